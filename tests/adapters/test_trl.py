"""TRL: BunshinToolEnv as GRPOTrainer's environment_factory, through TRL's own trainer on CPU.

A tiny randomly initialised Qwen2 with a character-level tokenizer and TRL's shipped
Qwen2.5 chat template stands in for the model; its ``generate`` is scripted (a tool call
on the first turn, then a final answer), so one real ``train()`` step runs TRL's tool
loop: ``reset(**row)``, the tool schemas from the env's methods, the tool calls, and
``get_reward`` as the reward source.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")

import torch  # noqa: E402
import trl  # noqa: E402
from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # noqa: E402
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM  # noqa: E402
from transformers.utils import get_json_schema  # noqa: E402

from bunshin.adapters.trl import BunshinToolEnv  # noqa: E402
from bunshin.errors import InvalidArgument, StateConflict  # noqa: E402

from .conftest import TASK  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.criu]
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
SPECIAL = ["<pad>", "<|im_start|>", "<|im_end|>", "<unk>"]
CALL = '<tool_call>\n{"name": "bash", "arguments": {"command": "cat setup.id; echo 0.5 > score"}}\n</tool_call>'


def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {t: i for i, t in enumerate(SPECIAL + [chr(c) for c in (9, 10, *range(32, 127))])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()  # characters join without spaces
    ptok = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>",
                                   unk_token="<unk>", additional_special_tokens=["<|im_start|>"])
    ptok.chat_template = (Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text()
    return ptok


class ScriptedLM(Qwen2ForCausalLM):
    """A real (tiny) model whose generation is a script: a bash call, then a final answer."""

    tok: PreTrainedTokenizerFast

    def generate(self, input_ids=None, attention_mask=None, **kw):  # type: ignore[override]
        outs = []
        for row, mask in zip(input_ids, attention_mask, strict=True):
            prompt = self.tok.decode(row[mask.bool()])
            text = "done" if "<tool_response>" in prompt else CALL
            outs.append(self.tok(text, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id])
        width = max(map(len, outs))
        pad = self.tok.pad_token_id
        tail = torch.tensor([o + [pad] * (width - len(o)) for o in outs], dtype=input_ids.dtype)
        return torch.cat([input_ids, tail], dim=1)


def model(tok: PreTrainedTokenizerFast) -> ScriptedLM:
    m = ScriptedLM(Qwen2Config(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=8192,
                               pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id))
    m.tok = tok
    return m


def test_tool_schemas_as_trl_builds_them():
    # what GRPOTrainer does with an instance: public functions of the class are the tools
    env = BunshinToolEnv()
    names = [n for n, _ in inspect.getmembers(type(env), predicate=inspect.isfunction)
             if n not in ("reset", "get_reward") and not n.startswith("_")]
    assert names == ["bash", "edit", "python", "read_file", "write_file"]
    schemas = {n: get_json_schema(getattr(env, n))["function"] for n in names}
    assert schemas["edit"]["parameters"]["required"] == ["path", "old_str", "new_str"]
    assert all(s["description"] and all(p.get("description") for p in s["parameters"]["properties"].values())
               for s in schemas.values())
    with pytest.raises(StateConflict, match="reset"):
        env.bash("ls")
    with pytest.raises(InvalidArgument, match="names no bunshin task"):
        env.reset(prompt="x")


def test_grpo_trainer_step_runs_the_tools_in_forks_of_one_root(home, tmp_path):
    tok = tokenizer()
    row = {"prompt": [{"role": "user", "content": "write the score"}], "task": json.dumps(TASK.model_dump(mode="json")),
           "instance_id": "trl-1"}
    ds = Dataset.from_list([row] * 4).map(lambda r: {"task": json.loads(r["task"])})
    args = trl.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                          max_completion_length=160, use_cpu=True, report_to=[], max_steps=1, save_strategy="no",
                          logging_steps=1)
    trainer = trl.GRPOTrainer(model=model(tok), args=args, train_dataset=ds, processing_class=tok,
                              environment_factory=BunshinToolEnv.factory(config=home))
    try:
        assert [t.__name__ for t in trainer.tools] == ["bash", "edit", "python", "read_file", "write_file"]
        trainer.train()
        logs = trainer.state.log_history[0]
        assert logs["rewards/BunshinToolEnv/mean"] == 0.5 and logs["tools/call_frequency"] > 0
        assert logs["tools/failure_frequency"] == 0
        pool = trainer._environment_pool[None]
        assert len(pool) == 4
        ids = {env.bash("cat setup.id").split()[0] for env in pool}
        assert len(ids) == 1  # four rollouts, one setup: each a fork of the instance's root
        assert all(env.get_reward() == 0.5 for env in pool)
        pool[0].reset(**{**row, "task": TASK.model_dump(mode="json")})  # TRL's reuse: a fresh fork of the root
        assert "score" not in pool[0].bash("ls") and pool[0].bash("cat setup.id").split()[0] in ids
    finally:
        BunshinToolEnv.close_instances()


CHILD = r"""
import json, sys
from bunshin.adapters.trl import BunshinToolEnv
from bunshin.adapters.trajectories import close_all
url, token, task = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
env = BunshinToolEnv.factory(url=url, token=token)()
assert env.reset(prompt=[{"role": "user", "content": "go"}], task=task, instance_id="trl-served") is None
setup_id = env.bash("cat setup.id; echo 1 > score").split()[0]
print(json.dumps({"id": setup_id, "reward": env.get_reward()}))
BunshinToolEnv.close_instances()
close_all()
"""


def test_rollouts_of_one_prompt_on_several_ranks_share_the_served_root(served):
    # TRL splits a prompt's G rollouts across processes (one per GPU): the server's group key joins them
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, served.url, served.token,
                               json.dumps(TASK.model_dump(mode="json"))],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-2000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    assert outs[0]["id"] == outs[1]["id"] and [o["reward"] for o in outs] == [1.0, 1.0]
    with served.client() as c:
        c.request("DELETE", "/v1/groups/trl-served")

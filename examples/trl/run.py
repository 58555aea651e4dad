"""One GRPO step of TRL on bunshin workspaces, on CPU (as root: `python examples/trl/run.py`).

``GRPOTrainer(environment_factory=BunshinToolEnv.factory())``: four rollouts of one prompt,
each ``reset(**row)`` to a fork of the task's root, the model's tool calls run in its
workspace, ``get_reward`` scores it. The "model" is a tiny random Qwen2 with a
character-level tokenizer whose ``generate`` is scripted (no weights to download):
each rollout first calls ``edit`` with its own fix, then answers. Pass ``--url`` (and
set BUNSHIN_TOKEN) to put the root on a ``bunshin serve`` host, as a multi-GPU run must.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import tempfile
from pathlib import Path

import torch
import trl
from datasets import Dataset
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from bunshin.adapters.trajectories import client, close_all
from bunshin.adapters.trl import BunshinToolEnv

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
TASK = {
    "id": "trl-example",
    "memory": "512M",
    "files": {"/work/calc.py": "def add(a, b):\n    return a - b\n"},
    "setup": ["cd /work && python3 -B -c 'import calc'"],  # -B: a stale .pyc would hide a same-size edit
    "tools": ["bash", "read_file", "edit"],
    "workdir": "/work",
    "prompt": "Fix calc.add.",
    "max_turns": 4,
    "reward": "cd /work && python3 -c \"import calc; print(float(calc.add(2, 3) == 5))\"",
}
FIXES = itertools.cycle(["a + b", "a * b", "b + a", "a - b"])


def tokenizer() -> PreTrainedTokenizerFast:
    special = ["<pad>", "<|im_start|>", "<|im_end|>", "<unk>"]
    vocab = {t: i for i, t in enumerate(special + [chr(c) for c in (9, 10, *range(32, 127))])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    ptok = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>",
                                   unk_token="<unk>", additional_special_tokens=["<|im_start|>"])
    ptok.chat_template = (Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text()
    return ptok


class ScriptedLM(Qwen2ForCausalLM):
    """A real tiny model; its generation is the scripted policy: an edit, then a final answer."""

    tok: PreTrainedTokenizerFast

    def generate(self, input_ids=None, attention_mask=None, **kw):
        outs = []
        for row, mask in zip(input_ids, attention_mask, strict=True):
            if "<tool_response>" in self.tok.decode(row[mask.bool()]):
                text = "fixed"
            else:
                args = {"path": "calc.py", "old_str": "return a - b", "new_str": f"return {next(FIXES)}"}
                text = f'<tool_call>\n{json.dumps({"name": "edit", "arguments": args})}\n</tool_call>'
            outs.append(self.tok(text, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id])
        width = max(map(len, outs))
        tail = [o + [self.tok.pad_token_id] * (width - len(o)) for o in outs]
        return torch.cat([input_ids, torch.tensor(tail, dtype=input_ids.dtype)], dim=1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", help="a bunshin serve host (default: fork in this process)")
    url = ap.parse_args().url
    tok = tokenizer()
    model = ScriptedLM(Qwen2Config(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=8192,
                                   pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id))
    model.tok = tok
    rows = [{"prompt": [{"role": "user", "content": TASK["prompt"]}], "task": json.dumps(TASK),
             "instance_id": "trl-calc"}] * 4
    ds = Dataset.from_list(rows).map(lambda r: {"task": json.loads(r["task"])})
    with tempfile.TemporaryDirectory() as out:
        args = trl.GRPOConfig(output_dir=out, per_device_train_batch_size=4, num_generations=4, max_steps=1,
                              max_completion_length=160, use_cpu=True, report_to=[], save_strategy="no",
                              logging_steps=1)
        envs: list[BunshinToolEnv] = []  # TRL's pool: it makes them with the factory and reuses them

        def factory() -> BunshinToolEnv:
            envs.append(BunshinToolEnv(url=url))
            return envs[-1]

        trainer = trl.GRPOTrainer(model=model, args=args, train_dataset=ds, processing_class=tok,
                                  environment_factory=factory)
        try:
            trainer.train()
            rewards = [env.get_reward() for env in envs]
        finally:
            BunshinToolEnv.close_instances()
            if url:  # the group's root stays on the host for later groups until removed
                client(url).request("DELETE", "/v1/groups/trl-calc")
            close_all()
    logs = trainer.state.log_history[0]
    print(f"rewards per rollout: {rewards}; TRL's mean reward {logs['rewards/BunshinToolEnv/mean']}, "
          f"tool calls per rollout {logs['tools/call_frequency']}")
    assert sorted(rewards) == [0.0, 0.0, 1.0, 1.0]


if __name__ == "__main__":
    main()

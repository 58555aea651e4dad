"""verl: the ``bunshin_agent`` agent loop and ``BunshinTool``, run for real on bunshin workspaces.

verl itself is not installed here (its pins would downgrade transformers and tensordict under
TRL's tests; see tests/adapters/verl_interface/README.md): without it the test imports the
stand-in of verl 0.9.1's interface in verl_interface/ (same module paths, classes, fields and
signatures), with it the real package. verl's worker is played as its source does it: the
agent loop looked up in the registry by name and built per sample with the worker's keyword
arguments, ``run(sampling_params, **non_tensor_batch_row)``; a scripted ``server_manager``
(a bash call, then a final answer) and a character-level tokenizer stand in for the LLM.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

if importlib.util.find_spec("verl") is None:
    sys.path.insert(0, str(Path(__file__).with_name("verl_interface")))

from omegaconf import OmegaConf  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402
from verl.experimental.agent_loop import agent_loop as verl_loop  # noqa: E402

from bunshin.adapters import verl as adapter  # noqa: E402
from bunshin.errors import InvalidArgument, NotFound, StateConflict  # noqa: E402

from .conftest import TASK  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.criu]
SPECIAL = ["<pad>", "<|im_start|>", "<|im_end|>", "<unk>"]
CALL = '<tool_call>\n{"name": "bash", "arguments": {"command": "cat setup.id; echo 0.5 > score"}}\n</tool_call>'
TEMPLATE = (
    "{% if tools %}<|im_start|>system\ntools: {{ tools | map(attribute='function.name') | join(',') }}<|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ 'user' if m.role == 'tool' else m.role }}\n"
    "{% if m.role == 'tool' %}<tool_response>\n{{ m.content }}\n</tool_response>{% else %}{{ m.content }}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {t: i for i, t in enumerate(SPECIAL + [chr(c) for c in (9, 10, *range(32, 127))])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    ptok = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>",
                                   unk_token="<unk>", additional_special_tokens=["<|im_start|>"])
    ptok.chat_template = TEMPLATE
    return ptok


@dataclass
class Generated:
    """What verl's ``server_manager.generate`` returns (TokenOutput's fields the loop reads)."""

    token_ids: list[int]
    log_probs: list[float] | None = None


@dataclass
class ScriptedServer:
    """The LLM: a bash call until a tool response is in the prompt, then a final answer."""

    tok: PreTrainedTokenizerFast
    call: str = CALL
    prompts: list[str] = field(default_factory=list)

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any],
                       **kw: Any) -> Generated:
        prompt = self.tok.decode(prompt_ids)
        self.prompts.append(prompt)
        text = "done" if "<tool_response>" in prompt else self.call
        ids = self.tok(text, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
        return Generated(ids, [-0.5] * len(ids))


def trainer_config(n: int) -> Any:
    return OmegaConf.create({"actor_rollout_ref": {"rollout": {"n": n, "response_length": 600, "prompt_length": 512}},
                             "data": {"apply_chat_template_kwargs": {}}})


def agent_loop(server: ScriptedServer, n: int, **options: Any) -> Any:
    """As verl's AgentLoopWorker builds one per sample: the registry's target, the worker's kwargs."""
    target = verl_loop._agent_loop_registry[adapter.AGENT_NAME]["_target_"]
    module, _, name = target.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    cfg = trainer_config(n)
    return cls(trainer_config=verl_loop.DictConfigWrap(cfg), server_manager=server, tokenizer=server.tok,
               processor=None, dataset_cls=None, data_config=verl_loop.DictConfigWrap(cfg.data), **options)


def sample(uid: str, task: Any = None) -> dict[str, Any]:
    task = TASK.model_dump(mode="json") if task is None else task
    return {"raw_prompt": [{"role": "user", "content": "write the score"}], "uid": uid, "agent_name": "bunshin_agent",
            "extra_info": {"task": task}, "index": 0}


def observed(tok: PreTrainedTokenizerFast, out: Any) -> str:
    """The tool-response tokens of an output (``response_mask`` 0), decoded."""
    return tok.decode([t for t, m in zip(out.response_ids, out.response_mask, strict=True) if m == 0])


def setup_id(text: str) -> str:
    return text.split("<tool_response>\n", 1)[1].split()[0]


async def run_batch(server: ScriptedServer, uids: list[str], n: int, **options: Any) -> list[Any]:
    params = {"temperature": 1.0, "top_p": 1.0, "logprobs": True}
    return await asyncio.gather(*[agent_loop(server, n, **options).run(dict(params), **sample(u)) for u in uids])


def test_agent_loop_forks_each_uid_from_one_root(home):
    server = ScriptedServer(tokenizer())
    outs = asyncio.run(run_batch(server, ["uid-a"] * 3 + ["uid-b"] * 3, 3, config=home))
    tok = server.tok
    assert [o.reward_score for o in outs] == [0.5] * 6
    for o in outs:
        assert set(o.response_mask) == {0, 1} and len(o.response_logprobs) == len(o.response_ids)
        assert tok.decode(o.prompt_ids).startswith("<|im_start|>system\ntools: bash,read_file,write_file")
        assert o.extra_fields["tool_calls"] == 1 and o.extra_fields["reward_error"] is None
        generated = [t for t, m in zip(o.response_ids, o.response_mask, strict=True) if m]
        assert tok.decode(generated, skip_special_tokens=True) == CALL + "done"  # the model's tokens, masked 1
    ids = [setup_id(observed(tok, o)) for o in outs]
    assert len(set(ids[:3])) == 1 and len(set(ids[3:])) == 1  # one setup per uid: its samples are forks
    assert ids[0] != ids[3]  # another uid, another root
    assert {o.extra_fields["bunshin_group"] for o in outs} == {"uid-a", "uid-b"}
    assert adapter.ROOTS.keys() == []  # each uid's root freed with its last sample


def test_agent_loop_refuses_bad_samples_and_reports_bad_calls(home, tmp_path):
    server = ScriptedServer(tokenizer())
    params = {"temperature": 1.0}

    async def run(**row: Any) -> Any:  # verl builds and runs its agent loops inside its event loop
        return await agent_loop(server, 1, config=home).run(dict(params), **row)

    with pytest.raises(InvalidArgument, match="names no bunshin task"):
        asyncio.run(run(raw_prompt=[], uid="u", extra_info={}))
    canary = tmp_path / "canary"
    canary.write_text("host secret")
    evil = {**TASK.model_dump(mode="json"), "mounts": [{"host": str(tmp_path), "path": "/mnt"}]}
    with pytest.raises(InvalidArgument, match="may not share host folders"):
        asyncio.run(run(**sample("u-evil", evil)))
    evil_image = {**TASK.model_dump(mode="json"), "image": str(tmp_path)}
    with pytest.raises(InvalidArgument, match="not a host folder"):
        asyncio.run(run(**sample("u-evil2", evil_image)))
    # verl's batch holds raw_prompt in a numpy object array (2-D when the chats have one length)
    row = {**sample("u-np"), "raw_prompt": np.array([[{"role": "user", "content": "write the score"}]],
                                                    dtype=object)[0]}
    assert asyncio.run(run(**row)).reward_score == 0.5
    bad = ScriptedServer(server.tok, call="<tool_call>{not json</tool_call>")
    (out,) = asyncio.run(run_batch(bad, ["u-bad"], 1, config=home))
    assert "is not JSON" in observed(bad.tok, out) and out.reward_score == 0.0
    assert adapter.ROOTS.keys() == []


@dataclass
class AgentData:
    """What verl's tool loop passes as ``agent_data`` (the field the tool reads)."""

    request_id: str


async def stock_call(tool: adapter.BunshinTool, request_id: str, args: dict[str, Any], create_kwargs: dict) -> str:
    """One call as verl's ToolAgentLoop._call_tool makes it: create, execute, release."""
    iid, _ = await tool.create(create_kwargs=create_kwargs)
    try:
        resp, reward, _ = await tool.execute(iid, args, agent_data=AgentData(request_id))
    finally:
        await tool.release(iid)
    assert reward == 0.0
    return str(resp.text)


def test_tool_keeps_a_workspace_per_request_across_stock_calls(home):
    tool = adapter.BunshinTool({"name": "bash", "bunshin_config": home}, None)
    assert tool.name == "bash" and tool.tool_schema.function.parameters.required == ["command"]
    kw = {"task": TASK.model_dump(mode="json"), "instance_id": "verl-tool"}

    async def main() -> tuple[list[str], list[float]]:
        outs = [await stock_call(tool, "req-1", {"command": "cat setup.id; echo 1 > score; echo a > mine"}, kw),
                await stock_call(tool, "req-2", {"command": "cat setup.id; ls"}, kw),
                await stock_call(tool, "req-1", {"command": "cat mine"}, kw)]
        rewards = [await tool.calc_reward("x", agent_data=AgentData(r)) for r in ("req-1", "req-2")]
        return outs, rewards

    try:
        outs, rewards = asyncio.run(main())
        assert outs[0].split()[0] == outs[1].split()[0]  # two requests, one setup: forks of one root
        assert "mine" not in outs[1] and outs[2].startswith("a")  # state per request, across calls
        assert rewards == [1.0, 0.0]
        assert sorted(tool.open_requests()) == ["req-1", "req-2"]
        asyncio.run(tool.finish("req-1"))
        assert tool.open_requests() == ["req-2"]
        with pytest.raises(StateConflict, match="no workspace"):
            asyncio.run(tool.calc_reward("x", agent_data=AgentData("req-1")))
        with pytest.raises(StateConflict, match="before create"):
            asyncio.run(tool.execute("never-created", {"command": "ls"}, agent_data=AgentData("req-9")))
        with pytest.raises(InvalidArgument, match="names no bunshin task"):
            asyncio.run(stock_call(tool, "req-3", {"command": "ls"}, {}))
    finally:
        tool.close_all()
    with pytest.raises(InvalidArgument, match="unknown bunshin tool"):
        adapter.BunshinTool({"name": "rm_rf"}, None)


CHILD = r"""
import asyncio, json, sys
from tests.adapters.test_verl import ScriptedServer, observed, run_batch, setup_id, tokenizer
from bunshin.adapters.trajectories import close_all
url, token, n, k = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
server = ScriptedServer(tokenizer())
outs = asyncio.run(run_batch(server, ["uid-served"] * k, n, url=url, token=token))
print(json.dumps({"ids": [setup_id(observed(server.tok, o)) for o in outs], "rewards": [o.reward_score for o in outs]}))
close_all()
"""


def test_samples_of_one_uid_on_two_workers_share_the_served_root(served):
    # verl may put the n samples of a uid on different AgentLoopWorkers: the server's group key joins them
    root = str(Path(__file__).parents[2])
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, served.url, served.token, "2", "1"], cwd=root,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-2000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    assert outs[0]["ids"] == outs[1]["ids"] and [o["rewards"] for o in outs] == [[0.5], [0.5]]
    with served.client() as c:
        assert c.request("GET", "/v1/groups/uid-served").status_code == 200  # neither worker saw all n
        c.request("DELETE", "/v1/groups/uid-served")
        # both samples in one worker: the worker removes the group with its last sample
        p = subprocess.run([sys.executable, "-c", CHILD, served.url, served.token, "2", "2"], cwd=root,
                           capture_output=True, text=True, timeout=240)
        assert p.returncode == 0, p.stderr[-2000:]
        one = json.loads(p.stdout.strip().splitlines()[-1])
        assert len(set(one["ids"])) == 1 and one["rewards"] == [0.5, 0.5]
        with pytest.raises(NotFound, match="no group .uid-served."):
            c.request("GET", "/v1/groups/uid-served")


def test_verls_own_tool_call_path_keeps_the_request_workspace(home):
    # verl's ToolAgentLoop._call_tool itself (create, execute with agent_data, release per call);
    # only where verl is installed: the interface stand-in has no tool loop
    tal = pytest.importorskip("verl.experimental.agent_loop.tool_agent_loop",
                              reason="needs verl itself (see tests/adapters/verl_interface/README.md)")
    from verl.experimental.agent_loop.tool_parser import FunctionCall

    tool = adapter.BunshinTool({"name": "bash", "bunshin_config": home}, None)
    kw = {"bash": {"create_kwargs": {"task": TASK.model_dump(mode="json"), "instance_id": "verl-own"}}}
    loop = SimpleNamespace(tools={"bash": tool}, max_tool_response_length=4096, tool_response_truncate_side="middle")
    data = tal.AgentData(messages=[], image_data=None, video_data=None, audio_data=None, mm_processor_kwargs=None,
                         metrics={}, request_id="req-own", tools_kwargs=kw)

    async def main() -> list[Any]:
        calls = [FunctionCall(name="bash", arguments=json.dumps({"command": "echo 1 > score; echo wrote"})),
                 FunctionCall(name="bash", arguments=json.dumps({"command": "cat score"}))]
        return [await tal.ToolAgentLoop._call_tool(loop, c, kw, data) for c in calls]

    try:
        (first, _, _), (second, _, _) = asyncio.run(main())
        assert first.text.startswith("wrote") and second.text.startswith("1")  # one workspace across the calls
        assert asyncio.run(tool.calc_reward("any", agent_data=data)) == 1.0
        assert tool.open_requests() == ["req-own"]
    finally:
        tool.close_all()

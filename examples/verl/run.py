"""A verl GRPO group on bunshin: the ``bunshin_agent`` loop, a scripted LLM (as root: `python examples/verl/run.py`).

What verl's AgentLoopWorker does for one prompt with ``rollout.n=4``: four samples under one
``uid``, each its own agent-loop instance (looked up by name in verl's registry), run
concurrently on the worker's event loop. The four fork from one root (the task's setup, a slow
CPU-bound `pip`-like step here, runs once) and the root is freed with the fourth. The LLM is scripted
(an edit, then a final answer) and the tokenizer is character-level. verl is not installed
here (see README, verl section): without it the example uses the stand-in of its interface in
tests/adapters/verl_interface. ``--url`` (and BUNSHIN_TOKEN) shares the root across worker
processes through a ``bunshin serve`` host.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Any

if importlib.util.find_spec("verl") is None:
    sys.path.insert(0, str(Path(__file__).parents[2] / "tests" / "adapters" / "verl_interface"))

from omegaconf import OmegaConf  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402
from verl.experimental.agent_loop import agent_loop as verl_loop  # noqa: E402

import bunshin.adapters.verl  # noqa: E402, F401  (registers "bunshin_agent")
from bunshin.adapters.trajectories import close_all  # noqa: E402

TASK = {
    "id": "verl-example",
    "memory": "512M",
    "files": {"/work/calc.py": "def add(a, b):\n    return a - b\n"},
    # the slow part (CPU-bound, as a pip install's build is), run once per uid
    "setup": ["python3 -c 'import hashlib\nfor _ in range(1_500_000): hashlib.sha256(b\"x\" * 1000).digest()' "
              "&& echo 'deps installed' > /work/deps.log"],
    "tools": ["bash", "edit"],
    "workdir": "/work",
    "prompt": "Fix calc.add.",
    "max_turns": 4,
    "reward": "cd /work && python3 -c \"import calc; print(float(calc.add(2, 3) == 5))\"",
}
FIXES = ["a + b", "a * b", "b + a", "a - b"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ 'user' if m.role == 'tool' else m.role }}\n{{ m.content }}"
            "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tokenizer() -> PreTrainedTokenizerFast:
    special = ["<pad>", "<|im_start|>", "<|im_end|>", "<unk>"]
    vocab = {t: i for i, t in enumerate(special + [chr(c) for c in (9, 10, *range(32, 127))])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    out = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>", unk_token="<unk>",
                                  additional_special_tokens=["<|im_start|>"])
    out.chat_template = TEMPLATE
    return out


class ScriptedLLM:
    """verl's server_manager: per request, an edit with this sample's fix, then a final answer."""

    def __init__(self, tok: PreTrainedTokenizerFast, fix: str) -> None:
        self.tok, self.fix = tok, fix

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any],
                       **kw: Any) -> Any:
        prompt = self.tok.decode(prompt_ids)
        call = {"name": "edit", "arguments": {"path": "calc.py", "old_str": "return a - b",
                                              "new_str": f"return {self.fix}"}}
        text = "fixed" if prompt.count("<|im_start|>assistant") > 1 else f"<tool_call>{json.dumps(call)}</tool_call>"
        ids = self.tok(text, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
        return type("TokenOutput", (), {"token_ids": ids, "log_probs": None})()


async def group(url: str | None, mode: str) -> list[Any]:
    tok = tokenizer()
    cfg = OmegaConf.create({"actor_rollout_ref": {"rollout": {"n": len(FIXES), "response_length": 2048}},
                            "data": {"apply_chat_template_kwargs": {}}})
    target = verl_loop._agent_loop_registry["bunshin_agent"]["_target_"]  # noqa: SLF001 (as verl's worker reads it)
    module, _, name = target.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    row = {"raw_prompt": [{"role": "user", "content": TASK["prompt"]}], "uid": "verl-calc-step1",
           "extra_info": {"task": TASK}}
    loops = [cls(trainer_config=verl_loop.DictConfigWrap(cfg), server_manager=ScriptedLLM(tok, fix), tokenizer=tok,
                 processor=None, dataset_cls=None, data_config=verl_loop.DictConfigWrap(cfg.data), url=url,
                 mode=mode)
             for fix in FIXES]
    return await asyncio.gather(*(loop.run({"temperature": 1.0}, **row) for loop in loops))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", help="a bunshin serve host (default: fork in this worker)")
    ap.add_argument("--mode", default="bunshin", choices=["bunshin", "baseline"],
                    help="baseline: a fresh workspace and setup per sample")
    args = ap.parse_args()
    t0 = time.perf_counter()
    try:
        outs = asyncio.run(group(args.url, args.mode))
    finally:
        close_all()
    for fix, o in zip(FIXES, outs, strict=True):
        print(f"return {fix:<6} reward {o.reward_score}  response tokens {len(o.response_ids)} "
              f"(tool tokens {o.response_mask.count(0)})")
    once = "run once" if args.mode == "bunshin" else "run per sample"
    print(f"group of {len(FIXES)} in {time.perf_counter() - t0:.1f} s ({args.mode}; setup ~1.3 s of CPU, {once})")
    assert [o.reward_score for o in outs] == [1.0, 0.0, 1.0, 0.0]


if __name__ == "__main__":
    main()

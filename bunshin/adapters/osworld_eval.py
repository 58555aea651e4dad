"""OSWorld task evaluators on a bunshin desktop: getters (what to read from the
workspace) and metrics (how to score it), for the task JSON's ``evaluator`` block::

    "evaluator": {"func": "exact_match",
                  "result": {"type": "vm_file", "path": "/root/out.txt"},
                  "expected": {"type": "rule", "rules": {"expected": "hello\\n"}}}

``func``/``result``/``expected`` may be lists (scored together under ``conj``: ``and``,
the default, or ``or``). Getters: ``vm_file`` (``path``), ``vm_command_line``
(``command``, ``shell``: its stdout), ``vm_command_error`` (its stderr),
``vm_screen_size``, ``list_directory`` (``path``: the names in it), ``rule`` (``rules``
as given). Metrics: ``exact_match``, ``check_include_exclude``, ``match_in_list``,
``compare_text_file``, ``is_in_list``, ``infeasible`` (1 when the agent's last action was
``FAIL``). Anything else is refused by name. Written from the task format's facts.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import InvalidArgument
from ..workspace.desktop import Desktop

GETTERS = ("vm_file", "vm_command_line", "vm_command_error", "vm_screen_size", "list_directory", "rule")


def get(desk: Desktop, spec: Mapping[str, Any]) -> Any:
    """What one ``result``/``expected`` block names, read from the workspace."""
    kind = spec.get("type")
    ws = desk.ws
    if kind == "rule":
        return spec.get("rules", {})
    if kind == "vm_file":
        r = ws.exec(["cat", str(spec.get("path", ""))])
        return r.stdout if r.exit_code == 0 else None  # a missing file scores 0, as in OSWorld
    if kind in ("vm_command_line", "vm_command_error"):
        cmd = spec.get("command", "")
        if isinstance(cmd, str):
            argv = ["sh", "-c", cmd]
        elif spec.get("shell"):
            argv = ["sh", "-c", " ".join(shlex.quote(str(a)) for a in cmd)]
        else:
            argv = [str(a) for a in cmd]
        r = ws.exec(argv, env=desk.spec.env, timeout=120)
        return r.stdout if kind == "vm_command_line" else r.stderr
    if kind == "vm_screen_size":
        return {"width": desk.spec.width, "height": desk.spec.height}
    if kind == "list_directory":
        return sorted(e.name for e in ws.files.list(str(spec.get("path", "/"))))
    raise InvalidArgument(f"evaluator getter {kind!r} is not supported here", hint=f"one of {', '.join(GETTERS)}")


def _exact_match(result: Any, rules: Any) -> float:
    return float(result == rules.get("expected"))


def _check_include_exclude(result: Any, rules: Any) -> float:
    if result is None:
        return 0.0
    text = str(result)
    inc = all(s in text for s in rules.get("include", []))
    exc = not any(s in text for s in rules.get("exclude", []))
    return float(inc and exc)


def _match_in_list(result: Any, rules: Any) -> float:
    return float(result in rules.get("expected", []))


def _is_in_list(result: Any, rules: Any) -> float:
    return float(isinstance(result, list) and rules.get("expected") in result)


def _compare_text_file(result: Any, expected: Any) -> float:
    if result is None or expected is None:
        return 0.0
    return float(str(result).rstrip("\n") == str(expected).rstrip("\n"))


METRICS: dict[str, Callable[[Any, Any], float]] = {
    "exact_match": _exact_match, "check_include_exclude": _check_include_exclude,
    "match_in_list": _match_in_list, "is_in_list": _is_in_list, "compare_text_file": _compare_text_file,
}


def check(evaluator: Mapping[str, Any]) -> None:
    """Refuse, before a task runs, an evaluator this module cannot score."""
    funcs = evaluator.get("func")
    for f in funcs if isinstance(funcs, list) else [funcs]:
        if f != "infeasible" and f not in METRICS:
            raise InvalidArgument(f"evaluator func {f!r} is not supported here",
                                  hint=f"one of infeasible, {', '.join(METRICS)}")
    for key in ("result", "expected"):
        blocks = evaluator.get(key)
        for b in blocks if isinstance(blocks, list) else ([blocks] if blocks else []):
            if not isinstance(b, Mapping) or b.get("type") not in GETTERS:
                raise InvalidArgument(f"evaluator {key} {b!r}: its type is not supported here",
                                      hint=f"one of {', '.join(GETTERS)}")


def evaluate(desk: Desktop, evaluator: Mapping[str, Any], last_action: str | None) -> float:
    """The task's score in [0, 1] in the workspace as it is now."""
    check(evaluator)
    funcs = evaluator["func"]
    if funcs == "infeasible":
        return float(last_action == "FAIL")
    if last_action == "FAIL":  # a feasible task the agent gave up on
        return 0.0
    as_list = isinstance(funcs, list)
    funcs = funcs if as_list else [funcs]
    results: list[Any] = (evaluator.get("result") or []) if as_list else [evaluator.get("result")]
    expected: list[Any] = (evaluator.get("expected") or []) if as_list else [evaluator.get("expected")]
    scores = []
    for i, f in enumerate(funcs):
        r = get(desk, results[i]) if i < len(results) and results[i] else None
        e = get(desk, expected[i]) if i < len(expected) and expected[i] else {}
        scores.append(METRICS[f](r, e))
    return max(scores) if evaluator.get("conj") == "or" else min(scores)

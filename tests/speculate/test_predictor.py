"""The frequency predictor, on its own."""

from __future__ import annotations

from bunshin.speculate import ChildStat, FrequencyPredictor, PredictContext, Predictor
from bunshin.tools import ToolCall


def c(name: str, arg: str = "") -> ToolCall:
    return ToolCall(name, {"a": arg}, key=f"{name}:{arg}")


def keys(cands):
    return [x.call.key for x in cands]


def test_children_rank_by_siblings_now_then_earlier_iterations():
    p = FrequencyPredictor()
    assert isinstance(p, Predictor)
    ctx = PredictContext(history=(), children=(
        ChildStat(c("bash", "a"), taken_now=0, taken_before=9),
        ChildStat(c("bash", "b"), taken_now=2, taken_before=0),
        ChildStat(c("bash", "c"), taken_now=2, taken_before=1),
    ))
    assert keys(p.predict(ctx, 3)) == ["bash:c", "bash:b", "bash:a"]


def test_follow_ups_of_the_same_call_then_of_the_same_tool():
    p = FrequencyPredictor()
    edit1, edit2, edit3 = c("edit", "1"), c("edit", "2"), c("edit", "3")
    test, lint = c("bash", "pytest"), c("bash", "ruff")
    for e in (edit1, edit2, edit1, edit2):
        p.observe(None, e, 0.01)
        p.observe(e, test, 1.5)
    p.observe(edit1, lint, 0.3)
    p.observe(edit1, lint, 0.3)
    p.observe(edit1, lint, 0.3)
    # after edit1 itself: lint (3 times) before test (twice)
    assert keys(p.predict(PredictContext((edit1,), ()), 2))[:2] == ["bash:ruff", "bash:pytest"]
    # after edit2: only what followed edit2 (no back-off to the tool for a known call)
    assert keys(p.predict(PredictContext((edit2,), ()), 2)) == ["bash:pytest"]
    # after a new edit nobody made before (observed once: just now): what follows edits in general
    p.observe(test, edit3, 0.01)
    ranked = p.predict(PredictContext((edit3,), ()), 2)
    assert keys(ranked)[:2] == ["bash:pytest", "bash:ruff"]
    # a known call that nothing ever followed predicts nothing
    final = c("bash", "final")
    p.observe(test, final, 0.1)
    p.observe(test, final, 0.1)
    assert p.predict(PredictContext((final,), ()), 2) == []
    assert abs(ranked[0].expected_s - 1.5) < 1e-9
    # the tree's children come first
    ctx = PredictContext((edit3,), (ChildStat(c("bash", "ls"), 1, 0),))
    assert keys(p.predict(ctx, 1))[0] == "bash:ls"


def test_new_iteration_moves_counts_to_earlier():
    p = FrequencyPredictor()
    a, b = c("bash", "a"), c("bash", "b")
    for _ in range(3):
        p.observe(None, a, 0.1)
    p.new_iteration()
    p.observe(None, b, 0.1)
    # b was taken in this iteration, a only before: siblings now win
    assert keys(p.predict(PredictContext((), ()), 2))[:2] == ["bash:b", "bash:a"]


def test_no_follow_ups_when_disabled():
    p = FrequencyPredictor(follow_ups=False)
    p.observe(None, c("bash", "x"), 0.1)
    assert p.predict(PredictContext((), ()), 2) == []

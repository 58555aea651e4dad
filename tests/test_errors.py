"""The error tree: drawn in ``bunshin/errors.py``'s docstring, and every error survives the wire."""

from __future__ import annotations

import builtins
import re

import pytest

from bunshin import errors
from bunshin.errors import BunshinError, error_class

ALL = [BunshinError, *errors._all_subclasses(BunshinError)]
_LINE = re.compile(r"^(?P<indent>[ │├└─]*?)(?P<name>[A-Z]\w+)(?: \((?P<builtin>\w+)\))?(?:\s+(?P<status>\d{3}))?(?:\s.*)?$")


def _drawn_tree() -> dict[str, tuple[str | None, str | None, int | None]]:
    """``name -> (parent, built-in base, status)`` as the docstring draws them."""
    doc = errors.__doc__ or ""
    block = doc.split("::", 1)[1].strip("\n").split("\n\n", 1)[0]
    drawn: dict[str, tuple[str | None, str | None, int | None]] = {}
    stack: list[str] = []
    for line in block.splitlines():
        m = _LINE.match(line.strip("\n")[4:] if line.startswith("    ") else line)
        assert m, f"cannot read the tree line {line!r}"
        depth = len(m["indent"]) // 4
        del stack[depth:]
        drawn[m["name"]] = (stack[-1] if stack else None, m["builtin"], int(m["status"]) if m["status"] else None)
        stack.append(m["name"])
    return drawn


def test_the_docstring_draws_the_whole_tree() -> None:
    drawn = _drawn_tree()
    assert set(drawn) == {c.__name__ for c in ALL}
    for cls in ALL:
        parent, builtin, status = drawn[cls.__name__]
        bunshin_bases = [b for b in cls.__bases__ if issubclass(b, BunshinError)]
        other_bases = [b.__name__ for b in cls.__bases__ if not issubclass(b, BunshinError)]
        if cls is BunshinError:
            assert parent is None
            continue
        assert [b.__name__ for b in bunshin_bases] == [parent], cls
        assert other_bases == ([builtin] if builtin else []), cls
        if builtin:
            assert isinstance(getattr(builtins, builtin), type) and issubclass(cls, getattr(builtins, builtin))
        assert cls.http_status == (status if status is not None else bunshin_bases[0].http_status), cls


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
def test_every_error_has_its_own_code_and_survives_the_wire(cls: type[BunshinError]) -> None:
    assert cls.code and re.fullmatch(r"[a-z_]+", cls.code)
    assert cls is BunshinError or "code" in vars(cls), f"{cls.__name__} reuses its parent's code"
    assert 400 <= cls.http_status < 600
    assert error_class(cls.code) is cls
    err = cls("it broke", hint="do this", path="/x")
    back = BunshinError.from_dict(err.to_dict())
    assert type(back) is cls
    assert (back.message, back.hint, back.details) == ("it broke", "do this", err.details)
    assert str(back) == str(err) and "do this" in str(back)


def test_an_unknown_code_is_a_plain_bunshin_error() -> None:
    assert error_class("no_such_code") is BunshinError
    assert type(BunshinError.from_dict({"code": "no_such_code", "message": "m"})) is BunshinError

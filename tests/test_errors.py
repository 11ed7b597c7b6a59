"""The error tree drawn in ``bmoe/errors.py``'s docstring is the real one: every ``BmoeError``
subclass appears in it, under its actual parent."""

from __future__ import annotations

import re

import pytest

import bmoe.errors as errors

pytestmark = pytest.mark.pure  # no model, no llama.cpp: `pytest -m pure` runs these in seconds


def drawn_tree() -> dict[str, str | None]:
    """class name -> parent name, from the ``+--`` drawing (indent gives the depth)."""
    parents: dict[str, str | None] = {}
    stack: list[tuple[int, str]] = []
    for line in (errors.__doc__ or "").splitlines():
        m = re.match(r"^(\s*(?:\|\s*)*)(?:\+-- )?([A-Z]\w*(?:Error|Cancelled))\b", line)
        if not m:
            continue
        depth = m.start(2)
        while stack and stack[-1][0] >= depth:
            stack.pop()
        parents[m.group(2)] = stack[-1][1] if stack else None
        stack.append((depth, m.group(2)))
    return parents


def test_every_error_class_is_drawn_under_its_parent() -> None:
    drawn = drawn_tree()
    real = {
        name: obj for name, obj in vars(errors).items()
        if isinstance(obj, type) and issubclass(obj, errors.BmoeError)
    }
    assert set(drawn) == set(real), "drawn and defined error classes differ"
    for name, cls in real.items():
        expected = None if cls is errors.BmoeError else cls.__base__.__name__
        assert drawn[name] == expected, f"{name} is drawn under {drawn[name]}, defined under {expected}"


def test_the_check_would_catch_a_missing_class(monkeypatch) -> None:  # noqa: ANN001
    class UndrawnError(errors.BmoeError):
        pass

    monkeypatch.setattr(errors, "UndrawnError", UndrawnError, raising=False)
    try:
        test_every_error_class_is_drawn_under_its_parent()
    except AssertionError:
        return
    raise AssertionError("an undrawn error class went unnoticed")

"""Argparse value types the command lines share (``bmoe`` and its subcommands, ``inspect`` and
``quality`` among them, which sit below ``bmoe.cli``): a bad value is refused by the parser, in one
line and with status 2, before any model is opened. ``nan``, ``inf`` and ``1e308`` used to reach a
run and end in a traceback or an internal error."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def plain(x: float) -> str:
    """A bound as typed, never in exponent form (``1048576``, not ``1.04858e+06``)."""
    return str(int(x)) if float(x).is_integer() else f"{x:f}".rstrip("0")


def checked(kind: type, ok: Callable[[float], bool], what: str, bounds: str = "") -> Callable[[str], int | float]:
    """A ``kind`` for which ``ok`` holds; refused as "expected WHAT, got TEXT" when it does not
    parse, with ``bounds`` added when it parses but ``ok`` refuses it."""

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except (ValueError, OverflowError):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"expected {what}{bounds}, got {text!r}")
        return value

    parse.__name__ = what  # argparse names the type in its messages
    return parse


def number(kind: type, lo: float, hi: float, what: str) -> Callable[[str], int | float]:
    """A finite ``kind`` in [lo, hi]."""
    return checked(kind, lambda v: math.isfinite(v) and lo <= v <= hi, what, f" from {plain(lo)} to {plain(hi)}")

"""Rounds: the configurations run interleaved (A B C A B C ...), so a change in the machine's
load between them spreads over every configuration instead of reading as a difference between
two of them; each figure is then the median of its rounds, with its spread beside it.

Pure arithmetic over the rounds' results: ``median_tree`` folds the results of one configuration
into one of the same shape (numbers: the median of the rounds that have them; anything else, the
first round's: tokens, texts, lists); ``spread`` is the largest less the smallest; ``flag_noisy``
marks a row whose spread is larger than the gap to the row nearest to it, whose order against
that row the rounds do not settle."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def median_of(values: Iterable[Any]) -> float | None:
    """The median of the numbers among ``values`` (None where a round has none), None if none."""
    nums = [v for v in values if _number(v)]
    return statistics.median(nums) if nums else None


def spread(values: Iterable[Any]) -> float | None:
    """Largest less smallest of the numbers among ``values``; None with fewer than two."""
    nums = [v for v in values if _number(v)]
    return max(nums) - min(nums) if len(nums) >= 2 else None


def median_tree(results: Sequence[Any]) -> Any:
    """One result of the shape of ``results[0]``: each number the median of that number across
    the results that have it, each dict folded key by key, anything else the first result's."""
    if not results:
        return None
    first = results[0]
    if len(results) == 1:
        return first
    if isinstance(first, Mapping):
        return {k: median_tree([r[k] for r in results if isinstance(r, Mapping) and k in r]) for k in first}
    if _number(first) or first is None:
        m = median_of(results)
        if m is None:
            return first
        return int(m) if all(isinstance(v, int) for v in results if _number(v)) and m == int(m) else m
    return first


def flag_noisy(rows: list[dict[str, Any]], col: str = "tok_s") -> None:
    """On each row with a spread of ``col``: ``noisy`` True when that spread is larger than the
    gap between its median and the nearest other row's (``noisy_vs``: that row's id), else False.
    Rows without a spread (one round, or not measured) get ``noisy`` None."""
    measured = [r for r in rows if r.get(col) is not None]
    for row in rows:
        row["noisy"], row["noisy_vs"] = None, None
        s = (row.get("spread") or {}).get(col)
        if s is None or row.get(col) is None:
            continue
        others = [r for r in measured if r is not row]
        if not others:
            row["noisy"] = False
            continue
        nearest = min(others, key=lambda r: abs(r[col] - row[col]))
        gap = abs(nearest[col] - row[col])
        row["noisy"] = s > gap
        if row["noisy"]:
            row["noisy_vs"] = nearest["id"]

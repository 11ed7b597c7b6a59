"""The read stage's scheduling, with no threads: real reads first, promotions, fair batches."""

from __future__ import annotations

import pytest

from bmoe.pipeline.events import ExpertKey, ReadRequest
from bmoe.stages.read import ReadQueue

pytestmark = pytest.mark.pure  # no model, no llama.cpp: `pytest -m pure` runs these in seconds


def job(layer: int, proj: int, expert: int, speculative: bool = False):  # noqa: ANN201 - a ReadJob
    """A read with a stand-in for its readiness future: the queue never touches the future."""
    return ReadRequest(ExpertKey(layer, proj, expert), 0, 0, 1, 0, speculative), object()


def keys(batch) -> list[tuple[int, int, int]]:  # noqa: ANN001
    return [tuple(request.key) for request, _ in batch]


def test_real_reads_go_before_speculative_ones() -> None:
    q = ReadQueue()
    q.put(job(1, 0, 5, speculative=True))
    q.put(job(0, 0, 1))
    assert keys(q.take()) == [(0, 0, 1)]
    assert keys(q.take()) == [(1, 0, 5)]
    assert not q and q.take() == []


def test_a_lane_takes_its_fair_share_of_one_layer_projection_run() -> None:
    q = ReadQueue()
    for e in range(4):
        q.put(job(0, 0, e))
    q.put(job(0, 1, 0))
    assert keys(q.take(idle=1)) == [(0, 0, 0), (0, 0, 1)], "half the run: one other lane is idle"
    assert keys(q.take(idle=0)) == [(0, 0, 2), (0, 0, 3)], "the rest of the run, not the next projection"
    assert keys(q.take(idle=3)) == [(0, 1, 0)], "a share rounds up: never an empty batch"


def test_a_speculative_batch_is_one_experts_queued_projections() -> None:
    q = ReadQueue()
    for p in (2, 0, 1):
        q.put(job(1, p, 5, speculative=True))
    q.put(job(1, 0, 6, speculative=True))
    assert keys(q.take(idle=2)) == [(1, 0, 5), (1, 1, 5), (1, 2, 5)]
    assert keys(q.take()) == [(1, 0, 6)]


def test_a_promotion_moves_a_queued_speculative_read_ahead_of_the_rest() -> None:
    q = ReadQueue()
    q.put(job(1, 0, 5, speculative=True))
    q.put(job(1, 1, 5, speculative=True))
    q.put(ExpertKey(1, 1, 5))
    q.put(ExpertKey(2, 0, 9))  # nothing queued for it: already read, or never speculated
    assert keys(q.take()) == [(1, 1, 5)]
    assert keys(q.take()) == [(1, 0, 5)]


def test_dropping_speculative_reads_leaves_the_real_ones() -> None:
    q = ReadQueue()
    q.put(job(1, 0, 5, speculative=True))
    q.put(job(0, 0, 1))
    assert keys(q.drop_speculative()) == [(1, 0, 5)]
    assert keys(q.take()) == [(0, 0, 1)] and not q


def test_a_newer_read_of_a_key_hands_back_the_queued_speculative_one() -> None:
    """An entry evicted while its read-ahead was queued, then admitted again: the old read must not
    run later into a slot whose pages may have moved on, so the queue gives it back to be dropped."""
    q = ReadQueue()
    old = job(1, 0, 5, speculative=True)
    assert q.put(old) is None
    new = job(1, 0, 5)
    assert q.put(new) is old
    assert keys(q.take()) == [(1, 0, 5)] and not q
    assert q.put(job(1, 0, 6)) is None, "a real read supersedes nothing queued"


def test_drain_empties_both_queues() -> None:
    q = ReadQueue()
    q.put(job(0, 0, 1))
    q.put(job(1, 0, 5, speculative=True))
    assert sorted(keys(q.drain())) == [(0, 0, 1), (1, 0, 5)]
    assert not q

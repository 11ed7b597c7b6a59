"""A route trace's decode replayed as B concurrent streams (``RouteTrace.batched``): what the step
scheduler's union of experts would read, on real routing and on a written trace."""

from __future__ import annotations

from pathlib import Path

import pytest

from bmoe.pipeline.trace import RouteTrace, TraceWriter, default_trace_path, read_trace

pytestmark = pytest.mark.pure
SHARED = default_trace_path()


def _decode(path: Path, tokens: list[list[int]]) -> RouteTrace:
    """A one-layer trace whose decoded token ``i`` routes to ``tokens[i]`` (a prompt row first)."""
    with TraceWriter(path, model="m", arch="a", n_layer=1, n_expert=8, n_expert_used=2,
                     expert_bytes={0: 100}, dense_bytes={0: 1}) as w:
        w.add(0, 0, 0, 0, [0, 1], [0.5, 0.5], [False, False])
        for i, experts in enumerate(tokens):
            w.add(0, 1, 1 + i, 0, experts, [0.5, 0.5], [False, False])
    return read_trace(path)


def test_each_step_holds_one_token_of_every_stream_and_routes_their_union(tmp_path: Path) -> None:
    t = _decode(tmp_path / "t.csv", [[1, 2], [3, 4], [1, 5], [6, 7], [2, 3]])  # 5 tokens: 2 streams of 2
    b = t.batched(2)
    assert b.tokens(1) == 2 and b.tokens(0) == 0  # one token left over, the prompt left out
    events = [e for e in b.layer_events() if e.phase == 1]
    assert [e.experts for e in events] == [(1, 2, 5), (3, 4, 6, 7)]  # tokens 0+2, then 1+3
    assert all(e.ends_call for e in events)
    assert t.batched(1).tokens(1) == 5


def test_too_many_streams_is_refused(tmp_path: Path) -> None:
    t = _decode(tmp_path / "t.csv", [[1, 2], [3, 4]])
    with pytest.raises(ValueError, match="fewer than 3 streams"):
        t.batched(3)
    with pytest.raises(ValueError, match="streams must be"):
        t.batched(0)


@pytest.mark.skipif(not SHARED.exists(), reason=f"shared trace not found at {SHARED}")
def test_real_routing_union_shares() -> None:
    """Issue 35's figures from the shared Qwen3-30B-A3B trace: 0.88 / 0.73 / 0.56 of the reads."""
    t = read_trace(SHARED)
    shares = []
    for n in (2, 4, 8):
        evs = [e for e in t.batched(n).layer_events() if e.phase == 1]
        shares.append(round(sum(len(e.experts) for e in evs) / (len(evs) * n * t.n_expert_used), 2))
    assert shares == [0.88, 0.73, 0.56]


def test_replay_streams_what_if(tmp_path: Path) -> None:
    """``bmoe replay --streams 2``: half the steps, each routing the union of two tokens."""
    import json

    from tests.helpers import cli

    path = tmp_path / "t.route.csv"
    _decode(path, [[1, 2], [3, 4], [1, 5], [6, 7]])
    one = cli("replay", path, "--cache-mb", "0", "--io", "sim", "--json")
    two = cli("replay", path, "--cache-mb", "0", "--io", "sim", "--json", "--streams", "2")
    assert one.returncode == 0 and two.returncode == 0, two.stderr
    r1, r2 = json.loads(one.stdout), json.loads(two.stdout)
    assert "--streams 2" in r2["how"]
    assert r1["results"][0]["bytes_read"] == 10 * 100  # the prompt's 2 experts and 4 tokens' 2
    assert r2["results"][0]["bytes_read"] == 7 * 100  # steps {1,2,5} and {3,4,6,7}: expert 1 read once
    bad = cli("replay", path, "--cache-mb", "0", "--io", "sim", "--streams", "8")
    assert bad.returncode == 1 and "fewer than 8 streams" in bad.stderr

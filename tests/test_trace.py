"""Route traces: the shared v1 file, the writer's round trip (v1 and v2), and malformed input."""

from __future__ import annotations

import csv
import io
from pathlib import Path

import numpy as np
import pytest

from bmoe.errors import BmoeError
from bmoe.pipeline.trace import (
    COLUMNS,
    RouteTrace,
    TraceFormatError,
    TraceWriter,
    default_trace_path,
    read_trace,
)

pytestmark = pytest.mark.pure  # no model, no llama.cpp: `pytest -m pure` runs these in seconds

SHARED = default_trace_path()
needs_shared = pytest.mark.skipif(not SHARED.exists(), reason=f"shared trace not found at {SHARED}")


@pytest.fixture(scope="module")
def shared() -> RouteTrace:
    return read_trace(SHARED)


@needs_shared
def test_shared_trace_header_and_shape(shared: RouteTrace) -> None:
    t = shared
    assert t.version == 1
    assert (t.model, t.arch) == ("Qwen3-30B-A3B-Q4_K_M.gguf", "qwen3moe")
    assert (t.n_layer, t.n_expert, t.n_expert_used) == (48, 128, 6)
    assert t.moe_layers == list(range(48))
    assert set(t.expert_bytes.values()) == {3059712, 2654208}
    assert t.expert_bytes[0] == 3059712 and t.expert_bytes[6] == 2654208
    assert t.dense_bytes[0] == 11953152 and t.dense_bytes[6] == 11682816
    assert len(t) == 44766
    assert set(np.unique(t.phase).tolist()) == {0, 1}
    assert t.tokens(0) == 28 and t.tokens(1) == 128
    assert np.array_equal(np.unique(t.step[t.phase == 1]), np.arange(28, 156))
    # llama.cpp computes only the output row at the last layer: one prefill token there.
    assert (t.phase == 0).sum() == 47 * 28 * 6 + 6
    assert t.weight.dtype == np.float32 and abs(float(t.weight[0]) - 0.221297) < 1e-6
    # a resident expert reads nothing (a prefill duplicate reads nothing either)
    assert not t.bytes_read[t.residency == 1].any()
    assert abs(100 * t.residency[t.phase == 1].mean() - 80.29) < 0.01


@needs_shared
def test_accesses_follow_execution_order(shared: RouteTrace) -> None:
    acc = list(shared.accesses())
    assert len(acc) == 47 * 28 + 1 + 128 * 48
    assert all(len(a.experts) == 6 for a in acc)
    # prefill ran layer by layer over the whole prompt, decode token by token
    assert [(a.step, a.layer) for a in acc[:3]] == [(0, 0), (1, 0), (2, 0)]
    first_decode = next(i for i, a in enumerate(acc) if a.phase == 1)
    assert [(a.step, a.layer) for a in acc[first_decode : first_decode + 2]] == [(28, 0), (28, 1)]
    assert acc[first_decode].experts == (60, 49, 78, 50, 106, 32)  # slot order


@needs_shared
def test_layer_events_are_what_the_engine_plans(shared: RouteTrace) -> None:
    ev = shared.layer_events()
    assert len(ev) == 48 + 128 * 48
    assert sum(e.ends_call for e in ev) == 1 + 128  # one prefill call, one call per token
    assert all(e.experts == tuple(sorted(set(e.experts))) for e in ev)
    pre = [e for e in ev if e.phase == 0]
    union0 = set(shared.expert[(shared.phase == 0) & (shared.layer == 0)].tolist())
    assert set(pre[0].experts) == union0 and len(union0) > 6
    fine = shared.layer_events(prefill="tokens", order="recorded")
    assert len(fine) == 47 * 28 + 1 + 128 * 48
    assert fine[-1].experts == (73, 105, 20, 57, 9, 126)
    small = shared.layer_events(ubatch=8)
    assert sum(e.ends_call for e in small) == 4 + 128  # 28 prompt tokens re-cut into calls of 8


def _write_sample(path: Path, version: int) -> None:
    eb = {0: 3000, 1: 2000}
    run = {"cache_bytes": 8000, "policy": "lru"} if version == 2 else None
    with TraceWriter(path, model="m.gguf", arch="qwen3moe", n_layer=2, n_expert=8, n_expert_used=2,
                     expert_bytes=eb, dense_bytes={0: 10, 1: 11}, version=version, run=run) as w:
        w.add(0, 0, 0, 0, [3, 5], [0.6, 0.4], [False, False])
        w.add(0, 0, 1, 0, [3, 1], [0.7, 0.3], [True, False])
        w.add(0, 0, 1, 1, [2, 7], [0.5, 0.5], [False, False])
        if version == 2:
            w.timing(0, 0, 1, 1, compute_us=1234.5, read_us=99.0)
        w.add(0, 1, 2, 0, [1, 3], [0.55, 0.45], [1, 1])
        w.add(0, 1, 2, 1, [7, 6], [0.8, 0.2], [1, 0])
        if version == 2:
            w.timing(0, 1, 2, 1, compute_us=800.0)
            w.summary(tokens=1, hit_pct=75.0)


@pytest.mark.parametrize("version", [1, 2])
def test_writer_round_trip(tmp_path: Path, version: int) -> None:
    path = tmp_path / f"t{version}.route.csv"
    _write_sample(path, version)
    t = read_trace(path)
    assert t.version == version
    assert (t.model, t.arch, t.n_layer, t.n_expert, t.n_expert_used) == ("m.gguf", "qwen3moe", 2, 8, 2)
    assert t.expert_bytes == {0: 3000, 1: 2000} and t.dense_bytes == {0: 10, 1: 11}
    assert t.expert.tolist() == [3, 5, 3, 1, 2, 7, 1, 3, 7, 6]
    assert t.slot.tolist() == [0, 1] * 5
    assert t.residency.tolist() == [0, 0, 1, 0, 0, 0, 1, 1, 1, 0]
    assert t.bytes_read.tolist() == [3000, 3000, 0, 3000, 2000, 2000, 0, 0, 0, 2000]
    assert np.allclose(t.weight, [0.6, 0.4, 0.7, 0.3, 0.5, 0.5, 0.55, 0.45, 0.8, 0.2])
    assert [a.experts for a in t.accesses()] == [(3, 5), (3, 1), (2, 7), (1, 3), (7, 6)]
    if version == 2:
        assert t.run == {"cache_bytes": "8000", "policy": "lru"}
        assert t.timing[(0, 0, 1, 1)] == {"compute_us": 1234.5, "read_us": 99.0}
        assert t.timing[(0, 1, 2, 1)] == {"compute_us": 800.0}
        assert t.summary == {"tokens": "1", "hit_pct": "75.0"}
    else:
        assert t.run == {} and t.timing == {} and t.summary == {}


def _naive_v1_rows(path: Path) -> list[list[str]]:
    """What a v1 reader does (BigMoeOnEdge's route-analyze.py): skip '#' lines, read the CSV."""
    lines = [ln for ln in path.read_text().splitlines() if ln and not ln.startswith("#")]
    rows = list(csv.reader(io.StringIO("\n".join(lines))))
    assert tuple(rows[0]) == COLUMNS
    return rows[1:]


def test_a_v1_reader_reads_v2_unchanged(tmp_path: Path) -> None:
    _write_sample(tmp_path / "a.csv", 1)
    _write_sample(tmp_path / "b.csv", 2)
    assert _naive_v1_rows(tmp_path / "a.csv") == _naive_v1_rows(tmp_path / "b.csv")
    v2 = (tmp_path / "b.csv").read_text().splitlines()
    assert v2[0] == "# route_trace v2" and any(ln.startswith("# timing ") for ln in v2)


def test_writer_refuses_v2_lines_in_v1(tmp_path: Path) -> None:
    with TraceWriter(tmp_path / "x.csv", model="m", arch="a", n_layer=1, n_expert=4, n_expert_used=1,
                     expert_bytes={0: 1}) as w:
        with pytest.raises(ValueError):
            w.timing(0, 1, 0, 0, compute_us=1.0)
        with pytest.raises(ValueError):
            w.add(0, 1, 0, 0, [1, 2], [1.0], [0])


GOOD_HEAD = [
    "# route_trace v1",
    "# model=m arch=a n_layer=2 n_expert=4 n_expert_used=2",
    "# layer=0 expert_bytes=100 dense_bytes=5",
    "# layer=1 expert_bytes=100 dense_bytes=5",
    ",".join(COLUMNS),
]


@pytest.mark.parametrize(
    ("lines", "line_no", "words"),
    [
        (["turn,phase"], 1, "route_trace v1"),
        (GOOD_HEAD[:1] + GOOD_HEAD[2:], 2, "model="),
        (GOOD_HEAD + ["0,1,0,0,0,3,0.5,0"], 6, "expected 9 fields"),
        (GOOD_HEAD + ["0,1,0,0,0,x,0.5,0,100"], 6, "expert='x'"),
        (GOOD_HEAD + ["0,1,0,0,0,3,0.5,0,100", "0,1,0,1,0,9,0.5,0,100"], 7, "expert out of range"),
        (GOOD_HEAD + ["0,2,0,0,0,3,0.5,0,100"], 6, "phase"),
        (GOOD_HEAD + ["0,1,0,0,0,3.5,0.5,0,100"], 6, "not an integer"),
        (GOOD_HEAD[:3] + GOOD_HEAD[4:] + ["0,1,0,1,0,3,0.5,0,100"], 5, "no '# layer=' header"),
        (GOOD_HEAD[:2] + ["# layer=0 expert_bytes=-1"] + GOOD_HEAD[3:], 3, "negative"),
        (GOOD_HEAD[:4], 4, "no column row"),
        (GOOD_HEAD[:2] + GOOD_HEAD[4:], 3, "names no MoE layer"),  # replay: max() of an empty sequence
        # values past a column's type wrapped round in the cast: replayed as layer 0, as decode
        (GOOD_HEAD + ["0,1,0,65536,0,3,0.5,0,100"], 6, "layer='65536' is out of range"),
        (GOOD_HEAD + ["0,257,0,0,0,3,0.5,0,100"], 6, "phase='257' is out of range"),
        (GOOD_HEAD + ["0,1,1e30,0,0,3,0.5,0,100"], 6, "step='1e30' is out of range"),
        (GOOD_HEAD + ["0,1,0,0,0,3,0.5,256,100"], 6, "residency='256' is out of range"),
    ],
)
def test_malformed_traces_name_file_and_line(tmp_path: Path, lines: list[str], line_no: int,
                                              words: str) -> None:
    path = tmp_path / "bad.csv"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(TraceFormatError) as err:
        read_trace(path)
    assert isinstance(err.value, BmoeError)
    assert f"{path}:{line_no}:" in str(err.value)
    assert words in str(err.value)


def test_missing_file_is_a_trace_error(tmp_path: Path) -> None:
    with pytest.raises(TraceFormatError, match="cannot read"):
        read_trace(tmp_path / "nope.csv")


def test_prompt_calls_are_read_from_the_rows(tmp_path: Path) -> None:
    """Two prefill calls (2 tokens each, layer-major), unrecorded weights, then one decode token."""
    path = tmp_path / "calls.csv"
    nan = float("nan")
    with TraceWriter(path, model="m", arch="a", n_layer=2, n_expert=8, n_expert_used=1,
                     expert_bytes={0: 10, 1: 10}) as w:
        for first in (0, 2):
            for layer in (0, 1):
                for tok in (first, first + 1):
                    w.add(0, 0, tok, layer, [tok + layer], [nan], [0])
        w.add(0, 1, 4, 0, [5], [1.0], [0])
        w.add(0, 1, 4, 1, [6], [1.0], [0])
    t = read_trace(path)
    assert np.isnan(t.weight[0]) and t.weight[-1] == 1.0
    ev = t.layer_events()
    assert [(e.phase, e.step, e.layer, e.experts, e.ends_call) for e in ev] == [
        (0, 0, 0, (0, 1), False), (0, 0, 1, (1, 2), True),
        (0, 2, 0, (2, 3), False), (0, 2, 1, (3, 4), True),
        (1, 4, 0, (5,), False), (1, 4, 1, (6,), True),
    ]
    assert sum(e.ends_call for e in t.layer_events(ubatch=4)) == 1 + 1

"""Route traces from live runs, and their replay through the same stages: agreement with the live
run's counts, determinism, modelled reads, and the command line."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bmoe.engine.config import MiB, RunConfig
from bmoe.engine.replay import ComputeModel, replay
from bmoe.engine.session import Session
from bmoe.io.validate import open_layout
from bmoe.pipeline.trace import read_trace
from bmoe.synth.tiny import TinySpec, write_tiny
from tests.conftest import N_TOKENS, PROMPT

SPEC = TinySpec(n_embd=256, n_ff=256, n_layer=3)
BUDGET = 2 * MiB


@pytest.fixture(scope="module")
def traced(tiny, tmp_path_factory):  # noqa: ANN001, ANN201
    """A live run at an evicting budget, its stats and its route trace."""
    path = tiny.path(SPEC)
    trace = tmp_path_factory.mktemp("trace") / "live.route.csv"

    async def go():  # noqa: ANN202
        config = RunConfig(n_ctx=256, cache_bytes=BUDGET, cache_policy="lru", route_trace=str(trace))
        with Session.open(path, config) as s:
            return await s.generate(PROMPT, N_TOKENS, stop_at_end=False)

    return path, trace, asyncio.run(go())


def test_live_trace_is_a_route_trace(traced) -> None:  # noqa: ANN001
    path, trace_path, gen = traced
    t = read_trace(trace_path)
    assert (t.arch, t.n_layer, t.n_expert, t.n_expert_used) == ("qwen3moe", 3, SPEC.n_expert, SPEC.n_expert_used)
    assert t.tokens(0) == len(Session.open(path, RunConfig(mode="resident")).tokenize(PROMPT))
    assert t.tokens(1) == N_TOKENS - 1  # the prefill makes the first token; each decode one more
    assert t.timing, "v2 timing lines for modelled replay"
    assert (t.bytes_read > 0).sum() == gen.stats.experts_read


@pytest.mark.asyncio
async def test_replay_reproduces_the_live_counts(traced) -> None:  # noqa: ANN001
    path, trace_path, gen = traced
    t = read_trace(trace_path)
    layout = open_layout(path)
    runs = [
        await replay(t, budget_bytes=BUDGET, policy="lru", compute=ComputeModel(t.timing, 0.0), model=layout)
        for _ in range(2)
    ]
    for r in runs:
        assert (r.hits, r.misses) == (gen.stats.cache_hits, gen.stats.experts_read)
        assert r.decode_tokens == N_TOKENS - 1
    assert runs[0].bytes_read == runs[1].bytes_read


@pytest.mark.asyncio
async def test_simulated_reads_give_the_same_counts(traced, tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    _, trace_path, gen = traced
    t = read_trace(trace_path)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    probe = {"mib_s": 500.0, "slice_bytes": max(t.expert_bytes.values()), "lanes": 2, "mode": "odirect",
             "reads": 1, "how": "seeded by the test"}
    (tmp_path / "bmoe").mkdir()
    key = f"{os.stat(tmp_path).st_dev}:{probe['slice_bytes']}:2"
    (tmp_path / "bmoe" / "probe.json").write_text(json.dumps({key: probe}))
    r = await replay(t, budget_bytes=BUDGET, policy="lru", compute=ComputeModel({}, 0.0), sim_dir=tmp_path)
    assert (r.hits, r.misses) == (gen.stats.cache_hits, gen.stats.experts_read)
    assert r.io.startswith("sim") and r.tok_per_s is not None


def test_replay_cli_json_plot_and_bad_input(traced, tmp_path: Path) -> None:  # noqa: ANN001
    path, trace_path, _ = traced
    plot = tmp_path / "r.png"
    proc = subprocess.run(
        [sys.executable, "-m", "bmoe.cli", "replay", str(trace_path), "-m", str(path),
         "--cache-mb", "0,2,64", "--policy", "lru,opt", "--json", "--plot", str(plot),
         "--compute-ms-per-layer", "0"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert len(out["results"]) == 6
    for r in out["results"]:
        assert set(r) >= {"policy", "cache_mb", "decode_hit_pct", "hit_pct", "bytes_read", "tok_per_s"}
    by = {(r["policy"], r["cache_mb"]): r for r in out["results"]}
    for mb in (0, 2, 64):
        assert by["opt", mb]["hits"] >= by["lru", mb]["hits"]
    assert plot.stat().st_size > 10_000
    other = write_tiny(tmp_path / "other.gguf", TinySpec(n_layer=2))[0]
    bad = subprocess.run(
        [sys.executable, "-m", "bmoe.cli", "replay", str(trace_path), "-m", str(other), "--cache-mb", "1"],
        capture_output=True, text=True, timeout=120,
    )
    assert bad.returncode == 1 and "does not match the trace" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1

"""Route traces from live runs, and their replay through the same stages: agreement with the live
run's counts, determinism, modelled reads, and the command line."""

from __future__ import annotations

import asyncio
import csv
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
from tests.helpers import N_TOKENS, PROMPT

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


def _seed_probe(tmp_path: Path, monkeypatch, slice_bytes: int, lanes: int = 2):  # noqa: ANN001, ANN202
    """A probe result in a private cache directory, so no test measures the disk."""
    from bmoe.io.probe import ProbeResult

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    probe = {"mib_s": 500.0, "slice_bytes": slice_bytes, "lanes": lanes, "mode": "odirect",
             "reads": 1, "how": "seeded by the test"}
    (tmp_path / "bmoe").mkdir(exist_ok=True)
    key = f"{os.stat(tmp_path).st_dev}:{slice_bytes}:{lanes}"
    (tmp_path / "bmoe" / "probe.json").write_text(json.dumps({key: probe}))
    return ProbeResult(**probe)


@pytest.mark.asyncio
@pytest.mark.parametrize("policy", ["lru", "default", "opt"])
async def test_modelled_timing_agrees_with_real_reads(traced, policy: str, tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """--timing model counts exactly what the staged replay with real reads counts."""
    from bmoe.engine.replay import model_replay

    path, trace_path, _ = traced
    t = read_trace(trace_path)
    layout = open_layout(path)
    probe = _seed_probe(tmp_path, monkeypatch, max(t.expert_bytes.values()))
    for budget in (0, BUDGET // 2, BUDGET, 64 * MiB):
        real = await replay(t, budget_bytes=budget, policy=policy, compute=ComputeModel(t.timing, 0.0), model=layout)
        for overlap in ("none", "tensor", "expert"):
            m = model_replay(t, budget_bytes=budget, policy=policy, compute=ComputeModel(t.timing, 0.0),
                             probe=probe, overlap=overlap)
            assert (m.hits, m.misses, m.bytes_read) == (real.hits, real.misses, real.bytes_read), (budget, overlap)
            assert (m.decode_hit_pct, m.decode_tokens) == (real.decode_hit_pct, real.decode_tokens)
            assert m.io.startswith("modelled")


def test_modelled_layer_time() -> None:
    """Reads spread over the lanes that free first; overlap only ever shortens a layer."""
    from bmoe.engine.replay import _modelled_layer

    bw = 100.0  # bytes per second per lane
    slices = [(p, e, 100) for p in range(3) for e in (1, 2)]  # 1 s each, six of them
    none = _modelled_layer(0.0, 4.0, slices, 2, bw, "none", 3, (1, 2))
    assert none == pytest.approx(3.0 + 4.0)  # six 1 s reads on two lanes, then all compute
    tensor = _modelled_layer(0.0, 4.0, slices, 2, bw, "tensor", 3, (1, 2))
    assert tensor == pytest.approx(1 + 1 + 1 + 1 + 1)  # each projection lands as the last one computes
    expert = _modelled_layer(0.0, 4.0, slices, 2, bw, "expert", 3, (1, 2))
    assert expert <= tensor <= none
    assert _modelled_layer(5.0, 4.0, [], 2, bw, "none", 3, (1,)) == pytest.approx(9.0)  # all hits
    assert _modelled_layer(0.0, 0.0, slices, 1, bw, "none", 3, (1, 2)) == pytest.approx(6.0)  # one lane


def test_replay_cli_models_time_by_default_for_sim(traced, tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    _, trace_path, _ = traced
    t = read_trace(trace_path)
    local = tmp_path / "trace.route.csv"
    local.write_bytes(trace_path.read_bytes())
    _seed_probe(tmp_path, monkeypatch, max(t.expert_bytes.values()))
    proc = subprocess.run(
        [sys.executable, "-m", "bmoe.cli", "replay", str(local), "--io", "sim", "--cache-mb", "0,2",
         "--policy", "lru,default", "--json"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "XDG_CACHE_HOME": str(tmp_path)},
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert "modelled decode time" in out["how"]
    assert all(r["io"].startswith("modelled") and r["tok_per_s"] for r in out["results"])
    bad = subprocess.run(
        [sys.executable, "-m", "bmoe.cli", "replay", str(local), "-m", str(local), "--timing", "model",
         "--cache-mb", "1"], capture_output=True, text=True, timeout=120,
    )
    assert bad.returncode == 1 and bad.stderr.count("\n") == 1 and "--timing model" in bad.stderr


def test_replay_rows_label_budgets_and_policies_as_given(traced, tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """Sub-MiB budgets were rounded (0 and 0.5 both '0 MiB', 1.5 '2 MiB') and ``default`` printed
    as the ``adaptive`` it resolves to."""
    _, trace_path, _ = traced
    local = tmp_path / "trace.route.csv"
    local.write_bytes(trace_path.read_bytes())
    _seed_probe(tmp_path, monkeypatch, max(read_trace(trace_path).expert_bytes.values()))
    proc = subprocess.run(
        [sys.executable, "-m", "bmoe.cli", "replay", str(local), "--io", "sim", "--cache-mb", "0,0.5,1,1.5",
         "--policy", "default"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "XDG_CACHE_HOME": str(tmp_path)},
    )
    assert proc.returncode == 0, proc.stderr
    header, *rows = proc.stdout.splitlines()
    assert header.split()[:3] == ["policy", "overlap", "budget"], header
    assert [r.split()[2] for r in rows] == ["0", "0.5", "1", "1.5"], rows
    assert all(r.split()[0] == "default" for r in rows), rows
    as_json = subprocess.run(
        [sys.executable, "-m", "bmoe.cli", "replay", str(local), "--io", "sim", "--cache-mb", "0.5,1",
         "--policy", "default,lru", "--json", "--csv", str(tmp_path / "rows.csv")],
        capture_output=True, text=True, timeout=120, env={**os.environ, "XDG_CACHE_HOME": str(tmp_path)},
    )
    assert as_json.returncode == 0, as_json.stderr
    given = [(r["policy"], r["cache_mb"]) for r in json.loads(as_json.stdout)["results"]]
    assert given == [("default", 0.5), ("default", 1), ("lru", 0.5), ("lru", 1)], given
    with open(tmp_path / "rows.csv", newline="") as f:
        assert [(r["policy"], float(r["cache_mb"])) for r in csv.DictReader(f)] == given


def test_replay_outputs_replace_a_link_instead_of_writing_through_it(traced, tmp_path: Path,  # noqa: ANN001
                                                                     monkeypatch) -> None:  # noqa: ANN001
    """--csv and --plot given as links to files that are not outputs: opened for writing in place,
    the file a link pointed to was overwritten; now the link is replaced and that file kept."""
    _, trace_path, _ = traced
    local = tmp_path / "trace.route.csv"
    local.write_bytes(trace_path.read_bytes())
    _seed_probe(tmp_path, monkeypatch, max(read_trace(trace_path).expert_bytes.values()))
    victims = {}
    for name in ("rows.csv", "plot.png"):
        victims[name] = tmp_path / f"victim-{name}"
        victims[name].write_text(f"not an output: {name}")
        (tmp_path / name).symlink_to(victims[name])
    proc = subprocess.run(
        [sys.executable, "-m", "bmoe.cli", "replay", str(local), "--io", "sim", "--cache-mb", "0.5,1",
         "--policy", "lru", "--json", "--csv", str(tmp_path / "rows.csv"), "--plot", str(tmp_path / "plot.png")],
        capture_output=True, text=True, timeout=120, env={**os.environ, "XDG_CACHE_HOME": str(tmp_path)},
    )
    assert proc.returncode == 0, proc.stderr
    for name, victim in victims.items():
        assert victim.read_text() == f"not an output: {name}", name
        assert not (tmp_path / name).is_symlink(), name
    with open(tmp_path / "rows.csv", newline="") as f:
        assert [float(r["cache_mb"]) for r in csv.DictReader(f)] == [0.5, 1.0]
    assert (tmp_path / "plot.png").read_bytes()[:4] == b"\x89PNG"

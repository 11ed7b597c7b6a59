"""``bmoe bench`` plumbing: the report it writes, the balloon's life, the refusals. Never timings."""

from __future__ import annotations

import argparse
import csv
import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bmoe.bench import harness, side
from bmoe.bench.child import squeezed_generation
from bmoe.bench.options import SQUEEZE_TOKENS_CAP, BenchOptions
from bmoe.bench.plan import Run, plan_runs
from bmoe.bench.balloon import Balloon, GiB, MiB, has_cap_ipc_lock, plan_balloon
from bmoe.errors import BudgetError, ConfigError
from bmoe.synth.tiny import TinySpec, write_tiny

KEYS = ("device_read_mb_s", "stream_cache_off_read_mb_s", "resident_tok_s", "mmap_tok_s", "stream_tok_s",
        "all_cached_tok_s", "p1_all_cached_over_resident", "p2_read_over_device", "p3_stream_over_mmap",
        "mmap_norepack_tok_s", "stock_tok_s", "stream_auto_tok_s", "p3_auto_over_mmap", "device_read_fresh_mb_s",
        "device_read_end_mb_s")
LOCK = 64 * MiB


def may_lock(nbytes: int) -> bool:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return has_cap_ipc_lock() or soft == resource.RLIM_INFINITY or soft >= nbytes


needs_lock = pytest.mark.skipif(not may_lock(LOCK), reason=f"this process may not lock {LOCK >> 20} MiB "
                                "(RLIMIT_MEMLOCK, no CAP_IPC_LOCK)")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny(tmp_path_factory.mktemp("bench") / "tiny.gguf", TinySpec())[0]


class Spy(Balloon):
    """A balloon that records its pid in ``pids`` when it inflates."""

    pids: list[int]

    def inflate(self) -> Balloon:
        out = super().inflate()
        assert self.pid is not None
        self.pids.append(self.pid)
        return out


@pytest.fixture
def spy() -> list[int]:
    """Pids of every balloon the harness inflates (through ``host(..., spy=spy)``)."""
    return []


def host(available: int, spy: list[int] | None = None, execute: object = None) -> harness.Host:
    """The machine as the bench sees it: ``available`` bytes of memory and no cgroup limit; a
    balloon that records its pid in ``spy``; ``execute`` in place of running each side."""
    balloon = type("Recorded", (Spy,), {"pids": spy if spy is not None else []})
    return harness.Host(meminfo=lambda: {"MemTotal": 24 * GiB, "MemAvailable": available}, cgroup_room=lambda: None,
                        balloon=balloon, **({"execute": execute} if execute is not None else {}))


def limit_of(model_path: Path) -> float:
    """A --ram-limit (GiB) just past the refusal floor for this model."""
    from bmoe.io.validate import open_layout

    return (open_layout(model_path).dense_bytes + GiB + MiB) / GiB


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bmoe")
    sub = parser.add_subparsers(dest="command", required=True)
    harness.add_bench_command(sub)
    return parser.parse_args(["bench", *argv])


def gone(pid: int) -> bool:
    """True once the process no longer exists (or is a zombie nobody reaped: it holds no memory)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return True
    return state in ("Z", "X")


def wait_gone(pid: int, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if gone(pid):
            return True
        time.sleep(0.05)
    return gone(pid)


@needs_lock
def test_bench_json_and_files_under_a_ram_limit(model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                spy: list[int]) -> None:
    limit = limit_of(model)
    machine = host(int(limit * GiB) + LOCK, spy)  # so the balloon locks a real 64 MiB
    out = tmp_path / "report"
    args = parse([str(model), "--tokens", "6", "--warmup", "2", "-t", "1", "--ram-limit", str(limit), "--json",
                  "--out", str(out), "--plot", str(tmp_path / "p.png"), "--budgets", "1,4", "--squeeze", "0.03125",
                  "--ttft", "5,50", "--stock-timeout", "600"])
    assert harness.run_bench_command(args, machine) == 0
    result = json.loads(capsys.readouterr().out)

    for key in KEYS:
        assert key in result
        assert result[key] is None and key in result["notes"] or isinstance(result[key], float), key
    assert all(v != 0 for k, v in result.items() if k in KEYS)  # unmeasured is null, never 0
    assert set(KEYS) <= set(result["how"])
    assert result["identical_tokens"] is True
    assert {r["id"] for r in result["runs"]} >= {"resident", "mmap", "stream_off", "stream_below_ws",
                                                  "stream_half_bank", "all_cached", "overlap", "stream_auto",
                                                  "mmap_norepack", "sweep_1", "sweep_4", "squeeze"}
    below = next(r for r in result["runs"] if r["id"] == "stream_below_ws")  # a tiny model: clamped, and says so
    assert "not below one token's working set" in below["config"] and "clamped" in below["notes"], below
    assert result["mmap_norepack_tok_s"] == result["resident_tok_s"], "the file fits: resident is the baseline"
    assert result["p3_stream_over_mmap"] == round(result["stream_tok_s"] / result["mmap_norepack_tok_s"], 3)
    assert result["stock_tok_s"] == result["mmap_tok_s"]
    ttft = result["ttft_s"]
    assert len(ttft) == 2 and all(v > 0 for v in ttft.values())
    assert [int(k) for k in ttft] == sorted(int(k) for k in ttft) and 2 <= int(next(iter(ttft))) <= 5
    floor = result["ttft_floor"]  # each first token against its reads at the probed rate plus its compute
    assert set(floor) == set(ttft) and "ttft_floor" in result["how"]
    for k, f in floor.items():
        assert f["ttft_s"] == ttft[k] and f["floor_s"] > 0 and f["read_mib"] >= 0 and f["compute_s"] >= 0
        assert f["floor_s"] >= f["compute_s"] and f["ttft_over_floor"] > 0  # of unrounded seconds
    cold, cold_floor = result["ttft_cold_s"], result["ttft_cold_floor"]  # a fresh session per prompt
    assert set(cold) == set(ttft) and set(cold_floor) == set(ttft) and "ttft_cold_s" in result["how"]
    for k, f in cold_floor.items():  # an empty cache reads the prompt's whole union: never less than warm
        assert f["ttft_s"] == cold[k] and f["read_mib"] > 0 and f["read_mib"] >= floor[k]["read_mib"]
        # the same reads, those into fresh pages at the rate the probe measured into fresh pages
        fresh_ratio = result["device_read_mb_s"] / result["device_read_fresh_mb_s"]
        assert f["floor_fresh_s"] > 0 and f["ttft_over_floor_fresh"] > 0
        assert (f["floor_fresh_s"] - f["floor_s"]) * (fresh_ratio - 1) >= -2e-3, "slower fresh rate: a higher floor"
    for key, floors in (("ttft_no_predict_s", floor), ("ttft_cold_no_predict_s", cold_floor)):
        # the auto run reads prompts ahead: the same prompts without it, side by side, give the
        # floors their compute (reads and compute in turn there)
        assert set(result[key]) == set(ttft) and key in result["how"], key
        for k, f in floors.items():
            assert f["compute_from"] == "no read-ahead run" and f["ttft_no_predict_s"] == result[key][k]
            assert f["ttft_over_no_predict"] > 0
    assert result["probe_fresh"]["fresh"] and result["probe_fresh"]["lanes"] == 2 * result["config"]["io_threads"]
    assert [(r["budget_mb"], r["status"]) for r in result["budget_sweep"]] == [(1.0, "measured"), (4.0, "measured")]
    assert all(r["tok_per_s"] > 0 and r["hit_pct"] is not None for r in result["budget_sweep"])
    sq = result["squeeze"]
    for key in ("tok_per_s_before", "tok_per_s_after", "budget_bytes_before", "budget_bytes_after"):
        assert sq[key] is not None and sq[key] > 0, key
    assert sq["started_after_token"] == 3 and "squeeze" in result["how"]
    assert result["runs"][[r["id"] for r in result["runs"]].index("all_cached")]["hit_pct"] == 100.0
    auto = next(r for r in result["runs"] if r["id"] == "stream_auto")  # was empty: the budget auto chose
    assert auto["budget_mib"] and "chosen by the run" in auto["notes"], auto
    assert [p["lanes"] for p in result["probe"]] == [1, 2, 4, 8]
    assert result["machine"]["cores"] and result["machine"]["kernel"] and result["machine"]["cpu_model"]
    assert result["config"]["balloon"]["lock_bytes"] == LOCK
    assert result["config"]["balloon"]["alive_at_end"] is True

    md = (out / "bench.md").read_text()
    assert "| config |" in md and "stream, cache off" in md and "## Machine" in md
    with open(out / "bench.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(result["runs"]) and "tok_s" in rows[0]
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((out / "bench.json").read_text())["p3_stream_over_mmap"] == result["p3_stream_over_mmap"]

    assert len(spy) == 1 and wait_gone(spy[0])


@needs_lock
def test_balloon_released_when_the_harness_raises(model: Path, tmp_path: Path, spy: list[int]) -> None:
    limit = limit_of(model)
    seen: list[bool] = []

    def boom(*_a: object) -> None:
        seen.append(not gone(spy[0]))  # the balloon stands while configurations run
        raise RuntimeError("injected failure")

    args = parse([str(model), "--tokens", "4", "--ram-limit", str(limit), "--out", str(tmp_path)])
    with pytest.raises(RuntimeError, match="injected"):
        harness.run_bench_command(args, host(int(limit * GiB) + LOCK, spy, execute=boom))
    assert seen == [True]
    assert len(spy) == 1 and wait_gone(spy[0])


def test_unmeasured_figures_are_null_with_reasons(model: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """No memory to speak of: everything but the cache-off runs is skipped; and the mmap run fails."""

    def fake(run: Run, *_a: object) -> side.Outcome:
        if run.kind == "mmap" or run.id == "mmap_norepack":
            return side.Outcome(error="child killed by signal 9 (out of memory?)")
        return side.Outcome(result={
            "tokens": [1, 2, 3, 4], "open_s": 0.1, "peak_rss_bytes": 50 * MiB, "disk_read_bytes": MiB,
            "io_mode": "odirect", "stats": {"mode": "stream", "generated_tokens": 4, "tok_per_s": 5.0,
                                            "read_mib_per_s": 40.0, "cache_hit_pct": 0.0}})

    args = parse([str(model), "--tokens", "4", "--json", "--out", str(tmp_path)])
    assert harness.run_bench_command(args, host(64 * MiB, execute=fake)) == 0
    result = json.loads(capsys.readouterr().out)
    rows = {r["id"]: r for r in result["runs"]}
    assert rows["resident"]["status"] == "skipped" and "exceed" in rows["resident"]["notes"]
    assert rows["mmap"]["status"] == "failed"
    assert rows["mmap_norepack"]["status"] == "failed", "run when the file does not fit: it is the baseline"
    for key in ("resident_tok_s", "mmap_tok_s", "all_cached_tok_s", "p1_all_cached_over_resident",
                "p3_stream_over_mmap", "stock_tok_s", "mmap_norepack_tok_s"):
        assert result[key] is None and result["notes"][key], key
    assert "killed" in result["notes"]["stock_tok_s"]
    assert result["budget_sweep"] == [] and result["squeeze"] is None and "--squeeze" in result["notes"]["squeeze"]
    assert result["stream_tok_s"] == 5.0 and result["stream_cache_off_read_mb_s"] == 40.0
    assert (tmp_path / "bench.png").exists() and (tmp_path / "bench.csv").exists()


def test_too_tight_limit_refused(model: Path, tmp_path: Path) -> None:
    args = parse([str(model), "--ram-limit", "0.5", "--out", str(tmp_path / "never")])
    with pytest.raises(BudgetError, match="too tight"):
        args.func(args)
    assert not (tmp_path / "never").exists()  # refused before measuring anything


def test_balloon_plan_bounds() -> None:
    info = {"MemTotal": 16 * GiB, "MemAvailable": 10 * GiB}
    plan = plan_balloon(4 * GiB, 2 * GiB, meminfo=info, memlock=(-1, -1), privileged=False)
    assert plan.lock_bytes == 6 * GiB
    with pytest.raises(BudgetError, match="too tight"):  # < dense + 1 GiB
        plan_balloon(int(2.5 * GiB), 2 * GiB, meminfo=info)
    with pytest.raises(BudgetError, match="RLIMIT_MEMLOCK"):
        plan_balloon(4 * GiB, 2 * GiB, meminfo=info, memlock=(64 * MiB, 64 * MiB), privileged=False)
    assert plan_balloon(4 * GiB, 2 * GiB, meminfo=info, memlock=(64 * MiB, 64 * MiB), privileged=True).lock_bytes
    assert plan_balloon(12 * GiB, 2 * GiB, meminfo=info).lock_bytes == 0  # already below the limit
    assert plan_balloon(4 * GiB, 2 * GiB, meminfo=info, cgroup=5 * GiB).lock_bytes == GiB  # cgroup room smaller


def test_bad_options_are_config_errors(model: Path) -> None:
    with pytest.raises(ConfigError, match="tokens"):
        BenchOptions(model, tokens=1).validate()
    with pytest.raises(ConfigError, match="io-threads"):
        BenchOptions(model, io_threads=0).validate()
    with pytest.raises(ConfigError, match="context of 100000256 tokens"):  # was found after every run, by each
        BenchOptions(model, ttft_lengths=(99999999,)).validate()


@pytest.mark.parametrize("flag,value", [("--ram-limit", "nan"), ("--ram-limit", "inf"), ("--squeeze", "1e300"),
                                        ("--budgets", "nan"), ("--budgets", "inf"), ("--timeout", "nan"),
                                        ("--stock-timeout", "0")])
def test_non_finite_numbers_are_parse_errors(model: Path, flag: str, value: str) -> None:
    """nan, inf and 1e300 passed the checks and ended in an internal error (NaN to integer)."""
    with pytest.raises(SystemExit) as info:
        parse([str(model), flag, value])
    assert info.value.code == 2


def test_a_squeeze_larger_than_the_room_left_is_skipped_with_its_reason(model: Path) -> None:
    """The squeeze balloon is locked and kept from the OOM killer: one bigger than the room beside
    the run would have had the kernel kill the run or other programs instead."""
    from types import SimpleNamespace

    layout = SimpleNamespace(dense_bytes=512 * MiB, expert_bytes=4 * GiB, file_bytes=4 * GiB + 512 * MiB,
                             expert_bytes_per_token=lambda: 64 * MiB)
    plan = {r.id: r for r in plan_runs(layout, BenchOptions(model, squeeze_bytes=5 * GiB), 3 * GiB)}
    assert plan["squeeze"].skip is not None and "--squeeze 5.00 GiB is more than" in plan["squeeze"].skip
    fits = {r.id: r for r in plan_runs(layout, BenchOptions(model, squeeze_bytes=GiB), 3 * GiB)}
    assert fits["squeeze"].skip is None


@needs_lock
def test_balloon_locks_and_releases() -> None:
    with Balloon(LOCK) as b:
        pid = b.pid
        assert pid is not None
        status = Path(f"/proc/{pid}/status").read_text()
        locked = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmLck:"))
        assert locked * 1024 >= LOCK
    assert wait_gone(pid)


@needs_lock
def test_balloon_dies_with_its_parent() -> None:
    code = ("import time; from bmoe.bench.balloon import Balloon; "
            f"b = Balloon({LOCK}).inflate(); print(b.pid, flush=True); time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        pid = int(parent.stdout.readline())
        assert not gone(pid)
    finally:
        parent.kill()
        parent.wait()
    assert wait_gone(pid)


def test_balloon_refusal_is_a_budget_error() -> None:
    """In a child that may lock 8 MiB and lacks CAP_IPC_LOCK (as root, dropped from its bounding
    set by util-linux's setpriv, since root may lock past the limit), locking 72 MiB is one
    BudgetError."""
    code = ("import sys; from bmoe.bench.balloon import Balloon\n"
            "try:\n    Balloon(72 << 20).inflate()\n"
            "except Exception as e:\n    print(type(e).__name__, e); sys.exit(3)\n")
    argv = [sys.executable, "-c", code]
    if has_cap_ipc_lock():
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("this process may lock past RLIMIT_MEMLOCK and setpriv (util-linux) is missing")
        argv = [setpriv, "--bounding-set=-ipc_lock", "--inh-caps=-ipc_lock", *argv]

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (8 << 20, 8 << 20))

    proc = subprocess.run(argv, preexec_fn=limited, capture_output=True, text=True, timeout=60)
    if proc.returncode != 3 and proc.stderr.startswith("setpriv:"):  # no CAP_SETPCAP here to drop it
        pytest.skip(f"setpriv could not drop CAP_IPC_LOCK: {proc.stderr.strip()[:200]}")
    assert proc.returncode == 3 and proc.stdout.startswith("BudgetError") and "could not lock" in proc.stdout, \
        (proc.returncode, proc.stdout, proc.stderr)


def test_a_child_timed_out_after_its_measured_generation_keeps_it(model: Path, tmp_path: Path) -> None:
    """The time-to-first-token prompts run after the measured generation: a timeout there keeps the
    generation's figures and says what is missing; a timeout before it is the row's error."""
    partial = {"tokens": [1, 2], "stats": {"mode": "stream", "tok_per_s": 2.0}, "warnings": [],
               "partial": "during the time-to-first-token prompts: those are missing"}

    def fake_run(cmd: list[str], **kw: object) -> None:
        if write:
            Path(cmd[-1]).write_text(json.dumps(partial))
        raise subprocess.TimeoutExpired(cmd, 5.0)

    opts = BenchOptions(model=model, timeout_s=5.0)
    for write in (True, False):
        run = side.execute(Run("stream_auto", "auto", "bmoe", {}), model, opts, tmp_path, spawn=fake_run)
        if write:
            assert run.error is None and run.result is not None and run.result["tokens"] == [1, 2]
            assert "partial" not in run.result and run.result["warnings"] == [
                "timed out after 5 s during the time-to-first-token prompts: those are missing"]
        else:
            assert run.result is None and run.error == "timed out after 5 s"


def test_squeeze_reads_the_stats_of_a_closed_generation() -> None:
    """The squeezed generation stops early (a break out of ``Session.stream``): the stream must be
    closed before its stats are read, or the budget at the end and its changes are still unset."""
    import asyncio
    from types import SimpleNamespace

    class FakeBalloon:
        inflate_s, lock = 0.5, False

        def __init__(self, nbytes: int, lock: bool = True) -> None:
            pass

        def start(self) -> None:
            pass

        def ready_nowait(self) -> bool:
            return True

        def release(self) -> None:
            pass

    class FakeSession:
        budget_bytes = 100 * MiB
        last_stats: SimpleNamespace | None = None

        async def stream(self, _prompt: str, cap: int, stop_at_end: bool = True):  # noqa: ANN201
            stats = SimpleNamespace(budget_bytes_end=None, budget_changes=None)
            self.last_stats = stats
            try:
                for i in range(cap):
                    yield SimpleNamespace(token=i, metrics=SimpleNamespace(wall_ms=100.0))
            finally:  # as Session.stream: the stats are finished when the generator closes
                stats.budget_bytes_end, stats.budget_changes = 60 * MiB, [{"old": 100 * MiB, "new": 60 * MiB}]

    spec = {"tokens": 8, "squeeze_bytes": GiB, "prompt": "p"}
    tokens, sq = asyncio.run(squeezed_generation(FakeSession(), spec, balloon=FakeBalloon(GiB)))
    assert len(tokens) < SQUEEZE_TOKENS_CAP * 8, "it stopped early: the case under test"
    assert sq["budget_bytes_after"] == 60 * MiB and sq["budget_changes"] == [{"old": 100 * MiB, "new": 60 * MiB}]


def test_out_refuses_a_folder_where_a_report_file_would_overwrite_an_input(model: Path, tmp_path: Path) -> None:
    """Only the folder was checked: a model named bench.csv inside --out became the CSV report."""
    from bmoe.errors import OutputPathError

    folder = tmp_path / "report"
    folder.mkdir()
    victim = folder / "bench.csv"
    victim.write_bytes(model.read_bytes())
    args = parse([str(victim), "--tokens", "2", "--out", str(folder)])
    with pytest.raises(OutputPathError, match="is an input of this run"):
        args.func(args)
    assert victim.read_bytes() == model.read_bytes()

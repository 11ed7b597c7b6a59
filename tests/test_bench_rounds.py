"""``bmoe bench --rounds / --busy / --disk-limit``, its exit status and its report files: the
rounds' arithmetic alone, then the bench end to end on the tiny model with every side's child
replaced by a function (``Host.execute``), so the figures are known. Never timings."""

from __future__ import annotations

import argparse
import json
import os
import resource
from pathlib import Path

import pytest

from bmoe.bench import harness
from bmoe.bench.balloon import has_cap_ipc_lock
from bmoe.bench.busy import Spinners
from bmoe.bench.plan import Outcome, Run
from bmoe.bench.rounds import flag_noisy, median_tree, spread
from bmoe.errors import ConfigError
from bmoe.stages.read import disk_limit_plan
from bmoe.synth.tiny import TinySpec, write_tiny

MiB = 1 << 20
GiB = 1 << 30


@pytest.mark.pure
def test_median_tree_takes_each_numbers_median_and_the_rest_from_the_first_round() -> None:
    rounds = [{"tok": 1.0, "n": 4, "tokens": [1, 2], "ttft": {"5": 0.5, "50": 2.0}, "why": "a", "gone": None},
              {"tok": 9.0, "n": 4, "tokens": [1, 2], "ttft": {"5": 0.7, "50": 1.0}, "why": "b", "gone": 3.0},
              {"tok": 2.0, "n": 6, "tokens": [1, 3], "ttft": {"5": 0.6}, "why": "c", "gone": None}]
    out = median_tree(rounds)
    assert out == {"tok": 2.0, "n": 4, "tokens": [1, 2], "ttft": {"5": 0.6, "50": 1.5}, "why": "a", "gone": 3.0}
    assert median_tree([rounds[0]]) is rounds[0] and median_tree([]) is None


@pytest.mark.pure
def test_spread_is_largest_less_smallest_of_two_or_more() -> None:
    assert spread([3.0, None, 1.0, 2.5]) == 2.0
    assert spread([3.0, None]) is None and spread([]) is None


@pytest.mark.pure
def test_a_row_is_noisy_when_its_spread_exceeds_the_gap_to_the_nearest_row() -> None:
    rows = [{"id": "a", "tok_s": 10.0, "spread": {"tok_s": 3.0}},
            {"id": "b", "tok_s": 12.0, "spread": {"tok_s": 0.5}},
            {"id": "c", "tok_s": 30.0, "spread": {"tok_s": 1.0}},
            {"id": "d", "tok_s": None, "spread": {"tok_s": None}},
            {"id": "e", "tok_s": 50.0, "spread": {"tok_s": None}}]
    flag_noisy(rows)
    assert [(r["noisy"], r["noisy_vs"]) for r in rows] == [
        (True, "b"), (False, None), (False, None), (None, None), (None, None)]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny(tmp_path_factory.mktemp("rounds") / "tiny.gguf", TinySpec())[0]


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bmoe")
    harness.add_bench_command(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["bench", *argv])


# Each configuration's decode tok/s, round by round: stream_off's spread (20) exceeds its gap to
# overlap (5): noisy; resident's (1) is far below its gap to any row: not noisy.
TOK_S = {"resident": (100.0, 101.0, 100.5), "mmap": (10.0, 10.2, 10.1), "stream_off": (10.0, 30.0, 20.0),
         "overlap": (25.0, 25.1, 24.9), "stream_below_ws": (40.0, 41.0, 42.0), "stream_half_bank": (60.0, 61.0, 62.0),
         "all_cached": (90.0, 90.5, 91.0), "stream_auto": (55.0, 57.0, 56.0), "sweep_1": (50.0, 52.0, 51.0),
         "sweep_4": (70.0, 70.2, 70.1)}


class Sides:
    """Stands in for every side's child: records the order and each run's config, returns the
    round's tok/s from ``TOK_S``, fails where ``fail`` says (run id -> the rounds that fail)."""

    def __init__(self, fail: dict[str, set[int]] | None = None) -> None:
        self.calls: list[str] = []
        self.configs: dict[str, dict] = {}
        self.fail = fail or {}
        self.check = lambda: None

    def __call__(self, run: Run, model: Path, opts: object, scratch: Path) -> Outcome:
        self.check()
        n = self.calls.count(run.id)
        self.calls.append(run.id)
        self.configs[run.id] = dict(run.config)
        if n in self.fail.get(run.id, ()) or run.id not in TOK_S:
            return Outcome(error=f"child killed by SIGKILL (out of memory?) in round {n + 1}")
        stream = run.config.get("mode") == "stream"
        return Outcome(result={
            "tokens": [1, 2, 3, 4], "open_s": 0.1, "peak_rss_bytes": 50 * MiB, "disk_read_bytes": MiB,
            "io_mode": "odirect",
            "stats": {"mode": "stream" if stream else "resident", "generated_tokens": 4,
                      "tok_per_s": TOK_S[run.id][n], "read_mib_per_s": 40.0 + n if stream else None,
                      "cache_hit_pct": 0.0 if stream else None, "prefill_s": 0.1, "decode_s": 0.3}})


def host(sides: Sides, spinners: type[Spinners] = Spinners) -> harness.Host:
    return harness.Host(meminfo=lambda: {"MemTotal": 24 * GiB, "MemAvailable": 16 * GiB}, cgroup_room=lambda: None,
                        execute=sides, spinners=spinners)


def bench(model: Path, out: Path, sides: Sides, *flags: str, spinners: type[Spinners] = Spinners,
          capsys: pytest.CaptureFixture[str]) -> tuple[int, dict]:
    args = parse([str(model), "--tokens", "4", "--ttft", "0", "--json", "--out", str(out), *flags])
    code = harness.run_bench_command(args, host(sides, spinners))
    return code, json.loads(capsys.readouterr().out)


def test_rounds_run_interleaved_and_report_medians_spreads_and_load(model: Path, tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    sides = Sides(fail={"stream_below_ws": {1}})
    code, result = bench(model, tmp_path / "r", sides, "--rounds", "3", "--budgets", "1,4", capsys=capsys)
    assert code == 0 and result["rounds"] == 3
    order = [i for i in sides.calls if i in ("resident", "stream_off", "sweep_4")]
    assert order == ["resident", "stream_off", "sweep_4"] * 3, "A B C A B C A B C, not A A A B B B"
    rows = {r["id"]: r for r in result["runs"]}
    off = rows["stream_off"]
    assert off["tok_s"] == off["median"]["tok_s"] == 20.0 and off["spread"]["tok_s"] == 20.0
    assert off["read_mib_s"] == 41.0 and off["spread"]["read_mib_s"] == 2.0
    assert len(off["loadavg"]) == 3 and all(v is not None and v >= 0 for v in off["loadavg"])
    assert len(off["probe_mib_s_rounds"]) == 3 and off["rounds"] == 3
    assert off["noisy"] is True and off["noisy_vs"] == "overlap" and "noisy" in off["notes"]
    assert rows["resident"]["noisy"] is False and "noisy" not in rows["resident"]["notes"]  # the negative control
    below = rows["stream_below_ws"]  # one round failed: the median of the other two, and said
    assert below["status"] == "measured" and below["rounds"] == 2 and below["tok_s"] == 41.0
    assert "1 of 3 rounds failed" in below["notes"]
    # the ratios are of the medians
    assert result["resident_tok_s"] == 100.5 and result["stream_tok_s"] == 61.0
    assert result["p3_stream_over_mmap"] == round(61.0 / 100.5, 3)
    assert result["best_fixed_tok_s"] == 70.1 and result["auto_over_best_fixed"] == round(56.0 / 70.1, 3)
    assert result["identical_tokens"] is True
    assert result["overlap_over_stream_off"] == round(25.0 / 20.0, 3) and "overlap_over_stream_off" not in result["notes"]
    assert result["readahead_worst_over_off"] is None and result["notes"]["readahead_worst_over_off"]  # --ttft 0
    md = (tmp_path / "r" / "bench.md").read_text()
    assert "± tok/s" in md and "rounds: 3" in md


def test_busy_processes_spin_through_the_runs_and_are_gone_after(model: Path, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    made: list[Spinners] = []

    class Recorded(Spinners):
        def start(self) -> Recorded:
            made.append(self)
            return super().start()

    sides = Sides()
    alive: list[int] = []
    sides.check = lambda: alive.append(made[0].alive())
    code, result = bench(model, tmp_path / "b", sides, "--busy", "2", spinners=Recorded, capsys=capsys)
    assert code == 0 and result["busy"] == 2 and "spinning" in result["how"]["busy"]
    assert alive and set(alive) == {2}, "both spin while every side runs"
    pids = result["config"]["busy"]["pids"]
    assert len(pids) == 2
    for pid in pids:  # killed and reaped: no such process any more
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert "busy: 2 spinning" in (tmp_path / "b" / "bench.md").read_text()


def test_disk_limit_reaches_the_streamed_runs_and_says_how(model: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    sides = Sides()
    code, result = bench(model, tmp_path / "d", sides, "--disk-limit", "300", capsys=capsys)
    assert code == 0 and result["disk_limit_mib_s"] == 300.0
    assert sides.configs["stream_off"]["disk_limit_mib_s"] == 300.0
    assert sides.configs["stream_auto"]["disk_limit_mib_s"] == 300.0
    assert "disk_limit_mib_s" not in sides.configs["resident"], "resident reads no lanes: nothing to limit"
    mechanism = disk_limit_plan([model], 300.0)[1]
    assert result["config"]["disk_limit_how"] == mechanism and mechanism in result["how"]["disk_limit_mib_s"]
    assert ("token bucket" in mechanism) != ("cgroup v2 io.max (" in mechanism)
    code, plain = bench(model, tmp_path / "n", Sides(), capsys=capsys)
    assert plain["disk_limit_mib_s"] is None and "disk_limit_mib_s" not in Sides().configs


def test_every_configuration_failed_is_a_failure(model: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    args = parse([str(model), "--tokens", "4", "--ttft", "0", "--out", str(tmp_path / "f")])
    sides = Sides(fail={i: {0} for i in TOK_S})
    assert harness.run_bench_command(args, host(sides)) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if "every configuration failed" in line]
    assert len(err) == 1 and "failed, " in err[0] and str(tmp_path / "f") in err[0], err
    assert (tmp_path / "f" / "bench.json").exists(), "the report of what failed is still written"


def test_report_files_replace_a_link_instead_of_writing_through_it(model: Path, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """bench.csv (and --plot) a link to a file that is not an output: the link is replaced, the
    file it pointed to is left as it was."""
    out = tmp_path / "report"
    out.mkdir()
    victims = {name: tmp_path / f"victim-{name}" for name in ("bench.csv", "bench.md", "bench.json", "p.png")}
    for name, victim in victims.items():
        victim.write_text(f"not an output: {name}")
        (out / name if name != "p.png" else tmp_path / name).symlink_to(victim)
    code, _ = bench(model, out, Sides(), "--plot", str(tmp_path / "p.png"), capsys=capsys)
    assert code == 0
    for name, victim in victims.items():
        assert victim.read_text() == f"not an output: {name}", name
        written = out / name if name != "p.png" else tmp_path / name
        assert not written.is_symlink() and written.stat().st_size > 0, name
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("flags,match", [(["--rounds", "0"], "--rounds"), (["--busy", "-1"], "--busy"),
                                         (["--rounds", "101"], "--rounds")])
def test_bad_rounds_and_busy_are_config_errors(model: Path, flags: list[str], match: str) -> None:
    args = parse([str(model), *flags])
    with pytest.raises(ConfigError, match=match):
        harness.BenchOptions.from_args(args).validate()


@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf"])
def test_a_bad_disk_limit_is_a_parse_error(model: Path, value: str) -> None:
    with pytest.raises(SystemExit) as info:
        parse([str(model), "--disk-limit", value])
    assert info.value.code == 2


@pytest.mark.skipif(not has_cap_ipc_lock() and resource.getrlimit(resource.RLIMIT_MEMLOCK)[0] != resource.RLIM_INFINITY,
                    reason="the balloon's plan refuses a lock past RLIMIT_MEMLOCK without CAP_IPC_LOCK")
def test_a_balloon_that_dies_between_rounds_stops_the_runs_after_it(model: Path, tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """The RAM limit no longer holds: nothing more is measured; rows keep the rounds they had."""
    from bmoe.io.validate import open_layout

    sides = Sides()
    first_round = len([i for i in TOK_S if not i.startswith("sweep_")]) - 1  # less mmap_norepack, skipped

    class Dies:
        """A balloon that holds nothing and dies once the first round is over."""

        pid, inflate_s = None, 0.0

        def __init__(self, nbytes: int) -> None:
            pass

        def inflate(self) -> Dies:
            return self

        def alive(self) -> bool:
            return len(sides.calls) < first_round

        def release(self) -> None:
            pass

    limit = (open_layout(model).dense_bytes + GiB + MiB) / GiB
    args = parse([str(model), "--tokens", "4", "--ttft", "0", "--json", "--out", str(tmp_path / "x"),
                  "--rounds", "2", "--ram-limit", str(limit)])
    machine = harness.Host(meminfo=lambda: {"MemTotal": 24 * GiB, "MemAvailable": 16 * GiB},
                           cgroup_room=lambda: None, execute=sides, balloon=Dies)
    assert harness.run_bench_command(args, machine) == 0
    result = json.loads(capsys.readouterr().out)
    assert len(sides.calls) == first_round, "nothing ran after the balloon died"
    rows = {r["id"]: r for r in result["runs"]}
    assert rows["stream_off"]["status"] == "measured" and rows["stream_off"]["rounds"] == 1
    assert "1 of 2 rounds failed: the memory balloon died" in rows["stream_off"]["notes"]
    assert result["config"]["balloon"]["alive_at_end"] is False


def test_an_io_max_limit_is_put_back_after_every_child(model: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """A child killed by a timeout never restores the cgroup's io.max its engine set: the bench
    puts the line back after each child, failed or not."""

    class Line:
        restored = 0

        def restore(self) -> None:
            self.restored += 1

    line = Line()
    sides = Sides(fail={"overlap": {0}})
    args = parse([str(model), "--tokens", "4", "--ttft", "0", "--json", "--out", str(tmp_path / "i"),
                  "--disk-limit", "300"])
    machine = harness.Host(meminfo=lambda: {"MemTotal": 24 * GiB, "MemAvailable": 16 * GiB},
                           cgroup_room=lambda: None, execute=sides,
                           disk_limit_plan=lambda _paths, _rate: (line, "cgroup v2 io.max (a test's)"))
    assert harness.run_bench_command(args, machine) == 0
    result = json.loads(capsys.readouterr().out)
    assert line.restored == len(sides.calls) > 0
    assert result["config"]["disk_limit_how"] == "cgroup v2 io.max (a test's)"

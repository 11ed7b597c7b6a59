"""``bmoe bench MODEL``: every way of running one model, side by side, in one invocation.

On one prompt, in this order:

1. device probe: random O_DIRECT reads of distinct expert projection slices of the model itself
   (``bmoe.io.probe.measure_model``) with 1, 2, 4 and 8 lanes;
2. ``resident``: bmoe with the whole file mapped (skipped, and said so, when the file does not fit
   the memory available);
3. ``mmap``: stock llama-cpp-python (``llama_cpp.Llama``, no bmoe callback), greedy argmax over its
   logits: what users run today;
4. streamed: cache off; a budget below one token's working set; about half the expert bank; the
   whole bank after a warm-up that fills it ("all cached"); cache off with overlap when RunConfig
   has an ``overlap`` field; the ``auto`` budget with the pressure guard, which also measures the
   time to first token of prompts of 5, 50, 200 and 1000 tokens (``--ttft``, where the context
   allows; warm: after the measured generation, in that order; cold: each again as the first
   prompt of a fresh session, the file dropped from the page cache, ``ttft_cold_s``);
5. ``--budgets``: a sweep of fixed budgets (forced past the memory model, pressure guard off), the
   curve and where its cliff is;
6. ``--squeeze GB``: the auto run again, with a second balloon of that size inflated halfway through
   the measured generation: decode tok/s and the budget before and after.

``--rounds N`` runs the configurations interleaved, N times (A B C A B C ...): a change in the
machine's load between two configurations spreads over both instead of reading as a difference
between them. Each figure is the median of its rounds, beside its spread, the load average and a
disk probe taken before each child; the ratios are of the medians (``bmoe.bench.rounds``).
``--busy N`` keeps N processes spinning beside the engine through the runs (``bmoe.bench.busy``);
``--disk-limit MiB/s`` holds the streamed runs' reads to that rate (``bmoe.stages.read``: cgroup
``io.max`` where writable, else a token bucket in the read lanes; the report says which).

The like-for-like baseline is llama.cpp's own mmap without repacking (``mmap_norepack``: bmoe's
resident mode, which is llama.cpp with ``use_extra_bufts`` off), the best a llama.cpp user can do
with a model bigger than RAM; stock llama-cpp-python (``mmap``, ``stock_tok_s``) repacks q4_0 into
anonymous memory and is killed past RAM (``--stock-timeout`` bounds how long it may take).

Decisions:

- Each configuration runs in a fresh child process (``python -m bmoe.bench.child``):
  peak RSS is its own, no mapping of an earlier run keeps file pages cached (FADV_DONTNEED does
  nothing to mapped pages), llama.cpp state cannot leak between runs, and a run that dies under a
  RAM limit (OOM kill, GGML_ASSERT) becomes a row that says so instead of ending the bench. The
  cost, about a second of interpreter and library start-up per run, is outside every timed window.
- The model file is dropped from the page cache (fsync + POSIX_FADV_DONTNEED) before every child,
  so each configuration starts cold and pays its own open.
- Warm-up: each child first generates ``--warmup`` tokens from a different prompt (compiles
  nothing, but faults in the dense weights, sizes llama.cpp's buffers and, with a cache, fills it
  with other routing, as in service), then measures the real prompt. "All cached" warms up on the
  measured generation itself, so every expert it routes to is resident when measured. tok/s then
  excludes the measured generation's first token too (it is the prompt's: ``tok_per_s``).
- The device probe runs in the parent before the balloon is inflated: O_DIRECT reads bypass the
  page cache. It reads the model's own slices, not a scratch file: a file just written may be
  served from a cache below the guest (a virtual disk's host), and the model's bytes are what the
  engine reads.

Every figure carries how it was measured (``how``); a figure not measured is null with the reason
in ``notes``, never 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from bmoe.bench import side
from bmoe.bench.balloon import (
    Balloon,
    BalloonPlan,
    GiB,
    available_bytes,
    cgroup_room,
    plan_balloon,
)
from bmoe.bench.busy import Spinners
from bmoe.bench.machine import machine_info
from bmoe.bench.options import (
    GIB_VALUE,
    MIB_S,
    PROMPT,
    SECONDS,
    TTFT_LENGTHS,
    BenchOptions,
    int_list,
    mib_list,
    stream_list,
)
from bmoe.bench.plan import Outcome, Run, plan_runs
from bmoe.bench.report import (
    key_figures_markdown,
    markdown_table,
    out_dir_for,
    write_report,
)
from bmoe.bench.summary import Conditions, Probes, summarize
from bmoe.errors import BmoeError
from bmoe.io.iomax import IoMax
from bmoe.io.layout import split_shard_paths
from bmoe.io.paths import check_output, check_output_dir, check_plot_output
from bmoe.pipeline.budget import read_meminfo
from bmoe.stages.read import disk_limit_plan

LANES = (1, 2, 4, 8)


def add_bench_command(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``bench`` with its handler (``args.func(args)`` returns the exit code)."""
    p = subparsers.add_parser(
        "bench", help="measure resident, mmap and streamed runs of one model side by side",
        description=__doc__.split("\n\n")[0].replace("``", "") if __doc__ else None,
    )
    p.add_argument("model", type=Path, help="GGUF file (shard 1 of a split set)")
    p.add_argument("--ram-limit", type=GIB_VALUE, default=None, metavar="GiB",
                   help="emulate a machine with only this many GiB available (locks the rest)")
    p.add_argument("--tokens", type=int, default=32, help="tokens measured per configuration")
    p.add_argument("--warmup", type=int, default=4, help="warm-up tokens before each measurement")
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--io-threads", type=int, default=2, help="I/O lanes of the streamed runs")
    p.add_argument("-t", "--threads", type=int, default=None, help="compute threads (default: all usable cores)")
    p.add_argument("-c", "--ctx", type=int, default=None, help="context length (default: fits prompt + tokens)")
    p.add_argument("--timeout", type=SECONDS, default=3600.0, help="seconds per configuration")
    p.add_argument("--stock-timeout", type=SECONDS, default=None, metavar="S",
                   help="seconds for stock llama-cpp-python (default: --timeout)")
    p.add_argument("--squeeze", type=GIB_VALUE, default=None, metavar="GiB",
                   help="also run auto with a second balloon of this many GiB inflated halfway through")
    p.add_argument("--budgets", type=mib_list, default=(), metavar="MIB,...",
                   help="a sweep of fixed cache budgets in MiB (forced, pressure guard off)")
    p.add_argument("--ttft", type=int_list, default=TTFT_LENGTHS, metavar="N,...",
                   help="prompt lengths (tokens) whose time to first token the auto run measures; 0 = none")
    p.add_argument("--rounds", type=int, default=1, metavar="N",
                   help="run every configuration N times, interleaved (A B C A B C ...): each figure is the "
                        "median of its rounds, with its spread")
    p.add_argument("--busy", type=int, default=0, metavar="N",
                   help="N processes spinning on a core each beside the engine during the runs (a busy machine)")
    p.add_argument("--disk-limit", type=MIB_S, default=None, metavar="MiB/s",
                   help="the streamed runs read at most this many MiB/s (a slower disk; the report says how)")
    p.add_argument("--streams", type=stream_list, default=(), metavar="N,...",
                   help="measure batched decoding instead: N requests together per count (e.g. 1,2,4,8), "
                        "aggregate tok/s, MiB read per token, equal tokens (bmoe.bench.streams)")
    p.add_argument("--draft", choices=("none", "ngram"), default="none",
                   help="with --streams: also n-gram drafts on a prompt with text to copy and one without")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--plot", type=Path, default=None, metavar="OUT.png", help="PNG path (default: in --out)")
    p.add_argument("--out", type=Path, default=None, metavar="DIR",
                   help="report folder (default: bmoe-bench-<model>-<time> next to the model, else in cwd)")
    p.set_defaults(func=run_bench_command)
    return p


def run_bench_command(args: argparse.Namespace, host: Host | None = None) -> int:
    """``bmoe bench``: check the outputs before measuring anything, measure, print, say where the
    report is. ``host``: the machine as the bench sees it (a test's stand-in; default: this one)."""
    inputs = (args.model, *split_shard_paths(args.model))
    if args.plot is not None:
        check_output(args.plot, "--plot", inputs)
        check_plot_output(args.plot, "--plot")
    if args.out is not None:
        check_output_dir(args.out, "--out", inputs)
        if args.out.is_dir():  # the report's own files must be none of the inputs either
            for name in ("bench.md", "bench.csv", "bench.json", *(() if args.plot is not None else ("bench.png",))):
                check_output(args.out / name, "--out", inputs)
    opts = BenchOptions.from_args(args).validate()
    if opts.streams:
        from bmoe.bench.streams import measure_streams, streams_markdown

        study = measure_streams(opts, log=_stderr_log)
        print(json.dumps(study, default=str) if args.json else streams_markdown(study))
        return 0
    result = run_bench(opts, log=_stderr_log, host=host)
    if args.json:
        print(json.dumps(result, default=str))
    else:
        print(markdown_table(result["runs"]))
        print()
        print(key_figures_markdown(result))
    statuses = [row["status"] for row in result["runs"]]
    if "measured" not in statuses:  # a report of nothing is a failure, said in one line
        print(f"bmoe bench: every configuration failed ({statuses.count('failed')} failed, "
              f"{statuses.count('skipped')} skipped); report in {result['files']['dir']}", file=sys.stderr)
        return 1
    print(f"bmoe bench: report in {result['files']['dir']}", file=sys.stderr)
    return 0


def _stderr_log(line: str) -> None:
    print(f"bmoe bench: {line}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Host:
    """What the bench reads of the machine and how it runs a side, in one place so that a test
    hands in its own (memory numbers, a balloon that reports its pid, a side that fails) instead
    of patching this module: /proc/meminfo, the cgroup's room, the balloon, one configuration's run,
    the spinning processes, how a disk limit is held."""

    meminfo: Callable[[], Mapping[str, int]] = read_meminfo
    cgroup_room: Callable[[], int | None] = cgroup_room
    balloon: Callable[[int], Balloon] = Balloon
    execute: Callable[[Run, Path, BenchOptions, Path], Outcome] = side.execute
    spinners: Callable[[int], Spinners] = Spinners
    disk_limit_plan: Callable[[Sequence[Path], float], tuple[IoMax | None, str]] = disk_limit_plan

    def available(self) -> int:
        return available_bytes(self.meminfo(), self.cgroup_room())[0]


def run_bench(opts: BenchOptions, log: Callable[[str], None] = lambda _l: None,
              host: Host | None = None) -> dict[str, Any]:
    """Measure everything, write the report files, return the JSON object."""
    return Bench(opts.validate(), log, host or Host()).measure()


BALLOON_DIED = "the memory balloon died (OOM kill?): the RAM limit no longer holds"


class Bench:
    """One ``bmoe bench``: the model's layout and the options, the device probes, the balloon and
    the spinning processes around the runs, the runs in rounds; then the summary and the report."""

    def __init__(self, opts: BenchOptions, log: Callable[[str], None], host: Host) -> None:
        from bmoe.io.validate import open_layout

        self.opts, self.log, self.host = opts, log, host
        self.started = datetime.now()
        self.layout = open_layout(opts.model)
        self.model = Path(self.layout.shards[0])
        self.slice_bytes = self.layout.layer_experts(self.layout.moe_layers[0])[0].stride
        # --disk-limit: the choice every streamed run's engine makes at open, and, where that is the
        # cgroup's io.max, its line as it was before any run, put back after every child (a child
        # killed by a timeout or the OOM killer never restores what its engine set).
        self.io_max, self.disk_limit_how = (None, None) if opts.disk_limit_mib_s is None else host.disk_limit_plan(
            self.layout.shards, opts.disk_limit_mib_s)

    def probe(self, lanes: int, what: str = "", fresh: bool = False) -> dict[str, Any]:
        """The device's random-read rate of the model's own slices at ``lanes`` lanes (or the
        probe's failure, said)."""
        from bmoe.io.probe import measure_model

        into = ", into pages never touched before" if fresh else ""
        self.log(f"probe{what}: {lanes} lane(s), {self.slice_bytes} byte slices{into}")
        try:
            return dataclasses.asdict(measure_model(self.layout, lanes, fresh=fresh))
        except (OSError, BmoeError) as e:
            return {"mib_s": None, "slice_bytes": self.slice_bytes, "lanes": lanes, "mode": None, "reads": None,
                    "how": f"probe failed on {self.model}: {type(e).__name__}: {e}", "fresh": fresh}

    def measure(self) -> dict[str, Any]:
        from bmoe.engine.streaming import FRESH_LANES

        opts, host, layout = self.opts, self.host, self.layout
        machine = machine_info(self.model, host.meminfo())
        plan: BalloonPlan | None = None
        if opts.ram_limit_bytes is not None:  # refuse a bad limit before measuring anything
            plan = plan_balloon(opts.ram_limit_bytes, layout.dense_bytes, meminfo=host.meminfo(),
                                cgroup=host.cgroup_room())
        out_dir = out_dir_for(opts, self.model, self.started)
        probes = [self.probe(n) for n in sorted(set(LANES) | {opts.io_threads})]
        probe_fresh = self.probe(FRESH_LANES * opts.io_threads, fresh=True)  # the lanes a fresh cache reads on
        balloon_info: dict[str, Any] = {"limit_bytes": opts.ram_limit_bytes}
        busy_info: dict[str, Any] = {"processes": opts.busy}
        with side.terminate_as_exit(), tempfile.TemporaryDirectory(prefix="bmoe-bench-") as scratch:
            balloon = host.balloon(plan.lock_bytes) if plan is not None and plan.lock_bytes > 0 else None
            try:
                if balloon is not None and plan is not None:
                    self.log(f"balloon: locking {plan.lock_bytes / GiB:.2f} GiB ({plan.how})")
                    balloon.inflate()
                    balloon_info |= {"pid": balloon.pid, "inflate_s": balloon.inflate_s}
                if plan is not None:
                    balloon_info |= {"lock_bytes": plan.lock_bytes, "how": plan.how,
                                     "available_before_bytes": plan.available_bytes}
                avail_now, avail_how = available_bytes(host.meminfo(), host.cgroup_room())
                balloon_info["available_after_inflate_bytes"] = avail_now
                balloon_info["room_how"] = avail_how
                budget_room = min(avail_now, opts.ram_limit_bytes) if opts.ram_limit_bytes else avail_now
                runs = plan_runs(layout, opts, budget_room)
                with host.spinners(opts.busy) as spinners:
                    busy_info["pids"] = spinners.pids
                    self.run_rounds(runs, balloon, Path(scratch))
                    busy_info["alive_at_end"] = spinners.alive()
                balloon_info["alive_at_end"] = balloon.alive() if balloon is not None else None
                balloon_info["available_at_end_bytes"] = host.available()
            finally:
                if balloon is not None:
                    balloon.release()
        probe_end = self.probe(opts.io_threads, " again, after the runs")  # how far the device's rate drifted
        busy_info["how"] = Spinners(opts.busy).how if opts.busy else "none: the machine as it was"
        result = summarize(runs, Probes(probes, probe_fresh, probe_end), layout, opts, machine,
                           Conditions(balloon_info, busy_info, self.disk_limit_how), self.started)
        write_report(result, out_dir, opts.plot)
        return result

    def run_rounds(self, runs: list[Run], balloon: Balloon | None, scratch: Path) -> None:
        """Every configuration not skipped once, in plan order, ``--rounds`` times over (A B C A B
        C ...); then each run's rounds folded into its figures. A balloon that died stops the
        limit: no configuration runs after it (a run with rounds already keeps them, and says so)."""
        for round_no in range(self.opts.rounds):
            for run in runs:
                if run.skip is None and balloon is not None and not balloon.alive():
                    if run.rounds:
                        run.rounds.append(Outcome(error=BALLOON_DIED))
                        continue
                    run.skip = BALLOON_DIED
                if run.skip is not None:
                    if round_no == 0 or run.skip == BALLOON_DIED:
                        self.log(f"{run.label}: skipped: {run.skip}")
                    continue
                self.run_side(run, round_no, scratch)
        for run in runs:
            run.settle()

    def run_side(self, run: Run, round_no: int, scratch: Path) -> None:
        """One round of ``run``: the device probed at the runs' lanes, the file dropped from the
        page cache, the memory and load noted, then its child."""
        from bmoe.io.pagecache import evict_file_cache

        opts = self.opts
        which = f"round {round_no + 1} of {opts.rounds}" if opts.rounds > 1 else ""
        row_probe = self.probe(opts.io_threads, f" before {run.id}" + (f", {which}" if which else ""))["mib_s"]
        evict_file_cache(self.layout.shards)
        mem, load = self.host.available(), os.getloadavg()[0]
        self.log(f"{run.label}: running" + (f" ({which})" if which else ""))
        try:
            outcome = self.host.execute(run, self.model, opts, scratch)
        finally:
            if self.io_max is not None:
                self.io_max.restore()
        outcome.mem_available_before, outcome.load_before, outcome.probe_mib_s = mem, load, row_probe
        run.rounds.append(outcome)
        if outcome.error:
            self.log(f"{run.label}: failed: {outcome.error}")
        else:
            tok_s = (outcome.result or {}).get("stats", {}).get("tok_per_s")
            self.log(f"{run.label}: {'n/a' if tok_s is None else f'{tok_s:.2f}'} tok/s")

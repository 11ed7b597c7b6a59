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

The like-for-like baseline is llama.cpp's own mmap without repacking (``mmap_norepack``: bmoe's
resident mode, which is llama.cpp with ``use_extra_bufts`` off), the best a llama.cpp user can do
with a model bigger than RAM; stock llama-cpp-python (``mmap``, ``stock_tok_s``) repacks q4_0 into
anonymous memory and is killed past RAM (``--stock-timeout`` bounds how long it may take).

Decisions:

- Each configuration runs in a fresh child process (``python -m bmoe.bench.harness --child``):
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
import csv
import dataclasses
import json
import math
import os
import platform
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import aclosing, contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from bmoe.argtypes import checked, plain
from bmoe.bench.balloon import (
    Balloon,
    BalloonPlan,
    GiB,
    available_bytes,
    cgroup_room,
    plan_balloon,
)
from bmoe.engine.aio import run as run_async
from bmoe.engine.config import MAX_CTX
from bmoe.errors import BmoeError, ConfigError
from bmoe.io.layout import split_shard_paths
from bmoe.io.pagecache import read_io_bytes
from bmoe.io.paths import (
    check_output,
    check_output_dir,
    check_plot_output,
    replace_with_text,
)
from bmoe.metrics.tokens import peak_rss_bytes
from bmoe.pipeline.budget import read_meminfo

MiB = 1 << 20
PROMPT = "The quick brown fox jumps over the lazy dog, and the experts stream from disk."
WARMUP_PROMPT = "Warm-up: a different prompt, so the measured routing is not pre-read."
LANES = (1, 2, 4, 8)
RUN_HEADROOM = 512 * MiB  # beyond the weights a run needs: KV, compute buffers, the interpreter
STREAMED = ("stream_off", "overlap", "stream_below_ws", "stream_half_bank", "stream_auto")  # for stream_tok_s
TTFT_LENGTHS = (5, 50, 200, 1000)
SQUEEZE_TOKENS_CAP = 4  # a squeezed generation runs on to at most this many times --tokens
TTFT_TEXT = "the experts of this layer stream from the disk while the next token waits for them "

# Read once per meminfo, replaced by tests to inject numbers.
meminfo_reader: Callable[[], Mapping[str, int]] = read_meminfo


# --- command line ---------------------------------------------------------------------------


def _positive(hi: float, what: str) -> Callable[[str], float]:
    """A finite number above 0 and at most ``hi`` (nan, inf and 1e300 ended in an internal error)."""
    return checked(float, lambda v: math.isfinite(v) and 0 < v <= hi, what, f" above 0 and at most {plain(hi)}")


_GIB_VALUE = _positive(1 << 20, "GiB")  # --ram-limit, --squeeze
_SECONDS = _positive(1e7, "seconds")  # --timeout, --stock-timeout


def _mib_list(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MiB values separated by commas, got {text!r}") from None
    if not values or not all(math.isfinite(v) and 1 <= v <= 1 << 30 for v in values):
        raise argparse.ArgumentTypeError(f"budgets must be from 1 to {1 << 30} MiB each, got {text!r}")
    return values


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected token counts separated by commas, got {text!r}") from None
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"token counts cannot be negative, got {text!r}")
    return tuple(v for v in values if v > 0)


def add_bench_command(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``bench`` with its handler (``args.func(args)`` returns the exit code)."""
    p = subparsers.add_parser(
        "bench", help="measure resident, mmap and streamed runs of one model side by side",
        description=__doc__.split("\n\n")[0].replace("``", "") if __doc__ else None,
    )
    p.add_argument("model", type=Path, help="GGUF file (shard 1 of a split set)")
    p.add_argument("--ram-limit", type=_GIB_VALUE, default=None, metavar="GiB",
                   help="emulate a machine with only this many GiB available (locks the rest)")
    p.add_argument("--tokens", type=int, default=32, help="tokens measured per configuration")
    p.add_argument("--warmup", type=int, default=4, help="warm-up tokens before each measurement")
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--io-threads", type=int, default=2, help="I/O lanes of the streamed runs")
    p.add_argument("-t", "--threads", type=int, default=None, help="compute threads (default: all usable cores)")
    p.add_argument("-c", "--ctx", type=int, default=None, help="context length (default: fits prompt + tokens)")
    p.add_argument("--timeout", type=_SECONDS, default=3600.0, help="seconds per configuration")
    p.add_argument("--stock-timeout", type=_SECONDS, default=None, metavar="S",
                   help="seconds for stock llama-cpp-python (default: --timeout)")
    p.add_argument("--squeeze", type=_GIB_VALUE, default=None, metavar="GiB",
                   help="also run auto with a second balloon of this many GiB inflated halfway through")
    p.add_argument("--budgets", type=_mib_list, default=(), metavar="MIB,...",
                   help="a sweep of fixed cache budgets in MiB (forced, pressure guard off)")
    p.add_argument("--ttft", type=_int_list, default=TTFT_LENGTHS, metavar="N,...",
                   help="prompt lengths (tokens) whose time to first token the auto run measures; 0 = none")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--plot", type=Path, default=None, metavar="OUT.png", help="PNG path (default: in --out)")
    p.add_argument("--out", type=Path, default=None, metavar="DIR",
                   help="report folder (default: bmoe-bench-<model>-<time> next to the model, else in cwd)")
    p.set_defaults(func=run_bench_command)
    return p


@dataclass(frozen=True)
class BenchOptions:
    model: Path
    tokens: int = 32
    warmup: int = 4
    prompt: str = PROMPT
    io_threads: int = 2
    threads: int | None = None
    ctx: int | None = None
    ram_limit_bytes: int | None = None
    timeout_s: float = 3600.0
    out: Path | None = None
    plot: Path | None = None
    stock_timeout_s: float | None = None
    squeeze_bytes: int | None = None
    budgets_mib: tuple[float, ...] = ()
    ttft_lengths: tuple[int, ...] = TTFT_LENGTHS

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> BenchOptions:
        return cls(
            model=args.model, tokens=args.tokens, warmup=args.warmup, prompt=args.prompt,
            io_threads=args.io_threads, threads=args.threads, ctx=args.ctx,
            ram_limit_bytes=None if args.ram_limit is None else int(args.ram_limit * GiB),
            timeout_s=args.timeout, out=args.out, plot=args.plot, stock_timeout_s=args.stock_timeout,
            squeeze_bytes=None if args.squeeze is None else int(args.squeeze * GiB),
            budgets_mib=tuple(args.budgets), ttft_lengths=tuple(args.ttft),
        )

    def validate(self) -> BenchOptions:
        if self.tokens < 2:
            raise ConfigError(f"--tokens must be at least 2 (tok/s counts the tokens after the first), got {self.tokens}")
        if self.warmup < 0:
            raise ConfigError(f"--warmup must be >= 0, got {self.warmup}")
        if not self.prompt:
            raise ConfigError("--prompt is empty")
        if not 1 <= self.io_threads <= 64:
            raise ConfigError(f"--io-threads must be 1..64, got {self.io_threads}")
        if self.threads is not None and not 1 <= self.threads <= 512:
            raise ConfigError(f"--threads must be 1..512, got {self.threads}")
        if not 16 <= self.n_ctx <= MAX_CTX:
            raise ConfigError(f"the runs need a context of {self.n_ctx} tokens (--ctx, or the longest --ttft prompt "
                              f"plus --tokens); at most {MAX_CTX}")
        return self

    @property
    def n_threads(self) -> int:
        return self.threads or max(1, len(os.sched_getaffinity(0)))

    @property
    def n_ctx(self) -> int:
        """A context every run fits: at most one token per prompt byte, plus BOS and the tokens."""
        if self.ctx is not None:
            return self.ctx
        gen = max(self.tokens * (SQUEEZE_TOKENS_CAP if self.squeeze_bytes else 1), self.warmup)
        need = max(len(self.prompt.encode()) + gen, max(self.ttft_lengths, default=0)) + 8
        return max(512, -(-need // 256) * 256)


def run_bench_command(args: argparse.Namespace) -> int:
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
    result = run_bench(opts, log=_stderr_log)
    if args.json:
        print(json.dumps(result, default=str))
    else:
        print(markdown_table(result["runs"]))
        print()
        print(key_figures_markdown(result))
    print(f"bmoe bench: report in {result['files']['dir']}", file=sys.stderr)
    return 0


def _stderr_log(line: str) -> None:
    print(f"bmoe bench: {line}", file=sys.stderr, flush=True)


# --- the plan -------------------------------------------------------------------------------


@dataclass
class Run:
    """One configuration: its child spec, or the reason it is skipped; then what it measured."""

    id: str
    label: str
    kind: str  # "bmoe" or "mmap"
    config: dict[str, Any] = field(default_factory=dict)  # RunConfig keyword arguments
    warmup: str = "short"  # "short": --warmup tokens of WARMUP_PROMPT; "same": the measured generation
    skip: str | None = None
    budget_bytes: int | None = None
    budget_note: str | None = None
    result: dict[str, Any] | None = None
    error: str | None = None
    mem_available_before: int | None = None
    load_before: float | None = None  # 1-minute load average when the child started
    timeout_s: float | None = None  # this run's own bound (default: --timeout)
    extra: dict[str, Any] = field(default_factory=dict)  # child spec additions (ttft, squeeze)


# Interpreter, llama.cpp's KV and compute buffers, read lanes: measured about 130 MiB on small
# models; twice that for margin.
_PROCESS_OVERHEAD = 256 * MiB


def plan_runs(layout: Any, opts: BenchOptions, available: int) -> list[Run]:
    """The configurations, in run order, each with its budget or the reason it is skipped.
    ``available``: memory the runs may use (the RAM limit, or MemAvailable)."""
    common = {"io_threads": opts.io_threads, "n_threads": opts.n_threads, "n_ctx": opts.n_ctx}
    dense, bank = layout.dense_bytes, layout.expert_bytes
    working_set = layout.expert_bytes_per_token()
    file_bytes = layout.file_bytes

    def fits(nbytes: int, what: str) -> str | None:
        if nbytes + RUN_HEADROOM <= available:
            return None
        return (f"{what} ({nbytes / GiB:.2f} GiB) + {RUN_HEADROOM // MiB} MiB headroom exceed the "
                f"{available / GiB:.2f} GiB available")

    resident_skip = fits(file_bytes, "the model file")
    runs = [
        Run("resident", "resident (bmoe, whole file mapped)", "bmoe", {"mode": "resident", **common},
            skip=resident_skip),
        Run("mmap_norepack", "llama.cpp mmap, no repacking (bmoe --resident), under the limit", "bmoe",
            {"mode": "resident", **common},
            skip=None if resident_skip else "the resident run is this configuration (the file fits)"),
        Run("mmap", "mmap (stock llama-cpp-python)", "mmap", dict(common), timeout_s=opts.stock_timeout_s),
        Run("stream_off", "stream, cache off", "bmoe", {"mode": "stream", "cache_bytes": 0, **common}),
    ]
    overlap = Run("overlap", "stream, cache off, overlap", "bmoe",
                  {"mode": "stream", "cache_bytes": 0, "overlap": True, **common})
    runs.append(overlap)

    def cached(run_id: str, label: str, budget: int, note: str | None, warmup: str = "short") -> Run:
        budget = max(MiB, -(-budget // MiB) * MiB)  # RunConfig takes 0 or >= 1 MiB
        run = Run(run_id, label.format(mib=f"{budget / MiB:.0f} MiB"), "bmoe",
                  {"mode": "stream", "cache_bytes": budget, **common}, warmup=warmup,
                  budget_bytes=budget, budget_note=note)
        run.skip = fits(dense + budget, "dense part + cache budget")
        return run

    below = max(MiB, working_set // 2)
    clamped = below >= working_set  # a tiny model: the label must not claim what the run is not
    runs.append(cached(
        "stream_below_ws",
        "stream, cache {mib} (the 1 MiB minimum, not below one token's working set)" if clamped
        else "stream, cache {mib} (below one token's working set)", below,
        f"clamped to the 1 MiB minimum, which is not below the {working_set / MiB:.2f} MiB working set"
        if clamped else None,
    ))
    # Under a RAM limit, the middle budget is what the limit leaves when half the bank does not fit:
    # the configuration a user of that machine would run.
    room = available - dense - RUN_HEADROOM - _PROCESS_OVERHEAD
    middle, middle_note = bank // 2, None
    if middle > room >= MiB:
        middle = room
        middle_note = f"half the bank does not fit: as much as the memory available leaves ({room / MiB:.0f} MiB)"
    runs.append(cached("stream_half_bank", "stream, cache {mib} (about half the expert bank, or what fits)",
                       middle, middle_note))
    runs.append(cached("all_cached", "stream, all cached (cache {mib} >= bank, warm)", bank, None, warmup="same"))
    for run in runs:  # the harness's own sizes: run as chosen (the memory model may be stricter)
        if run.id in ("stream_below_ws", "stream_half_bank", "all_cached"):
            run.config["force_cache"] = True
    auto = {"mode": "stream", "cache_bytes": None, **common}
    runs.append(Run("stream_auto", "stream, auto budget (pressure guard on)", "bmoe", dict(auto),
                    extra={"ttft_lengths": [n for n in opts.ttft_lengths if n + 2 <= opts.n_ctx]}))
    for mib in opts.budgets_mib:
        budget = int(mib * MiB)
        runs.append(Run(f"sweep_{mib:g}", f"stream, fixed budget {mib:g} MiB (forced, guard off)", "bmoe",
                        {"mode": "stream", "cache_bytes": budget, "force_cache": True, "pressure_guard": False,
                         **common}, budget_bytes=budget))
    if opts.squeeze_bytes:
        squeeze = Run("squeeze", f"stream, auto budget, {opts.squeeze_bytes / GiB:g} GiB taken halfway", "bmoe",
                      dict(auto), extra={"squeeze_bytes": opts.squeeze_bytes})
        # The balloon is locked and kept from the OOM killer: one larger than the room beside the
        # run's own needs would make the kernel kill the run, or other programs, instead.
        if opts.squeeze_bytes > room:
            squeeze.skip = (f"--squeeze {opts.squeeze_bytes / GiB:.2f} GiB is more than the {max(room, 0) / GiB:.2f} GiB "
                            f"the {available / GiB:.2f} GiB available leave beside the dense part and the run's "
                            "headroom: the locked balloon would push the run or other programs out of memory")
        runs.append(squeeze)
    return runs


# --- running ---------------------------------------------------------------------------------


def run_bench(opts: BenchOptions, log: Callable[[str], None] = lambda _l: None) -> dict[str, Any]:
    """Measure everything, write the report files, return the JSON object."""
    from bmoe.engine.streaming import FRESH_LANES
    from bmoe.io.pagecache import evict_file_cache
    from bmoe.io.probe import measure_model
    from bmoe.io.validate import open_layout

    opts.validate()
    started = datetime.now()
    layout = open_layout(opts.model)
    model = Path(layout.shards[0])
    first_moe = layout.moe_layers[0]
    slice_bytes = layout.layer_experts(first_moe)[0].stride
    machine = machine_info(model)
    plan: BalloonPlan | None = None
    if opts.ram_limit_bytes is not None:  # refuse a bad limit before measuring anything
        plan = plan_balloon(opts.ram_limit_bytes, layout.dense_bytes, meminfo=meminfo_reader(),
                            cgroup=cgroup_room())
    out_dir = _out_dir(opts, model, started)

    def probe(lanes: int, what: str = "", fresh: bool = False) -> dict[str, Any]:
        into = ", into pages never touched before" if fresh else ""
        log(f"probe{what}: {lanes} lane(s), {slice_bytes} byte slices{into}")
        try:
            return dataclasses.asdict(measure_model(layout, lanes, fresh=fresh))
        except (OSError, BmoeError) as e:
            return {"mib_s": None, "slice_bytes": slice_bytes, "lanes": lanes, "mode": None, "reads": None,
                    "how": f"probe failed on {model}: {type(e).__name__}: {e}", "fresh": fresh}

    probes = [probe(n) for n in sorted(set(LANES) | {opts.io_threads})]
    probe_fresh = probe(FRESH_LANES * opts.io_threads, fresh=True)  # the lanes a fresh cache's reads run on

    balloon_info: dict[str, Any] = {"limit_bytes": opts.ram_limit_bytes}
    with _terminate_as_exit(), tempfile.TemporaryDirectory(prefix="bmoe-bench-") as scratch:
        balloon = Balloon(plan.lock_bytes) if plan is not None and plan.lock_bytes > 0 else None
        try:
            if balloon is not None:
                log(f"balloon: locking {plan.lock_bytes / GiB:.2f} GiB ({plan.how})")
                balloon.inflate()
                balloon_info |= {"pid": balloon.pid, "inflate_s": balloon.inflate_s}
            if plan is not None:
                balloon_info |= {"lock_bytes": plan.lock_bytes, "how": plan.how,
                                 "available_before_bytes": plan.available_bytes}
            avail_now, avail_how = available_bytes(meminfo_reader(), cgroup_room())
            balloon_info["available_after_inflate_bytes"] = avail_now
            balloon_info["room_how"] = avail_how
            budget_room = min(avail_now, opts.ram_limit_bytes) if opts.ram_limit_bytes else avail_now
            runs = plan_runs(layout, opts, budget_room)
            for run in runs:
                if run.skip is None and balloon is not None and not balloon.alive():
                    run.skip = "the memory balloon died (OOM kill?): the RAM limit no longer holds"
                if run.skip is not None:
                    log(f"{run.label}: skipped: {run.skip}")
                    continue
                evict_file_cache(layout.shards)
                run.mem_available_before = available_bytes(meminfo_reader(), cgroup_room())[0]
                run.load_before = os.getloadavg()[0]
                log(f"{run.label}: running")
                execute(run, model, opts, Path(scratch))
                if run.error:
                    log(f"{run.label}: failed: {run.error}")
                else:
                    tok_s = (run.result or {}).get("stats", {}).get("tok_per_s")
                    log(f"{run.label}: {'n/a' if tok_s is None else f'{tok_s:.2f}'} tok/s")
            balloon_info["alive_at_end"] = balloon.alive() if balloon is not None else None
            balloon_info["available_at_end_bytes"] = available_bytes(meminfo_reader(), cgroup_room())[0]
        finally:
            if balloon is not None:
                balloon.release()
    probe_end = probe(opts.io_threads, " again, after the runs")  # how far the device's rate drifted
    result = summarize(runs, probes, layout, opts, machine, balloon_info, started, probe_fresh, probe_end)
    write_report(result, out_dir, opts.plot)
    return result


@contextmanager
def _terminate_as_exit() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C (finally blocks run: the balloon and a running child die)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def execute(run: Run, model: Path, opts: BenchOptions, scratch: Path) -> None:
    """Run one configuration in a child process; fills ``run.result`` or ``run.error``."""
    spec = {
        "kind": run.kind, "model": str(model), "config": run.config, "prompt": opts.prompt,
        "tokens": opts.tokens, "warmup": run.warmup, "warmup_tokens": opts.warmup,
        "warmup_prompt": WARMUP_PROMPT, "n_threads": opts.n_threads, "n_ctx": opts.n_ctx, **run.extra,
    }
    timeout = run.timeout_s or opts.timeout_s
    spec_path, result_path = scratch / f"{run.id}.spec.json", scratch / f"{run.id}.result.json"
    spec_path.write_text(json.dumps(spec))
    result_path.unlink(missing_ok=True)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "bmoe.bench.harness", "--child", str(spec_path), str(result_path)],
            check=False, capture_output=True, text=True, timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        partial = json.loads(result_path.read_text()) if result_path.exists() else {}
        if "partial" in partial:  # the measured generation finished: keep it, say what is missing
            missing = f"timed out after {timeout:.0f} s {partial.pop('partial')}"
            partial["warnings"] = [*partial.get("warnings", []), missing]
            run.result = partial
        else:
            run.error = f"timed out after {timeout:.0f} s"
        return
    if result_path.exists():
        data = json.loads(result_path.read_text())
        if "error" in data:
            run.error = data["error"]
        else:
            run.result = data
        return
    tail = (proc.stderr.strip().splitlines() or [""])[-1]
    if proc.returncode < 0:
        try:
            name = signal.Signals(-proc.returncode).name
        except ValueError:
            name = f"signal {-proc.returncode}"
        how = f"killed by {name}"
    else:
        how = f"exit status {proc.returncode}"
    # SIGKILL: the kernel's OOM killer, most likely; SIGABRT/SIGILL: llama.cpp aborting (GGML_ASSERT,
    # a failed allocation) or an instruction this CPU lacks.
    why = {-signal.SIGKILL: " (out of memory?)",
           -signal.SIGABRT: " (llama.cpp aborted: an assertion or a failed allocation?)",
           -signal.SIGILL: " (llama.cpp aborted, or an instruction this CPU lacks)"}.get(proc.returncode, "")
    run.error = f"child {how}" + (f": {tail}" if tail else "") + why


# --- the child ----------------------------------------------------------------------------------


def _delta(a: int | None, b: int | None) -> int | None:
    return None if a is None or b is None else b - a


async def _bmoe_child(spec: dict[str, Any], checkpoint: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    from bmoe.engine.config import RunConfig
    from bmoe.engine.session import Session

    config = RunConfig(**spec["config"])
    t0 = time.perf_counter()
    with Session.open(spec["model"], config) as s:
        open_s = time.perf_counter() - t0
        warm = None
        if spec["warmup"] == "same":
            warm = await s.generate(spec["prompt"], spec["tokens"], stop_at_end=False)
        elif spec["warmup_tokens"] > 0:
            warm = await s.generate(spec["warmup_prompt"], spec["warmup_tokens"], stop_at_end=False)
        io0, faults0 = read_io_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_majflt
        squeeze = None
        if spec.get("squeeze_bytes"):
            tokens, squeeze = await _squeezed_generation(s, spec)
            stats = s.last_stats
        else:
            g = await s.generate(spec["prompt"], spec["tokens"], stop_at_end=False)
            tokens, stats = g.tokens, g.stats
        io1, faults1 = read_io_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_majflt
        assert stats is not None
        out = {
            "tokens": tokens, "stats": stats.as_dict(), "open_s": open_s,
            "open_mode": s.open_mode, "open_reason": s.open_reason, "io_mode": s.io_mode,
            "io_fallback_reason": s.io_fallback_reason, "warnings": s.warnings, "budget_how": s.budget_how,
            "warmup_stats": warm.stats.as_dict() if warm is not None and warm.stats is not None else None,
            "disk_read_bytes": _delta(io0, io1), "major_faults": faults1 - faults0,
            "ttft_s": None, "ttft_detail": None, "ttft_cold_s": None, "ttft_cold_detail": None,
            "squeeze": squeeze, "map_count": _map_count(),
        }
        lengths = spec.get("ttft_lengths") or ()
        if lengths:  # a timeout in the prompts below keeps the measured generation
            checkpoint(out | {"partial": "during the time-to-first-token prompts: those are missing",
                              "peak_rss_bytes": peak_rss_bytes()})
        out["ttft_s"], out["ttft_detail"] = await _ttft(s, lengths)
    if lengths:  # cold: a fresh session per prompt (empty cache), the file dropped from the page cache
        checkpoint(out | {"partial": "during the cold time-to-first-token prompts: those are missing",
                          "peak_rss_bytes": peak_rss_bytes()})
        out["ttft_cold_s"], out["ttft_cold_detail"] = await _ttft_cold(spec, config, lengths)
    if lengths and config.predicts_prompts:
        # The same prompts with the prompt's read-ahead off, side by side: its reads and compute
        # run in turn, so wall less wait is the compute the floors take (with read-ahead on, the
        # wall less the wait also holds the reads the compute hid).
        serial = dataclasses.replace(config, predict_prompt=False)
        checkpoint(out | {"partial": "during the prompts without read-ahead: those are missing",
                          "peak_rss_bytes": peak_rss_bytes()})
        out["ttft_no_predict_s"], out["ttft_no_predict_detail"] = await _ttft_replayed(spec, serial, lengths)
        out["ttft_cold_no_predict_s"], out["ttft_cold_no_predict_detail"] = await _ttft_cold(spec, serial, lengths)
    return out


async def _ttft_replayed(spec: dict[str, Any], config: Any, lengths: Any) -> tuple[Any, Any]:
    """The warm prompts again in a fresh session of ``config`` with the same history as the
    measured run's (its warm-up, then its measured generation), so the cache starts alike."""
    from bmoe.engine.session import Session

    with Session.open(spec["model"], config) as s:
        if spec["warmup_tokens"] > 0:
            await s.generate(spec["warmup_prompt"], spec["warmup_tokens"], stop_at_end=False)
        await s.generate(spec["prompt"], spec["tokens"], stop_at_end=False)
        return await _ttft(s, lengths)


def _map_count() -> int | None:
    """Memory mappings this process holds (page moves split them; the kernel caps them)."""
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:
        return None


async def _ttft(s: Any, lengths: Any) -> tuple[dict[str, float] | None, dict[str, dict[str, Any]] | None]:
    """Prefill seconds of prompts of about each length in tokens, keyed by their exact length (one
    generated token each, one after another: the cache warm from what ran before); and per length
    what the prefill read and waited for, which its physical floor is computed from."""
    if not lengths:
        return None, None
    out: dict[str, float] = {}
    detail: dict[str, dict[str, Any]] = {}
    for n in lengths:
        _first_token(await s.generate(_prompt_of(s, n), 1, stop_at_end=False), out, detail)
    return out, detail


async def _ttft_cold(spec: dict[str, Any], config: Any, lengths: Any) -> tuple[dict[str, float], dict[str, dict[str, Any]]]:
    """The same prompts, each the first of a fresh session (an empty cache) opened after the file
    was dropped from the page cache: a user's first request. The open is not counted."""
    from bmoe.engine.session import Session
    from bmoe.io.pagecache import evict_file_cache

    out: dict[str, float] = {}
    detail: dict[str, dict[str, Any]] = {}
    for n in lengths:
        evict_file_cache([spec["model"]])
        with Session.open(spec["model"], config) as s:
            _first_token(await s.generate(_prompt_of(s, n), 1, stop_at_end=False), out, detail)
    return out, detail


def _prompt_of(s: Any, n: int) -> str:
    """The longest start of the TTFT text that is at most ``n`` tokens."""
    text = TTFT_TEXT * (1 + n // 4)
    lo, hi = 1, len(text)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(s.tokenize(text[:mid])) <= n:
            lo = mid
        else:
            hi = mid - 1
    return text[:lo]


def _first_token(g: Any, out: dict[str, float], detail: dict[str, dict[str, Any]]) -> None:
    assert g.stats is not None
    key = str(g.stats.prompt_tokens)
    out[key] = g.stats.prefill_s
    detail[key] = {"prefill_s": g.stats.prefill_s, "bytes_read": g.stats.bytes_read,
                   "blocked_s": g.stats.blocked_s, "hit_pct": g.stats.cache_hit_pct,
                   "recycled_bytes": g.stats.recycled_bytes}


async def _squeezed_generation(s: Any, spec: dict[str, Any]) -> tuple[list[int], dict[str, Any]]:
    """The measured generation with a second balloon started halfway: decode tok/s over the tokens
    before it started and over as many after it held all its memory (the generation runs on, up to
    four times --tokens, until there are that many), and the budget at each point."""
    from bmoe.bench.balloon import Balloon, has_cap_ipc_lock

    n = spec["tokens"]
    half = max(2, n // 2)
    cap = SQUEEZE_TOKENS_CAP * n
    balloon = Balloon(spec["squeeze_bytes"], lock=has_cap_ipc_lock())
    walls: list[float] = []
    tokens: list[int] = []
    started_at = held_at = None
    budget_before = budget_after_hold = None
    try:
        # Closed on the break below, so the generation's stats are final (budget at the end, changes,
        # reads, hits) before they are read: a generator left open finishes them only when collected.
        async with aclosing(s.stream(spec["prompt"], cap, stop_at_end=False)) as pieces:
            async for piece in pieces:
                if piece.token is None:
                    continue
                tokens.append(piece.token)
                if piece.metrics is not None:
                    walls.append(piece.metrics.wall_ms / 1e3)
                if started_at is not None and held_at is None and balloon.ready_nowait():
                    held_at, budget_after_hold = len(tokens), s.budget_bytes
                if len(tokens) == half:
                    budget_before = s.budget_bytes
                    balloon.start()
                    started_at = len(tokens)
                if held_at is not None and len(tokens) - held_at >= max(2, half - 1):
                    break
    finally:
        inflate_s = balloon.inflate_s
        balloon.release()
    n = len(tokens)

    def rate(first: int, last: int) -> float | None:
        """Decode tok/s of tokens [first, last) (index 0 is the prompt's: not decode)."""
        span = walls[max(first, 1):last]
        return len(span) / sum(span) if len(span) >= 1 and sum(span) > 0 else None

    after_from = held_at if held_at is not None else started_at
    stats = s.last_stats
    return tokens, {
        "tok_per_s_before": rate(1, half), "tok_per_s_after": rate(after_from or n, n),
        "budget_bytes_before": budget_before,
        "budget_bytes_after": stats.budget_bytes_end if stats is not None else None,
        "budget_bytes_when_held": budget_after_hold,
        "budget_changes": stats.budget_changes if stats is not None else None,
        "squeeze_bytes": spec["squeeze_bytes"], "locked": balloon.lock, "started_after_token": started_at,
        "held_after_token": held_at, "inflate_s": inflate_s,
        "tokens": n,
        "how": ("decode tok/s: tokens over the summed wall time of their decode calls; before = tokens 2.."
                f"{half}, after = those after the balloon said it held all its memory"
                + ("" if held_at is not None else f" (it never did within {cap} tokens: after its start instead)")),
    }


def _mmap_child(spec: dict[str, Any]) -> dict[str, Any]:
    import llama_cpp
    import numpy as np

    t0 = time.perf_counter()
    llm = llama_cpp.Llama(model_path=spec["model"], n_ctx=spec["n_ctx"], n_threads=spec["n_threads"],
                          n_threads_batch=spec["n_threads"], verbose=False)
    open_s = time.perf_counter() - t0
    n_vocab = llm.n_vocab()

    def generate(prompt: str, n: int) -> dict[str, Any]:
        llm.reset()  # the next eval drops every KV position from 0 on
        tokens = llm.tokenize(prompt.encode("utf-8"), add_bos=True, special=False)
        t = time.perf_counter()
        llm.eval(tokens)
        prefill_s, decode_s, out = time.perf_counter() - t, 0.0, []
        for i in range(n):
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))
            token = int(np.argmax(logits))
            out.append(token)
            if i + 1 == n:
                break
            t = time.perf_counter()
            llm.eval([token])
            decode_s += time.perf_counter() - t
        return {
            "tokens": out, "prompt_tokens": len(tokens), "generated_tokens": len(out),
            "prefill_s": prefill_s, "decode_s": decode_s,
            "tok_per_s": (len(out) - 1) / decode_s if len(out) > 1 and decode_s > 0 else None,
        }

    warm = None
    if spec["warmup_tokens"] > 0:
        warm = generate(spec["warmup_prompt"], spec["warmup_tokens"])
    io0, faults0 = read_io_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_majflt
    g = generate(spec["prompt"], spec["tokens"])
    io1, faults1 = read_io_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_majflt
    tokens = g.pop("tokens")
    if warm is not None:
        warm.pop("tokens")
    llm.close()
    return {
        "tokens": tokens, "stats": {"mode": "mmap", **g}, "open_s": open_s, "open_mode": "mmap (stock)",
        "warmup_stats": warm, "disk_read_bytes": _delta(io0, io1), "major_faults": faults1 - faults0,
    }


def child_main(spec_path: str, result_path: str) -> int:
    from bmoe.bench.balloon import die_with_parent, offer_to_oom_killer

    die_with_parent()
    offer_to_oom_killer()
    spec = json.loads(Path(spec_path).read_text())
    try:
        if spec["kind"] == "mmap":
            out = _mmap_child(spec)
        else:
            out = run_async(_bmoe_child(spec, lambda partial: _write_json(Path(result_path), partial)))
        out["peak_rss_bytes"] = peak_rss_bytes()  # VmHWM: ru_maxrss would carry the parent's peak
        code = 0
    except BmoeError as e:
        out, code = {"error": f"{type(e).__name__}: {e}"}, 1
    except Exception as e:  # noqa: BLE001 - a child reports any failure as its row's error
        out, code = {"error": f"{type(e).__name__}: {e}"}, 1
    _write_json(Path(result_path), out)
    return code


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """Whole or not at all: the parent may read the file the moment it kills a child that timed out."""
    replace_with_text(path, json.dumps(data))


# --- summarizing ----------------------------------------------------------------------------------


def _r(value: float | None, digits: int = 2) -> float | None:
    return None if value is None else round(value, digits)


def _row(run: Run, reference: list[int] | None, ref_id: str | None) -> dict[str, Any]:
    row: dict[str, Any] = {
        "id": run.id, "config": run.label, "status": "skipped" if run.skip else "failed" if run.error else "measured",
        "tok_s": None, "read_mib_s": None, "hit_pct": None, "disk_mib_per_token": None,
        "peak_rss_mib": None, "open_s": None, "budget_mib": _r(run.budget_bytes / MiB, 1) if run.budget_bytes else None,
        "identical_tokens": None, "notes": "",
    }
    notes = [n for n in (run.skip, run.error, run.budget_note) if n]
    res = run.result
    if res is None:
        row["notes"] = "; ".join(notes)
        return row
    st = res["stats"]
    n = st.get("generated_tokens") or 0
    row["tok_s"] = _r(st.get("tok_per_s"))
    if row["tok_s"] is None:
        notes.append("tok/s unmeasured: no decode step after the prompt, or no decode time")
    if run.kind == "bmoe" and st.get("mode") == "stream":
        row["read_mib_s"] = _r(st.get("read_mib_per_s"), 1)
        if row["read_mib_s"] is None:
            notes.append("nothing read during the measured generation")
        row["hit_pct"] = _r(st.get("cache_hit_pct"), 1)
        row["io_mode"] = res.get("io_mode")
        if res.get("io_fallback_reason"):
            notes.append(f"buffered reads: {res['io_fallback_reason']}")
    else:
        disk, wall = res.get("disk_read_bytes"), (st.get("prefill_s") or 0) + (st.get("decode_s") or 0)
        if disk and wall > 0:
            row["read_mib_s"] = _r(disk / MiB / wall, 1)
        else:
            notes.append("no storage reads while measured" if disk == 0 else "storage reads unmeasured")
        notes.append("no expert cache")
    disk = res.get("disk_read_bytes")
    row["disk_mib_per_token"] = _r(disk / MiB / n, 3) if disk is not None and n else None
    row["peak_rss_mib"] = _r(res["peak_rss_bytes"] / MiB, 1)
    row["open_s"] = _r(res["open_s"], 3)
    row["open_mode"] = res.get("open_mode")
    if (row["budget_mib"] is None and st.get("budget_bytes") is not None and st.get("mode") == "stream"
            and run.config.get("cache_bytes", 0) is None):
        # auto and squeeze: the budget the run chose, as the measured generation started (the
        # guard may move it after: budget_bytes_end)
        row["budget_mib"] = _r(st["budget_bytes"] / MiB, 1)
        notes.append("budget chosen by the run (auto), at the start of the measured generation")
    if reference is not None:
        mine = res["tokens"]
        if run.id == "squeeze":  # it runs on past --tokens, or stops short: compare what both have
            m = min(len(mine), len(reference))
            mine, reference = mine[:m], reference[:m]
        same = mine == reference
        row["identical_tokens"] = same
        if run.id == ref_id:
            notes.append("token reference")
        elif not same:
            notes.append(f"greedy tokens differ from {ref_id}" + (
                " (stock loading may repack weights: other kernels)" if run.kind == "mmap" else " (a bug)"))
    if run.id == "all_cached" and row["hit_pct"] is not None and row["hit_pct"] < 100:
        notes.append(f"not fully cached: {row['hit_pct']}% hits")
    notes.extend(res.get("warnings") or [])
    row["notes"] = "; ".join(notes)
    row["tokens"] = res["tokens"]
    row["stats"] = st
    row["warmup_stats"] = res.get("warmup_stats")
    row["mem_available_before_mib"] = _r(run.mem_available_before / MiB, 0) if run.mem_available_before else None
    row["load_before"] = _r(run.load_before)
    return row


def _ttft_floor(detail: Mapping[str, Mapping[str, Any]] | None, device_mib_s: float | None,
                fresh_mib_s: float | None = None,
                serial: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, dict[str, float | None]] | None:
    """Each time to first token against its physical floor: its reads at the device's rate plus its
    compute. Null when the device rate or the prefill's read figures are unmeasured. Beside it,
    the floor of the same reads where those that landed in fresh pages go at the probe's rate
    into fresh pages: a fresh cache's first prompt pays the machine's first touch of its memory.

    The compute is the prefill's wall less its wait on reads, from ``serial`` (the same prompt run
    without read-ahead, reads and compute in turn) where it has the prompt: with read-ahead, the
    reads it hid behind the compute would count as compute."""
    if not detail or not device_mib_s:
        return None
    out: dict[str, dict[str, float | None]] = {}
    for key, d in detail.items():
        if d.get("bytes_read") is None or d.get("blocked_s") is None:
            continue
        alone = (serial or {}).get(key) or d
        compute = max(0.0, alone["prefill_s"] - (alone.get("blocked_s") or 0.0))
        floor = d["bytes_read"] / MiB / device_mib_s + compute
        fresh_floor = None
        if fresh_mib_s and d.get("recycled_bytes") is not None:
            landed_fresh = max(0, d["bytes_read"] - d["recycled_bytes"])
            fresh_floor = (landed_fresh / MiB / fresh_mib_s + (d["bytes_read"] - landed_fresh) / MiB / device_mib_s
                           + compute)
        out[key] = {"ttft_s": _r(d["prefill_s"], 3), "floor_s": _r(floor, 3), "read_mib": _r(d["bytes_read"] / MiB, 1),
                    "compute_s": _r(compute, 3), "hit_pct": _r(d.get("hit_pct"), 1),
                    "ttft_over_floor": _r(d["prefill_s"] / floor, 3) if floor > 0 else None,
                    "floor_fresh_s": _r(fresh_floor, 3),
                    "ttft_over_floor_fresh": _r(d["prefill_s"] / fresh_floor, 3) if fresh_floor else None,
                    "compute_from": "no read-ahead run" if alone is not d else "this run"}
        if alone is not d:
            out[key]["ttft_no_predict_s"] = _r(alone["prefill_s"], 3)
            out[key]["ttft_over_no_predict"] = _r(d["prefill_s"] / alone["prefill_s"], 3) if alone["prefill_s"] else None
    return out or None


def summarize(runs: list[Run], probes: list[dict[str, Any]], layout: Any, opts: BenchOptions,
              machine: dict[str, Any], balloon: dict[str, Any], started: datetime,
              probe_fresh: dict[str, Any] | None = None, probe_end: dict[str, Any] | None = None) -> dict[str, Any]:
    by_id = {r.id: r for r in runs}
    ref_id = next((i for i in ("resident", "mmap_norepack", "stream_off") if by_id[i].result is not None), None)
    reference = by_id[ref_id].result["tokens"] if ref_id else None  # type: ignore[index]
    rows = [_row(r, reference, ref_id) for r in runs]
    rows_by = {r["id"]: r for r in rows}
    notes: dict[str, str] = {}
    how: dict[str, str] = {}

    def pick(key: str, run_id: str, col: str, what: str) -> float | None:
        row = rows_by[run_id]
        value = row[col]
        if value is None:
            notes[key] = f"{row['config']}: {row['notes'] or 'not measured'}"
        how[key] = what
        return value

    tok_how = ("decode tokens after the first over the summed wall time of their decode calls, in the "
               f"measured generation of --tokens {opts.tokens} (greedy, {opts.n_threads} threads), after a "
               f"warm-up of {opts.warmup} tokens on another prompt in the same fresh process")
    device = next((p for p in probes if p["lanes"] == opts.io_threads), None)
    out: dict[str, Any] = {}

    def probed(key: str, p: dict[str, Any] | None, what: str) -> None:
        """A probe's MiB/s under ``key``, null with the probe's own account when it failed."""
        out[key] = _r(p["mib_s"], 1) if p and p["mib_s"] else None
        how[key] = f"MiB/s; {what}: " + (p["how"] if p else "not run")
        if out[key] is None:
            notes[key] = p["how"] if p else "the probe did not run"

    probed("device_read_mb_s", device, f"bmoe.io.probe at {opts.io_threads} lanes (the streamed runs' --io-threads)")
    probed("device_read_end_mb_s", probe_end, "the probe of device_read_mb_s again after the last run: the device's "
           "rate drifts (a shared host), and every floor computed from device_read_mb_s moves with it")
    probed("device_read_fresh_mb_s", probe_fresh, "the same probe into pages never touched before, as a fresh "
           "cache's misses land (the kernel faults each page in as the read copies), at the lanes the engine uses "
           "for them")
    out["stream_cache_off_read_mb_s"] = pick(
        "stream_cache_off_read_mb_s", "stream_off", "read_mib_s",
        "MiB/s; engine read rate of the cache-off streamed run: file bytes read over the summed per-layer "
        "windows from issuing a layer's reads to the last landing (O_DIRECT supersets included)")
    out["resident_tok_s"] = pick("resident_tok_s", "resident", "tok_s", "bmoe resident (whole file mapped); " + tok_how)
    out["mmap_tok_s"] = pick("mmap_tok_s", "mmap", "tok_s",
                             "stock llama_cpp.Llama (default load, no bmoe callback), argmax over its logits; " + tok_how)
    out["stock_tok_s"] = pick("stock_tok_s", "mmap", "tok_s",
                              "stock llama_cpp.Llama(model_path): repacks q4_0 into anonymous memory; " + tok_how)
    norepack = "mmap_norepack" if by_id["mmap_norepack"].skip is None else "resident"
    out["mmap_norepack_tok_s"] = pick(
        "mmap_norepack_tok_s", norepack, "tok_s",
        "llama.cpp's mmap load without repacking (bmoe resident mode: use_extra_bufts off, whole file mapped), "
        f"under the same limit ({norepack} row): the best a llama.cpp user can run past RAM; " + tok_how)
    out["stream_auto_tok_s"] = pick("stream_auto_tok_s", "stream_auto", "tok_s",
                                    "streamed, budget auto, pressure guard on; " + tok_how)
    lossless = [rows_by[i] for i in STREAMED if rows_by[i]["tok_s"] is not None
                and rows_by[i]["identical_tokens"] is not False]
    best = max(lossless, key=lambda r: r["tok_s"]) if lossless else None
    out["stream_tok_s"] = best["tok_s"] if best else None
    out["stream_config"] = best["config"] if best else None
    how["stream_tok_s"] = ("best of the streamed configurations that actually stream (cache off, overlap, the two "
                           "partial budgets; not the pre-warmed full cache) whose greedy tokens equal the reference"
                           + (f": {best['config']}" if best else "") + "; " + tok_how)
    if best is None:
        notes["stream_tok_s"] = "no streamed configuration was measured with tokens equal to the reference"
    out["all_cached_tok_s"] = pick(
        "all_cached_tok_s", "all_cached", "tok_s",
        "streamed with a budget >= the expert bank, after a warm-up that is the measured generation itself "
        "(every routed expert resident when measured); " + tok_how.split(", after")[0])

    def ratio(key: str, num_key: str, den_key: str, what: str) -> None:
        a, b = out[num_key], out[den_key]
        out[key] = _r(a / b, 3) if a is not None and b else None
        how[key] = f"{num_key} / {den_key}: {what}"
        if out[key] is None:
            notes[key] = "; ".join(f"{k} is null" + (f" ({notes[k]})" if k in notes else "")
                                   for k, v in ((num_key, a), (den_key, b)) if not v)

    ratio("p1_all_cached_over_resident", "all_cached_tok_s", "resident_tok_s",
          "the cost of the streaming machinery when nothing has to be read")
    ratio("p2_read_over_device", "stream_cache_off_read_mb_s", "device_read_mb_s",
          "how much of the device's random-read bandwidth at this slice size the engine gets")
    ratio("p3_stream_over_mmap", "stream_tok_s", "mmap_norepack_tok_s",
          "the best streamed run against llama.cpp's own mmap without repacking under the same limit")
    ratio("p3_auto_over_mmap", "stream_auto_tok_s", "mmap_norepack_tok_s",
          "the auto budget against the same baseline")
    auto = by_id["stream_auto"].result or {}
    first_token_how = {
        "ttft_s": ("seconds of the prefill decode call, keyed by the prompt's length in tokens, in the auto run "
                   "after its measured generation (warm cache), shortest first; each generates one token"),
        "ttft_cold_s": ("as ttft_s, but each prompt the first of a fresh session in the auto run's process (empty "
                        "cache, model file dropped from the page cache, the open not counted): a first request"),
    }
    for key, text in first_token_how.items():  # ttft_s, ttft_floor; ttft_cold_s, ttft_cold_floor
        floor_key = key.replace("_s", "_floor")
        serial_key = key.replace("_s", "_no_predict_s")
        out[key] = {k: _r(v, 3) for k, v in auto[key].items()} if auto.get(key) else None
        how[key] = text
        if out[key] is None:
            notes[key] = ("not measured: --ttft 0" if not any(opts.ttft_lengths) else
                          f"stream_auto: {rows_by['stream_auto']['notes'] or 'no --ttft lengths fit the context'}")
        out[serial_key] = {k: _r(v, 3) for k, v in auto[serial_key].items()} if auto.get(serial_key) else None
        how[serial_key] = (f"as {key}, with the prompt's read-ahead off (--no-predict-prompt), in a session of the "
                           "same history, right after: reads and compute in turn")
        if out[serial_key] is None:
            notes[serial_key] = "not measured (the auto run does not read prompts ahead, or no --ttft lengths)"
        out[floor_key] = _ttft_floor(auto.get(key.replace("_s", "_detail")), out["device_read_mb_s"],
                                     out["device_read_fresh_mb_s"], auto.get(serial_key.replace("_s", "_detail")))
        how[floor_key] = ("per prompt length: floor_s = the bytes that prefill read (what the cache did not hold, "
                          "read-ahead included; O_DIRECT supersets included) at device_read_mb_s, plus its compute "
                          "(prefill wall time less the compute thread's wait on reads, from the same prompt without "
                          f"read-ahead where measured: compute_from); ttft_over_floor = {key} / floor_s; "
                          f"ttft_over_no_predict = {key} / {serial_key}. floor_fresh_s: the same, with the bytes that "
                          "landed in pages faulted in on the read (read less recycled) at device_read_fresh_mb_s "
                          "(null when unmeasured); the issue's target is judged on floor_s")
        if out[floor_key] is None:
            notes[floor_key] = ("device_read_mb_s is null" if out["device_read_mb_s"] is None
                                else "no time to first token with read figures was measured")
    out["budget_sweep"] = [
        {"budget_mb": _r(r.budget_bytes / MiB, 1) if r.budget_bytes else None, "tok_per_s": rows_by[r.id]["tok_s"],
         "hit_pct": rows_by[r.id]["hit_pct"], "status": rows_by[r.id]["status"],
         "peak_rss_mib": rows_by[r.id]["peak_rss_mib"], "notes": rows_by[r.id]["notes"]}
        for r in runs if r.id.startswith("sweep_")
    ]
    how["budget_sweep"] = ("one fresh process per fixed budget, forced past the memory model with the pressure "
                           "guard off, so the curve shows where the cliff is; " + tok_how)
    sq = by_id["squeeze"].result if "squeeze" in by_id else None
    out["squeeze"] = None
    if sq is not None and sq.get("squeeze"):
        out["squeeze"] = {k: (_r(v, 3) if isinstance(v, float) else v) for k, v in sq["squeeze"].items()}
        how["squeeze"] = out["squeeze"].pop("how")
    elif "squeeze" in by_id:
        notes["squeeze"] = f"squeeze: {rows_by['squeeze']['notes'] or 'not measured'}"
    else:
        notes["squeeze"] = "not asked for (--squeeze GB)"

    ids = [r["identical_tokens"] for r in rows if r["id"] != "mmap" and r["identical_tokens"] is not None]
    out["identical_tokens"] = all(ids) if ids else None
    how["identical_tokens"] = f"greedy tokens of every bmoe configuration equal those of {ref_id}"
    if not ids:
        notes["identical_tokens"] = "no reference run was measured"
    out["notes"] = notes
    out["how"] = how
    out["model"] = {
        "path": str(layout.shards[0]), "shards": len(layout.shards), "arch": layout.arch,
        "file_bytes": layout.file_bytes, "dense_bytes": layout.dense_bytes, "expert_bank_bytes": layout.expert_bytes,
        "working_set_bytes": layout.expert_bytes_per_token(), "n_layer": layout.n_layer,
        "n_expert": layout.n_expert, "n_expert_used": layout.n_expert_used,
        "slice_bytes": layout.layer_experts(layout.moe_layers[0])[0].stride,
    }
    out["machine"] = machine
    out["config"] = {
        "started": started.isoformat(timespec="seconds"), "tokens": opts.tokens, "warmup_tokens": opts.warmup,
        "prompt": opts.prompt, "warmup_prompt": WARMUP_PROMPT, "threads": opts.n_threads,
        "io_threads": opts.io_threads, "n_ctx": opts.n_ctx, "ram_limit_bytes": opts.ram_limit_bytes,
        "balloon": balloon, "process": "one fresh child process per configuration; model file dropped from "
                                       "the page cache (fsync + POSIX_FADV_DONTNEED) before each",
    }
    out["probe"] = probes
    out["probe_fresh"] = probe_fresh
    out["probe_end"] = probe_end
    out["runs"] = rows
    return out


# --- report -----------------------------------------------------------------------------------------


COLUMNS = ("config", "status", "tok_s", "read_mib_s", "hit_pct", "disk_mib_per_token", "peak_rss_mib",
           "open_s", "identical_tokens", "notes")
HEADERS = ("config", "status", "tok/s", "read MiB/s", "hit %", "disk MiB/token", "peak RSS MiB",
           "open s", "same tokens", "notes")


def _cell(v: Any) -> str:
    if v is None:
        return "—"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    return str(v).replace("|", "\\|")


def markdown_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    lines += ["| " + " | ".join(_cell(r.get(c)) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


KEYS = ("device_read_mb_s", "stream_cache_off_read_mb_s", "resident_tok_s", "mmap_norepack_tok_s", "stock_tok_s",
        "stream_tok_s", "stream_auto_tok_s", "all_cached_tok_s", "p1_all_cached_over_resident", "p2_read_over_device",
        "p3_stream_over_mmap", "p3_auto_over_mmap", "identical_tokens")


def key_figures_markdown(result: dict[str, Any]) -> str:
    lines = ["| figure | value | how / why null |", "|---|---|---|"]
    for k in KEYS:
        why = result["notes"].get(k)
        text = result["how"].get(k, "") + (f" — null: {why}" if why else "")
        lines.append(f"| {k} | {_cell(result.get(k))} | {_cell(text)} |")
    return "\n".join(lines)


def _extras_markdown(result: dict[str, Any]) -> list[str]:
    """Time to first token, the budget sweep and the squeeze, where measured."""
    out: list[str] = []
    for key, what in (("ttft_s", "warm"), ("ttft_cold_s", "cold: a fresh session each")):
        if not result.get(key):
            continue
        floor = result.get(key.replace("_s", "_floor")) or {}
        out += [f"## Time to first token (auto budget, {what})", "",
                "| prompt tokens | seconds | floor s | over floor | floor s, fresh pages | over that floor "
                "| seconds without read-ahead | with / without |",
                "|---|---|---|---|---|---|---|---|"]
        cols = ("floor_s", "ttft_over_floor", "floor_fresh_s", "ttft_over_floor_fresh", "ttft_no_predict_s",
                "ttft_over_no_predict")
        cells = lambda k: (_cell(floor.get(k, {}).get(c)) for c in cols)  # noqa: E731
        out += ["| {} | {} | {} | {} | {} | {} | {} | {} |".format(k, v, *cells(k))
                for k, v in result[key].items()] + [""]
    if result.get("budget_sweep"):
        out += ["## Budget sweep (fixed, forced, guard off)", "", "| budget MiB | tok/s | hit % | peak RSS MiB | status |",
                "|---|---|---|---|---|"]
        out += [f"| {r['budget_mb']} | {_cell(r['tok_per_s'])} | {_cell(r['hit_pct'])} | {_cell(r['peak_rss_mib'])} "
                f"| {r['status']} |" for r in result["budget_sweep"]] + [""]
    sq = result.get("squeeze")
    if sq:
        mb = lambda v: _cell(None if v is None else round(v / MiB))  # noqa: E731
        out += ["## Squeeze", "", "| | tok/s | budget MiB |", "|---|---|---|",
                f"| before | {_cell(sq['tok_per_s_before'])} | {mb(sq['budget_bytes_before'])} |",
                f"| after | {_cell(sq['tok_per_s_after'])} | {mb(sq['budget_bytes_after'])} |", "",
                f"{len(sq.get('budget_changes') or [])} budget change(s); {result['how'].get('squeeze', '')}", ""]
    return out


def report_markdown(result: dict[str, Any]) -> str:
    m, c, mo = result["machine"], result["config"], result["model"]
    disk = m.get("disk") or {}
    b = c["balloon"]
    limit = "none" if c["ram_limit_bytes"] is None else (
        f"{c['ram_limit_bytes'] / GiB:.2f} GiB ({b.get('how', '')}; available after inflating: "
        f"{b.get('available_after_inflate_bytes', 0) / GiB:.2f} GiB, at the end: "
        f"{(b.get('available_at_end_bytes') or 0) / GiB:.2f} GiB)")
    probe = ["| lanes | MiB/s | mode | reads |", "|---|---|---|---|"] + [
        f"| {p['lanes']} | {_cell(_r(p['mib_s'], 1))} | {_cell(p['mode'])} | {_cell(p['reads'])} |"
        for p in result["probe"]]
    return "\n".join([
        f"# bmoe bench: {Path(mo['path']).name}",
        "",
        f"Started {c['started']}. {c['process']}.",
        "",
        "## Machine",
        "",
        f"- CPU: {m['cpu_model']}; {m['cores']} cores, {m['usable_cores']} usable",
        f"- RAM: {m['mem_total_bytes'] / GiB:.1f} GiB total, {m['mem_available_bytes'] / GiB:.1f} GiB available at start",
        (f"- kernel: {m['kernel']} ({m['arch']}); load average at start {m['loadavg_at_start'][0]:.2f} "
         "(per run: `load_before` in the CSV; a shared machine makes every figure noisy)"),
        (f"- model's disk: {disk.get('device') or '?'} ({disk.get('model') or 'model unknown'}, "
         f"rotational={disk.get('rotational')}), {disk.get('fstype') or '?'} on {disk.get('mount') or '?'} "
         f"from {disk.get('source') or '?'}"),
        "",
        "## Configuration",
        "",
        (f"- model: {mo['path']} ({mo['arch']}, {mo['file_bytes'] / MiB:.1f} MiB file, "
         f"{mo['dense_bytes'] / MiB:.1f} MiB dense, {mo['expert_bank_bytes'] / MiB:.1f} MiB experts, working set "
         f"{mo['working_set_bytes'] / MiB:.2f} MiB/token, slice {mo['slice_bytes']} bytes)"),
        (f"- tokens measured: {c['tokens']} after a {c['warmup_tokens']}-token warm-up; {c['threads']} threads, "
         f"{c['io_threads']} I/O lanes, n_ctx {c['n_ctx']}"),
        f"- RAM limit: {limit}",
        f"- prompt: {c['prompt']!r}",
        "",
        "## Runs",
        "",
        markdown_table(result["runs"]),
        "",
        ("read MiB/s: streamed rows, the engine's rate over its read windows; resident and mmap rows, "
         "storage reads (/proc/self/io read_bytes) over the measured generation's wall time. disk MiB/token: "
         "/proc/self/io read_bytes of the measured generation per generated token (prefill included)."),
        "",
        *_extras_markdown(result),
        "## Device probe",
        "",
        *probe,
        "",
        f"Again after the last run, {result['config']['io_threads']} lanes: {_cell(result.get('device_read_end_mb_s'))} "
        f"MiB/s. Into pages never touched before, {(result.get('probe_fresh') or {}).get('lanes')} lanes: "
        f"{_cell(result.get('device_read_fresh_mb_s'))} MiB/s.",
        "",
        "## Key figures",
        "",
        key_figures_markdown(result),
        "",
    ])


CSV_COLUMNS = ("id", "config", "status", "tok_s", "read_mib_s", "hit_pct", "disk_mib_per_token", "peak_rss_mib",
               "open_s", "budget_mib", "identical_tokens", "mem_available_before_mib", "load_before", "notes")


def write_report(result: dict[str, Any], out_dir: Path, plot: Path | None) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {"dir": str(out_dir), "markdown": str(out_dir / "bench.md"), "csv": str(out_dir / "bench.csv"),
             "json": str(out_dir / "bench.json"), "png": str(plot or out_dir / "bench.png")}
    result["files"] = files
    with open(files["csv"], "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(CSV_COLUMNS), extrasaction="ignore")
        w.writeheader()
        w.writerows(result["runs"])
    Path(files["markdown"]).write_text(report_markdown(result))
    write_plot(result, Path(files["png"]))
    Path(files["json"]).write_text(json.dumps(result, indent=1, default=str))


def write_plot(result: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("the bench plot needs matplotlib: pip install 'bmoe[plot]'") from None
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = result["runs"]
    fig, (ax_tok, ax_read) = plt.subplots(1, 2, figsize=(12, 4.8), gridspec_kw={"width_ratios": [3, 2]})
    labels = [r["config"] for r in rows][::-1]
    values = [r["tok_s"] or 0.0 for r in rows][::-1]
    bars = ax_tok.barh(labels, values, color=["#4c72b0" if r["tok_s"] is not None else "#cccccc" for r in rows][::-1])
    for bar, r in zip(bars, rows[::-1]):
        text = f"{r['tok_s']:.2f}" if r["tok_s"] is not None else r["status"]
        ax_tok.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {text}", va="center", fontsize=8)
    ax_tok.set(xlabel="decode tok/s", title="tokens per second (after warm-up)")
    ax_tok.tick_params(axis="y", labelsize=8)
    probed = [p for p in result["probe"] if p["mib_s"] is not None]
    lanes = [p["lanes"] for p in result["probe"]]
    ax_read.plot([p["lanes"] for p in probed], [p["mib_s"] for p in probed], marker="o",
                 label="device probe (random direct reads)")
    engine = result["stream_cache_off_read_mb_s"]
    if engine is not None:
        ax_read.scatter([result["config"]["io_threads"]], [engine], color="#dd8452", zorder=3,
                        label="engine, cache off")
    ax_read.set_xscale("log", base=2)
    ax_read.set_xticks(lanes, [str(n) for n in lanes])
    ax_read.set(xlabel="lanes", ylabel="MiB/s", title=f"reads of {result['model']['slice_bytes']} byte slices")
    ax_read.grid(alpha=0.3)
    ax_read.legend(fontsize=8)
    limit = result["config"]["ram_limit_bytes"]
    fig.suptitle(f"{Path(result['model']['path']).name}"
                 + (f", RAM limit {limit / GiB:.2f} GiB" if limit else "")
                 + f" — {result['machine']['cpu_model']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _out_dir(opts: BenchOptions, model: Path, started: datetime) -> Path:
    if opts.out is not None:
        return opts.out
    name = f"bmoe-bench-{model.stem}-{started:%Y%m%d-%H%M%S}"
    parent = model.parent if os.access(model.parent, os.W_OK) else Path.cwd()
    return parent / name


# --- the machine -------------------------------------------------------------------------------------


def _read(path: Path | str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def cpu_model() -> str:
    text = _read("/proc/cpuinfo") or ""
    for key in ("model name", "Model", "Hardware", "cpu model"):
        for line in text.splitlines():
            if line.split(":")[0].strip() == key:
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def disk_of(path: Path) -> dict[str, Any]:
    """The block device (and its mount) holding ``path``, as far as sysfs and mountinfo tell."""
    st = os.stat(path)
    major, minor = os.major(st.st_dev), os.minor(st.st_dev)
    out: dict[str, Any] = {"dev": f"{major}:{minor}", "device": None, "model": None, "rotational": None,
                           "mount": None, "fstype": None, "source": None}
    target = str(path.resolve())
    best = -1
    for line in (_read("/proc/self/mountinfo") or "").splitlines():
        left, _, right = line.partition(" - ")
        parts, rparts = left.split(), right.split()
        if len(parts) < 5 or len(rparts) < 2:
            continue
        mount = parts[4]
        inside = mount == "/" or target == mount or target.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= best:  # the longest (and, on ties, the last) mount wins
            best = len(mount)
            out.update(mount=mount, fstype=rparts[0], source=rparts[1])
    sysfs = Path(f"/sys/dev/block/{major}:{minor}")
    if sysfs.exists():
        real = sysfs.resolve()
        disk = real.parent if (real / "partition").exists() else real
        out["device"] = real.name
        out["disk"] = disk.name
        out["model"] = _read(disk / "device" / "model")
        rot = _read(disk / "queue" / "rotational")
        out["rotational"] = None if rot is None else rot == "1"
    return out


def machine_info(model: Path) -> dict[str, Any]:
    info = meminfo_reader()
    return {
        "cpu_model": cpu_model(), "cores": os.cpu_count(), "usable_cores": len(os.sched_getaffinity(0)),
        "mem_total_bytes": info.get("MemTotal"), "mem_available_bytes": info.get("MemAvailable"),
        "swap_total_bytes": info.get("SwapTotal"), "kernel": platform.release(), "arch": platform.machine(),
        "python": platform.python_version(), "loadavg_at_start": os.getloadavg(), "disk": disk_of(model),
    }


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        sys.exit(child_main(sys.argv[2], sys.argv[3]))
    print("usage: python -m bmoe.bench.harness --child SPEC.json RESULT.json (run by `bmoe bench`)",
          file=sys.stderr)
    sys.exit(2)

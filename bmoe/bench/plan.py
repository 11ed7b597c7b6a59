"""The configurations ``bmoe bench`` runs, in order, each with its budget or the reason it is
skipped: pure arithmetic over the model's layout, the options and the memory available.

A configuration is a ``Run``: an id, a label, a ``kind`` of side (``bmoe``: bmoe's engine with a
RunConfig; ``mmap``: stock llama-cpp-python) and what that side's child needs. A new kind of side
joins here (runs of that kind in ``plan_runs``) and in ``bmoe.bench.child.SIDES`` (how its child
measures); the rounds, the summary rows and the report take every run alike."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from bmoe.bench.balloon import GiB
from bmoe.bench.options import BenchOptions, MiB
from bmoe.bench.rounds import median_of, median_tree

RUN_HEADROOM = 512 * MiB  # beyond the weights a run needs: KV, compute buffers, the interpreter
STREAMED = ("stream_off", "overlap", "stream_below_ws", "stream_half_bank", "stream_auto")  # for stream_tok_s


@dataclass
class Outcome:
    """One child's end: its result (possibly kept from a timeout after the measured generation,
    with a warning saying what is missing), or the error that is its row's note; and the machine
    as the child started: memory available, the 1-minute load average, the disk probe's MiB/s."""

    result: dict[str, Any] | None = None
    error: str | None = None
    mem_available_before: int | None = None
    load_before: float | None = None
    probe_mib_s: float | None = None


@dataclass
class Run:
    """One configuration: its child spec, or the reason it is skipped; then what it measured:
    one ``Outcome`` a round, folded by ``settle`` into ``result`` (each number the median of the
    rounds that measured it), ``error`` (only when no round measured) and the medians of the
    memory and load the children started with."""

    id: str
    label: str
    kind: str  # a key of bmoe.bench.child.SIDES: "bmoe" (a Session of ``config``) or "mmap" (stock)
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
    rounds: list[Outcome] = field(default_factory=list)  # one per round run (--rounds), in order

    def settle(self) -> None:
        results = [o.result for o in self.rounds if o.result is not None]
        self.result = median_tree(results)
        self.error = None if results or not self.rounds else self.rounds[-1].error
        mem = median_of(o.mem_available_before for o in self.rounds)
        self.mem_available_before = None if mem is None else int(mem)
        self.load_before = median_of(o.load_before for o in self.rounds)


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
    if opts.disk_limit_mib_s is not None:  # the limit sits in the read lanes: streamed runs have them
        for run in runs:
            if run.config.get("mode") == "stream":
                run.config["disk_limit_mib_s"] = opts.disk_limit_mib_s
    return runs


"""The bench's summary: one row per configuration and the key figures worked out from the rows
(decode tok/s of each side, read rates against the device's, the P1-P3 ratios, the times to first
token against their floors, the budget sweep, the squeeze). Pure: runs and probes in, one JSON
object out; every figure carries how it was measured, a figure not measured is null with the
reason in ``notes``, never 0."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from bmoe.bench.options import WARMUP_PROMPT, BenchOptions, MiB
from bmoe.bench.plan import STREAMED, Run
from bmoe.bench.rounds import flag_noisy, median_of, spread


def rounded(value: float | None, digits: int = 2) -> float | None:
    return None if value is None else round(value, digits)


def run_row(run: Run, reference: list[int] | None, ref_id: str | None) -> dict[str, Any]:
    """``run``'s row from its one result (or its skip or error): the figures, whether its greedy
    tokens equal the reference's, and notes saying what is missing and why."""
    row: dict[str, Any] = {
        "id": run.id, "config": run.label, "status": "skipped" if run.skip else "failed" if run.error else "measured",
        "tok_s": None, "read_mib_s": None, "hit_pct": None, "disk_mib_per_token": None,
        "peak_rss_mib": None, "open_s": None,
        "budget_mib": rounded(run.budget_bytes / MiB, 1) if run.budget_bytes else None,
        "identical_tokens": None, "notes": "",
    }
    notes = [n for n in (run.skip, run.error, run.budget_note) if n]
    res = run.result
    if res is None:
        row["notes"] = "; ".join(notes)
        return row
    st = res["stats"]
    n = st.get("generated_tokens") or 0
    row["tok_s"] = rounded(st.get("tok_per_s"))
    if row["tok_s"] is None:
        notes.append("tok/s unmeasured: no decode step after the prompt, or no decode time")
    if run.kind == "bmoe" and st.get("mode") == "stream":
        row["read_mib_s"] = rounded(st.get("read_mib_per_s"), 1)
        if row["read_mib_s"] is None:
            notes.append("nothing read during the measured generation")
        row["hit_pct"] = rounded(st.get("cache_hit_pct"), 1)
        row["io_mode"] = res.get("io_mode")
        if res.get("io_fallback_reason"):
            notes.append(f"buffered reads: {res['io_fallback_reason']}")
    else:
        disk, wall = res.get("disk_read_bytes"), (st.get("prefill_s") or 0) + (st.get("decode_s") or 0)
        if disk and wall > 0:
            row["read_mib_s"] = rounded(disk / MiB / wall, 1)
        else:
            notes.append("no storage reads while measured" if disk == 0 else "storage reads unmeasured")
        notes.append("no expert cache")
    disk = res.get("disk_read_bytes")
    row["disk_mib_per_token"] = rounded(disk / MiB / n, 3) if disk is not None and n else None
    row["peak_rss_mib"] = rounded(res["peak_rss_bytes"] / MiB, 1)
    row["open_s"] = rounded(res["open_s"], 3)
    row["open_mode"] = res.get("open_mode")
    if (row["budget_mib"] is None and st.get("budget_bytes") is not None and st.get("mode") == "stream"
            and run.config.get("cache_bytes", 0) is None):
        # auto and squeeze: the budget the run chose, as the measured generation started (the
        # guard may move it after: budget_bytes_end)
        row["budget_mib"] = rounded(st["budget_bytes"] / MiB, 1)
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
    row["mem_available_before_mib"] = rounded(run.mem_available_before / MiB, 0) if run.mem_available_before else None
    row["load_before"] = rounded(run.load_before)
    return row


# The row's figures that each round measures, with the digits they are shown with.
ROUND_FIGURES = {"tok_s": 2, "read_mib_s": 1, "hit_pct": 1, "disk_mib_per_token": 3, "peak_rss_mib": 1, "open_s": 3}


def row_of(run: Run, reference: list[int] | None, ref_id: str | None) -> dict[str, Any]:
    """``run``'s row over its rounds: each figure the median of the rounds that measured it
    (``median``), beside its spread (largest less smallest, ``spread``), the 1-minute load average
    and the disk probe's MiB/s as each round's child started (``loadavg``, ``probe_mib_s_rounds``;
    ``probe_mib_s`` their median); the greedy tokens equal the reference's only if every round's
    are. One round: the median is that round's figure, the spread null."""
    row = run_row(run, reference, ref_id)
    rounds = [run_row(replace(run, result=o.result, error=o.error, rounds=[]), reference, ref_id)
              for o in run.rounds]
    measured = [r for r in rounds if r["status"] == "measured"]
    row["median"], row["spread"] = {}, {}
    for col, digits in ROUND_FIGURES.items():
        if measured:
            row[col] = rounded(median_of(r[col] for r in measured), digits)
        row["median"][col] = row[col]
        row["spread"][col] = rounded(spread(r[col] for r in measured), digits)
    row["tok_s_spread"] = row["spread"]["tok_s"]
    same = [r["identical_tokens"] for r in measured if r["identical_tokens"] is not None]
    if same:
        row["identical_tokens"] = all(same)
    row["rounds"] = len(measured)
    row["loadavg"] = [rounded(o.load_before) for o in run.rounds]
    row["probe_mib_s_rounds"] = [rounded(o.probe_mib_s, 1) for o in run.rounds]
    row["probe_mib_s"] = rounded(median_of(o.probe_mib_s for o in run.rounds), 1)
    failed = [o.error for o in run.rounds if o.result is None]
    if measured and failed:
        row["notes"] = "; ".join(n for n in (row["notes"], f"{len(failed)} of {len(run.rounds)} rounds failed: "
                                                          f"{failed[-1]}") if n)
    return row


def flag_noise(rows: list[dict[str, Any]]) -> None:
    """A row whose tok/s spread over its rounds exceeds the gap to the nearest row's says so."""
    flag_noisy(rows, "tok_s")
    for row in rows:
        if row["noisy"]:
            near = next(r for r in rows if r["id"] == row["noisy_vs"])
            row["notes"] = "; ".join(n for n in (row["notes"], (
                f"noisy: its tok/s spread ({row['tok_s_spread']}) exceeds the gap to {near['id']} "
                f"({abs(near['tok_s'] - row['tok_s']):.2f}): the rounds do not settle their order")) if n)


def ttft_floor(detail: Mapping[str, Mapping[str, Any]] | None, device_mib_s: float | None,
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
        out[key] = {"ttft_s": rounded(d["prefill_s"], 3), "floor_s": rounded(floor, 3),
                    "read_mib": rounded(d["bytes_read"] / MiB, 1),
                    "compute_s": rounded(compute, 3), "hit_pct": rounded(d.get("hit_pct"), 1),
                    "ttft_over_floor": rounded(d["prefill_s"] / floor, 3) if floor > 0 else None,
                    "floor_fresh_s": rounded(fresh_floor, 3),
                    "ttft_over_floor_fresh": rounded(d["prefill_s"] / fresh_floor, 3) if fresh_floor else None,
                    "compute_from": "no read-ahead run" if alone is not d else "this run"}
        if alone is not d:
            out[key]["ttft_no_predict_s"] = rounded(alone["prefill_s"], 3)
            out[key]["ttft_over_no_predict"] = (rounded(d["prefill_s"] / alone["prefill_s"], 3)
                                                if alone["prefill_s"] else None)
    return out or None


@dataclass(frozen=True)
class Probes:
    """The device probes: at 1, 2, 4, 8 and the runs' lanes before the runs; into fresh pages; and
    at the runs' lanes again after the last run (how far the device's rate drifted)."""

    lanes: list[dict[str, Any]]
    fresh: dict[str, Any] | None = None
    end: dict[str, Any] | None = None


class Figures:
    """The key figures as they are worked out: each value beside how it was measured (``how``),
    and a null one beside why (``notes``), never 0."""

    def __init__(self, rows_by: Mapping[str, dict[str, Any]]) -> None:
        self.rows_by = rows_by
        self.out: dict[str, Any] = {}
        self.notes: dict[str, str] = {}
        self.how: dict[str, str] = {}

    def pick(self, key: str, run_id: str, col: str, what: str) -> None:
        """A row's column as figure ``key``; null with the row's notes."""
        row = self.rows_by[run_id]
        self.out[key] = row[col]
        if row[col] is None:
            self.notes[key] = f"{row['config']}: {row['notes'] or 'not measured'}"
        self.how[key] = what

    def probed(self, key: str, p: dict[str, Any] | None, what: str) -> None:
        """A probe's MiB/s under ``key``, null with the probe's own account when it failed."""
        self.out[key] = rounded(p["mib_s"], 1) if p and p["mib_s"] else None
        self.how[key] = f"MiB/s; {what}: " + (p["how"] if p else "not run")
        if self.out[key] is None:
            self.notes[key] = p["how"] if p else "the probe did not run"

    def ratio(self, key: str, num_key: str, den_key: str, what: str) -> None:
        a, b = self.out[num_key], self.out[den_key]
        self.out[key] = rounded(a / b, 3) if a is not None and b else None
        self.how[key] = f"{num_key} / {den_key}: {what}"
        if self.out[key] is None:
            self.notes[key] = "; ".join(f"{k} is null" + (f" ({self.notes[k]})" if k in self.notes else "")
                                        for k, v in ((num_key, a), (den_key, b)) if not v)


def tok_how(opts: BenchOptions) -> str:
    return ("decode tokens after the first over the summed wall time of their decode calls, in the "
            f"measured generation of --tokens {opts.tokens} (greedy, {opts.n_threads} threads), after a "
            f"warm-up of {opts.warmup} tokens on another prompt in the same fresh process")


def reference_of(runs: list[Run]) -> tuple[str | None, list[int] | None]:
    """The run whose greedy tokens every other is compared with: resident, else llama.cpp's mmap
    without repacking, else streaming with the cache off; the first of them measured."""
    by_id = {run.id: run for run in runs}
    ref_id = next((i for i in ("resident", "mmap_norepack", "stream_off") if by_id[i].result is not None), None)
    return ref_id, by_id[ref_id].result["tokens"] if ref_id else None  # type: ignore[index]


def device_figures(f: Figures, opts: BenchOptions, probes: Probes) -> None:
    device = next((p for p in probes.lanes if p["lanes"] == opts.io_threads), None)
    f.probed("device_read_mb_s", device, f"bmoe.io.probe at {opts.io_threads} lanes (the streamed runs' --io-threads)")
    f.probed("device_read_end_mb_s", probes.end, "the probe of device_read_mb_s again after the last run: the "
             "device's rate drifts (a shared host), and every floor computed from device_read_mb_s moves with it")
    f.probed("device_read_fresh_mb_s", probes.fresh, "the same probe into pages never touched before, as a fresh "
             "cache's misses land (the kernel faults each page in as the read copies), at the lanes the engine uses "
             "for them")


def speed_figures(f: Figures, runs: list[Run], opts: BenchOptions) -> None:
    """Decode tok/s of each side, the engine's read rate, and the P1-P3 ratios between them."""
    by_id, rows_by, how = {run.id: run for run in runs}, f.rows_by, tok_how(opts)
    f.pick("stream_cache_off_read_mb_s", "stream_off", "read_mib_s",
           "MiB/s; engine read rate of the cache-off streamed run: file bytes read over the summed per-layer "
           "windows from issuing a layer's reads to the last landing (O_DIRECT supersets included)")
    f.pick("resident_tok_s", "resident", "tok_s", "bmoe resident (whole file mapped); " + how)
    f.pick("mmap_tok_s", "mmap", "tok_s",
           "stock llama_cpp.Llama (default load, no bmoe callback), argmax over its logits; " + how)
    f.pick("stock_tok_s", "mmap", "tok_s",
           "stock llama_cpp.Llama(model_path): repacks q4_0 into anonymous memory; " + how)
    norepack = "mmap_norepack" if by_id["mmap_norepack"].skip is None else "resident"
    f.pick("mmap_norepack_tok_s", norepack, "tok_s",
           "llama.cpp's mmap load without repacking (bmoe resident mode: use_extra_bufts off, whole file mapped), "
           f"under the same limit ({norepack} row): the best a llama.cpp user can run past RAM; " + how)
    f.pick("stream_auto_tok_s", "stream_auto", "tok_s", "streamed, budget auto, pressure guard on; " + how)
    lossless = [rows_by[i] for i in STREAMED if rows_by[i]["tok_s"] is not None
                and rows_by[i]["identical_tokens"] is not False]
    best = max(lossless, key=lambda row: row["tok_s"]) if lossless else None
    f.out["stream_tok_s"] = best["tok_s"] if best else None
    f.out["stream_config"] = best["config"] if best else None
    f.how["stream_tok_s"] = ("best of the streamed configurations that actually stream (cache off, overlap, the two "
                             "partial budgets; not the pre-warmed full cache) whose greedy tokens equal the reference"
                             + (f": {best['config']}" if best else "") + "; " + how)
    if best is None:
        f.notes["stream_tok_s"] = "no streamed configuration was measured with tokens equal to the reference"
    f.pick("all_cached_tok_s", "all_cached", "tok_s",
           "streamed with a budget >= the expert bank, after a warm-up that is the measured generation itself "
           "(every routed expert resident when measured); " + how.split(", after")[0])
    f.ratio("p1_all_cached_over_resident", "all_cached_tok_s", "resident_tok_s",
            "the cost of the streaming machinery when nothing has to be read")
    f.ratio("p2_read_over_device", "stream_cache_off_read_mb_s", "device_read_mb_s",
            "how much of the device's random-read bandwidth at this slice size the engine gets")
    f.ratio("p3_stream_over_mmap", "stream_tok_s", "mmap_norepack_tok_s",
            "the best streamed run against llama.cpp's own mmap without repacking under the same limit")
    f.ratio("p3_auto_over_mmap", "stream_auto_tok_s", "mmap_norepack_tok_s",
            "the auto budget against the same baseline")


FIRST_TOKEN_HOW = {
    "ttft_s": ("seconds of the prefill decode call, keyed by the prompt's length in tokens, in the auto run "
               "after its measured generation (warm cache), shortest first; each generates one token"),
    "ttft_cold_s": ("as ttft_s, but each prompt the first of a fresh session in the auto run's process (empty "
                    "cache, model file dropped from the page cache, the open not counted): a first request"),
}


def first_token_figures(f: Figures, auto: Mapping[str, Any], opts: BenchOptions) -> None:
    """The auto run's times to first token, warm and cold, with and without the prompt's
    read-ahead, each against its physical floor."""
    out, how, notes = f.out, f.how, f.notes

    def limited(mib_s: float | None) -> float | None:
        """A rate the reads may reach: the device's, or the disk limit where that is lower."""
        if mib_s is None or opts.disk_limit_mib_s is None:
            return mib_s
        return min(mib_s, opts.disk_limit_mib_s)

    for key, text in FIRST_TOKEN_HOW.items():  # ttft_s, ttft_floor; ttft_cold_s, ttft_cold_floor
        floor_key = key.replace("_s", "_floor")
        serial_key = key.replace("_s", "_no_predict_s")
        out[key] = {k: rounded(v, 3) for k, v in auto[key].items()} if auto.get(key) else None
        how[key] = text
        if out[key] is None:
            notes[key] = ("not measured: --ttft 0" if not any(opts.ttft_lengths) else
                          f"stream_auto: {f.rows_by['stream_auto']['notes'] or 'no --ttft lengths fit the context'}")
        out[serial_key] = {k: rounded(v, 3) for k, v in auto[serial_key].items()} if auto.get(serial_key) else None
        how[serial_key] = (f"as {key}, with the prompt's read-ahead off (--no-predict-prompt), in a session of the "
                           "same history, right after: reads and compute in turn")
        if out[serial_key] is None:
            notes[serial_key] = "not measured (the auto run does not read prompts ahead, or no --ttft lengths)"
        out[floor_key] = ttft_floor(auto.get(key.replace("_s", "_detail")), limited(out["device_read_mb_s"]),
                                    limited(out["device_read_fresh_mb_s"]),
                                    auto.get(serial_key.replace("_s", "_detail")))
        how[floor_key] = ("per prompt length: floor_s = the bytes that prefill read (what the cache did not hold, "
                          "read-ahead included; O_DIRECT supersets included) at device_read_mb_s, plus its compute "
                          "(prefill wall time less the compute thread's wait on reads, from the same prompt without "
                          f"read-ahead where measured: compute_from); ttft_over_floor = {key} / floor_s; "
                          f"ttft_over_no_predict = {key} / {serial_key}. floor_fresh_s: the same, with the bytes that "
                          "landed in pages faulted in on the read (read less recycled) at device_read_fresh_mb_s "
                          "(null when unmeasured); the issue's target is judged on floor_s"
                          + ("" if opts.disk_limit_mib_s is None else
                             f"; both rates capped at --disk-limit {opts.disk_limit_mib_s:g} MiB/s"))
        if out[floor_key] is None:
            notes[floor_key] = ("device_read_mb_s is null" if out["device_read_mb_s"] is None
                                else "no time to first token with read figures was measured")


# A default that loses to its "off" by more than this is flagged (issue 40's bound for noise).
LOSES_BY = 1.05


def lever_figures(f: Figures) -> None:
    """Whether the levers pay here: the prompt's read-ahead (on by default) against the same
    prompts without it, at its worst over the measured lengths, warm and cold; and overlap (off by
    default) against the same cache-off run without it. A figure past ``LOSES_BY`` the wrong way
    says so in ``notes``."""
    ratios = {f"{which} {k}": v["ttft_over_no_predict"]
              for which, key in (("warm", "ttft_floor"), ("cold", "ttft_cold_floor"))
              for k, v in (f.out.get(key) or {}).items() if v.get("ttft_over_no_predict") is not None}
    worst = max(ratios, key=lambda k: ratios[k]) if ratios else None
    f.out["readahead_worst_over_off"] = ratios[worst] if worst else None
    f.how["readahead_worst_over_off"] = (
        "the largest ttft_over_no_predict over the measured prompt lengths, warm and cold: a time to first token "
        "with the prompt's read-ahead over the same prompt without it" + (f" ({worst} tokens)" if worst else ""))
    if worst is None:
        f.notes["readahead_worst_over_off"] = "no prompt was measured both with and without read-ahead"
    elif ratios[worst] > LOSES_BY:
        f.notes["readahead_worst_over_off"] = (f"read-ahead lost to off: {ratios[worst]}x at {worst} tokens "
                                               f"(more than {LOSES_BY}x)")
    rows = f.rows_by
    f.out["overlap_over_stream_off"] = (
        rounded(rows["overlap"]["tok_s"] / rows["stream_off"]["tok_s"], 3)
        if rows.get("overlap", {}).get("tok_s") is not None and rows.get("stream_off", {}).get("tok_s") else None)
    f.how["overlap_over_stream_off"] = "decode tok/s with --overlap over the same cache-off run without it"
    ratio = f.out["overlap_over_stream_off"]
    if ratio is None:
        f.notes["overlap_over_stream_off"] = "the overlap or the cache-off run was not measured"
    elif ratio < 1 / LOSES_BY:
        f.notes["overlap_over_stream_off"] = f"overlap lost to off here: {ratio}x"


def sweep_and_squeeze(f: Figures, runs: list[Run], opts: BenchOptions) -> None:
    """The fixed-budget sweep's curve, and the squeezed auto run's before and after."""
    rows_by = f.rows_by
    f.out["budget_sweep"] = [
        {"budget_mb": rounded(run.budget_bytes / MiB, 1) if run.budget_bytes else None,
         "tok_per_s": rows_by[run.id]["tok_s"], "hit_pct": rows_by[run.id]["hit_pct"],
         "status": rows_by[run.id]["status"], "peak_rss_mib": rows_by[run.id]["peak_rss_mib"],
         "notes": rows_by[run.id]["notes"]}
        for run in runs if run.id.startswith("sweep_")
    ]
    f.how["budget_sweep"] = ("one fresh process per fixed budget, forced past the memory model with the pressure "
                             "guard off, so the curve shows where the cliff is; " + tok_how(opts))
    fixed = [row for row in f.out["budget_sweep"] if row["tok_per_s"] is not None]
    best = max(fixed, key=lambda row: row["tok_per_s"]) if fixed else None
    f.out["best_fixed_tok_s"] = best["tok_per_s"] if best else None
    f.how["best_fixed_tok_s"] = ("the fastest budget of the sweep (--budgets)"
                                 + (f": {best['budget_mb']} MiB" if best else ""))
    if best is None:
        f.notes["best_fixed_tok_s"] = ("no budget of the sweep was measured" if f.out["budget_sweep"]
                                       else "not asked for (--budgets MIB,...)")
    f.ratio("auto_over_best_fixed", "stream_auto_tok_s", "best_fixed_tok_s",
            "the auto budget against the best fixed budget of the sweep")
    squeeze = next((run for run in runs if run.id == "squeeze"), None)
    sq = squeeze.result if squeeze is not None else None
    f.out["squeeze"] = None
    if sq is not None and sq.get("squeeze"):
        f.out["squeeze"] = {k: (rounded(v, 3) if isinstance(v, float) else v) for k, v in sq["squeeze"].items()}
        f.how["squeeze"] = f.out["squeeze"].pop("how")
        before, after = f.out["squeeze"].get("tok_per_s_before"), f.out["squeeze"].get("tok_per_s_after")
        f.out["squeeze"]["after_over_before"] = rounded(after / before, 3) if after is not None and before else None
        f.how["squeeze"] += "; after_over_before = tok_per_s_after / tok_per_s_before"
    elif squeeze is not None:
        f.notes["squeeze"] = f"squeeze: {rows_by['squeeze']['notes'] or 'not measured'}"
    else:
        f.notes["squeeze"] = "not asked for (--squeeze GB)"


def conditions_figures(f: Figures, opts: BenchOptions, conditions: Conditions) -> None:
    """How many rounds, how many spinning processes, what disk limit: each with how it was done."""
    f.out["rounds"] = opts.rounds
    f.how["rounds"] = (f"every configuration run {opts.rounds} times, interleaved (A B C A B C ...), each figure the "
                       "median of its rounds; per row: median, spread (largest less smallest), loadavg (1-minute "
                       "load as each round's child started), probe_mib_s_rounds (the disk probed at the runs' lanes "
                       "before each); a row whose tok/s spread exceeds the gap to the nearest row is flagged noisy; "
                       "the ratios are of the medians")
    f.out["busy"] = opts.busy
    f.how["busy"] = conditions.busy.get("how") or ""
    f.out["disk_limit_mib_s"] = opts.disk_limit_mib_s
    f.how["disk_limit_mib_s"] = ("none" if opts.disk_limit_mib_s is None else
                                 f"{conditions.disk_limit_how}; the streamed runs only (resident and mmap read "
                                 "through page faults, unlimited); the probes read the device unlimited")


def model_of(layout: Any) -> dict[str, Any]:
    return {
        "path": str(layout.shards[0]), "shards": len(layout.shards), "arch": layout.arch,
        "file_bytes": layout.file_bytes, "dense_bytes": layout.dense_bytes, "expert_bank_bytes": layout.expert_bytes,
        "working_set_bytes": layout.expert_bytes_per_token(), "n_layer": layout.n_layer,
        "n_expert": layout.n_expert, "n_expert_used": layout.n_expert_used,
        "slice_bytes": layout.layer_experts(layout.moe_layers[0])[0].stride,
    }


@dataclass(frozen=True)
class Conditions:
    """What the runs ran under beside the options: the memory balloon (``--ram-limit``), the
    spinning processes (``--busy``) and how the disk limit was held (``--disk-limit``)."""

    balloon: dict[str, Any]
    busy: dict[str, Any]
    disk_limit_how: str | None = None


def summarize(runs: list[Run], probes: Probes, layout: Any, opts: BenchOptions, machine: dict[str, Any],
              conditions: Conditions, started: datetime) -> dict[str, Any]:
    """The bench's JSON object: the key figures (each with ``how``, or null with ``notes``), the
    model, the machine, the configuration, the probes and one row per configuration."""
    ref_id, reference = reference_of(runs)
    rows = [row_of(run, reference, ref_id) for run in runs]
    flag_noise(rows)
    f = Figures({row["id"]: row for row in rows})
    device_figures(f, opts, probes)
    speed_figures(f, runs, opts)
    auto = next(run for run in runs if run.id == "stream_auto").result or {}
    first_token_figures(f, auto, opts)
    lever_figures(f)
    sweep_and_squeeze(f, runs, opts)
    out, notes, how = f.out, f.notes, f.how
    ids = [row["identical_tokens"] for row in rows if row["id"] != "mmap" and row["identical_tokens"] is not None]
    out["identical_tokens"] = all(ids) if ids else None
    how["identical_tokens"] = f"greedy tokens of every bmoe configuration equal those of {ref_id}"
    if not ids:
        notes["identical_tokens"] = "no reference run was measured"
    conditions_figures(f, opts, conditions)
    out["notes"] = notes
    out["how"] = how
    out["model"] = model_of(layout)
    out["machine"] = machine
    out["config"] = {
        "started": started.isoformat(timespec="seconds"), "tokens": opts.tokens, "warmup_tokens": opts.warmup,
        "prompt": opts.prompt, "warmup_prompt": WARMUP_PROMPT, "threads": opts.n_threads,
        "io_threads": opts.io_threads, "n_ctx": opts.n_ctx, "ram_limit_bytes": opts.ram_limit_bytes,
        "balloon": conditions.balloon, "busy": conditions.busy, "disk_limit_mib_s": opts.disk_limit_mib_s,
        "disk_limit_how": conditions.disk_limit_how, "rounds": opts.rounds,
        "process": "one fresh child process per configuration" + (
            f", {opts.rounds} rounds interleaved (every configuration once, then again)" if opts.rounds > 1 else "")
        + "; model file dropped from the page cache (fsync + POSIX_FADV_DONTNEED) and the disk probed before each",
    }
    out["probe"] = probes.lanes
    out["probe_fresh"] = probes.fresh
    out["probe_end"] = probes.end
    out["runs"] = rows
    return out

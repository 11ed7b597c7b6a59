"""The bench's report: the Markdown tables printed and written (``bench.md``), the CSV of the
rows, the JSON object whole, and the plot; and the folder they go in. Nothing here measures."""

from __future__ import annotations

import csv
import io
import json
import os
from datetime import datetime
from pathlib import Path
from typing import Any

from bmoe.bench.balloon import GiB
from bmoe.bench.options import BenchOptions, MiB
from bmoe.bench.summary import rounded
from bmoe.errors import ConfigError
from bmoe.io.outputs import save_figure, write_text_output


COLUMNS = ("config", "status", "tok_s", "tok_s_spread", "read_mib_s", "hit_pct", "disk_mib_per_token",
           "peak_rss_mib", "open_s", "identical_tokens", "load_before", "probe_mib_s", "notes")
HEADERS = ("config", "status", "tok/s", "± tok/s", "read MiB/s", "hit %", "disk MiB/token", "peak RSS MiB",
           "open s", "same tokens", "load", "probe MiB/s", "notes")


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
        "p3_stream_over_mmap", "p3_auto_over_mmap", "best_fixed_tok_s", "auto_over_best_fixed", "readahead_worst_over_off", "overlap_over_stream_off",
        "identical_tokens")


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
        f"| {p['lanes']} | {_cell(rounded(p['mib_s'], 1))} | {_cell(p['mode'])} | {_cell(p['reads'])} |"
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
        f"- rounds: {c.get('rounds', 1)}" + (" (each figure the median of its rounds; ± tok/s: largest less smallest)"
                                            if c.get("rounds", 1) > 1 else ""),
        f"- busy: {result.get('busy') or 0} spinning process(es)" + (
            f" ({result['how'].get('busy', '')})" if result.get("busy") else ""),
        "- disk limit: " + ("none" if c.get("disk_limit_mib_s") is None else
                            f"{c['disk_limit_mib_s']:g} MiB/s, by {c.get('disk_limit_how')}"),
        f"- prompt: {c['prompt']!r}",
        "",
        "## Runs",
        "",
        markdown_table(result["runs"]),
        "",
        ("read MiB/s: streamed rows, the engine's rate over its read windows; resident and mmap rows, "
         "storage reads (/proc/self/io read_bytes) over the measured generation's wall time. disk MiB/token: "
         "/proc/self/io read_bytes of the measured generation per generated token (prefill included). load: the "
         "1-minute load average as the row's child started; probe MiB/s: the disk probed at the runs' lanes right "
         "before it (medians over the rounds)."),
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
               "open_s", "budget_mib", "identical_tokens", "mem_available_before_mib", "load_before", "notes",
               "rounds", "tok_s_spread", "probe_mib_s", "noisy")


def write_report(result: dict[str, Any], out_dir: Path, plot: Path | None) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {"dir": str(out_dir), "markdown": str(out_dir / "bench.md"), "csv": str(out_dir / "bench.csv"),
             "json": str(out_dir / "bench.json"), "png": str(plot or out_dir / "bench.png")}
    result["files"] = files
    # Each file through a temporary renamed over its name: a link there is replaced, not written through.
    table = io.StringIO(newline="")
    w = csv.DictWriter(table, fieldnames=list(CSV_COLUMNS), extrasaction="ignore")
    w.writeheader()
    w.writerows(result["runs"])
    write_text_output(Path(files["csv"]), table.getvalue())
    write_text_output(Path(files["markdown"]), report_markdown(result))
    write_plot(result, Path(files["png"]))
    write_text_output(Path(files["json"]), json.dumps(result, indent=1, default=str))


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
    save_figure(fig, path, dpi=110)
    plt.close(fig)


def out_dir_for(opts: BenchOptions, model: Path, started: datetime) -> Path:
    if opts.out is not None:
        return opts.out
    name = f"bmoe-bench-{model.stem}-{started:%Y%m%d-%H%M%S}"
    parent = model.parent if os.access(model.parent, os.W_OK) else Path.cwd()
    return parent / name


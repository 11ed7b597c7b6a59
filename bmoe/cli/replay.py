"""``bmoe replay``: a route trace through the pipeline stages for a sweep of budgets, policies and
overlaps (what-if), as rows, a CSV or a plot."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import bmoe.cli.options as options
from bmoe.cli.edge import _run
from bmoe.cli.flags import (
    MAX_MIB,
    _check_outputs,
    _Help,
    _mib,
    _model_files,
    _number,
    _plain,
)
from bmoe.engine.config import MiB
from bmoe.errors import ConfigError
from bmoe.io.outputs import save_figure, write_text_output
from bmoe.io.paths import check_plot_output


def _replay_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("replay", help="replay a route trace through the pipeline stages (what-if)",
                       formatter_class=_Help)
    p.add_argument("trace", type=Path, help="route_trace v1 or v2 file")
    p.add_argument("-m", "--model", type=Path, default=None, help="read real bytes from this model")
    p.add_argument("--cache-mb", type=_mb_list, required=True, help="budgets, e.g. 500,1000,2000")
    p.add_argument("--policy", type=_policies, default=["default"], help="cache policies to compare, e.g. lru,default,opt (default: default)")
    p.add_argument("--io", choices=("real", "sim"), default=None,
                   help="real reads from -m, or reads modelled from a probe of this disk (default: real with -m)")
    p.add_argument("--timing", choices=("model", "measure"), default=None,
                   help="model: compute hits, bytes and time without sleeping (seconds per sweep; the "
                        "default for --io sim); measure: run the stages in modelled real time (--io real"
                        " always measures)")
    options.IO_THREADS.add(p, help="read lanes, real or modelled")
    p.add_argument("--overlap", type=_overlaps, default=["none"],
                   help="none,tensor,expert: modelled overlap of reads with the expert matmuls (default: none)")
    p.add_argument("--streams", type=_number(int, 1, 64, "a number of streams"), default=1,
                   help="what-if for the step scheduler: the trace's decode as this many concurrent streams, "
                        "each step routing the union of one token of each (default: 1, the trace as recorded)")
    p.add_argument("--compute-ms-per-layer", type=_number(float, 0, 1e6, "milliseconds"), default=1.0,
                   help="modelled compute per layer when the trace has no timings")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (the trace, how the figures were made, every result) instead of "
                        "a row per result and the how line on stderr")
    p.add_argument("--csv", type=Path, default=None,
                   help="also write the results to this CSV file, one row per overlap, policy and budget")
    p.add_argument("--plot", type=Path, default=None, help="PNG of hit %% and tok/s against budget")
    p.set_defaults(func=_cmd_replay)


def _names(text: str, known: tuple[str, ...], what: str) -> list[str]:
    names = text.split(",")
    bad = [n for n in names if n not in known]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown {what} {', '.join(map(repr, bad))} (known: {', '.join(known)})")
    return names


def _policies(text: str) -> list[str]:
    """Imported at parse time, and only when the flag is given (``bmoe --help`` stays light)."""
    from bmoe.pipeline.policies import POLICIES

    return _names(text, tuple(POLICIES), "cache policy")


def _overlaps(text: str) -> list[str]:
    from bmoe.engine.replay import OVERLAP_MODES

    return _names(text, tuple(OVERLAP_MODES), "overlap")


def _mb_list(text: str) -> list[float]:
    try:
        values = [_mib(x) for x in text.split(",")]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected MiB values (0 to {_plain(MAX_MIB)}) like 500,1000, got {text!r}") from None
    if len(values) > 1000:
        raise argparse.ArgumentTypeError(f"at most 1000 budgets, got {len(values)}")
    return values


def _cmd_replay(args: argparse.Namespace) -> int:
    from bmoe.engine.replay import ComputeModel, model_replay, replay
    from bmoe.io.probe import cached_probe
    from bmoe.io.validate import open_layout
    from bmoe.pipeline.trace import read_trace

    _check_outputs(args, (args.trace, *_model_files(args.model)), "--csv", "--plot")
    if args.plot is not None:
        check_plot_output(args.plot, "--plot")
    io = args.io or ("real" if args.model else "sim")
    if io == "real" and args.model is None:
        raise ConfigError("--io real reads the model's bytes: give it with -m MODEL (or use --io sim)")
    timing = args.timing or ("model" if io == "sim" else "measure")
    if timing == "model" and io == "real":
        raise ConfigError("--timing model computes the reads' time: use it with --io sim (--io real measures)")
    trace = read_trace(args.trace)
    if args.streams > 1:
        try:
            trace = trace.batched(args.streams)
        except ValueError as exc:
            raise ConfigError(f"--streams {args.streams}: {exc}") from None
    layout = open_layout(args.model) if io == "real" else None
    compute = ComputeModel(trace.timing, args.compute_ms_per_layer / 1e3)
    results = []
    policy_width = max(8, *map(len, args.policy))
    if not args.json:
        print(_replay_header(policy_width), flush=True)
    probe = None
    if timing == "model":
        probe = cached_probe(args.trace.resolve().parent, max(trace.expert_bytes.values(), default=0) or 4096,
                             args.io_threads)
    for overlap in args.overlap:
        for policy in args.policy:
            for mb in args.cache_mb:
                if probe is not None:
                    r = model_replay(trace, budget_bytes=int(mb * MiB), policy=policy, compute=compute,
                                     probe=probe, io_threads=args.io_threads, overlap=overlap)
                else:
                    r = _run(replay(trace, budget_bytes=int(mb * MiB), policy=policy, compute=compute,
                                          io_threads=args.io_threads, model=layout, overlap=overlap,
                                          sim_dir=args.trace.resolve().parent))
                results.append({**r.as_dict(), "policy": policy, "cache_mb": mb})
                if not args.json:
                    print(_replay_row(r.as_dict(), policy, mb, policy_width), flush=True)
    clock = ("the modelled decode time (no sleeps)" if timing == "model"
             else "the replay's decode wall time")
    how = (f"compute: {compute.describe()}; reads: {results[0]['io'] if results else io}; hit % = hits / "
           f"(hits + experts read) per layer event, decode phase and all phases; tok/s = decode tokens "
           f"over {clock}")
    if args.streams > 1:
        how += (f"; --streams {args.streams}: each decode step holds one token of each of {args.streams} streams cut "
                f"from the trace's decode (prefill left out), so a step's reads are their union and tok/s counts "
                f"steps: {args.streams} tokens each; a step's compute is modelled as one token's (optimistic: "
                f"measure it with bmoe bench --streams)")
    if args.csv is not None:
        _write_rows(args.csv, results)
    if args.plot is not None:
        _plot(args.plot, results, f"{args.trace.name}: {compute.describe()}")
    if args.json:
        print(json.dumps({"trace": str(args.trace), "how": how, "results": results}))
    else:
        print(how, file=sys.stderr)
    return 0


def _replay_header(policy_width: int = 8) -> str:
    """The columns of ``_replay_row``, named once above the rows (hit % and tok/s as the how line
    on stderr defines them)."""
    return (f"{'policy':>{policy_width}} {'overlap':>7} {'budget MiB':>10}  {'decode hit %':>12}  {'all hit %':>10}  "
            f"{'read MiB':>10}  {'tok/s':>10}")


def _replay_row(r: dict, policy: str, mb: float, policy_width: int = 8) -> str:
    """One result as a row under ``_replay_header``, labelled with the policy's name and the budget
    as the user gave them: ``default`` (not the ``adaptive`` it resolves to), and 0.5 MiB (not
    ``0``, as 0 and 1.5 as 2 were); a figure not measured says so, never 0."""
    def num(v: float | None, fmt: str, width: int) -> str:
        return f"{'unmeasured' if v is None else format(v, fmt):>{width}}"

    return (f"{policy:>{policy_width}} {r['overlap']:>7} {_plain(mb):>10}  {num(r['decode_hit_pct'], '.1f', 12)}  "
            f"{num(r['hit_pct'], '.1f', 10)}  {r['bytes_read'] / MiB:10.1f}  {num(r['tok_per_s'], '.2f', 10)}")


def _write_rows(path: Path, rows: list[dict]) -> None:
    """Through a temporary renamed over the name: a link there is replaced, never written through."""
    import csv
    from io import StringIO

    table = StringIO(newline="")
    w = csv.DictWriter(table, fieldnames=list(rows[0]))
    w.writeheader()
    w.writerows(rows)
    write_text_output(path, table.getvalue())


def _plot(path: Path, rows: list[dict], title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'bmoe[plot]'") from None
    fig, (ax_hit, ax_tok) = plt.subplots(1, 2, figsize=(11, 4.2))
    for series in dict.fromkeys((r["policy"], r["overlap"]) for r in rows):
        mine = sorted((r for r in rows if (r["policy"], r["overlap"]) == series), key=lambda r: r["cache_mb"])
        mb = [r["cache_mb"] for r in mine]
        label = series[0] if series[1] == "none" else f"{series[0]}, overlap {series[1]}"
        ax_hit.plot(mb, [r["decode_hit_pct"] for r in mine], marker="o", label=label)
        ax_tok.plot(mb, [r["tok_per_s"] for r in mine], marker="o", label=label)
    ax_hit.set(xlabel="cache budget (MiB)", ylabel="decode hit %", title="expert cache hit rate")
    ax_tok.set(xlabel="cache budget (MiB)", ylabel="predicted tok/s", title="replayed decode speed")
    for ax in (ax_hit, ax_tok):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)  # a link at the name is replaced, not written through
    plt.close(fig)

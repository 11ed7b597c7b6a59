"""The ``bmoe`` command line: run, demo and make-tiny.

Every bmoe error ends as one line on stderr and exit status 1; no traceback reaches a user for a
bad file or flag. Text goes to stdout as it is generated; summaries go to stderr (or, with
``--json``, one JSON object to stdout instead of both).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import sys
from pathlib import Path

from bmoe.engine.aio import run as run_async
from bmoe.engine.config import MiB, RunConfig
from bmoe.errors import BmoeError, ConfigError, first_error

DEMO_PROMPT = "The quick brown fox jumps over the lazy dog. Streaming experts from disk:"


def _run_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="generate text from a MoE GGUF (greedy)")
    p.add_argument("-m", "--model", type=Path, required=True, help="GGUF file (shard 1 of a split set)")
    p.add_argument("-p", "--prompt", required=True)
    p.add_argument("-n", "--n-predict", type=int, default=64, help="tokens to generate")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--stream", dest="mode", action="store_const", const="stream",
                      help="read routed experts from disk on demand (default)")
    mode.add_argument("--resident", dest="mode", action="store_const", const="resident",
                      help="plain llama.cpp: the whole file mapped, nothing streamed")
    p.add_argument("--io-threads", type=int, default=2, help="I/O lanes for expert reads")
    p.add_argument("--no-odirect", action="store_true", help="buffered reads instead of O_DIRECT")
    _common_flags(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--progress", action="store_true", help="one JSON line of metrics per token on stderr")
    p.add_argument("--csv", type=Path, default=None, help="per-token metrics CSV with a config header")
    p.set_defaults(mode="stream", func=_cmd_run)


def _cache_mb(text: str) -> float | None:
    if text == "auto":
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of MiB or 'auto', got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError("the cache budget cannot be negative")
    return value


def _common_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cache-mb", type=_cache_mb, default=0.0,
                   help="expert cache budget in MiB, or 'auto' (0 = off: every routed expert read)")
    p.add_argument("--cache-ceil-mb", type=float, default=None, help="upper bound for the budget")
    p.add_argument("--dense-weights", choices=("mmap", "anon"), default="mmap",
                   help="anon: copy dense weights into anonymous memory (safe from page-cache churn)")
    p.add_argument("--open-mode", choices=("auto", "user", "reserved", "mmap", "mmap-drop"), default="auto",
                   help="how a streamed model is opened (auto: the cheapest that works here)")
    p.add_argument("--prefill", choices=("auto", "batch", "token", "micro"), default="auto",
                   help="how a prompt runs: one batch, micro-batches, token by token, or auto (cost model)")
    p.add_argument("--route-trace", default=None, help="write every routing decision to this file")
    p.add_argument("--overlap", action="store_true",
                   help="read later projections while earlier expert matmuls compute (lossless)")
    p.add_argument("--prefetch", type=int, default=0, metavar="K",
                   help="read the previous token's experts of the next K layers ahead (needs a cache)")
    p.add_argument("--predict-prefetch", action="store_true",
                   help="predict the next layer's experts with its router and read them ahead (needs a cache)")
    p.add_argument("-t", "--threads", type=int, default=None, help="compute threads")
    p.add_argument("-c", "--ctx", type=int, default=2048, help="context length")


def _chat_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="interactive multi-turn chat; the expert cache stays warm")
    p.add_argument("-m", "--model", type=Path, required=True, help="GGUF file (shard 1 of a split set)")
    p.add_argument("-n", "--n-predict", type=int, default=256, help="most tokens per reply")
    p.add_argument("--system", default=None, help="system message")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--stream", dest="mode", action="store_const", const="stream")
    mode.add_argument("--resident", dest="mode", action="store_const", const="resident")
    p.add_argument("--io-threads", type=int, default=2)
    p.add_argument("--no-odirect", action="store_true")
    _common_flags(p)
    p.set_defaults(mode="stream", func=_cmd_chat)


def _replay_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("replay", help="replay a route trace through the pipeline stages (what-if)")
    p.add_argument("trace", type=Path, help="route_trace v1 or v2 file")
    p.add_argument("-m", "--model", type=Path, default=None, help="read real bytes from this model")
    p.add_argument("--cache-mb", type=_mb_list, required=True, help="budgets, e.g. 500,1000,2000")
    p.add_argument("--policy", type=lambda s: s.split(","), default=["default"], help="e.g. lru,default,opt")
    p.add_argument("--io", choices=("real", "sim"), default=None,
                   help="real reads from -m, or reads modelled from a probe of this disk (default: real with -m)")
    p.add_argument("--io-threads", type=int, default=2)
    p.add_argument("--overlap", type=lambda s: s.split(","), default=["none"],
                   help="none,tensor,expert: modelled overlap of reads with the expert matmuls")
    p.add_argument("--compute-ms-per-layer", type=float, default=1.0,
                   help="modelled compute per layer when the trace has no timings")
    p.add_argument("--json", action="store_true")
    p.add_argument("--csv", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None, help="PNG of hit %% and tok/s against budget")
    p.set_defaults(func=_cmd_replay)


def _mb_list(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MiB values like 500,1000, got {text!r}") from None
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError("budgets cannot be negative")
    return values


def _demo_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="make a synthetic MoE once, run it resident and streamed")
    p.add_argument("-n", "--n-predict", type=int, default=32)
    p.add_argument("--dir", type=Path, default=None, help="where to keep the demo model")
    p.set_defaults(func=_cmd_demo)


def _tiny_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("make-tiny", help="write a small random MoE GGUF (tests, measurements)")
    p.add_argument("out", type=Path)
    p.add_argument("--arch", default="qwen3moe", choices=("qwen3moe", "qwen2moe", "gemma4"))
    p.add_argument("--type", dest="wtype", default="f32", choices=("f32", "f16", "q8_0"))
    p.add_argument("--shards", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--embd", type=int, default=128)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--used", type=int, default=2)
    p.add_argument("--ff", type=int, default=64)
    p.set_defaults(func=_cmd_make_tiny)


def _config(args: argparse.Namespace) -> RunConfig:
    return RunConfig(
        mode=args.mode,
        io_threads=args.io_threads,
        odirect=not args.no_odirect,
        n_threads=args.threads,
        n_ctx=args.ctx,
        cache_bytes=None if args.cache_mb is None else int(args.cache_mb * MiB),
        cache_ceiling_bytes=None if args.cache_ceil_mb is None else int(args.cache_ceil_mb * MiB),
        dense_weights=args.dense_weights,
        open_mode=args.open_mode,
        prefill=getattr(args, "prefill", "auto"),
        route_trace=args.route_trace,
        overlap=args.overlap,
        prefetch_layers=args.prefetch,
        predict_prefetch=args.predict_prefetch,
    ).validate()


async def _generate(model: Path, config: RunConfig, prompt: str, n: int, *, echo: bool,
                    progress: bool = False, csv_path: Path | None = None) -> dict:
    from bmoe.engine.session import Session
    from bmoe.metrics.sinks import CsvSink, ProgressSink

    with Session.open(model, config) as session:
        for warning in session.warnings:
            print(f"bmoe: warning: {warning}", file=sys.stderr)
        sinks: list = []
        if progress:
            sinks.append(ProgressSink(None))
        if csv_path is not None:
            sinks.append(CsvSink(csv_path, config.as_dict() | {"budget_how": session.budget_how}, str(model)))
        bar = _token_bar(n) if echo and not progress and not sys.stdout.isatty() and sys.stderr.isatty() else None
        tokens: list[int] = []
        parts: list[str] = []
        async with asyncio.TaskGroup() as tg:
            for sink in sinks:
                tg.create_task(sink.run())
            try:
                async for piece in session.stream(prompt, n):
                    if piece.token is not None:
                        tokens.append(piece.token)
                    parts.append(piece.text)
                    if piece.metrics is not None:
                        for sink in sinks:
                            sink.add(piece.metrics)
                    if echo:
                        sys.stdout.write(piece.text)
                        sys.stdout.flush()
                    if bar is not None:
                        bar.update(1)
                stats = session.last_stats
                assert stats is not None
                result = {
                    "text": "".join(parts),
                    "tokens": tokens,
                    "n_tokens": len(tokens),
                    "io_fallback_reason": session.io_fallback_reason,
                    "budget_how": session.budget_how,
                    "open_reason": session.open_reason,
                    **stats.as_dict(),
                }
                for sink in sinks:
                    if isinstance(sink, CsvSink):
                        sink.summary({k: v for k, v in result.items() if k not in ("text", "tokens")})
            finally:
                if bar is not None:
                    bar.close()
                for sink in sinks:
                    sink.close()
        return result


def _token_bar(total: int):  # noqa: ANN202 - a tqdm bar for long runs whose text goes to a file
    from tqdm import tqdm

    return tqdm(total=total, unit="tok", desc="generating", file=sys.stderr)


def _summary(r: dict) -> str:
    def num(v: float | None, fmt: str) -> str:
        return "unmeasured" if v is None else format(v, fmt)

    line = f"[{r['mode']}] {r['n_tokens']} tokens, {num(r['tok_per_s'], '.2f')} tok/s"
    if r["mode"] == "stream":
        line += (
            f", experts read {r['experts_read']}, {r['bytes_read'] / MiB:.1f} MiB read"
            f", read {num(r['read_mib_per_s'], '.0f')} MiB/s ({r['io_mode']})"
            f", cache {r['budget_bytes'] / MiB:.0f} MiB hit {num(r['cache_hit_pct'], '.1f')}%"
        )
    return line


def _model_files(model: Path | None) -> tuple[Path, ...]:
    """The model and every shard its name implies: the inputs no output may overwrite."""
    from bmoe.io.layout import split_shard_paths

    return () if model is None else (model, *split_shard_paths(model))


def _check_outputs(args: argparse.Namespace, inputs: tuple[Path, ...], *flags: str) -> None:
    """Refuse, before anything is opened, any output flag that names an input or cannot be written."""
    from bmoe.io.paths import check_output

    for flag in flags:
        value = getattr(args, flag.lstrip("-").replace("-", "_"), None)
        if value is not None:
            check_output(value, flag, inputs)


def _cmd_run(args: argparse.Namespace) -> int:
    _check_outputs(args, _model_files(args.model), "--csv", "--route-trace")
    config = _config(args)
    result = run_async(_generate(args.model, config, args.prompt, args.n_predict, echo=not args.json,
                                  progress=args.progress, csv_path=args.csv))
    if args.json:
        print(json.dumps(result))
    else:
        print()
        print(_summary(result), file=sys.stderr)
    return 0


async def _chat(model: Path, config: RunConfig, system: str | None, n: int) -> None:
    from bmoe.engine.chat import ChatFormat, Message
    from bmoe.engine.session import Session

    with Session.open(model, config) as session:
        for warning in session.warnings:
            print(f"bmoe: warning: {warning}", file=sys.stderr)
        fmt = ChatFormat(session.chat_template())
        print(f"bmoe chat: {model.name}, {fmt.description}. An empty line or Ctrl-D ends.",
              file=sys.stderr)
        history: list[Message] = [Message("system", system)] if system else []
        while True:
            try:
                line = await asyncio.to_thread(input, "> ")
            except EOFError:
                break
            if not line.strip():
                break
            history.append(Message("user", line))
            prompt = _fit(session, fmt, history, n)
            parts: list[str] = []
            async for piece in session.stream(prompt, n, special=True):
                parts.append(piece.text)
                sys.stdout.write(piece.text)
                sys.stdout.flush()
            print()
            history.append(Message("assistant", "".join(parts)))
            stats = session.last_stats
            if stats is not None:
                r = {"n_tokens": stats.generated_tokens, **stats.as_dict()}
                print(_summary(r), file=sys.stderr)


def _fit(session, fmt, history, n: int) -> str:  # noqa: ANN001
    """Render the conversation, dropping the oldest turns (never the system message) to fit."""
    while True:
        prompt = fmt.render(history)
        if len(session.tokenize(prompt, special=True)) + n <= session.n_ctx:
            return prompt
        oldest = next((i for i, m in enumerate(history) if m.role != "system"), None)
        if oldest is None or oldest == len(history) - 1:
            raise ConfigError(f"the message does not fit the context ({session.n_ctx} tokens); raise -c")
        del history[oldest]
        print("bmoe: the conversation outgrew the context; dropped the oldest turn", file=sys.stderr)


def _cmd_chat(args: argparse.Namespace) -> int:
    _check_outputs(args, _model_files(args.model), "--route-trace")
    run_async(_chat(args.model, _config(args), args.system, args.n_predict))
    return 0


def _cmd_replay(args: argparse.Namespace) -> int:
    from bmoe.engine.replay import OVERLAP_MODES, ComputeModel, replay
    from bmoe.io.validate import open_layout
    from bmoe.pipeline.trace import read_trace

    _check_outputs(args, (args.trace, *_model_files(args.model)), "--csv", "--plot")
    io = args.io or ("real" if args.model else "sim")
    if io == "real" and args.model is None:
        raise ConfigError("--io real reads the model's bytes: give it with -m MODEL (or use --io sim)")
    if not 1 <= args.io_threads <= 64:
        raise ConfigError(f"--io-threads must be 1..64, got {args.io_threads}")
    trace = read_trace(args.trace)
    layout = open_layout(args.model) if io == "real" else None
    compute = ComputeModel(trace.timing, args.compute_ms_per_layer / 1e3)
    bad = [o for o in args.overlap if o not in OVERLAP_MODES]
    if bad:
        raise ConfigError(f"--overlap takes {', '.join(OVERLAP_MODES)}; got {', '.join(bad)}")
    results = []
    for overlap in args.overlap:
        for policy in args.policy:
            for mb in args.cache_mb:
                r = run_async(replay(trace, budget_bytes=int(mb * MiB), policy=policy, compute=compute,
                                      io_threads=args.io_threads, model=layout, overlap=overlap,
                                      sim_dir=args.trace.resolve().parent))
                results.append(r.as_dict())
                if not args.json:
                    print(_replay_row(r.as_dict()), flush=True)
    how = (f"compute: {compute.describe()}; reads: {results[0]['io'] if results else io}; hit % = hits / "
           "(hits + experts read) per layer event, decode phase and all phases; tok/s = decode tokens "
           "over the replay's decode wall time")
    if args.csv is not None:
        _write_rows(args.csv, results)
    if args.plot is not None:
        _plot(args.plot, results, f"{args.trace.name}: {compute.describe()}")
    if args.json:
        print(json.dumps({"trace": str(args.trace), "how": how, "results": results}))
    else:
        print(how, file=sys.stderr)
    return 0


def _replay_row(r: dict) -> str:
    def num(v: float | None, fmt: str) -> str:
        return "unmeasured" if v is None else format(v, fmt)

    return (f"{r['policy']:>8} {r['overlap']:>6} {r['cache_mb']:>8.0f} MiB  decode hit {num(r['decode_hit_pct'], '5.1f')}%  "
            f"all {num(r['hit_pct'], '5.1f')}%  read {r['bytes_read'] / MiB:9.1f} MiB  "
            f"{num(r['tok_per_s'], '7.2f')} tok/s")


def _write_rows(path: Path, rows: list[dict]) -> None:
    import csv

    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


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
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _cmd_make_tiny(args: argparse.Namespace) -> int:
    from bmoe.synth.tiny import TinySpec

    spec = TinySpec(arch=args.arch, wtype=args.wtype, n_layer=args.layers, n_embd=args.embd,
                    n_expert=args.experts, n_expert_used=args.used, n_ff=args.ff, seed=args.seed,
                    shards=args.shards)
    paths = _write_with_progress(args.out, spec)
    print(paths[0])
    return 0


def _write_with_progress(out: Path, spec) -> list[Path]:  # noqa: ANN001
    from tqdm import tqdm

    from bmoe.synth.tiny import write_tiny

    with tqdm(total=None, unit="B", unit_scale=True, desc=f"writing {out.name}", file=sys.stderr) as bar:
        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)

        return write_tiny(out, spec, progress)


def _demo_dir(arg: Path | None) -> Path:
    from bmoe.io.probe import cache_dir

    return arg if arg is not None else cache_dir()


def _cmd_demo(args: argparse.Namespace) -> int:
    from bmoe.synth.tiny import TinySpec

    # About 400 MB; this seed's greedy text is varied (a check a random model needs).
    spec = TinySpec(arch="qwen3moe", wtype="f16", n_layer=4, n_embd=1024, n_expert=32,
                    n_expert_used=4, n_ff=512, seed=0)
    folder = _demo_dir(args.dir)
    folder.mkdir(parents=True, exist_ok=True)
    model = folder / (f"demo-{spec.arch}-{spec.wtype}-l{spec.n_layer}-e{spec.n_embd}"
                      f"-x{spec.n_expert}-k{spec.n_expert_used}-f{spec.n_ff}-s{spec.seed}.gguf")
    if not model.exists():
        print(f"making the demo model once: {model}", file=sys.stderr)
        tmp = model.with_suffix(".partial.gguf")
        _write_with_progress(tmp, spec)
        tmp.replace(model)
    print(f"demo model: {model} ({model.stat().st_size / MiB:.0f} MiB). Its weights are random, "
          "so the text is gibberish: what matters is that both runs print the same bytes.\n")
    results = {}
    runs = {
        "resident": RunConfig(mode="resident"),
        "streamed, cache off": RunConfig(mode="stream", cache_bytes=0),
        "streamed, cache auto": RunConfig(mode="stream", cache_bytes=None),
    }
    for name, config in runs.items():
        r = run_async(_generate(model, config.validate(), DEMO_PROMPT, args.n_predict, echo=False))
        results[name] = r
        print(f"{name}: {r['text']!r}")
        print(f"    {_summary(r)}")
    same = all(r["tokens"] == results["resident"]["tokens"] for r in results.values())
    print("\nidentical tokens: " + ("yes" if same else "NO (this is a bug; please report it)"))
    return 0 if same else 1


# Subcommands whose modules are heavy to import (numpy, gguf writers, the bench harness): their full
# parser is registered only when the command line names them; otherwise a one-line entry keeps
# them listed in ``bmoe --help``.
_LAZY = {
    "bench": ("bmoe.bench.harness", "add_bench_command",
              "measure resident, mmap and streamed runs of one model side by side"),
    "synth": ("bmoe.synth.big", "add_synth_command",
              "write a random MoE GGUF with a real model's shapes (fast, any size)"),
}


def _lazy_parsers(sub: argparse._SubParsersAction, argv: list[str]) -> None:
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, register, help_) in _LAZY.items():
        if name == chosen:
            getattr(importlib.import_module(module), register)(sub)
        else:
            sub.add_parser(name, help=help_, add_help=False)


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bmoe", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _run_parser(sub)
    _chat_parser(sub)
    _replay_parser(sub)
    _demo_parser(sub)
    _lazy_parsers(sub, argv)
    _tiny_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    try:
        return args.func(args)
    except BaseExceptionGroup as group:  # the CLI's own task groups (sinks beside a generation)
        exc = first_error(group)
        if not isinstance(exc, BmoeError):
            raise
        print(f"bmoe: error: {exc}", file=sys.stderr)
        return 1
    except BmoeError as exc:
        print(f"bmoe: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bmoe: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

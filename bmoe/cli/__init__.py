"""The ``bmoe`` command line, the application layer: run, chat, serve, replay, demo, make-tiny, and
the heavy ones (bench, synth, inspect, quality) whose parsers load only when the command line names
them (``_LAZY``), so ``bmoe --help`` and ``bmoe run`` import no bench harness or gguf writer.

Every bmoe error ends as one line on stderr and exit status 1; no traceback reaches a user for a
bad file or flag. Text goes to stdout as it is generated; summaries go to stderr (or, with
``--json``, one JSON object to stdout instead of both).
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import importlib
import json
import math
import os
import signal
import sys
from pathlib import Path

from bmoe.engine.aio import run as run_async
from bmoe.engine.config import MiB, RunConfig
from bmoe.errors import BmoeError, ConfigError, first_error

DEMO_PROMPT = "The quick brown fox jumps over the lazy dog. Streaming experts from disk:"


class _Help(argparse.HelpFormatter):
    """Help that shows each flag's default, where it has one worth showing."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if ("%(default)" in text or default is None or default is False or default == argparse.SUPPRESS
                or action.const is not None
                or isinstance(action, argparse._StoreTrueAction) or not action.option_strings):
            return text
        return f"{text} (default: %(default)s)"


def _run_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="generate text from a MoE GGUF (greedy unless --temp)",
                       formatter_class=_Help)
    p.add_argument("-m", "--model", type=Path, required=True, help="GGUF file (shard 1 of a split set)")
    _prompt_flags(p)
    p.add_argument("-n", "--n-predict", type=_tokens, default=64, help="tokens to generate")
    _common_flags(p)
    _lossy_cli(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--progress", action="store_true", help="one JSON line of metrics per token on stderr")
    p.add_argument("--csv", type=Path, default=None, help="per-token metrics CSV with a config header")
    _sampling_flags(p)
    _verbosity_flags(p)
    p.set_defaults(mode="stream", func=_cmd_run)


def _prompt_flags(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("-p", "--prompt", help="the prompt ('-' reads it from standard input)")
    src.add_argument("-f", "--file", type=Path, default=None, help="read the prompt from this file")


def _prompt(args: argparse.Namespace) -> str:
    """The prompt of -p TEXT, -p - (standard input) or -f FILE; undecodable bytes kept as U+FFFD."""
    if args.file is not None:
        try:
            return args.file.read_bytes().decode("utf-8", errors="replace")
        except OSError as exc:
            raise ConfigError(f"-f {args.file}: {exc.strerror}") from None
    if args.prompt == "-":
        return sys.stdin.buffer.read().decode("utf-8", errors="replace")
    return args.prompt


def _sampling_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (greedy unless --temp > 0; run through llama.cpp's samplers)")
    g.add_argument("--temp", type=float, default=0.0, help="temperature (0 = greedy)")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus: keep tokens up to this mass (1 = off)")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below this share of the top one (0 = off)")
    g.add_argument("--repeat-penalty", type=float, default=1.0, help="penalise recent tokens (1 = off)")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="penalise tokens already present (0 = off)")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="penalise tokens by their count (0 = off)")
    g.add_argument("--seed", type=int, default=None, help="seed of the draw (default: a fresh one each run)")
    g.add_argument("--grammar-file", type=Path, default=None, help="constrain the output with a GBNF grammar")
    g.add_argument("--json-schema", default=None,
                   help="constrain the output to JSON matching this schema (JSON text, or a file holding it)")
    g.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="stop before this text (repeatable); it is never printed")


def _sampling(args: argparse.Namespace):  # noqa: ANN202 - a bmoe.engine.sampling.SamplingParams
    from bmoe.engine.sampling import SamplingParams

    grammar = schema = None
    if args.grammar_file is not None:
        try:
            grammar = args.grammar_file.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"--grammar-file {args.grammar_file}: {getattr(exc, 'strerror', None) or exc}") from None
    if args.json_schema is not None:
        text = args.json_schema
        if not text.lstrip().startswith("{"):
            try:
                text = Path(text).read_text()
            except (OSError, UnicodeDecodeError) as exc:
                raise ConfigError(f"--json-schema {args.json_schema}: neither JSON nor a readable file "
                                  f"({getattr(exc, 'strerror', None) or exc})") from None
        try:
            schema = json.loads(text)
        except ValueError as exc:
            raise ConfigError(f"--json-schema: not valid JSON ({exc})") from None
    return SamplingParams(
        temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        repeat_penalty=args.repeat_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, seed=args.seed, grammar=grammar, json_schema=schema,
    )


def _number(kind: type, lo: float, hi: float, what: str):  # noqa: ANN202 - an argparse type
    """An argparse type: a finite ``kind`` in [lo, hi], refused at parse time otherwise (``nan``,
    ``inf`` and ``1e308`` used to reach the run and end in a traceback)."""

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except (ValueError, OverflowError):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not math.isfinite(value) or not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"expected {what} from {lo:g} to {hi:g}, got {text!r}")
        return value

    parse.__name__ = what  # argparse names the type in its messages
    return parse


MAX_MIB = float(1 << 30)  # 1 PiB: beyond any machine; bounds the bytes computed from a budget
_mib = _number(float, 0, MAX_MIB, "a number of MiB")
_tokens = _number(int, 1, 1 << 20, "a number of tokens")
_ctx = _number(int, 16, 1 << 20, "a context length")
_threads = _number(int, 1, 512, "a thread count")
_io_threads = _number(int, 1, 64, "a number of I/O lanes")
_layers_ahead = _number(int, 0, 64, "a number of layers")


def _cache_mb(text: str) -> float | None:
    if text == "auto":
        return None
    try:
        return _mib(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected a number of MiB (0 to {MAX_MIB:g}) or 'auto', got {text!r}") from None


def _common_flags(p: argparse.ArgumentParser) -> None:
    """The engine flags of every command that opens a model (run, chat, serve), declared once."""
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--stream", dest="mode", action="store_const", const="stream",
                      help="read routed experts from disk on demand (default)")
    mode.add_argument("--resident", dest="mode", action="store_const", const="resident",
                      help="plain llama.cpp: the whole file mapped, nothing streamed")
    p.add_argument("--io-threads", type=_io_threads, default=2, help="I/O lanes for expert reads")
    p.add_argument("--no-odirect", action="store_true", help="buffered reads instead of O_DIRECT")
    p.set_defaults(mode="stream")
    p.add_argument("--cache-mb", type=_cache_mb, default=0.0,
                   help="expert cache budget in MiB, or 'auto' (0 = off: every routed expert read)")
    p.add_argument("--cache-ceil-mb", type=_mib, default=None, help="upper bound for the budget")
    p.add_argument("--cache-profile", default=None, metavar="FILE",
                   help="seed the cache policy from this JSON profile if it exists, save what the run "
                        "learned to it at the end (lossless: only the eviction order changes)")
    p.add_argument("--force", action="store_true",
                   help="run a --cache-mb that the memory model says cannot fit (warned, not refused)")
    p.add_argument("--no-pressure-guard", action="store_true",
                   help="keep the budget fixed while running (default: shrink it under memory pressure)")
    p.add_argument("--dense-weights", choices=("mmap", "anon"), default="mmap",
                   help="anon: copy dense weights into anonymous memory (safe from page-cache churn)")
    p.add_argument("--open-mode", choices=("auto", "user", "reserved", "mmap", "mmap-drop"), default="auto",
                   help="how a streamed model is opened (auto: the cheapest that works here)")
    p.add_argument("--prefill", choices=("auto", "batch", "token", "micro"), default="auto",
                   help="how a prompt runs: one batch, micro-batches, token by token, or auto (cost model)")
    p.add_argument("--route-trace", default=None, help="write every routing decision to this file")
    p.add_argument("--overlap", action="store_true",
                   help="read later projections while earlier expert matmuls compute (lossless)")
    p.add_argument("--prefetch", type=_layers_ahead, default=0, metavar="K",
                   help="read the previous token's experts of the next K layers ahead (needs a cache)")
    p.add_argument("--predict-prefetch", action="store_true",
                   help="predict the next layer's experts with its router and read them ahead (needs a cache)")
    p.add_argument("-t", "--threads", type=_threads, default=None, help="compute threads")
    p.add_argument("-c", "--ctx", type=_ctx, default=2048, help="context length")


def _lossy_cli(p: argparse.ArgumentParser) -> None:
    """The opt-in lossy levers of run and chat (bmoe.engine.lossy spells them; every figure a
    run with one reports then says lossy)."""
    from bmoe.engine.lossy import add_lossy_flags

    add_lossy_flags(p)


def _lossy_config(args: argparse.Namespace) -> dict[str, object]:
    """The levers' RunConfig fields; none for the commands without the flags (serve)."""
    from bmoe.engine.lossy import lossy_fields

    return lossy_fields(args) if hasattr(args, "n_expert_used") else {}


def _chat_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="interactive multi-turn chat; the expert cache stays warm",
                       formatter_class=_Help)
    p.add_argument("-m", "--model", type=Path, required=True, help="GGUF file (shard 1 of a split set)")
    p.add_argument("-n", "--n-predict", type=_tokens, default=256, help="most tokens per reply")
    p.add_argument("--system", default=None, help="system message")
    p.add_argument("--no-think", action="store_true",
                   help="ask a thinking model to answer without reasoning first (enable_thinking=false)")
    _common_flags(p)
    _lossy_cli(p)
    _sampling_flags(p)
    _verbosity_flags(p)
    p.set_defaults(mode="stream", func=_cmd_chat)


def _verbosity_flags(p: argparse.ArgumentParser, top: bool = False) -> None:
    """-v / -q, accepted before the command or after it (a subcommand's copy never resets the
    top-level one)."""
    default = False if top else argparse.SUPPRESS
    g = p.add_mutually_exclusive_group()
    g.add_argument("-v", "--verbose", action="store_true", default=default,
                   help="show llama.cpp's own log on stderr")
    g.add_argument("-q", "--quiet", action="store_true", default=default,
                   help="no banner, warnings or summaries on stderr: only the text and errors")


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (chat and text completions)",
                       formatter_class=_Help)
    p.add_argument("-m", "--model", type=Path, required=True, help="GGUF file (shard 1 of a split set)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (loopback by default)")
    p.add_argument("--port", type=_number(int, 0, 65535, "a port"), default=8080, help="port (0: any free one, printed at start)")
    p.add_argument("--api-key", default=os.environ.get("BMOE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every route but /health (or $BMOE_API_KEY)")
    p.add_argument("--queue", type=_number(int, 0, 10_000, "a queue length"), default=8,
                   help="requests that may wait for their turn; more get 503 with Retry-After")
    _common_flags(p)
    _verbosity_flags(p)
    p.set_defaults(mode="stream", func=_cmd_serve)


def _cmd_serve(args: argparse.Namespace) -> int:
    _check_outputs(args, _model_files(args.model), "--route-trace")
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be 0..65535, got {args.port}")
    if not 0 <= args.queue <= 10_000:
        raise ConfigError(f"--queue must be 0..10000, got {args.queue}")
    config = _config(args)
    from bmoe.server.run import serve

    stopped_by = serve(args.model, config, host=args.host, port=args.port, api_key=args.api_key or None,
                       max_waiting=args.queue, quiet=args.quiet)
    if stopped_by is not None:
        raise Interrupted(stopped_by)  # the session is closed and its route trace written
    return 0


def _replay_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("replay", help="replay a route trace through the pipeline stages (what-if)")
    p.add_argument("trace", type=Path, help="route_trace v1 or v2 file")
    p.add_argument("-m", "--model", type=Path, default=None, help="read real bytes from this model")
    p.add_argument("--cache-mb", type=_mb_list, required=True, help="budgets, e.g. 500,1000,2000")
    p.add_argument("--policy", type=lambda s: s.split(","), default=["default"], help="e.g. lru,default,opt")
    p.add_argument("--io", choices=("real", "sim"), default=None,
                   help="real reads from -m, or reads modelled from a probe of this disk (default: real with -m)")
    p.add_argument("--timing", choices=("model", "measure"), default=None,
                   help="model: compute hits, bytes and time without sleeping (seconds per sweep; the "
                        "default for --io sim); measure: run the stages in modelled real time (--io real"
                        " always measures)")
    p.add_argument("--io-threads", type=_io_threads, default=2)
    p.add_argument("--overlap", type=lambda s: s.split(","), default=["none"],
                   help="none,tensor,expert: modelled overlap of reads with the expert matmuls")
    p.add_argument("--compute-ms-per-layer", type=_number(float, 0, 1e6, "milliseconds"), default=1.0,
                   help="modelled compute per layer when the trace has no timings")
    p.add_argument("--json", action="store_true")
    p.add_argument("--csv", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None, help="PNG of hit %% and tok/s against budget")
    p.set_defaults(func=_cmd_replay)


def _mb_list(text: str) -> list[float]:
    try:
        values = [_mib(x) for x in text.split(",")]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected MiB values (0 to {MAX_MIB:g}) like 500,1000, got {text!r}") from None
    if len(values) > 1000:
        raise argparse.ArgumentTypeError(f"at most 1000 budgets, got {len(values)}")
    return values


def _demo_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="make a synthetic MoE once, run it resident and streamed")
    p.add_argument("-n", "--n-predict", type=_tokens, default=32)
    p.add_argument("--dir", type=Path, default=None, help="where to keep the demo model")
    p.set_defaults(func=_cmd_demo)


def _tiny_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("make-tiny", help="write a small random MoE GGUF (tests, measurements)")
    p.add_argument("out", type=Path)
    # Checked by TinySpec.validate, which names the choices (bmoe --list-archs).
    p.add_argument("--arch", default="qwen3moe")
    p.add_argument("--type", dest="wtype", default="f32", choices=("f32", "f16", "q8_0"))
    p.add_argument("--shards", type=_number(int, 1, 10_000, "a shard count"), default=1)
    p.add_argument("--seed", type=_number(int, 0, 2**32 - 1, "a seed"), default=0)
    p.add_argument("--layers", type=_number(int, 1, 512, "a layer count"), default=None,
                   help="main blocks (default: the arch's, 2 for most)")
    p.add_argument("--mtp", type=_number(int, 0, 8, "an MTP block count"), default=0,
                   help="MTP blocks after them (archs that have them)")
    p.add_argument("--embd", type=_number(int, 16, 16384, "an embedding width"), default=128)
    p.add_argument("--experts", type=_number(int, 1, 1024, "an expert count"), default=8)
    p.add_argument("--used", type=_number(int, 1, 1024, "an expert count"), default=2)
    p.add_argument("--ff", type=_number(int, 1, 65536, "a feed-forward width"), default=64)
    p.set_defaults(func=_cmd_make_tiny)


def _warn_ignored(args: argparse.Namespace) -> None:
    """Say so when a flag given does nothing in the chosen mode, rather than ignoring it silently."""
    if args.mode != "resident" or getattr(args, "quiet", False):
        return
    given = [flag for flag, on in (
        ("--cache-mb", args.cache_mb != 0), ("--cache-ceil-mb", args.cache_ceil_mb is not None),
        ("--io-threads", args.io_threads != 2), ("--no-odirect", args.no_odirect),
        ("--open-mode", args.open_mode != "auto"),
    ) if on]
    if given:
        print(f"bmoe: warning: {', '.join(given)} {'does' if len(given) == 1 else 'do'} nothing with --resident "
              "(nothing is streamed)", file=sys.stderr)


def _config(args: argparse.Namespace) -> RunConfig:
    _warn_ignored(args)
    return RunConfig(
        mode=args.mode,
        io_threads=args.io_threads,
        odirect=not args.no_odirect,
        n_threads=args.threads,
        n_ctx=args.ctx,
        cache_bytes=None if args.cache_mb is None else int(args.cache_mb * MiB),
        cache_ceiling_bytes=None if args.cache_ceil_mb is None else int(args.cache_ceil_mb * MiB),
        force_cache=args.force,
        cache_profile=args.cache_profile,
        pressure_guard=not args.no_pressure_guard,
        dense_weights=args.dense_weights,
        open_mode=args.open_mode,
        prefill=getattr(args, "prefill", "auto"),
        route_trace=args.route_trace,
        overlap=args.overlap,
        prefetch_layers=args.prefetch,
        predict_prefetch=args.predict_prefetch,
        **_lossy_config(args),
    ).validate()


async def _generate(model: Path, config: RunConfig, prompt: str, n: int, *, echo: bool,
                    progress: bool = False, csv_path: Path | None = None, sampling=None,  # noqa: ANN001
                    stop: list[str] | None = None, quiet: bool = False) -> dict:
    from bmoe.engine.lossy import lossy_label
    from bmoe.engine.session import Session
    from bmoe.metrics.sinks import CsvSink, ProgressSink
    from bmoe.metrics.tokens import peak_rss_bytes

    with Session.open(model, config) as session:
        for warning in () if quiet else session.warnings:
            print(f"bmoe: warning: {warning}", file=sys.stderr)
        sinks: list = []
        if progress:
            sinks.append(ProgressSink(None))
        if csv_path is not None:
            sinks.append(CsvSink(csv_path, config.as_dict() | {"budget_how": session.budget_how}, str(model)))
        bar = _token_bar(n) if echo and not progress and not sys.stdout.isatty() and sys.stderr.isatty() else None
        tokens: list[int] = []
        parts: list[str] = []
        # The writers are owned here, not by a task group: a signal or an error cancels the
        # generation, and the lines queued so far (and the summary) must still reach the files.
        writers = [asyncio.ensure_future(sink.run()) for sink in sinks]
        result: dict = {}
        finish = usage = None
        try:
            async for piece in session.stream(prompt, n, sampling=sampling, stop=stop):
                if piece.finish_reason is not None:
                    finish, usage = piece.finish_reason, piece.usage
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
        finally:
            if bar is not None:
                bar.close()
            stats = session.last_stats
            result = {
                "text": "".join(parts),
                "tokens": tokens,
                "n_tokens": len(tokens),
                "finish_reason": finish,
                "prompt_tokens_evaluated": usage.prompt_evaluated if usage is not None else None,
                "io_fallback_reason": session.io_fallback_reason,
                "budget_how": session.budget_how,
                "open_reason": session.open_reason,
                **lossy_label(config),
                **session.lossy_counters(),
                **(stats.as_dict() if stats is not None else {}),
                "peak_rss_bytes": peak_rss_bytes(),
            }
            for sink in sinks:
                if isinstance(sink, CsvSink):
                    sink.summary({k: v for k, v in result.items() if k not in ("text", "tokens")})
                sink.close()
            await _drain(writers)
        return result


async def _drain(writers: list[asyncio.Future]) -> None:
    """Wait for the sink writers to write what was queued, even while being cancelled; a write
    error (a full disk) is raised once they have all stopped."""
    if not writers:
        return
    done = asyncio.gather(*writers, return_exceptions=True)
    cancelled = False
    while not done.done():
        try:
            await asyncio.shield(done)
        except asyncio.CancelledError:
            cancelled = True
    errors = [r for r in done.result() if isinstance(r, BaseException)]
    if errors:
        raise errors[0]
    if cancelled:
        raise asyncio.CancelledError


def _token_bar(total: int):  # noqa: ANN202 - a tqdm bar for long runs whose text goes to a file
    from tqdm import tqdm

    return tqdm(total=total, unit="tok", desc="generating", file=sys.stderr)


def _summary(r: dict) -> str:
    def num(v: float | None, fmt: str) -> str:
        return "unmeasured" if v is None else format(v, fmt)

    lossy = f" LOSSY {r['lossy_flags']}" if r.get("lossy") else ""
    line = f"[{r['mode']}{lossy}] {r['n_tokens']} tokens, {num(r['tok_per_s'], '.2f')} tok/s"
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
    sampling = _sampling(args)
    result = _run(_generate(args.model, config, _prompt_text(_prompt(args)), args.n_predict, echo=not args.json,
                            progress=args.progress, csv_path=args.csv, sampling=sampling, stop=args.stop,
                            quiet=args.quiet))
    if args.json:
        print(json.dumps(result))
    else:
        print()
        if not args.quiet:
            print(_summary(result), file=sys.stderr)
    return 0


CHAT_HELP = """commands:
  /help     this list
  /reset    forget the conversation (the system message stays)
  /stats    what the last reply measured, and the session's totals
  /think on|off   let a thinking model reason first (shown dimmed), or not
  /exit     leave (so does Ctrl-D)
Ctrl-C stops a reply and keeps the conversation; at the prompt it clears the line."""


async def _chat(model: Path, config: RunConfig, system: str | None, n: int, *, sampling=None,  # noqa: ANN001
                stop: list[str] | None = None, quiet: bool = False, think: bool = True) -> None:
    """The interactive chat. Line editing and history (prompt_toolkit) when standard input is a
    terminal, plain lines otherwise; prompts go to stderr when standard output is not a terminal,
    so a redirected transcript holds only the replies."""
    from bmoe.engine.chat import Message
    from bmoe.engine.session import Session

    with Session.open(model, config) as session:
        for warning in session.warnings:
            print(f"bmoe: warning: {warning}", file=sys.stderr)
        fmt = session.chat_format()
        dim = ("\x1b[2m", "\x1b[0m") if sys.stdout.isatty() else None  # reasoning: dimmed, or left out
        if not quiet:
            print(f"bmoe chat: {model.name}, {fmt.description}. /help lists commands; Ctrl-D leaves.",
                  file=sys.stderr)
        start: list[Message] = [Message("system", system)] if system else []
        history = list(start)
        read_line = _line_reader()
        totals = {"replies": 0, "tokens": 0, "prompt": 0, "reused": 0}
        while True:
            try:
                line = await read_line("> ")
            except KeyboardInterrupt:
                continue  # Ctrl-C at the prompt: the line is dropped, the chat goes on
            except EOFError:
                print(file=sys.stderr)
                return
            text = line.strip()
            if not text:
                continue
            if text.startswith("/"):
                command = text.split()[0]
                if command in ("/exit", "/quit"):
                    return
                if command == "/help":
                    print(CHAT_HELP, file=sys.stderr)
                elif command == "/reset":
                    history = list(start)
                    print("conversation cleared", file=sys.stderr)
                elif command == "/stats":
                    print(_chat_stats(session, totals), file=sys.stderr)
                elif command == "/think" and text.split()[1:] in (["on"], ["off"]):
                    think = text.split()[1] == "on"
                    print(f"thinking {'on' if think else 'off'}"
                          + ("" if fmt.thinks else " (this model's template has no thinking switch)"), file=sys.stderr)
                else:
                    print(f"unknown command {command}; /help lists them", file=sys.stderr)
                continue
            history.append(Message("user", _prompt_text(line)))
            prompt = _fit(session, fmt, history, n, {"enable_thinking": think})
            split = fmt.splitter(prompt)
            parts: list[str] = []
            _SIGINT_TAKEN_BY.append(session.cancel)  # Ctrl-C ends this reply only
            try:
                async for piece in session.stream(prompt, n, special=True, sampling=sampling, stop=stop):
                    reasoning, answer = split.feed(piece.text)
                    if piece.finish_reason is not None:
                        r2, a2 = split.flush()
                        reasoning, answer = reasoning + r2, answer + a2
                    if reasoning and dim is not None:
                        sys.stdout.write(dim[0] + reasoning + dim[1])
                    parts.append(answer)
                    sys.stdout.write(answer)
                    sys.stdout.flush()
                    if piece.usage is not None:
                        totals["replies"] += 1
                        totals["tokens"] += piece.usage.completion_tokens
                        totals["prompt"] += piece.usage.prompt_tokens
                        totals["reused"] += piece.usage.prompt_reused
                        if piece.finish_reason == "cancelled":
                            sys.stdout.write(" [stopped]")
            finally:
                _SIGINT_TAKEN_BY.remove(session.cancel)
            print()
            history.append(Message("assistant", "".join(parts)))
            stats = session.last_stats
            if stats is not None and not quiet:
                r = {"n_tokens": stats.generated_tokens, **stats.as_dict()}
                print(_summary(r), file=sys.stderr)


def _chat_stats(session, totals: dict[str, int]) -> str:  # noqa: ANN001
    stats = session.last_stats
    lines = []
    if stats is not None:
        lines.append("last reply: " + _summary({"n_tokens": stats.generated_tokens, **stats.as_dict()}))
    usage = session.last_usage
    if usage is not None:
        lines.append(f"last prompt: {usage.prompt_tokens} tokens, {usage.prompt_evaluated} evaluated, "
                     f"{usage.prompt_reused} reused from the context")
    lines.append(f"session: {totals['replies']} replies, {totals['tokens']} tokens generated, "
                 f"{totals['reused']} of {totals['prompt']} prompt tokens reused")
    return "\n".join(lines)


def _line_reader():  # noqa: ANN202 - async (prompt) -> line; raises EOFError / KeyboardInterrupt
    """prompt_toolkit on a terminal (editing, history, Ctrl-C clears the line); plain lines else."""
    prompt_to = sys.stdout if sys.stdout.isatty() else sys.stderr
    if sys.stdin.isatty():
        from prompt_toolkit import PromptSession
        from prompt_toolkit.history import InMemoryHistory
        from prompt_toolkit.output import create_output

        ps = PromptSession(history=InMemoryHistory(), output=create_output(stdout=prompt_to))

        async def edited(prompt: str) -> str:
            # Ctrl-C at the prompt is a key in raw mode; leave the runner's SIGINT handler alone
            return await ps.prompt_async(prompt, handle_sigint=False)

        return edited

    lines = _StdinLines()

    async def plain(prompt: str) -> str:
        prompt_to.write(prompt)
        prompt_to.flush()
        line = await lines.readline()
        if not line:
            raise EOFError
        return line.decode("utf-8", errors="replace").rstrip("\n")

    return plain


class _StdinLines:
    """Lines of standard input, waited for on the event loop: a pipe that stays open (a script
    feeding the chat) must not hold the process after a stop signal, as a thread blocked in
    ``readline`` did (the interpreter joins it at exit). What the loop cannot watch (a regular
    file, /dev/null) never blocks, and is read in a thread."""

    def __init__(self) -> None:
        self._fd = 0
        self._buf = b""
        self._eof = False

    async def readline(self) -> bytes:
        while b"\n" not in self._buf and not self._eof:
            chunk = await self._read()
            self._eof = not chunk
            self._buf += chunk
        line, nl, self._buf = self._buf.partition(b"\n")
        return line + nl

    async def _read(self) -> bytes:
        loop = asyncio.get_running_loop()
        ready = loop.create_future()
        try:
            loop.add_reader(self._fd, lambda: ready.done() or ready.set_result(None))
        except (OSError, ValueError):  # not pollable: a regular file or /dev/null, which never waits
            return await asyncio.to_thread(os.read, self._fd, 1 << 16)
        try:
            await ready
        finally:
            loop.remove_reader(self._fd)
        return os.read(self._fd, 1 << 16)


def _fit(session, fmt, history, n: int, template_kwargs: dict | None = None) -> str:  # noqa: ANN001
    """Render the conversation, dropping the oldest turns (never the system message) to fit."""
    while True:
        prompt = fmt.render(history, template_kwargs)
        if len(session.tokenize(prompt, special=True)) + n <= session.n_ctx:
            return prompt
        oldest = next((i for i, m in enumerate(history) if m.role != "system"), None)
        if oldest is None or oldest == len(history) - 1:
            raise ConfigError(f"the message does not fit the context ({session.n_ctx} tokens); raise -c")
        del history[oldest]
        print("bmoe: the conversation outgrew the context; dropped the oldest turn", file=sys.stderr)


def _cmd_chat(args: argparse.Namespace) -> int:
    if hasattr(sys.stdin, "reconfigure"):
        sys.stdin.reconfigure(errors="surrogateescape")  # bytes that are not UTF-8 reach _prompt_text
    _check_outputs(args, _model_files(args.model), "--route-trace")
    config, sampling = _config(args), _sampling(args)
    _run(_chat(args.model, config, args.system, args.n_predict, sampling=sampling, stop=args.stop,
               quiet=args.quiet, think=not args.no_think))
    return 0


def _cmd_replay(args: argparse.Namespace) -> int:
    from bmoe.engine.replay import OVERLAP_MODES, ComputeModel, model_replay, replay
    from bmoe.io.probe import cached_probe
    from bmoe.io.validate import open_layout
    from bmoe.pipeline.trace import read_trace

    _check_outputs(args, (args.trace, *_model_files(args.model)), "--csv", "--plot")
    io = args.io or ("real" if args.model else "sim")
    if io == "real" and args.model is None:
        raise ConfigError("--io real reads the model's bytes: give it with -m MODEL (or use --io sim)")
    if not 1 <= args.io_threads <= 64:
        raise ConfigError(f"--io-threads must be 1..64, got {args.io_threads}")
    timing = args.timing or ("model" if io == "sim" else "measure")
    if timing == "model" and io == "real":
        raise ConfigError("--timing model computes the reads' time: use it with --io sim (--io real measures)")
    trace = read_trace(args.trace)
    layout = open_layout(args.model) if io == "real" else None
    compute = ComputeModel(trace.timing, args.compute_ms_per_layer / 1e3)
    bad = [o for o in args.overlap if o not in OVERLAP_MODES]
    if bad:
        raise ConfigError(f"--overlap takes {', '.join(OVERLAP_MODES)}; got {', '.join(bad)}")
    results = []
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
                results.append(r.as_dict())
                if not args.json:
                    print(_replay_row(r.as_dict()), flush=True)
    clock = ("the modelled decode time (no sleeps)" if timing == "model"
             else "the replay's decode wall time")
    how = (f"compute: {compute.describe()}; reads: {results[0]['io'] if results else io}; hit % = hits / "
           f"(hits + experts read) per layer event, decode phase and all phases; tok/s = decode tokens "
           f"over {clock}")
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
                    shards=args.shards, n_nextn=args.mtp)
    spec.validate()  # a bad spec is one line, before any progress bar
    paths = _write_with_progress(args.out, spec)
    print(paths[0])
    return 0


def _write_with_progress(out: Path, spec) -> list[Path]:  # noqa: ANN001
    from tqdm import tqdm

    from bmoe.synth.tiny import write_tiny

    with tqdm(total=None, unit="B", unit_scale=True, desc=f"writing {out.name}", file=sys.stderr,
              disable=not sys.stderr.isatty()) as bar:
        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)

        try:
            return write_tiny(out, spec, progress)
        except OSError as e:
            if e.filename is None:
                e.filename = str(out)  # a failed write says where it was going
            raise


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
        r = _run(_generate(model, config.validate(), DEMO_PROMPT, args.n_predict, echo=False))
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
    "inspect": ("bmoe.inspect", "add_inspect_command",
                "what a model is and how it would run here, from its index alone"),
    "quality": ("bmoe.quality", "add_quality_command",
                "measure a lossy lever: agreement and KL vs the exact run, tok/s of both"),
    # The parser is light and lives here (it shares the run flags); starlette, uvicorn and the
    # server package are imported by _cmd_serve only.
    "serve": ("bmoe.cli", "_serve_parser", "an OpenAI-compatible HTTP server (chat and text completions)"),
}


class _ListArchs(argparse.Action):
    """``--list-archs``: print the supported architectures and exit, whatever else is given."""

    def __init__(self, option_strings: list[str], dest: str, **kw: object) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="print the supported architectures and exit")

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        from bmoe.inspect import list_archs

        print(list_archs())
        parser.exit()


def _lazy_parsers(sub: argparse._SubParsersAction, argv: list[str]) -> None:
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, register, help_) in _LAZY.items():
        if name == chosen:
            # This module's own entries come from this very module: run as ``python -m bmoe.cli``
            # it is ``__main__``, and a second copy would raise exceptions its main() cannot know.
            here = module == __spec__.name if __spec__ is not None else False
            getattr(sys.modules[__name__] if here else importlib.import_module(module), register)(sub)
        else:
            sub.add_parser(name, help=help_, add_help=False)


class _Parser(argparse.ArgumentParser):
    """argparse with its usage errors as one line (status 2, argparse's own convention)."""

    def error(self, message: str):  # noqa: ANN201 - NoReturn
        self.exit(2, f"bmoe: error: {self.prog}: {message}\n")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    from bmoe._version import __version__

    try:
        pin = version("llama-cpp-python")
    except PackageNotFoundError:
        pin = "not installed"
    return f"bmoe {__version__} (llama-cpp-python {pin})"


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = _Parser(prog="bmoe", description=__doc__.splitlines()[0])
    parser.add_argument("--list-archs", action=_ListArchs)
    parser.add_argument("--version", action="version", version=_version())
    _verbosity_flags(parser, top=True)
    sub = parser.add_subparsers(dest="command", required=True)
    _run_parser(sub)
    _chat_parser(sub)
    _replay_parser(sub)
    _demo_parser(sub)
    _lazy_parsers(sub, argv)
    _tiny_parser(sub)
    return parser


def _apply_verbosity(args: argparse.Namespace) -> None:
    """llama.cpp's log reaches stderr only with -v (bmoe reports failures itself, in one line)."""
    if getattr(args, "verbose", False):
        from bmoe.engine.seam import set_llama_log

        set_llama_log(True)


class Interrupted(Exception):
    """A run stopped by SIGINT, SIGTERM or SIGHUP after its sinks were flushed and closed."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# While set (the chat's reply in progress), Ctrl-C calls this instead of stopping the command.
_SIGINT_TAKEN_BY: list = []


def _run(coro):  # noqa: ANN001, ANN202 - run_async with the stop signals handled
    return run_async(_interruptible(coro))


async def _interruptible(coro):  # noqa: ANN001, ANN202
    """Run ``coro``; the first SIGINT, SIGTERM or SIGHUP cancels it (the decode stops at the next
    graph node, the sinks are flushed and closed) and ends as ``Interrupted``; a second one ends
    the process at once, even if a native call never returns."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    got: list[int] = []

    def on_signal(signum: int) -> None:
        if signum == signal.SIGINT and _SIGINT_TAKEN_BY and not got:
            _SIGINT_TAKEN_BY[-1]()
            return
        if got:
            os._exit(128 + got[0])
        got.append(signum)
        task.cancel()

    installed = []
    for sig in _STOP_SIGNALS:
        try:
            loop.add_signal_handler(sig, on_signal, sig)
            installed.append(sig)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread
            pass
    try:
        return await coro
    except asyncio.CancelledError:
        if got:
            raise Interrupted(got[0]) from None
        raise
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
        if got:
            raise Interrupted(got[0])


def _prompt_text(text: str) -> str:
    """A prompt from the command line as valid text: bytes that are not UTF-8 (which Python keeps as
    lone surrogates) become U+FFFD, with a warning, instead of failing inside the tokenizer."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        print("bmoe: warning: the prompt is not valid UTF-8; invalid bytes replaced by U+FFFD", file=sys.stderr)
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def _quiet_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's last flush cannot fail a second time."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


def _os_error_line(exc: OSError) -> str:
    where = f"{exc.filename}: " if exc.filename is not None else "writing the output: "
    return f"{where}{exc.strerror or exc}"


def _standard_streams() -> None:
    """Put /dev/null behind a standard descriptor the caller closed (``0<&-``, ``>&-``): otherwise
    the next file opened takes its number, and libuv (uvloop) aborts the process when it closes a
    descriptor below 3. Input then reads as empty, output goes nowhere, as a daemon's would."""
    for fd, mode in ((0, "r"), (1, "w"), (2, "w")):
        try:
            os.fstat(fd)
            continue
        except OSError:
            pass
        null = os.open(os.devnull, os.O_RDWR)
        if null != fd:
            os.dup2(null, fd)
            os.close(null)
        name = ("stdin", "stdout", "stderr")[fd]
        if getattr(sys, name) is None:  # Python found it closed at startup
            setattr(sys, name, open(fd, mode, closefd=False))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    _standard_streams()
    try:
        args = build_parser(argv).parse_args(argv)
        _apply_verbosity(args)
        status = args.func(args)
        sys.stdout.flush()  # here, where a full disk or a closed pipe can still be reported
        return status
    except BaseExceptionGroup as group:  # the CLI's own task groups (sinks beside a generation)
        exc = first_error(group)
        if isinstance(exc, Exception):
            return _fail(exc)
        raise
    except Exception as exc:  # noqa: BLE001 - the last line of defence: one line, never a traceback
        return _fail(exc)
    except KeyboardInterrupt:
        print("bmoe: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT


def _fail(exc: Exception) -> int:
    if isinstance(exc, Interrupted):
        print(f"bmoe: interrupted by {exc}; the output written so far is complete", file=sys.stderr)
        return 128 + exc.signum
    if isinstance(exc, BrokenPipeError) or (isinstance(exc, OSError) and exc.errno == errno.EPIPE):
        _quiet_stdout()  # a reader that went away (| head): quiet, with the status of SIGPIPE
        return 128 + signal.SIGPIPE
    if isinstance(exc, BmoeError):
        line = str(exc)
    elif isinstance(exc, OSError):
        line = _os_error_line(exc)
        if exc.filename is None:
            _quiet_stdout()
    elif isinstance(exc, MemoryError):
        line = "out of memory"
    else:
        if os.environ.get("BMOE_DEBUG"):
            raise exc
        line = f"internal error: {type(exc).__name__}: {exc} (BMOE_DEBUG=1 shows where; please report it)"
    print(f"bmoe: error: {line}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())

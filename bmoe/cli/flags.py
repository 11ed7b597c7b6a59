"""The flags several commands share, declared once, and their parsing into a RunConfig and
SamplingParams: a bad value is refused at parse time, in one line, before any model is opened
(``_number``, from ``bmoe.argtypes``)."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

from bmoe.argtypes import number as _number
from bmoe.argtypes import plain as _plain
from bmoe.engine.config import MAX_CTX, MiB, RunConfig
from bmoe.errors import ConfigError, OutputPathError


class _Help(argparse.HelpFormatter):
    """Help that shows each flag's default, where it has one worth showing (and the help text does not
    say it already)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if ("%(default)" in text or "(default:" in text or default is None or default is False or default == argparse.SUPPRESS
                or action.const is not None
                or isinstance(action, argparse._StoreTrueAction) or not action.option_strings):
            return text
        return f"{text} (default: %(default)s)"


MAX_MIB = float(1 << 30)  # 1 PiB: beyond any machine; bounds the bytes computed from a budget
_mib = _number(float, 0, MAX_MIB, "a number of MiB")
_tokens = _number(int, 1, 1 << 20, "a number of tokens")
_ctx = _number(int, 16, MAX_CTX, "a context length")
_threads = _number(int, 1, 512, "a thread count")
_io_threads = _number(int, 1, 64, "a number of I/O lanes")
_layers_ahead = _number(int, 0, 64, "a number of layers")


def _budget_mib(text: str) -> float:
    """A cache size in MiB: 0 (off) or from 1 MiB up. Below 1 MiB is a units mistake (bytes, not
    MiB), refused here as RunConfig refuses it; 1e-9 used to run with the cache quietly off."""
    value = _mib(text)
    if 0 < value < 1:
        raise argparse.ArgumentTypeError(f"expected 0 (off) or at least 1 MiB, got {text!r}")
    return value


def _cache_mb(text: str) -> float | None:
    if text == "auto":
        return None
    try:
        return _budget_mib(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a number of MiB: 0 (off) or 1 MiB to {_plain(MAX_MIB)}, "
                                         f"got {text!r}") from None


def _model_flag(p: argparse.ArgumentParser) -> None:
    """``-m MODEL`` of every command that opens a model (run, chat, serve)."""
    p.add_argument("-m", "--model", type=Path, required=True, help="GGUF file (shard 1 of a split set)")


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
                   help="expert cache budget in MiB, or 'auto' (default: 0, off: every routed expert read "
                        "every time)")
    p.add_argument("--cache-ceil-mb", type=_budget_mib, default=None,
                   help="with --cache-mb auto: the most the budget may be, at open and as the pressure guard "
                        "grows it (does nothing with a fixed --cache-mb)")
    p.add_argument("--cache-profile", default=None, metavar="FILE",
                   help="seed the cache policy from this JSON profile if it exists, save what the run "
                        "learned to it at the end (lossless: only the eviction order changes)")
    p.add_argument("--prewarm", action="store_true",
                   help="with --cache-profile: read the profile's most used experts into the cache's free room "
                        "in the background from the first prompt on (lossless; real reads go first)")
    p.add_argument("--force", action="store_true",
                   help="run a --cache-mb that the memory model says cannot fit (warned, not refused)")
    p.add_argument("--no-pressure-guard", action="store_true",
                   help="keep the budget fixed while running (default: shrink it under memory pressure)")
    p.add_argument("--no-warm-pool", action="store_true",
                   help="fault the cache's pages in on the reads only (default: a background thread faults "
                        "them in while the session is idle, so a fresh cache's first misses land in ready pages)")
    p.add_argument("--dense-weights", choices=("mmap", "anon"), default="mmap",
                   help="anon: copy dense weights into anonymous memory (safe from page-cache churn)")
    p.add_argument("--open-mode", choices=("auto", "user", "reserved", "mmap", "mmap-drop"), default="auto",
                   help="how a streamed model is opened (auto: the cheapest that works here)")
    p.add_argument("--prefill", choices=("auto", "batch", "token", "micro", "expert"), default="auto",
                   help="how a prompt runs: one batch, micro-batches of 8, token by token, expert-major (one "
                        "batch whose experts are read and computed group by group), or auto (one batch, or "
                        "expert-major where one batch's expert union would exceed the cache budget and the model "
                        "allows it; never chunks)")
    p.add_argument("--route-trace", default=None, help="write every routing decision to this file")
    p.add_argument("--overlap", action="store_true",
                   help="read later projections while earlier expert matmuls compute (lossless)")
    p.add_argument("--prefetch", type=_layers_ahead, default=0, metavar="K",
                   help="read the previous token's experts of the next K layers ahead (needs a cache)")
    p.add_argument("--predict-prefetch", action="store_true",
                   help="predict the next layer's experts with its router and read them ahead (needs a cache)")
    p.add_argument("--predict-prompt", action=argparse.BooleanOptionalAction, default=None,
                   help="the same for a batched prompt: read the next layer's predicted experts while a layer "
                        "computes (default: on when streaming with a cache)")
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


def _sampling_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (greedy unless --temp > 0; run through llama.cpp's samplers)")
    g.add_argument("--temp", type=float, default=0.0, help="temperature (0 = greedy)")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus: keep tokens up to this mass (1 = off)")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below this share of the top one (0 = off)")
    g.add_argument("--repeat-penalty", type=float, default=1.0, help="penalise recent tokens (1 = off)")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="penalise tokens already present (0 = off)")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="penalise tokens by their count (0 = off)")
    g.add_argument("--seed", type=int, default=None, help="seed of the draw (default, or -1: a fresh one each run)")
    g.add_argument("--grammar-file", type=Path, default=None, help="constrain the output with a GBNF grammar")
    g.add_argument("--json-schema", default=None,
                   help="constrain the output to JSON matching this schema (JSON text, or a file holding it)")
    g.add_argument("--stop", action="append", default=None, metavar="TEXT", type=_escaped,
                   help="stop before this text (repeatable); it is never printed; \\n \\t \\r \\\\ are "
                        "escapes, as in llama.cpp's command line")


_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", "'": "'", '"': '"'}


def _escaped(text: str) -> str:
    """A flag's text with the escapes llama.cpp's command line processes (``\\n \\r \\t \\\\ \\' \\"``):
    the shell passes ``--stop "\\n\\n"`` as a backslash and an n, which no model writes."""
    return re.sub(r"\\(.)", lambda m: _ESCAPES.get(m.group(1), m.group(0)), text)


def _sampling(args: argparse.Namespace):  # noqa: ANN202 - a bmoe.engine.sampling.SamplingParams
    grammar = schema = None
    if args.grammar_file is not None:
        try:
            grammar = args.grammar_file.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"--grammar-file {args.grammar_file}: {getattr(exc, 'strerror', None) or exc}") from None
    if args.json_schema is not None:
        text = args.json_schema
        if not text.lstrip().startswith(("{", "[")):
            try:
                text = Path(text).read_text()
            except (OSError, UnicodeDecodeError) as exc:
                raise ConfigError(f"--json-schema {args.json_schema}: neither JSON nor a readable file "
                                  f"({getattr(exc, 'strerror', None) or exc})") from None
        try:
            schema = json.loads(text)
        except ValueError as exc:
            raise ConfigError(f"--json-schema: not valid JSON ({exc})") from None
        if not isinstance(schema, dict):
            raise ConfigError(f"--json-schema: a schema is a JSON object, got {type(schema).__name__}")
    try:
        return _sampling_params(args, grammar, schema)
    except ConfigError as exc:
        raise _in_flags(exc) from None


def _sampling_params(args: argparse.Namespace, grammar: str | None, schema: object):  # noqa: ANN202
    from bmoe.engine.sampling import SamplingParams

    return SamplingParams(
        temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        repeat_penalty=args.repeat_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, grammar=grammar, json_schema=schema,
        seed=None if args.seed == -1 else args.seed,  # -1: a fresh one, as llama.cpp and the server spell it
    )


def _verbosity_flags(p: argparse.ArgumentParser, top: bool = False) -> None:
    """-v / -q, accepted before the command or after it (a subcommand's copy never resets the
    top-level one)."""
    default = False if top else argparse.SUPPRESS
    g = p.add_mutually_exclusive_group()
    g.add_argument("-v", "--verbose", action="store_true", default=default,
                   help="show llama.cpp's own log on stderr")
    g.add_argument("-q", "--quiet", action="store_true", default=default,
                   help="no banner, warnings or summaries on stderr: only the text and errors")


def _check_ceiling(args: argparse.Namespace) -> None:
    """A ceiling below the fixed budget asked for: the budget would quietly be the ceiling, not what
    ``--cache-mb`` says, so the pair is refused rather than one of them ignored."""
    mb, ceil = args.cache_mb, args.cache_ceil_mb
    if args.mode != "resident" and mb and ceil is not None and ceil < mb:
        raise ConfigError(f"--cache-ceil-mb {ceil:g} is below --cache-mb {mb:g}: the cache would be capped at "
                          f"{ceil:g} MiB, not the {mb:g} asked; give the budget with --cache-mb alone "
                          "(the ceiling caps --cache-mb auto)")


def _warn_ignored(args: argparse.Namespace) -> None:
    """Say so when a flag given does nothing in the chosen mode, rather than ignoring it silently."""
    if getattr(args, "quiet", False):
        return
    if args.mode != "resident":
        _warn_ignored_cache(args)
        return
    given = [flag for flag, on in (
        ("--cache-mb", args.cache_mb != 0), ("--cache-ceil-mb", args.cache_ceil_mb is not None),
        ("--io-threads", args.io_threads != 2), ("--no-odirect", args.no_odirect),
        ("--open-mode", args.open_mode != "auto"), ("--cache-profile", args.cache_profile is not None),
        ("--prewarm", args.prewarm),
    ) if on]
    if given:
        print(f"bmoe: warning: {', '.join(given)} {'does' if len(given) == 1 else 'do'} nothing with --resident "
              "(nothing is streamed)", file=sys.stderr)


def _warn_ignored_cache(args: argparse.Namespace) -> None:
    """The cache's flags that do nothing with the budget given (streamed runs)."""
    if args.cache_ceil_mb is not None and args.cache_mb is not None:  # a ceiling caps auto only
        how = "with the cache off (--cache-mb 0)" if args.cache_mb == 0 else "with a fixed --cache-mb"
        print(f"bmoe: warning: --cache-ceil-mb does nothing {how}: it caps --cache-mb auto", file=sys.stderr)
    if args.cache_profile is not None and args.cache_mb == 0:
        print("bmoe: warning: --cache-profile seeds no cache with the cache off (--cache-mb 0): it only records "
              "this run's routing to the file", file=sys.stderr)


# RunConfig / SamplingParams field names as the command line spells them: their errors name the
# API's fields (a Python caller's words); a command line user is told the flag instead.
_FLAG_OF = {
    "mode='stream'": "streaming (no --resident)", "mode='resident'": "--resident",
    "cache_bytes": "--cache-mb", "cache_ceiling_bytes": "--cache-ceil-mb", "cache_profile": "--cache-profile",
    "prefetch_layers": "--prefetch", "predict_prefetch": "--predict-prefetch", "predict_prompt": "--predict-prompt",
    "route_ahead": "--route-ahead", "drop_cold_experts": "--drop-cold-experts", "n_expert_used": "--n-expert-used",
    "drop_prefill": "--drop-prefill", "route_trace": "--route-trace", "io_threads": "--io-threads",
    "n_threads": "-t", "n_ctx": "-c", "open_mode": "--open-mode", "dense_weights": "--dense-weights",
    "top_p": "--top-p", "top_k": "--top-k", "min_p": "--min-p", "repeat_penalty": "--repeat-penalty",
    "presence_penalty": "--presence-penalty", "frequency_penalty": "--frequency-penalty",
    "json_schema": "--json-schema", "json_object": "a JSON object", "temperature": "--temp", "max_tokens": "-n",
    "seed": "--seed", "stop": "--stop", "drop_renorm": "--drop-no-renorm", "overlap": "--overlap",
}
_FLAG_WORDS = re.compile("|".join(rf"(?<![\w-]){re.escape(k)}(?![\w-])" for k in sorted(_FLAG_OF, key=len, reverse=True)))


def _in_flags(exc: ConfigError) -> ConfigError:
    """The same error in the command line's words (``cache_bytes`` -> ``--cache-mb``)."""
    return type(exc)(_FLAG_WORDS.sub(lambda m: _FLAG_OF[m.group(0)], str(exc)))


def _config(args: argparse.Namespace) -> RunConfig:
    _check_ceiling(args)
    _warn_ignored(args)
    try:
        return _run_config(args)
    except ConfigError as exc:
        raise _in_flags(exc) from None


def _run_config(args: argparse.Namespace) -> RunConfig:
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
        prewarm=args.prewarm,
        pressure_guard=not args.no_pressure_guard,
        warm_pool=not args.no_warm_pool,
        dense_weights=args.dense_weights,
        open_mode=args.open_mode,
        prefill=getattr(args, "prefill", "auto"),
        route_trace=args.route_trace,
        overlap=args.overlap,
        prefetch_layers=args.prefetch,
        predict_prefetch=args.predict_prefetch,
        predict_prompt=args.predict_prompt,
        **_lossy_config(args),
    ).validate()


def _model_files(model: Path | None) -> tuple[Path, ...]:
    """The model and every shard its name implies: the inputs no output may overwrite."""
    from bmoe.io.layout import split_shard_paths

    return () if model is None else (model, *split_shard_paths(model))


def _input_files(args: argparse.Namespace) -> tuple[Path, ...]:
    """The files a command reads besides the model: a prompt file, a grammar, a JSON schema file."""
    files = [getattr(args, name, None) for name in ("file", "grammar_file")]
    schema = getattr(args, "json_schema", None)
    if schema is not None and not schema.lstrip().startswith(("{", "[")):
        files.append(Path(schema))
    return tuple(Path(f) for f in files if f is not None)


def _check_outputs(args: argparse.Namespace, inputs: tuple[Path, ...], *flags: str) -> None:
    """Refuse, before anything is opened, any output flag that names an input (the model, or a
    prompt, grammar or schema file) or another output, or cannot be written: one file written by
    two flags keeps only the last one's bytes. ``-`` is refused too (status 2): it used to write a
    file named ``-``, and standard output already carries the command's own output."""
    from bmoe.io.paths import check_output, is_stream

    inputs = (*inputs, *_input_files(args))
    seen: list[tuple[str, Path]] = []
    for flag in flags:
        value = getattr(args, flag.lstrip("-").replace("-", "_"), None)
        if value is None:
            continue
        if str(value) == "-":  # not standard output: each command's own output is there already
            from bmoe.cli.edge import UsageError

            raise UsageError(f"bmoe {args.command}: {flag} -: standard output carries the command's own output; "
                             f"give {flag} a file name")
        if is_stream(value):  # /dev/null for two outputs, /dev/stdout and /dev/stderr on one terminal
            continue
        out = check_output(value, flag, inputs)
        for other_flag, other in seen:
            if out.resolve() == other.resolve() or _same_file(out, other):
                raise OutputPathError(f"{flag} and {other_flag} name the same file ({out}); give each its own")
        seen.append((flag, out))


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False

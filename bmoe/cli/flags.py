"""The flags several commands share, added from the one vocabulary (``bmoe.cli.options``), and their
parsing into a RunConfig and SamplingParams: a bad value is refused at parse time, in one line,
before any model is opened; a flag that does nothing in the mode chosen is said."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from bmoe.argtypes import number, plain
import bmoe.cli.options as options
from bmoe.engine.config import RunConfig
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


_number = number
_plain = plain
_mib, _tokens, MAX_MIB = options.mib, options.tokens, options.MAX_MIB
_escaped = options.escaped
_in_flags = options.in_flags


def _model_flag(p: argparse.ArgumentParser) -> None:
    """``-m MODEL`` of every command that opens a model (run, chat, serve)."""
    p.add_argument("-m", "--model", type=Path, required=True, help="GGUF file (shard 1 of a split set)")


def _common_flags(p: argparse.ArgumentParser) -> None:
    """The engine flags of every command that opens a model (run, chat, serve), from the vocabulary."""
    options.add_options(p, options.ENGINE)


def _lossy_cli(p: argparse.ArgumentParser) -> None:
    """The opt-in lossy levers of run and chat (every figure a run with one reports then says lossy)."""
    options.add_options(p, options.LOSSY, options.LOSSY_TITLE)


def _sampling_flags(p: argparse.ArgumentParser) -> None:
    options.add_options(p, options.SAMPLING, options.SAMPLING_TITLE)


def _sampling(args: argparse.Namespace):  # noqa: ANN202 - a bmoe.engine.sampling.SamplingParams
    from bmoe.engine.sampling import SamplingParams

    try:
        return SamplingParams(**options.fields_of(args, "sampling"))
    except ConfigError as exc:
        raise _in_flags(exc) from None


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
    """A flag given that does nothing in the chosen mode is said, never ignored silently: with
    ``--resident`` (nothing streamed) it is refused, one line and status 2, since a run without
    the cache asked for (``--resident --cache-mb 4096``, said only as a warning that -q hid)
    measures something else than what was asked; a streamed run's cache flags that do nothing
    with the budget given are warned about."""
    if args.mode != "resident":
        if not getattr(args, "quiet", False):
            _warn_ignored_cache(args)
        return
    given = [o.name for o in options.options_of(args) if o.streamed_only and options.given(args, o)]
    if given:
        from bmoe.cli.edge import UsageError

        raise UsageError(f"{', '.join(given)} {'does' if len(given) == 1 else 'do'} nothing with --resident "
                         "(nothing is streamed): drop it, or stream")


def _warn_ignored_cache(args: argparse.Namespace) -> None:
    """The cache's flags that do nothing with the budget given (streamed runs)."""
    if args.cache_ceil_mb is not None and args.cache_mb is not None:  # a ceiling caps auto only
        how = "with the cache off (--cache-mb 0)" if args.cache_mb == 0 else "with a fixed --cache-mb"
        print(f"bmoe: warning: --cache-ceil-mb does nothing {how}: it caps --cache-mb auto", file=sys.stderr)
    if args.cache_profile is not None and args.cache_mb == 0:
        print("bmoe: warning: --cache-profile seeds no cache with the cache off (--cache-mb 0): it only records "
              "this run's routing to the file", file=sys.stderr)


def _config(args: argparse.Namespace) -> RunConfig:
    """The RunConfig the command line asks for: the fields of the options the command declared."""
    _check_ceiling(args)
    _warn_ignored(args)
    try:
        return RunConfig(**options.fields_of(args))
    except ConfigError as exc:
        raise _in_flags(exc) from None


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

            raise UsageError(f"{flag} -: standard output carries the command's own output; "
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

"""The command line itself: its parser, the dispatch to a command, and the one line (and exit
status) every failure becomes. ``bmoe.cli.main`` imports it inside its own guard, so a Ctrl-C
while these modules load is an interrupt like any other, not a traceback."""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import signal
import sys

from bmoe.cli.chat import _chat_parser
from bmoe.cli.demo import _demo_parser, _tiny_parser
from bmoe.cli.edge import (
    Interrupted,
    UsageError,
    _os_error_line,
    _quiet_stdout,
    _standard_streams,
)
from bmoe.cli.flags import _in_flags, _verbosity_flags
from bmoe.cli.replay import _replay_parser
from bmoe.cli.run import _run_parser
from bmoe.errors import BmoeError, ConfigError, first_error

# Subcommands whose modules are heavy to import (numpy, gguf writers, the bench harness): their full
# parser is registered only when the command line names them; otherwise a one-line entry keeps
# them listed in ``bmoe --help``.
_LAZY = {
    "bench": ("bmoe.bench.harness", "add_bench_command",
              "measure resident, mmap and streamed runs of one model side by side"),
    "synth": ("bmoe.synth.big", "add_synth_command",
              "write a random MoE GGUF with a real model's shapes (fast, any size)"),
    "inspect": ("bmoe.cli.inspect", "add_inspect_command",
                "what a model is and how it would run here, from its index alone"),
    "quality": ("bmoe.cli.quality", "add_quality_command",
                "measure a lossy lever: agreement and KL vs the exact run, tok/s of both"),
    # The parser is light and lives in bmoe.cli.serve (it shares the run flags); starlette, uvicorn
    # and the server package are imported by _cmd_serve only.
    "serve": ("bmoe.cli.serve", "_serve_parser", "an OpenAI-compatible HTTP server (chat and text completions)"),
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
            getattr(importlib.import_module(module), register)(sub)
        else:
            sub.add_parser(name, help=help_, add_help=False)


class _Parser(argparse.ArgumentParser):
    """argparse with its usage errors as one line (status 2, argparse's own convention), prefixed
    once, as every other error: ``bmoe: error: MESSAGE`` (it read ``bmoe: error: bmoe run: ...``)."""

    def error(self, message: str):  # noqa: ANN201 - NoReturn
        self.exit(2, f"bmoe: error: {message}\n")


class _Command(_Parser):
    """A subcommand's parser. argparse leaves the words a subcommand does not know to the top-level
    parser, which refused them as its own ("bmoe: unrecognized arguments: -p hi" for ``bmoe chat``):
    the subcommand refuses them itself, so the message names it as its other usage errors do."""

    def parse_known_args(self, args=None, namespace=None):  # noqa: ANN001, ANN201 - argparse's signature
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)} ({self.prog} --help lists its flags)")
        return namespace, extras


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    from bmoe._version import __version__

    try:
        pin = version("llama-cpp-python")
    except PackageNotFoundError:
        pin = "not installed"
    return f"bmoe {__version__} (llama-cpp-python {pin})"


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = _Parser(prog="bmoe", description="Run Mixture-of-Experts GGUF models bigger than RAM: the "
                     "dense part in memory, each token's experts read from disk.")
    parser.add_argument("--list-archs", action=_ListArchs)
    parser.add_argument("--version", action="version", version=_version())
    _verbosity_flags(parser, top=True)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Command)
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
        from bmoe.llama.seam import set_llama_log

        set_llama_log(True)


# The commands whose flags spell RunConfig's fields (run, chat, serve, and quality's own and --lossy
# flags): a ConfigError raised past their parsing (a lever checked against the file at open, say)
# names the API's field, and is told to the user with the flag instead (``_in_flags``).
_RUN_FLAG_COMMANDS = frozenset({"run", "chat", "serve", "quality"})


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = None
    try:
        _standard_streams()
        args = build_parser(argv).parse_args(argv)
        command = args.command
        _check_usage(args)
        _apply_verbosity(args)
        status = args.func(args)
        sys.stdout.flush()  # here, where a full disk or a closed pipe can still be reported
        return status
    except BaseExceptionGroup as group:  # the CLI's own task groups (sinks beside a generation)
        exc = first_error(group)
        if isinstance(exc, Exception):
            return _fail(exc, command)
        if isinstance(exc, KeyboardInterrupt):
            return _interrupted()
        raise
    except Exception as exc:  # noqa: BLE001 - the last line of defence: one line, never a traceback
        return _fail(exc, command)
    except KeyboardInterrupt:
        return _interrupted()


def _check_usage(args: argparse.Namespace) -> None:
    """What argparse cannot see: -q and -v given on the two sides of the command (each side's pair
    is refused by argparse itself), and a prompt given as empty text (run -p '', bench --prompt '')."""
    if getattr(args, "quiet", False) and getattr(args, "verbose", False):
        raise UsageError("-q/--quiet and -v/--verbose cannot be given together")
    if getattr(args, "prompt", None) == "":
        raise UsageError("the prompt is empty")


def _interrupted() -> int:
    print("bmoe: interrupted", file=sys.stderr)
    return 128 + signal.SIGINT


def _fail(exc: Exception, command: str | None = None) -> int:
    if isinstance(exc, ConfigError) and command in _RUN_FLAG_COMMANDS:
        exc = _in_flags(exc)
    if isinstance(exc, Interrupted):
        print(f"bmoe: interrupted by {exc}; the output written so far is complete", file=sys.stderr)
        return 128 + exc.signum
    if isinstance(exc, BrokenPipeError) or (isinstance(exc, OSError) and exc.errno == errno.EPIPE):
        _quiet_stdout()  # a reader that went away (| head): quiet, with the status of SIGPIPE
        return 128 + signal.SIGPIPE
    if isinstance(exc, UsageError):
        print(f"bmoe: error: {exc}", file=sys.stderr)
        return 2
    if isinstance(exc, BmoeError):
        line = str(exc)
    elif isinstance(exc, OSError):
        line = _os_error_line(exc)
        if exc.filename is None and exc.errno != errno.ENOMEM:
            _quiet_stdout()
    elif isinstance(exc, MemoryError):
        line = "out of memory"
    elif isinstance(exc, RuntimeError) and "can't start new thread" in str(exc):
        line = "out of memory or threads: a thread could not be started (the memory, ulimit -v or ulimit -u left is too small)"
    else:
        if os.environ.get("BMOE_DEBUG"):
            raise exc
        line = f"internal error: {type(exc).__name__}: {exc} (BMOE_DEBUG=1 shows where; please report it)"
    print(f"bmoe: error: {line}", file=sys.stderr)
    return 1

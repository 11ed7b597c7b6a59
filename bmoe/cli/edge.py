"""What run, chat and serve share at the process edge: the stop signals (a first SIGINT, SIGTERM
or SIGHUP ends a run cleanly as ``Interrupted``, a second one at once), the standard streams a
caller closed, prompt text that is not UTF-8, and the one line an OSError becomes."""

from __future__ import annotations

import asyncio
import errno
import os
import signal
import sys

from bmoe.engine.aio import run as run_async
from bmoe.errors import ConfigError


class Interrupted(Exception):
    """A run stopped by SIGINT, SIGTERM or SIGHUP after its sinks were flushed and closed."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class UsageError(ConfigError):
    """A command line that cannot run as given, found only once a command has read its inputs (an
    empty prompt file): one line and status 2, as argparse's own usage errors."""


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


def _prompt_text(text: str, quiet: bool = False) -> str:
    """A prompt from the command line, a file or standard input as valid text: bytes that are not
    UTF-8 (kept as lone surrogates, as Python keeps them in ``sys.argv``) become U+FFFD, with a
    warning (none with ``quiet``), instead of failing inside the tokenizer."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        if not quiet:
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
    """An OSError as one line. Without a file name it is the output's (a full disk under stdout),
    except when the system is out of memory (a refused mapping of the model's index, say), which
    read as "writing the output: Cannot allocate memory"."""
    if exc.errno == errno.ENOMEM and exc.filename is None:
        return (f"out of memory: {exc.strerror or exc} (the memory or address space left, e.g. by ulimit -v, "
                "is too small)")
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

"""The ``bmoe`` command line, the application layer: run, chat, serve, replay, demo, make-tiny, and
the heavy ones (bench, synth, inspect, quality) whose parsers load only when the command line names
them (``_LAZY``), so ``bmoe --help`` and ``bmoe run`` import no bench harness or gguf writer.

Every bmoe error ends as one line on stderr and exit status 1 (2 for a bad command line, as
argparse's own); no traceback reaches a user for a bad file or flag. Text goes to stdout as it is generated; summaries go to stderr (or, with
``--json``, one JSON object to stdout instead of both).

This module stays this small on purpose: the ``bmoe`` script and ``python -m bmoe`` import it before
anything else, so a Ctrl-C while the rest loads (``bmoe.cli.app`` and all it imports) lands inside
``main``'s guard and ends as status 130 with one line, never a KeyboardInterrupt traceback.
"""

from __future__ import annotations

import sys

_INTERRUPTED = 130  # 128 + SIGINT, as the shell reports a process a Ctrl-C ended


def main(argv: list[str] | None = None) -> int:
    """Run the command line; its exit status."""
    try:
        from bmoe.cli.app import main as run

        return run(argv)
    except KeyboardInterrupt:  # before app.main's own guard is in place (imports), or after it
        try:
            print("bmoe: interrupted", file=sys.stderr)
        except (OSError, ValueError):
            pass
        return _INTERRUPTED


def __getattr__(name: str) -> object:
    """``build_parser`` and the rest of ``bmoe.cli.app``, importable from here as they always were."""
    if name.startswith("__"):
        raise AttributeError(name)
    from importlib import import_module

    app = import_module("bmoe.cli.app")
    try:
        return getattr(app, name)
    except AttributeError:
        raise AttributeError(f"module 'bmoe.cli' has no attribute {name!r}") from None

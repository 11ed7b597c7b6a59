"""``bmoe run``: generate text from a MoE GGUF, text to stdout as it comes, a summary to stderr
(or one JSON object with ``--json``)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bmoe.cli.edge import Interrupted, UsageError, _prompt_text, _run
from bmoe.cli.flags import (
    _check_outputs,
    _common_flags,
    _config,
    _Help,
    _lossy_cli,
    _model_files,
    _model_flag,
    _sampling,
    _sampling_flags,
    _tokens,
    _verbosity_flags,
)
from bmoe.cli.generate import _generate, _summary
from bmoe.errors import ConfigError


def _run_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="generate text from a MoE GGUF (greedy unless --temp)",
                       formatter_class=_Help)
    _model_flag(p)
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
    """The prompt of -p TEXT, -p - (standard input) or -f FILE, bytes that are not UTF-8 kept as lone
    surrogates whichever way it came, for ``_prompt_text`` to replace and warn about. An empty one is
    a usage error (status 2)."""
    if args.file is not None:
        try:
            text = args.file.read_bytes().decode("utf-8", "surrogateescape")
        except OSError as exc:
            raise ConfigError(f"-f {args.file}: {exc.strerror}") from None
        where = f" (-f {args.file})"
    elif args.prompt == "-":
        text, where = sys.stdin.buffer.read().decode("utf-8", "surrogateescape"), " (-p -: standard input)"
    else:
        text, where = args.prompt, ""
    if not text:
        raise UsageError(f"the prompt is empty{where}")
    return text


def _cmd_run(args: argparse.Namespace) -> int:
    _check_outputs(args, _model_files(args.model), "--csv", "--route-trace", "--cache-profile")
    config = _config(args)
    sampling = _sampling(args)
    partial: dict = {}
    try:
        result = _run(_generate(args.model, config, _prompt_text(_prompt(args), args.quiet), args.n_predict,
                                echo=not args.json, progress=args.progress, csv_path=args.csv, sampling=sampling,
                                stop=args.stop, quiet=args.quiet, partial=partial))
    except Interrupted:
        if args.json and partial:  # what was made before the signal, still one JSON object
            print(json.dumps(partial | {"finish_reason": partial.get("finish_reason") or "cancelled"}))
        raise
    if args.json:
        print(json.dumps(result))
    else:
        print()
        if not args.quiet:
            print(_summary(result), file=sys.stderr)
    return 0

"""``bmoe quality``: its parser, registered only when the command line names it (``_LAZY``); the
measurement is ``bmoe.quality``. Both runs' engine flags come from the vocabulary, and so do the
levers ``--lossy "FLAGS"`` reads (``parse_lossy``), which are run's and chat's own flags."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import bmoe.cli.options as options
from bmoe.argtypes import number
from bmoe.cli.flags import _config, _Help


def add_quality_command(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from bmoe import quality

    p = subparsers.add_parser(
        "quality", help="measure a lossy lever: agreement and KL vs the exact run, and tok/s of both",
        description=quality.__doc__.split("\n\n")[0].replace("``", "") if quality.__doc__ else None,
        formatter_class=_Help,
    )
    p.add_argument("model", type=Path, help="GGUF file (shard 1 of a split set)")
    p.add_argument("--lossy", required=True, metavar='"FLAGS"',
                   help='the lever flags of the lossy run, e.g. "--n-expert-used 4"; write --lossy="--route-ahead=1" '
                        'when the flags start with a glued value (argparse reads "--x=1" alone as a flag)')
    p.add_argument("-n", "--tokens", type=number(int, 2, 1 << 20, "a number of tokens"), default=16,
                   help="tokens per prompt")
    p.add_argument("--prompts", type=Path, default=None,
                   help="prompt file, one a line (default: the shipped set)")
    p.add_argument("--max-prompts", type=number(int, 1, 1 << 30, "a number of prompts"), default=None,
                   help="use only the first N prompts (default: all)")
    options.add_options(p, (options.MODE, options.IO_THREADS, options.THREADS))
    # Two sessions open side by side: each sizing its cache from the memory available would count
    # the other's as free, so the cache stays off unless a budget is given.
    options.CACHE_MB.add(p, default=0.0, help="expert cache budget of each of the two runs, in MiB, or 'auto'")
    options.CTX.add(p, default=512)
    options.remember(p, (options.CACHE_MB, options.CTX))
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(func=run_quality_command, cache_ceil_mb=None, cache_profile=None)
    return p


def run_quality_command(args: argparse.Namespace) -> int:
    from bmoe.engine.aio import run as run_async
    from bmoe.quality import compare, read_prompts, shipped_prompts, table

    exact = _config(args)
    lossy = replace(exact, **options.parse_lossy(args.lossy))
    prompts = shipped_prompts() if args.prompts is None else read_prompts(args.prompts)
    if args.max_prompts is not None:
        prompts = prompts[: args.max_prompts]
    result = run_async(compare(args.model, exact, lossy, prompts, args.tokens)).as_dict()
    if args.json:
        print(json.dumps(result))
    else:
        print(table(result), file=sys.stderr)
    return 0

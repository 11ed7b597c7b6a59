"""``bmoe inspect``: its parser, registered only when the command line names it (``_LAZY``); the
report is ``bmoe.inspect`` (the index alone: llama.cpp is never imported). ``--io-threads`` is the
vocabulary's, the lanes the forecast assumes."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict
from pathlib import Path

import bmoe.cli.options as options
from bmoe.argtypes import checked
from bmoe.cli.flags import _Help

GiB = 1 << 30


def add_inspect_command(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from bmoe.inspect import COMPUTE_PRIOR_GBS

    p = subparsers.add_parser("inspect", help="what a model is and how it would run here (index only)",
                              formatter_class=_Help)
    p.add_argument("model", type=Path, help="GGUF file (shard 1 of a split set)")
    p.add_argument("--ram", type=checked(float, lambda v: 0 < v < math.inf, "a positive number of GiB"),
                   default=None, metavar="GiB", help="RAM to plan for, in GiB (default: MemAvailable)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.add_argument("--probe", action="store_true",
                   help="measure the device's read rate if no probe of it is stored (writes a 256 MiB scratch file "
                        "beside the model, then removes it; default: a prior rate, labelled so)")
    options.IO_THREADS.add(p, help="read lanes the forecast assumes")
    p.add_argument("--compute-gbs", type=checked(float, lambda v: 0 < v < math.inf, "a positive rate"),
                   default=None, help=f"measured compute rate (GB/s of weights; default: a {COMPUTE_PRIOR_GBS:g} GB/s "
                                      "prior)")
    p.set_defaults(func=_cmd_inspect)
    return p


def _cmd_inspect(args: argparse.Namespace) -> int:
    from bmoe.inspect import inspect_model, render

    ram = None if args.ram is None else int(args.ram * GiB)
    report = inspect_model(args.model, ram_bytes=ram, probe=args.probe, lanes=args.io_threads,
                           compute_gbs=args.compute_gbs)
    if args.json:
        print(json.dumps(asdict(report)))
    else:
        print(render(report))
    return 0

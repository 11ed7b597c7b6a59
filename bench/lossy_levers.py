"""The lossy levers measured side by side: for each lever, ``bmoe quality``'s comparison with the
exact run (same cache budget, same prompts, both sessions open at once and alternating per prompt),
so every row's tok/s ratio is lossy over exact measured in the same minutes. Prints one JSON line
per lever (each with ``lossy: true`` and its flags) and a Markdown table. Nothing is asserted.

On a ``bmoe synth`` model the weights are random: agreement and KL measure how far a lever
perturbs the computation, not what it costs a real model's text.

    python bench/lossy_levers.py MODEL [--cache-mb 2000] [-n 16] [--prompts 4] [-t T] [--levers "..."] [--force-cache]
                                       [--ram-limit GB]

``--ram-limit GB`` emulates a smaller machine for the whole run, as ``bmoe bench --ram-limit`` does
(an mlock balloon in a child process leaves GB available). Both sessions are open at once: size
``--cache-mb`` so that two dense parts and two caches fit under the limit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from dataclasses import replace
from pathlib import Path

from bmoe.bench.balloon import Balloon, GiB, plan_balloon
from bmoe.engine.aio import run as run_async
from bmoe.engine.config import MiB, RunConfig
from bmoe.cli.options import parse_lossy
from bmoe.errors import BmoeError
from bmoe.io.validate import open_layout
from bmoe.quality import compare, shipped_prompts


def default_levers(k: int) -> list[str]:
    return [
        f"--n-expert-used {k}", f"--n-expert-used {k - 2}", f"--n-expert-used {k // 2}",
        "--drop-cold-experts 0.5", "--drop-cold-experts 0.75", "--drop-cold-experts 1.0",
        "--route-ahead 1", "--route-ahead 2",
    ]


def measure(args: argparse.Namespace, exact: RunConfig, k: int) -> list[dict]:
    rows = []
    for flags in args.levers or default_levers(k):
        lossy = replace(exact, **parse_lossy(flags))
        r = run_async(compare(args.model, exact, lossy, shipped_prompts()[: args.prompts], args.tokens)).as_dict()
        print(json.dumps(r), flush=True)
        rows.append(r)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--cache-mb", type=float, default=2000.0)
    ap.add_argument("-n", "--tokens", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--force-cache", action="store_true",
                    help="open even when the memory model says the budget does not fit now (the pressure "
                         "guard still shrinks it while running)")
    ap.add_argument("--ram-limit", type=float, default=None, metavar="GB",
                    help="lock memory in a balloon so that only GB stay available while measuring")
    ap.add_argument("--levers", type=lambda s: s.split(","), default=None,
                    help='comma-separated flag strings, e.g. "--n-expert-used 4,--route-ahead 1"')
    args = ap.parse_args()
    layout = open_layout(args.model)
    k = layout.n_expert_used
    exact = RunConfig(mode="stream", n_ctx=512, n_threads=args.threads, cache_bytes=int(args.cache_mb * MiB),
                      force_cache=args.force_cache)
    plan = None
    if args.ram_limit is not None:  # refused before anything is measured
        plan = plan_balloon(int(args.ram_limit * GiB), layout.dense_bytes)
    with contextlib.ExitStack() as stack:
        if plan is not None and plan.lock_bytes > 0:
            print(f"balloon: {plan.how}", file=sys.stderr, flush=True)
            stack.callback(Balloon(plan.lock_bytes).inflate().release)
        rows = measure(args, exact, k)
    print("\n| lever | exact tok/s | lossy tok/s | ratio | agreement % | KL mean | KL max | MiB read/token exact → lossy |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        e, lo = r["exact"], r["lossy_run"]
        ratio = lo["tok_per_s"] / e["tok_per_s"] if e["tok_per_s"] and lo["tok_per_s"] else None

        def f(v: float | None, fmt: str) -> str:
            return "unmeasured" if v is None else format(v, fmt)

        mib = [None if x["bytes_read_per_token"] is None else x["bytes_read_per_token"] / MiB for x in (e, lo)]
        print(f"| `{r['lossy_flags']}` | {f(e['tok_per_s'], '.2f')} | {f(lo['tok_per_s'], '.2f')} | "
              f"{f(ratio, '.2f')}x | {f(r['agreement_pct'], '.1f')} | {f(r['kl_mean'], '.3f')} | "
              f"{f(r['kl_max'], '.3f')} | {f(mib[0], '.0f')} → {f(mib[1], '.0f')} |")


if __name__ == "__main__":
    try:
        main()
    except BmoeError as e:  # a bad model, flag or limit: one line, as the CLI says it
        raise SystemExit(f"lossy_levers: {e}") from None

"""How far ``bmoe inspect``'s decode forecast is from measured ``bmoe run``s, per model and budget.

For each model: ``inspect --probe`` (the device probe at the model's slice size, measured once and
cached), then in one process, side by side: a resident run (whose tok/s gives a measured compute
rate: active bytes per token x tok/s) and streamed runs with the cache off and at half the expert
bank. Per streamed budget it prints the forecast (prior hit rate, prior compute), the forecast with
the measured compute rate and the measured hit rate (what the inputs explain), and the measured
tok/s, read per token and read rate. Synthetic models route near-uniformly (no skew profile for
these shapes), so the prior hit rate, fitted to a real trace, is expected to be optimistic there.

    python bench/forecast_check.py MODEL.gguf [MODEL.gguf ...] [-n 32]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from bmoe.engine.config import MiB, RunConfig
from bmoe.engine.session import Session
from bmoe.inspect import inspect_model

PROMPT = "The quick brown fox jumps over the lazy dog, and the experts stream from disk."


async def generate(path: Path, config: RunConfig, n: int):  # noqa: ANN201
    with Session.open(path, config) as s:
        return (await s.generate(PROMPT, n, stop_at_end=False)).stats


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+", type=Path)
    ap.add_argument("-n", type=int, default=32)
    args = ap.parse_args()
    for path in args.models:
        report = inspect_model(path, probe=True)
        active = report.forecasts[0].compute_s * report.compute_gbs * 1e9
        resident = asyncio.run(generate(path, RunConfig(mode="resident", n_ctx=512), args.n))
        measured_gbs = active * resident.tok_per_s / 1e9
        print(f"{path.name}: read rate {report.read_mib_s:.0f} MiB/s ({report.read_how}); "
              f"resident {resident.tok_per_s:.2f} tok/s -> compute {measured_gbs:.2f} GB/s "
              f"(prior {report.compute_gbs:g}); {report.bytes_per_token_cache_off / MiB:.1f} MiB/token cache off")
        for f in report.forecasts:
            if f.label not in ("cache off", "half bank"):
                continue
            stats = asyncio.run(generate(path, RunConfig(mode="stream", n_ctx=512, cache_bytes=f.budget_bytes), args.n))
            decode_tokens = stats.decode_steps
            hit = stats.cache_hit_pct or 0.0
            read_tok = report.bytes_per_token_cache_off * (1 - hit / 100)
            explained = 1 / (read_tok / (report.read_mib_s * MiB) + active / (measured_gbs * 1e9))
            err = (f.tok_s - stats.tok_per_s) / stats.tok_per_s * 100
            print(f"  {f.label:<9} {f.budget_bytes / MiB:8.0f} MiB: forecast {f.tok_s:6.2f} tok/s "
                  f"(prior hit {f.hit_pct_prior:.0f} %), measured {stats.tok_per_s:6.2f} tok/s "
                  f"(hit {hit:.0f} %, {stats.bytes_read / (stats.generated_tokens + 0.0) / MiB:.1f} MiB read/token incl. prompt, "
                  f"engine read rate {stats.read_mib_per_s or 0:.0f} MiB/s): off by {err:+.0f} %; "
                  f"with measured hit and compute {explained:.2f} tok/s ({(explained - stats.tok_per_s) / stats.tok_per_s * 100:+.0f} %)"
                  f" [{decode_tokens} decode steps]")
    return 0


if __name__ == "__main__":
    sys.exit(main())

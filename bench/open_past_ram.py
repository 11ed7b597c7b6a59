"""Opening a model bigger than RAM + swap: bytes read and seconds per open mode, side by side.

Each mode runs in a fresh process with the model's page cache evicted first: open the model for
streaming with the mode forced, then greedy-decode a few tokens with a fixed cache budget. Reports
per mode the open's bytes read (/proc/self/io read_bytes) as a multiple of the model's dense
bytes, the open's wall seconds, decode tok/s, peak RSS, and whether the tokens equal the first
successful mode's. A mode the machine refuses (``user`` past RAM + swap) is reported with its
reason and no numbers (null, not zero). Nothing is asserted.

    python bench/open_past_ram.py MODEL [--modes reserved,mmap-drop,user] [-n 4] [--cache-mb 2000] [-t T]

Make a model past RAM + swap with ``bmoe synth --like qwen3-30b-a3b --type q8_0 OUT`` (30 GiB).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

PROMPT = "The quick brown fox jumps over the lazy dog, and the experts stream from disk."


def child(path: str, mode: str, n: int, cache_mb: int, threads: int | None) -> dict:
    from bmoe.engine.config import MiB, RunConfig
    from bmoe.engine.session import Session
    from bmoe.errors import BmoeError
    from bmoe.io.pagecache import evict_file_cache
    from bmoe.io.validate import open_layout

    layout = open_layout(path)
    evict_file_cache(layout.shards)
    config = RunConfig(mode="stream", open_mode=mode, cache_bytes=cache_mb * MiB, n_ctx=256, n_threads=threads)
    out: dict = {"mode": mode, "dense_bytes": layout.dense_bytes, "file_bytes": layout.file_bytes}
    t0 = time.perf_counter()
    try:
        session = Session.open(path, config)
    except BmoeError as e:
        out.update(refused=f"{type(e).__name__}: {e}", open_s=None, open_bytes_read=None)
        return out
    out["open_s"] = time.perf_counter() - t0
    with session:
        out.update(open_mode=session.open_mode, open_reason=session.open_reason,
                   open_bytes_read=session.open_bytes_read)

        async def go() -> list[int]:
            return (await session.generate(PROMPT, n, stop_at_end=False)).tokens

        out["tokens"] = asyncio.run(go())
        stats = session.last_stats
        out["decode_tok_s"] = stats.tok_per_s if stats else None
        out["io_mode"] = session.io_mode
        out["read_mib_per_s"] = stats.read_mib_per_s if stats else None
        out["bytes_read"] = stats.bytes_read if stats else None
        out["cache_hit_pct"] = stats.cache_hit_pct if stats else None
        out["prefill_s"] = stats.prefill_s if stats else None
    out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def _num(x: float | None, fmt: str) -> str:
    return "null" if x is None else format(x, fmt)


def _line(r: dict) -> str:
    if r.get("open_s") is None:
        return f"refused ({r.get('refused')})"
    read, dense = r.get("open_bytes_read"), r["dense_bytes"]
    rss = r.get("peak_rss_bytes")
    return (
        f"open {r['open_s']:.2f} s, read {_num(read and read / 2**20, '.0f')} MiB = "
        f"{_num(r['open_read_over_dense'], '.2f')}x dense ({dense / 2**20:.0f} MiB), decode "
        f"{_num(r.get('decode_tok_s'), '.2f')} tok/s, peak RSS {_num(rss and rss / 2**30, '.2f')} GiB, "
        f"tokens match: {r['tokens_match']}; run read {_num(r.get('bytes_read') and r['bytes_read'] / 2**20, '.0f')} MiB "
        f"at {_num(r.get('read_mib_per_s'), '.0f')} MiB/s ({r.get('io_mode')}), hit {_num(r.get('cache_hit_pct'), '.1f')} %"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--modes", default="reserved,mmap-drop,user")
    ap.add_argument("-n", type=int, default=4)
    ap.add_argument("--cache-mb", type=int, default=2000)
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.model, args.child, args.n, args.cache_mb, args.threads)))
        return
    results = []
    for mode in args.modes.split(","):
        cmd = [sys.executable, __file__, args.model, "--child", mode, "-n", str(args.n), "--cache-mb", str(args.cache_mb)]
        if args.threads:
            cmd += ["-t", str(args.threads)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode != 0 or not lines:
            tail = proc.stderr.strip().splitlines()[-1:]
            r = {"mode": mode, "refused": f"exit {proc.returncode}: {tail[0] if tail else ''}", "open_s": None}
        else:
            r = json.loads(lines[-1])
        results.append(r)
    reference = next((r["tokens"] for r in results if r.get("tokens")), None)
    for r in results:
        dense = r.get("dense_bytes")
        read = r.get("open_bytes_read")
        r["open_read_over_dense"] = read / dense if read is not None and dense else None
        r["tokens_match"] = r["tokens"] == reference if r.get("tokens") is not None else None
        print(f"{r['mode']:>10}: {_line(r)}")
    print(json.dumps({"model": str(Path(args.model)), "results": results}))


if __name__ == "__main__":
    main()

"""Expert cache and cheap open, measured in one run on one model.

For three cache budgets (below one token's working set, about half the expert bank, the whole
bank) it generates the same tokens streamed and reports hit %, decode tok/s and peak RSS next to
budget + dense bytes; then it opens the model twice with the file evicted from the page cache,
the plain mmap way and the cheap way, and reports the bytes each read (/proc/self/io read_bytes).
Synthetic routers route nearly uniformly, so hit rates here are a floor, not what real routing
gives (see bench/policies.py for the real trace).

    python bench/cache_budgets.py [--model M] [-n 48]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from bmoe.engine.aio import run as run_async
from bmoe.engine.config import MiB, RunConfig
from bmoe.engine.session import Session
from bmoe.io.pagecache import evict_file_cache
from bmoe.io.probe import cache_dir
from bmoe.io.validate import open_layout
from bmoe.metrics.tokens import peak_rss_bytes
from bmoe.synth.tiny import TinySpec, write_tiny

PROMPT = "The quick brown fox jumps over the lazy dog, and the experts stream from disk."
DEFAULT = TinySpec(wtype="q8_0", n_layer=10, n_embd=1024, n_expert=64, n_expert_used=4, n_ff=512)


async def generate(path: Path, config: RunConfig, n: int) -> dict:
    with Session.open(path, config) as s:
        g = await s.generate(PROMPT, n, stop_at_end=False)
        return {"tokens": g.tokens, "dense": s.layout.dense_bytes, **g.stats.as_dict()}


def in_child(path: Path, cache_bytes: int | None, n: int) -> dict:
    """One run in a fresh process, so its peak RSS is its own."""
    out = subprocess.run(
        [sys.executable, __file__, "--child", str(path), str(cache_bytes), str(n)],
        capture_output=True, text=True, check=True,
    )
    return json.loads(out.stdout)


def child(path: Path, cache_bytes: str, n: int) -> None:
    mode = "resident" if cache_bytes == "None" else "stream"
    config = RunConfig(mode=mode, cache_bytes=0 if mode == "resident" else int(cache_bytes))
    r = run_async(generate(path, config, n))
    r["peak_rss"] = peak_rss_bytes()
    print(json.dumps(r))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path)
    ap.add_argument("-n", type=int, default=48)
    ap.add_argument("--child", nargs=3)
    args = ap.parse_args()
    if args.child:
        child(Path(args.child[0]), args.child[1], int(args.child[2]))
        return
    path = args.model or cache_dir() / "bench" / "bmoe-bench-q8_0-l10-e1024-x64-k4-f512.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_tiny(path, DEFAULT)
    layout = open_layout(path)
    working_set = layout.expert_bytes_per_token()
    budgets = {
        "below working set": max(MiB, working_set // 2),
        "half the bank": layout.expert_bytes // 2,
        "whole bank": layout.expert_bytes,
    }
    resident = in_child(path, None, args.n)
    rows = []
    for name, budget in budgets.items():
        r = in_child(path, budget, args.n)
        rows.append({
            "budget": name,
            "budget_mib": round(budget / MiB, 1),
            "identical_tokens": r["tokens"] == resident["tokens"],
            "decode_hit_pct": None if r["cache_hit_pct"] is None else round(r["cache_hit_pct"], 1),
            "tok_s": round(r["tok_per_s"], 2),
            "mib_read": round(r["bytes_read"] / MiB, 1),
            "resident_cache_mib": round(r["resident_cache_bytes"] / MiB, 1),
            "peak_rss_mib": round(r["peak_rss"] / MiB, 1),
            "budget_plus_dense_mib": round((budget + layout.dense_bytes) / MiB, 1),
        })
    opens = {}
    for mode in ("mmap", "user"):
        evict_file_cache([path])
        with Session.open(path, RunConfig(open_mode=mode)) as s:
            opens[mode] = s.open_bytes_read
    print(json.dumps({
        "model": str(path),
        "file_mib": round(layout.file_bytes / MiB, 1),
        "dense_mib": round(layout.dense_bytes / MiB, 1),
        "working_set_mib": round(working_set / MiB, 1),
        "resident_tok_s": round(resident["tok_per_s"], 2),
        "budgets": rows,
        "open_bytes_read_mib": {k: None if v is None else round(v / MiB, 1) for k, v in opens.items()},
        "open_over_dense": {k: None if v is None else round(v / layout.dense_bytes, 3) for k, v in opens.items()},
        "resident_peak_rss_mib": round(resident["peak_rss"] / MiB, 1),
        "how": "one process; runs in the order listed; tok/s = decode tokens after the first over "
               "summed decode calls; hit % = hits / (hits + experts read) over the whole generation "
               "(prefill included); open bytes = /proc/self/io read_bytes across Session.open after "
               "posix_fadvise(DONTNEED) of the file; peak RSS = VmHWM of a fresh process per run "
               "(it includes the interpreter, numpy and llama.cpp's own buffers: KV, compute)",
    }, indent=1))


if __name__ == "__main__":
    main()

"""Streaming core, measured side by side in one run (the machines are shared and noisy).

For one model (made with make-tiny at the given size if absent) it runs, in interleaved rounds:
  resident         plain llama.cpp, no eval callback
  resident+filter  the eval callback installed, filtering every node but streaming nothing
  stream           experts read from disk per token, cache off (every routed expert read)
then replays exactly the slice reads the streamed run made, layer by layer with the same lanes,
through the same reader outside the engine ("direct"), to compare the engine's read rate with the
device's at the same slice sizes. Reports medians over rounds and the ratios. Nothing here is asserted.

    python bench/stream_core.py [--model M] [--layers 10 --embd 1024 --experts 64 --used 4 --ff 512 --type q8_0]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bmoe.engine.aio import run as run_async
from bmoe.engine.config import MiB, RunConfig
from bmoe.engine.session import Session
from bmoe.io.direct import ShardReader
from bmoe.io.probe import cache_dir
from bmoe.io.regions import Region
from bmoe.pipeline.hooks import Hooks
from bmoe.synth.tiny import TinySpec, write_tiny

PROMPT = "The quick brown fox jumps over the lazy dog, and the experts stream from disk."


async def one_run(path: Path, config: RunConfig, n: int, hooks: Hooks | None = None) -> dict:
    with Session.open(path, config, hooks=hooks) as s:
        g = await s.generate(PROMPT, n, stop_at_end=False)
    assert g.stats is not None
    return {"tokens": g.tokens, **g.stats.as_dict()}


def direct_probe(path: Path, groups: list[list[tuple[int, int, int]]], lanes: int) -> dict:
    """Read the recorded slices layer group by layer group, ``lanes`` threads at a time, straight
    into a region congruent with the file as the engine does, with no pipeline around them."""
    reader = ShardReader([path], direct=True)
    largest = max(n for g in groups for _, _, n in g)
    regions = [Region(largest, 0) for _ in range(max(len(g) for g in groups))]
    wall = 0.0
    total = 0
    try:
        with ThreadPoolExecutor(lanes) as pool:
            for group in groups:
                t0 = time.perf_counter()
                futs = [
                    pool.submit(reader.read_into, shard, off, n, regions[i].base + off % 4096)
                    for i, (shard, off, n) in enumerate(group)
                ]
                total += sum(f.result() for f in futs)
                wall += time.perf_counter() - t0
    finally:
        for r in regions:
            r.close()
        reader.close()
    return {"bytes": total, "seconds": wall, "mib_s": total / MiB / wall, "mode": reader.mode}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path)
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--embd", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--used", type=int, default=4)
    ap.add_argument("--ff", type=int, default=512)
    ap.add_argument("--type", default="q8_0")
    ap.add_argument("-n", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--io-threads", type=int, default=2)
    args = ap.parse_args()
    path = args.model
    if path is None:
        spec = TinySpec(wtype=args.type, n_layer=args.layers, n_embd=args.embd, n_expert=args.experts,
                        n_expert_used=args.used, n_ff=args.ff)
        name = (f"bmoe-bench-{spec.wtype}-l{spec.n_layer}-e{spec.n_embd}-x{spec.n_expert}"
                f"-k{spec.n_expert_used}-f{spec.n_ff}.gguf")
        path = cache_dir() / "bench" / name
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            write_tiny(path, spec)
    runs: dict[str, list[dict]] = {"resident": [], "resident+filter": [], "stream": []}
    configs = {
        "resident": RunConfig(mode="resident"),
        "resident+filter": RunConfig(mode="resident", eval_filter=True),
        "stream": RunConfig(mode="stream", io_threads=args.io_threads),
    }
    groups: list[list[tuple[int, int, int]]] = []

    def record(request) -> bool:  # noqa: ANN001 - lane thread; a layer's reads end before the next plan
        groups[-1].append((request.shard, request.offset, request.nbytes))
        return True

    recording = Hooks(before_read=record, on_plan=lambda _e, _p: groups.append([]))
    for r in range(args.rounds):
        for name, config in configs.items():
            hooks = recording if name == "stream" and r == 0 else None
            runs[name].append(run_async(one_run(path, config, args.n, hooks)))
    probe = direct_probe(path, [g for g in groups if g], args.io_threads)

    def med(name: str, key: str) -> float:
        return statistics.median(x[key] for x in runs[name])

    res, filt, stream = med("resident", "tok_per_s"), med("resident+filter", "tok_per_s"), med("stream", "tok_per_s")
    same = all(x["tokens"] == runs["resident"][0]["tokens"] for v in runs.values() for x in v)
    report = {
        "model": str(path),
        "model_mib": round(os.path.getsize(path) / MiB, 1),
        "tokens": args.n,
        "rounds": args.rounds,
        "identical_tokens": same,
        "resident_tok_s": round(res, 2),
        "resident_filter_tok_s": round(filt, 2),
        "callback_overhead_ms_per_token": round((1 / filt - 1 / res) * 1e3, 3),
        "stream_tok_s": round(stream, 2),
        "stream_over_resident": round(stream / res, 3),
        "stream_read_mib_s": round(med("stream", "read_mib_per_s"), 1),
        "stream_blocked_ms_per_token": round(med("stream", "blocked_s") * 1e3 / args.n, 2),
        "stream_mib_per_token": round(med("stream", "bytes_read") / MiB / args.n, 2),
        "direct_probe_mib_s": round(probe["mib_s"], 1),
        "stream_read_over_direct": round(med("stream", "read_mib_per_s") / probe["mib_s"], 3),
        "io_mode": runs["stream"][0]["io_mode"],
        "how": "medians over rounds of wall-clock decode tok/s (tokens after the first); the engine read "
               "rate is file bytes over the summed per-layer windows from issuing a layer's reads to the "
               "last landing; the probe replays the first streamed run's slices, grouped by layer, with "
               "the same lane count through the same O_DIRECT reader, timed per group the same way",
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

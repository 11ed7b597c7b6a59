"""Overlap and read-ahead, measured side by side in one run, plus replay's what-if for a
per-expert readiness hook.

On one model and one cache budget it runs in interleaved rounds: serial, --overlap, --prefetch 1,
--predict-prefetch, and --overlap with each read-ahead; reports median decode tok/s, and per decode
token the stall (compute thread blocked on reads) and the rest (compute), each tok/s as a ratio to
serial, and checks every configuration produced the serial tokens. The default model is the
benchmark generator's 8-layer qwen3-30b-a3b shape in q4_0 (3.3 GB, written once into the user
cache directory) with an eighth of its expert bank as cache: there a serial token's stall on reads
and its compute take about as long as each other (44 and 48 ms, `docs/facts.md`). Then it records
a route trace of a serial run and replays it (real reads from the model, the trace's own compute
timings) with --overlap none, tensor and expert, so the gain a per-expert hook would add over
tensor overlap is predicted before anyone writes it. Nothing is asserted.

    python bench/overlap.py [--model M] [--cache-mb N] [-n 32] [--rounds 3] [-t T] [--io-threads N] [--no-replay]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from bmoe.engine.aio import run as run_async
from bmoe.engine.config import MiB, RunConfig
from bmoe.engine.replay import ComputeModel, replay
from bmoe.engine.session import Session
from bmoe.io.probe import cache_dir
from bmoe.io.validate import open_layout
from bmoe.pipeline.trace import read_trace
from bmoe.synth.big import SynthSpec, write_synth

PROMPT = "The quick brown fox jumps over the lazy dog, and the experts stream from disk."
DEFAULT = SynthSpec(like="qwen3-30b-a3b", n_layer=8, wtype="q4_0")


async def run(path: Path, config: RunConfig, n: int) -> dict:
    """Tokens, generation stats, and per decode token the ms blocked on reads and the rest."""
    tokens, stall, compute = [], [], []
    with Session.open(path, config) as s:
        async for piece in s.stream(PROMPT, n, stop_at_end=False):
            if piece.token is None:
                continue
            tokens.append(piece.token)
            m = piece.metrics
            if m is not None and m.phase == "decode":
                stall.append(m.read_wait_ms or 0.0)
                compute.append(m.compute_ms)
        stats = s.last_stats
    return {**stats.as_dict(), "tokens": tokens, "decode_stall_ms": statistics.fmean(stall),
            "decode_compute_ms": statistics.fmean(compute)}


def replay_what_if(path: Path, layout, base: dict, budget: int, n: int) -> dict[str, float]:  # noqa: ANN001
    """Decode tok/s a serial run's trace predicts under each overlap mode."""
    with tempfile.TemporaryDirectory() as tmp:
        trace_path = Path(tmp) / "serial.route.csv"
        run_async(run(path, RunConfig(**base, route_trace=str(trace_path)), n))
        trace = read_trace(trace_path)
    compute = ComputeModel(trace.timing, 0.0)
    predicted = {}
    for overlap in ("none", "tensor", "expert"):
        r = run_async(replay(trace, budget_bytes=budget, policy="lru", compute=compute, model=layout, overlap=overlap))
        predicted[overlap] = r.tok_per_s
    return predicted


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path)
    ap.add_argument("--cache-mb", type=float, default=None)
    ap.add_argument("-n", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-t", "--threads", type=int, default=None, help="compute threads (default: every core)")
    ap.add_argument("--io-threads", type=int, default=2)
    ap.add_argument("--no-replay", action="store_true", help="skip the replay what-if")
    args = ap.parse_args()
    path = args.model or cache_dir() / "bench" / DEFAULT.file_name()
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_synth(path, DEFAULT)
    layout = open_layout(path)
    budget = int(args.cache_mb * MiB) if args.cache_mb is not None else layout.expert_bytes // 8
    base = {"cache_bytes": budget, "io_threads": args.io_threads, "n_threads": args.threads}
    configs = {
        "serial": RunConfig(**base),
        "overlap": RunConfig(**base, overlap=True),
        "prefetch 1": RunConfig(**base, prefetch_layers=1),
        "predict-prefetch": RunConfig(**base, predict_prefetch=True),
        "overlap + prefetch 1": RunConfig(**base, overlap=True, prefetch_layers=1),
        "overlap + predict-prefetch": RunConfig(**base, overlap=True, predict_prefetch=True),
    }
    runs: dict[str, list[dict]] = {k: [] for k in configs}
    for _ in range(args.rounds):
        for name, config in configs.items():
            runs[name].append(run_async(run(path, config, args.n)))
    reference = runs["serial"][0]["tokens"]
    serial_tok = statistics.median(r["tok_per_s"] for r in runs["serial"])
    table = []
    for name, rs in runs.items():
        tok = statistics.median(r["tok_per_s"] for r in rs)
        table.append({
            "config": name,
            "identical_tokens": all(r["tokens"] == reference for r in rs),
            "tok_s": round(tok, 2),
            "over_serial": round(tok / serial_tok, 3),
            "decode_stall_ms_per_token": round(statistics.median(r["decode_stall_ms"] for r in rs), 2),
            "decode_compute_ms_per_token": round(statistics.median(r["decode_compute_ms"] for r in rs), 2),
            "hit_pct": round(statistics.median(r["cache_hit_pct"] for r in rs), 1),
            "prefetch_useful_of_issued": f"{rs[0]['prefetch_useful']}/{rs[0]['prefetch_issued']}",
            "predict_accuracy_pct_mean": (
                round(statistics.mean(rs[0]["predict_accuracy_pct"].values()), 1)
                if rs[0]["predict_accuracy_pct"] else None
            ),
        })
    predicted = {} if args.no_replay else replay_what_if(path, layout, base, budget, args.n)
    print(json.dumps({
        "model": str(path),
        "cache_mb": round(budget / MiB, 1),
        "tokens": args.n,
        "rounds": args.rounds,
        "live": table,
        "threads": args.threads or "every core",
        "io_threads": args.io_threads,
        "replay_tok_s": {k: round(v, 2) for k, v in predicted.items()} or "not run",
        "replay_expert_over_tensor": round(predicted["expert"] / predicted["tensor"], 3) if predicted else None,
        "replay_tensor_over_none": round(predicted["tensor"] / predicted["none"], 3) if predicted else None,
        "how": "live: medians over rounds, configurations interleaved, decode tok/s = tokens after the "
               "first over summed decode calls; per decode token, stall = compute thread blocked on the "
               "pipeline and compute = the rest of the token's wall time; replay: "
               "a serial run's route trace replayed with real reads and its recorded per-layer compute, "
               "compute modelled as n_proj+1 equal parts per layer (see bmoe/engine/replay.py)",
    }, indent=1))


if __name__ == "__main__":
    main()

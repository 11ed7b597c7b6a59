"""How often is a layer's routing predicted right one layer early, per ``synth --route-drift``?

bmoe reads a layer's experts ahead by applying that layer's router to the previous layer's router
input (``bmoe.stages.predict``). On a plain skewed synthetic model the prediction is always right
(nothing writes what the routers read), a best case; ``--route-drift GAMMA`` moves the routers'
inputs from layer to layer. For each gamma this writes a ``--like qwen3-30b-a3b`` model of
``--layers`` layers and measures, with a cache that holds the whole bank (reads do not matter):

- token: the decode's per-token score, the share of a token's top-k the prediction named
  (``--predict-prefetch``, prompt read-ahead off);
- prompt: the prompt's per-layer score, the union the rows named against the union they routed,
  over the larger of the two (the prompt read-ahead's own score, one per layer);
- popularity and reuse of the decode's routing (``bench/routing_realism.py``'s statistics), which
  the drift must leave where the routing profile put them;
- whether the streamed tokens equal the resident run's.

    python bench/route_drift.py [--gammas 0,0.1,0.2,0.3] [--layers 8] [-n 48] [--keep DIR]

Nothing is asserted; one JSON line per gamma and a table.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

from bmoe.engine.aio import run as run_async
from bmoe.engine.config import RunConfig
from bmoe.engine.session import Session
from bmoe.pipeline.trace import read_trace
from bmoe.synth.big import SynthSpec, write_synth

sys.path.insert(0, str(Path(__file__).parent))
from routing_realism import PROMPT, decode_masks, layer_stats  # noqa: E402

CACHE = 8 << 30  # more than the bank of any --layers this script is meant for: nothing is evicted


def _score(predictor) -> float | None:  # noqa: ANN001 - a Predictor
    pct = predictor.overall_pct()
    return None if pct is None else round(pct, 1)


def measure(path: Path, n: int, trace: Path) -> dict:
    async def go() -> dict:
        out: dict = {}
        with Session.open(path, RunConfig(mode="resident", n_ctx=512)) as s:
            resident = (await s.generate(PROMPT, n, stop_at_end=False)).tokens
        token = RunConfig(mode="stream", n_ctx=512, cache_bytes=CACHE, predict_prefetch=True,
                          predict_prompt=False, route_trace=str(trace))
        with Session.open(path, token) as s:
            streamed = (await s.generate(PROMPT, n, stop_at_end=False)).tokens
            predictor = s._streaming.modes.predictor
            out["token_pct"] = _score(predictor)
            by_layer = predictor.accuracy_pct()
            out["token_pct_worst_layer"] = round(min(by_layer.values()), 1) if by_layer else None
            out["token_pct_best_layer"] = round(max(by_layer.values()), 1) if by_layer else None
        prompt = RunConfig(mode="stream", n_ctx=512, cache_bytes=CACHE, predict_prompt=True)
        with Session.open(path, prompt) as s:
            await s.generate(PROMPT, 1, stop_at_end=False)
            out["prompt_pct"] = _score(s._streaming.modes.predictor)
        out["identical"] = streamed == resident
        return out

    return run_async(go())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gammas", default="0,0.1,0.2,0.3")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--type", dest="wtype", default="q4_0")
    ap.add_argument("-n", type=int, default=48, help="decoded tokens")
    ap.add_argument("--keep", type=Path, default=None, metavar="DIR", help="write the models here and keep them")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.keep or Path(tmp)
        for gamma in (float(g) for g in args.gammas.split(",")):
            path = folder / f"drift-{gamma:g}-{args.layers}.gguf"
            if not path.exists():
                write_synth(path, SynthSpec(like="qwen3-30b-a3b", n_layer=args.layers, wtype=args.wtype,
                                            route_drift=gamma))
            trace = Path(tmp) / f"drift-{gamma:g}.route.csv"
            row = {"gamma": gamma, "layers": args.layers, "tokens": args.n} | measure(path, args.n, trace)
            stats = layer_stats(decode_masks(read_trace(trace)))
            row["popularity"] = round(float(np.mean(stats["popularity"])), 3)
            row["reuse"] = round(float(np.mean(stats["reuse"])), 3)
            print(json.dumps(row), flush=True)
            rows.append(row)
            if args.keep is None:
                path.unlink()
    print(f"{'gamma':>6} {'token %':>8} {'worst..best layer':>18} {'prompt %':>9} {'popularity':>11} "
          f"{'reuse':>6}  identical")
    for r in rows:
        span = f"{r['token_pct_worst_layer']}..{r['token_pct_best_layer']}"
        print(f"{r['gamma']:>6g} {r['token_pct']!s:>8} {span:>18} {r['prompt_pct']!s:>9} {r['popularity']:>11} "
              f"{r['reuse']:>6}  {r['identical']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Does a synthetic model route like the real one? Popularity and reuse, per layer, side by side.

Two statistics per MoE layer, over the decode steps of a run:

- popularity: the share of all routed slots that go to the layer's 8 most used experts
  (uniform routing over 128 experts gives ~0.12 at 128 steps x top-6, from sampling noise alone);
- reuse: the share of a token's experts that the previous token also used (uniform: k/E);
- (shown, not fitted) floor: the same overlap at lags 2, 3, 4 and 8, i.e. what popularity alone
  explains; reuse above it is the short-range (previous-token) part.

``--derive`` computes them for every layer of the shared real trace and inverts the router logit
model of ``bmoe.synth.shapes.RoutingProfile`` for each layer (a simulation with the trace's own
expert count, top-k and step count, on a grid, common random numbers), then checks the table in
``bmoe/synth/shapes.py`` against it (or prints it for pasting).

Without ``--derive``: writes a small ``--like qwen3-30b-a3b`` model twice (routing profile on, and
off: plain random routers, the control), generates tokens streamed (cache off) with a route trace,
and prints each synthetic layer next to the real layer at the same relative depth, whose fitted
profile it carries (the real stats are averaged over decode windows as long as the synthetic run),
and next to the logit model's expectation for that profile (a synthetic layer is one draw of the
expert popularities and one run: it scatters around it). The synthetic model runs at the trace's
top-k (6), so the numbers compare like for like. Models and traces are deleted unless --keep.

    python bench/routing_realism.py [--layers 4] [--type q4_0] [-n 64] [--seed 0] [--dir D]
    python bench/routing_realism.py --derive [--print]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from bmoe.engine.aio import run as run_async
from bmoe.io.probe import cache_dir
from bmoe.pipeline.trace import RouteTrace, default_trace_path, read_trace

TOP = 8  # popularity: share of the top-8 experts
FLOOR_LAGS = (2, 3, 4, 8)
PROMPT = ("User: Explain in a few sentences why the sky is blue and why sunsets are red.\n"
          "Assistant:")


# ---- statistics -------------------------------------------------------------------------------

def decode_masks(trace: RouteTrace, turn: int = 0) -> np.ndarray:
    """bool [n_layer, n_steps, n_expert]: which experts each decode step routed to, per layer."""
    d = (trace.phase == 1) & (trace.turn == turn)
    steps = np.unique(trace.step[d])
    index = np.full(int(steps.max()) + 1, -1)
    index[steps] = np.arange(len(steps))
    sel = np.zeros((trace.n_layer, len(steps), trace.n_expert), dtype=bool)
    sel[trace.layer[d].astype(np.int64), index[trace.step[d]], trace.expert[d].astype(np.int64)] = True
    return sel


def popularity(sel: np.ndarray) -> np.ndarray:
    """sel [..., steps, experts] -> share of routed slots taken by the top-8 experts [...]."""
    counts = sel.sum(-2)
    top = np.sort(counts, axis=-1)[..., ::-1][..., :TOP].sum(-1)
    return top / np.maximum(counts.sum(-1), 1)


def overlap(sel: np.ndarray, lag: int = 1) -> np.ndarray:
    """Share of step t's experts that step t-lag also used, summed over t [...]."""
    both = (sel[..., lag:, :] & sel[..., :-lag, :]).sum((-1, -2))
    return both / np.maximum(sel[..., lag:, :].sum((-1, -2)), 1)


def layer_stats(sel: np.ndarray, window: int | None = None) -> dict[str, np.ndarray]:
    """Per layer: popularity, reuse (lag 1) and floor (mean overlap at FLOOR_LAGS), each the mean
    over consecutive windows of ``window`` steps (the whole run if None)."""
    n = sel.shape[1]
    w = n if window is None or window >= n else window
    chunks = [sel[:, s:s + w] for s in range(0, n - w + 1, w)]
    return {
        "popularity": np.mean([popularity(c) for c in chunks], axis=0),
        "reuse": np.mean([overlap(c, 1) for c in chunks], axis=0),
        "floor": np.mean([np.mean([overlap(c, g) for g in FLOOR_LAGS], axis=0) for c in chunks], axis=0),
    }


# ---- the logit model and its inversion ----------------------------------------------------------

def simulate(sigma_b: np.ndarray, alpha: np.ndarray, n_expert: int, k: int, steps: int,
             reps: int = 48, seed: int = 20260715) -> dict[str, np.ndarray]:
    """Stats of routing by logits sigma_b*b_e + (u_t + alpha*u_{t-1})/sqrt(1+alpha^2) (see
    RoutingProfile), for arrays of parameters; common random numbers across parameters."""
    rng = np.random.default_rng(seed)
    b = rng.standard_normal((reps, 1, n_expert), dtype=np.float32)
    u = rng.standard_normal((reps, steps + 1, n_expert), dtype=np.float32)
    out = {"popularity": [], "reuse": [], "floor": []}
    for sb, al in zip(np.ravel(sigma_b), np.ravel(alpha)):
        z = sb * b + (u[:, 1:] + al * u[:, :-1]) / np.sqrt(1 + al * al)
        top = np.argpartition(-z, k, axis=-1)[..., :k]
        sel = np.zeros(z.shape, dtype=bool)
        np.put_along_axis(sel, top, True, axis=-1)
        out["popularity"].append(popularity(sel).mean())
        out["reuse"].append(overlap(sel, 1).mean())
        out["floor"].append(np.mean([overlap(sel, g).mean() for g in FLOOR_LAGS]))
    shape = np.shape(sigma_b)
    return {key: np.array(v).reshape(shape) for key, v in out.items()}


SB_GRID = np.round(np.arange(0.0, 4.01, 0.1), 2)
AL_GRID = np.round(np.arange(0.0, 1.01, 0.1), 2)


def invert(pop: np.ndarray, reuse: np.ndarray, n_expert: int, k: int,
           steps: int) -> tuple[np.ndarray, np.ndarray, dict]:
    """(sigma_b, alpha) per layer whose simulated (popularity, reuse) match the given ones: the
    simulated surfaces on a grid, bilinearly refined to 0.01, nearest point in a metric scaled by
    each statistic's noise; alpha is clamped to [0, 1] (an MA(1) cannot correlate more)."""
    sb, al = np.meshgrid(SB_GRID, AL_GRID, indexing="ij")
    grid = simulate(sb, al, n_expert, k, steps)
    fine_sb = np.round(np.arange(SB_GRID[0], SB_GRID[-1] + 1e-9, 0.01), 2)
    fine_al = np.round(np.arange(AL_GRID[0], AL_GRID[-1] + 1e-9, 0.01), 2)
    surf = {key: _bilinear(grid[key], SB_GRID, AL_GRID, fine_sb, fine_al) for key in grid}
    out_sb, out_al = [], []
    for p, r in zip(pop, reuse):
        err = ((surf["popularity"] - p) / 0.02) ** 2 + ((surf["reuse"] - r) / 0.02) ** 2
        i, j = np.unravel_index(np.argmin(err), err.shape)
        out_sb.append(fine_sb[i])
        out_al.append(fine_al[j])
    sb_fit, al_fit = np.array(out_sb), np.array(out_al)
    return sb_fit, al_fit, simulate(sb_fit, al_fit, n_expert, k, steps)


def _bilinear(z: np.ndarray, xs: np.ndarray, ys: np.ndarray, fx: np.ndarray, fy: np.ndarray) -> np.ndarray:
    tmp = np.array([np.interp(fx, xs, z[:, j]) for j in range(z.shape[1])]).T
    return np.array([np.interp(fy, ys, tmp[i]) for i in range(tmp.shape[0])])


def derive(trace_path: Path, show: bool) -> int:
    from bmoe.synth.shapes import ROUTING_PROFILES

    t = read_trace(trace_path)
    sel = decode_masks(t)
    real = layer_stats(sel)
    steps = sel.shape[1]
    print(f"# {trace_path.name}: {t.n_layer} layers, top-{t.n_expert_used} of {t.n_expert}, "
          f"{steps} decode steps", file=sys.stderr)
    start = time.perf_counter()
    sb, al, fit = invert(real["popularity"], real["reuse"], t.n_expert, t.n_expert_used, steps)
    print(f"# inversion took {time.perf_counter() - start:.1f} s", file=sys.stderr)
    print(f"{'layer':>5} | {'real pop':>8} {'reuse':>6} {'floor':>6} | {'sigma_b':>7} {'alpha':>5} | "
          f"{'model pop':>9} {'reuse':>6} {'floor':>6}")
    for il in range(t.n_layer):
        print(f"{il:5d} | {real['popularity'][il]:8.3f} {real['reuse'][il]:6.3f} {real['floor'][il]:6.3f} | "
              f"{sb[il]:7.2f} {al[il]:5.2f} | {fit['popularity'][il]:9.3f} {fit['reuse'][il]:6.3f} "
              f"{fit['floor'][il]:6.3f}")
    for key in ("popularity", "reuse", "floor"):
        err = np.abs(fit[key] - real[key])
        print(f"# {key}: model - real, mean abs {err.mean():.3f}, max {err.max():.3f}"
              + ("  (not fitted)" if key == "floor" else ""))
    if show:
        print("_QWEN3_SIGMA_B = (" + ", ".join(f"{v:.2f}" for v in sb) + ")")
        print("_QWEN3_ALPHA = (" + ", ".join(f"{v:.2f}" for v in al) + ")")
    stored = ROUTING_PROFILES.get("qwen3-30b-a3b")
    if stored is None:
        print("# bmoe/synth/shapes.py has no qwen3 profile yet: paste the two lines above (--print)")
        return 1
    d_sb = np.abs(np.array(stored.sigma_b) - sb).max()
    d_al = np.abs(np.array(stored.alpha) - al).max()
    ok = d_sb <= 0.02 and d_al <= 0.02
    print(f"# stored profile vs this derivation: max |d sigma_b| {d_sb:.3f}, max |d alpha| {d_al:.3f}: "
          + ("reproduced" if ok else "DIFFERS"))
    return 0 if ok else 1


# ---- the synthetic runs -------------------------------------------------------------------------

def record(path: Path, trace_path: Path, n: int) -> tuple[list[int], str]:
    """Generate ``n`` greedy tokens streamed (cache off) and record the route trace."""
    from bmoe.engine.config import RunConfig
    from bmoe.engine.session import Session

    async def go() -> tuple[list[int], str]:
        config = RunConfig(mode="stream", n_ctx=512, cache_bytes=0, route_trace=str(trace_path))
        with Session.open(path, config) as s:
            g = await s.generate(PROMPT, n, stop_at_end=False)
            return g.tokens, g.text

    return run_async(go())


def realism(args: argparse.Namespace) -> int:
    from bmoe.synth.big import SynthSpec, describe, write_synth
    from bmoe.synth.shapes import ROUTING_PROFILES, real_layer

    real_trace = read_trace(args.trace)
    real_sel = decode_masks(real_trace)
    k = real_trace.n_expert_used  # the trace's top-k (6): compare like for like
    folder = args.dir
    folder.mkdir(parents=True, exist_ok=True)
    runs: dict[str, dict[str, np.ndarray]] = {}
    for label, skew in (("synthetic", True), ("control", False)):
        spec = SynthSpec(like="qwen3-30b-a3b", n_layer=args.layers, wtype=args.type, seed=args.seed,
                         skew=skew, n_expert_used=k)
        tag = "skew" if skew else "noskew"
        model = folder / f"routing-{tag}-l{args.layers}-{args.type}-s{args.seed}.gguf"
        if not model.exists():
            start = time.perf_counter()
            write_synth(model, spec)
            took = time.perf_counter() - start
            print(f"# wrote {model.name}: {model.stat().st_size / 2**20:.0f} MiB in {took:.1f} s "
                  f"({model.stat().st_size / 2**20 / took:.0f} MiB/s)", file=sys.stderr)
        print(f"# {label}: {describe(spec)}", file=sys.stderr)
        trace_path = model.with_suffix(".route.csv")
        tokens, text = record(model, trace_path, args.n)
        distinct = len(set(tokens))
        print(f"# {label}: {len(tokens)} tokens, {distinct} distinct: {text[:90]!r}...", file=sys.stderr)
        sel = decode_masks(read_trace(trace_path))
        runs[label] = layer_stats(sel)
        runs[label]["steps"] = np.array(sel.shape[1])
        if not args.keep:
            model.unlink()
            trace_path.unlink()
    steps = int(runs["synthetic"]["steps"])
    real = layer_stats(real_sel, window=steps)  # mean over windows as long as the synthetic run
    n_real = real_trace.n_layer
    print(f"per layer, decode phase: synthetic {args.layers} layers x {steps} steps, top-{k} of "
          f"{real_trace.n_expert}; real = the real layer at the same relative depth (whose fitted "
          f"profile the synthetic layer has), mean over {real_sel.shape[1] // steps} windows of "
          f"{steps} steps; control = the same model with plain random routers")
    print("expect = the logit model's mean for the layer's fitted profile at this length (what a "
          "synthetic layer scatters around: one draw of the expert popularities, one run)")
    keys = ("popularity", "reuse", "floor")
    whos = ("real", "synthetic", "expect", "control")
    head = f"{'layer':>5} {'real':>4} |"
    for key in keys:
        head += f" {key + ' real':>15} {'synth':>6} {'expect':>6} {'ctrl':>6} |"
    print(head)
    profile = ROUTING_PROFILES["qwen3-30b-a3b"].for_layers(args.layers)
    expect = simulate(np.array([p[0] for p in profile]), np.array([p[1] for p in profile]),
                      real_trace.n_expert, k, steps)
    rows = {key: {who: [] for who in whos} for key in keys}
    for il in range(args.layers):
        j = real_layer(il, args.layers, n_real)
        line = f"{il:5d} {j:4d} |"
        for key in keys:
            vals = (float(real[key][j]), float(runs["synthetic"][key][il]), float(expect[key][il]),
                    float(runs["control"][key][il]))
            for who, v in zip(whos, vals):
                rows[key][who].append(v)
            line += f" {vals[0]:15.3f} " + " ".join(f"{v:6.3f}" for v in vals[1:]) + " |"
        print(line)
    summary = f"{'mean':<10} |"
    for key in keys:
        summary += f" {np.mean(rows[key]['real']):15.3f} " + " ".join(
            f"{np.mean(rows[key][w]):6.3f}" for w in whos[1:]) + " |"
    print(summary)
    print(f"{'real, all':<10} |" + "".join(f" {float(real[key].mean()):15.3f} {'':20} |" for key in keys))
    for key in ("popularity", "reuse"):
        r = np.array(rows[key]["real"])
        print(f"# {key}: mean |synthetic - real| {np.abs(np.array(rows[key]['synthetic']) - r).mean():.3f}, "
              f"mean |control - real| {np.abs(np.array(rows[key]['control']) - r).mean():.3f}")
    uniform = _uniform_popularity(real_trace.n_expert, k, steps)
    print(f"# uniform routing would give popularity ~{uniform:.3f} and reuse "
          f"{k / real_trace.n_expert:.3f} at this length")
    return 0


def _uniform_popularity(n_expert: int, k: int, steps: int) -> float:
    return float(simulate(np.array([0.0]), np.array([0.0]), n_expert, k, steps)["popularity"][0])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--derive", action="store_true", help="fit the routing profile to the real trace")
    ap.add_argument("--print", dest="show", action="store_true", help="with --derive: print the table")
    ap.add_argument("--trace", type=Path, default=default_trace_path())
    ap.add_argument("--layers", type=int, default=4, help="synthetic layers (4 in q4_0: 2.1 GB)")
    ap.add_argument("--type", default="q4_0", choices=("q4_0", "q8_0"))
    ap.add_argument("-n", type=int, default=64, help="tokens to generate")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", type=Path, default=cache_dir() / "bench")
    ap.add_argument("--keep", action="store_true", help="keep the models and traces")
    args = ap.parse_args()
    if args.derive:
        return derive(args.trace, args.show)
    return realism(args)


if __name__ == "__main__":
    sys.exit(main())

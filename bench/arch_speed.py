"""Per architecture: decode tok/s resident vs streamed (cache off, and half the expert bank), on
each family's tiny fixture, measured side by side in interleaved rounds in one process.

The fixtures are the gates' (``tests/test_arch_gates.py``; the first three archs at the same
widths), written once into a temporary folder. Every streamed run must give the resident tokens;
a mismatch is reported, never hidden. Tiny models decode in a few ms per token, so these ratios
say what the engine's per-token overhead costs on each graph (callback, routing events, reads of
a few hundred KB), not what a large model would do. Nothing is asserted.

    python bench/arch_speed.py [-n 64] [--rounds 3] [--arch A ...] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from pathlib import Path

from bmoe.engine.config import MiB, RunConfig
from bmoe.engine.session import Session
from bmoe.io.validate import open_layout
from bmoe.synth.tiny import TinySpec, write_tiny

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.test_arch_gates import SPECS  # noqa: E402 - the gates' fixtures, not a copy of them

PROMPT = "Routed experts stream from the disk, token after token."
W = {"n_embd": 256, "n_ff": 256}
FIXTURES = {"qwen3moe": TinySpec(**W), "qwen2moe": TinySpec(arch="qwen2moe", **W),
            "gemma4": TinySpec(arch="gemma4", **W), **SPECS}


async def decode(path: Path, config: RunConfig, n: int) -> tuple[list[int], float | None, int | None]:
    with Session.open(path, config) as s:
        out = await s.generate(PROMPT, n, stop_at_end=False)
    return out.tokens, out.stats.tok_per_s, out.stats.bytes_read


def measure(path: Path, n: int, rounds: int) -> dict:
    layout = open_layout(path)
    half = max(MiB, layout.expert_bytes // 2)
    configs = {
        "resident": RunConfig(mode="resident", n_ctx=512),
        "stream_off": RunConfig(mode="stream", n_ctx=512, cache_bytes=0),
        "stream_half": RunConfig(mode="stream", n_ctx=512, cache_bytes=half),
    }
    speeds: dict[str, list[float]] = {k: [] for k in configs}
    tokens: dict[str, list[int]] = {}
    read: dict[str, int | None] = {}
    for _ in range(rounds):
        for name, config in configs.items():
            got, tok_s, nbytes = asyncio.run(decode(path, config, n))
            tokens.setdefault(name, got)
            read[name] = nbytes
            if tok_s is not None:
                speeds[name].append(tok_s)
    med = {k: statistics.median(v) if v else None for k, v in speeds.items()}
    base = med["resident"]
    return {
        "arch": layout.arch, "bank_mib": layout.expert_bytes / MiB, "half_bank_mib": half / MiB,
        "tok_s": med,
        "ratio_vs_resident": {k: (v / base if v and base else None) for k, v in med.items()},
        "bytes_read": read,
        "identical": {k: tokens[k] == tokens["resident"] for k in configs},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=64, help="tokens generated per run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--arch", nargs="*", default=list(FIXTURES))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.arch:
            path = write_tiny(Path(tmp) / f"{arch}.gguf", FIXTURES[arch])[0]
            rows.append(measure(path, args.n, args.rounds))
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"decode tok/s, median of {args.rounds} interleaved rounds of {args.n} tokens")
    print(f"{'arch':<12} {'bank MiB':>8} {'resident':>9} {'off':>8} {'half':>8} {'off/res':>8} {'half/res':>8}  same tokens")
    for r in rows:
        t, q = r["tok_s"], r["ratio_vs_resident"]

        def f(x: float | None, spec: str = "8.1f") -> str:
            return format(x, spec) if x is not None else "    null"

        print(f"{r['arch']:<12} {r['bank_mib']:8.1f} {f(t['resident'], '9.1f')} {f(t['stream_off'])} "
              f"{f(t['stream_half'])} {f(q['stream_off'], '8.2f')} {f(q['stream_half'], '8.2f')}  "
              f"{all(r['identical'].values())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

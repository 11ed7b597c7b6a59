"""Does llama.cpp give a sequence the same tokens alone and inside a batch? Measured, resident.

For each fixture (a tiny model per family, ``bmoe make-tiny --arch``; or ``--model`` files), each of
four prompts is decoded greedily alone (``parallel=1``, the turn-by-turn path) and then the four
together (``parallel=4``, one decode step holding a token of each). Reported per prompt: equal or
not, and the first token where they part. A second comparison, drafts: one prompt decoded plainly
and with n-gram drafts verified in one step. Nothing streams here: this is llama.cpp's own
property, which streaming must not change (the gates in tests/test_scheduler.py hold streamed ==
resident for the same schedule).

    python bench/batch_invariance.py [--archs qwen3moe,gpt-oss,...] [--types f32,q8_0] [--tokens 48]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

from bmoe.engine.config import RunConfig
from bmoe.engine.session import Session
from bmoe.synth.tiny import TinySpec, write_tiny

PROMPTS = (
    "Routed experts stream from the disk, token after token.",
    "The cache keeps the experts that are used most often.",
    "Four clients wait in a queue; one step serves them all.",
    "one two three one two three one two three one two three",
)


def first_diff(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


async def _gen(path: Path, config: RunConfig, prompts, n: int) -> list[list[int]]:  # noqa: ANN001
    async with await Session.open_async(path, config) as s:
        gens = await asyncio.gather(*(s.generate(p, n, stop_at_end=False) for p in prompts))
        return [g.tokens for g in gens]


def measure(path: Path, n: int) -> dict:
    alone = [asyncio.run(_gen(path, RunConfig(mode="resident", n_ctx=1024), [p], n))[0] for p in PROMPTS]
    batched = asyncio.run(_gen(path, RunConfig(mode="resident", n_ctx=1024, parallel=4), PROMPTS, n))
    plain = alone[3]
    try:
        drafted = asyncio.run(_gen(path, RunConfig(mode="resident", n_ctx=1024, draft="ngram"), [PROMPTS[3]], n))[0]
        draft = {"equal": drafted == plain, "first_diff": first_diff(drafted, plain)}
    except Exception as exc:  # noqa: BLE001 - a model drafts cannot run on (recurrent): said, not hidden
        draft = {"refused": str(exc)}
    return {
        "batch": [{"equal": a == b, "first_diff": first_diff(a, b)} for a, b in zip(alone, batched)],
        "draft": draft,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--archs", default="qwen3moe,qwen2moe,gemma4,gpt-oss,deepseek2,qwen35moe,qwen3next,glm4moe,llama4,"
                                      "bailingmoe2,lfm2moe,olmoe,minimax-m2")
    p.add_argument("--types", default="f32,q8_0")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--model", type=Path, action="append", default=[])
    args = p.parse_args(argv)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        jobs = [(str(m), m) for m in args.model]
        for arch in args.archs.split(",") if not args.model else ():
            for wtype in args.types.split(","):
                folder = Path(tmp) / f"{arch}-{wtype}"
                folder.mkdir()
                spec = TinySpec(arch=arch, wtype=wtype, n_embd=256, n_ff=256) if arch != "qwen3moe" else TinySpec(arch=arch, wtype=wtype)
                jobs.append((f"{arch} {wtype}", write_tiny(folder / "m.gguf", spec)[0]))
        for name, path in jobs:
            try:
                out[name] = measure(path, args.tokens)
            except Exception as exc:  # noqa: BLE001 - one fixture's failure is a row, not the end
                out[name] = {"error": str(exc)}
            print(name, json.dumps(out[name]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

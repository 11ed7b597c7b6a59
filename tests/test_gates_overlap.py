"""Overlap gates: reading later projections while earlier expert matmuls run changes no token."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from bmoe.engine.config import MiB, RunConfig
from bmoe.engine.session import Session
from bmoe.errors import ReadError
from bmoe.pipeline.hooks import Hooks
from bmoe.synth.tiny import TinySpec
from tests.helpers import N_TOKENS, PROMPT, generate_tokens


@pytest.mark.parametrize("arch,wtype", [("qwen3moe", "f32"), ("qwen2moe", "q8_0"), ("gemma4", "f16")])
def test_overlap_equals_resident(tiny, arch: str, wtype: str) -> None:
    path = tiny.path(TinySpec(arch=arch, wtype=wtype, n_embd=256, n_ff=256, n_layer=3))
    resident = tiny.resident_tokens(path)
    for cache_mb, lanes, open_mode in itertools.product((0, 1), (1, 4), ("user", "mmap")):
        config = RunConfig(n_ctx=256, overlap=True, cache_bytes=cache_mb * MiB, io_threads=lanes,
                           open_mode=open_mode)
        assert generate_tokens(path, config) == resident, (cache_mb, lanes, open_mode)


def test_overlap_waits_per_projection(tiny) -> None:
    """The first matmul is released before the layer's last projection has landed: overlap is real."""
    path = tiny.path(TinySpec(n_embd=256, n_ff=256, n_layer=3))
    released_early = []

    async def go() -> None:
        with Session.open(path, RunConfig(n_ctx=256, overlap=True)) as s:
            gate = s._callback.gate
            original = gate.wait_proj

            def spy(layer: int, proj: int) -> None:
                event = gate._open.get(layer)
                if event is not None:
                    released_early.append(not event.reply.done())
                original(layer, proj)

            gate.wait_proj = spy
            await s.generate(PROMPT, N_TOKENS, stop_at_end=False)

    asyncio.run(go())
    assert released_early, "matmul wait points were reached"
    assert any(released_early), "some layer computed before all its projections were read"


@pytest.mark.asyncio
async def test_raising_read_under_overlap_aborts_cleanly(tiny) -> None:
    path = tiny.path(TinySpec(arch="gemma4"))
    state = {"n": 0, "on": True}

    def before_read(request) -> bool:  # noqa: ANN001
        state["n"] += 1
        # Projection 1 (down) is waited for at a matmul node, not at routing: the overlap path.
        if state["on"] and state["n"] >= 25 and request.key.proj == 1:
            raise OSError("bad sector")
        return True

    emitted: list[int] = []
    async with Session.open(path, RunConfig(n_ctx=256, overlap=True), hooks=Hooks(before_read=before_read)) as s:
        with pytest.raises(ReadError):
            async for piece in s.stream(PROMPT, N_TOKENS, stop_at_end=False):
                emitted.append(piece.token)
        state["on"] = False
        again = await s.generate(PROMPT, N_TOKENS, stop_at_end=False)
    resident = await asyncio.to_thread(tiny.resident_tokens, path)
    assert emitted == resident[: len(emitted)] and len(emitted) < N_TOKENS
    assert again.tokens == resident

"""Hybrid recurrent families (gated delta net: qwen35moe, qwen3next; short conv: lfm2moe): a decode
aborted mid-graph leaves the recurrent state rolled back only within llama.cpp's snapshot budget
(``llama-memory-recurrent.cpp`` seq_rm returns false beyond it). A session never continues from
that state: every generation clears the memory and evaluates its prompt afresh, so cancelling or
failing mid-decode and generating again must give exactly a fresh run's tokens."""

from __future__ import annotations

import asyncio

import pytest

from bmoe.engine.config import RunConfig
from bmoe.engine.session import Session
from bmoe.errors import ReadError
from bmoe.io.recipes import RECIPES
from bmoe.pipeline.hooks import Hooks
from tests.helpers import N_TOKENS, PROMPT
from tests.test_arch_gates import SPECS

HYBRID = [a for a in SPECS if RECIPES[a].recurrent]
CONFIG = RunConfig(mode="stream", n_ctx=512)
DECODE_STEP = 4  # well past the prompt: the state has been advanced token by token


def test_the_hybrid_families_are_covered() -> None:
    assert set(HYBRID) == {"qwen35moe", "qwen3next", "lfm2moe", "bailingmoe3", "kimi-linear", "jamba",
                            "granitehybrid"}


@pytest.mark.asyncio
@pytest.mark.parametrize("arch", HYBRID)
async def test_cancel_mid_decode_then_generate_equals_fresh(tiny, arch: str) -> None:
    path = tiny.path(SPECS[arch])
    loop = asyncio.get_running_loop()
    reached = asyncio.Event()
    steps: list[int] = []

    def on_plan(event, plan) -> None:  # noqa: ANN001 - on the loop: the callback is waiting
        steps.append(event.step)
        if event.step == DECODE_STEP:
            loop.call_soon(reached.set)

    async with Session.open(path, CONFIG, hooks=Hooks(on_plan=on_plan)) as session:
        task = asyncio.create_task(session.generate(PROMPT, 200, stop_at_end=False))
        await reached.wait()
        task.cancel()  # the decode is inside the graph, between a layer's routing and its matmuls
        with pytest.raises(asyncio.CancelledError):
            await task
        again = await session.generate(PROMPT, N_TOKENS, stop_at_end=False)
        fresh_after = await session.generate(PROMPT, N_TOKENS, stop_at_end=False)
    resident = await asyncio.to_thread(tiny.resident_tokens, path)
    assert max(steps) >= DECODE_STEP
    assert again.tokens == fresh_after.tokens == resident


@pytest.mark.asyncio
@pytest.mark.parametrize("arch", HYBRID)
async def test_failed_read_mid_decode_then_generate_equals_fresh(tiny, arch: str) -> None:
    path = tiny.path(SPECS[arch])
    state = {"step": 0, "on": True}

    def on_plan(event, plan) -> None:  # noqa: ANN001
        state["step"] = event.step

    def before_read(request) -> bool:  # noqa: ANN001
        if state["on"] and state["step"] == DECODE_STEP:
            raise OSError("bad sector")
        return True

    emitted: list[int] = []
    async with Session.open(path, CONFIG, hooks=Hooks(on_plan=on_plan, before_read=before_read)) as session:
        with pytest.raises(ReadError):
            async for piece in session.stream(PROMPT, N_TOKENS, stop_at_end=False):
                emitted.append(piece.token)
        state["on"] = False
        again = await session.generate(PROMPT, N_TOKENS, stop_at_end=False)
    resident = await asyncio.to_thread(tiny.resident_tokens, path)
    assert 0 < len(emitted) < N_TOKENS and emitted == resident[: len(emitted)]
    assert again.tokens == resident

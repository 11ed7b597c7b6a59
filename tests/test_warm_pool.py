"""The warm pool: pages faulted in while idle, handed to slots, never past the cache's budget."""

import asyncio
import time

import pytest

from bmoe.engine.config import RunConfig
from bmoe.engine.session import Session
from bmoe.io.regions import Region, WarmPool, move_pages, resident_bytes_of
from bmoe.synth.tiny import TinySpec
from tests.helpers import N_TOKENS, PROMPT

MiB = 1 << 20


def _wait(cond, timeout=10.0):
    end = time.monotonic() + timeout
    while not cond() and time.monotonic() < end:
        time.sleep(0.01)
    return cond()


@pytest.mark.pure
def test_pool_faults_in_up_to_the_room_and_hands_pages_over():
    used = [0]
    pool = WarmPool(8 * MiB, lambda: 8 * MiB, lambda: used[0])
    try:
        used[0] = 3 * MiB  # the cache holds 3 MiB: the spare stops at 5
        assert _wait(lambda: pool.spare_bytes >= 5 * MiB)
        time.sleep(0.2)
        assert pool.spare_bytes <= 5 * MiB, "spare plus the cache never pass the budget"
        with Region(2 * MiB, 0) as r:
            lo = -(-r.base // 4096) * 4096
            src, n = pool.take(MiB)
            assert n == MiB and move_pages(src, lo, n)
            assert resident_bytes_of(lo, n) == n, "the slot got pages already present"
    finally:
        pool.close()


@pytest.mark.pure
def test_pool_pauses_and_gives_back_when_the_cache_fills():
    used = [0]
    pool = WarmPool(64 * MiB, lambda: 64 * MiB, lambda: used[0])
    try:
        pool.pause()
        at_pause = pool.spare_bytes
        time.sleep(0.2)
        assert pool.spare_bytes <= at_pause + WarmPool.CHUNK, "paused: nothing more faulted in"
        pool.resume()
        assert _wait(lambda: pool.spare_bytes > 0)
        used[0] = 64 * MiB  # full: evictions supply pages from now on
        assert _wait(lambda: pool.take(MiB)[1] == 0)
        assert _wait(lambda: pool._thread is not None and not pool._thread.is_alive())
    finally:
        pool.close()
    pool.close()  # idempotent


def test_pool_pages_given_to_an_evicting_cache_change_no_token(tiny) -> None:
    """Session level: the pool is given time to fault pages in, then a generation whose cache
    evicts takes them into slots (counted at ``take``); tokens equal the resident run's. A page
    moved into the wrong slot, or after its read, would change a token (the gate's power to see a
    wrong or missing expert is shown in tests/test_gates_stream.py's negative controls)."""
    path = tiny.path(TinySpec(n_embd=256, n_ff=256, n_layer=3))
    budget = 2 * MiB

    async def go():  # noqa: ANN202
        with Session.open(path, RunConfig(mode="stream", n_ctx=256, cache_bytes=budget)) as s:
            pool = s._streaming.residency.pool
            assert pool is not None, "the pool is on by default with a recycling cache"
            assert _wait(lambda: pool.spare_bytes >= budget // 2), "idle: the pool faults pages in"
            taken, real = [], pool.take

            def counting(nbytes: int):  # noqa: ANN202
                src, n = real(nbytes)
                taken.append(n)
                return src, n

            pool.take = counting
            g = await s.generate(PROMPT, N_TOKENS, stop_at_end=False)
            return g, sum(taken)

    g, taken = asyncio.run(go())
    assert g.tokens == tiny.resident_tokens(path)
    assert g.stats.cache_evictions > 0, "the cache evicted during the generation"
    assert taken > 0, "misses took the pool's pages"


@pytest.mark.pure
def test_no_warm_pool_flag_turns_it_off() -> None:
    from bmoe.cli import build_parser
    from bmoe.cli.flags import _config

    def parsed(*flags: str):  # noqa: ANN202
        argv = ["run", "-m", "m.gguf", "-p", "hi", "--cache-mb", "64", *flags]
        return _config(build_parser(argv).parse_args(argv))

    on, off = parsed(), parsed("--no-warm-pool")
    assert on.warm_pool and not off.warm_pool


def test_pool_pages_are_not_read_as_memory_pressure(tiny) -> None:
    """The pool's spare pages are out of MemAvailable, like another program's: the guard must
    count them as the cache's, or a first request after idle time shrinks the budget for nothing."""
    from bmoe.pipeline.pressure import GuardSettings, PressureSample

    path = tiny.path(TinySpec(n_embd=256, n_ff=256, n_layer=3))
    budget, low = 12 * MiB, 100 * MiB

    async def go():  # noqa: ANN202
        with Session.open(path, RunConfig(mode="stream", n_ctx=256, cache_bytes=budget)) as s:
            pool = s._streaming.residency.pool
            assert _wait(lambda: pool.spare_bytes >= 4 * MiB)
            t = [0.0]

            def memory() -> PressureSample:  # what the kernel shows: the cache's and the pool's pages taken
                t[0] += 0.001
                return PressureSample(t[0], budget + low + 2 * MiB - s.resident_cache_bytes - pool.spare_bytes,
                                      None, None)

            s.pressure_guard.source = memory
            s.pressure_guard.settings = GuardSettings(low=low, high=low + MiB, interval_s=0.0, cooldown_s=1e9)
            g = await s.generate(PROMPT, N_TOKENS, stop_at_end=False)
            return g

    g = asyncio.run(go())
    assert g.tokens == tiny.resident_tokens(path)
    assert g.stats.budget_changes == [], "no other program took memory: the budget stays"

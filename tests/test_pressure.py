"""The pressure guard: pure decisions over injected samples, then gates on a live session: a fake
pressure source shrinks the cache at the next layer with tokens identical to resident (and a
negative control shows the gate can fail), and a real squeeze (a balloon inflated mid-generation
in a subprocess) brings the budget down with tokens still identical."""

from __future__ import annotations

import asyncio
import os
from dataclasses import replace

import pytest

from bmoe.engine.config import MiB, RunConfig
from bmoe.engine.session import Session
from bmoe.errors import BudgetError
from bmoe.pipeline.budget import read_meminfo
from bmoe.pipeline.hooks import Hooks
from bmoe.pipeline.pressure import (
    GuardSettings,
    PressureGuard,
    PressureSample,
    decide,
    live_sample,
    parse_psi,
)
from bmoe.synth.tiny import TinySpec
from tests.helpers import N_TOKENS, PROMPT

GiB = 1 << 30
S = GuardSettings(low=1 * GiB, high=1536 * MiB, cooldown_s=10.0, grow_step=512 * MiB)
BIG_EXPERTS = TinySpec(n_embd=256, n_ff=256, n_layer=3)  # entries of 0.75 MiB, 18 MiB bank


def sample(t: float, avail: int | None, psi: int | None = 0, faults: int | None = 0) -> PressureSample:
    return PressureSample(t, avail, psi, faults)


def test_parse_psi() -> None:
    text = "some avg10=1.00 avg60=0.50 avg300=0.10 total=123456\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=99\n"
    assert parse_psi(text) == 123456
    assert parse_psi("") is None
    s = live_sample()
    assert s.major_faults is not None and s.major_faults >= 0
    assert os.path.exists("/proc/pressure/memory") == (s.psi_some_us is not None)


def test_shrinks_by_what_brings_memory_back_to_high() -> None:
    out = decide(None, sample(0, 800 * MiB), budget=4 * GiB, resident=4 * GiB, ceiling=4 * GiB,
                 settings=S, since_change_s=1e9)
    assert out is not None
    new, why = out
    assert new == 4 * GiB - (1536 - 800) * MiB and "MemAvailable 800 MiB" in why
    # The unfilled part of the budget counts as taken: 2 GiB free, but the cache will take 1.5 more.
    out = decide(None, sample(0, 2 * GiB), budget=4 * GiB, resident=2560 * MiB, ceiling=4 * GiB,
                 settings=S, since_change_s=1e9)
    assert out is not None and out[0] == 4 * GiB - (1536 - 512) * MiB
    assert decide(None, sample(0, 10), budget=100 * MiB, resident=0, ceiling=4 * GiB, settings=S,
                  since_change_s=0)[0] == 0, "never below the floor"


def test_psi_and_fault_signals_shrink_an_eighth() -> None:
    prev = sample(0.0, 8 * GiB, psi=0, faults=0)
    stalled = sample(1.0, 8 * GiB, psi=400_000, faults=0)  # 40 % of one second
    out = decide(prev, stalled, budget=8 * GiB, resident=8 * GiB, ceiling=8 * GiB, settings=S, since_change_s=1e9)
    assert out == (7 * GiB, "memory stalls 40 % of the time (PSI)")
    faulting = sample(2.0, 8 * GiB, psi=0, faults=1000)
    out = decide(prev, faulting, budget=8 * GiB, resident=8 * GiB, ceiling=8 * GiB, settings=S, since_change_s=1e9)
    assert out is not None and out[0] == 7 * GiB and "500 major faults/s" in out[1]
    held = decide(prev, stalled, budget=8 * GiB, resident=8 * GiB, ceiling=8 * GiB, settings=S, since_change_s=0.5)
    assert held is None, "stalls alone shrink at most once per signal cooldown"
    short = decide(prev, sample(1.0, 100 * MiB, psi=400_000), budget=8 * GiB, resident=8 * GiB, ceiling=8 * GiB,
                   settings=S, since_change_s=0.0)
    assert short is not None and short[0] == 8 * GiB - (1536 - 100) * MiB, "a shortfall is never held back"
    calm = sample(1.0, 8 * GiB, psi=100_000, faults=100)  # 10 %, 100/s: below both bars
    assert decide(prev, calm, budget=8 * GiB, resident=8 * GiB, ceiling=8 * GiB, settings=S, since_change_s=0) is None
    blind = sample(1.0, None, psi=None, faults=None)
    assert decide(prev, blind, budget=8 * GiB, resident=8 * GiB, ceiling=8 * GiB, settings=S, since_change_s=1e9) is None


def test_grows_back_with_hysteresis() -> None:
    kw = {"resident": 2 * GiB, "ceiling": 4 * GiB, "settings": S}
    # Between low and high: nothing, either way.
    assert decide(None, sample(0, 1200 * MiB), budget=2 * GiB, since_change_s=1e9, **kw) is None
    # Room above high, but too soon after the last change.
    assert decide(None, sample(0, 3 * GiB), budget=2 * GiB, since_change_s=5.0, **kw) is None
    new, why = decide(None, sample(0, 3 * GiB), budget=2 * GiB, since_change_s=10.0, **kw)
    assert new == 2 * GiB + 512 * MiB and "cleared" in why, "at most one growth step"
    new, _ = decide(None, sample(0, 1800 * MiB), budget=2 * GiB, since_change_s=10.0, **kw)
    assert new == 2 * GiB + (1800 - 1536) * MiB, "never takes the projection below high"
    assert decide(None, sample(0, 9 * GiB), budget=4 * GiB, since_change_s=1e9, **kw | {"resident": 4 * GiB}) is None


def test_guard_samples_at_most_every_interval_and_settings_validate() -> None:
    now = {"t": 0.0}
    calls = []

    def source() -> PressureSample:
        calls.append(now["t"])
        return sample(now["t"], 100 * MiB)

    guard = PressureGuard(4 * GiB, replace(S, interval_s=0.5), source, clock=lambda: now["t"])
    change = guard.poll(4 * GiB, 4 * GiB)
    assert change is not None and change.old == 4 * GiB and change.new < 4 * GiB
    now["t"] = 0.4
    assert guard.poll(change.new, change.new) is None and len(calls) == 1
    now["t"] = 0.5
    guard.poll(change.new, change.new)
    assert len(calls) == 2
    with pytest.raises(BudgetError):
        GuardSettings(low=2, high=1)
    assert GuardSettings.around(1 * GiB).high == 1536 * MiB


class FakeMemory:
    """A machine whose MemAvailable the test sets; the cache's resident bytes come out of it, as a
    real cache's pages do."""

    def __init__(self) -> None:
        self.session: Session | None = None
        self.spare = 64 * GiB
        self.t = 0.0

    @property
    def squeezed(self) -> bool:
        return self.spare < 64 * GiB

    def __call__(self) -> PressureSample:
        self.t += 0.001
        s = self.session
        assert s is not None
        return PressureSample(self.t, self.spare - (s.resident_cache_bytes or 0), None, None)


def _squeezed_run(path, budget: int, squeeze_at: int, fake: FakeMemory, hooks: Hooks | None = None):  # noqa: ANN001, ANN202
    """Generate with a fake source that turns to pressure after token ``squeeze_at``; check at each
    layer that the budget holds and that the shrink came at the first layer after the squeeze."""
    seen = {"after": [], "plans_after": 0}
    low = 100 * MiB
    hooks = hooks or Hooks()
    outer = hooks.on_plan

    def on_plan(event, plan) -> None:  # noqa: ANN001
        s = fake.session
        entry = s.layout.entry_bytes()[event.layer]
        admitted = len(plan.misses) * entry
        assert s.resident_cache_bytes - admitted <= s.budget_bytes, "evicted down to the budget before admitting"
        if fake.squeezed:
            if seen["plans_after"] == 0:
                seen["first_budget"] = s.budget_bytes
            seen["plans_after"] += 1
        if outer is not None:
            outer(event, plan)

    async def go():  # noqa: ANN202
        with Session.open(path, RunConfig(mode="stream", n_ctx=256, cache_bytes=budget),
                          hooks=Hooks(before_read=hooks.before_read, on_plan=on_plan)) as s:
            fake.session = s
            guard = s.pressure_guard
            guard.source = fake
            guard.settings = GuardSettings(low=low, high=low + 4 * MiB, interval_s=0.0, cooldown_s=1e9)
            out, metrics = [], []
            async for piece in s.stream(PROMPT, N_TOKENS, stop_at_end=False):
                if piece.token is None:  # the flush of a text ending mid-character
                    continue
                out.append(piece.token)
                metrics.append(piece.metrics)
                assert s.resident_cache_bytes <= s.budget_bytes
                if len(out) == squeeze_at:
                    fake.spare = low + 6 * MiB  # with the cache full: 6 MiB short of the low mark
            return out, metrics, s.last_stats

    tokens, metrics, stats = asyncio.run(go())
    return tokens, metrics, stats, seen


def test_fake_pressure_shrinks_the_cache_at_the_next_layer_and_output_is_identical(tiny) -> None:
    path = tiny.path(BIG_EXPERTS)
    budget = 12 * MiB
    tokens, metrics, stats, seen = _squeezed_run(path, budget, squeeze_at=8, fake=FakeMemory())
    assert tokens == tiny.resident_tokens(path)
    assert seen["plans_after"] > 0, "layers missed after the squeeze (the check ran)"
    assert seen["first_budget"] < budget, "shrunk at the first layer after the squeeze"
    assert stats.budget_bytes == budget and stats.budget_bytes_end < budget
    (change,) = stats.budget_changes
    assert change["old"] == budget and change["new"] == stats.budget_bytes_end and "MemAvailable" in change["why"]
    assert [m.budget_bytes for m in metrics[:8]] == [budget] * 8 and metrics[-1].budget_bytes < budget
    assert stats.cache_evictions > 0


def test_fake_pressure_gate_catches_a_missing_expert(tiny) -> None:
    """Negative control: the same squeezed run, one routed read skipped after the squeeze, differs."""
    path = tiny.path(BIG_EXPERTS)
    fake, skipped = FakeMemory(), []

    def before_read(request) -> bool:  # noqa: ANN001
        if fake.squeezed and not skipped:
            skipped.append(request.key)
            return False
        return True

    tokens, *_ = _squeezed_run(path, 12 * MiB, squeeze_at=8, fake=fake, hooks=Hooks(before_read=before_read))
    assert len(skipped) == 1
    assert tokens != tiny.resident_tokens(path)


def test_a_real_squeeze_mid_generation_brings_the_budget_down(tiny) -> None:
    """A balloon subprocess takes 1 GiB between two tokens; the guard (real sampler, watermarks
    set 384 MiB under what was available at open) shrinks the budget; tokens stay identical."""
    from bmoe.bench.balloon import Balloon

    avail = read_meminfo().get("MemAvailable", 0)
    if avail < 4 * GiB:
        pytest.skip("needs 4 GiB available to squeeze 1 GiB safely")
    path = tiny.path(BIG_EXPERTS)
    budget = 12 * MiB

    async def go():  # noqa: ANN202
        with Session.open(path, RunConfig(mode="stream", n_ctx=256, cache_bytes=budget)) as s:
            low = read_meminfo()["MemAvailable"] - 384 * MiB
            s.pressure_guard.settings = GuardSettings(low=low, high=low + 64 * MiB, interval_s=0.0,
                                                      cooldown_s=1e9, psi_fraction=2.0, fault_rate=1e12)
            out = []
            balloon = Balloon(1 * GiB, lock=False)
            try:
                async for piece in s.stream(PROMPT, N_TOKENS, stop_at_end=False):
                    if piece.token is None:
                        continue
                    out.append(piece.token)
                    if len(out) == 6:
                        balloon.inflate()  # returns once every page is written
            finally:
                balloon.release()
            return out, s.last_stats

    tokens, stats = asyncio.run(go())
    assert tokens == tiny.resident_tokens(path)
    assert stats.budget_bytes_end < budget and stats.budget_changes, "the budget went down"
    assert all(c["new"] < c["old"] for c in stats.budget_changes)


def test_an_idle_session_gives_memory_back_when_asked_and_the_next_generation_is_identical(tiny) -> None:
    """Between generations the guard was never asked: an idle server kept its whole cache while
    other programs took the machine's memory. ``check_memory`` (``bmoe serve`` calls it every
    second) shrinks it at once; the next generation still gives the resident tokens."""
    path = tiny.path(BIG_EXPERTS)
    budget, low = 12 * MiB, 100 * MiB
    fake = FakeMemory()

    async def go():  # noqa: ANN202
        with Session.open(path, RunConfig(mode="stream", n_ctx=256, cache_bytes=budget)) as s:
            fake.session = s
            s.pressure_guard.source = fake
            s.pressure_guard.settings = GuardSettings(low=low, high=low + 4 * MiB, interval_s=0.0, cooldown_s=1e9)
            first = (await s.generate(PROMPT, N_TOKENS, stop_at_end=False)).tokens
            full = s.resident_cache_bytes
            assert not s.check_memory(), "no pressure: nothing moves"
            fake.spare = low + 6 * MiB  # another program takes memory while the session idles
            assert s.check_memory() and s.budget_bytes < budget
            assert s.resident_cache_bytes <= s.budget_bytes < full
            second = (await s.generate(PROMPT, N_TOKENS, stop_at_end=False)).tokens
            return first, second

    first, second = asyncio.run(go())
    assert first == second == tiny.resident_tokens(path)[:N_TOKENS]


@pytest.mark.pure
def test_the_live_sample_takes_the_containers_room_and_stalls() -> None:
    """Issue 39: the guard read the host's MemAvailable and PSI only; in a container near its limit
    the host may have gigabytes free and no stalls while the limit reclaims this process's pages."""
    from bmoe.pipeline.cgroup import CgroupMemory

    near = CgroupMemory(limit=1100 * MiB, usage=1050 * MiB, file_pages=0, what="memory.max", oom_kills=0,
                        psi_some_us=42)
    s = live_sample(cgroup=lambda: near)
    assert s.mem_available == 50 * MiB and s.psi_some_us == 42
    out = decide(None, s, budget=512 * MiB, resident=512 * MiB, ceiling=512 * MiB,
                 settings=GuardSettings(low=256 * MiB, high=384 * MiB), since_change_s=1e9)
    assert out is not None and out[0] < 512 * MiB  # the guard shrinks on the container's figure
    host = live_sample(cgroup=lambda: None)  # negative control: the host's figure, far above 50 MiB here
    assert host.mem_available is not None and host.mem_available > 50 * MiB

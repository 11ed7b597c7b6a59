"""Read-ahead gates: temporal prefetch changes no token, holds the budget, and really reads ahead."""

from __future__ import annotations

import asyncio
from collections import deque

import pytest

from bmoe.engine.config import MiB, RunConfig
from bmoe.engine.session import Session
from bmoe.errors import ConfigError, ReadError
from bmoe.pipeline.cache import ExpertCache
from bmoe.pipeline.channel import Channel
from bmoe.pipeline.events import PHASE_DECODE, ReadAhead, RoutingEvent
from bmoe.pipeline.hooks import Hooks
from bmoe.pipeline.policies import LruPolicy
from bmoe.pipeline.readiness import ReadinessBoard
from bmoe.stages.bind import SimResidency
from bmoe.stages.prefetch import PrefetchStage
from bmoe.synth.tiny import TinySpec
from tests.helpers import N_TOKENS, PROMPT, resident_mismatches

SPEC = TinySpec(n_embd=256, n_ff=256, n_layer=4)
BUDGET = 4 * MiB  # five experts of 0.75 MiB: tight enough to evict, room to read ahead


def stream_within_budget(path, config: RunConfig):  # noqa: ANN001, ANN201
    """Greedy tokens and stats, checking after every token that the budget held."""

    async def go():  # noqa: ANN202
        with Session.open(path, config) as s:
            tokens = []
            async for piece in s.stream(PROMPT, N_TOKENS, stop_at_end=False):
                if piece.token is not None:  # the final piece carries only the finish reason
                    tokens.append(piece.token)
                assert s.resident_cache_bytes <= config.cache_bytes
            return tokens, s.last_stats

    return asyncio.run(go())


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("lanes", [1, 4])
def test_temporal_prefetch_equals_resident_and_holds_the_budget(tiny, overlap: bool, lanes: int) -> None:
    path = tiny.path(SPEC)
    config = RunConfig(n_ctx=256, cache_bytes=BUDGET, prefetch_layers=2, overlap=overlap, io_threads=lanes)
    tokens, stats = stream_within_budget(path, config)
    assert tokens == tiny.resident_tokens(path)
    assert stats.prefetch_issued > 0 and stats.speculative_bytes > 0, "the read-ahead fired"
    assert stats.cache_evictions > 0
    assert 0 <= stats.prefetch_useful <= stats.prefetch_issued


def test_prefetch_needs_a_cache() -> None:
    with pytest.raises(ConfigError, match="cache budget"):
        RunConfig(prefetch_layers=1, cache_bytes=0).validate()


@pytest.mark.parametrize("arch", ["qwen3moe", "gemma4"])
def test_predictive_prefetch_equals_resident_and_scores_itself(tiny, arch: str) -> None:
    path = tiny.path(TinySpec(arch=arch, n_embd=256, n_ff=256, n_layer=4))
    config = RunConfig(n_ctx=256, cache_bytes=BUDGET, predict_prefetch=True, overlap=arch == "gemma4")
    tokens, stats = stream_within_budget(path, config)
    assert tokens == tiny.resident_tokens(path)
    # Read-ahead survives the eviction of the layer in between: a third of it used, about the
    # predictor's accuracy here (~65 %; 6 % when the next layer's plan evicted it first).
    assert stats.prefetch_useful > 0, "experts were read ahead and later routed"
    assert stats.prefetch_issued <= 3 * stats.prefetch_useful, "predicted experts were read ahead and used"
    accuracy = stats.predict_accuracy_pct
    assert accuracy and set(accuracy) == {1, 2, 3}, "every layer after the first is predicted and scored"
    assert all(0 <= v <= 100 for v in accuracy.values())


@pytest.mark.parametrize("steps", [False, True])
def test_prompt_prediction_equals_resident_and_reads_ahead_in_the_prompt(tiny, steps: bool) -> None:
    """The batched prompt's read-ahead (the union of each row's predicted top-k) changes no token
    and holds the budget; without ``predict_prefetch`` only the prompt reads ahead."""
    path = tiny.path(SPEC)
    budget = 14 * MiB  # the prompt routes all 8 experts of a layer (6 MiB): two layers fit, not four
    config = RunConfig(n_ctx=256, cache_bytes=budget, predict_prompt=True, predict_prefetch=steps,
                       prefill="batch")
    tokens, stats = stream_within_budget(path, config)
    assert tokens == tiny.resident_tokens(path)
    assert stats.prefetch_issued > 0 and stats.speculative_bytes > 0, "the prompt read ahead"
    assert stats.cache_evictions > 0
    accuracy = stats.predict_accuracy_pct
    assert accuracy and set(accuracy) == {1, 2, 3}, "every layer after the first is predicted and scored"
    if not steps:
        off = RunConfig(n_ctx=256, cache_bytes=budget, prefill="batch", predict_prompt=False)
        plain, plain_stats = stream_within_budget(path, off)
        assert plain == tokens and not plain_stats.prefetch_issued, "no prediction, no read-ahead"


@pytest.mark.parametrize("wtype", ["f32", "q8_0"])
def test_the_predictor_reads_llama_cpp_routers_in_place(tiny, wtype: str) -> None:
    """F32 routers are views of llama.cpp's own tensors (no copy the budget never counted); other
    types are dequantised from the file. Either way they are the file's routers."""
    import numpy as np

    from bmoe.io.ggml import GgmlTensor
    from bmoe.stages.predict import load_routers

    path = tiny.path(TinySpec(n_embd=256, n_ff=256, n_layer=4, wtype=wtype))
    with Session.open(path, RunConfig(n_ctx=256, cache_bytes=14 * MiB)) as s:
        routers = s._streaming.modes.predictor._routers
        from_file = load_routers(s.layout)
        assert sorted(routers) == sorted(from_file) == [0, 1, 2, 3]
        for il, expected in from_file.items():
            got = routers[il]
            tensor = GgmlTensor.from_address(routers._addresses[il])
            assert (got.ctypes.data == tensor.data) == (wtype == "f32"), "in place exactly when llama.cpp holds F32"
            np.testing.assert_array_equal(got, expected)


def test_prompt_prediction_needs_a_cache_and_not_expert_major() -> None:
    with pytest.raises(ConfigError, match="cache budget"):
        RunConfig(predict_prompt=True, cache_bytes=0)
    with pytest.raises(ConfigError, match="predict_prompt"):
        RunConfig(predict_prompt=True, cache_bytes=4 * MiB, prefill="expert")


def test_read_ahead_from_the_fast_path_spares_the_layer_about_to_compute() -> None:
    """An all-resident layer computes right after its read-ahead is planned: the read-ahead must
    never make room by evicting that layer's experts."""
    entry = {0: 100, 1: 100}
    cache = ExpertCache(200, entry, LruPolicy())
    residency = SimResidency(2, 8, entry)
    stage = PrefetchStage(cache, residency, ReadinessBoard(), deque(), Hooks())
    cache.plan(0, (1, 2))
    residency.maps[0][[1, 2]] = True

    async def go() -> None:
        events, reads, binds = Channel(), Channel(), Channel()
        task = asyncio.create_task(stage.run(events, reads, binds))
        events.send_nowait(ReadAhead(1, (5,), frozenset({(0, 1), (0, 2)})))
        events.close()
        await task

    asyncio.run(go())
    assert residency.maps[0][1] and residency.maps[0][2] and cache.is_resident(0, 1)
    assert not cache.is_resident(1, 5), "no room without evicting the layer being served"


def test_a_layer_served_from_the_fast_path_is_planned_before_a_read_ahead_evicts() -> None:
    """Issue 16's NaN (route-ahead): the gate serves an all-resident layer without a round trip and
    leaves its plan for later (``fast_hits``). A read-ahead handled before that plan evicted one of
    its experts; the late plan then found it missing and admitted it with no read, so the cache held
    an entry whose slot had another expert's pages, and the layer's next routing took it for a hit.
    A read-ahead plans the fast-path layers first; an expert it evicts is read again when routed."""
    import numpy as np

    from bmoe.pipeline.events import ExpertKey

    entry = {0: 100, 1: 100, 2: 100}
    cache = ExpertCache(300, entry, LruPolicy())  # room for three experts
    residency = SimResidency(3, 8, entry)
    fast: deque = deque()
    stage = PrefetchStage(cache, residency, ReadinessBoard(), fast, Hooks())
    for layer, expert in ((0, 1), (1, 2), (2, 3)):
        cache.plan(layer, (expert,))
        residency.maps[layer][expert] = True
    one = np.array([0])
    fast.extend([(0, np.array([1]), one), (1, np.array([2]), one)])  # served again, resident; not yet planned

    async def go() -> list:
        events, reads, binds = Channel(), Channel(), Channel()
        task = asyncio.create_task(stage.run(events, reads, binds))
        events.send_nowait(ReadAhead(2, (4,), frozenset({(1, 2)})))  # from layer 1's fast path: needs room
        events.send_nowait(RoutingEvent(2, (4,), 1, PHASE_DECODE))
        events.close()
        await task
        return [item[0] async for item in reads if not isinstance(item, ExpertKey)]  # not promotions

    read = {(r.key.layer, r.key.expert) for r in asyncio.run(go())}
    held = {(layer, e) for layer in range(3) for e in range(8) if cache.is_resident(layer, e)}
    unread = {(layer, e) for layer, e in held if not residency.maps[layer][e] and (layer, e) not in read}
    assert not unread, f"the cache holds {sorted(unread)}, never read and not resident"
    assert held == {(0, 1), (1, 2), (2, 4)}, "the read-ahead evicted the one expert no layer used since"


def _one_slot_stage(residency_type: type[SimResidency]) -> tuple:
    """A prefetch stage over an LRU cache with room for one expert (two layers of 100 bytes)."""
    entry = {0: 100, 1: 100}
    cache = ExpertCache(100, entry, LruPolicy())
    residency = residency_type(2, 8, entry)
    board = ReadinessBoard()
    return cache, residency, board, PrefetchStage(cache, residency, board, deque(), Hooks())


def _guess_wrong_then_read(events: Channel) -> None:
    """Expert 5 of layer 1 read ahead, evicted for 6 (the guess was wrong), then read for real."""
    events.send_nowait(ReadAhead(1, (5,), frozenset()))
    events.send_nowait(RoutingEvent(1, (6,), 0, PHASE_DECODE))
    events.send_nowait(RoutingEvent(1, (5,), 1, PHASE_DECODE))


def test_a_late_failure_of_an_abandoned_read_leaves_the_newer_copy_alone() -> None:
    """A read-ahead evicted while its read was in flight, then read again for real: when the old
    read fails afterwards, the expert read since must stay resident and in the cache."""
    cache, residency, board, stage = _one_slot_stage(SimResidency)

    async def go() -> None:
        events, reads, binds = Channel(), Channel(), Channel()
        task = asyncio.create_task(stage.run(events, reads, binds))
        _guess_wrong_then_read(events)
        events.close()
        await task
        (old_request, old), _, (new_request, new) = [item async for item in reads]
        assert old_request.speculative and not new_request.speculative
        board.complete(new_request.key, new, new_request.nbytes, None)
        residency.maps[1][5] = True  # what the ready stage does once the read landed
        board.complete(old_request.key, old, None, ReadError("the abandoned read failed late"))
        await asyncio.sleep(0)

    asyncio.run(go())
    assert cache.is_resident(1, 5) and residency.maps[1][5]


class _DonorLog(SimResidency):
    """SimResidency that records whose pages are handed on (``reuse``) and whose are only released."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self.donors: list[tuple[int, int]] = []
        self.released: list[tuple[int, int]] = []

    def reuse(self, evicted, needed) -> None:  # noqa: ANN001
        evicted = list(evicted)
        self.donors += evicted
        super().reuse(evicted, needed)

    def release(self, layer: int, expert: int) -> None:
        self.released.append((layer, expert))
        super().release(layer, expert)


def test_an_expert_a_superseded_read_may_still_land_in_never_gives_its_pages_away() -> None:
    """Found looking for issue 16's NaN (not shown to be its cause): a read-ahead evicted while its
    read was queued, read again for real, and evicted once more after the real read landed. The old read
    still runs when a lane gets to it; had the expert's pages moved to another slot meanwhile,
    those bytes (at another page offset) would land in the other expert, resident and bound, and
    the layers that route it compute on garbage. While any read of the entry may land, its pages
    are only released, never handed on."""
    cache, residency, board, stage = _one_slot_stage(_DonorLog)

    async def go() -> None:
        events, reads, binds = Channel(), Channel(), Channel()
        task = asyncio.create_task(stage.run(events, reads, binds))
        _guess_wrong_then_read(events)
        old_request, old = await reads.receive()
        await reads.receive()  # 6's read
        new_request, new = await reads.receive()
        assert old_request.speculative and not new_request.speculative and old_request.key == new_request.key
        board.complete(new_request.key, new, new_request.nbytes, None)  # the real read lands first
        await asyncio.sleep(0)
        assert not old.done(), "the old read is still queued: it will write into 5's slot"
        events.send_nowait(RoutingEvent(1, (6,), 2, PHASE_DECODE))  # 5 evicted again
        events.close()
        await task

    asyncio.run(go())
    assert (1, 5) in residency.released and (1, 5) not in residency.donors


def test_a_newer_read_of_a_key_drops_its_queued_speculative_read() -> None:
    """The read stage's side of the same case: a speculative read still queued when a newer read
    of the key arrives never runs (it is resolved as dropped), so it writes nothing later."""
    from concurrent.futures import ThreadPoolExecutor

    from bmoe.pipeline.events import ExpertKey, ReadRequest
    from bmoe.stages.read import ReadStage

    ran: list[int] = []  # file offsets read: 0 the old read of the key, 1 its newer read, 2 another key's

    class Reader:
        def read_into(self, shard: int, offset: int, nbytes: int, dest: int) -> int:
            ran.append(offset)
            return nbytes

    key, other = ExpertKey(1, 0, 5), ExpertKey(1, 0, 7)
    board = ReadinessBoard()

    async def go() -> None:
        reads: Channel = Channel()
        task = asyncio.create_task(ReadStage(Reader(), ThreadPoolExecutor(1), 1, board, Hooks()).run(reads))
        old, new, later = board.expect(key), board.expect(key), board.expect(other)
        reads.send_nowait((ReadRequest(key, 0, 0, 8, 0, speculative=True), old))
        reads.send_nowait((ReadRequest(key, 0, 1, 8, 0), new))
        await new
        # The lane then takes queued speculative reads in order: the old one first, if still queued.
        reads.send_nowait((ReadRequest(other, 0, 2, 8, 0, speculative=True), later))
        await later
        reads.close()
        await task
        assert ran == [1, 2], "the superseded read never ran"
        assert isinstance(old.exception(), ReadError)
        await asyncio.sleep(0)
        assert not board.busy(key), "every read of the key is resolved"

    asyncio.run(go())


SPEC_READ_AHEAD = TinySpec(arch="qwen3moe", n_layer=4, n_expert=8, n_expert_used=2)
PROMPTS = [PROMPT, "A second prompt routes elsewhere.", "Tokens, layers, experts: read ahead of need.", PROMPT]


@pytest.mark.parametrize("config", [
    RunConfig(mode="stream", n_ctx=256, cache_bytes=2 * MiB, route_ahead=1),
    RunConfig(mode="stream", n_ctx=256, cache_bytes=2 * MiB, route_ahead=2),
    RunConfig(mode="stream", n_ctx=256, cache_bytes=2 * MiB, predict_prefetch=True),
], ids=["route-ahead-1", "route-ahead-2", "predict-prefetch"])
def test_every_expert_the_fast_path_may_use_holds_the_files_bytes(tiny, config: RunConfig) -> None:
    """Issue 16's NaN: a read-ahead handled before the plan of a layer the gate had served alone
    evicted that layer's experts; the late plan admitted them again with no read, and a later
    routing took their slots (another expert's pages) for hits. After every prompt of a run that
    evicts, every expert marked resident must hold exactly the file's bytes."""
    path = tiny.path(SPEC_READ_AHEAD)

    async def go() -> list:
        found = []
        with Session.open(path, config) as session:
            assert sum(session.layout.entry_bytes().values()) * 8 > config.cache_bytes, "the cache must evict"
            for prompt in PROMPTS:
                await session.generate(prompt, 12, stop_at_end=False)
                found += resident_mismatches(session)
        return found

    assert asyncio.run(go()) == []


def test_the_check_sees_a_resident_expert_with_wrong_bytes(tiny) -> None:
    """Negative control: one resident expert's bytes flipped are found."""
    import ctypes

    async def go() -> list:
        with Session.open(tiny.path(SPEC_READ_AHEAD), RunConfig(mode="stream", n_ctx=256, cache_bytes=2 * MiB)) as session:
            await session.generate(PROMPT, 4, stop_at_end=False)
            residency = session._streaming.residency  # noqa: SLF001
            layer = residency.layout.moe_layers[0]
            expert = int(residency.maps[layer].nonzero()[0][0])
            request = residency.requests(layer, expert)[0]
            byte = ctypes.c_ubyte.from_address(request.dest + 7)
            byte.value ^= 0xFF
            return resident_mismatches(session), (layer, request.key.proj, expert)

    found, flipped = asyncio.run(go())
    assert found == [flipped]


def test_a_predictor_that_scored_nothing_reports_null_not_an_empty_object(tiny, monkeypatch) -> None:  # noqa: ANN001
    """Unmeasured is null: ``--json`` printed ``"predict_accuracy_pct": {}`` when nothing was scored."""
    from bmoe.stages.predict import Predictor

    monkeypatch.setattr(Predictor, "accuracy_pct", lambda self: {})
    path = tiny.path(TinySpec(n_embd=256, n_ff=256, n_layer=4))
    _, stats = stream_within_budget(path, RunConfig(n_ctx=256, cache_bytes=BUDGET, predict_prefetch=True))
    assert stats.predict_accuracy_pct is None

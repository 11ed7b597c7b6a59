"""The C node filter in front of the eval callback: only MoE nodes reach Python, and the tokens are
the ones the Python filter (and a resident run) give."""

from __future__ import annotations

import asyncio
import ctypes
from dataclasses import replace

import numpy as np
import pytest

from bmoe.llama import node_filter
from bmoe.llama.callback import EvalCallback
from bmoe.engine.config import MiB, RunConfig
from bmoe.engine.session import Session
from bmoe.io.ggml import GgmlTensor
from bmoe.synth.tiny import TinySpec
from tests.helpers import N_TOKENS, PROMPT, TinyModels, generate_tokens

SPEC = TinySpec(arch="qwen3moe", n_layer=4, n_expert=8, n_expert_used=2)
EVICTING = RunConfig(mode="stream", n_ctx=256, cache_bytes=1 * MiB)


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """The name of every node the Python callback is asked about (from the next context on)."""
    names: list[bytes] = []
    plain = EvalCallback._eval

    def counting(self, node, ask, data):  # noqa: ANN001, ANN202
        names.append(GgmlTensor.from_address(node).name)
        return plain(self, node, ask, data)

    monkeypatch.setattr(EvalCallback, "_eval", counting)
    return names


def test_only_moe_nodes_reach_python(tiny: TinyModels, seen: list[bytes], monkeypatch: pytest.MonkeyPatch) -> None:
    path = tiny.path(SPEC)
    if node_filter.node_filter(node_filter.EvalFn(lambda *_: False)) is None:
        pytest.skip(f"no C filter here: {node_filter.unavailable}")
    generate_tokens(path, EVICTING, n=4)
    assert seen and all(name.startswith(b"ffn_moe_") for name in seen)
    moe_calls = len(seen)
    seen.clear()
    monkeypatch.setenv("BMOE_NODE_FILTER", "python")  # negative control: every node asked in Python
    generate_tokens(path, EVICTING, n=4)
    assert any(not name.startswith(b"ffn_moe_") for name in seen)
    assert len(seen) > 2 * moe_calls


def test_the_c_and_python_filters_give_the_resident_tokens(tiny: TinyModels, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tiny.path(SPEC)
    resident = tiny.resident_tokens(path)
    assert generate_tokens(path, EVICTING) == resident
    monkeypatch.setenv("BMOE_NODE_FILTER", "python")
    assert generate_tokens(path, EVICTING) == resident


@pytest.mark.pure
def test_without_a_compiler_the_python_filter_is_installed(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # noqa: ANN001
    monkeypatch.setattr(node_filter, "_loaded", None)
    monkeypatch.setattr(node_filter, "_failed", None)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    assert node_filter.node_filter(node_filter.EvalFn(lambda *_: False)) is None
    assert "could not be built" in (node_filter.unavailable or "")


def test_the_stats_say_which_filter_ran(tiny: TinyModels, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tiny.path(SPEC)

    async def kind(config: RunConfig) -> str | None:
        with Session.open(path, config) as s:
            return (await s.generate(PROMPT, 2, stop_at_end=False)).stats.node_filter

    assert asyncio.run(kind(RunConfig(mode="resident", n_ctx=256))) is None  # no callback at all
    built = node_filter.node_filter(node_filter.EvalFn(lambda *_: False)) is not None
    assert asyncio.run(kind(EVICTING)) == ("c" if built else f"python: {node_filter.unavailable}")
    monkeypatch.setenv("BMOE_NODE_FILTER", "python")
    assert asyncio.run(kind(EVICTING)) == "python: BMOE_NODE_FILTER=python"


@pytest.mark.pure
def test_a_failed_build_is_not_tried_again_at_every_open(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # noqa: ANN001
    monkeypatch.setattr(node_filter, "_loaded", None)
    monkeypatch.setattr(node_filter, "_failed", None)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a compiler that fails
    assert node_filter.node_filter(node_filter.EvalFn(lambda *_: False)) is None
    builds = []
    monkeypatch.setattr(node_filter, "_build", lambda: builds.append(1))
    assert node_filter.node_filter(node_filter.EvalFn(lambda *_: False)) is None
    assert builds == [] and "could not be built" in (node_filter.unavailable or "")



@pytest.fixture
def asked(monkeypatch: pytest.MonkeyPatch) -> list[tuple[bytes, bool]]:
    """(name, ask) of every call that reaches the Python callback once it streams (the warm-up
    decodes at open, before streaming starts, see every MoE node by design)."""
    calls: list[tuple[bytes, bool]] = []
    plain = EvalCallback._eval

    def counting(self, node, ask, data):  # noqa: ANN001, ANN202
        if self.streaming:
            calls.append((GgmlTensor.from_address(node).name, bool(ask)))
        return plain(self, node, ask, data)

    monkeypatch.setattr(EvalCallback, "_eval", counting)
    return calls


def test_a_plain_stream_calls_python_once_a_layer(tiny: TinyModels, asked: list[tuple[bytes, bool]]) -> None:
    path = tiny.path(SPEC)
    if node_filter.node_filter(node_filter.EvalFn(lambda *_: False)) is None:
        pytest.skip(f"no C filter here: {node_filter.unavailable}")
    resident = tiny.resident_tokens(path)
    plain = replace(EVICTING, predict_prompt=False)
    assert generate_tokens(path, plain) == resident
    assert asked and all(n.startswith(b"ffn_moe_topk-") and not a for n, a in asked)
    assert {int(n[len(b"ffn_moe_topk-"):]) for n, _ in asked} == set(range(SPEC.n_layer))
    asked.clear()  # the prompt's read-ahead (on by default) also takes each router node of the batch
    assert EVICTING.predicts_prompts and generate_tokens(path, EVICTING) == resident
    routers = [n for n, _ in asked if n.startswith(b"ffn_moe_logits-")]
    assert not any(a for _, a in asked), "asked in C"
    assert all(n.startswith((b"ffn_moe_topk-", b"ffn_moe_logits-")) for n, _ in asked)
    assert sorted(int(n[len(b"ffn_moe_logits-"):]) for n in routers) == list(range(SPEC.n_layer)), \
        "one router node a layer, in the prompt's one batched call only"
    asked.clear()  # negative control: overlap waits at the matmuls, so every MoE node reaches Python
    overlap = RunConfig(mode="stream", n_ctx=256, cache_bytes=1 * MiB, overlap=True)
    assert generate_tokens(path, overlap) == resident
    assert any(a for n, a in asked)
    assert any(not n.startswith(b"ffn_moe_topk-") for n, _ in asked)



def _run_stats(path, config: RunConfig, between=None):  # noqa: ANN001, ANN202
    async def go():  # noqa: ANN202
        with Session.open(path, config) as s:
            first = await s.generate(PROMPT, 12, stop_at_end=False)
            if between is not None:
                between()
            second = await s.generate(PROMPT, 12, stop_at_end=False)
            st = second.stats
            return first.tokens, second.tokens, (st.cache_hits, st.experts_read, st.cache_evictions)

    return asyncio.run(go())


def test_resident_routings_are_served_in_c_and_the_cache_sees_them_in_order(
    tiny: TinyModels, asked: list[tuple[bytes, bool]], monkeypatch: pytest.MonkeyPatch,
) -> None:
    path = tiny.path(SPEC)
    if node_filter.node_filter(node_filter.EvalFn(lambda *_: False)) is None:
        pytest.skip(f"no C filter here: {node_filter.unavailable}")
    resident = tiny.resident_tokens(path)
    big = RunConfig(mode="stream", n_ctx=256, cache_bytes=64 * MiB)
    first, second, (hits, read, _) = _run_stats(path, big, between=asked.clear)
    assert first == second == resident[:12]
    assert read == 0 and hits >= 11 * SPEC.n_layer, "all cached, and every routing reached the cache"
    assert asked == [], "one-token routings of cached experts never reach Python"
    monkeypatch.setenv("BMOE_NODE_FILTER", "python")  # negative control: Python sees every one
    _run_stats(path, big, between=asked.clear)
    assert sum(1 for n, a in asked if n.startswith(b"ffn_moe_topk-") and not a) >= 11 * SPEC.n_layer
    monkeypatch.delenv("BMOE_NODE_FILTER")
    # The accounting matches the Python filter's exactly, evicting or not (same hits, same evictions).
    for budget in (64 * MiB, 1 * MiB):
        config = RunConfig(mode="stream", n_ctx=256, cache_bytes=budget)
        with_c = _run_stats(path, config)
        monkeypatch.setenv("BMOE_NODE_FILTER", "python")
        with_python = _run_stats(path, config)
        monkeypatch.delenv("BMOE_NODE_FILTER")
        assert with_c == with_python


def _unseen_run(path, monkeypatch: pytest.MonkeyPatch, *, poison: bool = False, hold_one_back: bool = False):  # noqa: ANN001, ANN202
    """Tokens of the second of two generations on a cache that holds every expert, the hits the
    C filter let pass unseen during it, and its hit count. ``poison``: layer 0's first expert
    projection is overwritten with NaNs after the first generation (the map still says resident);
    ``hold_one_back``: layer 0's map says one expert is missing (it is not: pages stay)."""
    from bmoe.pipeline.boundary import UnseenHits

    unseen: list[int] = []
    drain = node_filter.NodeFilter.drain

    def spying(self):  # noqa: ANN001, ANN202
        out = drain(self)
        unseen.extend(x.count for x in out if isinstance(x, UnseenHits))
        return out

    monkeypatch.setattr(node_filter.NodeFilter, "drain", spying)

    async def go():  # noqa: ANN202
        with Session.open(path, RunConfig(mode="stream", n_ctx=256, cache_bytes=64 * MiB)) as s:
            await s.generate(" ".join([PROMPT] * 6), N_TOKENS, stop_at_end=False)  # routes every expert
            residency = s._streaming.residency  # noqa: SLF001 - the test reaches into the bytes
            assert all(m.all() for m in residency.maps), "the first generation filled the cache"
            if poison:
                residency._regions[0, 0].fill(0xFF)  # noqa: SLF001
            if hold_one_back:
                residency.maps[0][SPEC.n_expert - 1] = False
            unseen.clear()
            g = await s.generate(PROMPT, N_TOKENS, stop_at_end=False)
            return g.tokens, sum(unseen), g.stats.cache_hits

    out = asyncio.run(go())
    monkeypatch.undo()
    return out


def test_a_cache_holding_every_expert_lets_one_token_routings_pass_unseen(
    tiny: TinyModels, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With every expert resident no routing can miss or evict, so llama.cpp is not asked to stop at
    the routing nodes (no graph split, no bookkeeping); the hits still count, the tokens are
    resident's, and while an expert is missing every routing is looked at again."""
    path = tiny.path(SPEC)
    if node_filter.node_filter(node_filter.EvalFn(lambda *_: False)) is None:
        pytest.skip(f"no C filter here: {node_filter.unavailable}")
    resident = tiny.resident_tokens(path)
    tokens, unseen, hits = _unseen_run(path, monkeypatch)
    assert tokens == resident
    # Every call is one token: the prompt is a prefix of the first generation's, reused from the KV
    # cache but for its last token, which is decoded again for its logits.
    decode_steps = N_TOKENS
    assert unseen == decode_steps * SPEC.n_layer * SPEC.n_expert_used, "every one-token routing went unseen"
    assert hits >= unseen, "and every one counted as a hit"
    tokens, partial, _ = _unseen_run(path, monkeypatch, hold_one_back=True)
    assert tokens == resident
    # One expert short, the routings are looked at (and planned) until a read makes the cache whole.
    assert partial < unseen and partial % (SPEC.n_layer * SPEC.n_expert_used) == 0
    poisoned, _, _ = _unseen_run(path, monkeypatch, poison=True)  # negative control
    assert poisoned != resident, "the unseen layers compute on bmoe's bytes: a bad expert shows"


def _noop_run(path, monkeypatch: pytest.MonkeyPatch, scale: float | None = None, mute: bool = True):  # noqa: ANN001, ANN202
    """Greedy tokens of a streamed user-open run and the no-op nodes it muted. ``scale``: the
    filled per-expert down scales are overwritten with it after the open (the filter still takes
    them for no-ops); ``mute`` False: the filter mutes nothing."""
    import bmoe.llama.loader as loader

    open_user = loader._open_user

    def opening(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        opened = open_user(*a, **kw)
        if scale is not None:
            for name, addr in opened.tensors.items():
                if name.endswith("ffn_down_exps.scale"):
                    t = GgmlTensor.from_address(addr)
                    n = t.ne[0] * t.ne[1] * t.ne[2] * t.ne[3]
                    np.ctypeslib.as_array((ctypes.c_float * n).from_address(t.data))[:] = scale
        return opened

    monkeypatch.setattr(loader, "_open_user", opening)
    if not mute:
        monkeypatch.setattr(node_filter.NodeFilter, "set_skip", lambda self, on: None)

    async def go():  # noqa: ANN202
        with Session.open(path, RunConfig(mode="stream", n_ctx=256, cache_bytes=64 * MiB)) as s:
            g = await s.generate(PROMPT, N_TOKENS, stop_at_end=False)
            nf = s._model._node_filter  # noqa: SLF001 - the filter's own count
            return g.tokens, (nf.skipped if nf is not None else 0), g.stats.open_mode

    out = asyncio.run(go())
    monkeypatch.undo()
    return out


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe"])
def test_the_user_opens_no_op_nodes_are_muted_and_tokens_stay_resident(
    tiny: TinyModels, arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The user open creates every optional tensor (1.0 scales, 0.0 biases); their nodes cost a
    barrier each a token. Muted in C, the run must give the resident tokens. Negative control: with
    the down scales made 50.0 (no no-op any more) a mute drops a real computation, and the tokens
    differ from the unmuted run's: a wrong mute shows in the tokens."""
    if node_filter.node_filter(node_filter.EvalFn(lambda *_: False)) is None:
        pytest.skip(f"no C filter here: {node_filter.unavailable}")
    path = tiny.path(TinySpec(arch=arch, n_layer=3, n_expert=8, n_expert_used=2))
    resident = tiny.resident_tokens(path)
    tokens, skipped, mode = _noop_run(path, monkeypatch)
    assert mode == "user" and skipped > 0, "no-op nodes were muted"
    assert tokens == resident
    unmuted, none_muted, _ = _noop_run(path, monkeypatch, mute=False)
    assert none_muted == 0 and unmuted == resident
    if arch != "qwen3moe":
        return  # the control overwrites qwen3moe's expert down scales; on qwen2moe that changed no token here
    scaled, _, _ = _noop_run(path, monkeypatch, scale=50.0, mute=False)
    scaled_muted, _, _ = _noop_run(path, monkeypatch, scale=50.0)
    assert scaled != resident, "a 50.0 scale changes the tokens"
    assert scaled_muted != scaled, "muting it drops it: the tokens show a wrong mute"


def test_a_filter_that_could_not_be_built_is_a_warning(tiny: TinyModels, monkeypatch: pytest.MonkeyPatch,
                                                       tmp_path) -> None:  # noqa: ANN001
    """An unwritable cache folder (or no compiler) left every node to Python, said only in --json."""
    path = tiny.path(SPEC)
    monkeypatch.setattr(node_filter, "_loaded", None)
    monkeypatch.setattr(node_filter, "_failed", None)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with Session.open(path, EVICTING) as s:
        assert any("the C node filter is not in use (" in w and "could not be built" in w for w in s.warnings), s.warnings
    monkeypatch.setenv("BMOE_NODE_FILTER", "python")  # asked for: no warning
    with Session.open(path, EVICTING) as s:
        assert not any("node filter" in w for w in s.warnings), s.warnings


def _built() -> ctypes.CDLL:
    if node_filter.node_filter(node_filter.EvalFn(lambda *_: False)) is None:
        pytest.skip(f"no C filter here: {node_filter.unavailable}")
    assert node_filter._loaded is not None
    return node_filter._loaded


@pytest.mark.pure
def test_the_c_structs_layout_matches_its_ctypes_mirror() -> None:
    """The compiled struct's size and every field's offset and size, as the C compiler laid them
    out, equal the mirror's: checked at every open, before a field is written."""
    node_filter.check_layout(_built())


class _Moved(ctypes.Structure):  # the mirror with two int32 fields swapped for one int64: offsets shift
    _fields_ = [(n, t) if n != "n_layers" else ("n_layers", ctypes.c_int64)
                for n, t in node_filter._FilterData._fields_ if n != "n_expert"]


class _Short(ctypes.Structure):  # the last field dropped: the mirror is 8 bytes short
    _fields_ = node_filter._FilterData._fields_[:-1]


@pytest.mark.pure
@pytest.mark.parametrize(("mirror", "says"), [
    (_Moved, "the C side has n_layers: 4 bytes at offset 40, the mirror n_layers: 8 bytes at offset 40"),
    (_Short, "the C side has the struct: 168 bytes, the mirror the struct: 160 bytes"),
])
def test_a_wrong_mirror_is_refused_in_one_line(mirror: type, says: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: a mirror that disagrees with the C struct is one SeamMismatchError, at
    the open (``node_filter``), never a callback that writes the wrong bytes."""
    from bmoe.errors import SeamMismatchError

    lib = _built()
    with pytest.raises(SeamMismatchError) as err:
        node_filter.check_layout(lib, mirror)
    assert says in str(err.value) and "\n" not in str(err.value)
    monkeypatch.setattr(node_filter.check_layout, "__defaults__", (mirror,))
    with pytest.raises(SeamMismatchError):
        node_filter.node_filter(node_filter.EvalFn(lambda *_: False))

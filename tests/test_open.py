"""Open modes: init_from_user builds the same model as the plain load, reads only the dense bytes
when streaming, and the mode choice and page release behave as the loader says."""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

import numpy as np
import pytest

from bmoe.llama.callback import EvalCallback
from bmoe.llama.loader import (
    OpenedModel,
    UserPathUnsupported,
    capture_weights,
    choose_open_mode,
    open_model,
    user_alloc_bytes,
)
from bmoe.llama.seam import LlamaModel
from bmoe.errors import SeamError
from bmoe.io.ggml import GgmlTensor
from bmoe.io.layout import ModelLayout, read_layout
from bmoe.io.pagecache import (
    evict_file_cache,
    mapping_spans,
    read_io_bytes,
    release_file_pages,
)
from bmoe.io.regions import resident_bytes_of
from bmoe.pipeline.gate import RoutingGate
from bmoe.stages.bind import Residency
from bmoe.synth import tiny as tiny_mod
from bmoe.synth.tiny import TinySpec, write_tiny
from tests.helpers import greedy_on

PROMPT = "Routed experts stream from the disk, token after token."  # ~20 byte-level tokens
N_TOKENS = 16
GIB = 1 << 30
# Most of the file is experts: 4 layers x 3 x 32 experts x 256 x 256 f16 = 48 MiB of 50 MiB.
BIG_EXPERTS = TinySpec(arch="qwen3moe", wtype="f16", n_layer=4, n_embd=256, n_expert=32, n_ff=256)
# Header pages, page rounding of the small tensors, first-use code pages of libllama.
READ_SLACK = 512 * 1024


def greedy(opened: OpenedModel, n: int = N_TOKENS, *, keep: bool = False) -> tuple[np.ndarray, list[int]]:
    """Logits after the prompt and ``n`` greedy tokens, on a context of its own. Frees the model
    unless ``keep``."""
    owned = opened if not keep else OpenedModel(opened.model, opened.open_mode, opened.open_reason, None)
    model = LlamaModel(owned, n_ctx=128, n_threads=2, callback=EvalCallback(RoutingGate()), install=False)
    try:
        return greedy_on(model, n, PROMPT)
    finally:
        if keep:
            owned.model = None  # the context goes, the caller's model stays
        model.close()


def layout_of(tmp_path: Path, spec: TinySpec) -> ModelLayout:
    return read_layout(write_tiny(tmp_path / "tiny.gguf", spec)[0])


def assert_same_model(layout: ModelLayout) -> list[int]:
    logits_mmap, tokens_mmap = greedy(open_model(layout, streaming=False, mode="mmap"))
    user = open_model(layout, streaming=False, mode="user")
    assert user.open_mode == "user"
    logits_user, tokens_user = greedy(user)
    assert tokens_user == tokens_mmap
    assert logits_user.tobytes() == logits_mmap.tobytes()
    return tokens_mmap


@pytest.mark.parametrize("wtype", ["f32", "q8_0"])
@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe", "gemma4"])
def test_user_open_matches_mmap(tmp_path: Path, arch: str, wtype: str) -> None:
    tokens = assert_same_model(layout_of(tmp_path, TinySpec(arch=arch, wtype=wtype)))
    assert len(set(tokens)) > 2, "degenerate fixture: the comparison would prove little"


def test_user_open_split_set(tmp_path: Path) -> None:
    layout = layout_of(tmp_path, TinySpec(arch="qwen3moe", wtype="q8_0", shards=3))
    assert len(layout.shards) == 3
    assert_same_model(layout)


def test_user_open_tied_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No output.weight: the plain load reuses token_embd; the user path gets a typed copy."""
    plan = tiny_mod._plan
    monkeypatch.setattr(tiny_mod, "_plan", lambda spec, dims: [t for t in plan(spec, dims) if t.name != "output.weight"])
    layout = layout_of(tmp_path, TinySpec(arch="qwen3moe", wtype="q8_0"))
    assert "output.weight" not in layout.tensors
    assert_same_model(layout)


def test_user_open_fills_missing_optional_tensors(tmp_path: Path) -> None:
    layout = layout_of(tmp_path, TinySpec(arch="qwen3moe", wtype="f32"))
    opened = open_model(layout, streaming=True, mode="user")
    try:
        extra = {n: a for n, a in opened.tensors.items() if n not in layout.tensors}
        assert "blk.0.attn_q.bias" in extra and "blk.0.ffn_down_exps.scale" in extra
        for name, addr in extra.items():
            t = GgmlTensor.from_address(addr)
            n = int(np.prod(t.ne))
            values = np.ctypeslib.as_array((ctypes.c_float * n).from_address(t.data))
            assert (values == (0.0 if name.endswith(".bias") else 1.0)).all(), name
        # Every file tensor was seen, and the experts' addresses are there for the session.
        assert set(layout.tensors) <= set(opened.tensors)
        assert set(opened.expert_tensors(layout)) == set(layout.experts)
        # Per-expert scales exist, so the expert matmuls lost their ffn_moe_* names.
        assert opened.scaled_expert_matmuls
    finally:
        opened.free()
        opened.free()  # idempotent


@pytest.mark.parametrize(("arch", "wtype"), [("qwen3moe", "q8_0"), ("gemma4", "f32")])
def test_user_open_streamed_experts(tmp_path: Path, arch: str, wtype: str) -> None:
    """What the session does with a streaming user open: rebind the experts from
    ``expert_tensors`` into regions holding the file's bytes; same logits as the plain load."""
    layout = layout_of(tmp_path, TinySpec(arch=arch, wtype=wtype))
    logits_mmap, tokens_mmap = greedy(open_model(layout, streaming=False, mode="mmap"))
    opened = open_model(layout, streaming=True, mode="user")
    residency = Residency(layout, opened.expert_tensors(layout))
    try:
        residency.bind()
        fds = [os.open(p, os.O_RDONLY) for p in layout.shards]
        try:
            for il in layout.moe_layers:
                for base_nbytes, et in zip(residency.layer_spans(il), layout.layer_experts(il)):
                    buf = (ctypes.c_char * et.span.nbytes).from_address(base_nbytes[0])
                    assert os.preadv(fds[et.span.shard], [buf], et.span.offset) == et.span.nbytes
        finally:
            for fd in fds:
                os.close(fd)
        logits_user, tokens_user = greedy(opened, keep=True)
        assert tokens_user == tokens_mmap
        assert logits_user.tobytes() == logits_mmap.tobytes()
    finally:
        residency.close()
        opened.free()


def test_user_open_refuses_what_it_cannot_fill(tmp_path: Path) -> None:
    """gemma4 with separate gate/up experts: the user path would create a fused F32 tensor."""
    layout = layout_of(tmp_path, TinySpec(arch="gemma4", fuse_gate_up=False))
    with pytest.raises(UserPathUnsupported, match="ffn_gate_up_exps"):
        open_model(layout, streaming=True, mode="user")
    opened = open_model(layout, streaming=True)  # auto: falls back, and says why
    try:
        assert opened.open_mode == "mmap-drop"
        assert "ffn_gate_up_exps" in opened.open_reason
    finally:
        opened.free()


def measured_open(layout: ModelLayout, *, streaming: bool, mode: str) -> OpenedModel:
    evict_file_cache(layout.shards)
    opened = open_model(layout, streaming=streaming, mode=mode)
    if not opened.open_bytes_read:
        opened.free()
        pytest.skip(
            f"/proc/self/io read_bytes did not move across a {mode} open of an evicted file "
            f"({opened.open_bytes_read}): page cache not evictable or filesystem without block I/O accounting"
        )
    return opened


def test_open_bytes_read(tmp_path: Path) -> None:
    layout = layout_of(tmp_path, BIG_EXPERTS)
    assert layout.expert_bytes >= 0.9 * layout.file_bytes
    if read_io_bytes() is None:
        pytest.skip("/proc/self/io is unreadable here")
    open_model(layout, streaming=True, mode="user").free()  # first use pages in libllama's code

    user = measured_open(layout, streaming=True, mode="user")
    try:
        assert user.open_bytes_read is not None
        assert user.open_bytes_read <= 1.1 * layout.dense_bytes + READ_SLACK, (
            f"user open read {user.open_bytes_read} bytes for {layout.dense_bytes} dense bytes"
        )
        # The experts were never written: (almost) none of their pages are in RAM.
        expert_resident = sum(
            resident_bytes_of(GgmlTensor.from_address(addr).data, layout.experts[key].span.nbytes)
            for key, addr in user.expert_tensors(layout).items()
        )
        assert expert_resident <= 0.05 * layout.expert_bytes
    finally:
        user.free()

    plain = measured_open(layout, streaming=True, mode="mmap")
    try:
        assert plain.open_bytes_read is not None
        assert plain.open_bytes_read >= 0.9 * layout.file_bytes
    finally:
        plain.free()


def fake_memory(mem_total: int, swap: int = 0, commit_limit: int = 0, committed: int = 0):  # noqa: ANN201
    return lambda: {"MemTotal": mem_total, "SwapTotal": swap, "CommitLimit": commit_limit, "Committed_AS": committed}


@pytest.mark.pure
def test_choose_open_mode(tmp_path: Path) -> None:
    layout = layout_of(tmp_path, TinySpec(arch="qwen3moe"))
    need = user_alloc_bytes(layout)
    assert need >= sum(s.nbytes for s in layout.tensors.values())

    assert choose_open_mode(layout, False)[0] == "mmap"
    mode, reason = choose_open_mode(layout, True, meminfo=fake_memory(16 * GIB), overcommit=lambda: 0)
    assert mode == "user", reason
    # RAM + swap smaller than the one allocation (with its margin): the kernel would refuse it.
    mode, reason = choose_open_mode(layout, True, meminfo=fake_memory(need), overcommit=lambda: 0)
    assert mode == "mmap-drop" and "MemTotal + SwapTotal" in reason and "overcommit_memory=0" in reason
    assert "\n" not in reason
    # Swap counts in the heuristic.
    assert choose_open_mode(layout, True, meminfo=fake_memory(need, swap=4 * GIB), overcommit=lambda: 0)[0] == "user"
    # Mode 1 never refuses; mode 2 looks at what is left of the commit limit.
    assert choose_open_mode(layout, True, meminfo=fake_memory(1), overcommit=lambda: 1)[0] == "user"
    strict = fake_memory(64 * GIB, commit_limit=8 * GIB, committed=8 * GIB - need)
    assert choose_open_mode(layout, True, meminfo=strict, overcommit=lambda: 2)[0] == "mmap-drop"
    roomy = fake_memory(64 * GIB, commit_limit=8 * GIB, committed=GIB)
    assert choose_open_mode(layout, True, meminfo=roomy, overcommit=lambda: 2)[0] == "user"


def test_auto_open_follows_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from bmoe.llama import loader

    layout = layout_of(tmp_path, TinySpec(arch="qwen3moe"))
    monkeypatch.setattr(loader, "read_overcommit", lambda: 0)
    monkeypatch.setattr(loader, "read_meminfo", fake_memory(user_alloc_bytes(layout)))
    small = open_model(layout, streaming=True)
    try:
        assert small.open_mode == "mmap-drop" and small.tensors == {}
    finally:
        small.free()
    monkeypatch.setattr(loader, "read_meminfo", fake_memory(64 * GIB))
    big = open_model(layout, streaming=True)
    try:
        assert big.open_mode == "user" and big.tensors
    finally:
        big.free()
    with pytest.raises(ValueError):
        open_model(layout, streaming=True, mode="lazy")


def test_release_file_pages(tmp_path: Path) -> None:
    layout = layout_of(tmp_path, BIG_EXPERTS)
    evict_file_cache(layout.shards)  # written back, so the page cache can let the pages go
    opened = open_model(layout, streaming=True, mode="mmap-drop")
    try:
        found = capture_weights(opened.model, [et.span.name for et in layout.experts.values()])
        tensors = {key: found[et.span.name][0] for key, et in layout.experts.items()}
        spans = mapping_spans(layout, tensors)
        before = sum(resident_bytes_of(addr, span.nbytes) for span, addr in spans)
        assert before >= 0.9 * layout.expert_bytes  # the plain load populated everything
        released = release_file_pages(layout, spans)
        after = sum(resident_bytes_of(addr, span.nbytes) for span, addr in spans)
        assert released >= 0.95 * layout.expert_bytes
        # Only the edges stay: partial pages and large page-cache folios across a tensor's ends.
        assert after <= 0.05 * layout.expert_bytes, (before, after)
        # Dropped pages refault from the file: the model still decodes the same.
        _, tokens = greedy(opened, 4, keep=True)
        assert len(tokens) == 4

        # Anything that is not llama.cpp's read-only mapping of that file range is refused.
        span, addr = spans[0]
        with pytest.raises(SeamError):
            release_file_pages(layout, [(span, addr + mmap.PAGESIZE)])  # wrong file offset
        anon = (ctypes.c_char * span.nbytes)()
        with pytest.raises(SeamError):
            release_file_pages(layout, [(span, ctypes.addressof(anon))])
    finally:
        opened.free()

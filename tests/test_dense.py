"""AnonDense: dense weights copied into anonymous memory decode exactly as from the file mapping."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bmoe.llama.callback import EvalCallback
from bmoe.llama.loader import capture_weights, open_model
from bmoe.llama.seam import LlamaModel
from bmoe.io.ggml import GgmlTensor
from bmoe.io.layout import read_layout
from bmoe.io.pagecache import evict_file_cache
from bmoe.io.regions import resident_bytes_of
from bmoe.pipeline.gate import RoutingGate
from bmoe.stages.dense import ALIGN, AnonDense
from bmoe.synth.tiny import TinySpec, write_tiny
from tests.helpers import greedy_on

PROMPT = "Routed experts stream from the disk, token after token."


def generate(model: LlamaModel, n: int = 16) -> tuple[np.ndarray, list[int]]:
    model.clear_memory()
    return greedy_on(model, n, PROMPT)


@pytest.mark.parametrize(("arch", "wtype"), [("qwen3moe", "f32"), ("qwen2moe", "q8_0"), ("gemma4", "q8_0")])
def test_anon_dense_generates_the_same(tmp_path: Path, arch: str, wtype: str) -> None:
    layout = read_layout(write_tiny(tmp_path / "tiny.gguf", TinySpec(arch=arch, wtype=wtype, n_embd=256))[0])
    evict_file_cache(layout.shards)  # written back: the released pages can leave the page cache
    opened = open_model(layout, streaming=False, mode="mmap")
    model = LlamaModel(opened, n_ctx=128, n_threads=2, callback=EvalCallback(RoutingGate()), install=False)
    try:
        logits0, tokens0 = generate(model)
        expert_names = {et.span.name for et in layout.experts.values()}
        dense = [n for n in layout.tensors if n not in expert_names]
        captured = capture_weights(opened.model, dense)
        originals = {a: GgmlTensor.from_address(a).data for addrs in captured.values() for a in addrs}

        def mapped_resident() -> int:
            return sum(
                resident_bytes_of(data, layout.tensors[GgmlTensor.from_address(a).name.decode()].nbytes)
                for a, data in originals.items()
            )

        resident_before = mapped_resident()
        anon = AnonDense(layout, captured, open_mode=opened.open_mode)
        assert anon.active and anon.missing == []
        anon.apply()
        assert anon.not_mapped == []
        assert anon.bytes_copied == layout.dense_bytes
        for addr, data in originals.items():
            now = GgmlTensor.from_address(addr).data
            assert now != data and now % ALIGN == 0
        # The mapping's pages of the dense ranges are gone, but for partial pages at the edges.
        resident_after = mapped_resident()
        assert anon.bytes_released > 0.5 * layout.dense_bytes
        assert resident_after <= resident_before - 0.5 * anon.bytes_released, (resident_before, resident_after)

        logits1, tokens1 = generate(model)
        assert tokens1 == tokens0
        assert logits1.tobytes() == logits0.tobytes()

        anon.restore()
        assert {a: GgmlTensor.from_address(a).data for a in originals} == originals
        assert generate(model)[1] == tokens0  # refaulted from the file
        anon.apply()  # again, onto the copies it kept
        assert generate(model)[1] == tokens0
        anon.close()
        anon.close()
        assert {a: GgmlTensor.from_address(a).data for a in originals} == originals
        assert generate(model)[1] == tokens0
    finally:
        model.close()


def test_anon_dense_is_a_no_op_after_a_user_open(tmp_path: Path) -> None:
    layout = read_layout(write_tiny(tmp_path / "tiny.gguf", TinySpec(arch="qwen3moe"))[0])
    opened = open_model(layout, streaming=False, mode="user")
    try:
        before = {n: GgmlTensor.from_address(a).data for n, a in opened.tensors.items()}
        anon = AnonDense(layout, opened.tensors, open_mode=opened.open_mode)
        assert not anon.active and "anonymous" in (anon.inactive_reason or "")
        anon.apply()
        assert not anon.bound and anon.bytes_copied == 0
        assert {n: GgmlTensor.from_address(a).data for n, a in opened.tensors.items()} == before
        anon.close()
    finally:
        opened.free()

"""Byte-identity gates on the weight types people download, written by llama.cpp's own quantizer.

The other gates run on files bmoe writes (f32, f16, q8_0, and gpt-oss's MXFP4). What users run
is mostly K- and I-quants, mixed within one file: a Q4_K_M model keeps some layers' down
projections in Q6_K, so one layer's experts are bigger than the next one's. Here a tiny qwen3moe
in f32 is quantized by ``llama_model_quantize`` (what ``llama-quantize`` runs) and each result must
stream to the resident tokens with the cache off and with a cache that evicts, and with every slot
the routing does not name poisoned (cache off); a run that skips one routed expert must differ.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
from gguf import GGUFReader

from bmoe.engine.config import MiB, RunConfig
from bmoe.io.validate import open_layout
from bmoe.pipeline.hooks import Hooks
from bmoe.synth.tiny import TinySpec, write_tiny
from tests.helpers import generate_tokens
from tests.test_gates_stream import poison, skip_top_expert

# llama.cpp file types, and the expert tensor types each gives this model (checked, so that a
# change of llama.cpp's mix shows here rather than silently testing something else).
FTYPES = {
    "Q4_K_M": {"Q4_K", "Q6_K"},
    "Q3_K_M": {"Q3_K", "Q4_K"},
    "Q5_K_M": {"Q5_K", "Q6_K"},
    "IQ4_XS": {"IQ4_XS"},
    "MXFP4_MOE": {"MXFP4"},
}
MIXED_LAYERS = {"Q4_K_M", "Q5_K_M"}  # some layers' down projections in Q6_K: their experts are bigger
SOURCE = TinySpec(arch="qwen3moe", wtype="f32", n_embd=256, n_ff=256, n_expert=16, n_layer=3)


def stream(**kw: object) -> RunConfig:
    return RunConfig(mode="stream", n_ctx=256, **kw)


@pytest.fixture(scope="module")
def quantized(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    import llama_cpp

    folder = tmp_path_factory.mktemp("quants")
    source = write_tiny(folder / "f32.gguf", SOURCE)[0]
    out = {}
    for name in FTYPES:
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{name}")
        params.nthread = 2
        path = folder / f"{name}.gguf"
        assert llama_cpp.llama_model_quantize(str(source).encode(), str(path).encode(), ctypes.byref(params)) == 0
        out[name] = path
    return out


@pytest.mark.parametrize("ftype", list(FTYPES))
def test_quantized_by_llama_cpp_streams_to_the_resident_tokens(quantized, ftype: str) -> None:
    path = quantized[ftype]
    types = {t.tensor_type.name for t in GGUFReader(path).tensors if "_exps." in t.name}
    assert types == FTYPES[ftype]
    layout = open_layout(path)
    if ftype in MIXED_LAYERS:
        assert len(set(layout.entry_bytes().values())) > 1, "one file, experts of two sizes"
    assert layout.expert_bytes > MiB, "the smallest budget must evict"
    resident = generate_tokens(path, RunConfig(mode="resident", n_ctx=256))
    assert len(set(resident)) >= 5, "fixture is degenerate; the gate would prove little"
    for cache, lanes in ((0, 1), (MiB, 2)):
        assert generate_tokens(path, stream(cache_bytes=cache, io_threads=lanes)) == resident, (cache, lanes)
    assert generate_tokens(path, stream(), Hooks(before_layer_reads=poison)) == resident
    assert generate_tokens(path, stream(), skip_top_expert(layout.moe_layers[0])) != resident

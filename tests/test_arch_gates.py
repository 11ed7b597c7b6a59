"""Byte-identity gates for the families added beyond bmoe's first five, one tiny fixture each.

Per architecture, on a file the pinned llama.cpp loads and decodes: streamed == resident with the
cache off and with a cache so small it evicts within every token, on 1 and 4 read lanes, serial
and with overlap; a poison run (every non-routed slot NaN) identical; a negative control (one routed
expert never read) different; and exact reads counted only in the MoE layers. The fixtures carry
what each family brings: dense lead blocks (glm4moe, deepseek2, bailingmoe2, lfm2moe, deepseek), interleaved
dense/MoE (llama4), recurrent blocks (qwen35moe, qwen3next, lfm2moe), MXFP4 experts with resident
per-expert biases (gpt-oss), shared experts and selection biases, MTP blocks (glm4moe, qwen35moe).
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from bmoe.engine.config import MiB, RunConfig
from bmoe.llama.loader import UserPathUnsupported, open_model
from bmoe.engine.session import Session
from bmoe.io.validate import open_layout
from bmoe.pipeline.hooks import Hooks
from bmoe.synth.tiny import TinySpec
from tests.helpers import N_TOKENS, PROMPT, generate_tokens
from tests.test_gates_stream import assert_exact_reads, poison, skip_top_expert

# One fixture per family, weight types spread over the three the gates cover. Experts of 0.2 to
# 0.8 MB (q8_0 to f32; gpt-oss's MXFP4 ones are 0.1 MB, hence more of them) so that the smallest
# budget, 1 MiB, evicts: the cache holds one to five of them.
W = {"n_embd": 256, "n_ff": 256}
SPECS = {
    "gpt-oss": TinySpec(arch="gpt-oss", n_expert=16, **W),  # experts MXFP4 whatever the type
    "qwen35moe": TinySpec(arch="qwen35moe", wtype="q8_0", n_nextn=1, **W),
    "deepseek2": TinySpec(arch="deepseek2", wtype="f16", **W),
    "glm4moe": TinySpec(arch="glm4moe", wtype="q8_0", n_nextn=1, **W),
    "qwen3next": TinySpec(arch="qwen3next", **W),
    "minimax-m2": TinySpec(arch="minimax-m2", wtype="f16", **W),
    "llama4": TinySpec(arch="llama4", wtype="q8_0", **W),
    "bailingmoe2": TinySpec(arch="bailingmoe2", **W),
    "lfm2moe": TinySpec(arch="lfm2moe", wtype="f16", **W),
    "qwen3vlmoe": TinySpec(arch="qwen3vlmoe", wtype="q8_0", **W),
    "dots1": TinySpec(arch="dots1", wtype="f16", **W),
    "hunyuan-moe": TinySpec(arch="hunyuan-moe", wtype="q8_0", **W),
    "ernie4_5-moe": TinySpec(arch="ernie4_5-moe", **W),
    "olmoe": TinySpec(arch="olmoe", wtype="f16", **W),
    "llama": TinySpec(arch="llama", wtype="q8_0", **W),  # Mixtral
    # Issue 37's first batch: the plain MoE block with other trimmings.
    "granitemoe": TinySpec(arch="granitemoe", wtype="f16", **W),  # + a shared expert, the four scales
    "bailingmoe": TinySpec(arch="bailingmoe", wtype="q8_0", **W),  # two shared experts
    "deepseek": TinySpec(arch="deepseek", **W),  # a leading dense block, two shared experts
    "smallthinker": TinySpec(arch="smallthinker", wtype="q8_0", **W),  # router before attention
    "phimoe": TinySpec(arch="phimoe", wtype="f16", **W),  # LayerNorm with biases, an output bias
    "minicpm": TinySpec(arch="minicpm", wtype="q8_0", **W),  # granite's block, its scales
    "mistral3": TinySpec(arch="mistral3", **W),
    "dbrx": TinySpec(arch="dbrx", wtype="f16", **W),  # fused q/k/v, LayerNorm, clamped q/k/v
    "grok": TinySpec(arch="grok", wtype="q8_0", **W),  # GELU experts, softcapped attention and router
    "afmoe": TinySpec(arch="afmoe", wtype="f16", **W),  # sliding windows, gated attention, dense lead
    "mellum": TinySpec(arch="mellum", wtype="q8_0", **W),  # sliding windows
    "arctic": TinySpec(arch="arctic", **W),  # a dense residual MLP beside the experts in every block
    "mistral4": TinySpec(arch="mistral4", wtype="f16", **W),  # deepseek2's MLA under another name
    # Ling 3: KDA linear-attention blocks (recurrent) and a gated MLA block, a dense lead block.
    "bailingmoe3": TinySpec(arch="bailingmoe3", wtype="q8_0", **W),
    "kimi-linear": TinySpec(arch="kimi-linear", wtype="f16", **W),  # KDA with low-rank gates + MLA
    "cohere2moe": TinySpec(arch="cohere2moe", wtype="q8_0", fuse_gate_up=True, **W),  # parallel blocks, windows
    "maple": TinySpec(arch="maple", wtype="f16", **W),  # sliding windows by pattern, clamped SwiGLU
    "deepseek32": TinySpec(arch="deepseek32", wtype="q8_0", **W),  # MLA + the sparse-attention indexer
    "glm-dsa": TinySpec(arch="glm-dsa", wtype="f16", **W),  # GLM-5: deepseek32's block
    "deepseek2-ocr": TinySpec(arch="deepseek2-ocr", wtype="q8_0", fuse_gate_up=True, **W),  # MHA, rope base 10000
    "exaone-moe": TinySpec(arch="exaone-moe", wtype="f16", **W),  # sliding windows, a shared expert
    "laguna": TinySpec(arch="laguna", wtype="q8_0", **W),  # a per-head attention gate, a shared expert
    "granite_swa": TinySpec(arch="granite_swa", wtype="f16", fuse_gate_up=True, **W),  # sinks, windows
    "mimo2": TinySpec(arch="mimo2", wtype="q8_0", **W),  # optional tensors: a dense block, sinks, windows
    "step35": TinySpec(arch="step35", wtype="f16", **W),  # + q/k norms, a per-head gate, a shared expert
    "hy_v3": TinySpec(arch="hy_v3", wtype="q8_0", fuse_gate_up=True, **W),  # optional tensors, fused gate/up
    "jamba": TinySpec(arch="jamba", wtype="f16", **W),  # mamba blocks (recurrent), MoE every other block
    "granitehybrid": TinySpec(arch="granitehybrid", wtype="q8_0", **W),  # mamba2 blocks, every block MoE
}
EVICTING = MiB  # the smallest budget RunConfig takes


def stream(**kw: object) -> RunConfig:
    return RunConfig(mode="stream", n_ctx=256, **kw)


@pytest.mark.parametrize("arch", list(SPECS))
def test_streamed_equals_resident(tiny, arch: str) -> None:
    path = tiny.path(SPECS[arch])
    resident = tiny.resident_tokens(path)
    assert len(set(resident)) >= 6, "fixture is degenerate; the gate would prove little"
    budget = EVICTING
    assert open_layout(path).expert_bytes > budget, "the budget must evict"
    for cache, lanes, overlap in ((0, 1, False), (0, 4, True), (budget, 1, True), (budget, 4, False)):
        got = generate_tokens(path, stream(cache_bytes=cache, io_threads=lanes, overlap=overlap))
        assert got == resident, f"cache={cache} lanes={lanes} overlap={overlap}"


@pytest.mark.parametrize("arch", list(SPECS))
def test_poison_identical_and_negative_control_differs(tiny, arch: str) -> None:
    path = tiny.path(SPECS[arch])
    resident = tiny.resident_tokens(path)
    assert generate_tokens(path, stream(), Hooks(before_layer_reads=poison)) == resident
    first_moe = open_layout(path).moe_layers[0]
    assert generate_tokens(path, stream(), skip_top_expert(first_moe)) != resident


@pytest.mark.parametrize("arch", list(SPECS))
def test_reads_only_in_moe_layers(tiny, arch: str) -> None:
    spec = SPECS[arch]
    path = tiny.path(spec)
    layout = open_layout(path)
    kinds = layout.layer_kinds()
    assert [il for il, k in kinds.items() if k == "moe"] == list(layout.moe_layers)
    n_proj = len(layout.layer_experts(layout.moe_layers[0]))
    assert_exact_reads(path, spec, moe_layers=layout.moe_layers, n_proj=n_proj)


EXPECTED_MOE_LAYERS = {
    "glm4moe": (1,),  # block 0 dense (leading_dense_block_count), block 2 MTP
    "deepseek2": (1, 2),
    "bailingmoe2": (1,),
    "lfm2moe": (1, 2),
    "llama4": (1, 3),  # interleave_moe_layer_step 2
    "qwen35moe": (0, 1),  # block 2 MTP
    "dots1": (1,),
    "ernie4_5-moe": (1,),
    "deepseek": (1, 2),
    "afmoe": (1, 2, 3),
    "mistral4": (1, 2),
    "bailingmoe3": (1, 2),
    "kimi-linear": (1, 2),
    "cohere2moe": (1, 2, 3),
    "deepseek32": (1, 2),
    "glm-dsa": (1, 2),
    "deepseek2-ocr": (1, 2),
    "exaone-moe": (1, 2, 3),
    "laguna": (1, 2),
    "mimo2": (1, 2),
    "step35": (1, 2),
    "hy_v3": (1, 2),
    "jamba": (1, 3),
}


@pytest.mark.parametrize("arch", list(EXPECTED_MOE_LAYERS))
def test_layers_without_experts_get_nothing(tiny, arch: str) -> None:
    layout = open_layout(tiny.path(SPECS[arch]))
    assert layout.moe_layers == EXPECTED_MOE_LAYERS[arch]
    assert all(il in layout.moe_layers for il, _ in layout.experts)


MTP_SPECS = {
    "glm4moe": SPECS["glm4moe"],
    "qwen35moe": SPECS["qwen35moe"],
    "bailingmoe2": dataclasses.replace(SPECS["bailingmoe2"], n_nextn=1),
    "deepseek2": dataclasses.replace(SPECS["deepseek2"], n_nextn=1),
    "bailingmoe3": dataclasses.replace(SPECS["bailingmoe3"], n_nextn=1),
}


@pytest.mark.parametrize("arch", list(MTP_SPECS))
def test_mtp_file_never_takes_the_user_path_and_never_reads_mtp_experts(tiny, arch: str) -> None:
    spec = MTP_SPECS[arch]
    path = tiny.path(spec)
    layout = open_layout(path)
    mtp = spec.n_layer  # the MTP block follows the main ones
    assert layout.n_nextn == 1 and layout.layer_kinds()[mtp] == "mtp"
    assert any(name.startswith(f"blk.{mtp}.ffn_down_exps") for name in layout.tensors)
    assert layout.skipped_bytes > 0
    with pytest.raises(UserPathUnsupported, match="MTP"):
        open_model(layout, streaming=True, mode="user")  # refused before llama.cpp sees it
    layers_read: set[int] = set()

    def before_read(request) -> bool:  # noqa: ANN001
        layers_read.add(request.key.layer)
        return True

    async def go():  # noqa: ANN202
        with Session.open(path, stream(), hooks=Hooks(before_read=before_read)) as s:
            out = await s.generate(PROMPT, N_TOKENS, stop_at_end=False)
            return s.open_mode, s.open_reason, out.tokens

    mode, reason, tokens = asyncio.run(go())
    assert mode == "mmap-drop" and "MTP" in reason
    assert tokens == tiny.resident_tokens(path)
    assert layers_read == set(layout.moe_layers) and mtp not in layers_read


def test_fused_and_split_gate_up_give_the_same_tokens(tiny) -> None:
    """deepseek2 accepts either; the fused file opens cheaply (user path), the split one cannot."""
    split = tiny.path(SPECS["deepseek2"])
    fused = tiny.path(TinySpec(arch="deepseek2", wtype="f16", fuse_gate_up=True, **W))
    assert open_layout(fused).layer_experts(1)[0].suffix == "ffn_gate_up_exps"
    with pytest.raises(UserPathUnsupported, match="ffn_gate_up_exps"):
        open_model(open_layout(split), streaming=True, mode="user")
    got = generate_tokens(fused, stream(open_mode="user"))
    assert got == tiny.resident_tokens(fused) == tiny.resident_tokens(split)


@pytest.mark.parametrize("arch", ["glm4moe", "gpt-oss"])
def test_split_sets_stream_like_the_single_file(tiny, arch: str) -> None:
    """Three shards (glm4moe's MTP experts in the last one; gpt-oss's MXFP4 experts): same tokens."""
    single = tiny.path(SPECS[arch])
    shards = tiny.path(dataclasses.replace(SPECS[arch], shards=3))
    assert len(open_layout(shards).shards) == 3
    resident = tiny.resident_tokens(single)
    assert tiny.resident_tokens(shards) == resident
    for odirect in (True, False):
        assert generate_tokens(shards, stream(odirect=odirect, io_threads=4)) == resident


@pytest.mark.parametrize("arch,mode", [("qwen35moe", "user"), ("qwen3next", "mmap-drop")])
def test_fused_hybrid_files_open_as_cheaply_as_they_can(tiny, arch: str, mode: str) -> None:
    """Fused gate/up, no MTP: qwen35moe takes the user open; qwen3next's user open would create
    the legacy ssm_in, so it is refused from the recipe before llama.cpp is asked."""
    path = tiny.path(TinySpec(arch=arch, fuse_gate_up=True))

    async def go():  # noqa: ANN202
        with Session.open(path, stream()) as s:
            return s.open_mode, (await s.generate(PROMPT, N_TOKENS, stop_at_end=False)).tokens

    open_mode, tokens = asyncio.run(go())
    assert open_mode == mode and tokens == tiny.resident_tokens(path)


@pytest.mark.parametrize("arch", ["llama", "ernie4_5-moe", "granitemoe", "grok"])
def test_up_down_only_experts(tiny, arch: str) -> None:
    """The loaders take experts without gate projections here: two projections stream, same tokens."""
    spec = dataclasses.replace(SPECS[arch], gate_experts=False)
    path = tiny.path(spec)
    layout = open_layout(path)
    assert [e.suffix for e in layout.layer_experts(layout.moe_layers[0])] == ["ffn_up_exps", "ffn_down_exps"]
    resident = tiny.resident_tokens(path)
    assert len(set(resident)) >= 6
    for overlap in (False, True):
        assert generate_tokens(path, stream(overlap=overlap, cache_bytes=EVICTING)) == resident
    assert generate_tokens(path, stream(), skip_top_expert(layout.moe_layers[0])) != resident

"""The tensor sets and keys of the MoE families beyond bmoe's first three, for tiny fixtures.

Each family writes exactly what its loader in the pinned llama.cpp (``src/models/<arch>.cpp``)
creates, at tiny widths, so that the pin loads and decodes it: extra tensors fail the load, and
several missing or malformed keys abort the process (see ``../shared/ARCHITECTURES.md``). Shapes
here are numpy order (outermost first), the reverse of ggml's. What a family chooses beyond the
loader (how many leading dense blocks, which layers are recurrent, MTP blocks) is chosen so the
fixture exercises what bmoe must handle: layers without experts, shared experts and resident
expert-dimension tensors, MXFP4, MTP blocks, recurrent state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from gguf import GGMLQuantizationType, GGUFWriter


class _Builder(Protocol):
    """What a layer plan writes with: widths and one method per kind of tensor. The tiny writer's
    builder quantizes random floats; ``synth --like``'s writes random blocks at real widths."""

    spec: Any  # n_layer (main blocks), n_expert, fused
    E: int
    F: int
    hd: int
    F_dense: int
    F_shexp: int
    n_head: int
    n_head_kv: int
    dense_lead: int
    router_std: float
    x: dict[str, Any]

    def mat(self, name: str, shape: tuple[int, ...], std: float, zero_rows: tuple[int, ...] = (),
            qtype: GGMLQuantizationType | None = None) -> None: ...

    def f32(self, name: str, shape: tuple[int, ...], std: float) -> None: ...

    def ones(self, name: str, n: int) -> None: ...

    def const(self, name: str, n: int, value: float) -> None: ...

    def experts(self, p: str, qtype: GGMLQuantizationType | None = None) -> None: ...

MXFP4 = GGMLQuantizationType.MXFP4
SMALL_STD = 0.1  # biases, selection biases, sinks: present and varied, never dominant


@dataclass(frozen=True)
class Family:
    arch: str
    layer: Callable[[_Builder, int], None]  # the tensors of block il (MTP blocks included)
    keys: Callable[[GGUFWriter, _Builder], None]  # keys beyond write_moe_keys
    min_layers: int = 1
    default_layers: int = 2
    # Keys of write_moe_keys this family writes differently (MLA head sizes, per-layer KV heads);
    # an integer n_head_kv is the builder's too (MLA's plan does not read it).
    overrides: Callable[[_Builder], dict[str, Any]] = lambda b: {}
    output_norm: str = "output_norm.weight"
    fuses_gate_up: bool = False  # may write ffn_gate_up_exps (llama.cpp accepts either)
    mtp: bool = False  # may carry nextn_predict_layers MTP blocks
    gate_optional: bool = False  # the loader takes up/down experts without gate ones
    # Family widths beyond the common ones (MLA ranks, gated-delta-net heads, groups, ...): the tiny
    # fixture's values; ``synth --like`` replaces them with a real model's (``MoeShape.extra``).
    extra: tuple[tuple[str, Any], ...] = ()
    # Tensors beside token_embd / output_norm / output (phimoe's output biases), given the vocabulary size.
    globals_: Callable[[_Builder, int], None] | None = None


# --- shared pieces --------------------------------------------------------------------------


def _attn(b: _Builder, p: str, *, q_mult: int = 1, norms: bool = True) -> None:
    E, hd = b.E, b.hd
    q_dim, kv_dim = b.n_head * hd, b.n_head_kv * hd
    b.mat(p + "attn_q.weight", (q_mult * q_dim, E), E ** -0.5)
    b.mat(p + "attn_k.weight", (kv_dim, E), E ** -0.5)
    b.mat(p + "attn_v.weight", (kv_dim, E), E ** -0.5)
    b.mat(p + "attn_output.weight", (E, q_dim), q_dim ** -0.5)
    if norms:
        b.ones(p + "attn_q_norm.weight", hd)
        b.ones(p + "attn_k_norm.weight", hd)


def _dense_ffn(b: _Builder, p: str, width: int) -> None:
    E = b.E
    b.mat(p + "ffn_gate.weight", (width, E), E ** -0.5)
    b.mat(p + "ffn_up.weight", (width, E), E ** -0.5)
    b.mat(p + "ffn_down.weight", (E, width), width ** -0.5)


def _shexp(b: _Builder, p: str, width: int) -> None:
    E = b.E
    b.mat(p + "ffn_gate_shexp.weight", (width, E), E ** -0.5)
    b.mat(p + "ffn_up_shexp.weight", (width, E), E ** -0.5)
    b.mat(p + "ffn_down_shexp.weight", (E, width), width ** -0.5)


def _router(b: _Builder, p: str, probs_bias: bool = False) -> None:
    b.mat(p + "ffn_gate_inp.weight", (b.spec.n_expert, b.E), b.router_std)
    if probs_bias:
        b.f32(p + "exp_probs_b.bias", (b.spec.n_expert,), SMALL_STD)


def _nextn(b: _Builder, p: str) -> None:
    E = b.E
    b.mat(p + "nextn.eh_proj.weight", (E, 2 * E), (2 * E) ** -0.5)
    b.ones(p + "nextn.enorm.weight", E)
    b.ones(p + "nextn.hnorm.weight", E)


def _lead_or_moe_ffn(b: _Builder, p: str, il: int, shared_width: int | None, probs_bias: bool = True) -> None:
    """The FFN of a family with leading dense blocks: a dense FFN below ``dense_lead``, else the
    router, the routed experts and (``shared_width`` not None) a shared expert of that width."""
    if il < b.dense_lead:
        _dense_ffn(b, p, b.F_dense)
        return
    _router(b, p, probs_bias=probs_bias)
    b.experts(p)
    if shared_width is not None:
        _shexp(b, p, shared_width)


def _is_mtp(b: _Builder, il: int) -> bool:
    return il >= b.spec.n_layer


def _gating(w: GGUFWriter, a: str, func: int = 2) -> None:
    w.add_uint32(f"{a}.expert_gating_func", func)
    w.add_bool(f"{a}.expert_weights_norm", True)
    w.add_float32(f"{a}.expert_weights_scale", 1.0)


# --- gpt-oss ----------------------------------------------------------------------------------


def _gpt_oss_layer(b: _Builder, il: int) -> None:
    p, E, F, N = f"blk.{il}.", b.E, b.F, b.spec.n_expert
    b.ones(p + "attn_norm.weight", E)
    b.ones(p + "post_attention_norm.weight", E)
    _attn(b, p, norms=False)
    b.f32(p + "attn_output.bias", (E,), SMALL_STD)
    b.f32(p + "attn_sinks.weight", (b.n_head,), SMALL_STD)
    _router(b, p)
    b.f32(p + "ffn_gate_inp.bias", (N,), SMALL_STD)
    b.experts(p, qtype=MXFP4)
    # Per-expert biases (ggml_add_id by the routed ids): an expert dimension, but resident.
    b.f32(p + "ffn_gate_exps.bias", (N, F), SMALL_STD)
    b.f32(p + "ffn_up_exps.bias", (N, F), SMALL_STD)
    b.f32(p + "ffn_down_exps.bias", (N, E), SMALL_STD)


def _gpt_oss_keys(w: GGUFWriter, b: _Builder) -> None:
    w.add_uint32("gpt-oss.attention.sliding_window", b.x["sliding_window"])


# --- glm4moe / bailingmoe2 / deepseek2: dense lead, shared experts, selection bias, MTP ---------


def _glm4moe_layer(b: _Builder, il: int) -> None:
    p, E = f"blk.{il}.", b.E
    b.ones(p + "attn_norm.weight", E)
    _attn(b, p)
    b.ones(p + "post_attention_norm.weight", E)
    _lead_or_moe_ffn(b, p, il, b.F * b.x["n_shared"])
    if _is_mtp(b, il):
        _nextn(b, p)


def _glm4moe_keys(w: GGUFWriter, b: _Builder) -> None:
    a = "glm4moe"
    w.add_uint32(f"{a}.feed_forward_length", b.F_dense)
    w.add_uint32(f"{a}.expert_shared_count", b.x["n_shared"])
    w.add_uint32(f"{a}.leading_dense_block_count", b.dense_lead)
    _gating(w, a)


def _bailing_layer(b: _Builder, il: int) -> None:
    p, E = f"blk.{il}.", b.E
    b.ones(p + "attn_norm.weight", E)
    b.mat(p + "attn_qkv.weight", (E + 2 * b.n_head_kv * b.hd, E), E ** -0.5)
    b.mat(p + "attn_output.weight", (E, b.n_head * b.hd), E ** -0.5)
    b.ones(p + "attn_q_norm.weight", b.hd)
    b.ones(p + "attn_k_norm.weight", b.hd)
    b.ones(p + "ffn_norm.weight", E)
    _lead_or_moe_ffn(b, p, il, b.F)
    if _is_mtp(b, il):
        _nextn(b, p)
        b.ones(p + "layer_output_norm.weight", E)


def _bailing_keys(w: GGUFWriter, b: _Builder) -> None:
    a = "bailingmoe2"
    w.add_uint32(f"{a}.feed_forward_length", b.F_dense)
    w.add_uint32(f"{a}.expert_shared_count", 1)
    w.add_uint32(f"{a}.leading_dense_block_count", b.dense_lead)
    _groups(w, a, b)
    _gating(w, a)


# DeepSeek MLA widths (ARCHITECTURES.md's verified fixture): q and kv low-rank, nope/rope/v heads.
_DS_MLA = (("q_rank", 64), ("kv_rank", 64), ("nope", 32), ("rope", 16), ("v", 32), ("groups", (4, 2)),
           ("gating", 2), ("n_shared", 1))


def _deepseek2_layer(b: _Builder, il: int) -> None:
    p, E, H, x = f"blk.{il}.", b.E, b.n_head, b.x
    q_rank, kv_rank, nope, rope, v = x["q_rank"], x["kv_rank"], x["nope"], x["rope"], x["v"]
    b.ones(p + "attn_norm.weight", E)
    if q_rank:
        b.ones(p + "attn_q_a_norm.weight", q_rank)
    b.ones(p + "attn_kv_a_norm.weight", kv_rank)
    if q_rank:
        b.mat(p + "attn_q_a.weight", (q_rank, E), E ** -0.5)
        b.mat(p + "attn_q_b.weight", (H * (nope + rope), q_rank), q_rank ** -0.5)
    else:  # the Lite models: no query compression
        b.mat(p + "attn_q.weight", (H * (nope + rope), E), E ** -0.5)
    b.mat(p + "attn_kv_a_mqa.weight", (kv_rank + rope, E), E ** -0.5)
    b.mat(p + "attn_k_b.weight", (H, kv_rank, nope), nope ** -0.5)
    b.mat(p + "attn_v_b.weight", (H, v, kv_rank), kv_rank ** -0.5)
    b.mat(p + "attn_output.weight", (E, H * v), (H * v) ** -0.5)
    b.ones(p + "ffn_norm.weight", E)
    _lead_or_moe_ffn(b, p, il, b.F * b.x["n_shared"])
    if _is_mtp(b, il):
        _nextn(b, p)


def _groups(w: GGUFWriter, a: str, b: _Builder) -> None:
    if b.x.get("groups"):
        w.add_uint32(f"{a}.expert_group_count", b.x["groups"][0])
        w.add_uint32(f"{a}.expert_group_used_count", b.x["groups"][1])


def _deepseek2_keys(w: GGUFWriter, b: _Builder, a: str = "deepseek2") -> None:
    x = b.x
    w.add_uint32(f"{a}.feed_forward_length", b.F_dense)
    # 0 for the Lite models (no query compression); written even then, since llama.cpp requires
    # it of every block count but 26 and 27 (a cut-down synth file has fewer layers).
    w.add_uint32(f"{a}.attention.q_lora_rank", x["q_rank"])
    w.add_uint32(f"{a}.attention.kv_lora_rank", x["kv_rank"])
    w.add_uint32(f"{a}.attention.key_length_mla", x["nope"] + x["rope"])
    w.add_uint32(f"{a}.attention.value_length_mla", x["v"])
    w.add_uint32(f"{a}.expert_shared_count", x["n_shared"])
    w.add_uint32(f"{a}.leading_dense_block_count", b.dense_lead)
    _groups(w, a, b)
    _gating(w, a, x["gating"])


def _deepseek2_overrides(b: _Builder) -> dict[str, Any]:
    # MLA: the KV cache holds the compressed latent; one KV head of kv_rank + rope widths.
    x = b.x
    return {"n_head_kv": 1, "key_length": x["kv_rank"] + x["rope"], "value_length": x["kv_rank"],
            "rope_dims": x["rope"]}


# --- minimax-m2, qwen3vlmoe, llama4 --------------------------------------------------------------


def _minimax_layer(b: _Builder, il: int) -> None:
    p, E = f"blk.{il}.", b.E
    _attn(b, p, norms=False)
    b.ones(p + "attn_norm.weight", E)
    b.ones(p + "attn_q_norm.weight", b.n_head * b.hd)  # full-width q/k norms
    b.ones(p + "attn_k_norm.weight", b.n_head_kv * b.hd)
    b.ones(p + "ffn_norm.weight", E)
    _router(b, p, probs_bias=True)
    b.experts(p)


def _minimax_keys(w: GGUFWriter, b: _Builder) -> None:
    w.add_uint32("minimax-m2.feed_forward_length", b.F)  # the experts' width on this arch
    w.add_uint32("minimax-m2.expert_gating_func", 2)


def _qwen3vl_layer(b: _Builder, il: int) -> None:
    p, E = f"blk.{il}.", b.E
    b.ones(p + "attn_norm.weight", E)
    _attn(b, p)
    b.ones(p + "ffn_norm.weight", E)
    _router(b, p)
    b.experts(p)


def _sections(rope_dims: int) -> list[int]:
    """M-RoPE sections over rope_dims/2 rotations, t/h/w as the real models split them."""
    half = rope_dims // 2
    t = half - 2 * (half * 5 // 16)
    return [t, half * 5 // 16, half * 5 // 16, 0]


def _qwen3vl_keys(w: GGUFWriter, b: _Builder) -> None:
    w.add_array("qwen3vlmoe.rope.dimension_sections", _sections(b.hd))


LLAMA4_STEP = 2  # Maverick's interleave: every second block is MoE, the others dense


def _llama4_layer(b: _Builder, il: int) -> None:
    p, E = f"blk.{il}.", b.E
    b.ones(p + "attn_norm.weight", E)
    _attn(b, p, norms=False)
    b.ones(p + "ffn_norm.weight", E)
    if (il + 1) % LLAMA4_STEP == 0:
        _router(b, p)
        b.experts(p)
        _shexp(b, p, b.F)
    else:
        _dense_ffn(b, p, b.F_dense)


def _llama4_keys(w: GGUFWriter, b: _Builder) -> None:
    w.add_uint32("llama4.feed_forward_length", b.F_dense)
    w.add_uint32("llama4.interleave_moe_layer_step", LLAMA4_STEP)


# --- hybrid recurrent: qwen35moe, qwen3next (gated delta net), lfm2moe (short conv) -------------

# Gated-delta-net widths: state S, key heads Kh, value heads Vh, conv kernel Kc; every
# ``full_attn``-th block full attention (2 here: the others linear), the rope over ``rope`` dims.
_GDN = (("gdn_s", 16), ("gdn_kh", 2), ("gdn_vh", 4), ("gdn_kc", 4), ("full_attn", 2), ("rope", 0))


def _qwen35_layer(b: _Builder, il: int, *, next_variant: bool = False) -> None:
    p, E, x = f"blk.{il}.", b.E, b.x
    S, Kh, Vh, Kc = x["gdn_s"], x["gdn_kh"], x["gdn_vh"], x["gdn_kc"]
    b.ones(p + "attn_norm.weight", E)
    b.ones(p + "post_attention_norm.weight", E)
    recurrent = not _is_mtp(b, il) and (il + 1) % x["full_attn"] != 0
    if not recurrent:
        _attn(b, p, q_mult=2)  # the query carries its output gate
    else:
        key_dim, value_dim = S * Kh, S * Vh
        conv_dim = 2 * key_dim + value_dim
        b.mat(p + "attn_qkv.weight", (conv_dim, E), E ** -0.5)
        b.mat(p + "attn_gate.weight", (value_dim, E), E ** -0.5)
        b.f32(p + "ssm_conv1d.weight", (conv_dim, Kc), Kc ** -0.5)
        b.f32(p + "ssm_dt.bias", (Vh,), SMALL_STD)
        b.const(p + "ssm_a", Vh, -1.0)  # -exp(A_log): a decaying state
        if next_variant:
            b.mat(p + "ssm_ba.weight", (2 * Vh, E), E ** -0.5)
        else:
            b.mat(p + "ssm_beta.weight", (Vh, E), E ** -0.5)
            b.mat(p + "ssm_alpha.weight", (Vh, E), E ** -0.5)
        b.ones(p + "ssm_norm.weight", S)
        b.mat(p + "ssm_out.weight", (E, value_dim), value_dim ** -0.5)
    _router(b, p)
    b.experts(p)
    b.f32(p + "ffn_gate_inp_shexp.weight", (E,), E ** -0.5)
    _shexp(b, p, b.F_shexp)
    if _is_mtp(b, il):
        _nextn(b, p)


def _qwen3next_layer(b: _Builder, il: int) -> None:
    _qwen35_layer(b, il, next_variant=True)


def _gdn_keys(w: GGUFWriter, b: _Builder, a: str) -> None:
    x = b.x
    w.add_uint32(f"{a}.ssm.conv_kernel", x["gdn_kc"])
    w.add_uint32(f"{a}.ssm.state_size", x["gdn_s"])
    w.add_uint32(f"{a}.ssm.group_count", x["gdn_kh"])
    w.add_uint32(f"{a}.ssm.time_step_rank", x["gdn_vh"])
    w.add_uint32(f"{a}.ssm.inner_size", x["gdn_s"] * x["gdn_vh"])
    w.add_uint32(f"{a}.full_attention_interval", x["full_attn"])
    w.add_uint32(f"{a}.expert_shared_feed_forward_length", b.F_shexp)


def _qwen35_keys(w: GGUFWriter, b: _Builder) -> None:
    _gdn_keys(w, b, "qwen35moe")
    sections = b.x.get("sections") or _sections(_partial_rope(b)["rope_dims"])
    w.add_array("qwen35moe.rope.dimension_sections", list(sections))


def _qwen3next_keys(w: GGUFWriter, b: _Builder) -> None:
    _gdn_keys(w, b, "qwen3next")


def _partial_rope(b: _Builder) -> dict[str, Any]:
    return {"rope_dims": b.x["rope"] or b.hd // 2}


SHORTCONV_L_CACHE = 3


def _lfm2_attention(b: _Builder, il: int) -> bool:
    return il == b.spec.n_layer - 1  # the last block attends, the others short-conv


def _lfm2_layer(b: _Builder, il: int) -> None:
    p, E = f"blk.{il}.", b.E
    b.ones(p + "ffn_norm.weight", E)
    _lead_or_moe_ffn(b, p, il, None)
    b.ones(p + "attn_norm.weight", E)
    if _lfm2_attention(b, il):
        b.ones(p + "attn_q_norm.weight", b.hd)
        b.ones(p + "attn_k_norm.weight", b.hd)
        b.mat(p + "attn_q.weight", (E, E), E ** -0.5)
        b.mat(p + "attn_k.weight", (b.n_head_kv * b.hd, E), E ** -0.5)
        b.mat(p + "attn_v.weight", (b.n_head_kv * b.hd, E), E ** -0.5)
        b.mat(p + "attn_output.weight", (E, E), E ** -0.5)
    else:
        b.f32(p + "shortconv.conv.weight", (E, SHORTCONV_L_CACHE), SHORTCONV_L_CACHE ** -0.5)
        b.mat(p + "shortconv.in_proj.weight", (3 * E, E), E ** -0.5)
        b.mat(p + "shortconv.out_proj.weight", (E, E), E ** -0.5)


def _lfm2_keys(w: GGUFWriter, b: _Builder) -> None:
    a = "lfm2moe"
    w.add_uint32(f"{a}.feed_forward_length", b.F_dense)
    w.add_uint32(f"{a}.shortconv.l_cache", SHORTCONV_L_CACHE)
    w.add_uint32(f"{a}.leading_dense_block_count", b.dense_lead)
    _gating(w, a)


def _lfm2_overrides(b: _Builder) -> dict[str, Any]:
    # Per-block KV heads: 0 marks a short-conv block.
    return {"n_head_kv": [b.n_head_kv if _lfm2_attention(b, il) else 0 for il in range(b.spec.n_layer)]}


# --- dots1, hunyuan-moe ----------------------------------------------------------------------------


def _dots1_layer(b: _Builder, il: int) -> None:
    p, E = f"blk.{il}.", b.E
    b.ones(p + "attn_norm.weight", E)
    _attn(b, p)  # k and v are as wide as q on this arch (head_count_kv = head_count)
    b.ones(p + "ffn_norm.weight", E)
    _lead_or_moe_ffn(b, p, il, b.F * b.x["n_shared"])


def _dots1_keys(w: GGUFWriter, b: _Builder) -> None:
    a = "dots1"
    w.add_uint32(f"{a}.feed_forward_length", b.F_dense)
    w.add_uint32(f"{a}.expert_shared_count", b.x["n_shared"])
    w.add_uint32(f"{a}.leading_dense_block_count", b.dense_lead)
    _gating(w, a, 1)


def _full_kv_heads(b: _Builder) -> dict[str, Any]:
    return {"n_head_kv": b.n_head}


def _hunyuan_layer(b: _Builder, il: int) -> None:
    p, E = f"blk.{il}.", b.E
    b.ones(p + "attn_norm.weight", E)
    _attn(b, p)
    b.ones(p + "ffn_norm.weight", E)
    _router(b, p)
    b.experts(p)
    _shexp(b, p, b.F_shexp)


def _hunyuan_keys(w: GGUFWriter, b: _Builder) -> None:
    w.add_uint32("hunyuan-moe.feed_forward_length", b.F)  # the experts' width on this arch
    w.add_uint32("hunyuan-moe.expert_shared_feed_forward_length", b.F_shexp)


# --- ernie4_5-moe ---------------------------------------------------------------------------------


def _ernie_layer(b: _Builder, il: int) -> None:
    p, E = f"blk.{il}.", b.E
    b.ones(p + "attn_norm.weight", E)
    _attn(b, p, norms=False)
    b.ones(p + "ffn_norm.weight", E)
    _lead_or_moe_ffn(b, p, il, b.F_shexp)


def _ernie_keys(w: GGUFWriter, b: _Builder) -> None:
    a = "ernie4_5-moe"
    w.add_uint32(f"{a}.feed_forward_length", b.F_dense)
    w.add_uint32(f"{a}.expert_shared_feed_forward_length", b.F_shexp)
    w.add_uint32(f"{a}.interleave_moe_layer_step", 1)  # what the published models use
    w.add_uint32(f"{a}.leading_dense_block_count", b.dense_lead)


# --- olmoe, llama (Mixtral) -------------------------------------------------------------------------


def _olmoe_layer(b: _Builder, il: int) -> None:
    p, E = f"blk.{il}.", b.E
    b.ones(p + "attn_norm.weight", E)
    _attn(b, p, norms=False)
    b.ones(p + "attn_q_norm.weight", E)  # full-width q/k norms (k as wide as q on this arch)
    b.ones(p + "attn_k_norm.weight", E)
    b.ones(p + "ffn_norm.weight", E)
    _router(b, p)
    b.experts(p)


def _mixtral_layer(b: _Builder, il: int) -> None:
    p, E = f"blk.{il}.", b.E
    b.ones(p + "attn_norm.weight", E)
    _attn(b, p, norms=False)
    b.ones(p + "ffn_norm.weight", E)
    _router(b, p)
    b.experts(p)


def _ffn_width_keys(arch: str) -> Callable[[GGUFWriter, _Builder], None]:
    def keys(w: GGUFWriter, b: _Builder) -> None:
        w.add_uint32(f"{arch}.feed_forward_length", b.F)  # the experts' width on these archs

    return keys


# --- granitemoe, bailingmoe, deepseek, smallthinker, phimoe: the plain MoE block, other trimmings ---


GRANITE_SCALES = (("embedding_scale", 2.0), ("residual_scale", 0.5), ("attention_scale", 0.125), ("logit_scale", 2.0))


def _granite_layer(b: _Builder, il: int) -> None:
    p, E = f"blk.{il}.", b.E
    b.ones(p + "attn_norm.weight", E)
    _attn(b, p, norms=False)
    b.ones(p + "ffn_norm.weight", E)
    _router(b, p)
    b.experts(p)
    _shexp(b, p, b.F_shexp)  # Granite MoE Shared: sized by expert_shared_feed_forward_length


def _granite_keys(w: GGUFWriter, b: _Builder) -> None:
    a = "granitemoe"
    w.add_uint32(f"{a}.feed_forward_length", b.F)  # the experts' width on this arch
    w.add_uint32(f"{a}.expert_shared_feed_forward_length", b.F_shexp)
    for key, value in GRANITE_SCALES:
        w.add_float32(f"{a}.{key}", value)


def _bailingmoe_layer(b: _Builder, il: int) -> None:
    p, E = f"blk.{il}.", b.E
    b.ones(p + "attn_norm.weight", E)
    _attn(b, p, norms=False)  # q/k/v are head_count x rope dimensions wide (rope = head here)
    b.ones(p + "ffn_norm.weight", E)
    _router(b, p)
    b.experts(p)
    _shexp(b, p, b.F * b.x["n_shared"])


def _bailingmoe_keys(w: GGUFWriter, b: _Builder) -> None:
    a = "bailingmoe"
    w.add_uint32(f"{a}.expert_shared_count", b.x["n_shared"])
    w.add_bool(f"{a}.expert_weights_norm", True)
    w.add_float32(f"{a}.expert_weights_scale", 1.0)


def _deepseek_layer(b: _Builder, il: int) -> None:
    p, E = f"blk.{il}.", b.E
    b.ones(p + "attn_norm.weight", E)
    _attn(b, p, norms=False)
    b.ones(p + "ffn_norm.weight", E)
    _lead_or_moe_ffn(b, p, il, b.F * b.x["n_shared"], probs_bias=False)


def _deepseek_keys(w: GGUFWriter, b: _Builder, a: str = "deepseek") -> None:
    w.add_uint32(f"{a}.feed_forward_length", b.F_dense)
    w.add_uint32(f"{a}.expert_shared_count", b.x["n_shared"])
    w.add_uint32(f"{a}.leading_dense_block_count", b.dense_lead)
    w.add_float32(f"{a}.expert_weights_scale", 1.0)


def _smallthinker_layer(b: _Builder, il: int) -> None:
    p, E = f"blk.{il}.", b.E
    b.ones(p + "attn_norm.weight", E)
    _attn(b, p, norms=False)
    b.ones(p + "ffn_norm.weight", E)
    _router(b, p)  # applied to the block's input, before attention (probs_in)
    b.experts(p)


def _smallthinker_keys(w: GGUFWriter, b: _Builder) -> None:
    w.add_uint32("smallthinker.expert_gating_func", 1)  # softmax; absent, llama.cpp aborts


def _phimoe_layer(b: _Builder, il: int) -> None:
    p, E = f"blk.{il}.", b.E
    b.ones(p + "attn_norm.weight", E)
    b.f32(p + "attn_norm.bias", (E,), SMALL_STD)  # LayerNorm with biases
    _attn(b, p, norms=False)
    b.f32(p + "attn_output.bias", (E,), SMALL_STD)
    b.ones(p + "ffn_norm.weight", E)
    b.f32(p + "ffn_norm.bias", (E,), SMALL_STD)
    _router(b, p)
    b.experts(p)


def _phimoe_globals(b: _Builder, n_vocab: int) -> None:
    b.f32("output_norm.bias", (b.E,), SMALL_STD)
    b.f32("output.bias", (n_vocab,), 0.0)  # zero: the control tokens' rows stay at logit 0


# --- minicpm, mistral3, dbrx, grok, afmoe ------------------------------------------------------------


def _plain_moe_layer(b: _Builder, il: int) -> None:
    """attn norm, q/k/v/o, ffn norm, router and experts: minicpm's and mistral3's MoE block."""
    p, E = f"blk.{il}.", b.E
    b.ones(p + "attn_norm.weight", E)
    _attn(b, p, norms=False)
    b.ones(p + "ffn_norm.weight", E)
    _router(b, p)
    b.experts(p)


def _minicpm_keys(w: GGUFWriter, b: _Builder) -> None:
    a = "minicpm"
    w.add_uint32(f"{a}.feed_forward_length", b.F)  # the experts' width on this arch
    # Written, not left to the loader's defaults (embeddings x12 would swamp a random model).
    for key, value in (("embedding_scale", 1.0), ("residual_scale", 0.5), ("logit_scale", 1.0)):
        w.add_float32(f"{a}.{key}", value)


def _dbrx_layer(b: _Builder, il: int) -> None:
    p, E = f"blk.{il}.", b.E
    b.ones(p + "attn_norm.weight", E)
    b.mat(p + "attn_qkv.weight", (E + 2 * b.n_head_kv * b.hd, E), E ** -0.5)  # fused q/k/v
    b.mat(p + "attn_output.weight", (E, E), E ** -0.5)
    b.ones(p + "attn_output_norm.weight", E)
    _router(b, p)
    b.experts(p)


def _dbrx_keys(w: GGUFWriter, b: _Builder) -> None:
    a = "dbrx"
    w.add_uint32(f"{a}.feed_forward_length", b.F)  # the experts' width on this arch
    w.add_float32(f"{a}.attention.layer_norm_epsilon", 1e-5)
    w.add_float32(f"{a}.attention.clamp_kqv", 8.0)


def _grok_layer(b: _Builder, il: int) -> None:
    p, E = f"blk.{il}.", b.E
    b.ones(p + "attn_norm.weight", E)
    _attn(b, p, norms=False)
    b.ones(p + "attn_output_norm.weight", E)
    b.ones(p + "ffn_norm.weight", E)
    _router(b, p)
    b.experts(p)
    b.ones(p + "layer_output_norm.weight", E)


def _grok_keys(w: GGUFWriter, b: _Builder) -> None:
    a = "grok"
    # Grok-1's own values are written where they suit a tiny random model; its defaults
    # (embeddings x78) would not.
    for key, value in (("embedding_scale", 1.0), ("logit_scale", 1.0), ("attention.output_scale", 1.0),
                       ("attn_logit_softcapping", 30.0), ("router_logit_softcapping", 30.0)):
        w.add_float32(f"{a}.{key}", value)


def _afmoe_layer(b: _Builder, il: int) -> None:
    p, E = f"blk.{il}.", b.E
    b.ones(p + "attn_norm.weight", E)
    b.ones(p + "post_attention_norm.weight", E)
    _attn(b, p)
    b.mat(p + "attn_gate.weight", (b.n_head * b.hd, E), E ** -0.5)  # gated attention output
    b.ones(p + "ffn_norm.weight", E)
    b.ones(p + "post_ffw_norm.weight", E)
    _lead_or_moe_ffn(b, p, il, b.F * b.x["n_shared"])  # selection bias required here


def _afmoe_keys(w: GGUFWriter, b: _Builder) -> None:
    a = "afmoe"
    w.add_uint32(f"{a}.feed_forward_length", b.F_dense)
    w.add_uint32(f"{a}.expert_shared_count", b.x["n_shared"])
    w.add_uint32(f"{a}.leading_dense_block_count", b.dense_lead)
    # Its graph always builds the sliding-window attention input: without a window, a segfault.
    w.add_uint32(f"{a}.attention.sliding_window", b.x["sliding_window"])
    _gating(w, a)


# --- mellum, arctic, mistral4 ---------------------------------------------------------------------------


def _mellum_layer(b: _Builder, il: int) -> None:
    p, E = f"blk.{il}.", b.E
    b.ones(p + "attn_norm.weight", E)
    _attn(b, p)
    b.ones(p + "ffn_norm.weight", E)
    _router(b, p)
    b.experts(p)


def _mellum_keys(w: GGUFWriter, b: _Builder) -> None:
    w.add_uint32("mellum.attention.sliding_window", b.x["sliding_window"])  # every 4th block full


def _arctic_layer(b: _Builder, il: int) -> None:
    p, E = f"blk.{il}.", b.E
    b.ones(p + "attn_norm.weight", E)
    _attn(b, p, norms=False)
    b.ones(p + "ffn_norm.weight", E)
    _dense_ffn(b, p, E)  # the residual MLP beside the experts is n_embd wide
    _router(b, p)
    b.ones(p + "ffn_norm_exps.weight", E)
    b.experts(p)


def _mistral4_keys(w: GGUFWriter, b: _Builder) -> None:
    _deepseek2_keys(w, b, "mistral4")


# DeepSeek V3.2's sparse-attention indexer: heads, head width, top-k tokens (beyond a tiny context).
_DSA = (("ix_heads", 2), ("ix_head", 64), ("ix_top_k", 64))  # the head: a multiple of 64 (its Hadamard rotation)


def _deepseek32_layer(b: _Builder, il: int) -> None:
    _deepseek2_layer(b, il)
    p, E, x = f"blk.{il}.", b.E, b.x
    ih, ihd = x["ix_heads"], x["ix_head"]
    b.ones(p + "indexer.k_norm.weight", ihd)
    b.f32(p + "indexer.k_norm.bias", (ihd,), SMALL_STD)
    b.mat(p + "indexer.proj.weight", (ih, E), E ** -0.5)
    b.mat(p + "indexer.attn_k.weight", (ihd, E), E ** -0.5)
    b.mat(p + "indexer.attn_q_b.weight", (ih * ihd, x["q_rank"]), x["q_rank"] ** -0.5)


def _deepseek32_keys(w: GGUFWriter, b: _Builder, a: str = "deepseek32") -> None:
    x = b.x
    _deepseek2_keys(w, b, a)
    w.add_uint32(f"{a}.attention.indexer.head_count", x["ix_heads"])
    w.add_uint32(f"{a}.attention.indexer.key_length", x["ix_head"])
    w.add_uint32(f"{a}.attention.indexer.top_k", x["ix_top_k"])


# --- bailingmoe3 (Ling 3): KDA linear attention + gated MLA, leading dense blocks ---------------------

# KDA head width, conv kernel, the gate's lower bound; MLA widths as deepseek2's (no query rank).
_LING3 = (("kda_head", 64), ("kda_conv", 4), ("gate_bound", -5.0), ("kv_rank", 64), ("nope", 32), ("rope", 16),
          ("v", 32), ("n_shared", 1), ("groups", (2, 1)))


def _ling3_attends(b: _Builder, il: int) -> bool:
    return il == b.spec.n_layer - 1 or _is_mtp(b, il)  # the last main block (and MTP) MLA, the rest KDA


def _ling3_layer(b: _Builder, il: int, *, kimi: bool = False) -> None:
    p, E, H, x = f"blk.{il}.", b.E, b.n_head, b.x
    b.ones(p + "attn_norm.weight", E)
    if not _ling3_attends(b, il) and kimi:  # Kimi-Linear: low-rank forget and output gates
        hd, kc = x["kda_head"], x["kda_conv"]
        inner = H * hd
        for part in ("q", "k", "v"):
            b.f32(p + f"ssm_conv1d_{part}.weight", (1, inner, 1, kc), kc ** -0.5)
            b.mat(p + f"attn_{part}.weight", (inner, E), E ** -0.5)
        b.mat(p + "ssm_f_a.weight", (hd, E), E ** -0.5)
        b.mat(p + "ssm_f_b.weight", (inner, hd), hd ** -0.5)
        b.mat(p + "ssm_beta.weight", (H, E), E ** -0.5)
        b.f32(p + "ssm_a", (H, 1), 1.0)
        b.f32(p + "ssm_dt.bias", (inner,), SMALL_STD)
        b.mat(p + "ssm_g_a.weight", (hd, E), E ** -0.5)
        b.mat(p + "ssm_g_b.weight", (inner, hd), hd ** -0.5)
        b.ones(p + "ssm_norm.weight", hd)
        b.mat(p + "attn_output.weight", (E, inner), inner ** -0.5)
    elif not _ling3_attends(b, il):
        hd, kc = x["kda_head"], x["kda_conv"]
        inner = H * hd
        for part in ("q", "k", "v"):
            b.f32(p + f"ssm_conv1d_{part}.weight", (1, inner, 1, kc), kc ** -0.5)
            b.mat(p + f"attn_{part}.weight", (inner, E), E ** -0.5)
        b.mat(p + "ssm_f_a.weight", (inner, E), E ** -0.5)
        b.mat(p + "ssm_beta.weight", (H, E), E ** -0.5)
        b.f32(p + "ssm_a", (H, 1), 1.0)
        b.f32(p + "ssm_dt.bias", (inner,), SMALL_STD)
        b.mat(p + "ssm_g_a.weight", (inner, E), E ** -0.5)
        b.ones(p + "ssm_norm.weight", hd)
        b.mat(p + "attn_output.weight", (E, inner), inner ** -0.5)
    else:
        kv_rank, nope, rope, v = x["kv_rank"], x["nope"], x["rope"], x["v"]
        b.mat(p + "attn_q.weight", (H * (nope + rope), E), E ** -0.5)
        b.mat(p + "attn_kv_a_mqa.weight", (kv_rank + rope, E), E ** -0.5)
        b.ones(p + "attn_kv_a_norm.weight", kv_rank)
        b.mat(p + "attn_k_b.weight", (H, kv_rank, nope), nope ** -0.5)
        b.mat(p + "attn_v_b.weight", (H, v, kv_rank), kv_rank ** -0.5)
        if not kimi:
            b.mat(p + "attn_gate.weight", (H, E), E ** -0.5)
        b.mat(p + "attn_output.weight", (E, H * v), (H * v) ** -0.5)
    b.ones(p + "ffn_norm.weight", E)
    _lead_or_moe_ffn(b, p, il, b.F * x["n_shared"])
    if _is_mtp(b, il):
        _nextn(b, p)
        b.ones(p + "layer_output_norm.weight", E)


def _ling3_keys(w: GGUFWriter, b: _Builder) -> None:
    a, x = "bailingmoe3", b.x
    w.add_uint32(f"{a}.feed_forward_length", b.F_dense)
    w.add_uint32(f"{a}.attention.kv_lora_rank", x["kv_rank"])
    w.add_uint32(f"{a}.attention.key_length_mla", x["nope"] + x["rope"])
    w.add_uint32(f"{a}.attention.value_length_mla", x["v"])
    w.add_uint32(f"{a}.ssm.conv_kernel", x["kda_conv"])
    w.add_uint32(f"{a}.kda.head_dim", x["kda_head"])
    w.add_bool(f"{a}.kda.safe_gate", True)
    w.add_float32(f"{a}.kda.gate_lower_bound", x["gate_bound"])
    w.add_uint32(f"{a}.expert_shared_count", x["n_shared"])
    w.add_uint32(f"{a}.leading_dense_block_count", b.dense_lead)
    _groups(w, a, b)
    _gating(w, a)


def _kimi_linear_layer(b: _Builder, il: int) -> None:
    _ling3_layer(b, il, kimi=True)


def _kimi_linear_keys(w: GGUFWriter, b: _Builder) -> None:
    a, x = "kimi-linear", b.x
    w.add_uint32(f"{a}.feed_forward_length", b.F_dense)
    w.add_uint32(f"{a}.attention.kv_lora_rank", x["kv_rank"])
    w.add_uint32(f"{a}.attention.key_length_mla", x["nope"] + x["rope"])
    w.add_uint32(f"{a}.attention.value_length_mla", x["v"])
    w.add_uint32(f"{a}.ssm.conv_kernel", x["kda_conv"])
    w.add_uint32(f"{a}.kda.head_dim", x["kda_head"])
    w.add_uint32(f"{a}.expert_shared_count", x["n_shared"])
    w.add_uint32(f"{a}.leading_dense_block_count", b.dense_lead)
    _gating(w, a)


def _ling3_overrides(b: _Builder) -> dict[str, Any]:
    # MLA blocks keep one KV head of kv_rank + rope; KDA blocks none (0 marks a recurrent block).
    x = b.x
    heads = [1 if _ling3_attends(b, il) else 0 for il in range(b.spec.n_layer + b.spec.n_nextn)]
    return {"n_head_kv": heads, "key_length": x["kv_rank"] + x["rope"], "value_length": x["kv_rank"],
            "rope_dims": x["rope"]}


# --- cohere2moe: parallel attention and FFN off one norm, interleaved sliding windows ---------------


def _cohere2moe_layer(b: _Builder, il: int) -> None:
    p, E = f"blk.{il}.", b.E
    b.ones(p + "attn_norm.weight", E)  # the only norm: attention and FFN read the same input
    _attn(b, p, norms=False)
    _lead_or_moe_ffn(b, p, il, b.F * b.x["n_shared"], probs_bias=False)


def _cohere2moe_keys(w: GGUFWriter, b: _Builder) -> None:
    a = "cohere2moe"
    w.add_uint32(f"{a}.feed_forward_length", b.F_dense)
    w.add_uint32(f"{a}.attention.sliding_window", b.x["sliding_window"])
    w.add_float32(f"{a}.logit_scale", 1.0)
    w.add_uint32(f"{a}.leading_dense_block_count", b.dense_lead)
    w.add_uint32(f"{a}.expert_shared_count", b.x["n_shared"])
    _gating(w, a)


# --- maple: sliding windows by a per-block pattern, clamped SwiGLU experts ----------------------------


def _maple_keys(w: GGUFWriter, b: _Builder) -> None:
    a, n = "maple", b.spec.n_layer
    w.add_uint32(f"{a}.attention.sliding_window", b.x["sliding_window"])
    w.add_array(f"{a}.attention.sliding_window_pattern", [il % 2 == 0 and il != n - 1 for il in range(n)])
    w.add_float32(f"{a}.swiglu_clamp_exp", 7.0)


# --- exaone-moe (K-EXAONE): sliding windows, q/k norms, leading dense blocks, a shared expert -------


def _exaone_layer(b: _Builder, il: int) -> None:
    p, E = f"blk.{il}.", b.E
    _attn(b, p)
    b.ones(p + "attn_norm.weight", E)
    b.ones(p + "ffn_norm.weight", E)
    _lead_or_moe_ffn(b, p, il, b.F_shexp)


def _exaone_keys(w: GGUFWriter, b: _Builder) -> None:
    a = "exaone-moe"
    w.add_uint32(f"{a}.feed_forward_length", b.F_dense)
    w.add_uint32(f"{a}.attention.sliding_window", b.x["sliding_window"])
    w.add_uint32(f"{a}.expert_shared_count", 1)
    w.add_uint32(f"{a}.expert_shared_feed_forward_length", b.F_shexp)
    w.add_uint32(f"{a}.leading_dense_block_count", b.dense_lead)
    _gating(w, a)


# --- laguna: a per-head attention output gate, leading dense blocks, one shared expert -----------


def _laguna_layer(b: _Builder, il: int) -> None:
    p, E = f"blk.{il}.", b.E
    b.ones(p + "attn_norm.weight", E)
    _attn(b, p)
    b.mat(p + "attn_gate.weight", (b.n_head, E), E ** -0.5)  # one gate per head
    b.ones(p + "ffn_norm.weight", E)
    _lead_or_moe_ffn(b, p, il, b.F_shexp)  # selection bias required here


def _laguna_keys(w: GGUFWriter, b: _Builder) -> None:
    a = "laguna"
    w.add_uint32(f"{a}.feed_forward_length", b.F_dense)
    w.add_uint32(f"{a}.leading_dense_block_count", b.dense_lead)
    w.add_uint32(f"{a}.expert_shared_feed_forward_length", b.F_shexp)
    _gating(w, a)


# --- granite_swa (Granite 4 with sliding windows): sinks, a fused-up shared expert ------------------


def _granite_swa_layer(b: _Builder, il: int) -> None:
    p, E = f"blk.{il}.", b.E
    b.ones(p + "attn_norm.weight", E)
    _attn(b, p, norms=False)
    b.f32(p + "attn_sinks.weight", (b.n_head,), SMALL_STD)  # F32: the softmax kernel asserts it
    b.ones(p + "ffn_norm.weight", E)
    _router(b, p)
    b.experts(p)
    b.mat(p + "ffn_up_shexp.weight", (2 * b.F_shexp, E), E ** -0.5)  # gate and up in one
    b.mat(p + "ffn_down_shexp.weight", (E, b.F_shexp), b.F_shexp ** -0.5)


def _granite_swa_keys(w: GGUFWriter, b: _Builder) -> None:
    a, n = "granite_swa", b.spec.n_layer
    w.add_uint32(f"{a}.feed_forward_length", b.F)  # the experts' width on this arch
    w.add_uint32(f"{a}.expert_shared_feed_forward_length", b.F_shexp)
    for key, value in GRANITE_SCALES:
        w.add_float32(f"{a}.{key}", value)
    w.add_uint32(f"{a}.attention.sliding_window", b.x["sliding_window"])
    w.add_array(f"{a}.attention.sliding_window_pattern", [il % 2 == 0 and il != n - 1 for il in range(n)])


# --- mimo2 (MiMo-V2-Flash): every tensor optional, dense or MoE by what a block holds; sinks --------


def _mimo2_layer(b: _Builder, il: int) -> None:
    p, E = f"blk.{il}.", b.E
    _attn(b, p, norms=False)
    b.ones(p + "attn_norm.weight", E)
    b.f32(p + "attn_sinks.weight", (b.n_head,), SMALL_STD)
    b.ones(p + "ffn_norm.weight", E)
    _lead_or_moe_ffn(b, p, il, None)  # a block with a router is MoE, the first dense


def _mimo2_keys(w: GGUFWriter, b: _Builder) -> None:
    a, n = "mimo2", b.spec.n_layer
    w.add_uint32(f"{a}.feed_forward_length", b.F_dense)
    w.add_uint32(f"{a}.attention.sliding_window", b.x["sliding_window"])
    w.add_array(f"{a}.attention.sliding_window_pattern", [il % 2 == 0 and il != n - 1 for il in range(n)])


# --- step35 (Step-3.5-Flash): mimo2's optional-tensor scheme with q/k norms, a per-head gate, shexp ---


def _step35_layer(b: _Builder, il: int) -> None:
    p, E = f"blk.{il}.", b.E
    b.ones(p + "attn_norm.weight", E)
    _attn(b, p)
    b.mat(p + "attn_gate.weight", (b.n_head, E), E ** -0.5)
    b.ones(p + "ffn_norm.weight", E)
    _lead_or_moe_ffn(b, p, il, b.F_shexp)


def _step35_keys(w: GGUFWriter, b: _Builder) -> None:
    a, n = "step35", b.spec.n_layer
    w.add_uint32(f"{a}.feed_forward_length", b.F_dense)
    w.add_uint32(f"{a}.expert_shared_feed_forward_length", b.F_shexp)
    w.add_uint32(f"{a}.attention.sliding_window", b.x["sliding_window"])
    w.add_array(f"{a}.attention.sliding_window_pattern", [il % 2 == 0 and il != n - 1 for il in range(n)])
    _gating(w, a)


# --- hy_v3 (Hunyuan next): optional tensors, a selection bias named without .bias, shared expert ------


def _hy_v3_layer(b: _Builder, il: int) -> None:
    p, E = f"blk.{il}.", b.E
    b.ones(p + "attn_norm.weight", E)
    _attn(b, p)
    b.ones(p + "ffn_norm.weight", E)
    if il < b.dense_lead:
        _dense_ffn(b, p, b.F_dense)
        return
    _router(b, p)
    b.f32(p + "exp_probs_b", (b.spec.n_expert,), SMALL_STD)  # this loader's name has no .bias
    b.experts(p)
    _shexp(b, p, b.F_shexp)


def _hy_v3_keys(w: GGUFWriter, b: _Builder) -> None:
    a = "hy_v3"
    w.add_uint32(f"{a}.feed_forward_length", b.F_dense)
    w.add_uint32(f"{a}.expert_shared_feed_forward_length", b.F_shexp)
    _gating(w, a)


# --- jamba: mamba blocks (0 KV heads) and attention blocks, MoE every other block -------------------

_JAMBA = (("d_state", 16), ("dt_rank", 16), ("d_conv", 4), ("moe_every", 2))


def _jamba_attends(b: _Builder, il: int) -> bool:
    return il == b.spec.n_layer - 1  # the last block attends, the others are mamba


def _jamba_layer(b: _Builder, il: int) -> None:
    p, E, x = f"blk.{il}.", b.E, b.x
    inner, S, R, K = 2 * E, x["d_state"], x["dt_rank"], x["d_conv"]
    b.ones(p + "attn_norm.weight", E)
    if _jamba_attends(b, il):
        _attn(b, p, norms=False)
    else:
        b.mat(p + "ssm_in.weight", (2 * inner, E), E ** -0.5)
        b.f32(p + "ssm_conv1d.weight", (inner, K), K ** -0.5)
        b.f32(p + "ssm_conv1d.bias", (inner,), SMALL_STD)
        b.mat(p + "ssm_x.weight", (R + 2 * S, inner), inner ** -0.5)
        b.ones(p + "ssm_dt_norm.weight", R)
        b.mat(p + "ssm_dt.weight", (inner, R), R ** -0.5)
        b.f32(p + "ssm_dt.bias", (inner,), SMALL_STD)
        b.ones(p + "ssm_b_norm.weight", S)
        b.ones(p + "ssm_c_norm.weight", S)
        b.const(p + "ssm_a", (inner, S), -1.0)  # -exp(A_log): a decaying state
        b.ones(p + "ssm_d", inner)
        b.mat(p + "ssm_out.weight", (E, inner), inner ** -0.5)
    b.ones(p + "ffn_norm.weight", E)
    if (il + 1) % x["moe_every"] == 0:
        _router(b, p)
        b.experts(p)
    else:
        _dense_ffn(b, p, b.F)  # dense blocks share the experts' width (feed_forward_length)


def _jamba_keys(w: GGUFWriter, b: _Builder) -> None:
    a, x = "jamba", b.x
    w.add_uint32(f"{a}.feed_forward_length", b.F)
    w.add_uint32(f"{a}.ssm.conv_kernel", x["d_conv"])
    w.add_uint32(f"{a}.ssm.inner_size", 2 * b.E)
    w.add_uint32(f"{a}.ssm.state_size", x["d_state"])
    w.add_uint32(f"{a}.ssm.time_step_rank", x["dt_rank"])


def _jamba_overrides(b: _Builder) -> dict[str, Any]:
    return {"n_head_kv": [b.n_head_kv if _jamba_attends(b, il) else 0 for il in range(b.spec.n_layer)]}


# --- granitehybrid (Granite 4.0-H): mamba2 blocks and attention blocks, every block MoE -------------

_MAMBA2 = (("d_state", 16), ("ssm_heads", 8), ("ssm_groups", 1), ("d_conv", 4))


def _granitehybrid_layer(b: _Builder, il: int) -> None:
    p, E, x = f"blk.{il}.", b.E, b.x
    inner, S, H, G, K = 2 * E, x["d_state"], x["ssm_heads"], x["ssm_groups"], x["d_conv"]
    b.ones(p + "attn_norm.weight", E)
    if _jamba_attends(b, il):
        _attn(b, p, norms=False)
    else:
        b.mat(p + "ssm_in.weight", (2 * inner + 2 * G * S + H, E), E ** -0.5)
        b.f32(p + "ssm_conv1d.weight", (inner + 2 * G * S, K), K ** -0.5)
        b.f32(p + "ssm_conv1d.bias", (inner + 2 * G * S,), SMALL_STD)
        b.f32(p + "ssm_dt.bias", (H,), SMALL_STD)
        b.const(p + "ssm_a", (H, 1), -1.0)
        b.const(p + "ssm_d", (H, 1), 1.0)
        b.const(p + "ssm_norm.weight", (G, inner // G), 1.0)
        b.mat(p + "ssm_out.weight", (E, inner), inner ** -0.5)
    b.ones(p + "ffn_norm.weight", E)
    _router(b, p)
    b.experts(p)
    _shexp(b, p, b.F_shexp)


def _granitehybrid_keys(w: GGUFWriter, b: _Builder) -> None:
    a, x = "granitehybrid", b.x
    w.add_uint32(f"{a}.feed_forward_length", b.F)  # the experts' width on this arch
    w.add_uint32(f"{a}.expert_shared_feed_forward_length", b.F_shexp)
    for key, value in GRANITE_SCALES:
        w.add_float32(f"{a}.{key}", value)
    w.add_uint32(f"{a}.ssm.conv_kernel", x["d_conv"])
    w.add_uint32(f"{a}.ssm.inner_size", 2 * b.E)
    w.add_uint32(f"{a}.ssm.state_size", x["d_state"])
    w.add_uint32(f"{a}.ssm.time_step_rank", x["ssm_heads"])
    w.add_uint32(f"{a}.ssm.group_count", x["ssm_groups"])


FAMILIES: dict[str, Family] = {
    f.arch: f
    for f in (
        Family("gpt-oss", _gpt_oss_layer, _gpt_oss_keys, min_layers=2, extra=(("sliding_window", 128),)),
        Family("glm4moe", _glm4moe_layer, _glm4moe_keys, min_layers=2, mtp=True, extra=(("n_shared", 1),)),
        Family("bailingmoe2", _bailing_layer, _bailing_keys, min_layers=2, mtp=True, extra=(("groups", (2, 1)),)),
        Family("deepseek2", _deepseek2_layer, _deepseek2_keys, min_layers=2, default_layers=3,
               overrides=_deepseek2_overrides, fuses_gate_up=True, mtp=True, extra=_DS_MLA),
        Family("minimax-m2", _minimax_layer, _minimax_keys),
        Family("qwen3vlmoe", _qwen3vl_layer, _qwen3vl_keys),
        Family("llama4", _llama4_layer, _llama4_keys, min_layers=4, default_layers=4),
        Family("qwen35moe", _qwen35_layer, _qwen35_keys, min_layers=2, overrides=_partial_rope,
               fuses_gate_up=True, mtp=True, extra=_GDN),
        Family("qwen3next", _qwen3next_layer, _qwen3next_keys, min_layers=2, overrides=_partial_rope,
               fuses_gate_up=True, mtp=True, extra=_GDN),
        Family("dots1", _dots1_layer, _dots1_keys, min_layers=2, overrides=_full_kv_heads, extra=(("n_shared", 2),)),
        Family("hunyuan-moe", _hunyuan_layer, _hunyuan_keys),
        Family("ernie4_5-moe", _ernie_layer, _ernie_keys, min_layers=2, gate_optional=True),
        Family("olmoe", _olmoe_layer, _ffn_width_keys("olmoe"), overrides=_full_kv_heads),
        Family("llama", _mixtral_layer, _ffn_width_keys("llama"), gate_optional=True),
        Family("lfm2moe", _lfm2_layer, _lfm2_keys, min_layers=3, default_layers=3,
               overrides=_lfm2_overrides, output_norm="token_embd_norm.weight"),
        Family("granitemoe", _granite_layer, _granite_keys, gate_optional=True),
        Family("bailingmoe", _bailingmoe_layer, _bailingmoe_keys, extra=(("n_shared", 2),)),
        Family("deepseek", _deepseek_layer, _deepseek_keys, min_layers=2, default_layers=3,
               extra=(("n_shared", 2),)),
        Family("smallthinker", _smallthinker_layer, _smallthinker_keys),
        Family("phimoe", _phimoe_layer, _ffn_width_keys("phimoe"), globals_=_phimoe_globals),
        Family("minicpm", _plain_moe_layer, _minicpm_keys, gate_optional=True),
        Family("mistral3", _plain_moe_layer, _ffn_width_keys("mistral3"), gate_optional=True),
        Family("dbrx", _dbrx_layer, _dbrx_keys),
        Family("grok", _grok_layer, _grok_keys, gate_optional=True),
        Family("mellum", _mellum_layer, _mellum_keys, min_layers=2, default_layers=4,
               extra=(("sliding_window", 128),)),
        Family("arctic", _arctic_layer, _ffn_width_keys("arctic")),
        # deepseek2's loader and graph under another name (Mistral's MLA MoE).
        Family("mistral4", _deepseek2_layer, _mistral4_keys, min_layers=2, default_layers=3,
               overrides=_deepseek2_overrides, fuses_gate_up=True, extra=_DS_MLA),
        Family("bailingmoe3", _ling3_layer, _ling3_keys, min_layers=2, default_layers=3, overrides=_ling3_overrides,
               mtp=True, extra=_LING3),
        Family("kimi-linear", _kimi_linear_layer, _kimi_linear_keys, min_layers=2, default_layers=3,
               overrides=_ling3_overrides, extra=_LING3),
        Family("cohere2moe", _cohere2moe_layer, _cohere2moe_keys, min_layers=2, default_layers=4,
               fuses_gate_up=True, extra=(("n_shared", 1), ("sliding_window", 128))),
        Family("maple", _mellum_layer, _maple_keys, min_layers=2, extra=(("sliding_window", 128),)),
        Family("deepseek32", _deepseek32_layer, _deepseek32_keys, min_layers=2, default_layers=3,
               overrides=_deepseek2_overrides, mtp=True, extra=_DS_MLA + _DSA),
        # GLM-5 (GlmMoeDsa): deepseek32's tensors under another name.
        Family("glm-dsa", _deepseek32_layer, lambda w, b: _deepseek32_keys(w, b, "glm-dsa"), min_layers=2,
               default_layers=3, overrides=_deepseek2_overrides, mtp=True, extra=_DS_MLA + _DSA),
        # DeepSeek-OCR's language model: deepseek's MHA block (k and v as wide as q), dense lead,
        # shared experts, fused or split gate/up.
        Family("deepseek2-ocr", _deepseek_layer, lambda w, b: _deepseek_keys(w, b, "deepseek2-ocr"), min_layers=2,
               default_layers=3, overrides=lambda b: {"n_head_kv": b.n_head, "rope_theta": 10_000.0},
               fuses_gate_up=True, extra=(("n_shared", 2),)),  # its graph asserts a rope base of 10000
        Family("exaone-moe", _exaone_layer, _exaone_keys, min_layers=2, default_layers=4,
               extra=(("sliding_window", 128),)),
        Family("laguna", _laguna_layer, _laguna_keys, min_layers=2, default_layers=3),
        Family("granite_swa", _granite_swa_layer, _granite_swa_keys, min_layers=2, fuses_gate_up=True,
               extra=(("sliding_window", 128),)),
        Family("mimo2", _mimo2_layer, _mimo2_keys, min_layers=2, default_layers=3, extra=(("sliding_window", 128),)),
        Family("step35", _step35_layer, _step35_keys, min_layers=2, default_layers=3,
               extra=(("sliding_window", 128),)),
        Family("hy_v3", _hy_v3_layer, _hy_v3_keys, min_layers=2, default_layers=3, fuses_gate_up=True),
        Family("jamba", _jamba_layer, _jamba_keys, min_layers=2, default_layers=4, overrides=_jamba_overrides,
               gate_optional=False, extra=_JAMBA),
        Family("granitehybrid", _granitehybrid_layer, _granitehybrid_keys, min_layers=2, default_layers=4,
               overrides=_jamba_overrides, gate_optional=True, extra=_MAMBA2),
        Family("afmoe", _afmoe_layer, _afmoe_keys, min_layers=2, default_layers=4,
               extra=(("n_shared", 1), ("sliding_window", 128))),
    )
}

"""The real shapes of known MoE models, as data, for ``bmoe synth --like NAME``.

Each entry copies the model's Hugging Face ``config.json`` (the field names are given beside each
value), so a synthetic file has exactly the tensor shapes, expert bytes and KV sizes of the real
one. The GGUF architecture and key set are llama.cpp's (``src/models/<arch>.cpp`` in the pinned
sources).

``ROUTING_PROFILES`` holds, per real layer, the router structure that ``bmoe.synth.big`` builds so
that the synthetic model's routing resembles the real model's (see ``RoutingProfile``).
"""

from __future__ import annotations

from dataclasses import dataclass

from bmoe.errors import ConfigError


@dataclass(frozen=True)
class MoeShape:
    name: str
    arch: str  # GGUF general.architecture (llama.cpp's LLM_ARCH name)
    n_layer: int  # num_hidden_layers
    n_embd: int  # hidden_size
    n_expert: int  # num_experts
    n_expert_used: int  # num_experts_per_tok
    n_ff_exp: int  # moe_intermediate_size
    n_ff: int  # intermediate_size (the dense FFN width, written as feed_forward_length)
    n_ff_shexp: int  # shared_expert_intermediate_size; 0 = no shared expert
    n_head: int  # num_attention_heads
    n_head_kv: int  # num_key_value_heads
    head_dim: int  # head_dim (hidden_size / num_attention_heads where config.json has none)
    n_vocab: int  # vocab_size
    context_length: int  # max_position_embeddings
    rope_theta: float  # rope_theta
    rms_eps: float  # rms_norm_eps
    qkv_bias: bool  # attention_bias (qwen3_moe) / always true for qwen2_moe
    norm_topk: bool  # norm_topk_prob (informative: llama.cpp hard-codes it per architecture)
    source: str
    # The families of bmoe.synth.families (written by their layer plans, plain random routers):
    n_dense_lead: int = 0  # first_k_dense_replace: leading blocks with a dense FFN
    n_nextn: int = 0  # num_nextn_predict_layers: MTP blocks after the main ones
    extra: tuple[tuple[str, object], ...] = ()  # the family's own widths (Family.extra's keys)

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_head_kv * self.head_dim


SHAPES: dict[str, MoeShape] = {
    # https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json ("Qwen3MoeForCausalLM",
    # model_type "qwen3_moe", tie_word_embeddings false, mlp_only_layers [], decoder_sparse_step 1:
    # every layer is MoE, no shared expert). Cross-checked against the shared route trace's header
    # (expert_bytes=3059712 = gate+up 768x2048 in Q4_K plus down 2048x768 in Q6_K) and llama.cpp's
    # qwen3moe.cpp (48 layers -> LLM_TYPE_30B_A3B).
    "qwen3-30b-a3b": MoeShape(
        name="qwen3-30b-a3b", arch="qwen3moe",
        n_layer=48,  # num_hidden_layers
        n_embd=2048,  # hidden_size
        n_expert=128,  # num_experts
        n_expert_used=8,  # num_experts_per_tok
        n_ff_exp=768,  # moe_intermediate_size
        n_ff=6144,  # intermediate_size
        n_ff_shexp=0,
        n_head=32,  # num_attention_heads
        n_head_kv=4,  # num_key_value_heads
        head_dim=128,  # head_dim (32 x 128 = 4096 != hidden_size: q is wider than the residual)
        n_vocab=151936,  # vocab_size
        context_length=40960,  # max_position_embeddings
        rope_theta=1_000_000.0,  # rope_theta
        rms_eps=1e-6,  # rms_norm_eps
        qkv_bias=False,  # attention_bias
        norm_topk=True,  # norm_topk_prob
        source="Qwen/Qwen3-30B-A3B config.json",
    ),
    # https://huggingface.co/Qwen/Qwen1.5-MoE-A2.7B/blob/main/config.json ("Qwen2MoeForCausalLM",
    # model_type "qwen2_moe", tie_word_embeddings false, decoder_sparse_step 1; Qwen2 attention
    # has q/k/v biases). llama.cpp's qwen2moe.cpp: 24 layers -> LLM_TYPE_A2_7B.
    "qwen1.5-moe-a2.7b": MoeShape(
        name="qwen1.5-moe-a2.7b", arch="qwen2moe",
        n_layer=24,  # num_hidden_layers
        n_embd=2048,  # hidden_size
        n_expert=60,  # num_experts
        n_expert_used=4,  # num_experts_per_tok
        n_ff_exp=1408,  # moe_intermediate_size
        n_ff=5632,  # intermediate_size
        n_ff_shexp=5632,  # shared_expert_intermediate_size
        n_head=16,  # num_attention_heads
        n_head_kv=16,  # num_key_value_heads (no GQA)
        head_dim=128,  # hidden_size / num_attention_heads
        n_vocab=151936,  # vocab_size
        context_length=8192,  # max_position_embeddings
        rope_theta=1_000_000.0,  # rope_theta
        rms_eps=1e-6,  # rms_norm_eps
        qkv_bias=True,  # Qwen2 attention: q/k/v projections with bias
        norm_topk=False,  # norm_topk_prob
        source="Qwen/Qwen1.5-MoE-A2.7B config.json",
    ),
    # The families below were written from the models' config.json values as published (field
    # names beside them); this machine has no network, so they were not re-fetched for this entry.
    # https://huggingface.co/openai/gpt-oss-20b/blob/main/config.json ("GptOssForCausalLM")
    "gpt-oss-20b": MoeShape(
        name="gpt-oss-20b", arch="gpt-oss",
        n_layer=24,  # num_hidden_layers
        n_embd=2880,  # hidden_size
        n_expert=32,  # num_local_experts
        n_expert_used=4,  # num_experts_per_tok (experts_per_token)
        n_ff_exp=2880,  # intermediate_size (per expert; MXFP4 in every published GGUF)
        n_ff=2880,  # no dense FFN: informative only
        n_ff_shexp=0,
        n_head=64,  # num_attention_heads
        n_head_kv=8,  # num_key_value_heads
        head_dim=64,  # head_dim
        n_vocab=201088,  # vocab_size
        context_length=131072,  # max_position_embeddings
        rope_theta=150000.0,  # rope_theta
        rms_eps=1e-5,  # rms_norm_eps
        qkv_bias=True,  # attention_bias
        norm_topk=False,  # softmax over the top-k logits (SOFTMAX_WEIGHT)
        source="openai/gpt-oss-20b config.json",
        extra=(("sliding_window", 128),),  # sliding_window
    ),
    # https://huggingface.co/openai/gpt-oss-120b/blob/main/config.json
    "gpt-oss-120b": MoeShape(
        name="gpt-oss-120b", arch="gpt-oss",
        n_layer=36, n_embd=2880, n_expert=128, n_expert_used=4, n_ff_exp=2880, n_ff=2880, n_ff_shexp=0,
        n_head=64, n_head_kv=8, head_dim=64, n_vocab=201088, context_length=131072,
        rope_theta=150000.0, rms_eps=1e-5, qkv_bias=True, norm_topk=False,
        source="openai/gpt-oss-120b config.json", extra=(("sliding_window", 128),),
    ),
    # https://huggingface.co/zai-org/GLM-4.5-Air/blob/main/config.json ("Glm4MoeForCausalLM")
    "glm-4.5-air": MoeShape(
        name="glm-4.5-air", arch="glm4moe",
        n_layer=46,  # num_hidden_layers
        n_embd=4096,  # hidden_size
        n_expert=128,  # n_routed_experts
        n_expert_used=8,  # num_experts_per_tok
        n_ff_exp=1408,  # moe_intermediate_size
        n_ff=10944,  # intermediate_size (the leading dense block)
        n_ff_shexp=1408,  # moe_intermediate_size x n_shared_experts (1)
        n_head=96,  # num_attention_heads
        n_head_kv=8,  # num_key_value_heads
        head_dim=128,  # head_dim
        n_vocab=151552,  # vocab_size
        context_length=131072,  # max_position_embeddings
        rope_theta=1_000_000.0,  # rope_theta
        rms_eps=1e-5,  # rms_norm_eps
        qkv_bias=True,  # attention_bias
        norm_topk=True,  # norm_topk_prob
        source="zai-org/GLM-4.5-Air config.json",
        n_dense_lead=1,  # first_k_dense_replace
        n_nextn=1,  # num_nextn_predict_layers
        extra=(("n_shared", 1),),  # n_shared_experts
    ),
    # https://huggingface.co/Qwen/Qwen3.5-35B-A3B/blob/main/config.json (text_config)
    "qwen3.5-35b-a3b": MoeShape(
        name="qwen3.5-35b-a3b", arch="qwen35moe",
        n_layer=40,  # num_hidden_layers
        n_embd=2048,  # hidden_size
        n_expert=256,  # num_experts
        n_expert_used=8,  # num_experts_per_tok
        n_ff_exp=512,  # moe_intermediate_size
        n_ff=512,  # no dense FFN: informative only
        n_ff_shexp=512,  # shared_expert_intermediate_size
        n_head=16,  # num_attention_heads
        n_head_kv=2,  # num_key_value_heads
        head_dim=256,  # head_dim
        n_vocab=248320,  # vocab_size
        context_length=262144,  # max_position_embeddings
        rope_theta=10_000_000.0,  # rope_theta
        rms_eps=1e-6,  # rms_norm_eps
        qkv_bias=False,  # attention_bias
        norm_topk=True,  # norm_topk_prob
        source="Qwen/Qwen3.5-35B-A3B config.json",
        n_nextn=1,  # mtp_num_hidden_layers
        # linear_key_head_dim = linear_value_head_dim, linear_num_key_heads, linear_num_value_heads,
        # linear_conv_kernel_dim, full_attention_interval, head_dim x partial_rotary_factor 0.25,
        # mrope_section
        extra=(("gdn_s", 128), ("gdn_kh", 16), ("gdn_vh", 32), ("gdn_kc", 4), ("full_attn", 4),
               ("rope", 64), ("sections", (11, 11, 10, 0))),
    ),
    # https://huggingface.co/deepseek-ai/DeepSeek-V2-Lite/blob/main/config.json ("DeepseekV2ForCausalLM")
    "deepseek-v2-lite": MoeShape(
        name="deepseek-v2-lite", arch="deepseek2",
        n_layer=27,  # num_hidden_layers (27: llama.cpp's "lite", no q_lora_rank needed)
        n_embd=2048,  # hidden_size
        n_expert=64,  # n_routed_experts
        n_expert_used=6,  # num_experts_per_tok
        n_ff_exp=1408,  # moe_intermediate_size
        n_ff=10944,  # intermediate_size (the leading dense block)
        n_ff_shexp=2816,  # moe_intermediate_size x n_shared_experts (2)
        n_head=16,  # num_attention_heads
        n_head_kv=16,  # num_key_value_heads
        head_dim=192,  # qk_nope_head_dim + qk_rope_head_dim
        n_vocab=102400,  # vocab_size
        context_length=163840,  # max_position_embeddings
        rope_theta=10000.0,  # rope_theta
        rms_eps=1e-6,  # rms_norm_eps
        qkv_bias=False,  # attention_bias
        norm_topk=False,  # norm_topk_prob
        source="deepseek-ai/DeepSeek-V2-Lite config.json",
        n_dense_lead=1,  # first_k_dense_replace
        # q_lora_rank null, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim,
        # n_group 1 (no grouped routing), scoring_func softmax, n_shared_experts
        extra=(("q_rank", 0), ("kv_rank", 512), ("nope", 128), ("rope", 64), ("v", 128), ("groups", None),
               ("gating", 1), ("n_shared", 2)),
    ),
}


def get_shape(name: str) -> MoeShape:
    try:
        return SHAPES[name.lower()]
    except KeyError:
        raise ConfigError(
            f"unknown model {name!r} for --like; known: {', '.join(sorted(SHAPES))}") from None


@dataclass(frozen=True)
class RoutingProfile:
    """Per real layer, the router logit structure that reproduces that layer's routing statistics.

    The synthetic router's logit for expert ``e`` at token ``t`` is, up to a positive factor common
    to all experts (the RMS norm), ``sigma_b * b_e + (u_e . f_t + alpha * u_e . f_{t-1}) /
    sqrt(1 + alpha^2)``: ``b_e`` a fixed standard normal per expert (popularity), ``f_t`` the
    token's own random features and ``f_{t-1}`` the previous token's (a previous-token attention
    head carries them), so the token part has unit variance and a lag-1 correlation of
    ``alpha / (1 + alpha^2)`` and none beyond.

    The values are fitted per layer, not chosen: ``bench/routing_realism.py --derive`` measures,
    for each layer of the real trace named in ``source``, the share of routed slots that go to the
    layer's 8 most used experts (popularity) and the share of a token's experts that the previous
    token also used (reuse), over its decode steps, and inverts the logit model above (simulated
    with the trace's own expert count, top-k and step count) for the ``(sigma_b, alpha)`` that
    gives both. The lag 2-8 overlap, which is not fitted, is then predicted within a few points.
    """

    sigma_b: tuple[float, ...]
    alpha: tuple[float, ...]
    source: str

    def __post_init__(self) -> None:
        if len(self.sigma_b) != len(self.alpha):
            raise ValueError("sigma_b and alpha need one value per layer")

    @property
    def n_layer(self) -> int:
        return len(self.sigma_b)

    def for_layers(self, n_layer: int) -> list[tuple[float, float]]:
        """``(sigma_b, alpha)`` for each of ``n_layer`` synthetic layers: those of the real layer
        at the same relative depth (``real_layer``). Each synthetic layer is one real layer's
        routing, not an average of several, so a shallower model keeps the spread of the real
        layers (near-uniform ones beside very concentrated ones), which is what a cache sees."""
        return [(self.sigma_b[j], self.alpha[j])
                for j in (real_layer(i, n_layer, self.n_layer) for i in range(n_layer))]


def real_layer(i: int, n_layer: int, n_real: int) -> int:
    """The real layer at the relative depth of synthetic layer ``i`` of ``n_layer``: the middle of
    the real layers it stands for, ``[i * n_real / n_layer, (i + 1) * n_real / n_layer)``."""
    return min(n_real - 1, (2 * i + 1) * n_real // (2 * n_layer))


# Fitted by `python bench/routing_realism.py --derive` from ../shared/traces/qwen3-30b-a3b.route.csv
# (Qwen3-30B-A3B Q4_K_M, 128 decode steps, top-k 6 of 128); one value per real layer 0..47.
_QWEN3_SIGMA_B: tuple[float, ...] = (
    0.40, 0.45, 0.59, 0.72, 0.73, 0.95, 1.25, 1.63, 1.07, 1.13, 0.95, 0.85,
    1.05, 0.64, 0.88, 1.11, 0.80, 0.82, 2.04, 2.03, 1.28, 1.14, 1.03, 0.90,
    1.09, 0.61, 0.97, 1.15, 0.94, 0.83, 2.57, 2.29, 1.35, 1.23, 1.03, 0.89,
    1.04, 0.51, 0.91, 0.97, 0.71, 0.59, 0.63, 1.24, 1.19, 1.47, 1.01, 0.63,
)
_QWEN3_ALPHA: tuple[float, ...] = (
    0.00, 0.52, 0.38, 0.61, 0.64, 0.65, 0.45, 1.00, 0.49, 1.00, 0.60, 0.81,
    0.85, 0.83, 0.61, 0.73, 0.65, 0.48, 0.35, 0.56, 0.53, 0.81, 0.68, 0.52,
    0.57, 0.58, 0.52, 0.51, 0.51, 0.70, 1.00, 1.00, 1.00, 1.00, 0.70, 0.61,
    0.72, 0.60, 0.57, 0.68, 0.61, 0.53, 0.49, 0.57, 0.35, 0.50, 0.31, 0.14,
)

ROUTING_PROFILES: dict[str, RoutingProfile] = {
    "qwen3-30b-a3b": RoutingProfile(
        _QWEN3_SIGMA_B, _QWEN3_ALPHA, source="shared/traces/qwen3-30b-a3b.route.csv"),
    # No trace of Qwen1.5-MoE-A2.7B exists here: it borrows Qwen3's profile by relative depth, an
    # assumption (its 60 experts, top-4 and shared expert may well route differently).
    "qwen1.5-moe-a2.7b": RoutingProfile(
        _QWEN3_SIGMA_B, _QWEN3_ALPHA, source="qwen3-30b-a3b's profile by relative depth (no trace)"),
}

# The RMS of the residual stream entering each layer of a skewed synthetic model (layer 0's input is
# the embedding), by absolute layer index: random attention and expert outputs add up, so it grows
# with depth, and a write into the routing dims (the route drift of ``bmoe.synth.big``) is scaled by
# it to land at a chosen size after the layer's RMS norm. Measured by ``python bench/residual_rms.py
# MODEL`` on ``synth --like qwen3-30b-a3b --type q4_0`` (48 layers, seed 0), the last row of a
# 19-token prompt; past the table it is extrapolated by its last step.
_QWEN3_RESIDUAL_RMS: tuple[float, ...] = (
    0.98, 1.13, 1.19, 1.27, 1.40, 1.49, 1.61, 1.72, 1.84, 1.97, 2.10, 2.21, 2.33, 2.46, 2.57, 2.68,
    2.79, 2.87, 2.98, 3.11, 3.22, 3.31, 3.44, 3.53, 3.63, 3.71, 3.81, 3.93, 4.01, 4.08, 4.16, 4.29,
    4.37, 4.46, 4.55, 4.62, 4.74, 4.84, 4.91, 4.99, 5.08, 5.16, 5.24, 5.31, 5.39, 5.48, 5.55, 5.63,
)

RESIDUAL_RMS: dict[str, tuple[float, ...]] = {"qwen3-30b-a3b": _QWEN3_RESIDUAL_RMS}


def residual_rms(name: str, layer: int) -> float:
    """The residual stream's RMS entering ``layer`` of shape ``name`` (``RESIDUAL_RMS``)."""
    table = RESIDUAL_RMS[name]
    if layer < len(table):
        return table[layer]
    return table[-1] + (layer - len(table) + 1) * (table[-1] - table[-2])

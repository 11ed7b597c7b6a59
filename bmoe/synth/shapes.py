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

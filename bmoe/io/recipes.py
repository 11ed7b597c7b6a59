"""Architecture recipes: which tensors of a layer are the streamed experts, per architecture.

A recipe holds only what differs between architectures and cannot be read from the file: the
expert tensor layouts llama.cpp accepts, the metadata keys it needs before it will load, the key
that sizes the experts, and the facts about the pinned loader that decide how a file may be opened
(read from ``src/models/<arch>.cpp`` of the pin; see ``../shared/ARCHITECTURES.md``). Counts and
sizes (layers, which layers carry experts, experts, top-k, bytes per expert, MTP blocks) always
come from the file itself. Pure data: importable without llama.cpp.

Only tensors named ``blk.<il>.<suffix>.weight`` with a suffix of the recipe's layouts stream. Every
other tensor with an expert dimension (router weights and biases, ``exp_probs_b``, gpt-oss's
per-expert biases, ``.scale``) and every shared expert is small and stays resident with the dense
weights, so it needs no entry here.
"""

from __future__ import annotations

from dataclasses import dataclass

from bmoe.errors import UnsupportedArchitectureError

# Keys every MoE architecture needs under "<arch>."; missing expert counts abort llama.cpp.
_COMMON_KEYS = (
    "block_count",
    "context_length",
    "embedding_length",
    "attention.head_count",
    "expert_count",
    "expert_used_count",
)

SPLIT = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
FUSED = ("ffn_gate_up_exps", "ffn_down_exps")
# The hybrid recurrent families' gated-delta-net / short-conv state keys.
_SSM_KEYS = ("ssm.conv_kernel", "ssm.inner_size", "ssm.state_size", "ssm.time_step_rank", "ssm.group_count")

EXPERT_WIDTH = "expert_feed_forward_length"
FFN_WIDTH = "feed_forward_length"


@dataclass(frozen=True)
class Recipe:
    arch: str
    # The expert tensor sets llama.cpp accepts for one layer (`blk.<il>.<suffix>.weight`); a MoE
    # layer of a file holds exactly one of them. Listed in the order the graph consumes them.
    layouts: tuple[tuple[str, ...], ...] = (SPLIT,)
    required_keys: tuple[str, ...] = _COMMON_KEYS
    # The key whose value is the experts' FFN width (ne[1] of gate/up, ne[0] of down).
    width_key: str = EXPERT_WIDTH
    # llama.cpp's user open (init_from_user) always creates a fused ffn_gate_up_exps for this
    # arch, so a file with split gate/up experts cannot be opened that way faithfully.
    user_open_fuses: bool = False
    # Some layers keep a recurrent state (gated delta net, short conv): an aborted decode can
    # roll it back only within llama.cpp's snapshot budget.
    recurrent: bool = False
    # The graph takes ``expert_gating_func`` as written: absent (where the loader makes it
    # optional) or 0 (NONE), llama.cpp aborts at context creation (build_moe_ffn's GGML_ABORT).
    gating_required: bool = False
    # ``rope.dimension_sections`` (IMROPE/MROPE archs): all-zero sections abort at first decode.
    rope_sections: bool = False
    # Tensor name suffixes llama.cpp's kernels assert to be F32 (gpt-oss sinks and biases).
    f32_suffixes: tuple[str, ...] = ()
    # None: llama.cpp's user open builds this arch as the plain load does (given the fused rule
    # above). Otherwise why it cannot: it then creates a tensor no file has and bmoe cannot fill.
    user_open_refusal: str | None = None
    # ``interleave_moe_layer_step`` 0 aborts (ernie4_5-moe's graph asserts it positive).
    moe_step_positive: bool = False
    # How a hybrid marks its recurrent blocks: "interval" (every full_attention_interval-th block
    # attends, default 4, or a per-block attention.recurrent_layers array) or "kv_heads" (a block
    # with 0 KV heads is recurrent). With no attending block at all llama.cpp creates no KV buffer
    # and asserts at the first decode (GGML_ASSERT(buffer), measured on a 2-block qwen35moe; an
    # all-conv lfm2moe fails its load instead): refused in Python either way.
    recurrent_marker: str = ""
    # The graph asserts the rope spans the whole head (``GGML_ASSERT(n_embd_head == n_rot)``).
    full_rope: bool = False
    # Attention is plain q/k/v/o of head_count x key_length (per-layer KV heads allowed): the
    # projections' shapes are checked against those keys.
    plain_attention: bool = False
    # Multi-head latent attention (deepseek2): head sizes are kv_lora_rank + rope and the *_mla keys.
    mla: bool = False
    # Gated delta net: ssm.inner_size must be ssm.state_size x ssm.time_step_rank (the tensors are
    # sized by the product, the graph divides by the heads: anything else asserts).
    gated_delta_net: bool = False
    # Keys whose 0 sizes a tensor the loader creates unconditionally to 0 (``ne[dim] >= 1`` abort).
    positive_keys: tuple[str, ...] = ()
    # What sizes a dense FFN block (``blk.N.ffn_up``): the key, or ``embedding_length`` where the
    # block is n_embd wide whatever feed_forward_length says (arctic's residual MLP).
    dense_width_key: str = FFN_WIDTH
    # Kimi delta attention (bailingmoe3): the loader asserts kda.safe_gate true and
    # kda.gate_lower_bound below 0 (aborts, not load errors).
    kda: bool = False
    # Keys the graph asserts to one value (deepseek2-ocr: rope.freq_base 10000): another aborts.
    exact_keys: tuple[tuple[str, float], ...] = ()
    # Mamba blocks of jamba / granitehybrid: the loader asserts ssm.inner_size = 2 x embedding_length.
    mamba_inner_twice_embd: bool = False

    @property
    def expert_suffixes(self) -> tuple[str, ...]:
        """Every suffix of every layout, in graph order (fused gate_up first, down last)."""
        out: list[str] = []
        for layout in self.layouts:
            out.extend(s for s in layout if s not in out)
        return tuple(sorted(out, key=_GRAPH_ORDER.index))

    def key(self, name: str) -> str:
        return f"{self.arch}.{name}"


_GRAPH_ORDER = ("ffn_gate_up_exps", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")  # gate before up (DESIGN)


def _keys(*extra: str) -> tuple[str, ...]:
    return _COMMON_KEYS + extra


RECIPES: dict[str, Recipe] = {
    r.arch: r
    for r in (
        Recipe("qwen3moe", required_keys=_keys(EXPERT_WIDTH), full_rope=True, plain_attention=True),
        # The shared expert (ffn_*_shexp) is a plain matmul: dense, so it stays resident.
        Recipe("qwen2moe", required_keys=_keys(EXPERT_WIDTH), full_rope=True, plain_attention=True),
        # olmoe and Mixtral size their experts by feed_forward_length, not the expert key.
        Recipe("olmoe", required_keys=_keys(FFN_WIDTH), width_key=FFN_WIDTH, full_rope=True, plain_attention=True),
        # Mixtral: the gate experts are optional in the loader.
        Recipe("llama", (SPLIT, ("ffn_up_exps", "ffn_down_exps")), _keys(FFN_WIDTH), width_key=FFN_WIDTH,
               full_rope=True, plain_attention=True),
        Recipe("gemma4", (FUSED, SPLIT), _keys(EXPERT_WIDTH, FFN_WIDTH), user_open_fuses=True, plain_attention=True),
        # MXFP4 experts; router bias, per-expert biases and attention sinks stay resident (F32).
        Recipe(
            "gpt-oss", required_keys=_keys(EXPERT_WIDTH, "attention.sliding_window",
                                           "attention.layer_norm_rms_epsilon"),
            f32_suffixes=("attn_sinks.weight", "_exps.bias", "ffn_gate_inp.bias"),
            full_rope=True, plain_attention=True,  # q/k/v are head_count x n_rot wide
        ),
        Recipe("qwen35moe", (SPLIT, FUSED), _keys(EXPERT_WIDTH, "rope.dimension_sections", *_SSM_KEYS),
               user_open_fuses=True, recurrent=True, rope_sections=True, recurrent_marker="interval",
               gated_delta_net=True),
        Recipe("qwen3next", (SPLIT, FUSED), _keys(EXPERT_WIDTH, *_SSM_KEYS), user_open_fuses=True, recurrent=True,
               recurrent_marker="interval", gated_delta_net=True,
               user_open_refusal="qwen3next's user open creates the legacy ssm_in the file lacks (measured)"),
        Recipe("qwen3vlmoe", required_keys=_keys("rope.dimension_sections"), rope_sections=True, full_rope=True,
               plain_attention=True),
        Recipe("deepseek2", (SPLIT, FUSED), _keys(EXPERT_WIDTH, "expert_shared_count", "attention.kv_lora_rank"),
               user_open_fuses=True, mla=True, positive_keys=("expert_shared_count",)),
        Recipe("glm4moe", required_keys=_keys(EXPERT_WIDTH, "expert_shared_count"), plain_attention=True),
        # Experts are {E, feed_forward_length, N}, yet the loader also requires the expert key.
        Recipe("minimax-m2", required_keys=_keys(FFN_WIDTH, EXPERT_WIDTH), width_key=FFN_WIDTH,
               gating_required=True),
        Recipe("llama4", required_keys=_keys(EXPERT_WIDTH, "interleave_moe_layer_step"), full_rope=True,
               plain_attention=True),
        Recipe("bailingmoe2", required_keys=_keys(EXPERT_WIDTH, "expert_shared_count", "expert_gating_func"),
               gating_required=True, positive_keys=("expert_shared_count",)),
        # dots.llm1: the gating key is optional in the loader, absent it aborts (verified upstream).
        Recipe("dots1", required_keys=_keys(EXPERT_WIDTH, "expert_shared_count"), gating_required=True,
               full_rope=True, plain_attention=True, positive_keys=("expert_shared_count",)),
        # Hunyuan-A13B: experts are {E, feed_forward_length, N}; the loader still requires the expert key.
        Recipe("hunyuan-moe", required_keys=_keys(FFN_WIDTH, EXPERT_WIDTH), width_key=FFN_WIDTH, full_rope=True,
               plain_attention=True),
        # ERNIE 4.5 (published models: interleave_moe_layer_step 1); a step of 0 aborts (GGML_ASSERT
        # in the graph builder, verified). The gate experts are optional in the loader.
        Recipe("ernie4_5-moe", (SPLIT, ("ffn_up_exps", "ffn_down_exps")),
               _keys(EXPERT_WIDTH, "interleave_moe_layer_step"), moe_step_positive=True, full_rope=True,
               plain_attention=True),
        Recipe("lfm2moe", required_keys=_keys(EXPERT_WIDTH, "expert_gating_func", "shortconv.l_cache"),
               recurrent=True, recurrent_marker="kv_heads", gating_required=True, plain_attention=True,
               positive_keys=("shortconv.l_cache",)),
        # Granite 3.x MoE: experts sized by feed_forward_length, gate experts optional, logit_scale
        # required (the logits are divided by it); the graph asserts n_rot == head size.
        Recipe("granitemoe", (SPLIT, ("ffn_up_exps", "ffn_down_exps")), _keys(FFN_WIDTH, "logit_scale"),
               width_key=FFN_WIDTH, full_rope=True, plain_attention=True),
        # Ling-lite / Ling-plus (Ling 1.x): q/k/v are head_count x rope dimensions wide.
        Recipe("bailingmoe", required_keys=_keys(EXPERT_WIDTH, "expert_shared_count"), full_rope=True,
               plain_attention=True, positive_keys=("expert_shared_count",)),
        # DeepSeek-MoE 16B (V1): leading dense blocks, shared experts sized by their count.
        Recipe("deepseek", required_keys=_keys(EXPERT_WIDTH, "expert_shared_count"), full_rope=True,
               plain_attention=True, positive_keys=("expert_shared_count",)),
        # SmallThinker: the router reads the block's input before attention; the loader takes the
        # expert width and the gating key as optional, yet 0 / absent they abort.
        Recipe("smallthinker", required_keys=_keys(EXPERT_WIDTH), gating_required=True, full_rope=True,
               plain_attention=True),
        # Phi-3.5-MoE: LayerNorm with biases, output bias; experts sized by feed_forward_length.
        Recipe("phimoe", required_keys=_keys(FFN_WIDTH), width_key=FFN_WIDTH, plain_attention=True),
        # MiniCPM-MoE (its dense files share the arch: no expert count, "a dense model"); granite's
        # MoE block; experts sized by feed_forward_length, gate experts optional.
        Recipe("minicpm", (SPLIT, ("ffn_up_exps", "ffn_down_exps")), _keys(FFN_WIDTH), width_key=FFN_WIDTH,
               full_rope=True, plain_attention=True),
        # Mistral 3 MoE variants: llama's block, experts sized by feed_forward_length.
        Recipe("mistral3", (SPLIT, ("ffn_up_exps", "ffn_down_exps")), _keys(FFN_WIDTH), width_key=FFN_WIDTH,
               full_rope=True, plain_attention=True),
        # DBRX: fused q/k/v, LayerNorm (layer_norm_epsilon), clamp_kqv required.
        Recipe("dbrx", required_keys=_keys(FFN_WIDTH, "attention.clamp_kqv", "attention.layer_norm_epsilon"),
               width_key=FFN_WIDTH, full_rope=True, plain_attention=True),
        # Grok-1/2: GELU experts, softcapped attention and router; the loader takes the expert width
        # as optional, yet absent it sizes the experts 0.
        Recipe("grok", (SPLIT, ("ffn_up_exps", "ffn_down_exps")), _keys(EXPERT_WIDTH), full_rope=True,
               plain_attention=True),
        # Arcee AFM MoE (Trinity): gated attention, leading dense blocks, exp_probs_b required.
        # Mellum: qwen3moe's block, interleaved sliding windows when attention.sliding_window is set.
        Recipe("mellum", required_keys=_keys(EXPERT_WIDTH), full_rope=True, plain_attention=True),
        # Snowflake Arctic: a dense residual MLP n_embd wide beside the experts (sized by
        # feed_forward_length) in every block.
        Recipe("arctic", required_keys=_keys(FFN_WIDTH), width_key=FFN_WIDTH, full_rope=True, plain_attention=True,
               dense_width_key="embedding_length"),
        # deepseek2's loader and graph under another name.
        Recipe("mistral4", (SPLIT, FUSED), _keys(EXPERT_WIDTH, "expert_shared_count", "attention.kv_lora_rank"),
               user_open_fuses=True, mla=True, positive_keys=("expert_shared_count",)),
        # Ling 3: KDA linear-attention blocks (0 KV heads) and gated MLA blocks, leading dense blocks,
        # shared experts, selection bias; MTP ignored.
        Recipe("bailingmoe3", required_keys=_keys(
            EXPERT_WIDTH, "expert_shared_count", "expert_gating_func", "leading_dense_block_count",
            "attention.kv_lora_rank", "attention.key_length_mla", "attention.value_length_mla", "ssm.conv_kernel",
            "kda.head_dim", "kda.gate_lower_bound"),
               recurrent=True, recurrent_marker="kv_heads", gating_required=True, mla=True, kda=True,
               positive_keys=("ssm.conv_kernel", "kda.head_dim")),
        # Kimi-Linear: KDA blocks with low-rank gates (0 KV heads) and MLA blocks, dense lead blocks.
        Recipe("kimi-linear", required_keys=_keys(
            EXPERT_WIDTH, "expert_shared_count", "expert_gating_func", "attention.kv_lora_rank",
            "attention.key_length_mla", "attention.value_length_mla", "ssm.conv_kernel", "kda.head_dim"),
               recurrent=True, recurrent_marker="kv_heads", gating_required=True, mla=True,
               positive_keys=("ssm.conv_kernel", "kda.head_dim")),
        # Cohere MoE: attention and FFN in parallel off one norm, sliding windows always (3 of 4
        # blocks), fused or split gate/up (the user open fuses), logit_scale required.
        Recipe("cohere2moe", (SPLIT, FUSED), _keys(EXPERT_WIDTH, "attention.sliding_window", "logit_scale",
                                                   "leading_dense_block_count"),
               user_open_fuses=True, full_rope=True, plain_attention=True),
        # Maple: qwen3moe's block with sliding windows by a per-block pattern, clamped SwiGLU experts.
        Recipe("maple", required_keys=_keys(EXPERT_WIDTH, "attention.sliding_window", "attention.sliding_window_pattern",
                                            "swiglu_clamp_exp"),
               plain_attention=True),
        # DeepSeek V3.2: deepseek2's MLA block plus the sparse-attention indexer; split experts only.
        Recipe("deepseek32", required_keys=_keys(
            EXPERT_WIDTH, "expert_shared_count", "expert_gating_func", "attention.q_lora_rank",
            "attention.kv_lora_rank", "attention.key_length_mla", "attention.value_length_mla",
            "attention.indexer.head_count", "attention.indexer.key_length", "attention.indexer.top_k"),
               gating_required=True, mla=True, positive_keys=("expert_shared_count", "attention.q_lora_rank",
                                                              "attention.indexer.head_count",
                                                              "attention.indexer.key_length")),
        # GLM-5 (GlmMoeDsa): deepseek32's block (the indexer optional in the loader).
        Recipe("glm-dsa", required_keys=_keys(
            EXPERT_WIDTH, "expert_shared_count", "attention.q_lora_rank", "attention.kv_lora_rank",
            "attention.key_length_mla", "attention.value_length_mla", "attention.indexer.head_count",
            "attention.indexer.key_length", "attention.indexer.top_k"),
               mla=True, positive_keys=("expert_shared_count", "attention.q_lora_rank")),
        # DeepSeek-OCR's language model: deepseek2's graph in plain multi-head attention.
        Recipe("deepseek2-ocr", (SPLIT, FUSED), _keys(EXPERT_WIDTH, "expert_shared_count"), user_open_fuses=True,
               plain_attention=True, positive_keys=("expert_shared_count",),
               exact_keys=(("rope.freq_base", 10000.0),)),
        # K-EXAONE: sliding windows (3 of 4 blocks), leading dense blocks, a shared expert in every MoE
        # block (sized by expert_shared_feed_forward_length, else the expert width).
        Recipe("exaone-moe", required_keys=_keys(EXPERT_WIDTH, "attention.sliding_window", "expert_gating_func"),
               gating_required=True, full_rope=True, plain_attention=True),
        # Laguna: an attention output gate per head (or per element: any other width aborts the
        # loader), leading dense blocks, one shared expert, exp_probs_b required.
        Recipe("laguna", required_keys=_keys(EXPERT_WIDTH, "leading_dense_block_count"), plain_attention=True),
        # Granite 4 with sliding windows: attention sinks (F32), windows by a per-block pattern, fused
        # or split gate/up sized by feed_forward_length, a shared expert with gate and up fused.
        Recipe("granite_swa", (SPLIT, FUSED), _keys(FFN_WIDTH, "logit_scale", "attention.sliding_window",
                                                    "attention.sliding_window_pattern"),
               width_key=FFN_WIDTH, user_open_fuses=True, full_rope=True, plain_attention=True,
               f32_suffixes=("attn_sinks.weight",)),
        # MiMo-V2-Flash: every block tensor optional in the loader (dense or MoE by what a block
        # holds), sinks resident (F32), windows by a per-block pattern; sigmoid routing.
        Recipe("mimo2", required_keys=_keys(EXPERT_WIDTH, "attention.sliding_window",
                                            "attention.sliding_window_pattern"),
               plain_attention=True, f32_suffixes=("attn_sinks.weight",)),
        # Step-3.5-Flash: mimo2's optional-tensor scheme, q/k norms, a per-head attention gate, a
        # shared expert, windows by a per-block pattern.
        Recipe("step35", required_keys=_keys(EXPERT_WIDTH, "attention.sliding_window",
                                             "attention.sliding_window_pattern"), plain_attention=True),
        # Hunyuan next-gen (hy_v3): every block tensor optional (dense or MoE by what a block holds),
        # fused or split gate/up, a shared expert, a selection bias; sigmoid routing by default.
        Recipe("hy_v3", (SPLIT, FUSED), _keys(EXPERT_WIDTH), user_open_fuses=True, full_rope=True,
               plain_attention=True),
        # Jamba: mamba blocks (0 KV heads, recurrent) and attention blocks; MoE where a block has a
        # router, dense blocks as wide as the experts (feed_forward_length); the loader asserts
        # ssm.inner_size = 2 x embedding_length.
        Recipe("jamba", required_keys=_keys(FFN_WIDTH, "ssm.conv_kernel", "ssm.inner_size", "ssm.state_size",
                                            "ssm.time_step_rank"),
               width_key=FFN_WIDTH, recurrent=True, recurrent_marker="kv_heads", plain_attention=True,
               positive_keys=("ssm.conv_kernel", "ssm.state_size", "ssm.time_step_rank"),
               mamba_inner_twice_embd=True),
        # Granite 4.0-H: mamba2 blocks (0 KV heads, recurrent) and attention blocks, every block MoE
        # (experts sized by feed_forward_length, gate optional) with a shared expert; the loader
        # asserts ssm.inner_size = 2 x embedding_length.
        Recipe("granitehybrid", (SPLIT, ("ffn_up_exps", "ffn_down_exps")),
               _keys(FFN_WIDTH, *_SSM_KEYS), width_key=FFN_WIDTH, recurrent=True, recurrent_marker="kv_heads",
               plain_attention=True, mamba_inner_twice_embd=True,
               positive_keys=("ssm.conv_kernel", "ssm.state_size", "ssm.time_step_rank", "ssm.group_count")),
        # Its graph always builds a sliding-window input: no window (absent or 0) is a segfault.
        Recipe("afmoe", required_keys=_keys(EXPERT_WIDTH, "expert_shared_count", "attention.sliding_window"),
               plain_attention=True, positive_keys=("attention.sliding_window",)),
    )
}


def recipe_for(arch: str) -> Recipe:
    try:
        return RECIPES[arch]
    except KeyError:
        known = ", ".join(sorted(RECIPES))
        raise UnsupportedArchitectureError(
            f"architecture {arch!r} has no bmoe recipe (supported: {known})"
        ) from None

"""Architecture recipes: which tensors of a layer are the streamed experts, per architecture.

A recipe holds only what differs between architectures and cannot be read from the file: the
expert tensor suffixes and the metadata keys llama.cpp needs before it will load. Counts and sizes
(layers, experts, top-k, bytes per expert) always come from the file itself. Pure data: importable
without llama.cpp.
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


@dataclass(frozen=True)
class Recipe:
    arch: str
    # Expert tensor suffixes (`blk.<il>.<suffix>.weight`), in the order the graph consumes them.
    expert_suffixes: tuple[str, ...]
    required_keys: tuple[str, ...] = _COMMON_KEYS

    @property
    def fused_gate_up(self) -> bool:
        return "ffn_gate_up_exps" in self.expert_suffixes

    def key(self, name: str) -> str:
        return f"{self.arch}.{name}"


_SPLIT_GLU = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")

RECIPES: dict[str, Recipe] = {
    r.arch: r
    for r in (
        Recipe("qwen3moe", _SPLIT_GLU, _COMMON_KEYS + ("expert_feed_forward_length",)),
        # The shared expert (ffn_*_shexp) is a plain matmul: dense, so it stays resident.
        Recipe("qwen2moe", _SPLIT_GLU, _COMMON_KEYS + ("expert_feed_forward_length",)),
        Recipe("olmoe", _SPLIT_GLU),
        Recipe("llama", _SPLIT_GLU),
        Recipe(
            "gemma4",
            ("ffn_gate_up_exps", "ffn_down_exps"),
            _COMMON_KEYS + ("expert_feed_forward_length", "feed_forward_length"),
        ),
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

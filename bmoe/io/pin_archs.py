"""The pinned llama.cpp's MoE architectures, and why bmoe leaves any of them out. Pure data.

``PIN_MOE_ARCHS`` is every ``general.architecture`` name whose model class in the pin
(llama-cpp-python 0.3.36's ``vendor/llama.cpp``) creates routed-expert tensors: its
``load_arch_tensors`` (its own, or inherited: ``src/models/models.h``) names an ``*_EXPS`` tensor,
with the class chosen by ``llama_model_mapping`` (``src/llama-model.cpp``) and the name from
``src/llama-arch.cpp``. Read once from the sources, not at test time; a pin bump re-reads it, and
``tests/test_pin_archs.py`` then fails until each new name has a recipe or a line in ``LEFT_OUT``
(and the README's list of what is left out names it).
"""

from __future__ import annotations

PIN_MOE_ARCHS: tuple[str, ...] = (
    "afmoe", "arctic", "bailingmoe", "bailingmoe2", "bailingmoe3", "cohere2moe", "dbrx", "deepseek", "deepseek2",
    "deepseek2-ocr", "deepseek32", "deepseek4", "dflash", "dots1", "dots3note", "ernie4_5", "ernie4_5-moe",
    "exaone-moe", "gemma4", "glm-dsa", "glm4moe", "glm5-next", "gpt-oss", "granite", "granite_swa", "granitehybrid",
    "granitemoe", "grok", "grovemoe", "hunyuan-moe", "hy_v3", "hy_v4", "jamba", "kimi-k3", "kimi-linear", "laguna",
    "lfm2", "lfm2moe", "llada-moe", "llama", "llama-embed", "llama4", "maple", "mellum", "mimo2", "minicpm",
    "minimax-01", "minimax-m2", "minimax-m3", "mistral3", "mistral4", "nemotron_h", "nemotron_h_moe",
    "nomic-bert-moe", "olmoe", "paddleocr", "phimoe", "qwen2moe", "qwen35moe", "qwen3moe", "qwen3next",
    "qwen3vlmoe", "qwen4exp", "refact", "rnd1", "smallthinker", "step35",
)

_NOT_YET = "no recipe yet: the pin builds it, nobody has written and gated a fixture for it"
_NOT_GENERATIVE = "not a left-to-right text generator"

# Each refused with "architecture 'X' has no bmoe recipe"; the reason is the README's.
LEFT_OUT: dict[str, str] = {
    # What bmoe's seam cannot take as it stands.
    "grovemoe": "two top-k nodes per layer and a second, adjugate expert set (chexps) routed by them",
    "deepseek4": "hash-routed layers (top-k from the token id, a GET_ROWS), hyper-connections, compressed attention",
    "nemotron_h_moe": "per-layer expert counts and widths (arrays), experts in a latent space",
    "kimi-k3": "experts in a latent space and more than 1024 of them",
    # Not models bmoe generates text with.
    "dflash": f"{_NOT_GENERATIVE}: a speculative-decoding draft model",
    "nomic-bert-moe": f"{_NOT_GENERATIVE}: an embedding encoder",
    "llama-embed": f"{_NOT_GENERATIVE}: an embedding model",
    "llada-moe": f"{_NOT_GENERATIVE}: a diffusion LM (non-causal)",
    "rnd1": f"{_NOT_GENERATIVE}: a diffusion LM (non-causal)",
    "refact": "not a MoE: its loader creates expert tensors its graph never uses",
    # Dense architectures whose loader also takes experts when expert_count > 0.
    "ernie4_5": "dense; its MoE files are ernie4_5-moe",
    "paddleocr": "dense (an OCR model on the ernie4_5 loader)",
    "lfm2": "dense; its MoE files are lfm2moe",
    "granite": "dense; its MoE files are granitemoe",
    "nemotron_h": "dense; its MoE files are nemotron_h_moe",
    **{arch: _NOT_YET for arch in (
        "dots3note", "glm5-next",
        "hy_v4",
        "minimax-01", "minimax-m3", "qwen4exp",
    )},
}

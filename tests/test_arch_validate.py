"""Metadata that makes the pinned llama.cpp kill the process (GGML_ASSERT / GGML_ABORT, see
ARCHITECTURES.md section 6) is refused in Python first: one line on stderr, exit status 1, never a
signal. Each malformed file is a tiny fixture with one key changed, run through the CLI in a
subprocess so that an abort would show as a negative return code instead of ending the suite."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter
from gguf.gguf_writer import GGUFValue

from bmoe.errors import ModelFileError
from bmoe.io.validate import open_layout
from bmoe.synth import tiny as tiny_mod
from bmoe.synth.tiny import TinySpec, write_tiny


def set_u32(key: str, value: int) -> Callable[[GGUFWriter], None]:
    def edit(w: GGUFWriter) -> None:
        w.kv_data[0][key] = GGUFValue(value, GGUFValueType.UINT32)

    return edit


def drop(key: str) -> Callable[[GGUFWriter], None]:
    def edit(w: GGUFWriter) -> None:
        del w.kv_data[0][key]

    return edit


def set_value(key: str, value: object, vtype: GGUFValueType, sub: GGUFValueType | None = None) -> Callable[[GGUFWriter], None]:
    def edit(w: GGUFWriter) -> None:
        w.kv_data[0][key] = GGUFValue(value, vtype, sub)

    return edit


def rename_arch(old: str, new: str, then: Callable[[GGUFWriter], None] | None = None) -> Callable[[GGUFWriter], None]:
    """The same file under another architecture's keys (validation is all this reaches)."""

    def edit(w: GGUFWriter) -> None:
        kv = w.kv_data[0]
        for key in [k for k in kv if k.startswith(old + ".")]:
            kv[new + key[len(old):]] = kv.pop(key)
        kv["general.architecture"] = GGUFValue(new, GGUFValueType.STRING)
        if then is not None:
            then(w)

    return edit


def nul_twin(w: GGUFWriter) -> None:
    """The last token made the one before it plus a NUL: llama.cpp keys tokens by C string."""
    value = w.kv_data[0]["tokenizer.ggml.tokens"]
    tokens = list(value.value)
    tokens[-1] = tokens[-2] + "\0"
    w.kv_data[0]["tokenizer.ggml.tokens"] = GGUFValue(tokens, value.type, value.sub_type)


# (id, spec, metadata edit, what the one line must say)
FAULTS = [
    # Issue 39.3: what only the first-open child caught (each aborted the unisolated process).
    ("dense-ffn-width-deleted", TinySpec(arch="glm4moe"), drop("glm4moe.feed_forward_length"),
     "feed_forward_length is missing or 0"),
    ("shared-count-zero", TinySpec(arch="dots1"), set_u32("dots1.expert_shared_count", 0),
     "expert_shared_count' is 0"),
    ("l-cache-zero", TinySpec(arch="lfm2moe"), set_u32("lfm2moe.shortconv.l_cache", 0), "shortconv.l_cache' is 0"),
    ("mla-kv-heads-deleted", TinySpec(arch="deepseek2"), drop("deepseek2.attention.head_count_kv"),
     "head_count_kv must be 1 with latent attention"),
    ("mla-key-length-deleted", TinySpec(arch="deepseek2"), drop("deepseek2.attention.key_length"),
     "key_length must be kv_lora_rank"),
    ("mla-rope-deleted", TinySpec(arch="deepseek2"), drop("deepseek2.rope.dimension_count"),
     "leaves no room beside"),
    ("gdn-inner-size-zero", TinySpec(arch="qwen35moe"), set_u32("qwen35moe.ssm.inner_size", 0),
     "ssm.inner_size is 0"),
    ("rope-dims-odd", TinySpec(arch="glm4moe"), set_u32("glm4moe.rope.dimension_count", 1),
     "rope.dimension_count is 1; llama.cpp's rope needs it even"),
    ("full-rope-narrow", TinySpec(arch="hunyuan-moe"), set_u32("hunyuan-moe.rope.dimension_count", 8),
     "ropes the whole head"),
    ("token-equal-up-to-nul", TinySpec(arch="qwen3moe"), nul_twin, "are the same string"),
    # Issue 37's first batch (granitemoe, bailingmoe, deepseek, smallthinker, phimoe).
    ("gating-absent-smallthinker", TinySpec(arch="smallthinker"), drop("smallthinker.expert_gating_func"),
     "expert_gating_func"),
    ("granite-rope-narrow", TinySpec(arch="granitemoe"), set_u32("granitemoe.rope.dimension_count", 16),
     "ropes the whole head"),
    ("shared-count-zero-bailingmoe", TinySpec(arch="bailingmoe"), set_u32("bailingmoe.expert_shared_count", 0),
     "expert_shared_count' is 0"),
    ("shared-count-zero-deepseek", TinySpec(arch="deepseek"), set_u32("deepseek.expert_shared_count", 0),
     "expert_shared_count' is 0"),
    ("phimoe-rope-odd", TinySpec(arch="phimoe"), set_u32("phimoe.rope.dimension_count", 7), "needs it even"),
    ("afmoe-window-zero", TinySpec(arch="afmoe"), set_u32("afmoe.attention.sliding_window", 0),
     "sliding_window' is 0"),
    ("dbrx-one-head", TinySpec(arch="dbrx"), set_u32("dbrx.attention.head_count", 1), "the dbrx metadata says"),
    ("mla-kv-heads-deleted-mistral4", TinySpec(arch="mistral4"), drop("mistral4.attention.head_count_kv"),
     "head_count_kv must be 1 with latent attention"),
    ("arctic-width-deleted", TinySpec(arch="arctic"), drop("arctic.feed_forward_length"), "feed_forward_length"),
    ("ling3-gate-bound-positive", TinySpec(arch="bailingmoe3"),
     set_value("bailingmoe3.kda.gate_lower_bound", 1.0, GGUFValueType.FLOAT32), "gate_lower_bound is 1.0"),
    ("ling3-safe-gate-false", TinySpec(arch="bailingmoe3"),
     set_value("bailingmoe3.kda.safe_gate", False, GGUFValueType.BOOL), "safe_gate is False"),
    ("kimi-linear-gating-none", TinySpec(arch="kimi-linear"), set_u32("kimi-linear.expert_gating_func", 0),
     "expert_gating_func is 0"),
    ("dsa-indexer-head-32", TinySpec(arch="deepseek32"), set_u32("deepseek32.attention.indexer.key_length", 32),
     "indexer.key_length is 32"),
    ("ocr-rope-base", TinySpec(arch="deepseek2-ocr"),
     set_value("deepseek2-ocr.rope.freq_base", 20000.0, GGUFValueType.FLOAT32), "asserts 10000"),
    ("exaone-gating-absent", TinySpec(arch="exaone-moe"), drop("exaone-moe.expert_gating_func"),
     "expert_gating_func"),
    ("laguna-gate-width", TinySpec(arch="laguna"), set_u32("laguna.attention.head_count", 8),
     "the laguna metadata says"),
    ("jamba-inner-size", TinySpec(arch="jamba"), set_u32("jamba.ssm.inner_size", 128), "asserts twice"),
    ("granitehybrid-inner-size", TinySpec(arch="granitehybrid"), set_u32("granitehybrid.ssm.inner_size", 128),
     "asserts twice"),
    ("ling3-conv-kernel-zero", TinySpec(arch="bailingmoe3"), set_u32("bailingmoe3.ssm.conv_kernel", 0),
     "ssm.conv_kernel' is 0"),
    ("granite-logit-scale-zero", TinySpec(arch="granitemoe"),
     set_value("granitemoe.logit_scale", 0.0, GGUFValueType.FLOAT32), "logit_scale' is 0.0, not a positive"),
    ("gating-absent", TinySpec(arch="minimax-m2"), drop("minimax-m2.expert_gating_func"), "expert_gating_func"),
    ("gating-absent-dots1", TinySpec(arch="dots1"), drop("dots1.expert_gating_func"), "expert_gating_func"),
    ("gating-invalid", TinySpec(arch="glm4moe"), set_u32("glm4moe.expert_gating_func", 7), "expert_gating_func is 7"),
    ("gating-none", TinySpec(arch="bailingmoe2"), set_u32("bailingmoe2.expert_gating_func", 0), "expert_gating_func is 0"),
    ("groups-do-not-divide", TinySpec(arch="bailingmoe2"), set_u32("bailingmoe2.expert_group_count", 3),
     "does not divide"),
    ("group-used-too-many", TinySpec(arch="bailingmoe2"), set_u32("bailingmoe2.expert_group_used_count", 2),
     "expert_group_used_count is 2"),
    ("group-used-zero", TinySpec(arch="deepseek2"), set_u32("deepseek2.expert_group_used_count", 0),
     "expert_group_used_count is 0"),
    ("nextn-beyond-blocks", TinySpec(arch="glm4moe", n_nextn=1), set_u32("glm4moe.nextn_predict_layers", 9),
     "nextn_predict_layers is 9"),
    ("block-count-zero", TinySpec(arch="qwen3vlmoe"), set_u32("qwen3vlmoe.block_count", 0), "block_count is 0"),
    ("zero-rope-sections", TinySpec(arch="qwen3vlmoe"),
     set_value("qwen3vlmoe.rope.dimension_sections", [0, 0, 0, 0], GGUFValueType.ARRAY, GGUFValueType.INT32),
     "all-zero sections"),
    ("used-over-count", TinySpec(arch="llama4"), set_u32("llama4.expert_used_count", 9), "expert_used_count is 9"),
    # glm4moe's loader asserts n_expert > 0 && n_expert_used > 0 (glm4-moe.cpp:42-43).
    ("used-zero", TinySpec(arch="glm4moe"), set_u32("glm4moe.expert_used_count", 0), "expert_used_count is 0"),
    ("groups-as-many-as-experts", TinySpec(arch="bailingmoe2"), set_u32("bailingmoe2.expert_group_count", 8),
     "expert_group_count is 8, not fewer than the 8 experts"),
    ("groups-out-of-range", TinySpec(arch="bailingmoe2"), set_u32("bailingmoe2.expert_group_count", 0xFFFFFFFF),
     "expert_group_count is 4294967295, not fewer than"),  # was "does not divide"
    ("block-count-over-max", TinySpec(arch="qwen3vlmoe"), set_u32("qwen3vlmoe.block_count", 513),
     "block_count is 513"),
    ("count-zero", TinySpec(arch="gpt-oss"), set_u32("gpt-oss.expert_count", 0), "expert_used_count is 2"),
    ("rope-scaling-unknown", TinySpec(arch="qwen35moe"),
     set_value("qwen35moe.rope.scaling.type", "warp", GGUFValueType.STRING), "rope.scaling.type is 'warp'"),
    ("ernie-step-zero", TinySpec(arch="ernie4_5-moe"), set_u32("ernie4_5-moe.interleave_moe_layer_step", 0),
     "interleave_moe_layer_step is 0"),
    ("hybrid-without-attention", TinySpec(arch="qwen3next"), set_u32("qwen3next.full_attention_interval", 4),
     "none of the 2 blocks attends"),
    ("conv-only-lfm2", TinySpec(arch="lfm2moe"),
     set_value("lfm2moe.attention.head_count_kv", [0, 0, 0], GGUFValueType.ARRAY, GGUFValueType.INT32),
     "none of the 3 blocks attends"),
    ("lfm2-kv-heads-short", TinySpec(arch="lfm2moe"),  # was "none of the 3 blocks attends"
     set_value("lfm2moe.attention.head_count_kv", [2], GGUFValueType.ARRAY, GGUFValueType.INT32),
     "head_count_kv' has 1 values for 3 layers"),
    ("olmoe-without-ffn-width", TinySpec(arch="qwen3moe"), rename_arch("qwen3moe", "olmoe"), "olmoe.feed_forward_length"),
    ("llama-ffn-width-wrong", TinySpec(arch="qwen3moe"),
     rename_arch("qwen3moe", "llama", set_u32("llama.feed_forward_length", 48)), "llama.feed_forward_length is 48"),
]


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bmoe.cli", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("spec,edit,message", [f[1:] for f in FAULTS], ids=[f[0] for f in FAULTS])
def test_aborting_metadata_is_one_line_exit_1(tmp_path: Path, spec: TinySpec, edit, message: str) -> None:  # noqa: ANN001
    (path,) = write_tiny(tmp_path / "bad.gguf", spec, edit_metadata=edit)
    with pytest.raises(ModelFileError, match=message.replace("(", r"\(")):
        open_layout(path)
    done = cli("run", "-m", str(path), "-p", "hello", "-n", "2")
    assert done.returncode == 1, f"status {done.returncode} (negative: killed by a signal)\n{done.stderr}"
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bmoe: error: ") and message in lines[0], done.stderr


@pytest.mark.parametrize("suffix", ["attn_sinks.weight", "ffn_down_exps.bias", "ffn_gate_inp.bias"])
def test_non_f32_sinks_and_biases_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, suffix: str) -> None:
    """gpt-oss's sinks and per-expert / router biases go to kernels that assert F32: a file with
    F16 there would abort at decode."""
    original = tiny_mod._Builder.f32

    def f32(self, name: str, shape: tuple[int, ...], std: float) -> None:  # noqa: ANN001
        original(self, name, shape, std)
        if name.endswith(suffix):
            t = self.out[-1]
            self.out[-1] = tiny_mod._Tensor(t.name, t.shape, GGMLQuantizationType.F16, t.chunks)

    monkeypatch.setattr(tiny_mod._Builder, "f32", f32)
    (path,) = write_tiny(tmp_path / "bad.gguf", TinySpec(arch="gpt-oss"))
    done = cli("run", "-m", str(path), "-p", "hello", "-n", "2")
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines() == [done.stderr.strip()]
    assert f"{suffix} is F16; llama.cpp needs F32" in done.stderr


def test_without_validation_the_same_fault_kills_the_process(tmp_path: Path) -> None:
    """The control: handed straight to llama.cpp, a file these checks refuse aborts the process."""
    (path,) = write_tiny(tmp_path / "bad.gguf", TinySpec(arch="bailingmoe2"),
                         edit_metadata=set_u32("bailingmoe2.expert_gating_func", 0))
    code = ("import llama_cpp, sys; llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=64, verbose=False); "
            "llm('hello', max_tokens=2)")
    done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode < 0, f"status {done.returncode}: llama.cpp no longer aborts here?"
    assert cli("run", "-m", str(path), "-p", "hello", "-n", "2").returncode == 1


# Where each issue-39 fault kills plain llama.cpp: at load, context or first decode ("abort"), or
# only on the user open bmoe's streamed run takes, which creates tensors from the keys alone (the
# loader's ne[dim] >= 1 assert; a plain load of the same file fails cleanly instead).
_LOAD_ERROR_IN_PLAIN = ("dense-ffn-width-deleted", "shared-count-zero", "l-cache-zero", "shared-count-zero-bailingmoe",
                        "shared-count-zero-deepseek", "ling3-conv-kernel-zero", "dsa-indexer-head-32",
                        "exaone-gating-absent", "laguna-gate-width")
_NO_CONTROL = ("granite-logit-scale-zero", "arctic-width-deleted")  # NaN logits / a clean load error, no abort
_FIRST_OLD = [f[0] for f in FAULTS].index("gating-absent")  # those before it came with issues 39 and 37
ISSUE_39_FAULTS = [(f, "load error" if f[0] in _LOAD_ERROR_IN_PLAIN else "abort") for f in FAULTS[:_FIRST_OLD]
                   if f[0] not in _NO_CONTROL]


@pytest.mark.parametrize("spec,edit,plain", [(*f[1:3], k) for f, k in ISSUE_39_FAULTS],
                         ids=[f[0] for f, _ in ISSUE_39_FAULTS])
def test_each_issue_39_fault_breaks_plain_llama_cpp(tmp_path: Path, spec: TinySpec, edit, plain: str) -> None:  # noqa: ANN001
    """The control of the faults above that only the first-open child used to catch: handed to
    llama.cpp without bmoe's checks, each file is broken there too (so refusing it is no guess)."""
    (path,) = write_tiny(tmp_path / "bad.gguf", spec, edit_metadata=edit)
    code = ("import llama_cpp, sys; llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=64, verbose=False); "
            "llm('hello', max_tokens=2)")
    done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120)
    if plain == "abort":
        assert done.returncode < 0, f"status {done.returncode}: llama.cpp no longer aborts here?\n{done.stderr[-400:]}"
    else:
        assert done.returncode == 1 and "Failed to load model" in done.stderr, done.stderr[-400:]


def test_an_indexer_head_not_a_multiple_of_64_is_refused_where_llama_cpp_aborts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """deepseek32's indexer keys get a Hadamard rotation of at least 64 x 64: a file whose indexer
    head is 32 wide throughout (keys and tensors agreeing) loads, then aborts at the first decode."""
    import dataclasses

    from bmoe.synth.families import FAMILIES

    family = FAMILIES["deepseek32"]
    extra = tuple((k, 32 if k == "ix_head" else v) for k, v in family.extra)
    monkeypatch.setitem(FAMILIES, "deepseek32", dataclasses.replace(family, extra=extra))
    (path,) = write_tiny(tmp_path / "bad.gguf", TinySpec(arch="deepseek32"))
    done = cli("run", "-m", str(path), "-p", "hello", "-n", "2")
    assert done.returncode == 1 and "indexer.key_length is 32" in done.stderr, done.stderr
    code = ("import llama_cpp, sys; llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=64, verbose=False); "
            "llm('hello', max_tokens=2)")
    plain = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120)
    assert plain.returncode < 0, f"status {plain.returncode}: llama.cpp no longer aborts here?"

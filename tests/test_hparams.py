"""Metadata llama.cpp asserts on (or spins with) is refused in Python: one line, exit 1, no signal.

Each case edits one value of a valid tiny model in place; unchecked, every one of them killed the
process with SIGABRT inside llama.cpp (or, gemma4 with no rope dimension, decoded forever).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGUFReader, GGUFValueType
from gguf.gguf_writer import GGUFValue

from bmoe.errors import ModelFileError
from bmoe.io.validate import open_layout
from bmoe.synth.tiny import TinySpec, write_tiny

CASES = {
    "rope_not_head_size": ("qwen3moe", {"rope.dimension_count": 48}, "rope.dimension_count"),
    "head_count_0": ("qwen3moe", {"attention.head_count": 0}, "head_count"),
    "head_count_kv_0": ("qwen3moe", {"attention.head_count_kv": 0}, "head_count_kv"),
    "embedding_length_0": ("qwen3moe", {"embedding_length": 0}, "embedding_length"),
    "key_length_0": ("qwen3moe", {"attention.key_length": 0}, "key_length"),
    "value_length_0": ("qwen3moe", {"attention.value_length": 0}, "value_length"),
    "key_value_differ": ("qwen3moe", {"attention.value_length": 16}, "value_length"),
    "expert_ff_0": ("qwen3moe", {"expert_feed_forward_length": 0}, "expert_feed_forward_length"),
    "eps_nan": ("qwen3moe", {"attention.layer_norm_rms_epsilon": float("nan")}, "epsilon"),
    "eps_negative": ("qwen3moe", {"attention.layer_norm_rms_epsilon": -1.0}, "epsilon"),
    "block_count_huge": ("qwen3moe", {"block_count": 2**31 - 1}, "block_count"),
    "block_count_more_than_tensors": ("qwen3moe", {"block_count": 3}, "block_count"),
    "used_over_count": ("qwen3moe", {"expert_used_count": 9}, "expert_used_count"),
    "qwen2moe_rope": ("qwen2moe", {"rope.dimension_count": 16}, "rope.dimension_count"),
    "qwen2moe_shared_expert_0": ("qwen2moe", {"expert_shared_feed_forward_length": 0}, "shared expert"),
    "per_layer_embd_overflow": ("gemma4", {"embedding_length_per_layer_input": 0x80000000}, "per_layer"),
    "gemma4_rope_0": ("gemma4", {"rope.dimension_count": 0}, "rope.dimension_count"),
    "gemma4_rope_odd": ("gemma4", {"rope.dimension_count": 15}, "rope.dimension_count"),
    # Not asserts: NaN logits, and token 0 printed with exit 0 (the fuzzing audit of 2026-12-07).
    "freq_base_nan": ("qwen3moe", {"rope.freq_base": float("nan")}, "rope.freq_base"),
    "freq_base_0": ("qwen3moe", {"rope.freq_base": 0.0}, "rope.freq_base"),
    "freq_base_swa_inf": ("gemma4", {"rope.freq_base_swa": float("inf")}, "rope.freq_base_swa"),
}


def _token_types_99(w) -> None:  # noqa: ANN001
    old = w.kv_data[0]["tokenizer.ggml.token_type"]
    w.kv_data[0]["tokenizer.ggml.token_type"] = GGUFValue([99] * len(old.value), GGUFValueType.ARRAY,
                                                          GGUFValueType.INT32)


def _scores_as_ints(w) -> None:  # noqa: ANN001
    old = w.kv_data[0]["tokenizer.ggml.scores"]
    w.kv_data[0]["tokenizer.ggml.scores"] = GGUFValue([0x7FC00000] * len(old.value), GGUFValueType.ARRAY,
                                                      GGUFValueType.INT32)


def _template_int(w) -> None:  # noqa: ANN001
    w.kv_data[0]["tokenizer.chat_template"] = GGUFValue(5, GGUFValueType.UINT32)


def _eos_outside(w) -> None:  # noqa: ANN001
    w.kv_data[0]["tokenizer.ggml.eos_token_id"] = GGUFValue(10**6, GGUFValueType.UINT32)


def _short_swa_pattern(w) -> None:  # noqa: ANN001
    w.kv_data[0]["gemma4.attention.sliding_window_pattern"] = GGUFValue([True], GGUFValueType.ARRAY,
                                                                        GGUFValueType.BOOL)


def _short_expert_width(w) -> None:  # noqa: ANN001 - was "missing or not an integer"
    w.kv_data[0]["qwen3moe.expert_feed_forward_length"] = GGUFValue([64], GGUFValueType.ARRAY, GGUFValueType.UINT32)


def _alignment_1(w) -> None:  # noqa: ANN001
    w.kv_data[0]["general.alignment"] = GGUFValue(1, GGUFValueType.UINT32)
    w.data_alignment = 1


WRITTEN = {  # (arch, edit, words of the one line): files llama.cpp runs wrongly, or --resident aborts on
    "token_type_99": ("qwen3moe", _token_types_99, ("token 0 has type 99",)),
    "scores_int32": ("qwen3moe", _scores_as_ints, ("tokenizer.ggml.scores", "INT32")),
    "template_not_text": ("qwen3moe", _template_int, ("chat_template",)),
    "eos_outside_vocab": ("qwen3moe", _eos_outside, ("eos_token_id", "outside the vocabulary")),
    "swa_pattern_short": ("gemma4", _short_swa_pattern, ("sliding_window_pattern", "1 values")),
    "data_not_32_aligned": ("qwen3moe", _alignment_1, ("not a multiple of 32",)),
    "expert_width_short": ("qwen3moe", _short_expert_width, ("expert_feed_forward_length", "1 values for 2 layers")),
}


def _patched(src: Path, dst: Path, arch: str, edits: dict[str, float]) -> Path:
    shutil.copy(src, dst)
    reader = GGUFReader(dst, "r+")
    for key, value in edits.items():
        field = reader.fields[f"{arch}.{key}"]
        field.parts[field.data[0]][0] = value
    del reader
    return dst


def _duplicate_token(src: Path, dst: Path) -> Path:
    """Two tokens of the same length made the same string: a one- or two-byte change."""
    data = bytearray(src.read_bytes())
    reader = GGUFReader(src)
    field = reader.fields["tokenizer.ggml.tokens"]
    base = reader.data.__array_interface__["data"][0]
    parts = [field.parts[i] for i in field.data]
    a, b = next((a, b) for a, b in zip(parts[300:], parts[301:]) if len(a) == len(b))
    start = b.__array_interface__["data"][0] - base
    data[start : start + len(b)] = bytes(a)
    del reader
    dst.write_bytes(data)
    return dst


def _relabelled(src: Path, dst: Path, old: bytes, new: bytes) -> Path:
    """Every ``old.`` key and the architecture renamed in place (same length): the tensors stay."""
    data = src.read_bytes()
    head = 1 << 18
    dst.write_bytes(data[:head].replace(old, new) + data[head:])
    return dst


def bmoe_run(path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bmoe.cli", "run", "-m", str(path), "-p", "hello there", "-n", "3", "-c", "256",
         *extra],
        capture_output=True, text=True, timeout=60,
    )


def assert_one_line(proc: subprocess.CompletedProcess[str], *words: str) -> None:
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bmoe: error: "), proc.stderr[-2000:]
    for word in words:
        assert word in lines[0], lines[0]


@pytest.mark.parametrize("case", sorted(CASES))
def test_metadata_fault_is_one_line(tiny, tmp_path: Path, case: str) -> None:
    arch, edits, word = CASES[case]
    bad = _patched(tiny.path(TinySpec(arch=arch)), tmp_path / f"{case}.gguf", arch, edits)
    with pytest.raises(ModelFileError):
        open_layout(bad)
    assert_one_line(bmoe_run(bad), word)


@pytest.mark.parametrize("case", sorted(WRITTEN))
def test_written_fault_is_one_line_streamed_and_resident(tmp_path: Path, case: str) -> None:
    arch, edit, words = WRITTEN[case]
    (bad,) = write_tiny(tmp_path / f"{case}.gguf", TinySpec(arch=arch), edit_metadata=edit)
    with pytest.raises(ModelFileError):
        open_layout(bad)
    assert_one_line(bmoe_run(bad), *words)
    assert_one_line(bmoe_run(bad, "--resident"), *words)  # alignment 1: SIGABRT in llama.cpp's mmap load


def test_duplicate_token_is_one_line(tiny, tmp_path: Path) -> None:
    bad = _duplicate_token(tiny.path(TinySpec()), tmp_path / "dup.gguf")
    assert_one_line(bmoe_run(bad), "same string")
    assert_one_line(bmoe_run(bad, "--resident"), "same string")


@pytest.mark.parametrize("old,new", [(b"qwen3moe", b"qwen2moe"), (b"qwen2moe", b"qwen3moe")])
def test_relabelled_architecture_is_one_line(tiny, tmp_path: Path, old: bytes, new: bytes) -> None:
    src = tiny.path(TinySpec(arch=old.decode()))
    bad = _relabelled(src, tmp_path / "relabel.gguf", old, new)
    assert_one_line(bmoe_run(bad), "relabelled")


def test_valid_models_pass_every_check(tiny) -> None:
    """The negative control: the unedited files open and run."""
    for arch in ("qwen3moe", "qwen2moe", "gemma4"):
        open_layout(tiny.path(TinySpec(arch=arch)))
    proc = bmoe_run(tiny.path(TinySpec(arch="gemma4")))
    assert proc.returncode == 0, proc.stderr

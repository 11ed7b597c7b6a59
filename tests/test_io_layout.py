"""GGUF layout reading and validation, on tiny hand-made files (valid and deliberately broken)."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

from bmoe.errors import (
    ExpertLayoutError,
    GGUFVersionError,
    MissingKeyError,
    MissingShardError,
    ModelFileError,
    NotGGUFError,
    TruncatedFileError,
    UnsupportedArchitectureError,
)
from bmoe.io.layout import read_layout, split_shard_paths
from bmoe.io.validate import open_layout

SUFFIXES = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
DROP = object()  # a kv or tensor override that removes the entry


def model_tensors(n_layer: int = 2, n_expert: int = 4, embd: int = 16, ff: int = 8) -> dict[str, np.ndarray]:
    """A qwen3moe-shaped tensor set; values are distinct so misplaced bytes are detected."""
    rng = np.random.default_rng(0)
    vocab = 32

    def t(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    tensors = {"token_embd.weight": t(vocab, embd), "output_norm.weight": t(embd)}
    for il in range(n_layer):
        tensors[f"blk.{il}.attn_norm.weight"] = t(embd)
        tensors[f"blk.{il}.ffn_gate_inp.weight"] = t(n_expert, embd)
        # numpy order is ggml order reversed: ne = (embd, ff, n_expert) for gate and up.
        tensors[f"blk.{il}.ffn_gate_exps.weight"] = t(n_expert, ff, embd)
        tensors[f"blk.{il}.ffn_up_exps.weight"] = t(n_expert, ff, embd)
        tensors[f"blk.{il}.ffn_down_exps.weight"] = t(n_expert, embd, ff)
    return tensors


def model_kv(arch: str = "qwen3moe", n_layer: int = 2, n_expert: int = 4, n_used: int = 2) -> dict[str, Any]:
    return {
        f"{arch}.block_count": n_layer,
        f"{arch}.context_length": 128,
        f"{arch}.embedding_length": 16,
        f"{arch}.attention.head_count": 2,
        f"{arch}.expert_count": n_expert,
        f"{arch}.expert_used_count": n_used,
        f"{arch}.expert_feed_forward_length": 8,
        "general.name": "tiny",
        f"{arch}.rope.freq_base": 10000.0,
        "tokenizer.ggml.tokens": [f"t{i}" for i in range(32)],
        "tokenizer.ggml.token_type": [1] * 32,
    }


def write_model(
    path: Path,
    *,
    arch: str = "qwen3moe",
    kv: dict[str, Any] | None = None,
    tensors: dict[str, Any] | None = None,
    split_max_tensors: int = 0,
    **shape: int,
) -> dict[str, np.ndarray]:
    """Write a model (overrides: value DROP removes an entry); returns the tensors written."""
    all_kv = model_kv(arch, **{k: v for k, v in shape.items() if k in ("n_layer", "n_expert")}) | (kv or {})
    all_t = model_tensors(**shape) | (tensors or {})
    w = GGUFWriter(path, arch, split_max_tensors=split_max_tensors)
    for key, value in all_kv.items():
        if value is DROP:
            w.kv_data[0].pop(key, None)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, (str, list)):
            w.add_key_value(key, value, GGUFValueType.STRING if isinstance(value, str) else GGUFValueType.ARRAY)
    written = {name: a for name, a in all_t.items() if a is not DROP}
    for name, a in written.items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written


@pytest.fixture
def model(tmp_path: Path) -> Path:
    path = tmp_path / "m.gguf"
    write_model(path)
    return path


def patch(path: Path, offset: int, data: bytes) -> None:
    with path.open("r+b") as f:
        f.seek(offset)
        f.write(data)


def field_value_offset(path: Path, key: str) -> int:
    """Offset of the value of a KV (just after its type field)."""
    return GGUFReader(path).fields[key].offset + 8 + len(key.encode()) + 4


def tensor_type_offset(path: Path, name: str) -> int:
    t = next(t for t in GGUFReader(path).tensors if t.name == name)
    return t.field.offset + 8 + len(name.encode()) + 4 + 8 * len(t.shape)


def raises_exactly(cls: type[Exception], path: Path, match: str | None = None) -> str:
    with pytest.raises(cls, match=match) as info:
        open_layout(path)
    assert info.type is cls, f"{info.type.__name__}: {info.value}"
    message = str(info.value)
    assert "\n" not in message
    return message


# --- valid files ---------------------------------------------------------------------------


def test_single_file_layout(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    written = write_model(path)
    layout = open_layout(path)
    assert layout.shards == (path,)
    assert (layout.arch, layout.n_layer, layout.n_expert, layout.n_expert_used) == ("qwen3moe", 2, 4, 2)
    assert layout.moe_layers == (0, 1)
    assert set(layout.tensors) == set(written)
    data = path.read_bytes()
    for name, array in written.items():
        span = layout.tensors[name]
        assert span.shard == 0 and span.ne == tuple(reversed(array.shape))
        assert span.ggml_type == GGMLQuantizationType.F32
        assert data[span.offset : span.offset + span.nbytes] == array.tobytes()  # offsets are absolute
    e = layout.experts[1, "ffn_down_exps"]
    assert (e.n_expert, e.stride) == (4, 16 * 8 * 4)
    array = written["blk.1.ffn_down_exps.weight"]
    assert data[e.file_offset(3) : e.file_offset(3) + e.stride] == array[3].tobytes()
    assert [x.suffix for x in layout.layer_experts(0)] == list(SUFFIXES)
    assert layout.expert_bytes == sum(written[f"blk.{i}.{s}.weight"].nbytes for i in (0, 1) for s in SUFFIXES)
    assert layout.dense_bytes + layout.expert_bytes == sum(a.nbytes for a in written.values())
    assert layout.file_bytes == path.stat().st_size
    assert layout.expert_bytes_per_token() == 2 * 2 * 3 * 16 * 8 * 4
    assert layout.metadata["qwen3moe.expert_count"] == 4
    assert layout.metadata["general.name"] == "tiny"
    assert "tokenizer.ggml.tokens" not in layout.metadata


def test_three_shard_split(tmp_path: Path) -> None:
    written = write_model(tmp_path / "m.gguf", split_max_tensors=5)
    shards = tuple(tmp_path / f"m-{i:05d}-of-00003.gguf" for i in (1, 2, 3))
    assert all(p.is_file() for p in shards) and not (tmp_path / "m.gguf").exists()
    layout = open_layout(shards[0])
    assert layout.shards == shards
    assert {s.shard for s in layout.tensors.values()} == {0, 1, 2}
    assert set(layout.tensors) == set(written)
    for name, array in written.items():
        span = layout.tensors[name]
        with shards[span.shard].open("rb") as f:
            f.seek(span.offset)
            assert f.read(span.nbytes) == array.tobytes()
    assert layout.metadata["split.count"] == 3


@pytest.mark.parametrize("split_max_tensors", [0, 5])
def test_index_agrees_with_gguf_py(tmp_path: Path, split_max_tensors: int) -> None:
    """gguf-py's GGUFReader is the reference parser: same offsets, sizes, shapes, types, values."""
    write_model(tmp_path / "m.gguf", split_max_tensors=split_max_tensors)
    layout = read_layout(sorted(tmp_path.glob("m*.gguf"))[0])
    for shard, path in enumerate(layout.shards):
        reader = GGUFReader(path)
        for t in reader.tensors:
            span = layout.tensors[t.name]
            assert (span.shard, span.offset, span.nbytes) == (shard, t.data_offset, t.n_bytes)
            assert (span.ne, span.ggml_type) == (tuple(int(d) for d in t.shape), int(t.tensor_type))
    reader = GGUFReader(layout.shards[0])
    scalars = {
        k: f.contents()
        for k, f in reader.fields.items()
        if not k.startswith("GGUF.") and f.types[0] != GGUFValueType.ARRAY
    }
    assert dict(layout.metadata) == scalars


def test_split_shard_paths(tmp_path: Path) -> None:
    assert split_shard_paths(tmp_path / "a.gguf") == (tmp_path / "a.gguf",)
    assert split_shard_paths(tmp_path / "a-b-00002-of-00002.gguf") == (
        tmp_path / "a-b-00001-of-00002.gguf",
        tmp_path / "a-b-00002-of-00002.gguf",
    )


def test_read_layout_without_validation_parses(model: Path) -> None:
    assert read_layout(model).moe_layers == (0, 1)


# --- files that are not usable GGUF ----------------------------------------------------------


def test_missing_file(tmp_path: Path) -> None:
    raises_exactly(ModelFileError, tmp_path / "nope.gguf", "no such file")


def test_directory(tmp_path: Path) -> None:
    raises_exactly(ModelFileError, tmp_path, "not a regular file")


def test_not_gguf(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(100))
    raises_exactly(NotGGUFError, path, "not a GGUF")


@pytest.mark.parametrize("content", [b"", b"GG", b"GGUF\x03\x00\x00\x00"])
def test_too_short(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(content)
    raises_exactly(NotGGUFError, path, "too short")


@pytest.mark.parametrize("version", [struct.pack("<I", 1), struct.pack("<I", 4), struct.pack(">I", 3)])
def test_unsupported_version(model: Path, version: bytes) -> None:
    patch(model, 4, version)
    raises_exactly(GGUFVersionError, model)


def test_version_2_accepted(model: Path) -> None:
    patch(model, 4, struct.pack("<I", 2))
    assert open_layout(model).n_expert == 4


@pytest.mark.parametrize("field_offset", [8, 16], ids=["tensor_count", "kv_count"])
def test_absurd_header_counts(model: Path, field_offset: int) -> None:
    patch(model, field_offset, struct.pack("<Q", 2**62))
    raises_exactly(TruncatedFileError, model, "header claims")


def test_absurd_array_length(model: Path) -> None:
    # type (u32) then count (u64) of the array's elements
    patch(model, field_value_offset(model, "tokenizer.ggml.token_type") + 4, struct.pack("<Q", 2**61))
    raises_exactly(TruncatedFileError, model, "token_type")


def test_absurd_string_array_length(model: Path) -> None:
    patch(model, field_value_offset(model, "tokenizer.ggml.tokens") + 4, struct.pack("<Q", 2**61))
    raises_exactly(TruncatedFileError, model, "tokens")


def test_header_cut_short(model: Path) -> None:
    index_end = GGUFReader(model).tensors[0].field.offset + 40  # inside the tensor index
    model.write_bytes(model.read_bytes()[:index_end])
    raises_exactly(TruncatedFileError, model, "past the end")


def test_tensor_data_cut_short(model: Path) -> None:
    data = model.read_bytes()
    model.write_bytes(data[:-8])
    message = raises_exactly(TruncatedFileError, model, "past the end")
    assert "blk.1.ffn_down_exps.weight" in message


def test_unknown_value_type(model: Path) -> None:
    patch(model, field_value_offset(model, "general.name") - 4, struct.pack("<I", 99))
    raises_exactly(ModelFileError, model, "unknown type 99")


def test_unknown_tensor_type(model: Path) -> None:
    patch(model, tensor_type_offset(model, "output_norm.weight"), struct.pack("<I", 999))
    raises_exactly(ModelFileError, model, "unknown ggml type")


def test_bad_alignment(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    write_model(path, kv={"general.alignment": 48})
    raises_exactly(ModelFileError, path, "power of two")


def test_nested_array(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    write_model(path, kv={"x.nested": [[1, 2], [3]]})
    raises_exactly(ModelFileError, path, "nested array")


def test_implausible_string_length(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("bmoe.io.layout._MAX_STRING", 8)  # the real cap is beyond any test file
    raises_exactly(ModelFileError, model, "claims")


def test_alignment_not_uint32(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    write_model(path, kv={"general.alignment": 32.0})
    raises_exactly(ModelFileError, path, "not UINT32")


def test_duplicate_tensor_name(model: Path) -> None:
    data = model.read_bytes()
    model.write_bytes(data.replace(b"blk.1.attn_norm.weight", b"blk.0.attn_norm.weight", 1))
    raises_exactly(ModelFileError, model, "appears twice")


def test_invalid_utf8_value_is_tolerated(model: Path) -> None:
    # llama.cpp does not check UTF-8 in values; neither may we.
    patch(model, field_value_offset(model, "general.name") + 8, b"\xff")
    assert open_layout(model).metadata["general.name"] == "\ufffdiny"


# --- metadata ---------------------------------------------------------------------------------


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    write_model(path, arch="gpt2")
    raises_exactly(UnsupportedArchitectureError, path, "gpt2")


def test_missing_architecture(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    write_model(path, kv={"general.architecture": DROP})
    raises_exactly(MissingKeyError, path, "general.architecture")


@pytest.mark.parametrize("key", ["expert_count", "expert_used_count", "expert_feed_forward_length", "block_count"])
def test_missing_required_key(tmp_path: Path, key: str) -> None:
    path = tmp_path / "m.gguf"
    write_model(path, kv={f"qwen3moe.{key}": DROP})
    raises_exactly(MissingKeyError, path, f"qwen3moe.{key}")


@pytest.mark.parametrize("used", [0, 5])
def test_expert_used_count_out_of_range(tmp_path: Path, used: int) -> None:
    path = tmp_path / "m.gguf"
    write_model(path, kv={"qwen3moe.expert_used_count": used})
    raises_exactly(ExpertLayoutError, path, "expert_used_count")


@pytest.mark.parametrize("value", [2.0, "2", True])
def test_non_integer_count(tmp_path: Path, value: object) -> None:
    path = tmp_path / "m.gguf"
    write_model(path, kv={"qwen3moe.expert_used_count": value})
    raises_exactly(ModelFileError, path, "not an integer")


# --- expert tensors ---------------------------------------------------------------------------


def test_layer_missing_an_expert_tensor(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    write_model(path, tensors={"blk.1.ffn_up_exps.weight": DROP})
    raises_exactly(ExpertLayoutError, path, "layer 1 lacks expert tensor.*ffn_up_exps")


def test_no_expert_tensors(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    write_model(path, tensors={f"blk.{i}.{s}.weight": DROP for i in (0, 1) for s in SUFFIXES})
    raises_exactly(ExpertLayoutError, path, "no expert tensors")


def test_tensor_expert_count_disagrees_with_metadata(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    write_model(path, kv={"qwen3moe.expert_count": 8})
    raises_exactly(ExpertLayoutError, path, "holds 4 experts, expert_count is 8")


def test_shapes_disagree_across_layers(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    odd = np.zeros((4, 16, 12), np.float32)  # ff 12 instead of 8
    write_model(path, tensors={"blk.1.ffn_down_exps.weight": odd})
    raises_exactly(ExpertLayoutError, path, "blk.1.ffn_down_exps.weight has shape")


def test_expert_tensor_not_3d(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    write_model(path, tensors={"blk.0.ffn_gate_exps.weight": np.zeros((8, 16), np.float32)})
    raises_exactly(ExpertLayoutError, path, "blk.0.ffn_gate_exps.weight")


def test_experts_beyond_block_count(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    write_model(path, kv={"qwen3moe.block_count": 1})
    raises_exactly(ExpertLayoutError, path, "block_count is 1")


def test_row_not_a_whole_number_of_blocks(tmp_path: Path) -> None:
    # ne[0] = 16 retyped as Q8_0 (32 per block): also what would make nbytes % n_expert != 0.
    path = tmp_path / "m.gguf"
    write_model(path)
    patch(path, tensor_type_offset(path, "blk.0.ffn_gate_exps.weight"), struct.pack("<I", GGMLQuantizationType.Q8_0))
    raises_exactly(ModelFileError, path, "not whole Q8_0 blocks of 32")


# --- split sets -------------------------------------------------------------------------------


def split_model(tmp_path: Path) -> tuple[Path, ...]:
    write_model(tmp_path / "m.gguf", split_max_tensors=5)
    return tuple(tmp_path / f"m-{i:05d}-of-00003.gguf" for i in (1, 2, 3))


def test_split_tensor_count_disagrees(tmp_path: Path) -> None:
    shards = split_model(tmp_path)
    patch(shards[0], field_value_offset(shards[0], "split.tensors.count"), struct.pack("<i", 99))
    raises_exactly(ModelFileError, shards[0], "split.tensors.count says 99")


def test_split_shard_missing(tmp_path: Path) -> None:
    shards = split_model(tmp_path)
    shards[1].unlink()
    raises_exactly(MissingShardError, shards[0], shards[1].name)


def test_split_opened_from_later_shard(tmp_path: Path) -> None:
    shards = split_model(tmp_path)
    raises_exactly(MissingShardError, shards[1], "not the first shard")


def test_split_first_shard_renamed(tmp_path: Path) -> None:
    shards = split_model(tmp_path)
    plain = shards[0].rename(tmp_path / "plain.gguf")
    raises_exactly(MissingShardError, plain, "split.count says 3")


def test_split_later_shard_renamed_as_plain_file(tmp_path: Path) -> None:
    shards = split_model(tmp_path)
    plain = shards[1].rename(tmp_path / "plain.gguf")
    raises_exactly(MissingShardError, plain, "split.no is 1 where shard 1")


def test_split_later_shard_counting_other_shards(tmp_path: Path) -> None:
    shards = split_model(tmp_path)
    patch(shards[1], field_value_offset(shards[1], "split.count"), struct.pack("<H", 5))
    raises_exactly(MissingShardError, shards[0], "split.count says 5")


def test_split_key_of_another_type(tmp_path: Path) -> None:
    """llama.cpp's loader reads split.count as UINT16 and refuses another type (``--resident``
    refused the set the streamed run opened)."""
    shards = split_model(tmp_path)
    patch(shards[1], field_value_offset(shards[1], "split.count") - 4, struct.pack("<I", GGUFValueType.INT16))
    raises_exactly(ModelFileError, shards[0], "split.count is INT16, not UINT16")


def test_split_key_missing(tmp_path: Path) -> None:
    shards = split_model(tmp_path)
    data = shards[0].read_bytes()
    shards[0].write_bytes(data.replace(b"split.tensors.count", b"split.tensors.cXunt", 1))
    raises_exactly(ModelFileError, shards[0], "lacks split.tensors.count")

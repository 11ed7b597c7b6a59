"""Shards of two models mixed in one split set (issue 39.9): what a shard's header can tell is
checked, and what it cannot is pinned here as the README says (one model's shard 2 in another's
set, same architecture, shapes and types, opens: only the tensor data differ)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from gguf import GGUFReader

from bmoe.errors import MissingShardError, ModelFileError
from bmoe.io.layout import read_layout
from bmoe.io.validate import open_layout
from bmoe.synth.tiny import TinySpec, write_tiny

pytestmark = pytest.mark.pure
SPEC = TinySpec(arch="qwen3moe", shards=3)


def two_sets(tmp_path: Path) -> tuple[list[Path], list[Path]]:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = write_tiny(tmp_path / "a" / "m.gguf", SPEC)
    b = write_tiny(tmp_path / "b" / "m.gguf", TinySpec(arch="qwen3moe", shards=3, seed=1))
    return a, b


def poke_scalar(path: Path, key: str, data: bytes) -> None:
    """Overwrite a scalar value in place (same width), as another writer would have written it."""
    reader = GGUFReader(path)
    field = reader.fields[key]
    part = field.parts[field.data[0]]
    offset = part.__array_interface__["data"][0] - reader.data.__array_interface__["data"][0]
    del reader
    assert len(data) == part.nbytes
    with path.open("r+b") as f:
        f.seek(offset)
        f.write(data)


def test_a_shard_whose_identity_keys_disagree_is_refused(tmp_path: Path) -> None:
    a, b = two_sets(tmp_path)
    # Shard 2 of another model whose writer stamps its architecture on every shard, as bmoe's does.
    poke_scalar(b[1], "general.architecture", b"qwen2moe")
    shutil.copyfile(b[1], a[1])
    with pytest.raises(ModelFileError, match="general.architecture is 'qwen2moe' where shard 1 says 'qwen3moe'"):
        read_layout(a[0])
    with pytest.raises(ModelFileError, match="different models mixed"):
        open_layout(a[0])


def test_a_shard_counting_another_sets_tensors_is_refused(tmp_path: Path) -> None:
    a, _ = two_sets(tmp_path)
    field = GGUFReader(a[2]).fields["split.tensors.count"]
    count = int(field.parts[field.data[0]][0])
    poke_scalar(a[2], "split.tensors.count", (count + 3).to_bytes(4, "little"))
    with pytest.raises(ModelFileError, match=f"split.tensors.count is {count + 3} where shard 1 says {count}"):
        open_layout(a[0])


def test_a_shard_of_a_set_cut_otherwise_is_refused(tmp_path: Path) -> None:
    a, _ = two_sets(tmp_path)
    poke_scalar(a[1], "split.count", (4).to_bytes(2, "little"))
    with pytest.raises(MissingShardError, match="split.count says 4 shards"):
        open_layout(a[0])


def test_same_shapes_mixed_is_what_cannot_be_detected(tmp_path: Path) -> None:
    """The README's limit, pinned: same architecture, shapes and types, later shards carrying
    only split.* and the architecture: the mix opens (its output would be wrong)."""
    a, b = two_sets(tmp_path)
    assert a[1].read_bytes() != b[1].read_bytes()  # different weights
    shutil.copyfile(b[1], a[1])
    assert open_layout(a[0]).shards == tuple(a)

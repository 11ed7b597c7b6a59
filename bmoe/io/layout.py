"""Where every tensor's bytes live on disk, read from the GGUF index.

Pure data once built: the stages plan reads from it (shard, absolute offset, per-expert stride)
without touching the file again. The index is walked here with gguf-py's type tables but not its
GGUFReader: that reader builds numpy views per array element (11.6 s for a 151k-token vocabulary,
against 0.07 s here) and does not bound counts against the file size, so a corrupt count makes it
loop or allocate without end. Every read below is bounds-checked before it is made; parse failures
are the ``ModelFileError`` subclasses. Semantic checks live in ``validate.open_layout``.
"""

from __future__ import annotations

import mmap
import os
import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from math import prod
from pathlib import Path
from types import MappingProxyType

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from bmoe.errors import (
    GGUFVersionError,
    MissingKeyError,
    MissingShardError,
    ModelFileError,
    NotGGUFError,
    TruncatedFileError,
)
from bmoe.io.recipes import recipe_for

# llama.cpp's split naming, "%s-%05d-of-%05d.gguf": %05d widens past 99999, hence \d{5,}.
MAX_SHARDS = 10_000  # far beyond any published split; bounds the paths built from a name
_SPLIT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5,})-of-(?P<count>\d{5,})\.gguf$")
_BLOCK_NAME = re.compile(r"^blk\.(\d+)\.")
_EXPERT_NAME = re.compile(r"^blk\.(?P<layer>\d+)\.(?P<suffix>[^.]+)\.weight$")

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_HEADER = struct.Struct("<4sIQQ")  # magic, version, tensor count, kv count
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_DEFAULT_ALIGNMENT = 32
_TYPED_KEYS = {
    "general.alignment": GGUFValueType.UINT32,
    "split.no": GGUFValueType.UINT16,
    "split.count": GGUFValueType.UINT16,
    "split.tensors.count": GGUFValueType.INT32,
}
_TENSOR_ALIGNMENT = 32  # ggml's TENSOR_ALIGNMENT: where a CPU buffer over mapped file data may start
# Keys, names and scalar strings are copied out; chat templates, the longest, run to ~100 KB. A
# corrupt length that still fits in a 100 GB file must not become a 100 GB allocation.
_MAX_STRING = 1 << 24
_MAX_DIMS = 4  # GGML_MAX_DIMS
# Numeric arrays this long or shorter are decoded (per-layer values, at most LLAMA_MAX_LAYERS = 512);
# longer ones (token scores, merges) are skipped.
_MAX_KEPT_ARRAY = 1024
# Smallest encodings: a KV is a key length, a type and a 1-byte value; a tensor info is a name
# length, n_dims, one dimension, a type and an offset. They bound the header counts up front.
_MIN_KV_BYTES = 8 + 4 + 1
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8
_SCALARS = {
    GGUFValueType.UINT8: struct.Struct("<B"),
    GGUFValueType.INT8: struct.Struct("<b"),
    GGUFValueType.UINT16: struct.Struct("<H"),
    GGUFValueType.INT16: struct.Struct("<h"),
    GGUFValueType.UINT32: struct.Struct("<I"),
    GGUFValueType.INT32: struct.Struct("<i"),
    GGUFValueType.FLOAT32: struct.Struct("<f"),
    GGUFValueType.BOOL: struct.Struct("<?"),
    GGUFValueType.UINT64: struct.Struct("<Q"),
    GGUFValueType.INT64: struct.Struct("<q"),
    GGUFValueType.FLOAT64: struct.Struct("<d"),
}

Scalar = int | float | str | bool


@dataclass(frozen=True)
class TensorSpan:
    name: str
    shard: int  # index into ModelLayout.shards (0 = shard 1)
    offset: int  # absolute file offset of the tensor data in that shard
    nbytes: int
    ne: tuple[int, ...]  # ggml order: ne[0] is the innermost (contiguous) dimension
    ggml_type: int


@dataclass(frozen=True)
class ExpertTensor:
    layer: int
    suffix: str
    span: TensorSpan
    n_expert: int
    stride: int  # bytes of one expert: experts are the outermost dimension, ne[2]

    def file_offset(self, expert: int) -> int:
        return self.span.offset + expert * self.stride


@dataclass(frozen=True)
class ModelLayout:
    shards: tuple[Path, ...]  # shard 1 first
    arch: str
    n_layer: int
    n_expert: int
    n_expert_used: int
    tensors: Mapping[str, TensorSpan]
    experts: Mapping[tuple[int, str], ExpertTensor]  # (layer, suffix)
    moe_layers: tuple[int, ...]
    metadata: Mapping[str, Scalar]  # scalar KVs of shard 1; arrays are in ``arrays``
    # MTP / nextn blocks: the last ``n_nextn`` of the ``n_layer`` blocks. llama.cpp's plain load
    # skips them (their tensors are not part of the model), so their experts are not in ``experts``.
    n_nextn: int = 0
    # Numeric arrays of shard 1 up to _MAX_KEPT_ARRAY elements (per-layer counts, rope sections).
    arrays: Mapping[str, tuple[int | float | bool, ...]] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def main_layers(self) -> int:
        """Blocks the plain load builds; MTP blocks come after them."""
        return self.n_layer - self.n_nextn

    @property
    def skipped_bytes(self) -> int:
        """Bytes of the MTP blocks' tensors: in the file, never loaded, never read."""
        return sum(s.nbytes for s in self.tensors.values() if block_of(s.name) >= self.main_layers)

    @property
    def expert_bytes(self) -> int:
        return sum(e.span.nbytes for e in self.experts.values())

    @property
    def dense_bytes(self) -> int:
        """Everything the model holds besides the routed experts (MTP blocks excluded)."""
        return sum(s.nbytes for s in self.tensors.values()) - self.expert_bytes - self.skipped_bytes

    @property
    def file_bytes(self) -> int:
        """Size on disk of the whole set, headers and padding included (stats the files)."""
        return sum(p.stat().st_size for p in self.shards)

    def layer_experts(self, layer: int) -> tuple[ExpertTensor, ...]:
        """The layer's expert tensors in the order the graph consumes them (the recipe's order)."""
        suffixes = recipe_for(self.arch).expert_suffixes
        return tuple(self.experts[layer, s] for s in suffixes if (layer, s) in self.experts)

    def layer_kinds(self) -> dict[int, str]:
        """Per block: "moe" (routed experts), "mtp" (skipped by the plain load) or "dense"."""
        moe = set(self.moe_layers)
        return {
            il: "mtp" if il >= self.main_layers else "moe" if il in moe else "dense"
            for il in range(self.n_layer)
        }

    def entry_bytes(self) -> dict[int, int]:
        """Per MoE layer, the bytes of one expert with all its projections (one cache entry)."""
        return {il: sum(e.stride for e in self.layer_experts(il)) for il in self.moe_layers}

    def expert_bytes_per_token(self) -> int:
        """Bytes a token needs from disk when no routed expert is resident."""
        return self.n_expert_used * sum(self.entry_bytes().values())


@dataclass(frozen=True)
class ShardIndex:
    """One shard's header as parsed: what validation needs beyond the layout (keys, split.*)."""

    path: Path
    version: int
    metadata: Mapping[str, Scalar]  # scalar KVs; arrays are skipped, not decoded
    keys: frozenset[str]  # every key, arrays included
    tensors: tuple[TensorSpan, ...]
    arrays: Mapping[str, tuple[int | float | bool, ...]] = field(default_factory=lambda: MappingProxyType({}))  # small numeric ones
    # Where each array sits, (element type, count, offset of the first element), for checks that
    # read one (the vocabulary, per-layer counts) without decoding every array at parse time.
    array_spans: Mapping[str, tuple[int, int, int]] = field(default_factory=lambda: MappingProxyType({}))


def split_shard_paths(path: Path) -> tuple[Path, ...]:
    """All paths of the split set ``path`` belongs to, by name alone; a plain file is its own set."""
    path = Path(path)
    m = _SPLIT_NAME.match(path.name)
    if m is None:
        return (path,)
    prefix, count = m["prefix"], int(m["count"])
    if not 1 <= count <= MAX_SHARDS:
        raise MissingShardError(f"{path.name}: a split set of {count} shards (bmoe reads 1 to {MAX_SHARDS})")
    return tuple(path.with_name(f"{prefix}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1))


def read_layout(path: str | os.PathLike[str]) -> ModelLayout:
    """Parse the index of every shard of the set ``path`` names. No validation beyond parsing."""
    shards = split_shard_paths(Path(path))
    return build_layout([read_index(p, i) for i, p in enumerate(shards)])


def build_layout(indexes: Sequence[ShardIndex]) -> ModelLayout:
    """Assemble the set's layout from its shard indexes (shard 1 first, which holds the metadata)."""
    first = indexes[0]
    metadata = first.metadata
    arch = _require(first, "general.architecture")
    recipe = recipe_for(str(arch))
    check_same_set(indexes)
    tensors: dict[str, TensorSpan] = {}
    for index in indexes:
        for span in index.tensors:
            if span.name in tensors:
                raise ModelFileError(f"{index.path}: tensor {span.name!r} appears twice in the set")
            tensors[span.name] = span
    n_layer = _require_int(first, recipe.key("block_count"))
    n_nextn = metadata.get(recipe.key("nextn_predict_layers"), 0)
    if not isinstance(n_nextn, int) or isinstance(n_nextn, bool) or not 0 <= n_nextn <= n_layer:
        raise ModelFileError(
            f"{first.path}: {recipe.key('nextn_predict_layers')} is {n_nextn!r}, not in 0..{n_layer} (block_count)"
        )
    experts = {
        key: et for key, et in _expert_tensors(tensors, recipe.expert_suffixes).items()
        if key[0] < n_layer - n_nextn
    }
    return ModelLayout(
        shards=tuple(ix.path for ix in indexes),
        arch=recipe.arch,
        n_layer=n_layer,
        n_expert=_require_int(first, recipe.key("expert_count")),
        n_expert_used=_require_int(first, recipe.key("expert_used_count")),
        tensors=MappingProxyType(tensors),
        experts=MappingProxyType(experts),
        moe_layers=tuple(sorted({layer for layer, _ in experts})),
        metadata=metadata,
        n_nextn=n_nextn,
        arrays=first.arrays,
    )


def check_same_set(indexes: Sequence[ShardIndex]) -> None:
    """Refuse a split set whose shards disagree on a key they both carry: shards of two models
    mixed in one set (llama.cpp would run it and print wrong text, exit 0).

    Writers put the model's metadata in shard 1 only; later shards carry ``split.*`` (the set's
    shard and tensor counts, on every shard: gguf-split and gguf-py both write them) and, from
    some writers, ``general.architecture`` and other identity keys. Every such key must agree with
    shard 1. What this cannot see (README, Supported architectures): two models of the same
    architecture, shapes and tensor types split at the same tensors, whose later shards carry only
    ``split.*``: nothing in a GGUF names the set a shard belongs to, and only the tensor data differ.
    """
    first = indexes[0]
    for index in indexes[1:]:
        for key, value in index.metadata.items():
            if key == "split.no" or key not in first.metadata:
                continue
            want = first.metadata[key]
            if value != want and not (value != value and want != want):  # NaN equals NaN here
                raise ModelFileError(
                    f"{index.path}: {key} is {value!r} where shard 1 says {want!r}: shards of different "
                    "models mixed in one split set?"
                )


def block_of(name: str) -> int:
    """The block index of a ``blk.<il>.`` tensor name; -1 for the others."""
    m = _BLOCK_NAME.match(name)
    return int(m[1]) if m else -1


def expert_key(name: str, suffixes: tuple[str, ...]) -> tuple[int, str] | None:
    """(layer, suffix) when ``name`` is an expert tensor under these suffixes, else None."""
    m = _EXPERT_NAME.match(name)
    if m is None or m["suffix"] not in suffixes:
        return None
    return int(m["layer"]), m["suffix"]


def _require(index: ShardIndex, key: str) -> Scalar:
    try:
        return index.metadata[key]
    except KeyError:
        what = "is an array" if key in index.keys else "is missing"
        raise MissingKeyError(f"{index.path}: metadata key {key!r} {what}") from None


def _require_int(index: ShardIndex, key: str) -> int:
    value = _require(index, key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ModelFileError(f"{index.path}: metadata key {key!r} is {value!r}, not an integer")
    return value


def _expert_tensors(
    tensors: Mapping[str, TensorSpan], suffixes: tuple[str, ...]
) -> dict[tuple[int, str], ExpertTensor]:
    experts: dict[tuple[int, str], ExpertTensor] = {}
    for span in tensors.values():
        key = expert_key(span.name, suffixes)
        # Anything not shaped [.., .., n_expert] is left for validation to name.
        if key is None or len(span.ne) != 3 or span.ne[2] == 0:
            continue
        n_expert = span.ne[2]
        experts[key] = ExpertTensor(key[0], key[1], span, n_expert, span.nbytes // n_expert)
    return experts


# --- the index walk ---------------------------------------------------------------------------


def read_index(path: Path, shard: int = 0) -> ShardIndex:
    """Parse one shard's header and tensor index, every length checked against the file size."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(_HEADER.size)
    if len(head) < _HEADER.size and _MAGIC.startswith(head[:4]):
        raise NotGGUFError(f"{path}: {size} bytes, too short to hold a GGUF header")
    if head[:4] != _MAGIC:
        raise NotGGUFError(f"{path}: not a GGUF file (magic {head[:4]!r})")
    _, version, n_tensors, n_kv = _HEADER.unpack(head)
    _check_version(path, version)
    if n_kv * _MIN_KV_BYTES + n_tensors * _MIN_TENSOR_INFO_BYTES > size - _HEADER.size:
        raise TruncatedFileError(
            f"{path}: header claims {n_tensors} tensors and {n_kv} keys, more than {size} bytes can hold"
        )
    with path.open("rb") as f:
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            # No fault read-around: it would read megabytes of tensor data behind a small header,
            # which a streamed open must not pay. The walker asks for the header window by window.
            buf.madvise(mmap.MADV_RANDOM)
            walker = _Walker(path, buf, size)
            index = walker.walk(version, n_kv, n_tensors, shard)
        # Drop the header pages, and the read-ahead marks on them, which would otherwise set off
        # read-ahead into tensor data when llama.cpp reads near them.
        os.posix_fadvise(f.fileno(), 0, walker.read_ahead_end, os.POSIX_FADV_DONTNEED)
    return index


def _check_version(path: Path, version: int) -> None:
    if version in _VERSIONS:
        return
    if int.from_bytes(version.to_bytes(4, "little"), "big") in _VERSIONS:
        raise GGUFVersionError(f"{path}: big-endian GGUF, only little-endian files are read")
    raise GGUFVersionError(f"{path}: GGUF version {version} is not supported (only 2 and 3)")


# Header read-ahead window: large enough for few I/Os on a real vocabulary (megabytes of header),
# small enough that the overshoot into tensor data stays a rounding error of the dense bytes.
_HEADER_WINDOW = 256 * 1024


class _Walker:
    """A cursor over one header: every read is bounds-checked before it is made."""

    def __init__(self, path: Path, buf: mmap.mmap, size: int) -> None:
        self.path, self.buf, self.size = path, buf, size
        self.pos = _HEADER.size
        self._ahead = 0  # the header is read ahead in windows up to here

    @property
    def read_ahead_end(self) -> int:
        return self._ahead

    def _read_ahead(self, end: int) -> None:
        while self._ahead < end:
            length = min(_HEADER_WINDOW, self.size - self._ahead)
            self.buf.madvise(mmap.MADV_WILLNEED, self._ahead, length)
            self._ahead += length

    def walk(self, version: int, n_kv: int, n_tensors: int, shard: int) -> ShardIndex:
        metadata: dict[str, Scalar] = {}
        keys: set[str] = set()
        self.arrays: dict[str, tuple[int | float | bool, ...]] = {}
        self.array_spans: dict[str, tuple[int, int, int]] = {}
        for _ in range(n_kv):
            self._kv(metadata, keys)
        alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))  # UINT32, checked in _kv
        if alignment <= 0 or alignment & (alignment - 1):
            raise ModelFileError(f"{self.path}: general.alignment {alignment} is not a power of two")
        infos = [self._tensor_info() for _ in range(n_tensors)]
        data_start = -(-self.pos // alignment) * alignment
        spans = tuple(self._span(info, shard, data_start, alignment) for info in infos)
        return ShardIndex(
            self.path, version, MappingProxyType(metadata), frozenset(keys), spans,
            MappingProxyType(self.arrays), MappingProxyType(self.array_spans),
        )

    def _take(self, n: int, what: str) -> int:
        start = self.pos
        if n > self.size - start:
            raise TruncatedFileError(f"{self.path}: {what} at offset {start} runs past the end of the file")
        self.pos = start + n
        self._read_ahead(self.pos)
        return start

    def _u32(self, what: str) -> int:
        value: int = _U32.unpack_from(self.buf, self._take(4, what))[0]
        return value

    def _u64(self, what: str) -> int:
        value: int = _U64.unpack_from(self.buf, self._take(8, what))[0]
        return value

    def _str(self, what: str) -> str:
        n = self._u64(what)
        if n > _MAX_STRING:
            raise ModelFileError(f"{self.path}: {what} at offset {self.pos - 8} claims {n} bytes")
        start = self._take(n, what)
        # llama.cpp does not check UTF-8 either: a stray byte must not refuse a file it loads.
        return self.buf[start : start + n].decode(errors="replace")

    def _type(self, key: str, raw: int) -> GGUFValueType:
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise ModelFileError(f"{self.path}: metadata key {key!r} has unknown type {raw}") from None

    def _kv(self, metadata: dict[str, Scalar], keys: set[str]) -> None:
        key = self._str("metadata key")
        if key in keys:
            raise ModelFileError(f"{self.path}: metadata key {key!r} appears twice")
        keys.add(key)
        vtype = self._type(key, self._u32(f"type of {key!r}"))
        want = _TYPED_KEYS.get(key)
        if want is not None and vtype != want:
            # llama.cpp reads these with a typed getter: gguf_get_val_u32 asserts the type of
            # general.alignment (an abort); the loader refuses split keys of another type.
            raise ModelFileError(f"{self.path}: {key} is {vtype.name}, not {want.name}")
        what = f"value of {key!r}"
        if vtype == GGUFValueType.STRING:
            metadata[key] = self._str(what)
        elif vtype == GGUFValueType.ARRAY:
            self._skip_array(key, what)
        else:
            scalar = _SCALARS[vtype]
            metadata[key] = scalar.unpack_from(self.buf, self._take(scalar.size, what))[0]

    def _skip_array(self, key: str, what: str) -> None:
        etype = self._type(key, self._u32(what))
        count = self._u64(what)
        if etype == GGUFValueType.ARRAY:
            raise ModelFileError(f"{self.path}: metadata key {key!r} is a nested array")
        self.array_spans[key] = (int(etype), count, self.pos)
        if etype != GGUFValueType.STRING:
            scalar = _SCALARS[etype]
            start = self._take(count * scalar.size, what)
            if count <= _MAX_KEPT_ARRAY:
                self.arrays[key] = tuple(v for (v,) in scalar.iter_unpack(self.buf[start : start + count * scalar.size]))
            return
        if count > (self.size - self.pos) // 8:
            raise TruncatedFileError(f"{self.path}: {what} ({count} strings) runs past the end of the file")
        for _ in range(count):
            self._take(self._u64(what), what)

    def _tensor_info(self) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
        name = self._str("tensor name")
        what = f"tensor {name!r}"
        n_dims = self._u32(what)
        if not 1 <= n_dims <= _MAX_DIMS:
            raise ModelFileError(f"{self.path}: {what} has {n_dims} dimensions (1 to {_MAX_DIMS})")
        ne = tuple(self._u64(what) for _ in range(n_dims))
        raw_type = self._u32(what)
        try:
            ggml_type = GGMLQuantizationType(raw_type)
        except ValueError:
            raise ModelFileError(f"{self.path}: {what} has unknown ggml type {raw_type}") from None
        return name, ne, ggml_type, self._u64(what)

    def _span(
        self, info: tuple[str, tuple[int, ...], GGMLQuantizationType, int], shard: int, data_start: int, alignment: int
    ) -> TensorSpan:
        name, ne, ggml_type, rel = info
        if ggml_type not in GGML_QUANT_SIZES:
            raise ModelFileError(f"{self.path}: tensor {name!r} has ggml type {ggml_type.name}, which gguf-py cannot size")
        block, type_size = GGML_QUANT_SIZES[ggml_type]
        # Whole blocks per row: also what makes [.., .., n_expert] split evenly into experts.
        if ne[0] % block:
            raise ModelFileError(
                f"{self.path}: tensor {name!r} rows of {ne[0]} elements"
                f" are not whole {ggml_type.name} blocks of {block}"
            )
        if rel % alignment:
            raise ModelFileError(f"{self.path}: tensor {name!r} offset {rel} is not {alignment}-aligned")
        if (data_start + rel) % _TENSOR_ALIGNMENT:
            # llama.cpp's mmap load wraps the mapping in a CPU buffer that must start 32-byte
            # aligned (GGML_ASSERT, an abort); a general.alignment under 32 allows such offsets.
            raise ModelFileError(
                f"{self.path}: tensor {name!r} starts at byte {data_start + rel}, not a multiple of "
                f"{_TENSOR_ALIGNMENT} (general.alignment {alignment}): llama.cpp maps tensor data "
                f"{_TENSOR_ALIGNMENT}-byte aligned")
        nbytes = prod(ne) * type_size // block
        if data_start + rel + nbytes > self.size:
            raise TruncatedFileError(
                f"{self.path}: tensor {name!r} data ends at {data_start + rel + nbytes}, "
                f"past the end of the file ({self.size} bytes)"
            )
        return TensorSpan(name, shard, data_start + rel, nbytes, ne, int(ggml_type))

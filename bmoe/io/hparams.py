"""The architecture-independent hyperparameters, checked against llama.cpp's assertions.

llama.cpp reads the counts and sizes of a model from its metadata and trusts them: a head count of
0, a NaN norm epsilon, a rope dimension that is not the head size or a vocabulary with one string
twice each end in a ``GGML_ASSERT`` that kills the process (or, for gemma4 with no rope dimension,
in a decode that never returns). Every such value is checked here first and refused as one line.
The sites guarded, in the pinned sources (llama-cpp-python 0.3.36, ``vendor/llama.cpp``):

- ``src/llama-model.cpp`` ``load_hparams``: ``n_layer_all > 0 && <= LLAMA_MAX_LAYERS`` (512),
  ``n_expert <= LLAMA_MAX_EXPERTS`` (1024), ``n_expert_used <= n_expert``, ``n_embd / n_head``;
- ``src/models/{qwen3moe,qwen2moe,olmoe,llama}.cpp`` graph: ``n_embd_head_v == n_embd_head_k``
  and ``n_embd_head == n_rot``; ``gemma4.cpp``: ``n_embd_head_k(il) == n_embd_head_v(il)``, and a
  rope over 0 dimensions spins forever;
- ``src/llama-model-loader.cpp:1316`` ``t_meta.ne[dim] >= 1`` (a size key of 0 makes a tensor
  dimension 0);
- ``ggml/src/ggml-cpu/ops.cpp`` ``rms_norm``: ``eps >= 0.0f`` (NaN fails it);
- ``src/llama-vocab.cpp:2544`` ``id_to_token.size() == token_to_id.size()`` (a duplicate token).

Beyond the asserts, the tensor shapes the keys imply are compared with the shapes in the file: a
file relabelled to another architecture, or with a size key edited, disagrees there, and is named
here instead of after seconds of loading. Architecture-specific keys are ``validate``'s business.
"""

from __future__ import annotations

import math
import mmap
import re
import struct
from collections.abc import Sequence

import numpy as np
from gguf import GGUFValueType

from bmoe.errors import ExpertLayoutError, ModelFileError
from bmoe.io.layout import ModelLayout, ShardIndex
from bmoe.io.recipes import RECIPES

MAX_LAYERS = 512  # LLAMA_MAX_LAYERS, src/llama-hparams.h
MAX_EXPERTS = 1024  # LLAMA_MAX_EXPERTS
_VOCAB_KEY = "tokenizer.ggml.tokens"
# Per-layer tensors each architecture's load_arch_tensors creates as required (flags 0) besides the
# experts: a file relabelled from another architecture lacks some, and llama.cpp sizes the missing
# ones from keys the file does not have (0: the loader's ``ne[dim] >= 1`` assert).
_ATTN = ("attn_norm", "attn_output", "ffn_norm")
_LAYER_TENSORS = {
    "qwen3moe": _ATTN + ("attn_q_norm", "attn_k_norm", "ffn_gate_inp"),
    "olmoe": _ATTN + ("attn_q_norm", "attn_k_norm", "ffn_gate_inp"),
    "qwen2moe": _ATTN + ("ffn_gate_inp", "ffn_gate_inp_shexp", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"),
    "llama": _ATTN + ("ffn_gate_inp",),
    "gemma4": _ATTN + ("attn_q_norm", "post_attention_norm", "post_ffw_norm"),
}
_LAYER = re.compile(r"^blk\.(\d+)\.")
_INTS = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h", GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
    GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q",
}


class _Keys:
    """Typed access to ``<arch>.*`` keys of shard 1, each fault one line naming the key."""

    def __init__(self, index: ShardIndex, arch: str) -> None:
        self.index, self.arch = index, arch
        self.path = index.path

    def name(self, key: str) -> str:
        return f"{self.arch}.{key}"

    def has(self, key: str) -> bool:
        return self.name(key) in self.index.keys

    def int(self, key: str, lo: int, hi: int | None = None, default: int | None = None) -> int | None:
        """The key as an integer in [lo, hi]; ``default`` when absent; an array is left to ``per_layer``."""
        full = self.name(key)
        if full not in self.index.keys:
            return default
        if full in self.index.array_spans:
            return None
        value = self.index.metadata[full]
        if not isinstance(value, int) or isinstance(value, bool):
            raise ModelFileError(f"{self.path}: metadata key {full!r} is {value!r}, not an integer")
        _bounded(self.path, full, value, lo, hi)
        return value

    def per_layer(self, key: str, n_layer: int, lo: int, default: int | None) -> list[int | None]:
        """One value per layer, whether the key is a scalar or an array (llama.cpp's get_key_or_arr)."""
        full = self.name(key)
        if full in self.index.array_spans:
            values = _read_int_array(self.index, full)
            if len(values) != n_layer:
                raise ModelFileError(f"{self.path}: {full!r} has {len(values)} values for {n_layer} layers")
            for v in values:
                _bounded(self.path, full, v, lo, None)
            return list(values)
        return [self.int(key, lo, default=default)] * n_layer

    def float(self, key: str) -> float | None:
        full = self.name(key)
        value = self.index.metadata.get(full)
        if value is None or isinstance(value, bool) or not isinstance(value, int | float):
            return None
        return float(value)


def _bounded(path: object, key: str, value: int, lo: int, hi: int | None) -> None:
    if value < lo or (hi is not None and value > hi):
        span = f"at least {lo}" if hi is None else f"{lo} to {hi}"
        raise ModelFileError(f"{path}: metadata key {key!r} is {value}, llama.cpp needs {span}")


MAX_SIZE = 1 << 24  # any length or count above this makes a tensor bigger than any file, or overflows


def check_hparams(first: ShardIndex, layout: ModelLayout) -> None:
    """Refuse, as one line, every generic hyperparameter llama.cpp would assert on or spin with."""
    keys = _Keys(first, layout.arch)
    recipe = RECIPES.get(layout.arch)
    _check_sizes(keys)
    n_layer = keys.int("block_count", 1, MAX_LAYERS)
    assert n_layer is not None  # build_layout required it as a scalar
    n_embd = keys.int("embedding_length", 1)
    keys.int("context_length", 1)
    keys.int("expert_count", 1, MAX_EXPERTS)
    _check_eps(keys)
    n_head = keys.per_layer("attention.head_count", n_layer, 1, None)
    # A hybrid that marks its recurrent blocks by 0 KV heads (lfm2moe) has zeros there by design.
    kv_lo = 0 if recipe is not None and recipe.recurrent_marker == "kv_heads" else 1
    n_head_kv = keys.per_layer("attention.head_count_kv", n_layer, kv_lo, None)
    n_head_kv = [kv if kv is not None else h for kv, h in zip(n_head_kv, n_head)]
    heads = _HeadSizes.of(keys, n_embd, n_head)
    n_ff = keys.per_layer("feed_forward_length", n_layer, 1, None)
    n_ff_exp = keys.per_layer("expert_feed_forward_length", n_layer, 1, None)
    _check_shared_expert(keys, layout, n_ff[0])
    _check_dense_ffn(keys, layout, n_ff if recipe is None or recipe.dense_width_key != "embedding_length"
                     else [n_embd] * n_layer)
    _check_positive(keys)
    if recipe is not None and recipe.mla:
        _check_mla(keys, layout, n_embd, n_head, n_head_kv)
    if recipe is not None and recipe.gated_delta_net:
        _check_gated_delta_net(keys)
    _check_indexer(keys, heads)
    _check_layers(first, layout, n_layer)
    n_vocab = _check_vocab(first)
    _check_shapes(layout, n_embd, n_vocab, n_head, n_head_kv, heads, n_ff_exp)


def _check_sizes(keys: _Keys) -> None:
    """Every integer length or count of the architecture within [0, 2^24]: llama.cpp multiplies
    them in 32 bits (gemma4's per-layer embedding length times the layer count, for one), and a
    product that wraps negative sizes a tensor below 1 (the loader's ``ne[dim] >= 1`` assert)."""
    prefix = keys.arch + "."
    for key, value in keys.index.metadata.items():
        if not key.startswith(prefix) or isinstance(value, bool) or not isinstance(value, int):
            continue
        if ("length" in key or "count" in key) and not 0 <= value <= MAX_SIZE:
            raise ModelFileError(f"{keys.path}: metadata key {key!r} is {value}, llama.cpp needs 0 to {MAX_SIZE}")


def _check_shared_expert(keys: _Keys, layout: ModelLayout, n_ff: int | None) -> None:
    """A shared expert (qwen2moe) is sized by expert_shared_feed_forward_length, else by
    feed_forward_length: with neither above 0, llama.cpp sizes its tensors 0 and asserts."""
    # Only qwen2moe sizes it this way (src/models/qwen2moe.cpp); others size theirs from the
    # expert width and a shared-expert count, which their recipes check.
    if layout.arch != "qwen2moe" or not any(name.endswith("_shexp.weight") for name in layout.tensors):
        return
    width = keys.int("expert_shared_feed_forward_length", 0) or n_ff
    if not width:
        raise ModelFileError(
            f"{keys.path}: the shared expert needs {keys.name('expert_shared_feed_forward_length')} "
            f"(or {keys.name('feed_forward_length')}) above 0"
        )


def _check_dense_ffn(keys: _Keys, layout: ModelLayout, n_ff: Sequence[int | None]) -> None:
    """A dense FFN block (a leading dense block, an interleaved one) is sized by feed_forward_length:
    absent, llama.cpp sizes it 0 and asserts (``ne[dim] >= 1``); otherwise it must match the file."""
    for il in range(layout.n_layer):
        span = layout.tensors.get(f"blk.{il}.ffn_up.weight")
        if span is None:
            continue
        width = n_ff[il] if il < len(n_ff) else None
        recipe = RECIPES.get(keys.arch)
        key = keys.name(recipe.dense_width_key if recipe is not None else "feed_forward_length")
        if not width:
            raise ModelFileError(f"{keys.path}: {key} is missing or 0, and block {il}'s dense FFN is sized by it "
                                 "(llama.cpp aborts)")
        if len(span.ne) == 2 and span.ne[1] != width:
            raise ModelFileError(f"{keys.path}: blk.{il}.ffn_up.weight is {list(span.ne)}, but {key} is {width}")


def _check_positive(keys: _Keys) -> None:
    """The recipe's keys whose 0 sizes a tensor the loader always creates to 0 (an abort), each
    also at most MAX_SIZE (kda.head_dim = 2^32 - 1 overflowed a tensor's element count)."""
    recipe = RECIPES.get(keys.arch)
    for key in recipe.positive_keys if recipe is not None else ():
        if keys.has(key) and keys.int(key, 1, MAX_SIZE) is None:  # a huge one overflows ggml's sizes
            raise ModelFileError(f"{keys.path}: metadata key {keys.name(key)!r} is an array, llama.cpp reads one value")


def _check_mla(keys: _Keys, layout: ModelLayout, n_embd: int | None, n_head: Sequence[int | None],
               n_head_kv: Sequence[int | None]) -> None:
    """deepseek2's latent attention: the query/key head is the nope part plus the rope part, and
    with the *_mla keys the cache holds one head of kv_lora_rank + rope. A deleted or edited head
    key makes a view wider than its tensor (ggml asserts) or a nope part below 1 (the loader asserts)."""
    path, n = keys.path, keys.name
    head = n_head[0]
    if n_embd is None or head is None:
        return
    default = n_embd // head
    k = keys.int("attention.key_length", 1, default=default)
    v = keys.int("attention.value_length", 1, default=default)
    rot = keys.int("rope.dimension_count", 1, default=k)
    kv_rank = keys.int("attention.kv_lora_rank", 1)
    k_mla = keys.int("attention.key_length_mla", 0, default=0)
    v_mla = keys.int("attention.value_length_mla", 0, default=0)
    if None in (k, v, rot, kv_rank, k_mla, v_mla):
        raise ModelFileError(f"{path}: a head size, rope dimension or lora rank key is an array")
    is_mla = bool(k_mla and v_mla)
    head_k = k_mla if is_mla else k
    if head_k - rot < 1:  # type: ignore[operator]
        what = "attention.key_length_mla" if is_mla else "attention.key_length"
        raise ModelFileError(f"{path}: {n(what)} {head_k} leaves no room beside {n('rope.dimension_count')} {rot} "
                             "(llama.cpp asserts a non-rope part of at least 1)")
    if not is_mla:
        return
    recurrent_zero = RECIPES[keys.arch].recurrent_marker == "kv_heads"  # 0 KV heads mark a recurrent block
    if any(kv != 1 and not (recurrent_zero and kv == 0) for kv in n_head_kv):
        raise ModelFileError(f"{path}: {n('attention.head_count_kv')} must be 1 with latent attention "
                             f"({n('attention.key_length_mla')} set); it is {n_head_kv[0]}")
    if k != kv_rank + rot or v != kv_rank:  # type: ignore[operator]
        raise ModelFileError(
            f"{path}: with latent attention {n('attention.key_length')} must be kv_lora_rank + rope "
            f"({kv_rank} + {rot}) and {n('attention.value_length')} kv_lora_rank; they are {k} and {v}")
    span = layout.tensors.get(f"blk.{layout.n_layer - 1}.attn_kv_a_mqa.weight")
    if span is not None and span.ne[1:2] != (kv_rank + rot,):  # type: ignore[operator]
        raise ModelFileError(f"{path}: attn_kv_a_mqa is {list(span.ne)}, the metadata says kv_lora_rank + rope "
                             f"= {kv_rank + rot}")  # type: ignore[operator]


def _check_indexer(keys: _Keys, heads: _HeadSizes | None) -> None:
    """A sparse-attention indexer's head (deepseek32): its keys get a Hadamard rotation of 64 x 64
    or larger, so a head that is not a multiple of 64 fails a matmul assert at the first decode,
    and the graph asserts the rope fits in it."""
    if not keys.has("attention.indexer.key_length"):
        return
    width = keys.int("attention.indexer.key_length", 1, MAX_SIZE)
    if width is not None and width % 64:
        raise ModelFileError(f"{keys.path}: {keys.name('attention.indexer.key_length')} is {width}; llama.cpp needs "
                             "a multiple of 64 (its Hadamard rotation)")
    if width is not None and heads is not None and heads.rot > width:
        raise ModelFileError(f"{keys.path}: {keys.name('rope.dimension_count')} {heads.rot} is wider than the "
                             f"indexer head {width}")


def _check_gated_delta_net(keys: _Keys) -> None:
    """The gated delta net's tensors are sized by state_size x time_step_rank and its graph takes
    the value head as inner_size / time_step_rank: unless inner_size is that product, a reshape
    asserts (0 and 1 measured), and a huge one made the load balloon."""
    n = keys.name
    state, heads = keys.int("ssm.state_size", 1), keys.int("ssm.time_step_rank", 1)
    groups, inner = keys.int("ssm.group_count", 1), keys.int("ssm.inner_size", 0)
    if None in (state, heads, groups, inner):
        return  # absent keys are the recipe's business (required), arrays the loader's
    if inner != state * heads:  # type: ignore[operator]
        raise ModelFileError(f"{keys.path}: {n('ssm.inner_size')} is {inner}; llama.cpp needs "
                             f"{n('ssm.state_size')} x {n('ssm.time_step_rank')} = {state * heads}")  # type: ignore[operator]
    if heads % groups:  # type: ignore[operator]
        raise ModelFileError(f"{keys.path}: {n('ssm.time_step_rank')} {heads} is not a multiple of "
                             f"{n('ssm.group_count')} {groups}")


# Float keys a value of which at or under 0 breaks the model (rope over a base of 0 or less is NaN);
# rope.scaling.factor 0 means "none" to llama.cpp, so it needs only to be >= 0.
_POSITIVE = ("attention.layer_norm_rms_epsilon", "attention.layer_norm_epsilon", "rope.freq_base",
             "rope.freq_base_swa", "logit_scale")  # granite divides its logits by logit_scale


def _check_eps(keys: _Keys) -> None:
    """Every float key of the architecture finite (a NaN or inf rope base, scaling factor or expert
    weight scale made llama.cpp compute NaN logits and bmoe print token 0 four times, exit 0),
    the norm epsilons and rope bases above 0 (a NaN epsilon fails an assert), a scaling factor >= 0."""
    prefix = f"{keys.arch}."
    for full, value in keys.index.metadata.items():
        if (full.startswith(prefix) and isinstance(value, float) and full not in keys.index.array_spans
                and not math.isfinite(value)):
            raise ModelFileError(f"{keys.path}: metadata key {full!r} is {value}, not a finite number")
    for key in _POSITIVE:
        value = keys.float(key)
        if value is not None and not value > 0:
            raise ModelFileError(f"{keys.path}: metadata key {keys.name(key)!r} is {value}, not a positive number")
    factor = keys.float("rope.scaling.factor")
    if factor is not None and not factor >= 0:
        raise ModelFileError(f"{keys.path}: metadata key {keys.name('rope.scaling.factor')!r} is {factor}, "
                             "not a number >= 0")


class _HeadSizes:
    """Head sizes (key, value) and rope dimensions, full and sliding-window, as llama.cpp derives them."""

    def __init__(self, k: int, v: int, rot: int, k_swa: int, v_swa: int, rot_swa: int) -> None:
        self.k, self.v, self.rot, self.k_swa, self.v_swa, self.rot_swa = k, v, rot, k_swa, v_swa, rot_swa

    @classmethod
    def of(cls, keys: _Keys, n_embd: int | None, n_head: Sequence[int | None]) -> _HeadSizes | None:
        head = n_head[0]
        if n_embd is None or head is None:
            return None
        if "attention.key_length" not in _present(keys) and n_embd % head:
            raise ModelFileError(
                f"{keys.path}: {keys.name('embedding_length')} {n_embd} is not a multiple of "
                f"{keys.name('attention.head_count')} {head}, and no key_length says the head size"
            )
        k = keys.int("attention.key_length", 1, default=n_embd // head)
        v = keys.int("attention.value_length", 1, default=n_embd // head)
        rot = keys.int("rope.dimension_count", 1, default=k)
        k_swa = keys.int("attention.key_length_swa", 1, default=k)
        v_swa = keys.int("attention.value_length_swa", 1, default=v)
        rot_swa = keys.int("rope.dimension_count_swa", 1, default=rot)
        if None in (k, v, rot, k_swa, v_swa, rot_swa):
            raise ModelFileError(f"{keys.path}: a head size or rope dimension key is an array")
        sizes = cls(k, v, rot, k_swa, v_swa, rot_swa)  # type: ignore[arg-type]
        for value, key in ((rot, "rope.dimension_count"), (rot_swa, "rope.dimension_count_swa")):
            if value % 2:  # type: ignore[operator]  # every rope kernel asserts it (ops.cpp)
                raise ModelFileError(f"{keys.path}: {keys.name(key)} is {value}; llama.cpp's rope needs it even")
        recipe = RECIPES.get(keys.arch)
        if recipe is not None and recipe.plain_attention:  # MLA, gated or recurrent attention: their recipes check
            sizes.check(keys)
        return sizes

    def check(self, keys: _Keys) -> None:
        path, n = keys.path, keys.name
        if self.k != self.v:
            raise ModelFileError(
                f"{path}: {n('attention.key_length')} {self.k} and {n('attention.value_length')} {self.v} "
                "differ; llama.cpp asserts equal head sizes"
            )
        if self.k_swa != self.v_swa:
            raise ModelFileError(f"{path}: sliding-window key and value head sizes differ ({self.k_swa}, {self.v_swa})")
        if RECIPES[keys.arch].full_rope and self.rot != self.k:
            raise ModelFileError(
                f"{path}: {n('rope.dimension_count')} is {self.rot}, the head size is {self.k}; "
                f"{keys.arch} ropes the whole head (llama.cpp asserts n_rot == head size)"
            )
        for rot, head, key in ((self.rot, self.k, "rope.dimension_count"), (self.rot_swa, self.k_swa, "rope.dimension_count_swa")):
            if rot > head or rot % 2:
                raise ModelFileError(f"{path}: {n(key)} is {rot}; it must be even and at most the head size {head}")


def _present(keys: _Keys) -> set[str]:
    prefix = keys.arch + "."
    return {k[len(prefix):] for k in keys.index.keys if k.startswith(prefix)}


def _check_layers(first: ShardIndex, layout: ModelLayout, n_layer: int) -> None:
    """Every tensor's layer below block_count, and every layer present (its attention norm)."""
    seen: set[int] = set()
    for name in layout.tensors:
        m = _LAYER.match(name)
        if m is None:
            continue
        layer = int(m[1])
        if layer >= n_layer:
            raise ModelFileError(f"{first.path}: tensor {name!r} is in layer {layer}, but block_count is {n_layer}")
        seen.add(layer)
    missing = sorted(set(range(n_layer)) - seen)
    if missing:
        raise ModelFileError(
            f"{first.path}: block_count is {n_layer}, but layer(s) {_ranges(missing)} have no tensors"
        )
    for il in range(n_layer):
        if f"blk.{il}.attn_q.weight" not in layout.tensors:
            continue  # an index-only file (no attention at all) is the layout checks' business
        lacks = [s for s in _LAYER_TENSORS.get(layout.arch, ()) if f"blk.{il}.{s}.weight" not in layout.tensors]
        if lacks:
            raise ModelFileError(
                f"{first.path}: {layout.arch} needs blk.{il}.{{{','.join(lacks)}}}.weight, the file lacks "
                "them (relabelled from another architecture?)"
            )


def _ranges(layers: list[int]) -> str:
    return f"{layers[0]}..{layers[-1]}" if len(layers) > 3 else ", ".join(map(str, layers))


# The per-token arrays llama.cpp reads beside the strings, with no check of their type or length
# (``llama-vocab.cpp`` ``load``: ``gguf_get_arr_data`` cast to float / int32, indexed to n_tokens):
# an INT32 score array is read as floats, a short one read past its end.
_PER_TOKEN = {"tokenizer.ggml.scores": GGUFValueType.FLOAT32, "tokenizer.ggml.token_type": GGUFValueType.INT32}
_TOKEN_TYPES = range(0, 7)  # LLAMA_TOKEN_TYPE_UNDEFINED .. LLAMA_TOKEN_TYPE_BYTE
_SPECIAL_IDS = ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id")


def _check_vocab(first: ShardIndex) -> int | None:
    """The vocabulary's size, after refusing a token string that appears twice, a per-token array
    of another type or length than the tokens', a token type llama.cpp does not know (every token
    decoded to nothing), a BOS or EOS id outside the vocabulary, and a chat template that is not
    text (llama.cpp renders it as the number's digits)."""
    template = first.metadata.get("tokenizer.chat_template")
    if "tokenizer.chat_template" in first.keys and not isinstance(template, str):
        raise ModelFileError(f"{first.path}: tokenizer.chat_template is not a string")
    if _VOCAB_KEY not in first.array_spans:
        return None
    etype, count, offset = first.array_spans[_VOCAB_KEY]
    if etype != GGUFValueType.STRING:
        raise ModelFileError(f"{first.path}: {_VOCAB_KEY} is not an array of strings")
    for key, want in _PER_TOKEN.items():
        if key in first.keys:
            got = first.array_spans.get(key)
            if got is None or got[0] != want or got[1] != count:
                what = "not an array" if got is None else f"{got[1]} {GGUFValueType(got[0]).name} values"
                raise ModelFileError(f"{first.path}: {key} is {what}, llama.cpp reads {count} {want.name} "
                                     "(one per token)")
    if "tokenizer.ggml.token_type" in first.keys:
        types = np.frombuffer(_array_bytes(first, "tokenizer.ggml.token_type", count * 4), dtype="<i4")
        bad = np.flatnonzero((types < _TOKEN_TYPES.start) | (types >= _TOKEN_TYPES.stop))
        if bad.size:
            raise ModelFileError(f"{first.path}: token {int(bad[0])} has type {int(types[bad[0]])} (llama.cpp "
                                 f"knows {_TOKEN_TYPES.start}..{_TOKEN_TYPES.stop - 1})")
    for key in _SPECIAL_IDS:
        tid = first.metadata.get(key)
        if isinstance(tid, int) and not isinstance(tid, bool) and not 0 <= tid < count:
            raise ModelFileError(f"{first.path}: {key} is {tid}, outside the vocabulary (0..{count - 1})")
    seen: dict[bytes, int] = {}
    with first.path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        # Only the header's pages: without this, a fault's readahead pulls in megabytes of the
        # tensor data behind the vocabulary, and the cheap open is no longer cheap.
        buf.madvise(mmap.MADV_RANDOM)
        pos = offset
        for i in range(count):  # bounds were checked by the index walk
            (n,) = struct.unpack_from("<Q", buf, pos)
            # llama.cpp keys its map on the C string: a token differs from another only past a NUL
            # byte is the same token there (the assert below), so compare up to the first NUL.
            token = buf[pos + 8 : pos + 8 + n].split(b"\0", 1)[0]
            pos += 8 + n
            j = seen.setdefault(token, i)
            if j != i:
                raise ModelFileError(
                    f"{first.path}: tokens {j} and {i} of the vocabulary are the same string "
                    f"{token.decode(errors='replace')!r} (llama.cpp asserts every token is unique)"
                )
    return count


def _array_bytes(index: ShardIndex, key: str, nbytes: int) -> bytes:
    """The raw elements of a (bounds-checked) array value."""
    with index.path.open("rb") as f:
        f.seek(index.array_spans[key][2])
        return f.read(nbytes)


def _read_int_array(index: ShardIndex, key: str) -> tuple[int, ...]:
    etype, count, _ = index.array_spans[key]
    code = _INTS.get(GGUFValueType(etype))
    if code is None:
        raise ModelFileError(f"{index.path}: metadata key {key!r} is an array of {GGUFValueType(etype).name}, not integers")
    if count > MAX_LAYERS:
        raise ModelFileError(f"{index.path}: metadata key {key!r} has {count} values (at most {MAX_LAYERS} layers)")
    fmt = f"<{count}{code}"
    return struct.unpack(fmt, _array_bytes(index, key, struct.calcsize(fmt)))


def _check_shapes(
    layout: ModelLayout, n_embd: int | None, n_vocab: int | None, n_head: Sequence[int | None],
    n_head_kv: Sequence[int | None], heads: _HeadSizes | None, n_ff_exp: Sequence[int | None],
) -> None:
    """The shapes the keys imply against the file's: a relabelled or edited file disagrees here."""
    path = layout.shards[0]
    expected: dict[str, list[tuple[int, ...]]] = {}
    recipe = RECIPES.get(layout.arch)
    plain = recipe is not None and recipe.plain_attention

    def want(name: str, *shapes: tuple[int | None, ...]) -> None:
        full = [s for s in shapes if None not in s]
        if full:
            expected[name] = full  # type: ignore[assignment]

    want("token_embd.weight", (n_embd, n_vocab))
    want("output.weight", (n_embd, n_vocab))
    want("output_norm.weight", (n_embd,))
    for il in range(layout.n_layer):
        b = f"blk.{il}."
        h, kv, ff = n_head[il], n_head_kv[il], n_ff_exp[il]
        want(b + "attn_norm.weight", (n_embd,))
        want(b + "ffn_norm.weight", (n_embd,))
        want(b + "ffn_gate_inp.weight", (n_embd, layout.n_expert))
        want(b + "ffn_gate_exps.weight", (n_embd, ff, layout.n_expert))
        want(b + "ffn_up_exps.weight", (n_embd, ff, layout.n_expert))
        want(b + "ffn_down_exps.weight", (ff, n_embd, layout.n_expert))
        want(b + "ffn_gate_up_exps.weight", (n_embd, None if ff is None else 2 * ff, layout.n_expert))
        if heads is None or h is None or kv is None or not plain:
            continue
        # Sliding-window layers (gemma4) have their own head size: either is accepted per layer.
        sizes = {(heads.k, heads.v), (heads.k_swa, heads.v_swa)}
        want(b + "attn_q.weight", *[(n_embd, h * k) for k, _ in sizes])
        want(b + "attn_k.weight", *[(n_embd, kv * k) for k, _ in sizes])
        want(b + "attn_v.weight", *[(n_embd, kv * v) for _, v in sizes])
        want(b + "attn_output.weight", *[(h * v, n_embd) for _, v in sizes])
        want(b + "attn_qkv.weight", *[(n_embd, h * k + 2 * kv * k) for k, _ in sizes])  # dbrx's fused q/k/v
        want(b + "attn_gate.weight", (n_embd, h), *[(n_embd, h * k) for k, _ in sizes])  # per head or element
        if layout.arch == "olmoe":  # olmoe.cpp: q and k norms span the whole n_embd
            want(b + "attn_q_norm.weight", (n_embd,))
            want(b + "attn_k_norm.weight", (n_embd,))
        else:
            want(b + "attn_q_norm.weight", *[(k,) for k, _ in sizes])
            want(b + "attn_k_norm.weight", *[(k,) for k, _ in sizes])
    for name, shapes in expected.items():
        span = layout.tensors.get(name)
        if span is not None and span.ne not in shapes:
            says = " or ".join(str(list(s)) for s in shapes)
            cls = ExpertLayoutError if "_exps." in name else ModelFileError
            raise cls(
                f"{path}: tensor {name!r} is {list(span.ne)}, the {layout.arch} metadata says {says} "
                "(keys and tensors disagree: edited, or relabelled from another architecture?)"
            )

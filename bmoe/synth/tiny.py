"""Tiny random Mixture-of-Experts GGUF files that load on the pinned llama.cpp.

The test suite and demos generate their models instead of downloading them, so this writer has
to produce files llama.cpp accepts as the real thing (exact key and tensor sets per architecture)
while staying small, fully deterministic and non-degenerate under greedy decoding.

Every tensor is drawn from its own generator, seeded by ``(spec.seed, tensor name)``: a file's
bytes depend only on the spec, a split set holds exactly the tensors of the single file, and
gemma4's fused ``ffn_gate_up_exps`` holds exactly the rows of the separate gate and up tensors.
Weights are generated and written one expert slice at a time, so a ~1 GB model never sits in
memory.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, LlamaFileType
from gguf.quants import quantize

from bmoe.errors import ConfigError
from bmoe.synth.families import FAMILIES
from bmoe.synth.vocab import CONTROL_IDS, Vocab, byte_vocab, write_tokenizer

CORE_ARCHS = ("qwen3moe", "qwen2moe", "gemma4")  # planned in this module; the others in families.py
ARCHS = CORE_ARCHS + tuple(FAMILIES)

_WTYPES = {
    "f32": (GGMLQuantizationType.F32, LlamaFileType.ALL_F32),
    "f16": (GGMLQuantizationType.F16, LlamaFileType.MOSTLY_F16),
    "q8_0": (GGMLQuantizationType.Q8_0, LlamaFileType.MOSTLY_Q8_0),
}

# Room for multi-turn demos; costs nothing, llama.cpp sizes the KV cache by the caller's n_ctx.
CONTEXT_LENGTH = 2048
SLIDING_WINDOW = 128
RMS_EPS = 1e-6
# Standard deviation of router logits: wide enough that different tokens pick different experts.
ROUTER_LOGIT_STD = 2.0
QKV_BIAS_STD = 0.1
GGUF_ALIGNMENT = 32  # gguf-py's and llama.cpp's default data alignment
_SHARD_NAME = "{:s}-{:05d}-of-{:05d}.gguf"  # llama.cpp's split naming (llama_split_path)
_EXPERT_SUFFIX = "_exps.weight"  # gate, up, down and fused gate_up experts


@dataclass(frozen=True)
class TinySpec:
    """What a caller chooses; every other dimension is derived (see ``_Dims``)."""

    arch: str = "qwen3moe"
    wtype: str = "f32"
    n_layer: int | None = None  # main blocks; None: the family's default (2 for most)
    n_embd: int = 128
    n_expert: int = 8
    n_expert_used: int = 2
    n_ff: int = 64
    seed: int = 0
    shards: int = 1
    fuse_gate_up: bool | None = None
    n_nextn: int = 0  # MTP blocks after the main ones (block_count = n_layer + n_nextn)
    gate_experts: bool = True  # False: up/down experts only (archs whose loader allows it)

    def __post_init__(self) -> None:
        if self.n_layer is None:
            family = FAMILIES.get(self.arch)
            object.__setattr__(self, "n_layer", family.default_layers if family else 2)

    @property
    def n_block(self) -> int:
        return self.n_layer + self.n_nextn  # type: ignore[operator]

    @property
    def fused(self) -> bool:
        """Whether gate and up experts share one tensor (gemma4's natural layout)."""
        return self.arch == "gemma4" if self.fuse_gate_up is None else self.fuse_gate_up

    def validate(self) -> None:
        """Reject a spec before writing, since llama.cpp aborts the process on many bad files."""
        if self.arch not in ARCHS:
            raise ConfigError(f"unknown arch {self.arch!r}; expected one of {', '.join(ARCHS)}")
        if self.wtype not in _WTYPES:
            raise ConfigError(f"unknown wtype {self.wtype!r}; expected one of {', '.join(_WTYPES)}")
        family = FAMILIES.get(self.arch)
        # gemma4 needs a SWA and a full layer; the families their own minimum (llama4: 4).
        min_layers = family.min_layers if family else 2 if self.arch == "gemma4" else 1
        assert self.n_layer is not None
        if not min_layers <= self.n_layer <= 512 - self.n_nextn:
            raise ConfigError(f"n_layer must be in [{min_layers}, 512] for {self.arch}, got {self.n_layer}")
        if self.n_embd < 16 or self.n_embd % 16:
            raise ConfigError(f"n_embd must be a positive multiple of 16, got {self.n_embd}")
        if self.n_ff < 1:
            raise ConfigError(f"n_ff must be positive, got {self.n_ff}")
        if not 1 <= self.n_expert <= 1024:
            raise ConfigError(f"n_expert must be in [1, 1024], got {self.n_expert}")
        if not 1 <= self.n_expert_used <= self.n_expert:
            raise ConfigError(
                f"n_expert_used must be in [1, n_expert={self.n_expert}], got {self.n_expert_used}")
        if self.seed < 0:
            raise ConfigError(f"seed must be non-negative, got {self.seed}")
        if self.fuse_gate_up and not (self.arch == "gemma4" or (family and family.fuses_gate_up)):
            raise ConfigError(f"{self.arch} has no fused gate_up expert tensor")
        if not self.gate_experts and not (family and family.gate_optional):
            raise ConfigError(f"{self.arch} needs gate experts")
        if self.n_nextn and not (family and family.mtp):
            raise ConfigError(f"{self.arch} has no MTP blocks")
        if not 0 <= self.n_nextn <= 1:
            raise ConfigError(f"n_nextn must be 0 or 1, got {self.n_nextn}")
        if self.wtype == "q8_0":
            block = GGML_QUANT_SIZES[GGMLQuantizationType.Q8_0][0]
            for what, length in (("n_embd", self.n_embd), ("n_ff", self.n_ff)):
                if length % block:
                    raise ConfigError(
                        f"q8_0 needs every row length to be a multiple of {block}; {what}={length}")
        n_expert_tensors = self.n_block * (2 if self.fused or not self.gate_experts else 3)
        if not 1 <= self.shards <= n_expert_tensors:
            raise ConfigError(
                f"shards must be in [1, {n_expert_tensors}] (each shard holds an expert tensor), "
                f"got {self.shards}")


@dataclass(frozen=True)
class _Dims:
    n_vocab: int
    head_dim: int
    n_head: int
    n_head_kv: int
    n_ff_dense: int  # gemma4's dense MLP beside the experts; qwen2moe's shared expert

    @classmethod
    def of(cls, spec: TinySpec, vocab: Vocab) -> _Dims:
        # The widest head that still leaves 4 heads, so attention mixes several subspaces.
        head_dim = next((d for d in (64, 32, 16) if spec.n_embd % d == 0 and spec.n_embd // d >= 4), 16)
        n_head = spec.n_embd // head_dim
        n_head_kv = n_head // 2 if n_head % 2 == 0 else n_head  # GQA where it divides
        return cls(len(vocab), head_dim, n_head, n_head_kv, 2 * spec.n_ff)


@dataclass(frozen=True)
class _Tensor:
    name: str
    shape: tuple[int, ...]  # numpy order: outermost first, row length last
    qtype: GGMLQuantizationType
    chunks: Callable[[], Iterator[np.ndarray]]  # float32 pieces along axis 0, in file order

    @property
    def nbytes(self) -> int:
        block, type_size = GGML_QUANT_SIZES[self.qtype]
        return int(np.prod(self.shape)) // block * type_size

    @property
    def is_expert(self) -> bool:
        return self.name.endswith(_EXPERT_SUFFIX)


def _rng(seed: int, name: str) -> np.random.Generator:
    # A stable digest, not hash(): Python salts str hashes per process.
    digest = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")
    return np.random.default_rng([seed, digest])


def _normal(seed: int, name: str, shape: tuple[int, ...], std: float,
            zero_rows: tuple[int, ...] = ()) -> Callable[[], Iterator[np.ndarray]]:
    """Gaussian weights; 3-D tensors come one expert at a time to bound memory."""

    def chunks() -> Iterator[np.ndarray]:
        rng = _rng(seed, name)
        pieces = [shape[1:]] * shape[0] if len(shape) == 3 else [shape]
        for piece in pieces:
            x = rng.standard_normal(piece, dtype=np.float32)
            x *= np.float32(std)
            x[list(zero_rows)] = 0.0
            yield x

    return chunks


def _fused_gate_up(seed: int, gate: str, up: str, shape: tuple[int, ...],
                   std: float) -> Callable[[], Iterator[np.ndarray]]:
    """Per expert, the gate rows then the up rows, drawn exactly as the separate tensors are."""

    def chunks() -> Iterator[np.ndarray]:
        gates = _normal(seed, gate, shape, std)()
        ups = _normal(seed, up, shape, std)()
        for g, u in zip(gates, ups):
            yield np.concatenate([g, u])

    return chunks


def _ones(shape: tuple[int, ...]) -> Callable[[], Iterator[np.ndarray]]:
    """Norm weights, scales and rope factors: identity, so only the random matrices matter."""

    def chunks() -> Iterator[np.ndarray]:
        yield np.ones(shape, dtype=np.float32)

    return chunks


def _const(shape: tuple[int, ...], value: float) -> Callable[[], Iterator[np.ndarray]]:
    def chunks() -> Iterator[np.ndarray]:
        yield np.full(shape, value, dtype=np.float32)

    return chunks


class _Builder:
    """What a family's plan writes with: the spec's widths and one method per kind of tensor."""

    def __init__(self, spec: TinySpec, dims: _Dims) -> None:
        self.spec, self.dims = spec, dims
        self.E, self.F, self.hd = spec.n_embd, spec.n_ff, dims.head_dim
        self.F_dense = dims.n_ff_dense
        self.n_head, self.n_head_kv = dims.n_head, dims.n_head_kv
        self.dense_lead = 1  # families with leading dense blocks get one
        self.F_shexp = spec.n_ff
        family = FAMILIES.get(spec.arch)
        self.x: dict[str, object] = dict(family.extra) if family else {}  # the family's own widths
        kv = family.overrides(self).get("n_head_kv") if family else None
        if isinstance(kv, int):
            self.n_head_kv = kv
        self.router_std = ROUTER_LOGIT_STD * spec.n_embd ** -0.5  # the router sees a unit-RMS vector
        self.wq = _WTYPES[spec.wtype][0]
        self.out: list[_Tensor] = []

    def mat(self, name: str, shape: tuple[int, ...], std: float, zero_rows: tuple[int, ...] = (),
            qtype: GGMLQuantizationType | None = None) -> None:
        self.out.append(_Tensor(name, shape, qtype or self.wq, _normal(self.spec.seed, name, shape, std, zero_rows)))

    def f32(self, name: str, shape: tuple[int, ...], std: float) -> None:
        """Random F32: biases, sinks, conv kernels (kernels assert F32, rows too short to quantize)."""
        self.out.append(_Tensor(name, shape, GGMLQuantizationType.F32, _normal(self.spec.seed, name, shape, std)))

    def ones(self, name: str, n: int) -> None:
        self.const(name, n, 1.0)

    def const(self, name: str, n: int | tuple[int, ...], value: float) -> None:
        shape = n if isinstance(n, tuple) else (n,)
        self.out.append(_Tensor(name, shape, GGMLQuantizationType.F32, _const(shape, value)))

    def experts(self, p: str, qtype: GGMLQuantizationType | None = None) -> None:
        E, F, N, seed = self.E, self.F, self.spec.n_expert, self.spec.seed
        up_shape = (N, F, E)
        if self.spec.fused:
            self.out.append(_Tensor(p + "ffn_gate_up_exps.weight", (N, 2 * F, E), qtype or self.wq, _fused_gate_up(
                seed, p + "ffn_gate_exps.weight", p + "ffn_up_exps.weight", up_shape, E ** -0.5)))
        else:
            if self.spec.gate_experts:
                self.mat(p + "ffn_gate_exps.weight", up_shape, E ** -0.5, qtype=qtype)
            self.mat(p + "ffn_up_exps.weight", up_shape, E ** -0.5, qtype=qtype)
        self.mat(p + "ffn_down_exps.weight", (N, E, F), F ** -0.5, qtype=qtype)


def _family_plan(spec: TinySpec, dims: _Dims) -> list[_Tensor]:
    family = FAMILIES[spec.arch]
    b = _Builder(spec, dims)
    E, V = spec.n_embd, dims.n_vocab
    b.mat("token_embd.weight", (V, E), 1.0)
    b.ones(family.output_norm, E)
    # Control tokens get all-zero logit rows so a random model does not stop at once.
    b.mat("output.weight", (V, E), E ** -0.5, zero_rows=CONTROL_IDS)
    if family.globals_ is not None:
        family.globals_(b, V)
    for il in range(spec.n_block):
        family.layer(b, il)
    return b.out


def _plan(spec: TinySpec, dims: _Dims) -> list[_Tensor]:
    """The exact tensor set llama.cpp's load_tensors creates for the arch (extras are an error)."""
    if spec.arch in FAMILIES:
        return _family_plan(spec, dims)
    wq = _WTYPES[spec.wtype][0]
    f32 = GGMLQuantizationType.F32
    E, F, V, hd = spec.n_embd, spec.n_ff, dims.n_vocab, dims.head_dim
    q_dim, kv_dim = dims.n_head * hd, dims.n_head_kv * hd
    out: list[_Tensor] = []

    def mat(name: str, shape: tuple[int, ...], std: float, zero_rows: tuple[int, ...] = ()) -> None:
        out.append(_Tensor(name, shape, wq, _normal(spec.seed, name, shape, std, zero_rows)))

    def vec(name: str, n: int) -> None:
        out.append(_Tensor(name, (n,), f32, _ones((n,))))

    def rand_vec(name: str, n: int, std: float) -> None:
        out.append(_Tensor(name, (n,), f32, _normal(spec.seed, name, (n,), std)))

    gemma = spec.arch == "gemma4"
    # gemma4 multiplies embeddings by sqrt(n_embd): keep the residual stream at unit scale.
    mat("token_embd.weight", (V, E), E ** -0.5 if gemma else 1.0)
    if gemma:
        vec("rope_freqs.weight", hd // 2)  # factor 1: plain rope on the full-attention layers
    vec("output_norm.weight", E)
    # Control tokens get all-zero logit rows so a random model does not stop at once.
    mat("output.weight", (V, E), E ** -0.5, zero_rows=CONTROL_IDS)

    for il in range(spec.n_layer):
        p = f"blk.{il}."
        vec(p + "attn_norm.weight", E)
        mat(p + "attn_q.weight", (q_dim, E), E ** -0.5)
        mat(p + "attn_k.weight", (kv_dim, E), E ** -0.5)
        mat(p + "attn_v.weight", (kv_dim, E), E ** -0.5)
        if spec.arch == "qwen2moe":
            for proj, n in (("q", q_dim), ("k", kv_dim), ("v", kv_dim)):
                rand_vec(f"{p}attn_{proj}.bias", n, QKV_BIAS_STD)
        else:
            vec(p + "attn_q_norm.weight", hd)
            vec(p + "attn_k_norm.weight", hd)
        mat(p + "attn_output.weight", (E, q_dim), q_dim ** -0.5)
        vec(p + "ffn_norm.weight", E)

        if gemma:
            vec(p + "post_attention_norm.weight", E)
            mat(p + "ffn_gate.weight", (dims.n_ff_dense, E), E ** -0.5)
            mat(p + "ffn_up.weight", (dims.n_ff_dense, E), E ** -0.5)
            mat(p + "ffn_down.weight", (E, dims.n_ff_dense), dims.n_ff_dense ** -0.5)
            vec(p + "post_ffw_norm.weight", E)
            vec(p + "pre_ffw_norm_2.weight", E)
            vec(p + "post_ffw_norm_1.weight", E)
            vec(p + "post_ffw_norm_2.weight", E)
            # gemma4's router sees rms_norm(x) / sqrt(n_embd), a unit vector; the others see
            # a unit-RMS vector, hence the 1/sqrt(n_embd) below.
            vec(p + "ffn_gate_inp.scale", E)
            mat(p + "ffn_gate_inp.weight", (spec.n_expert, E), ROUTER_LOGIT_STD)
        else:
            mat(p + "ffn_gate_inp.weight", (spec.n_expert, E), ROUTER_LOGIT_STD * E ** -0.5)

        up_shape = (spec.n_expert, F, E)
        if spec.fused:
            name = p + "ffn_gate_up_exps.weight"
            fused_shape = (spec.n_expert, 2 * F, E)
            out.append(_Tensor(name, fused_shape, wq, _fused_gate_up(
                spec.seed, p + "ffn_gate_exps.weight", p + "ffn_up_exps.weight", up_shape, E ** -0.5)))
        else:
            mat(p + "ffn_gate_exps.weight", up_shape, E ** -0.5)
            mat(p + "ffn_up_exps.weight", up_shape, E ** -0.5)
        mat(p + "ffn_down_exps.weight", (spec.n_expert, E, F), F ** -0.5)

        if spec.arch == "qwen2moe":
            rand_vec(p + "ffn_gate_inp_shexp.weight", E, E ** -0.5)
            mat(p + "ffn_gate_shexp.weight", (dims.n_ff_dense, E), E ** -0.5)
            mat(p + "ffn_up_shexp.weight", (dims.n_ff_dense, E), E ** -0.5)
            mat(p + "ffn_down_shexp.weight", (E, dims.n_ff_dense), dims.n_ff_dense ** -0.5)
    return out


def write_moe_keys(
    w: GGUFWriter, arch: str, *, name: str, file_type: int, context_length: int, n_embd: int,
    n_layer: int, n_head: int, n_head_kv: int | list[int], head_dim: int, rms_eps: float,
    rope_theta: float, n_expert: int, n_expert_used: int, n_ff_exp: int, key_length: int | None = None,
    value_length: int | None = None, rope_dims: int | None = None, n_nextn: int = 0,
) -> None:
    """The keys every MoE file bmoe writes carries (tiny and synth alike). Literal key names (as
    in llama-arch.cpp) keep this independent of gguf-py's helper set, and the value types are the
    ones llama.cpp's typed get_key insists on."""
    w.add_string("general.name", name)
    w.add_uint32("general.file_type", file_type)
    w.add_uint32("general.quantization_version", 2)
    w.add_uint32(f"{arch}.context_length", context_length)
    w.add_uint32(f"{arch}.embedding_length", n_embd)
    w.add_uint32(f"{arch}.block_count", n_layer)
    w.add_uint32(f"{arch}.attention.head_count", n_head)
    if isinstance(n_head_kv, list):
        w.add_array(f"{arch}.attention.head_count_kv", n_head_kv)  # per block (0: not attention)
    else:
        w.add_uint32(f"{arch}.attention.head_count_kv", n_head_kv)
    w.add_uint32(f"{arch}.attention.key_length", key_length or head_dim)
    w.add_uint32(f"{arch}.attention.value_length", value_length or head_dim)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", rms_eps)
    w.add_uint32(f"{arch}.rope.dimension_count", rope_dims or head_dim)
    if n_nextn:
        w.add_uint32(f"{arch}.nextn_predict_layers", n_nextn)
    w.add_float32(f"{arch}.rope.freq_base", rope_theta)
    w.add_uint32(f"{arch}.expert_count", n_expert)
    w.add_uint32(f"{arch}.expert_used_count", n_expert_used)
    w.add_uint32(f"{arch}.expert_feed_forward_length", n_ff_exp)


def _write_metadata(w: GGUFWriter, spec: TinySpec, dims: _Dims, vocab: Vocab) -> None:
    a = spec.arch
    family = FAMILIES.get(a)
    builder = _Builder(spec, dims)
    keys = dict(
        name=f"bmoe-tiny-{a}-{spec.wtype}", file_type=int(_WTYPES[spec.wtype][1]),
        context_length=CONTEXT_LENGTH, n_embd=spec.n_embd, n_layer=spec.n_block, n_head=dims.n_head,
        n_head_kv=dims.n_head_kv, head_dim=dims.head_dim, rms_eps=RMS_EPS, rope_theta=1_000_000.0,
        n_expert=spec.n_expert, n_expert_used=spec.n_expert_used, n_ff_exp=spec.n_ff, n_nextn=spec.n_nextn,
    )
    if family is not None:
        keys.update(family.overrides(builder))
    write_moe_keys(w, a, **keys)  # type: ignore[arg-type]
    if family is not None:
        family.keys(w, builder)
    if a == "qwen2moe":
        w.add_uint32(f"{a}.expert_shared_feed_forward_length", dims.n_ff_dense)
    if a == "gemma4":
        w.add_uint32(f"{a}.feed_forward_length", dims.n_ff_dense)
        w.add_uint32(f"{a}.attention.sliding_window", SLIDING_WINDOW)
        # Alternate sliding/full attention; the last layer is full, as in the real models.
        w.add_array(f"{a}.attention.sliding_window_pattern",
                    [il % 2 == 0 and il != spec.n_layer - 1 for il in range(spec.n_layer)])
        w.add_uint32(f"{a}.attention.key_length_swa", dims.head_dim)
        w.add_uint32(f"{a}.attention.value_length_swa", dims.head_dim)
        w.add_float32(f"{a}.rope.freq_base_swa", 10_000.0)
        w.add_uint32(f"{a}.embedding_length_per_layer_input", 0)
    write_tokenizer(w, vocab)


def _shard_groups(tensors: list[_Tensor], n: int) -> list[list[_Tensor]]:
    """Cut the ordered tensor list into n runs, each starting at an expert tensor but the first.

    Cutting only before expert tensors spreads them evenly over the shards (they are nearly all
    of the bytes) and guarantees every shard holds some, which is what split-file tests need.
    """
    experts = [i for i, t in enumerate(tensors) if t.is_expert]
    starts = [0] + [experts[k * len(experts) // n] for k in range(1, n)] + [len(tensors)]
    return [tensors[s:e] for s, e in zip(starts, starts[1:])]


def _pad(f: BinaryIO, align: int = GGUF_ALIGNMENT) -> None:
    f.write(b"\0" * (-f.tell() % align))


def tiny_files(path: Path, shards: int) -> list[Path]:
    """The files ``write_tiny`` writes for ``shards`` shards: ``path``, or the split set beside it."""
    if shards == 1:
        return [path]
    return [path.with_name(_SHARD_NAME.format(path.stem, i + 1, shards)) for i in range(shards)]


def write_tiny(path: str | os.PathLike, spec: TinySpec,
               progress: Callable[[int, int], None] | None = None,
               edit_metadata: Callable[[GGUFWriter], None] | None = None) -> list[Path]:
    """Write the model and return its files, the one to open first.

    With ``spec.shards > 1`` the files are ``<stem>-0000i-of-0000N.gguf`` beside ``path`` (the
    names llama.cpp derives the rest of a split set from) and ``path`` itself is not written.
    ``progress(bytes_done, bytes_total)`` is called after each tensor, over tensor data bytes.
    ``edit_metadata(writer)`` may change shard 1's keys before they are written (``writer.kv_data[0]``
    is the dict of them): how tests make the malformed files llama.cpp would abort on.
    """
    spec.validate()
    path = Path(path)
    vocab = byte_vocab()
    dims = _Dims.of(spec, vocab)
    tensors = _plan(spec, dims)
    n_expert_tensors = sum(t.is_expert for t in tensors)
    if spec.shards > n_expert_tensors:
        raise ConfigError(f"shards must be in [1, {n_expert_tensors}] (each shard holds an expert tensor), got {spec.shards}")
    groups = _shard_groups(tensors, spec.shards)
    n = len(groups)
    files = tiny_files(path, n)
    total = sum(t.nbytes for t in tensors)
    done = 0

    for i, (file, group) in enumerate(zip(files, groups)):
        # One writer per shard: gguf-py can only split by tensor count or size, not at chosen cuts.
        w = GGUFWriter(file, spec.arch)
        if i == 0:
            _write_metadata(w, spec, dims, vocab)
            if edit_metadata is not None:
                edit_metadata(w)
        if n > 1:
            w.add_uint16("split.no", i)
            w.add_uint16("split.count", n)
            w.add_int32("split.tensors.count", len(tensors))
        for t in group:
            w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes, raw_dtype=t.qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        w.close()
        # Tensor data goes straight to the file, one slice at a time, instead of through the
        # writer, which wants each tensor whole in memory.
        with open(file, "r+b") as f:
            f.seek(0, os.SEEK_END)
            for t in group:
                _pad(f)
                for chunk in t.chunks():
                    f.write(np.ascontiguousarray(quantize(chunk, t.qtype)).data)
                done += t.nbytes
                if progress is not None:
                    progress(done, total)
            _pad(f)
    return files

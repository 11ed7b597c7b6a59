"""Real-sized random MoE GGUF files: ``bmoe synth OUT.gguf --like NAME``.

The file has the exact tensor set, shapes and keys of the named model (``bmoe.synth.shapes``), so
expert bytes, dense bytes and KV sizes are the real ones; only the weights are random, and
``--layers`` may cut the depth. Tens of GB go at disk speed with bounded memory:

- Expert and dense matrices are written as random quantized blocks directly, never as floats:
  ``random_raw`` bits from a per-tensor SFC64 generator fill the blocks in place, then each block's
  fp16 scale is set to a fixed magnitude (so a weight's standard deviation is ``std``; the sign bit
  stays random, which also cancels the -0.5 mean of the uniform quants) - one pass over the bytes,
  no quantization. Q8_0: fp16 d + 32 int8; Q4_0: fp16 d + 16 bytes of packed nibbles (q - 8).
- Chunks of at most ``CHUNK_BYTES`` go straight to the file after the header (as
  ``bmoe.synth.tiny`` does), through O_DIRECT from a writer thread while the next chunk is made
  (``_Sink``): memory stays at a few chunks and the page cache is left alone. The file is
  ``OUT.partial`` until its last byte is written.
- Every tensor's generator is seeded by ``(seed, tensor name)``: the bytes depend only on the spec.

Dense matrices (embeddings, output, attention, shared expert) are Q8_0 whatever ``--type`` is;
norms, routers and biases F32 (llama-quantize keeps routers in F32 too).

The vocabulary is ``bmoe.synth.vocab``'s byte-level SPM vocabulary padded to the real vocab size
with pronounceable filler words, so embedding and output have their real shapes, and greedy text is
readable gibberish; the output rows of the control tokens are zero so greedy runs do not stop.

Routing realism (``skew``, on by default): a random router routes almost uniformly and with no
memory, which no real model does. Here the residual stream reserves ``1 + 2*ROUTER_FEATURES`` dims
that no layer writes to: a constant (dim 0), the token's own random features ``f_t`` (from its
embedding row) and the previous token's ``f_{t-1}``, which one attention head of layer 0 copies
(its constant q and k are rotated by RoPE so that the scores peak at distance 1: a
previous-token head, as real models have). Each layer's router reads only these dims: logit_e ~
``sigma_b * b_e + (u_e.f_t + alpha * u_e.f_{t-1}) / sqrt(1 + alpha^2)`` (the RMS norm scales every
expert's logit alike, so top-k is exactly this). ``sigma_b`` sets the popularity skew and ``alpha``
the step-to-step reuse beyond it; both come per layer from ``shapes.ROUTING_PROFILES``, fitted to
the real trace (see ``RoutingProfile``). Without skew every router is a plain random matrix.

Own-token heads and route drift (shapes with a measured ``shapes.RESIDUAL_RMS``): ``r`` more
reserved dims hold ``D_l = R_l g_t`` (``g_t`` the token part above, ``R_l`` a random matrix per
layer), written by head 0 of every layer l >= 1, which attends to its own token (scores peaking at
distance 0) and writes ``R_l g_t - R_{l-1} g_t`` there, scaled by the residual stream's measured RMS
at that depth so the RMS norm lands it at unit size. Two things need it:

- Without it, a deep model's greedy decode falls into loops: at 48 layers of random attention
  the last hidden state forgets which token it is at, and the text repeats one to three words
  ("sumoza sumoza sumoza", measured on two seeds), so consecutive tokens route alike (reuse 0.78
  at 48 layers against 0.43 fitted) and every decode figure flatters the cache. A head that
  re-reads the token in every layer keeps the text varied (checked at 48 layers, bench/route_drift.py).
- Each router adds ``gamma * v_e . D_l`` (``route_drift``; the token part rescaled by
  ``1 / sqrt(1 + gamma^2)``, so popularity and step reuse keep their fitted values). Without it,
  nothing between two routers changes what they read, so layer l+1's router applied to layer l's
  input predicts l+1's routing exactly and bmoe's read-ahead (``bmoe.stages.predict``) is always
  right, a best case no real model gives. Published next-layer gate predictions are right for
  roughly 70-90 % of a token's experts; the default gamma, ``DEFAULT_ROUTE_DRIFT``, sits in the
  middle (about 82 % at 48 layers; 0.1 gives about 90 %, 0.3 about 74 %; 0 is the exact best case).
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import math
import os
import shutil
import struct
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Self

import numpy as np
from gguf import (
    GGML_QUANT_SIZES,
    GGMLQuantizationType,
    GGUFEndian,
    GGUFValueType,
    GGUFWriter,
    LlamaFileType,
    TokenType,
)

from bmoe.errors import ConfigError
from bmoe.io.paths import (
    check_new_file,
    fresh_partial,
    make_room,
    reclaimable_bytes,
    remove_partial,
)
from bmoe.synth.families import FAMILIES
from bmoe.synth.shapes import (
    RESIDUAL_RMS,
    ROUTING_PROFILES,
    MoeShape,
    get_shape,
    residual_rms,
)
from bmoe.synth.tiny import write_moe_keys
from bmoe.synth.vocab import (
    CONTROL_IDS,
    SPACE,
    Vocab,
    byte_vocab,
    write_tokenizer,
)

Q8_0 = GGMLQuantizationType.Q8_0
Q4_0 = GGMLQuantizationType.Q4_0
F32 = GGMLQuantizationType.F32
WTYPES = {"q8_0": (Q8_0, LlamaFileType.MOSTLY_Q8_0), "q4_0": (Q4_0, LlamaFileType.MOSTLY_Q4_0)}
DENSE = Q8_0  # embeddings, output, attention, shared expert
QK = 32  # weights per block (both types)
CHUNK_BYTES = 16 << 20
GGUF_ALIGNMENT = 32

# Standard deviation of one quant (uniform over its range, as random bits give): int8 for Q8_0,
# the nibble minus 8 for Q4_0.
_QUANT_STD = {Q8_0: math.sqrt(np.mean(np.arange(-128, 128) ** 2.0)),
              Q4_0: math.sqrt(np.mean(np.arange(-8, 8) ** 2.0))}

# Routing structure (skew).
ROUTER_FEATURES = 64  # r: token features read by the routers (top-k is not rank-limited at 64)
PREV_PAIRS = 12  # RoPE pairs of the previous-token head (the fastest rotating ones)
PREV_GAIN = 6.0  # its peak score is PREV_GAIN * sqrt(head_dim): > 0.99 of the weight on t-1
ROUTER_SCALE = 2.0  # logits' overall scale (softmax sharpness only; top-k does not depend on it)
ROUTER_STD = 2.0  # plain random routers (no skew): std of a logit, as in bmoe.synth.tiny
QKV_BIAS_STD = 0.1
# The routers' weight on D_l (module doc): about 82 % of a token's experts predicted one layer
# early at 48 layers, the middle of the 70-90 % published for real next-layer gate predictions.
DEFAULT_ROUTE_DRIFT = 0.2

# The constant dim's quant in an embedding block whose scale is 1 / quant std: a value of ~1.0.
_CONST_QUANT = np.uint8(round(_QUANT_STD[Q8_0]))
_FILLER_CONSONANTS = "bdfghjklmnprstvz"
_FILLER_VOWELS = "aeiou"


@dataclass(frozen=True)
class SynthSpec:
    like: str
    n_layer: int | None = None  # None: the real depth
    wtype: str = "q4_0"  # the routed experts' type
    seed: int = 0
    skew: bool = True  # routers structured after the real trace; False: plain random routers
    n_expert_used: int | None = None  # None: the real top-k (a replay may want another)
    # gamma: how far each layer moves what the routers read (module doc); None: DEFAULT_ROUTE_DRIFT
    # where the shape has own-token heads, else 0
    route_drift: float | None = None

    def validate(self) -> MoeShape:
        shape = get_shape(self.like)
        if self.wtype not in WTYPES:
            raise ConfigError(f"unknown --type {self.wtype!r}; expected one of {', '.join(WTYPES)}")
        if self.n_layer is not None and not 1 <= self.n_layer <= shape.n_layer:
            # More blocks than the real model has would be no longer its shapes (and a bigger file).
            raise ConfigError(f"--layers must be in [1, {shape.n_layer}] for {shape.name} "
                              f"(its real depth), got {self.n_layer}")
        if self.n_layer is not None and self.n_layer <= shape.n_dense_lead:
            # Only the leading dense blocks: a file with no experts, which nothing can stream.
            raise ConfigError(f"--layers must be more than {shape.name}'s {shape.n_dense_lead} leading dense "
                              f"block(s), or the model has no experts; got {self.n_layer}")
        attn = dict(shape.extra).get("full_attn")  # hybrid shapes: every attn-th block attends
        if self.n_layer is not None and isinstance(attn, int) and self.n_layer < attn:
            raise ConfigError(f"--layers must be at least {attn} for {shape.name}: only every {attn}th block "
                              f"attends, and a model where none does cannot run; got {self.n_layer}")
        if self.seed < 0 or self.seed >= 2**63:
            raise ConfigError(f"--seed must be in [0, 2^63), got {self.seed}")
        gamma = self.route_drift
        if gamma is not None and not (math.isfinite(gamma) and 0.0 <= gamma <= 10.0):
            raise ConfigError(f"--route-drift must be in [0, 10], got {self.route_drift}")
        if self.route_drift and shape.name not in RESIDUAL_RMS:
            raise ConfigError(f"--route-drift needs the residual stream's measured RMS per layer, which "
                              f"is known for {', '.join(RESIDUAL_RMS)} only (bench/residual_rms.py measures it)")
        if self.route_drift and not self.skew:
            raise ConfigError("--route-drift moves the structured routers' inputs: it needs skew (drop --no-skew)")
        if self.n_expert_used is not None and not 1 <= self.n_expert_used <= shape.n_expert:
            raise ConfigError(
                f"experts used must be in [1, {shape.n_expert}] for {shape.name}, got {self.n_expert_used}")
        if self.skew and shape.name not in ROUTING_PROFILES:
            raise ConfigError(f"no routing profile for {shape.name}; use skew=False")
        narrow = shape.n_embd < 4 * (1 + 2 * ROUTER_FEATURES) or shape.head_dim < 2 * PREV_PAIRS
        if self.skew and (narrow or shape.head_dim < ROUTER_FEATURES):
            raise ConfigError(f"{shape.name} is too narrow for the routing structure")
        for what, n in (("n_embd", shape.n_embd), ("expert ff", shape.n_ff_exp),
                        ("shared ff", shape.n_ff_shexp), ("q dim", shape.q_dim)):
            if n % QK:
                raise ConfigError(f"{what}={n} is not a multiple of {QK}: no block quantization")
        return shape

    def layers(self, shape: MoeShape) -> int:
        return shape.n_layer if self.n_layer is None else self.n_layer

    def own_token_heads(self, shape: MoeShape) -> bool:
        """Whether layers >= 1 get an own-token head writing ``D_l`` (the module doc)."""
        return self.skew and shape.name in RESIDUAL_RMS

    def drift(self, shape: MoeShape) -> float:
        """The routers' gamma on ``D_l``."""
        if self.route_drift is not None:
            return self.route_drift
        return DEFAULT_ROUTE_DRIFT if self.own_token_heads(shape) else 0.0

    def top_k(self, shape: MoeShape) -> int:
        return shape.n_expert_used if self.n_expert_used is None else self.n_expert_used

    def file_name(self) -> str:
        """A name that changes with everything the bytes depend on, for files written once and
        reused (the bench scripts' cached models): a generator change shows in it too."""
        shape = get_shape(self.like)
        parts = [f"synth-{shape.name}", f"l{self.layers(shape)}", self.wtype]
        if self.seed:
            parts.append(f"s{self.seed}")
        if not self.skew:
            parts.append("noskew")
        if self.n_expert_used is not None:
            parts.append(f"k{self.n_expert_used}")
        if self.own_token_heads(shape):
            parts.append(f"drift{self.drift(shape):g}")
        return "-".join(parts) + ".gguf"


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    shape: tuple[int, ...]  # numpy order: outermost first, row length last
    qtype: GGMLQuantizationType
    chunks: Callable[[], Iterator[np.ndarray]]  # uint8 arrays, in file order

    @property
    def nbytes(self) -> int:
        block, size = GGML_QUANT_SIZES[self.qtype]
        return int(np.prod(self.shape)) // block * size


# ---- random generation --------------------------------------------------------------------------

def _digest(seed: int, name: str) -> list[int]:
    # A stable digest, not hash(): Python salts str hashes per process.
    return [seed, int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")]


def _bits(seed: int, name: str) -> np.random.SFC64:
    return np.random.SFC64(np.random.SeedSequence(_digest(seed, name)))


def _gen(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(_digest(seed, name)))


def random_blocks(bits: np.random.BitGenerator, n_blocks: int, qtype: GGMLQuantizationType,
                  std: float) -> np.ndarray:
    """``n_blocks`` random blocks of ``qtype`` whose weights have standard deviation ``std``.

    The quants are raw random bits (uniform int8, or two uniform nibbles a byte); each block's fp16
    scale is ``std / quant std`` with a random sign, so weights are zero-mean.
    """
    block_bytes = GGML_QUANT_SIZES[qtype][1]
    nbytes = n_blocks * block_bytes
    raw = bits.random_raw(-(-nbytes // 8)).view(np.uint8)[:nbytes]
    words = raw.view(np.uint16).reshape(n_blocks, block_bytes // 2)  # both block sizes are even
    d_bits = np.float16(std / _QUANT_STD[qtype]).view(np.uint16)
    words[:, 0] &= np.uint16(0x8000)
    words[:, 0] |= d_bits
    return raw


def quantize_q8_0(x: np.ndarray) -> np.ndarray:
    """float rows (row length a multiple of 32) -> Q8_0 bytes, ggml's reference rounding."""
    blocks = np.asarray(x, dtype=np.float32).reshape(-1, QK)
    amax = np.abs(blocks).max(axis=1, keepdims=True)
    d = amax / 127.0
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(d > 0, np.round(blocks / np.where(d > 0, d, 1.0)), 0.0)
    out = np.empty((blocks.shape[0], 34), dtype=np.uint8)
    out[:, :2] = d.astype(np.float16).view(np.uint8)
    out[:, 2:] = np.clip(q, -127, 127).astype(np.int8).view(np.uint8)
    return out.reshape(-1)


def _row_bytes(n_cols: int, qtype: GGMLQuantizationType) -> int:
    block, size = GGML_QUANT_SIZES[qtype]
    return n_cols // block * size


def _rows_per_chunk(row_bytes: int) -> int:
    return max(1, CHUNK_BYTES // row_bytes)


# ---- tensor makers ------------------------------------------------------------------------------

Patch = Callable[[np.ndarray, int, int], None]  # (chunk as [rows, row_bytes] uint8, first row, outer index)


def _matrix(seed: int, name: str, shape: tuple[int, ...], qtype: GGMLQuantizationType, std: float,
            patch: Patch | None = None) -> PlannedTensor:
    """A random 2-D or 3-D (experts outermost) block matrix, in row chunks; ``patch`` may rewrite
    rows of each chunk in place (designed rows, zeroed rows)."""
    n_cols = shape[-1]
    n_rows = shape[-2]
    outer = shape[0] if len(shape) == 3 else 1
    row_bytes = _row_bytes(n_cols, qtype)
    blocks_per_row = n_cols // QK

    def chunks() -> Iterator[np.ndarray]:
        bits = _bits(seed, name)
        per = _rows_per_chunk(row_bytes)
        for e in range(outer):
            for r0 in range(0, n_rows, per):
                rows = min(per, n_rows - r0)
                raw = random_blocks(bits, rows * blocks_per_row, qtype, std)
                if patch is not None:
                    patch(raw.reshape(rows, row_bytes), r0, e)
                yield raw

    return PlannedTensor(name, shape, qtype, chunks)


def _f32(name: str, shape: tuple[int, ...], make: Callable[[], np.ndarray]) -> PlannedTensor:
    def chunks() -> Iterator[np.ndarray]:
        x = np.ascontiguousarray(make(), dtype=np.float32)
        assert x.shape == shape, (name, x.shape, shape)
        yield x.reshape(-1).view(np.uint8)

    return PlannedTensor(name, shape, F32, chunks)


def _zero_rows(lo: int, hi: int, then: Patch | None = None) -> Patch:
    """Zero the rows [lo, hi) (all-zero bytes are a zero scale: weights 0 in both block types)."""

    def patch(chunk: np.ndarray, r0: int, e: int) -> None:
        a, b = max(lo, r0), min(hi, r0 + chunk.shape[0])
        if a < b:
            chunk[a - r0:b - r0] = 0
        if then is not None:
            then(chunk, r0, e)

    return patch


def _set_rows(rows: dict[int, np.ndarray]) -> Patch | None:
    """Replace whole rows by Q8_0 encodings of the given float rows (global row index -> floats)."""
    if not rows:
        return None
    encoded = {r: quantize_q8_0(v) for r, v in rows.items()}

    def patch(chunk: np.ndarray, r0: int, e: int) -> None:
        for r, enc in encoded.items():
            if r0 <= r < r0 + chunk.shape[0]:
                chunk[r - r0] = enc

    return patch


# ---- the plan -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Layout:
    """Dims of the residual stream reserved for routing (skew only): only the designed heads write
    to them (layer 0's previous-token head; with ``drifts``, each later layer's own-token head)."""

    r: int = ROUTER_FEATURES
    drifts: bool = False  # own-token heads write D_l (the routers read it with weight gamma, maybe 0)

    @property
    def const(self) -> int:
        return 0

    @property
    def feat(self) -> slice:  # the token's own features
        return slice(1, 1 + self.r)

    @property
    def prev(self) -> slice:  # the previous token's features (written by layer 0's head 0)
        return slice(1 + self.r, 1 + 2 * self.r)

    @property
    def drift(self) -> slice:  # D_l: written by head 0 (the own-token head) of each layer >= 1
        return slice(1 + 2 * self.r, 1 + 3 * self.r)

    @property
    def written(self) -> int:
        """Reserved dims the embedding leaves at zero (the heads fill them)."""
        return self.r * (2 if self.drifts else 1)

    @property
    def reserved(self) -> int:
        return 1 + (3 if self.drifts else 2) * self.r


def _head_qk(head_dim: int, rope_theta: float, lag: int) -> tuple[np.ndarray, np.ndarray]:
    """q and k of a head that attends ``lag`` tokens back (NEOX RoPE: pair i is dims i and
    i + head_dim/2): the previous-token head (lag 1) or the own-token head of route drift (lag 0).

    q_i = 1 and k_i = e^{i lag theta_i} on the PREV_PAIRS fastest pairs: after RoPE the score
    between positions t and j is sum_i cos((t - j - lag) theta_i), largest at t - j = lag.
    """
    half = head_dim // 2
    theta = rope_theta ** (-2.0 * np.arange(PREV_PAIRS) / head_dim)
    q = np.zeros(head_dim)
    k = np.zeros(head_dim)
    q[:PREV_PAIRS] = 1.0
    k[:PREV_PAIRS] = np.cos(lag * theta)
    k[half:half + PREV_PAIRS] = np.sin(lag * theta)
    return q, k


def _drift_rows(seed: int, layer: int, lay: _Layout, alpha: float, n_embd: int) -> np.ndarray:
    """``c R_l`` on the token's features and ``c alpha R_l`` on the previous token's, ``c = 1 /
    sqrt(1 + alpha^2)``: row j maps the routing dims to ``(D_l)_j = (R_l g_t)_j`` at unit variance."""
    g = _gen(seed, f"blk.{layer}.route_drift")
    R = g.standard_normal((lay.r, lay.r)) / math.sqrt(lay.r)
    c = 1.0 / math.sqrt(1.0 + alpha * alpha)
    rows = np.zeros((lay.r, n_embd))
    rows[:, lay.feat] = c * R
    rows[:, lay.prev] = c * alpha * R
    return rows


def plan(spec: SynthSpec, shape: MoeShape, vocab: Vocab) -> list[PlannedTensor]:
    """Every tensor of the file, in file order: llama.cpp's exact set for the architecture."""
    seed = spec.seed
    wq, _ = WTYPES[spec.wtype]
    E, V, hd = shape.n_embd, shape.n_vocab, shape.head_dim
    F, Fsh, X = shape.n_ff_exp, shape.n_ff_shexp, shape.n_expert
    qd, kvd = shape.q_dim, shape.kv_dim
    n_layer = spec.layers(shape)
    skew = spec.skew
    lay = _Layout(drifts=spec.own_token_heads(shape))
    profile: list[tuple[float, float]] = (
        ROUTING_PROFILES[shape.name].for_layers(n_layer) if skew else [])
    # RMS of an embedding row: const ~1, r unit features, r (2r with drift) zeros, the rest unit
    # variance.
    rms_embd = math.sqrt((E - lay.written) / E) if skew else 1.0
    out: list[PlannedTensor] = []

    def mat(name: str, shp: tuple[int, ...], std: float, patch: Patch | None = None,
            qtype: GGMLQuantizationType = DENSE) -> None:
        out.append(_matrix(seed, name, shp, qtype, std, patch))

    def ones(name: str, n: int, values: dict[int, float] | None = None) -> None:
        def make() -> np.ndarray:
            x = np.ones(n, dtype=np.float32)
            for i, v in (values or {}).items():
                x[i] = v
            return x
        out.append(_f32(name, (n,), make))

    def normal(name: str, shp: tuple[int, ...], std: float,
               fix: Callable[[np.ndarray], None] | None = None) -> None:
        def make() -> np.ndarray:
            x = _gen(seed, name).standard_normal(shp, dtype=np.float32) * np.float32(std)
            if fix is not None:
                fix(x)
            return x
        out.append(_f32(name, shp, make))

    # Embeddings: the random quants of the reserved dims already are the token's features (unit
    # variance, like every other dim); set the constant, and zero the dims the heads write.
    def embd_patch(chunk: np.ndarray, r0: int, e: int) -> None:
        blocks = chunk.reshape(chunk.shape[0], E // QK, 34)
        c = lay.const
        blocks[:, c // QK, 1] &= np.uint8(0x7F)  # positive scale (fp16 sign bit) for the constant
        blocks[:, c // QK, 2 + c % QK] = _CONST_QUANT
        lo, hi = lay.prev.start, lay.prev.start + lay.written
        for b in range(lo // QK, -(-hi // QK)):
            a, z = max(lo, b * QK), min(hi, (b + 1) * QK)
            blocks[:, b, 2 + a - b * QK:2 + z - b * QK] = 0

    mat("token_embd.weight", (V, E), 1.0, embd_patch if skew else None)
    ones("output_norm.weight", E)
    mat("output.weight", (V, E), E ** -0.5, _zero_rows_set(CONTROL_IDS))

    for il in range(n_layer):
        p = f"blk.{il}."
        # Head 0 is designed in layer 0 (the previous-token head) and, with own-token heads, in
        # every later layer (writing D_l).
        drift_head = lay.drifts and il >= 1
        designed = skew and il == 0 or drift_head
        ones(p + "attn_norm.weight", E)

        q_rows: dict[int, np.ndarray] = {}
        k_rows: dict[int, np.ndarray] = {}
        v_rows: dict[int, np.ndarray] = {}
        q_zero = k_zero = 0
        if designed:
            q_vec, k_vec = _head_qk(hd, shape.rope_theta, lag=0 if drift_head else 1)
            if shape.qkv_bias:  # q and k come from the biases: zero the head's weight rows
                q_zero, k_zero = hd, hd
            else:  # q and k read the constant dim; attn_q_norm / attn_k_norm normalise them
                for i in range(hd):
                    q_rows[i] = _one_hot(E, lay.const, q_vec[i])
                    k_rows[i] = _one_hot(E, lay.const, k_vec[i])
            if drift_head:  # R_l g_t less the R_{l-1} g_t that layer l-1 wrote (none by layer 0)
                rows = _drift_rows(seed, il, lay, profile[il][1], E)
                if il >= 2:
                    rows = rows - _drift_rows(seed, il - 1, lay, profile[il - 1][1], E)
                v_rows = {j: rows[j] for j in range(lay.r)}
            else:  # the previous-token head's values: the token's features, scaled by 1 / rms_embd
                v_rows = {j: _one_hot(E, lay.feat.start + j, 1.0) for j in range(lay.r)}
            v_rows |= {j: np.zeros(E) for j in range(lay.r, hd)}
        mat(p + "attn_q.weight", (qd, E), E ** -0.5, _zero_rows(0, q_zero, _set_rows(q_rows)))
        mat(p + "attn_k.weight", (kvd, E), E ** -0.5, _zero_rows(0, k_zero, _set_rows(k_rows)))
        mat(p + "attn_v.weight", (kvd, E), E ** -0.5, _set_rows(v_rows))
        if shape.qkv_bias:
            scale = math.sqrt(PREV_GAIN * hd / PREV_PAIRS)  # peak score PREV_GAIN * sqrt(hd)

            def head0(vec: np.ndarray | None, scale: float = scale) -> Callable[[np.ndarray], None]:
                def fix(x: np.ndarray) -> None:  # head 0's bias: the designed q or k, or 0 for v
                    x[:hd] = 0.0 if vec is None else vec * scale
                return fix

            normal(p + "attn_q.bias", (qd,), QKV_BIAS_STD, head0(q_vec) if designed else None)
            normal(p + "attn_k.bias", (kvd,), QKV_BIAS_STD, head0(k_vec) if designed else None)
            normal(p + "attn_v.bias", (kvd,), QKV_BIAS_STD, head0(None) if designed else None)
        else:
            # Norm gains on the head's RoPE pairs make its peak score PREV_GAIN * sqrt(hd).
            gain = {i: math.sqrt(PREV_GAIN) for i in _pair_dims(hd)} if designed else None
            ones(p + "attn_q_norm.weight", hd, gain)
            ones(p + "attn_k_norm.weight", hd, gain)

        o_patch: Patch | None = None
        if skew:
            # Head 0 of layer 0 writes its output (the previous token's features) to the prev dims;
            # a drift head its own to the drift dims, undoing the RMS norm of the layer's input.
            o_rows: dict[int, np.ndarray] = {}
            if drift_head:
                undo = residual_rms(shape.name, il)
                o_rows = {lay.drift.start + j: _one_hot(qd, j, undo) for j in range(lay.r)}
            elif designed:
                o_rows = {lay.prev.start + j: _one_hot(qd, j, rms_embd) for j in range(lay.r)}
            o_patch = _zero_rows(0, lay.reserved, _set_rows(o_rows))
        mat(p + "attn_output.weight", (E, qd), qd ** -0.5, o_patch)
        ones(p + "ffn_norm.weight", E)

        if skew:
            sigma_b, alpha = profile[il]
            out.append(_f32(p + "ffn_gate_inp.weight", (X, E),
                            _router(seed, p + "ffn_gate_inp.weight", X, E, lay, sigma_b, alpha,
                                    spec.drift(shape))))
        else:
            normal(p + "ffn_gate_inp.weight", (X, E), ROUTER_STD * E ** -0.5)

        down_patch = _zero_rows(0, lay.reserved) if skew else None
        mat(p + "ffn_gate_exps.weight", (X, F, E), E ** -0.5, qtype=wq)
        mat(p + "ffn_up_exps.weight", (X, F, E), E ** -0.5, qtype=wq)
        mat(p + "ffn_down_exps.weight", (X, E, F), F ** -0.5, down_patch, qtype=wq)
        if Fsh:
            normal(p + "ffn_gate_inp_shexp.weight", (E,), E ** -0.5)
            mat(p + "ffn_gate_shexp.weight", (Fsh, E), E ** -0.5)
            mat(p + "ffn_up_shexp.weight", (Fsh, E), E ** -0.5)
            mat(p + "ffn_down_shexp.weight", (E, Fsh), Fsh ** -0.5, down_patch)
    return out


def _one_hot(n: int, i: int, v: float) -> np.ndarray:
    x = np.zeros(n)
    x[i] = v
    return x


def _pair_dims(head_dim: int) -> list[int]:
    half = head_dim // 2
    return [*range(PREV_PAIRS), *range(half, half + PREV_PAIRS)]


def _zero_rows_set(rows: tuple[int, ...]) -> Patch:
    def patch(chunk: np.ndarray, r0: int, e: int) -> None:
        for r in rows:
            if r0 <= r < r0 + chunk.shape[0]:
                chunk[r - r0] = 0

    return patch


def _router(seed: int, name: str, n_expert: int, n_embd: int, lay: _Layout, sigma_b: float,
            alpha: float, gamma: float = 0.0) -> Callable[[], np.ndarray]:
    """Router rows reading only the reserved dims (see the module doc): popularity ``b`` on the
    constant, ``u`` on the token's features, ``alpha * u`` on the previous token's and, with
    drift, ``gamma * v`` on ``D_l``; the token part is scaled to unit variance."""

    def make() -> np.ndarray:
        g = _gen(seed, name)
        b = g.standard_normal(n_expert)
        u = g.standard_normal((n_expert, lay.r)) / math.sqrt(lay.r)
        c = 1.0 / math.sqrt((1.0 + alpha * alpha) * (1.0 + gamma * gamma))
        w = np.zeros((n_expert, n_embd), dtype=np.float32)
        w[:, lay.const] = ROUTER_SCALE * sigma_b * b
        w[:, lay.feat] = ROUTER_SCALE * c * u
        w[:, lay.prev] = ROUTER_SCALE * c * alpha * u
        if lay.drifts:  # D_l already has unit variance: only the 1 / sqrt(1 + gamma^2) applies
            v = g.standard_normal((n_expert, lay.r)) / math.sqrt(lay.r)
            w[:, lay.drift] = ROUTER_SCALE * gamma / math.sqrt(1.0 + gamma * gamma) * v
        return w

    return make


# ---- vocabulary ---------------------------------------------------------------------------------

@lru_cache(maxsize=4)
def padded_vocab(n_vocab: int) -> Vocab:
    """bmoe.synth.vocab's vocabulary plus filler words up to ``n_vocab`` tokens.

    Fillers are distinct pronounceable words (" kodure"), normal tokens with the lowest scores;
    their texts are longer than any base piece, so no prompt merges into them by accident of the
    base vocabulary's pieces (and if one did, it would only be another valid tokenization).
    """
    base = byte_vocab()
    n_fill = n_vocab - len(base)
    if n_fill < 0:
        raise ConfigError(f"vocab size {n_vocab} is below the base vocabulary's {len(base)}")
    syll = [c + v for c in _FILLER_CONSONANTS for v in _FILLER_VOWELS]
    n = len(syll)
    if n_fill > n ** 3:
        raise ConfigError(f"vocab size {n_vocab} needs more filler words than {n ** 3}")
    # i -> (i * 7919 + 12345) mod n^3 is a bijection (7919 is prime, n^3 = 2^12 * 5^3): varied words.
    j = (np.arange(n_fill, dtype=np.int64) * 7919 + 12345) % n ** 3
    a, b, c = (j // (n * n)).tolist(), (j // n % n).tolist(), (j % n).tolist()
    words = tuple(SPACE + syll[x] + syll[y] + syll[z] for x, y, z in zip(a, b, c))
    tokens = base.tokens + words
    assert len(set(tokens)) == len(tokens)  # llama.cpp aborts on a duplicated token text
    low = min(base.scores) - 1.0
    return Vocab(tokens, base.scores + (low,) * n_fill, base.types + (int(TokenType.NORMAL),) * n_fill)


class _Writer(GGUFWriter):
    """gguf-py's writer, with long metadata arrays (the 150k-token vocabulary) packed in one go
    instead of value by value (1.5 s -> 0.1 s); everything else is gguf-py's own packing."""

    def _pack_val(self, val: Any, vtype: GGUFValueType, add_vtype: bool,
                  sub_type: GGUFValueType | None = None) -> bytes:
        if (vtype != GGUFValueType.ARRAY or self.endianess != GGUFEndian.LITTLE
                or not isinstance(val, (list, tuple)) or len(val) < 1024):
            return super()._pack_val(val, vtype, add_vtype, sub_type)
        ltype = sub_type if sub_type is not None else GGUFValueType.get_type(val[0])
        if ltype == GGUFValueType.STRING and all(isinstance(v, str) for v in val):
            enc = [v.encode("utf-8") for v in val]
            lens = np.array([len(e) for e in enc], dtype=np.int64)
            # Interleave each 8-byte length with its string, vectorised: string i starts at
            # starts[i] + 8, and its bytes sit at text offsets prior[i] .. prior[i] + lens[i].
            out = np.empty(8 * len(enc) + int(lens.sum()), dtype=np.uint8)
            starts = np.concatenate([[0], np.cumsum(lens + 8)[:-1]])
            prior = np.concatenate([[0], np.cumsum(lens)[:-1]])
            out[starts[:, None] + np.arange(8)] = lens.astype("<u8").view(np.uint8).reshape(-1, 8)
            dest = np.arange(int(lens.sum())) + np.repeat(starts + 8 - prior, lens)
            out[dest] = np.frombuffer(b"".join(enc), dtype=np.uint8)
            body = out.tobytes()
        elif ltype == GGUFValueType.FLOAT32 and all(isinstance(v, float) for v in val):
            body = np.asarray(val, dtype="<f4").tobytes()
        elif ltype == GGUFValueType.INT32 and all(type(v) is int for v in val):
            body = np.asarray(val, dtype="<i4").tobytes()
        else:
            return super()._pack_val(val, vtype, add_vtype, sub_type)
        head = struct.pack("<I", vtype) if add_vtype else b""
        return head + struct.pack("<IQ", ltype, len(val)) + body


def _write_metadata(w: GGUFWriter, spec: SynthSpec, shape: MoeShape, vocab: Vocab) -> None:
    a = shape.arch
    n_layer = spec.layers(shape)
    write_moe_keys(
        w, a, name=f"bmoe-synth-{shape.name}-l{n_layer}-{spec.wtype}-s{spec.seed}" + ("" if spec.skew else "-noskew"),
        file_type=int(WTYPES[spec.wtype][1]), context_length=shape.context_length, n_embd=shape.n_embd,
        n_layer=n_layer, n_head=shape.n_head, n_head_kv=shape.n_head_kv, head_dim=shape.head_dim,
        rms_eps=shape.rms_eps, rope_theta=shape.rope_theta, n_expert=shape.n_expert,
        n_expert_used=spec.top_k(shape), n_ff_exp=shape.n_ff_exp,
    )
    w.add_uint32(f"{a}.feed_forward_length", shape.n_ff)
    if shape.n_ff_shexp:
        w.add_uint32(f"{a}.expert_shared_feed_forward_length", shape.n_ff_shexp)
    write_tokenizer(w, vocab)


# ---- writing ------------------------------------------------------------------------------------

def planned(spec: SynthSpec) -> tuple[MoeShape, Vocab, list[PlannedTensor]]:
    shape = spec.validate()
    vocab = padded_vocab(shape.n_vocab)
    if shape.arch in FAMILIES:
        return shape, vocab, _FamilyBuilder(spec, shape, vocab).plan()
    return shape, vocab, plan(spec, shape, vocab)


# ---- the families of bmoe.synth.families, at real widths ------------------------------------------

MXFP4 = GGMLQuantizationType.MXFP4
_FP4_STD = 2.9  # std of a uniform random e2m1 nibble (values 0, +-0.5 .. +-6)


def _mxfp4_blocks(bits: np.random.BitGenerator, n_blocks: int, std: float) -> np.ndarray:
    """Random MXFP4 blocks (an E8M0 power-of-two scale, 16 bytes of e2m1 nibbles) of about ``std``."""
    raw = bits.random_raw(-(-n_blocks * 17 // 8)).view(np.uint8)[: n_blocks * 17]
    blocks = raw.reshape(n_blocks, 17)
    blocks[:, 0] = np.uint8(127 + round(math.log2(std / _FP4_STD)))
    return raw


class _FamilyBuilder:
    """The builder ``bmoe.synth.families`` plans with, making random blocks at a shape's widths:
    dense matrices Q8_0, routers, norms and biases F32, experts the spec's type (gpt-oss: MXFP4)."""

    def __init__(self, spec: SynthSpec, shape: MoeShape, vocab: Vocab) -> None:
        self.synth, self.shape, self.vocab = spec, shape, vocab
        family = FAMILIES[shape.arch]
        self.family = family
        self.E, self.F, self.hd = shape.n_embd, shape.n_ff_exp, shape.head_dim
        self.F_dense, self.F_shexp = shape.n_ff, shape.n_ff_shexp or shape.n_ff_exp
        self.n_head, self.n_head_kv = shape.n_head, shape.n_head_kv
        self.dense_lead = shape.n_dense_lead
        self.router_std = ROUTER_STD * shape.n_embd ** -0.5
        self.x = {**dict(family.extra), **dict(shape.extra)}
        self.spec = _FamilySpec(spec.layers(shape), shape.n_nextn, shape.n_expert)
        kv = family.overrides(self).get("n_head_kv")  # type: ignore[arg-type]
        if isinstance(kv, int):
            self.n_head_kv = kv
        self.out: list[PlannedTensor] = []

    def plan(self) -> list[PlannedTensor]:
        E, V = self.E, self.shape.n_vocab
        self.mat("token_embd.weight", (V, E), 1.0)
        self.ones(self.family.output_norm, E)
        self.mat("output.weight", (V, E), E ** -0.5, zero_rows=CONTROL_IDS)
        for il in range(self.spec.n_block):
            self.family.layer(self, il)  # type: ignore[arg-type]
        return self.out

    def mat(self, name: str, shape: tuple[int, ...], std: float, zero_rows: tuple[int, ...] = (),
            qtype: GGMLQuantizationType | None = None) -> None:
        if name.endswith("ffn_gate_inp.weight"):  # routers stay F32, as in the qwen plan
            self.f32(name, shape, std)
            return
        seed = self.synth.seed
        if qtype == MXFP4:
            self.out.append(self._mxfp4(name, shape, std))
            return
        patch = _zero_rows_set(zero_rows) if zero_rows else None
        self.out.append(_matrix(seed, name, shape, qtype or DENSE, std, patch))

    def _mxfp4(self, name: str, shape: tuple[int, ...], std: float) -> PlannedTensor:
        seed, rows = self.synth.seed, int(np.prod(shape[:-1]))
        blocks_per_row = shape[-1] // QK
        per = _rows_per_chunk(blocks_per_row * 17)

        def chunks() -> Iterator[np.ndarray]:
            bits = _bits(seed, name)
            for r0 in range(0, rows, per):
                yield _mxfp4_blocks(bits, min(per, rows - r0) * blocks_per_row, std)

        return PlannedTensor(name, shape, MXFP4, chunks)

    def f32(self, name: str, shape: tuple[int, ...], std: float) -> None:
        seed = self.synth.seed
        self.out.append(_f32(name, shape, lambda: _gen(seed, name).standard_normal(shape, dtype=np.float32) * std))

    def ones(self, name: str, n: int) -> None:
        self.const(name, n, 1.0)

    def const(self, name: str, n: int, value: float) -> None:
        self.out.append(_f32(name, (n,), lambda: np.full((n,), value, dtype=np.float32)))

    def experts(self, p: str, qtype: GGMLQuantizationType | None = None) -> None:
        E, F, N = self.E, self.F, self.shape.n_expert
        wq = qtype or WTYPES[self.synth.wtype][0]
        self.mat(p + "ffn_gate_exps.weight", (N, F, E), E ** -0.5, qtype=wq)
        self.mat(p + "ffn_up_exps.weight", (N, F, E), E ** -0.5, qtype=wq)
        self.mat(p + "ffn_down_exps.weight", (N, E, F), F ** -0.5, qtype=wq)

    def write_metadata(self, w: GGUFWriter) -> None:
        spec, shape, a = self.synth, self.shape, self.shape.arch
        keys: dict[str, Any] = dict(
            name=f"bmoe-synth-{shape.name}-l{self.spec.n_layer}-{spec.wtype}-s{spec.seed}-noskew",
            file_type=int(WTYPES[spec.wtype][1]), context_length=shape.context_length, n_embd=shape.n_embd,
            n_layer=self.spec.n_block, n_head=shape.n_head, n_head_kv=shape.n_head_kv, head_dim=shape.head_dim,
            rms_eps=shape.rms_eps, rope_theta=shape.rope_theta, n_expert=shape.n_expert,
            n_expert_used=spec.top_k(shape), n_ff_exp=shape.n_ff_exp, n_nextn=shape.n_nextn,
        )
        keys.update(self.family.overrides(self))  # type: ignore[arg-type]
        write_moe_keys(w, a, **keys)
        self.family.keys(w, self)  # type: ignore[arg-type]
        write_tokenizer(w, self.vocab)


@dataclass(frozen=True)
class _FamilySpec:
    """What a family plan reads of ``b.spec``: main blocks, MTP blocks, experts; never fused."""

    n_layer: int
    n_nextn: int
    n_expert: int
    fused: bool = False

    @property
    def n_block(self) -> int:
        return self.n_layer + self.n_nextn


DIRECT_ALIGN = 4096


class _Sink:
    """Appends to a file through O_DIRECT (no page-cache churn over tens of GB, and faster here),
    from a writer thread that also does the staging copies, so the caller generates the next chunk
    meanwhile (numpy copies and pwrite release the GIL). At most ``MAX_PENDING`` chunks wait.

    Bytes are staged in an aligned buffer of CHUNK_BYTES that starts with the file's tail from its
    last 4096-aligned offset, so every write is aligned; the last one is padded, then the file is
    cut back to its true size. Filesystems that refuse O_DIRECT get buffered writes.
    """

    MAX_PENDING = 2

    def __init__(self, path: Path, direct: bool = True) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.size = path.stat().st_size
        self._base = self.size - self.size % DIRECT_ALIGN
        with open(path, "rb") as f:
            f.seek(self._base)
            tail = f.read()
        self.direct = direct and hasattr(os, "O_DIRECT")
        try:
            self._fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC | (os.O_DIRECT if self.direct else 0))
        except OSError:
            self._fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
            self.direct = False
        self._path = path
        self._buf = _aligned(CHUNK_BYTES)
        self._fill = 0
        self._pending: list = []
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bmoe-synth-write")
        self._put(np.frombuffer(tail, dtype=np.uint8))

    def write(self, data: np.ndarray | bytes) -> None:
        arr = np.frombuffer(data, dtype=np.uint8) if isinstance(data, bytes) else data.reshape(-1)
        self.size += arr.size
        self._pending.append(self._pool.submit(self._put, arr))
        while len(self._pending) > self.MAX_PENDING:
            self._pending.pop(0).result()  # back-pressure; a write error surfaces here

    def _put(self, data: np.ndarray) -> None:  # writer thread
        pos = 0
        while pos < data.size:
            n = min(self._buf.size - self._fill, data.size - pos)
            self._buf[self._fill:self._fill + n] = data[pos:pos + n]
            self._fill += n
            pos += n
            if self._fill == self._buf.size:
                self._flush()

    def _flush(self) -> None:  # writer thread
        n = -(-self._fill // DIRECT_ALIGN) * DIRECT_ALIGN
        self._buf[self._fill:n] = 0
        view = memoryview(self._buf[:n])
        done = 0
        while done < n:
            try:
                done += os.pwrite(self._fd, view[done:], self._base + done)
            except OSError as e:
                if not self.direct or e.errno != errno.EINVAL:
                    raise
                os.close(self._fd)  # accepted at open, refused at write: go buffered
                self._fd = os.open(self._path, os.O_WRONLY | os.O_CLOEXEC)
                self.direct = False
        self._base += n
        self._fill = 0

    def close(self) -> None:
        try:
            for fut in self._pending:
                fut.result()
            self._pending.clear()
            if self._fill:
                self._pool.submit(self._flush).result()
            os.ftruncate(self._fd, self.size)
        finally:
            self._pool.shutdown(wait=True)
            os.close(self._fd)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self._pool.shutdown(wait=True, cancel_futures=True)
            os.close(self._fd)


def _aligned(n: int) -> np.ndarray:
    raw = np.empty(n + DIRECT_ALIGN, dtype=np.uint8)
    skip = -raw.ctypes.data % DIRECT_ALIGN
    return raw[skip:skip + n]


def write_synth(path: str | os.PathLike, spec: SynthSpec,
                progress: Callable[[int, int], None] | None = None) -> Path:
    """Write the model to ``path`` (via ``path.partial``, renamed at the end) and return ``path``.

    ``progress(bytes_done, bytes_total)`` is called after every chunk, over tensor data bytes.
    """
    shape, vocab, tensors = planned(spec)
    path = Path(path)
    total = sum(t.nbytes for t in tensors)
    check_destination(path, total)
    tmp = fresh_partial(path.with_name(path.name + ".partial"))
    try:
        w = _Writer(tmp, shape.arch)
        if shape.arch in FAMILIES:
            _FamilyBuilder(spec, shape, vocab).write_metadata(w)
        else:
            _write_metadata(w, spec, shape, vocab)
        for t in tensors:
            w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes, raw_dtype=t.qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        w.close()
        done = 0
        with _Sink(tmp) as sink:
            for t in tensors:
                sink.write(bytes(-sink.size % GGUF_ALIGNMENT))
                written = 0
                for chunk in t.chunks():
                    sink.write(chunk)
                    written += chunk.nbytes
                    done += chunk.nbytes
                    if progress is not None:
                        progress(done, total)
                assert written == t.nbytes, (t.name, written, t.nbytes)
            sink.write(bytes(-sink.size % GGUF_ALIGNMENT))
        os.replace(tmp, path)
    except OSError as e:
        remove_partial(tmp)
        raise ConfigError(f"cannot write {path}: {e.strerror or e}") from e
    except BaseException:
        remove_partial(tmp)
        raise
    return path


def check_destination(path: Path, nbytes: int, reclaimed: int = 0) -> None:
    """A clear error before writing, not an OSError half-way through tens of GB. ``reclaimed``:
    bytes a replaced file frees before the write."""
    folder = path.parent
    if not folder.is_dir():
        raise ConfigError(f"cannot write {path}: {folder} is not a directory")
    free = shutil.disk_usage(folder).free + reclaimed
    if free < nbytes + (64 << 20):
        raise ConfigError(f"cannot write {path}: it needs {nbytes / 2**30:.2f} GiB, "
                          f"{free / 2**30:.2f} GiB are free there")


def total_bytes(spec: SynthSpec) -> int:
    return sum(t.nbytes for t in planned(spec)[2])


def _expert_type(tensors: list[PlannedTensor]) -> str:
    """The routed experts' type as written (gpt-oss's are MXFP4 whatever --type says)."""
    return next((t.qtype.name.lower() for t in tensors if t.name.endswith("_exps.weight")), "no")


def describe(spec: SynthSpec) -> str:
    """One line: what the file is (for the CLI)."""
    shape, _, tensors = planned(spec)
    total = sum(t.nbytes for t in tensors)
    n_layer = spec.layers(shape)
    how = "none (plain random routers)"
    if spec.skew:
        how = f"fitted per layer from {ROUTING_PROFILES[shape.name].source}"
        if spec.own_token_heads(shape):
            how += f", route drift {spec.drift(shape):g}"
    return (f"{shape.name} ({shape.source}): {shape.arch}, {n_layer} of {shape.n_layer} layers, "
            f"{shape.n_expert} experts top-{spec.top_k(shape)}, {_expert_type(tensors)} experts, "
            f"{total / 2**30:.2f} GiB of tensors; routing skew: {how}")


# ---- CLI ----------------------------------------------------------------------------------------

def add_synth_command(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``bmoe synth``; its handler (``args.func``) returns an exit code and raises bmoe
    errors (ConfigError) for the CLI to print."""
    from bmoe.synth.shapes import SHAPES

    p = subparsers.add_parser(
        "synth", help="write a random MoE GGUF with a real model's shapes (fast, any size)",
        description="Write a random-weight GGUF with the exact tensor shapes of a known MoE model. "
                    "With --like qwen3-30b-a3b the routers are structured so routing resembles the real "
                    "model's (popularity skew, step-to-step reuse), fitted per layer to a recorded trace; "
                    "qwen1.5-moe-a2.7b borrows that profile by relative depth (no trace of its own). Every "
                    "other --like gets plain random routers (near-uniform routing: the line it prints "
                    "says 'routing skew: none'). Experts are written in --type (default q4_0), except "
                    "gpt-oss shapes', which are MXFP4 whatever --type says.")
    p.add_argument("out", type=Path, help="output .gguf file")
    p.add_argument("--like", required=True, metavar="NAME",
                   help=f"the model whose shapes to copy: {', '.join(sorted(SHAPES))}")
    p.add_argument("--layers", type=int, default=None, help="layer count (default: the real one)")
    p.add_argument("--type", dest="wtype", default="q4_0", choices=tuple(WTYPES),
                   help="expert weight type (default q4_0; gpt-oss experts are MXFP4 whatever it says); "
                        "dense matrices are q8_0, norms and routers f32")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    p.add_argument("--experts-used", type=int, default=None, metavar="K",
                   help="top-k written to the file (default: the real one)")
    p.add_argument("--no-skew", dest="skew", action="store_false",
                   help="plain random routers (near-uniform routing, no reuse): a control for the shapes "
                        "with a routing profile (the others get these anyway)")
    p.add_argument("--route-drift", type=float, default=None, metavar="GAMMA",
                   help=f"how much each layer moves what its router reads, so that predicting a layer's "
                        f"experts one layer early is right as often as on a real model (default "
                        f"{DEFAULT_ROUTE_DRIFT:g}: about 82 %% of a token's experts; 0.1: about 90 %%, 0.3: "
                        f"about 74 %%; 0: always right, a best case); qwen3-30b-a3b only")
    p.add_argument("--force", action="store_true", help="replace an existing file (never written through a link)")
    p.set_defaults(func=_cmd_synth)
    return p


def _cmd_synth(args: argparse.Namespace) -> int:
    # Shapes without a routing profile (the families) get plain random routers, as describe() says.
    skew = args.skew and get_shape(args.like).name in ROUTING_PROFILES
    spec = SynthSpec(like=args.like, n_layer=args.layers, wtype=args.wtype, seed=args.seed,
                     skew=skew, n_expert_used=args.experts_used, route_drift=args.route_drift)
    spec.validate()  # the flags first: a bad one is named before the output path is looked at
    check_new_file(args.out, "synth", force=args.force)
    check_destination(args.out, total_bytes(spec), reclaimable_bytes(args.out))
    make_room(args.out, "synth")  # everything checked: only now is a --force'd file replaced
    print(describe(spec), file=sys.stderr)
    from tqdm import tqdm

    with tqdm(total=None, unit="B", unit_scale=True, unit_divisor=1024,
              desc=f"writing {args.out.name}", file=sys.stderr, disable=not sys.stderr.isatty()) as bar:
        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)

        path = write_synth(args.out, spec, progress)
    print(path)
    return 0

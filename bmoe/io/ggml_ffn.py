"""ggml's own kernels run on one expert at a time: the native half of the expert-major prefill.

llama.cpp computes a MoE layer's experts in one ``mul_mat_id`` over every routed expert, so all of
them must be in memory while it runs. To stream a long prompt's experts one group at a time, bmoe
computes the layer's gate, up, SwiGLU and down itself, group by group, with the very kernels
llama.cpp would have used: a ``mul_mat_id`` over a one-expert view of the expert tensor (``ids``
all 0), ``ggml_swiglu_split``, ``mul_mat_id`` again. Each output row of ``mul_mat_id`` is one
``vec_dot`` per weight row over the same quantised input row, and the GLU works row by row, so the
rows come out bit-identical to the ones the whole-layer node computes; which rows share a call
does not enter. (Plain ``mul_mat`` would not do: it may take a tiled sgemm path that sums in
another order.)

Called through ctypes on libggml-base / libggml-cpu as llama-cpp-python ships them, on the
compute thread between two graph nodes, when no ggml worker runs. Nothing here knows about caches.
"""

from __future__ import annotations

import ctypes
import pathlib
from dataclasses import dataclass
from functools import cache

import numpy as np

from bmoe.errors import SeamMismatchError
from bmoe.io.ggml import GgmlTensor, libggml_base

GGML_TYPE_F32 = 0
GGML_TYPE_I32 = 26
GGML_GLU_OP_SWIGLU = 2  # enum ggml_glu_op: REGLU, GEGLU, SWIGLU, ...
GGML_STATUS_SUCCESS = 0


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


@cache
def _libs() -> tuple[ctypes.CDLL, ctypes.CDLL]:
    import llama_cpp

    base = libggml_base()
    lib_dir = pathlib.Path(llama_cpp.__file__).parent / "lib"
    found = sorted(lib_dir.glob("libggml-cpu.*"))
    if not found:
        raise SeamMismatchError(f"libggml-cpu not found in {lib_dir}")
    cpu = ctypes.CDLL(str(found[0]))
    p = ctypes.c_void_p
    for name, res, args in (
        ("ggml_init", p, [_InitParams]),
        ("ggml_free", None, [p]),
        ("ggml_set_no_alloc", None, [p, ctypes.c_bool]),
        ("ggml_new_tensor_2d", p, [p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]),
        ("ggml_new_tensor_3d", p, [p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]),
        ("ggml_mul_mat_id", p, [p, p, p, p]),
        ("ggml_swiglu_split", p, [p, p, p]),
        ("ggml_mul", p, [p, p, p]),
        ("ggml_new_graph", p, [p]),
        ("ggml_build_forward_expand", None, [p, p]),
        ("ggml_graph_overhead", ctypes.c_size_t, []),
        ("ggml_row_size", ctypes.c_size_t, [ctypes.c_int, ctypes.c_int64]),
        ("ggml_op_name", ctypes.c_char_p, [ctypes.c_int]),
    ):
        fn = getattr(base, name)
        fn.restype, fn.argtypes = res, args
    cpu.ggml_graph_compute_with_ctx.restype = ctypes.c_int
    cpu.ggml_graph_compute_with_ctx.argtypes = [p, p, ctypes.c_int]
    cpu.ggml_cpu_init.restype, cpu.ggml_cpu_init.argtypes = None, []
    cpu.ggml_cpu_init()
    return base, cpu


@cache
def op_code(name: str) -> int:
    """The ``enum ggml_op`` value of ``name`` ("MUL_MAT_ID", "GLU", "NONE") in the loaded libggml."""
    base, _ = _libs()
    for code in range(256):
        got = base.ggml_op_name(code)
        if got is None:
            break
        if got.decode() == name:
            return code
    raise SeamMismatchError(f"ggml has no op named {name}")


@dataclass(frozen=True)
class ExpertWeights:
    """One projection's expert tensor as the graph holds it: expert ``e`` at ``data + e*nb2``."""

    type: int
    n_in: int  # ne[0]: the input width
    n_out: int  # ne[1]: the output width
    data: int
    nb1: int
    nb2: int

    @classmethod
    def of(cls, tensor: int) -> ExpertWeights:
        t = GgmlTensor.from_address(tensor)
        return cls(t.type, t.ne[0], t.ne[1], t.data, t.nb[1], t.nb[2])


def swiglu_experts(
    gate: ExpertWeights, up: ExpertWeights, down: ExpertWeights, experts: list[int], inputs: list[np.ndarray],
    n_threads: int, scales: tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None] = (None, None, None),
) -> list[np.ndarray]:
    """``down(swiglu(gate x, up x))`` for each expert and its input rows (float32, rows x n_in),
    one ggml graph for the lot; returns each expert's output rows (rows x down.n_out).

    ``scales``: per-expert factors of gate, up and down (None: none), applied as llama.cpp does,
    a ``ggml_mul`` by a broadcast column right after each matmul."""
    base, cpu = _libs()
    n_in, n_ff, n_out = gate.n_in, gate.n_out, down.n_out
    rows = sum(x.shape[0] for x in inputs)
    if base.ggml_row_size(gate.type, n_in) != gate.nb1 or base.ggml_row_size(down.type, n_ff) != down.nb1:
        raise SeamMismatchError("expert tensors with padded rows: not computed expert by expert")
    # Tensor objects, the graph, the activations (gate, up, glu, down) and the work buffer (each
    # input row converted to the weights' dot type, twice over for padding and the id maps).
    f32 = 4 * rows * (5 * n_ff + 2 * n_out)  # with room for the scaled copies
    work = 2 * 4 * rows * (n_in + n_ff) + (1 << 20)
    objects = (len(experts) * 16 + 16) * (ctypes.sizeof(GgmlTensor) + 64)
    size = objects + base.ggml_graph_overhead() + f32 + work
    ctx = base.ggml_init(_InitParams(size, None, False))
    if not ctx:
        raise MemoryError(f"ggml_init could not allocate {size} bytes")
    try:
        gf = base.ggml_new_graph(ctx)
        keep: list[np.ndarray] = []
        outs = []
        for e, x in zip(experts, inputs):
            n = x.shape[0]
            base.ggml_set_no_alloc(ctx, True)
            w = [_view(base, ctx, p, e) for p in (gate, up, down)]
            b = base.ggml_new_tensor_3d(ctx, GGML_TYPE_F32, n_in, 1, n)
            ids = base.ggml_new_tensor_2d(ctx, GGML_TYPE_I32, 1, n)
            xs = np.ascontiguousarray(x, dtype=np.float32)
            zeros = np.zeros(n, dtype=np.int32)
            keep += (xs, zeros)
            _set_data(b, xs.ctypes.data)
            _set_data(ids, zeros.ctypes.data)
            factors = []
            for scale in scales:
                if scale is None:
                    factors.append(None)
                    continue
                column = np.full(n, scale[e], dtype=np.float32)
                keep.append(column)
                f = base.ggml_new_tensor_3d(ctx, GGML_TYPE_F32, 1, 1, n)
                _set_data(f, column.ctypes.data)
                factors.append(f)
            base.ggml_set_no_alloc(ctx, False)
            g = _scaled(base, ctx, base.ggml_mul_mat_id(ctx, w[0], b, ids), factors[0])
            u = _scaled(base, ctx, base.ggml_mul_mat_id(ctx, w[1], b, ids), factors[1])
            a = base.ggml_swiglu_split(ctx, g, u)
            d = _scaled(base, ctx, base.ggml_mul_mat_id(ctx, w[2], a, ids), factors[2])
            base.ggml_build_forward_expand(gf, d)
            outs.append((d, n))
        status = cpu.ggml_graph_compute_with_ctx(ctx, gf, n_threads)
        if status != GGML_STATUS_SUCCESS:
            raise RuntimeError(f"ggml_graph_compute failed with status {status}")
        result = []
        for d, n in outs:
            data = GgmlTensor.from_address(d).data
            buf = (ctypes.c_char * (4 * n * n_out)).from_address(data)
            result.append(np.frombuffer(buf, dtype=np.float32).reshape(n, n_out).copy())
        return result
    finally:
        base.ggml_free(ctx)


def _scaled(base: ctypes.CDLL, ctx: int, t: int, factor: int | None) -> int:
    return t if factor is None else base.ggml_mul(ctx, t, factor)


def _view(base: ctypes.CDLL, ctx: int, w: ExpertWeights, expert: int) -> int:
    t = base.ggml_new_tensor_3d(ctx, w.type, w.n_in, w.n_out, 1)
    _set_data(t, w.data + expert * w.nb2)
    return t


def _set_data(tensor: int, address: int) -> None:
    GgmlTensor.from_address(tensor).data = address


__all__ = ["ExpertWeights", "op_code", "swiglu_experts"]

"""A ctypes mirror of ``struct ggml_tensor``, checked against the libggml actually loaded.

bmoe reads routing ids out of graph nodes and rebinds expert weights by writing ``->data``, so a
layout that drifted under a pin bump would silently corrupt memory. ``check_mirror`` compares the
mirror with libggml before anything is streamed, and refuses on a mismatch. Nothing here runs at
import time.
"""

from __future__ import annotations

import ctypes
import pathlib
from functools import cache

from bmoe.errors import SeamMismatchError

GGML_MAX_DIMS = 4
GGML_MAX_SRC = 10
GGML_MAX_OP_PARAMS = 64
GGML_MAX_NAME = 64


class GgmlTensor(ctypes.Structure):
    # struct ggml_tensor { enum ggml_type type; struct ggml_backend_buffer * buffer;
    #   int64_t ne[4]; size_t nb[4]; enum ggml_op op; int32_t op_params[16]; int32_t flags;
    #   struct ggml_tensor * src[10]; struct ggml_tensor * view_src; size_t view_offs;
    #   void * data; char name[64]; void * extra; char padding[8]; };
    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * GGML_MAX_DIMS),
        ("nb", ctypes.c_size_t * GGML_MAX_DIMS),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * (GGML_MAX_OP_PARAMS // 4)),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * GGML_MAX_SRC),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * GGML_MAX_NAME),
        ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


# Offsets the eval callback reads without building a structure (hot path).
NAME_OFFSET = GgmlTensor.name.offset
DATA_OFFSET = GgmlTensor.data.offset
NE_OFFSET = GgmlTensor.ne.offset
NB_OFFSET = GgmlTensor.nb.offset
SRC_OFFSET = GgmlTensor.src.offset
OP_OFFSET = GgmlTensor.op.offset

# The ggml_tensor_overhead() of this layout: the struct plus ggml's object header.
_GGML_OBJECT_SIZE = 32


@cache
def libggml_base() -> ctypes.CDLL:
    """The ggml-base library that llama-cpp-python ships next to libllama."""
    import llama_cpp

    lib_dir = pathlib.Path(llama_cpp.__file__).parent / "lib"
    candidates = sorted(lib_dir.glob("libggml-base.*"))
    if not candidates:
        raise SeamMismatchError(f"libggml-base not found in {lib_dir}")
    lib = ctypes.CDLL(str(candidates[0]))
    lib.ggml_tensor_overhead.restype = ctypes.c_size_t
    lib.ggml_tensor_overhead.argtypes = []
    lib.ggml_get_name.restype = ctypes.c_char_p
    lib.ggml_get_name.argtypes = [ctypes.c_void_p]
    lib.ggml_get_data.restype = ctypes.c_void_p
    lib.ggml_get_data.argtypes = [ctypes.c_void_p]
    lib.ggml_nbytes.restype = ctypes.c_size_t
    lib.ggml_nbytes.argtypes = [ctypes.c_void_p]
    return lib


def check_overhead() -> None:
    lib = libggml_base()
    expected = ctypes.sizeof(GgmlTensor) + _GGML_OBJECT_SIZE
    got = lib.ggml_tensor_overhead()
    if got != expected:
        raise SeamMismatchError(
            f"ggml_tensor layout changed: libggml reports overhead {got}, the bmoe mirror "
            f"expects {expected}; refusing to stream (see third_party/llama.cpp/SEAM.md)"
        )


def check_live_tensor(address: int) -> None:
    """Compare name and data of one live tensor as the mirror reads them with libggml's getters."""
    lib = libggml_base()
    t = GgmlTensor.from_address(address)
    if lib.ggml_get_name(address) != t.name or (lib.ggml_get_data(address) or 0) != (t.data or 0):
        raise SeamMismatchError(
            "ggml_tensor mirror disagrees with libggml on a live tensor "
            f"(name {t.name!r} vs {lib.ggml_get_name(address)!r}); refusing to stream"
        )

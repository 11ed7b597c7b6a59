"""The ``reserved`` open: the cheap user open for models bigger than RAM + swap.

The ``user`` open (``bmoe.llama.loader``) builds the model with ``llama_model_init_from_user`` and
reads only the dense bytes, but llama.cpp puts every tensor, experts included, in one CPU buffer
allocated with ``ggml_aligned_malloc``: one committed allocation as large as the model, which the
kernel refuses beyond RAM + swap (overcommit heuristic) or beyond the commit limit (strict mode).
The fallback, ``mmap-drop``, then reads the whole file at open (25x the dense bytes of a 30 GB
model).

Here the expert tensors are placed, through the model parameters' ``tensor_buft_overrides``
(pattern = the architecture's expert weight names), in a buffer type of bmoe's own. Its
``alloc_buffer`` reserves the address space with ``mmap(PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS |
MAP_NORESERVE)`` and wraps it with ``ggml_backend_cpu_buffer_from_ptr``: a host buffer the CPU
backend computes from, over memory that is neither committed nor ever touched. llama.cpp's own
CPU buffer then holds only the dense tensors (and the small optional ones it creates), so the
only committed allocation is about the dense bytes, whatever the model's size. The user open's
tensor callback fills the dense tensors and skips the experts as usual; the session rebinds every
expert tensor to its own regions before any decode (the reservation is never read).

``PROT_NONE`` rather than read-write: a private read-write mapping is charged to the commit limit
under ``overcommit_memory=2`` even with ``MAP_NORESERVE``; an inaccessible one never is. Nothing
reads these pages: the filler skips the experts, ``from_ptr`` buffers need no tensor init, and the
session rebinds before computing. So this open is for streamed runs only (a resident run needs
the expert bytes where llama.cpp reads them).

The buffer-type struct (``struct ggml_backend_buffer_type`` of ``ggml-backend-impl.h``: six
function pointers, a device, a context) is not in ggml's public headers, so its ctypes mirror is
checked against libggml on every open (``check_buft_mirror``: the CPU buffer type read through
the mirror must answer name, alignment, host-ness and device as libggml's public getters do);
a mismatch refuses this open (``SeamMismatchError``), and ``auto`` falls back to ``mmap-drop``.
The reservation is unmapped only after ``llama_model_free`` (``from_ptr`` buffers never free the
memory they wrap).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import re
from collections.abc import Callable
from functools import cache
from typing import Any

from bmoe.errors import BudgetError, SeamError, SeamMismatchError
from bmoe.io.ggml import GgmlTensor, libggml_base
from bmoe.io.layout import ModelLayout
from bmoe.io.libc import libc

_PAGE = mmap.PAGESIZE
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)  # Python exports it from 3.13
_MAP_FAILED = ctypes.c_void_p(-1).value
_PROT_NONE = 0  # sys/mman.h; Python's mmap module does not export it
NAME = b"bmoe_reserved"

_GET_NAME = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)  # const char * (*)(buft)
_ALLOC_BUFFER = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
_GET_SIZE = ctypes.CFUNCTYPE(ctypes.c_size_t, ctypes.c_void_p)
_IS_HOST = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p)


class _BuftIface(ctypes.Structure):
    # struct ggml_backend_buffer_type_i {
    #     const char *          (*get_name)      (ggml_backend_buffer_type_t buft);
    #     ggml_backend_buffer_t (*alloc_buffer)  (ggml_backend_buffer_type_t buft, size_t size);
    #     size_t                (*get_alignment) (ggml_backend_buffer_type_t buft);
    #     size_t                (*get_max_size)  (ggml_backend_buffer_type_t buft);   // optional
    #     size_t                (*get_alloc_size)(ggml_backend_buffer_type_t buft, const struct ggml_tensor *);  // optional
    #     bool                  (*is_host)       (ggml_backend_buffer_type_t buft);   // optional
    # };
    _fields_ = [
        ("get_name", ctypes.c_void_p),
        ("alloc_buffer", ctypes.c_void_p),
        ("get_alignment", ctypes.c_void_p),
        ("get_max_size", ctypes.c_void_p),
        ("get_alloc_size", ctypes.c_void_p),
        ("is_host", ctypes.c_void_p),
    ]


class _Buft(ctypes.Structure):
    # struct ggml_backend_buffer_type { struct ggml_backend_buffer_type_i iface;
    #     ggml_backend_dev_t device; void * context; };
    _fields_ = [("iface", _BuftIface), ("device", ctypes.c_void_p), ("context", ctypes.c_void_p)]


class _Override(ctypes.Structure):
    # struct llama_model_tensor_buft_override { const char * pattern; ggml_backend_buffer_type_t buft; };
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


@cache
def _ggml() -> ctypes.CDLL:
    g = libggml_base()
    # ggml_backend_buffer_type_t ggml_backend_cpu_buffer_type(void);
    g.ggml_backend_cpu_buffer_type.restype = ctypes.c_void_p
    g.ggml_backend_cpu_buffer_type.argtypes = []
    # ggml_backend_buffer_t ggml_backend_cpu_buffer_from_ptr(void * ptr, size_t size);
    g.ggml_backend_cpu_buffer_from_ptr.restype = ctypes.c_void_p
    g.ggml_backend_cpu_buffer_from_ptr.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    # const char * ggml_backend_buft_name(ggml_backend_buffer_type_t buft);
    g.ggml_backend_buft_name.restype = ctypes.c_char_p
    g.ggml_backend_buft_name.argtypes = [ctypes.c_void_p]
    # size_t ggml_backend_buft_get_alignment(ggml_backend_buffer_type_t buft);
    g.ggml_backend_buft_get_alignment.restype = ctypes.c_size_t
    g.ggml_backend_buft_get_alignment.argtypes = [ctypes.c_void_p]
    # bool ggml_backend_buft_is_host(ggml_backend_buffer_type_t buft);
    g.ggml_backend_buft_is_host.restype = ctypes.c_bool
    g.ggml_backend_buft_is_host.argtypes = [ctypes.c_void_p]
    # ggml_backend_dev_t ggml_backend_buft_get_device(ggml_backend_buffer_type_t buft);
    g.ggml_backend_buft_get_device.restype = ctypes.c_void_p
    g.ggml_backend_buft_get_device.argtypes = [ctypes.c_void_p]
    # ggml_backend_buffer_type_t ggml_backend_buffer_get_type(ggml_backend_buffer_t buffer);
    g.ggml_backend_buffer_get_type.restype = ctypes.c_void_p
    g.ggml_backend_buffer_get_type.argtypes = [ctypes.c_void_p]
    # void ggml_backend_buffer_free(ggml_backend_buffer_t buffer);
    g.ggml_backend_buffer_free.restype = None
    g.ggml_backend_buffer_free.argtypes = [ctypes.c_void_p]
    return g


def check_buft_mirror() -> _Buft:
    """The CPU buffer type read through the mirror, after checking that the mirror reads it as
    libggml's public getters do: its name, alignment and host-ness through the mirrored function
    pointers, and its device. Raises SeamMismatchError otherwise."""
    g = _ggml()
    cpu_addr = g.ggml_backend_cpu_buffer_type()
    if not cpu_addr:
        raise SeamMismatchError("libggml has no CPU buffer type")
    cpu = _Buft.from_address(cpu_addr)
    iface = cpu.iface
    problems = []
    if not (iface.get_name and iface.alloc_buffer and iface.get_alignment and iface.is_host):
        problems.append("a required function pointer is NULL")
    else:
        name = ctypes.string_at(_GET_NAME(iface.get_name)(cpu_addr) or 0)
        if name != g.ggml_backend_buft_name(cpu_addr):
            problems.append(f"get_name gives {name!r}, libggml {g.ggml_backend_buft_name(cpu_addr)!r}")
        if _GET_SIZE(iface.get_alignment)(cpu_addr) != g.ggml_backend_buft_get_alignment(cpu_addr):
            problems.append("get_alignment disagrees")
        if _IS_HOST(iface.is_host)(cpu_addr) is not True or not g.ggml_backend_buft_is_host(cpu_addr):
            problems.append("is_host disagrees")
    if (cpu.device or None) != (g.ggml_backend_buft_get_device(cpu_addr) or None):
        problems.append("device disagrees")
    if problems:
        raise SeamMismatchError(
            "ggml_backend_buffer_type mirror disagrees with libggml (" + "; ".join(problems)
            + "); refusing the reserved open"
        )
    return cpu


def expert_pattern(layout: ModelLayout) -> str:
    """The regex (std::regex, searched in each tensor name) that matches exactly the layout's
    expert weight tensors, e.g. ``^blk\\.[0-9]+\\.(ffn_down_exps|ffn_gate_exps|ffn_up_exps)\\.weight$``."""
    suffixes = sorted({et.suffix for et in layout.experts.values()})
    if not suffixes:
        raise SeamError(f"{layout.shards[0]}: no expert tensors to reserve")
    return r"^blk\.[0-9]+\.(" + "|".join(re.escape(s) for s in suffixes) + r")\.weight$"


class ExpertReservation:
    """bmoe's buffer type and the address space its buffers wrap; ``apply`` points a model
    params' ``tensor_buft_overrides`` at it; ``close`` unmaps, and must come after the model is
    freed. Errors inside the allocation callback are recorded in ``error`` (ctypes would swallow
    them) and the callback returns NULL, which fails the load."""

    def __init__(self, layout: ModelLayout) -> None:
        g = _ggml()
        cpu = check_buft_mirror()
        self.reservations: list[tuple[int, int]] = []  # (address, length)
        self.error: BaseException | None = None
        self._name = ctypes.create_string_buffer(NAME)
        self._c_get_name = _GET_NAME(lambda _buft: ctypes.addressof(self._name))
        self._c_alloc = _ALLOC_BUFFER(self._alloc)
        self.buft = _Buft()
        self.buft.iface.get_name = ctypes.cast(self._c_get_name, ctypes.c_void_p).value
        self.buft.iface.alloc_buffer = ctypes.cast(self._c_alloc, ctypes.c_void_p).value
        # The rest is the CPU buffer type's own C code: same alignment, sizes and host-ness.
        self.buft.iface.get_alignment = cpu.iface.get_alignment
        self.buft.iface.get_max_size = cpu.iface.get_max_size
        self.buft.iface.get_alloc_size = cpu.iface.get_alloc_size
        self.buft.iface.is_host = cpu.iface.is_host
        self.buft.device = cpu.device
        self.buft.context = None
        self.pattern = expert_pattern(layout).encode()
        self._overrides = (_Override * 2)(_Override(self.pattern, ctypes.addressof(self.buft)), _Override(None, None))
        self._from_ptr = g.ggml_backend_cpu_buffer_from_ptr

    @property
    def reserved_bytes(self) -> int:
        return sum(n for _, n in self.reservations)

    def apply(self, params: Any) -> Any:
        """``params`` (llama_model_params, modified in place and returned) with the expert
        tensors overridden to this buffer type."""
        params.tensor_buft_overrides = ctypes.addressof(self._overrides)
        return params

    def _alloc(self, _buft: int | None, size: int) -> int | None:
        try:
            length = max(_PAGE, -(-size // _PAGE) * _PAGE)
            flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
            addr = libc().mmap(None, length, _PROT_NONE, flags, -1, 0)
            if addr in (None, _MAP_FAILED):
                err = ctypes.get_errno()
                raise BudgetError(f"cannot reserve {length} bytes of address space for experts: {os.strerror(err)}")
            self.reservations.append((addr, length))
            buf = self._from_ptr(addr, size)
            if not buf:
                raise SeamError("ggml_backend_cpu_buffer_from_ptr returned NULL")
            return buf
        except BaseException as exc:  # noqa: BLE001 - ctypes would swallow it; NULL fails the load
            self.error = self.error or exc
            return None

    def close(self) -> None:
        """Unmap every reservation (idempotent). Only after llama_model_free."""
        while self.reservations:
            addr, length = self.reservations.pop()
            libc().munmap(addr, length)


def open_reserved(
    layout: ModelLayout, params: Any, open_user: Callable[[ModelLayout, bool, Any], Any],
) -> Any:
    """Open ``layout`` for streaming through ``open_user`` (the loader's user open) with the
    experts in an ``ExpertReservation``; returns its OpenedModel, which unmaps the reservation
    when freed. A refused or failed build raises (the loader's own errors, or SeamError)."""
    reservation = ExpertReservation(layout)
    try:
        opened = open_user(layout, True, reservation.apply(params))
    except BaseException as exc:
        reservation.close()
        if reservation.error is not None:
            raise SeamError(f"reserved open failed: {reservation.error}") from reservation.error
        raise exc
    if not reservation.reservations:
        opened.free()
        reservation.close()
        raise SeamMismatchError(
            "llama.cpp never allocated from bmoe's buffer type: tensor_buft_overrides were ignored"
        )
    opened.open_mode = "reserved"
    opened._keep.append(reservation)
    opened._freers.insert(0, reservation.close)  # freers run last-first, after llama_model_free
    return opened


def check_tensors_in_reservation(opened: Any, layout: ModelLayout) -> list[str]:
    """Names of expert tensors whose data is not inside the reservation (empty when all are):
    a check for tests and diagnostics."""
    reservation = next(k for k in opened._keep if isinstance(k, ExpertReservation))
    out = []
    for et in layout.experts.values():
        addr = opened.tensors.get(et.span.name)
        data = GgmlTensor.from_address(addr).data if addr else None
        if data is None or not any(a <= data and data + et.span.nbytes <= a + n for a, n in reservation.reservations):
            out.append(et.span.name)
    return out


__all__ = ["ExpertReservation", "check_buft_mirror", "check_tensors_in_reservation", "expert_pattern", "open_reserved"]

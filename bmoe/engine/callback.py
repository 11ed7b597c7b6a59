"""The eval callback: llama.cpp asks it about every graph node, so it is the hottest code in bmoe.

Per node it reads the first 8 bytes of the name as one integer and returns False unless they spell
``ffn_moe_``; for those, 8 more bytes decide whether the node is ``ffn_moe_topk-<il>``, the only
node whose values the serial path needs. At topk (ask=False) the routed ids are valid: the tensor is
a view of the argsort, so rows are ``nb[1]`` bytes apart. If every routed expert of the layer is
resident the callback returns at once; otherwise it hands a RoutingEvent to the event loop and
blocks this (compute) thread on the event's reply until the bytes are in place.

ctypes swallows exceptions raised in a callback and the decode carries on with stale data, so
every failure is caught, recorded, and turned into an abort: the abort callback then stops the
graph, and the compute stage raises the recorded error instead of emitting a token.
"""

from __future__ import annotations

import asyncio
import ctypes
import time
from collections import deque
from collections.abc import Callable

import numpy as np

from bmoe.engine.ggml import NAME_OFFSET, SRC_OFFSET, GgmlTensor
from bmoe.errors import BmoeError, DecodeAbortedError
from bmoe.pipeline.channel import Channel
from bmoe.pipeline.events import PHASE_DECODE, RoutingEvent

_u64 = ctypes.c_uint64.from_address
_ptr = ctypes.c_void_p.from_address
_FFN_MOE = int.from_bytes(b"ffn_moe_", "little")
_TOPK = int.from_bytes(b"topk-", "little")
_MASK5 = (1 << 40) - 1
_TOPK_NAME_LEN = len("ffn_moe_topk-")


class Capture:
    """Warm-up mode: find the expert weight tensors as the src[0] of the MoE matmul nodes."""

    def __init__(self, is_expert_name: Callable[[bytes], bool]) -> None:
        self._is_expert_name = is_expert_name
        self.tensors: dict[bytes, int] = {}

    def visit(self, node: int) -> None:
        src0 = _ptr(node + SRC_OFFSET).value
        if src0:
            name = GgmlTensor.from_address(src0).name
            if self._is_expert_name(name):
                self.tensors[name] = src0


class EvalCallback:
    """Owns the ctypes callback objects for a context's lifetime (they must outlive it)."""

    def __init__(self) -> None:
        self.c_eval = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p, ctypes.c_bool, ctypes.c_void_p)(
            self._eval
        )
        self.c_abort = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p)(self._abort)
        self.streaming = False
        self.capture: Capture | None = None
        self.error: BaseException | None = None
        self._aborting = False
        self._resident: list[np.ndarray] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._events: Channel[RoutingEvent] | None = None
        self._pending: set[RoutingEvent] = set()
        self.step = 0
        self.phase = PHASE_DECODE
        # Layers served by the fast path, for the cache writer to account on the loop thread.
        self.fast_hits: deque[tuple[int, np.ndarray]] = deque()
        self.event_layers = 0
        self.blocked_s = 0.0  # compute thread time spent waiting for the pipeline

    def set_resident_maps(self, maps: list[np.ndarray]) -> None:
        """Per layer, a bool per expert that the bind stage keeps true while its bytes are in place."""
        self._resident = maps

    def arm(self, loop: asyncio.AbstractEventLoop, events: Channel[RoutingEvent], step: int, phase: int) -> None:
        """Prepare for one decode call: where to send events, and which step they belong to."""
        self._loop, self._events = loop, events
        self.step, self.phase = step, phase
        self.error = None
        self._aborting = False

    def disarm(self) -> None:
        self._loop = self._events = None

    def abort(self, error: BaseException) -> None:
        """Stop the running decode at the next node and unblock a callback waiting on the loop.

        Called from the event loop thread (cancellation, stage failure) or from the callback itself.
        """
        if self.error is None:
            self.error = error
        self._aborting = True
        for event in list(self._pending):
            if not event.reply.done():
                event.reply.set_exception(error)

    def reset_abort(self) -> None:
        self.error = None
        self._aborting = False

    # --- called by llama.cpp on the compute thread -------------------------------------------

    def _abort(self, _data: int | None) -> bool:
        return self._aborting

    def _eval(self, node: int, ask: bool, _data: int | None) -> bool:
        try:
            if _u64(node + NAME_OFFSET).value != _FFN_MOE:
                return False
            if self.capture is not None:
                self.capture.visit(node)
                return False
            if not self.streaming or (_u64(node + NAME_OFFSET + 8).value & _MASK5) != _TOPK:
                return False
            if ask:
                return True
            return self._on_topk(node)
        except BaseException as exc:  # noqa: BLE001 - ctypes would swallow it; record and abort
            self._record(exc)
            return False

    def _record(self, exc: BaseException) -> None:
        if not isinstance(exc, BmoeError):
            wrapped = DecodeAbortedError(f"eval callback failed: {exc!r}")
            wrapped.__cause__ = exc
            exc = wrapped
        if self.error is None:
            self.error = exc
        self._aborting = True

    def _on_topk(self, node: int) -> bool:
        if self._aborting:
            return False
        t = GgmlTensor.from_address(node)
        layer = int(t.name[_TOPK_NAME_LEN:])
        k, rows, row_bytes = t.ne[0], t.ne[1], t.nb[1]
        span = (rows - 1) * row_bytes + k * 4
        ids = np.ndarray(
            (rows, k), np.int32, (ctypes.c_char * span).from_address(t.data), strides=(row_bytes, 4)
        )
        experts = np.unique(ids)
        if self._resident[layer][experts].all():
            self.fast_hits.append((layer, experts))
            return True
        loop, events = self._loop, self._events
        if loop is None or events is None:
            raise DecodeAbortedError("routing event outside an armed decode")
        event = RoutingEvent(layer, tuple(experts.tolist()), self.step, self.phase)
        self._pending.add(event)
        self.event_layers += 1
        try:
            if self._aborting:  # abort() ran before the event was registered: it saw no event
                raise self.error or DecodeAbortedError("decode aborted")
            t0 = time.perf_counter()
            loop.call_soon_threadsafe(events.send_nowait, event)
            try:
                event.reply.result()
            finally:
                self.blocked_s += time.perf_counter() - t0
        finally:
            self._pending.discard(event)
        return True

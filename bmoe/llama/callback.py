"""The eval callback: llama.cpp asks it about every graph node, so it is the hottest code in bmoe.

Where a C compiler is available, a filter in C stands in front of it (``bmoe.llama.node_filter``):
every other node is answered there and only ``ffn_moe_*`` nodes reach this Python code; in a
plain streamed run (no mode watching other MoE nodes) only each layer's routing node does, once it
is computed. Without it, the name test below answers every node, in Python.

Per node it reads the first 8 bytes of the name as one integer and returns False unless they spell
``ffn_moe_``; for those, 8 more bytes decide whether the node is ``ffn_moe_topk-<il>``, the only
node whose values the serial path needs. At topk (ask=False) the routed ids are valid: the tensor is
a view of the argsort, so rows are ``nb[1]`` bytes apart. If every routed expert of the layer is
resident the callback returns at once; otherwise the routing gate hands a RoutingEvent to the
event loop and blocks this (compute) thread until the bytes are in place.

ctypes swallows exceptions raised in a callback and the decode carries on with stale data, so
every failure is caught, recorded, and turned into an abort: the node function answers False at
the next node whose result it waits for (a routing or an overlap wait point), which ends the
graph there, and the compute stage raises the recorded error instead of emitting a token.

No abort callback is installed: ggml's CPU backend calls it after every node, a second Python
call per node (about 2,700 a token at 48 layers), and it could stop the graph no sooner than the
next routing does, where nothing computed since the failure is used.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import numpy as np

from bmoe.llama.expert_major import ExpertMajor, Shapes
from bmoe.llama.node_filter import NodeFilter
from bmoe.errors import BmoeError, DecodeAbortedError, as_bmoe_error
from bmoe.io.ggml import NAME_OFFSET, SRC_OFFSET, GgmlTensor
from bmoe.pipeline.boundary import RoutePredictor, WeightsTap
from bmoe.pipeline.gate import RoutingGate

_u64 = ctypes.c_uint64.from_address
_ptr = ctypes.c_void_p.from_address
_FFN_MOE = int.from_bytes(b"ffn_moe_", "little")
_TOPK = int.from_bytes(b"topk-", "little")
_MASK5 = (1 << 40) - 1
_TOPK_NAME_LEN = len("ffn_moe_topk-")
_WEIGHTS = int.from_bytes(b"weights-", "little")
_LOGITS = int.from_bytes(b"logits-", "little")
_MASK7 = (1 << 56) - 1
_LOGITS_NAME_LEN = len("ffn_moe_logits-")
_WEIGHTS_NAME_LEN = len("ffn_moe_weights-")
_DOWN = int.from_bytes(b"down", "little")
_MASK4 = (1 << 32) - 1


class Capture:
    """Warm-up mode: find the expert weight tensors as the src[0] of the MoE matmul nodes."""

    def __init__(self, is_expert_name: Callable[[bytes], bool], also: Shapes | None = None) -> None:
        self._is_expert_name = is_expert_name
        self.tensors: dict[bytes, int] = {}
        self._also = also  # another warm-up visitor shown the same nodes

    def restore(self) -> None:
        if self._also is not None:
            self._also.restore()

    def visit(self, node: int) -> None:
        if self._also is not None:
            self._also.visit(node)
        src0 = _ptr(node + SRC_OFFSET).value
        if src0:
            name = GgmlTensor.from_address(src0).name
            if self._is_expert_name(name):
                self.tensors[name] = src0


class Consumption:
    """Overlap discovery: per layer, the nodes where each expert projection is first consumed, in
    graph order. A node consumes a projection when the expert tensor is its src[0] (the matmul)
    or its src[0]'s src[0] (the scale multiply that follows an unnamed matmul in user-open mode)."""

    def __init__(self, tensors: dict[int, tuple[int, int]]) -> None:
        self._tensors = tensors  # ggml_tensor address -> (layer, projection)
        self.order: dict[int, list[tuple[bytes, int]]] = {}  # layer -> [(node name, projection)]

    def visit(self, node: int) -> None:
        src0 = _ptr(node + SRC_OFFSET).value
        if not src0:
            return
        hit = self._tensors.get(src0)
        if hit is None:
            src00 = _ptr(src0 + SRC_OFFSET).value
            hit = self._tensors.get(src00) if src00 else None
        if hit is None:
            return
        layer, proj = hit
        seen = self.order.setdefault(layer, [])
        if all(p != proj for _, p in seen):
            seen.append((GgmlTensor.from_address(node).name, proj))


class EvalCallback:
    """Owns the ctypes callback objects for a context's lifetime (they must outlive it).

    Two lives, in this order. Warm-up (and resident runs): filters every node, shows MoE nodes to
    a ``capture`` visitor while one is set, and answers aborts from ``gate``. Streaming, from the
    one call to ``stream``: serves routing through the streamer's gate in the run's modes. The
    modes cannot come at construction: llama.cpp takes the function when the context is made, and
    overlap's wait points are found by a warm-up decode through this very callback."""

    def __init__(self, gate: RoutingGate) -> None:
        self.c_eval = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p, ctypes.c_bool, ctypes.c_void_p)(
            self._eval
        )
        self.gate = gate
        self.streaming = False
        self.capture: Capture | Consumption | Shapes | None = None  # warm-up visitors
        # Copied out of the modes by ``stream``: the node function reads plain attributes.
        # Route traces only: the routed experts' router probabilities, per layer (tokens x k).
        self.weights_tap: WeightsTap | None = None
        # Overlap only: node name -> (layer, projection to wait for once that node has run).
        self.wait_after: dict[bytes, tuple[int, int]] | None = None
        # Predictive read-ahead only: predicts the next layer's experts from a router input, in
        # one-token calls (``predict_steps``) and in batched ones (``predict_batches``).
        self.predictor: RoutePredictor | None = None
        self.predict_steps = self.predict_batches = False
        # Set by the model when a C node filter stands in front: ``stream`` hands it the one name
        # this callback needs, so that the other MoE nodes never reach Python, and the resident
        # maps, so that a one-token routing of resident experts is served in C.
        self.node_filter: NodeFilter | None = None
        # Expert-major prefill (given to ``stream`` when the model and the run allow it).
        self.expert_major: ExpertMajor | None = None
        self._em_active = False  # this decode call runs expert-major
        self._batched = False  # this decode call has more than one token
        # Whether every routing must reach the cache's policy even when the cache holds every
        # expert (a run that saves what the policy learned); else such routings go unseen.
        self.see_routing = False

    def stream(self, gate: RoutingGate, *, expert_major: ExpertMajor | None = None, see_routing: bool = False) -> None:
        """Start streaming through ``gate``, in the modes it was made with (once per callback):
        ``expert_major`` computes a prompt's experts group by group where it may; ``see_routing``
        sends every routing to the cache's policy, even one the cache holds whole."""
        if self.streaming:
            raise BmoeError("the eval callback already streams")
        modes = gate.modes
        self.gate = gate
        self.expert_major = expert_major
        self.see_routing = see_routing
        self.weights_tap = modes.weights_tap
        self.wait_after = dict(modes.overlap.wait_after) if modes.overlap is not None else None
        self.predictor = modes.predictor
        self.predict_steps = modes.predictor is not None and modes.predict_steps
        self.predict_batches = modes.predictor is not None and modes.predict_batches
        self.streaming = True
        nf = self.node_filter
        if nf is not None and self._topk_only():
            resident = gate.fast_path.resident
            nf.serve_routing(resident, max((len(m) for m in resident), default=0))
            gate.native = nf  # drained before the gate's own fast-path hits; off at an abort
        self._narrow()

    def _narrow(self) -> None:
        nf = self.node_filter
        if nf is not None and self._topk_only():
            # Expert-major calls need the output node of each layer too: every MoE node, then. A
            # batch predicted from its router inputs needs the router node beside the routing.
            if self._em_active:
                nf.narrow(None)
            else:
                nf.narrow(b"topk-", b"logits-" if self._batched and self.predict_batches else None)
            nf.set_fast(self.streaming and not self._em_active and not self.gate.aborting)

    def before_decode(self, n_tokens: int) -> None:
        """Called before each ``llama_decode`` (no decode runs): whether this call of
        ``n_tokens`` runs expert-major, and so which nodes the C filter lets through."""
        em = self.expert_major
        active = em is not None and self.streaming and em.begin(n_tokens)
        if self.node_filter is not None:
            # One-token graphs only: expert-major (batches) matches the scale chain op by op, and
            # llama.cpp reuses a graph only for the same batch shape.
            self.node_filter.set_skip(n_tokens == 1)
        batched = n_tokens > 1
        if active != self._em_active or batched != self._batched or self.gate.native is not None:
            self._em_active, self._batched = active, batched
            self._narrow()  # also turns the C routing back on after an abort turned it off
        nf = self.node_filter
        if nf is not None and self.gate.native is not None:
            # Every expert resident: no routing can miss or evict, so none needs to be seen.
            nf.set_unseen(not self.see_routing and n_tokens == 1 and all(m.all() for m in self.gate.fast_path.resident))

    def after_decode(self) -> None:
        """Called after each ``llama_decode``: expert-major puts every muted op back, and raises
        if a layer it deferred was never served (that graph computed on bytes never read)."""
        if self.expert_major is not None and self._em_active:
            self.expert_major.end()

    def _topk_only(self) -> bool:
        """Whether the routing node is the only one this callback serves in one-token calls (then
        the C filter may answer every other node, and the routing node's ask, itself; a batch
        predicted from its router inputs widens it call by call, ``_narrow``)."""
        return self.weights_tap is None and self.wait_after is None and not self.predict_steps

    @property
    def error(self) -> BaseException | None:
        return self.gate.error

    # --- called by llama.cpp on the compute thread -------------------------------------------

    def _eval(self, node: int, ask: bool, _data: int | None) -> bool:
        try:
            if _u64(node + NAME_OFFSET).value != _FFN_MOE:
                return False
            if self.capture is not None:
                self.capture.visit(node)
                return False
            if not self.streaming:
                return False
            tail = _u64(node + NAME_OFFSET + 8).value
            if (tail & _MASK5) != _TOPK:
                if self._em_active and (tail & _MASK4) == _DOWN:
                    return self.expert_major.on_output(node, ask)  # type: ignore[union-attr]
                if tail == _WEIGHTS and self.weights_tap is not None:
                    return self._on_weights(node, ask)
                if (tail & _MASK7) == _LOGITS and self.predictor is not None:
                    return self._on_logits(node, ask)
                if self.wait_after is not None:
                    return self._on_matmul(node, ask)
                return False
            if ask:
                return True
            if self.gate.aborting:
                return False
            layer, ids = _routed_ids(node)
            if self._em_active and self.expert_major.on_topk(layer, ids):  # type: ignore[union-attr]
                return True  # served at the layer's output node, group by group
            self.gate.route(layer, ids)
            return True
        except BaseException as exc:  # noqa: BLE001 - ctypes would swallow it; record and abort
            self._record(exc)
            return False

    def _on_logits(self, node: int, ask: bool) -> bool:
        if self._em_active or not (self.predict_batches if self._batched else self.predict_steps):
            return False  # expert-major reads its next group itself while one computes
        t = GgmlTensor.from_address(node)
        if not t.name[_LOGITS_NAME_LEN:].isdigit():
            return False
        if ask:
            return True
        x = GgmlTensor.from_address(t.src[1])  # the router input: F32 [n_embd, n_tokens]
        n_embd, rows, row_bytes = x.ne[0], x.ne[1], x.nb[1]
        if rows == 1:
            x_rows = np.ndarray((n_embd,), np.float32, (ctypes.c_char * (n_embd * 4)).from_address(x.data))
        else:
            span = (rows - 1) * row_bytes + n_embd * 4
            x_rows = np.ndarray((rows, n_embd), np.float32, (ctypes.c_char * span).from_address(x.data),
                                strides=(row_bytes, 4))
        predictor = self.predictor
        predicted = predictor.predict(int(t.name[_LOGITS_NAME_LEN:]), x_rows)  # type: ignore[union-attr]
        if predicted is not None and predictor.trusted(predicted[0]):  # type: ignore[union-attr]
            self.gate.predict(*predicted, batch=rows > 1)
        return True

    def _on_matmul(self, node: int, ask: bool) -> bool:
        wait = self.wait_after.get(GgmlTensor.from_address(node).name)  # type: ignore[union-attr]
        if wait is None:
            return False
        if ask:
            return True
        if self.gate.aborting:
            return False  # stop here: the next matmul must not run on bytes that never came
        self.gate.wait_proj(*wait)
        return True

    def _on_weights(self, node: int, ask: bool) -> bool:
        name = GgmlTensor.from_address(node).name
        if not name[_WEIGHTS_NAME_LEN:].isdigit():  # "(reshaped)" views of the same node
            return False
        if not ask:
            self.weights_tap(int(name[_WEIGHTS_NAME_LEN:]), _router_weights(node))  # type: ignore[misc]
        return True

    def _record(self, exc: BaseException) -> None:
        self.gate.abort(as_bmoe_error(exc, DecodeAbortedError, "eval callback failed"))


class LeverCallback(EvalCallback):
    """An ``EvalCallback`` whose node function lets a lossy lever see the MoE nodes it rewrites
    first (``_visit``: True when it wants the node), then runs the plain one. A subclass is chosen
    at construction, so a run without a lever keeps the plain function (no extra test per node)."""

    def __init__(self, gate: RoutingGate) -> None:
        super().__init__(gate)
        self.c_eval = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p, ctypes.c_bool, ctypes.c_void_p)(
            self._eval_lever
        )

    def _eval_lever(self, node: int, ask: bool, data: int | None) -> bool:
        try:
            mine = (
                _u64(node + NAME_OFFSET).value == _FFN_MOE and self.streaming and self.capture is None
                and self._visit(node, ask)
            )
        except BaseException as exc:  # noqa: BLE001 - ctypes would swallow it; record and abort
            self._record(exc)
            return False
        theirs = self._eval(node, ask, data)
        if ask:
            return mine or theirs
        return theirs or (mine and not self.gate.aborting)

    def _topk_only(self) -> bool:
        return False  # a lever rewrites other MoE nodes

    def _visit(self, node: int, ask: bool) -> bool:
        raise NotImplementedError


def _router_weights(node: int) -> np.ndarray:
    """The weights of an ``ffn_moe_weights-<il>`` node: F32 [1, k, tokens], strided."""
    t = GgmlTensor.from_address(node)
    k, rows = t.ne[1], t.ne[2]
    span = (rows - 1) * t.nb[2] + (k - 1) * t.nb[1] + 4
    return np.ndarray((rows, k), np.float32, (ctypes.c_char * span).from_address(t.data), strides=(t.nb[2], t.nb[1]))


def _routed_ids(node: int) -> tuple[int, np.ndarray]:
    """(layer, ids) of an ``ffn_moe_topk-<il>`` node: a view of the argsort, rows nb[1] apart."""
    t = GgmlTensor.from_address(node)
    layer = int(t.name[_TOPK_NAME_LEN:])
    k, rows, row_bytes = t.ne[0], t.ne[1], t.nb[1]
    span = (rows - 1) * row_bytes + k * 4
    ids = np.ndarray((rows, k), np.int32, (ctypes.c_char * span).from_address(t.data), strides=(row_bytes, 4))
    return layer, ids

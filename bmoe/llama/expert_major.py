"""Expert-major prefill: a prompt's MoE layers computed expert by expert, read group by group.

llama.cpp computes a layer's experts in one ``mul_mat_id`` over every expert the batch routes to,
so a batched prompt needs its whole per-layer union in memory at once, read before the layer
computes. Expert-major runs the same batch, but at each eligible layer bmoe computes the experts
itself (``bmoe.io.ggml_ffn``: the same ggml kernels, bit-identical rows) one group at a time: the
experts the cache already holds first, then the missing ones in groups that fit the cache, each
group read while the one before it computes. The union is never resident at once and reads overlap
compute, and llama.cpp computes everything else as usual.

How, without a fork: after the layer's routing node (``ffn_moe_topk``) has run, llama.cpp asks the
eval callback about each later node before computing it. At the node whose output the weighted sum
reads (``ffn_moe_down``, or ``ffn_moe_down_scaled`` when the model has per-expert scales) bmoe
checks the chain back to the routing (gate and up ``mul_mat_id``, optional scales, SwiGLU, down),
marks those nodes ``GGML_OP_NONE`` (the CPU backend skips them), asks for the output node, and
when llama.cpp reaches it writes the rows it computed into that node's buffer; the ops are put back
at once. Anything else in the chain (biases, fused gate-up, another activation) is not computed
here: the layer falls back to routing its whole union, before any of its expert nodes run.

Which layers qualify is found at open by a one-token warm-up decode (``Shapes``); a layer whose
routing was deferred and whose output node never came aborts the decode (no token is computed on
bytes that were never read).
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from bmoe.errors import DecodeAbortedError
from bmoe.io.ggml import GgmlTensor
from bmoe.io.ggml_ffn import (
    GGML_GLU_OP_SWIGLU,
    GGML_TYPE_F32,
    ExpertWeights,
    op_code,
    swiglu_experts,
)
from bmoe.pipeline.events import routed_set
from bmoe.pipeline.gate import RoutingGate

_OUTPUT_NAME = re.compile(rb"^ffn_moe_down(?:_scaled)?-(\d+)$")
_TOPK_NAME = re.compile(rb"^ffn_moe_topk-(\d+)$")
MIN_TOKENS = 2  # a batch of one token has nothing to share between its experts
GROUP_EXPERTS = 16  # most experts read per group: enough work per ggml call, early enough overlap


def _t(address: int) -> GgmlTensor:
    return GgmlTensor.from_address(address)


@dataclass(frozen=True)
class LayerNodes:
    """One MoE layer's expert chain in a built graph: what bmoe computes instead of llama.cpp."""

    layer: int
    output: int  # the node the weighted sum reads: down, or down times its scale
    muted: tuple[int, ...]  # every node of the chain, output included
    x: int  # the layer's input rows: F32 [n_embd, 1, tokens]
    topk: int
    mm: tuple[int, int, int]  # the gate, up and down mul_mat_id nodes
    scales: tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None]  # per expert, or None

    @classmethod
    def find(cls, output: int, muted: Mapping[int, int] | None = None) -> LayerNodes | None:
        """Walk back from ``output``; None unless the chain is exactly gate/up ``mul_mat_id``
        (each optionally times a per-expert scale), SwiGLU, down ``mul_mat_id`` (ditto).
        ``muted``: nodes whose op the warm-up has set aside (node -> its op)."""
        muted = muted or {}
        name = _OUTPUT_NAME.match(_t(output).name)
        if name is None:
            return None
        mmid, glu = op_code("MUL_MAT_ID"), op_code("GLU")
        d_mm, d_scale, d_muted = _unscaled(output, mmid, muted)
        if d_mm is None:
            return None
        a = _t(d_mm).src[1]
        ta = _t(a)
        if ta.op != glu or ta.op_params[0] != GGML_GLU_OP_SWIGLU or ta.op_params[1] != 0 or not ta.src[1]:
            return None
        g_mm, g_scale, g_muted = _unscaled(ta.src[0], mmid, muted)
        u_mm, u_scale, u_muted = _unscaled(ta.src[1], mmid, muted)
        if g_mm is None or u_mm is None:
            return None
        tg, tu, td = _t(g_mm), _t(u_mm), _t(d_mm)
        topk, x = tg.src[2], tg.src[1]
        if not topk or tu.src[2] != topk or td.src[2] != topk or tu.src[1] != x:
            return None
        tk = _TOPK_NAME.match(_t(topk).name)
        if tk is None or tk.group(1) != name.group(1):
            return None
        tx, tout = _t(x), _t(output)
        k = _t(topk).ne[0]
        n_in, n_ff, n_out = tx.ne[0], ta.ne[0], tout.ne[0]
        wg, wu, wd = (_t(t.src[0]) for t in (tg, tu, td))
        shapes_ok = (
            tx.type == GGML_TYPE_F32 and tx.ne[1] == 1 and tx.nb[0] == 4
            and tout.type == GGML_TYPE_F32 and tout.nb[0] == 4 and tout.ne[1] == k and ta.ne[1] == k
            and wg.ne[0] == n_in and wu.ne[0] == n_in and wg.ne[1] == n_ff and wu.ne[1] == n_ff
            and wd.ne[0] == n_ff and wd.ne[1] == n_out and wg.type == wu.type
        )
        if not shapes_ok:
            return None
        muted = (*g_muted, *u_muted, a, *d_muted)
        return cls(int(name.group(1)), output, muted, x, topk, (g_mm, u_mm, d_mm), (g_scale, u_scale, d_scale))


def _unscaled(node: int, mmid: int, muted: Mapping[int, int]) -> tuple[int | None, np.ndarray | None, tuple[int, ...]]:
    """(the ``mul_mat_id`` node, its per-expert scale or None, the nodes from it to ``node``):
    ``node`` is the matmul itself, or MUL(matmul, GET_ROWS(scale, topk))."""
    t = _t(node)
    if muted.get(node, t.op) == mmid:
        return node, None, (node,)
    # The node filter may have muted a no-op scale's MUL and its chain (``NodeFilter.skip_noops``):
    # a muted node keeps its sources, so it is walked as the op it was.
    none = op_code("NONE")
    if t.op not in (op_code("MUL"), none) or not t.src[0] or muted.get(t.src[0], _t(t.src[0]).op) != mmid:
        return None, None, ()
    rows = _t(t.src[1]) if t.src[1] else None
    if rows is None or rows.op not in (op_code("GET_ROWS"), none) or not rows.src[0]:
        return None, None, ()
    # The scale tensor [n_expert], reshaped to [1, n_expert] (same data) and, for a batch, repeated
    # over its tokens: follow src[0] down to the n_expert values (a leaf: no source).
    n_expert = _t(_t(t.src[0]).src[0]).ne[2]
    scale = _t(rows.src[0])
    repeat, views = op_code("REPEAT"), (op_code("RESHAPE"), op_code("VIEW"))
    while scale.src[0] and (scale.op in (repeat, none) or (scale.op in views and _numel(scale) != n_expert)):
        scale = _t(scale.src[0])
    if scale.type != GGML_TYPE_F32 or _numel(scale) != n_expert or scale.op not in (none, *views):
        return None, None, ()
    values = np.frombuffer((ctypes.c_float * n_expert).from_address(scale.data), dtype=np.float32).copy()
    return t.src[0], (None if bool((values == 1.0).all()) else values), (t.src[0], node)


def _numel(t: GgmlTensor) -> int:
    return t.ne[0] * t.ne[1] * t.ne[2] * t.ne[3]


class Shapes:
    """Warm-up visitor: the MoE layers whose expert chain expert-major can compute.

    It mutes every expert matmul it meets (``GGML_OP_NONE``; ``restore`` puts them back once the
    warm-up decode is over): every question comes before anything is computed, since the warm-up
    wants no node, so the warm-up reads no expert byte, and an open whose expert memory is not
    readable yet (the reserved open) computes nothing on it."""

    def __init__(self) -> None:
        self.layers: set[int] = set()
        self.looked = False  # a warm-up decode has shown it the graph
        self._muted: dict[int, int] = {}  # node -> its op, until restore

    def visit(self, node: int) -> None:
        self.looked = True
        if _OUTPUT_NAME.match(_t(node).name):
            found = LayerNodes.find(node, self._muted)
            if found is not None:
                self.layers.add(found.layer)
        mmid, none = op_code("MUL_MAT_ID"), op_code("NONE")
        for n in (node, _t(node).src[0]):
            if n and n not in self._muted and _t(n).op == mmid:
                self._muted[n] = mmid
                _t(n).op = none

    def restore(self) -> None:
        for n, op in self._muted.items():
            _t(n).op = op
        self._muted.clear()


@dataclass
class _Pending:
    layer: int
    ids: np.ndarray  # tokens x k, copied out of the routing node


class ExpertMajor:
    """The eval callback's expert-major state for the decode calls of one session.

    ``enabled`` is set by the prefill planner around a prompt's calls; a call of at least
    ``MIN_TOKENS`` tokens then runs expert-major at every ``layers`` layer. ``group_size(layer)``
    is how many missing experts are read as one group (the cache's room decides it)."""

    def __init__(
        self, gate: RoutingGate, layers: frozenset[int], n_threads: int, group_size: Callable[[int], int],
    ) -> None:
        self.gate = gate
        self.layers = layers
        self.n_threads = n_threads
        self.group_size = group_size
        self.enabled = False
        self.active = False  # this decode call
        self._pending: _Pending | None = None
        self._running: LayerNodes | None = None
        self._x: np.ndarray | None = None
        self._muted: list[tuple[int, int]] = []  # (node, its op) while muted
        self.layers_computed = 0  # layers computed expert-major (this session)
        self.groups = 0

    # --- around a decode call (compute thread) ----------------------------------------------

    def begin(self, n_tokens: int) -> bool:
        self.active = self.enabled and n_tokens >= MIN_TOKENS and bool(self.layers)
        self._pending = self._running = None
        return self.active

    def end(self) -> None:
        """After the decode: ops put back whatever happened; a deferred layer never served means
        the graph computed experts on bytes that were never read."""
        self._restore()
        pending, self._pending = self._pending, None
        self._running = self._x = None
        self.active = False
        if pending is not None and self.gate.error is None:
            raise DecodeAbortedError(f"expert-major: layer {pending.layer}'s expert nodes never came")

    # --- eval callback hooks -----------------------------------------------------------------

    def on_topk(self, layer: int, ids: np.ndarray) -> bool:
        """At a computed routing node: True when the layer is deferred to its output node (the
        callback must not route it now)."""
        if self._pending is not None:
            raise DecodeAbortedError(f"expert-major: layer {self._pending.layer}'s expert nodes never came")
        if layer not in self.layers:
            return False
        self._pending = _Pending(layer, ids.copy())
        return True

    def on_output(self, node: int, ask: bool) -> bool:
        """At a ``ffn_moe_down*`` node: asked, mute the layer's chain (or route its union when the
        chain is not one computed here); computed, serve and compute the layer's experts."""
        if ask:
            if _OUTPUT_NAME.match(_t(node).name) is None:  # "(view)" and the like
                return False
            return self._prepare(node)
        running, self._running = self._running, None
        try:
            if running is None or running.output != node:
                return False
            self._compute(running)
            return True
        finally:
            self._restore()

    def _prepare(self, node: int) -> bool:
        pending = self._pending
        if pending is None:
            return False
        found = LayerNodes.find(node)
        if found is None or found.layer != pending.layer:
            # Not the shape computed here: route the whole union now, before any expert node runs.
            self._pending = None
            self.gate.route(pending.layer, pending.ids)
            return False
        tx = _t(found.x)
        rows = tx.ne[2]
        if rows != pending.ids.shape[0]:
            raise DecodeAbortedError(f"expert-major: layer {found.layer} routes {pending.ids.shape[0]} rows, computes {rows}")
        # The input rows, copied now: the output node's buffer may reuse theirs.
        src = np.ndarray((rows, tx.ne[0]), np.float32, (ctypes.c_char * (tx.nb[2] * rows)).from_address(tx.data),
                         strides=(tx.nb[2], 4))
        self._x = src.copy()
        none = op_code("NONE")
        for n in found.muted:
            t = _t(n)
            self._muted.append((n, t.op))
            t.op = none
        self._running = found
        return True

    def _restore(self) -> None:
        for n, op in self._muted:
            _t(n).op = op
        self._muted.clear()

    def _compute(self, nodes: LayerNodes) -> None:
        """Serve the layer's union group by group and write each expert's rows where llama.cpp's
        down node would have put them."""
        pending, self._pending = self._pending, None
        x, self._x = self._x, None
        assert pending is not None and x is not None
        layer, ids = pending.layer, pending.ids
        experts, ranks = routed_set(ids)
        rank_of = dict(zip(experts.tolist(), ranks.tolist()))
        resident = self.gate.fast_path.resident[layer]
        held = [e for e in experts.tolist() if resident[e]]
        missing = [e for e in experts.tolist() if not resident[e]]
        # Held experts first (computed while the first missing group reads), then the missing
        # ones; every group of at most ``step`` experts, which also bounds the activations one
        # ggml call allocates (about 27 MB for 16 experts of a 512-token batch at 30B-A3B shape).
        step = max(1, self.group_size(layer))
        groups = [part[i : i + step] for part in (held, missing) for i in range(0, len(part), step)]
        w = tuple(ExpertWeights.of(_t(m).src[0]) for m in nodes.mm)
        out = _t(nodes.output)
        n_out, k = out.ne[0], out.ne[1]
        dst = np.ndarray((ids.shape[0], k, n_out), np.float32,
                         (ctypes.c_char * (out.nb[2] * ids.shape[0])).from_address(out.data),
                         strides=(out.nb[2], out.nb[1], 4))
        where = {e: np.nonzero(ids == e) for e in experts.tolist()}
        for i, group in enumerate(groups):
            self._route(layer, group, rank_of)
            if i + 1 < len(groups):
                self.gate.read_ahead(layer, tuple(groups[i + 1]), frozenset((layer, e) for e in group))
            rows = [x[where[e][0]] for e in group]
            outs = swiglu_experts(*w, group, rows, self.n_threads, scales=nodes.scales)
            for e, o in zip(group, outs):
                tokens, slots = where[e]
                dst[tokens, slots] = o
            self.groups += 1
        self.layers_computed += 1

    def _route(self, layer: int, group: list[int], rank_of: dict[int, int]) -> None:
        experts = np.asarray(sorted(group), dtype=np.int32)
        self.gate.route(layer, experts[None, :], np.asarray([rank_of[e] for e in experts.tolist()], dtype=np.int64))


__all__ = ["GROUP_EXPERTS", "MIN_TOKENS", "ExpertMajor", "LayerNodes", "Shapes"]

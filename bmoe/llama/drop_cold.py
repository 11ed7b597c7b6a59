"""``--drop-cold-experts F`` (lossy, opt-in): skip a routed expert that is not in memory and weighs
little, instead of waiting for its bytes.

Rule, per token and MoE layer: a routed expert is dropped when it is a cache miss AND its share of
the layer's top-k routing mass is below ``F / k``; the top-ranked expert is never dropped, and in a
multi-token batch an expert is dropped only if every row routing to it drops it (otherwise it is
read anyway and dropping it would cost quality for nothing). Decode only, unless ``drop_prefill``.

Stock llama.cpp has no "skip this expert" switch, but the public eval callback reaches the two
tensors the expert matmuls depend on, in this graph order (``build_moe_ffn``, pin 0.3.36):

1. ``ffn_moe_topk-<il>``: a VIEW of the argsort of the router probabilities, whose ``src[0]`` (the
   argsort) has the probabilities as its ``src[0]``. At ask=false its ids are computed and not yet
   read by anything: a dropped slot's id is rewritten in place to the row's top-ranked id (an expert
   that is read anyway), so the routing gate, which runs right after on the same ids, reads only the
   survivors, and the MUL_MAT_ID nodes never touch the dropped expert's bytes.
2. ``ffn_moe_weights-<il>``: ``get_rows(probs, ids)`` of the rewritten ids, before the optional
   ``_sum`` / ``_norm`` normalisation. The duplicated slot's weight is zeroed there, so it adds
   0 x (top expert's output). Renormalisation (the default) scales the survivors by
   original mass / surviving mass: in architectures that normalise (qwen3moe) the norm then divides
   by the original mass and the survivors sum to 1; in those that do not (qwen2moe) they keep the
   original mass. ``--drop-no-renorm`` leaves the survivors' weights as they were: where the
   architecture normalises, ``ffn_moe_weights_sum-<il>`` is overwritten with the original mass, so
   its division does not renormalise behind our back.

The weight of an expert is its router probability as the argsort saw it (the selection
probabilities; identical to the weights for architectures without a selection bias).

Zero cost when off: the session builds a plain ``EvalCallback`` unless the lever is set; this
subclass's function is the one handed to llama.cpp only then (decided at construction). With F = 0
nothing is ever dropped and the output is byte-identical to the exact run (a gate).
"""

from __future__ import annotations

import ctypes

import numpy as np

from bmoe.llama.callback import LeverCallback, _routed_ids, _router_weights
from bmoe.errors import SeamMismatchError
from bmoe.io.ggml import GgmlTensor
from bmoe.io.layout import ModelLayout
from bmoe.pipeline.events import PHASE_DECODE
from bmoe.pipeline.gate import RoutingGate

_PREFIX = len("ffn_moe_")


def choose_drops(ids: np.ndarray, probs: np.ndarray, resident: np.ndarray, threshold: float) -> np.ndarray:
    """The (rows, k) mask of routed slots to drop. ``ids`` (rows, k) routed experts, best first;
    ``probs`` (rows, k) their router probabilities; ``resident`` a bool per expert (in memory now);
    ``threshold`` the share of the row's routed mass below which a miss may go (F / k)."""
    if threshold <= 0:  # F = 0: nothing, whatever the scores (the exact run, byte for byte)
        return np.zeros(ids.shape, dtype=bool)
    share = probs / np.maximum(probs.sum(axis=1, keepdims=True), np.finfo(np.float32).tiny)
    drop = (share < threshold) & ~resident[ids]
    drop[:, 0] = False  # never the top-ranked expert
    if ids.shape[0] > 1:
        for e in np.unique(ids[drop]):
            where = ids == e
            if not drop[where].all():
                drop[where] = False
    return drop


class DropCold:
    """The decision and its bookkeeping, shared by the callback's three nodes of a layer.

    Runs on the compute thread only. Counters: ``dropped`` routed slots skipped (all layers),
    ``bytes_saved`` bytes of the experts a drop left unread at that step (an expert dropped now may
    be read later), ``tokens`` tokens decided on, so ``dropped / tokens`` is drops per token."""

    def __init__(self, layout: ModelLayout, fraction: float, *, renorm: bool = True, prefill: bool = False) -> None:
        self.threshold = fraction / layout.n_expert_used
        self.renorm = renorm
        self.prefill = prefill
        self._entry = layout.entry_bytes()
        self._first = layout.moe_layers[0]
        self._resident: list[np.ndarray] = []
        self._pending: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}  # layer -> mask, orig, surv
        self.dropped = 0
        self.bytes_saved = 0
        self.tokens = 0  # tokens decided on (counted at the first MoE layer)

    def bind(self, resident_maps: list[np.ndarray]) -> None:
        """The per-layer resident maps the ready stage keeps (``FastPath.resident``)."""
        self._resident = resident_maps

    def counters(self) -> dict[str, object]:
        return {
            "drop_dropped_experts": self.dropped,
            "drop_tokens": self.tokens,
            "drop_experts_per_token": self.dropped / self.tokens if self.tokens else None,
            "drop_bytes_saved": self.bytes_saved,
        }

    def on_topk(self, node: int) -> None:
        layer, ids = _routed_ids(node)
        self._pending.pop(layer, None)  # a step aborted between topk and weights leaves no trace
        argsort = GgmlTensor.from_address(GgmlTensor.from_address(node).src[0])
        p = GgmlTensor.from_address(argsort.src[0])  # router probabilities, F32 [n_expert, rows]
        rows, n_expert = ids.shape[0], p.ne[0]
        span = (rows - 1) * p.nb[1] + n_expert * 4
        all_probs = np.ndarray((rows, n_expert), np.float32, (ctypes.c_char * span).from_address(p.data), strides=(p.nb[1], 4))
        probs = np.take_along_axis(all_probs, ids, axis=1)
        if layer == self._first:
            self.tokens += rows
        drop = choose_drops(ids, probs, self._resident[layer], self.threshold)
        if not drop.any():
            return
        before = set(np.unique(ids).tolist())
        ids[drop] = np.broadcast_to(ids[:, :1], ids.shape)[drop]
        self.dropped += int(drop.sum())
        self.bytes_saved += self._entry[layer] * len(before - set(np.unique(ids).tolist()))
        orig = probs.sum(axis=1)
        self._pending[layer] = (drop, orig, orig - np.where(drop, probs, 0.0).sum(axis=1))

    def on_weights(self, node: int, layer: int) -> None:
        pending = self._pending.get(layer)
        if pending is None:
            return
        drop, orig, surv = pending
        w = _router_weights(node)  # (rows, k), writable view of the node's data
        w[drop] = 0.0
        if self.renorm:
            w *= (orig / np.maximum(surv, np.finfo(np.float32).tiny))[:, None].astype(np.float32)
            del self._pending[layer]

    def on_sum(self, node: int, layer: int) -> None:
        pending = self._pending.pop(layer, None)
        if pending is None:
            return
        t = GgmlTensor.from_address(node)  # F32 [1, rows]
        rows = t.ne[1]
        out = np.ndarray((rows,), np.float32, (ctypes.c_char * ((rows - 1) * t.nb[1] + 4)).from_address(t.data), strides=(t.nb[1],))
        out[:] = pending[1]

    def active(self, phase: int) -> bool:
        return self.prefill or phase == PHASE_DECODE


class DropColdCallback(LeverCallback):
    """Lets ``DropCold`` see its three nodes of each MoE layer, then runs the plain callback."""

    def __init__(self, gate: RoutingGate, drop: DropCold) -> None:
        super().__init__(gate)
        self.drop = self.lever = drop

    def stream(self, gate: RoutingGate, **kw: object) -> None:
        super().stream(gate, **kw)  # type: ignore[arg-type]
        self.drop.bind(gate.fast_path.resident)

    def _visit(self, node: int, ask: bool) -> bool:
        if not self.drop.active(self.gate.phase):
            return False
        name = GgmlTensor.from_address(node).name[_PREFIX:]
        what, _, tail = name.rpartition(b"-")
        if not tail.isdigit():  # "(reshaped)" views and the like
            return False
        if what == b"topk":
            if not ask and not self.gate.aborting:
                self.drop.on_topk(node)
            return True
        if what == b"weights":
            if not ask:
                self.drop.on_weights(node, int(tail))
            return True
        if what == b"weights_softmax":
            # gpt-oss style gating: a softmax over the selected experts' logits, where a zeroed
            # logit still gets weight. Not supported: refuse rather than compute something else.
            raise SeamMismatchError("drop_cold_experts: this architecture re-softmaxes the selected weights; unsupported")
        if what == b"weights_sum" and not self.drop.renorm:
            if not ask:
                self.drop.on_sum(node, int(tail))
            return True
        return False

"""``--route-ahead N`` (lossy, opt-in): route layer L from the hidden state N MoE layers earlier, so
its experts are read N layers ahead and the layer never waits for a read issued at its own turn.

Layer L's experts become the top-k of ``router_L @ x_{L-N}``, where ``x_j`` is the router input of
MoE layer j (the routers read once from the file, as the predictive read-ahead of
``bmoe.stages.predict`` does). Their weights stay the real ones: llama.cpp's ``ffn_moe_weights``
node gathers layer L's own router probabilities at the chosen ids, and normalises them where the
architecture does. The first N MoE layers have no layer N before them and keep their own routing.

On the public API, per MoE layer j, in graph order:

1. ``ffn_moe_logits-<j>`` (ask=false): its ``src[1]`` is x_j, F32 [n_embd, tokens]. For the layer
   L N MoE layers on, the ids of every token are computed here (numpy, on the compute thread) and
   the ones not in memory are handed to the routing gate as a read-ahead, which the prefetch stage
   admits into the cache and reads (``RoutingGate.predict``: carried by layer j's routing event, or
   alone when j is all resident).
2. ``ffn_moe_topk-<L>`` (ask=false), N layers later: the computed ids are written over the argsort's
   view before the plain callback routes the layer, so the gate sees experts whose reads were all
   issued N layers ago (a hit, at worst one still in flight), and the MUL_MAT_ID nodes use them.

Deterministic: the same input gives the same ids (numpy's argsort on the same floats), and the reads
change only when bytes land, never what is computed. N = 0 installs the machinery with no target:
a passthrough, byte-identical to the exact run. Needs a cache (the reads ahead live there), and
excludes the lossless read-ahead flags (this is read-ahead with the prediction made the truth).
"""

from __future__ import annotations

import ctypes

import numpy as np

from bmoe.llama.callback import LeverCallback, _routed_ids
from bmoe.errors import SeamMismatchError
from bmoe.io.ggml import GgmlTensor
from bmoe.io.layout import ModelLayout
from bmoe.pipeline.gate import RoutingGate

_PREFIX = len("ffn_moe_")


def top_k_rows(router: np.ndarray, x: np.ndarray, k: int) -> np.ndarray:
    """Per token (row of ``x``, [tokens, n_embd]), the k experts ``router`` ([n_expert, n_embd])
    scores highest, best first; ties go to the lower id (a stable sort)."""
    scores = x @ router.T  # [tokens, n_expert]
    return np.argsort(-scores, axis=1, kind="stable")[:, :k].astype(np.int32)


class RouteAhead:
    """Targets, pending ids and agreement counters; runs on the compute thread only."""

    def __init__(self, layout: ModelLayout, distance: int, routers: dict[int, np.ndarray]) -> None:
        self.distance = distance
        self.k = layout.n_expert_used
        layers = sorted(routers)
        self._target = dict(zip(layers, layers[distance:])) if distance else {}  # source -> target
        self._targets = frozenset(self._target.values())
        self._routers = routers
        # target layer -> ids [tokens, k]; always refreshed at the source layer's logits, which
        # precede the target's topk in every graph, so an aborted step leaves nothing stale behind
        self._pending: dict[int, np.ndarray] = {}
        self.routed_layers = 0  # layer routings taken from N layers earlier
        self.agree = 0  # of their routed slots, those the layer's own router also picks
        self.slots = 0

    def counters(self) -> dict[str, object]:
        return {
            "route_ahead_layers": self.routed_layers,
            "route_ahead_agreement_pct": 100.0 * self.agree / self.slots if self.slots else None,
        }

    def wants_logits(self, layer: int) -> bool:
        return layer in self._target

    def on_logits(self, node: int, layer: int, gate: RoutingGate) -> None:
        x = GgmlTensor.from_address(GgmlTensor.from_address(node).src[1])  # F32 [n_embd, tokens]
        n_embd, rows = x.ne[0], x.ne[1]
        span = (rows - 1) * x.nb[1] + n_embd * 4
        xs = np.ndarray((rows, n_embd), np.float32, (ctypes.c_char * span).from_address(x.data), strides=(x.nb[1], 4))
        target = self._target[layer]
        ids = top_k_rows(self._routers[target], xs, self.k)
        self._pending[target] = ids
        gate.predict(target, np.unique(ids))

    def on_topk(self, node: int) -> None:
        layer, ids = _routed_ids(node)
        ahead = self._pending.pop(layer, None)
        if ahead is None:
            if layer in self._targets:
                raise SeamMismatchError(f"route_ahead: no router input seen {self.distance} MoE layers before layer {layer}")
            return
        if ahead.shape[0] > ids.shape[0]:
            # The graph's last layer keeps only the rows whose logits are asked for (llama.cpp's
            # inp_out_ids), and bmoe asks for the last token's only: those are the last rows.
            ahead = ahead[-ids.shape[0]:]
        if ahead.shape != ids.shape:
            return
        self.routed_layers += 1
        self.slots += ids.size
        self.agree += sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(ahead, ids))
        ids[:] = ahead


class RouteAheadCallback(LeverCallback):
    """Lets ``RouteAhead`` see each MoE layer's logits and topk nodes, then runs the plain callback."""

    def __init__(self, gate: RoutingGate, ahead: RouteAhead) -> None:
        super().__init__(gate)
        self.ahead = self.lever = ahead

    def _visit(self, node: int, ask: bool) -> bool:
        what, _, tail = GgmlTensor.from_address(node).name[_PREFIX:].rpartition(b"-")
        if not tail.isdigit():
            return False
        if what == b"logits":
            layer = int(tail)
            if not self.ahead.wants_logits(layer):
                return False
            if not ask and not self.gate.aborting:
                self.ahead.on_logits(node, layer, self.gate)
            return True
        if what == b"topk":
            if not ask and not self.gate.aborting:
                self.ahead.on_topk(node)
            return True
        return False

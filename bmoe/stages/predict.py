"""Predictive read-ahead: guess layer l+1's experts from layer l's FFN input.

The residual stream changes little from one layer to the next, so layer l+1's router applied to
layer l's router input predicts much of l+1's routing one layer early. The routers
(``blk.<il>.ffn_gate_inp.weight``) are read once from the file and dequantised with gguf-py; the
eval callback hands over layer l's router input at ``ffn_moe_logits-<il>`` (its src[1]), the
prediction runs there on the compute thread (one small matrix-vector product), and the predicted
experts go to the prefetch stage as read-ahead. Each prediction is scored against the routing the
layer then really chooses, per layer.

A session reads the routers in place (``LiveRouters``: views of llama.cpp's own F32 router
tensors, no copy), since a copy costs memory the cache budget did not count: 50 MB for a
Qwen3-30B-A3B, 425 MB for a DeepSeek-V3. ``load_routers`` reads them from the file (replays, and
router types other than F32).
"""

from __future__ import annotations

import ctypes
import os
from collections import deque
from collections.abc import Iterator, Mapping

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from bmoe.io.ggml import GgmlTensor
from bmoe.io.layout import ModelLayout

_GGML_TYPE_F32 = 0


def router_name(layer: int) -> str:
    return f"blk.{layer}.ffn_gate_inp.weight"


def load_routers(layout: ModelLayout, layers: tuple[int, ...] | None = None) -> dict[int, np.ndarray]:
    """Per MoE layer (of ``layers``, default all), its router as float32 [n_expert, n_embd], read
    from the file once."""
    routers = {}
    fds = [os.open(p, os.O_RDONLY) for p in layout.shards]
    try:
        for il in layout.moe_layers if layers is None else layers:
            span = layout.tensors.get(router_name(il))
            if span is None:
                continue
            raw = os.pread(fds[span.shard], span.nbytes, span.offset)
            flat = dequantize(np.frombuffer(raw, dtype=np.uint8), GGMLQuantizationType(span.ggml_type))
            routers[il] = np.ascontiguousarray(flat.reshape(span.ne[1], span.ne[0]), dtype=np.float32)
    finally:
        for fd in fds:
            os.close(fd)
    return routers


class LiveRouters(Mapping[int, np.ndarray]):
    """Per MoE layer, its router as float32 [n_expert, n_embd]: a view of llama.cpp's own tensor
    (``addresses``: layer -> ggml_tensor) when it is F32, as llama-quantize leaves routers, else
    dequantised from the file. Each is made on first use, on the compute thread, so a view sees
    where the open finally put the dense weights (``AnonDense`` moves them after the capture)."""

    def __init__(self, layout: ModelLayout, addresses: Mapping[int, int]) -> None:
        self._layout = layout
        self._addresses = dict(addresses)
        self._layers = tuple(il for il in layout.moe_layers if router_name(il) in layout.tensors)
        self._made: dict[int, np.ndarray] = {}

    def __getitem__(self, layer: int) -> np.ndarray:
        made = self._made.get(layer)
        if made is None:
            if layer not in self._layers:
                raise KeyError(layer)
            made = self._made[layer] = self._view(layer)
        return made

    def _view(self, layer: int) -> np.ndarray:
        addr = self._addresses.get(layer)
        t = GgmlTensor.from_address(addr) if addr else None
        if t is None or t.type != _GGML_TYPE_F32 or not t.data or t.nb[0] != 4:
            return load_routers(self._layout, (layer,))[layer]
        n_embd, n_expert, row = t.ne[0], t.ne[1], t.nb[1]
        span = (n_expert - 1) * row + n_embd * 4
        return np.ndarray((n_expert, n_embd), np.float32, (ctypes.c_char * span).from_address(t.data),
                          strides=(row, 4))

    def __iter__(self) -> Iterator[int]:
        return iter(self._layers)

    def __len__(self) -> int:
        return len(self._layers)


class Predictor:
    """Predicts and scores; ``predict`` runs on the compute thread, ``score`` on the loop.

    A layer's predictions are read ahead only while they have recently been right often enough
    (``trusted``): a wrong guess costs a read and the CPU to make it, and at 61 % accuracy read-ahead
    lost 15 % of the tok/s while at 100 % it gained 13 to 23 % (``docs/facts.md``). The bar sits
    between those two measurements; it is not tuned. Untrusted layers are still predicted and
    scored, so a layer whose guesses improve is trusted again."""

    TRUST_PCT = 80.0
    RECENT = 8  # predictions per layer the trust looks back on

    def __init__(self, routers: Mapping[int, np.ndarray], k: int, final_layer: int | None = None) -> None:
        self._routers = routers
        self._k = k
        # llama.cpp runs the model's final layer on the rows whose logits it outputs only (a
        # prompt's last), so a batch predicts that layer from its last row.
        self._final = final_layer
        self._recent: dict[int, deque[tuple[int, int]]] = {}  # layer -> (right, routed) per prediction
        layers = sorted(routers)
        self._next = dict(zip(layers, layers[1:]))
        self._pending: dict[int, np.ndarray] = {}  # layer -> predicted experts, until scored
        self.correct: dict[int, int] = {}
        self.total: dict[int, int] = {}

    def predict(self, layer: int, x: np.ndarray) -> tuple[int, np.ndarray] | None:
        """From layer ``layer``'s router input (one row, or a batch's rows [tokens, n_embd]), the
        next MoE layer and the experts it is predicted to route: each row's top-k, their union
        for a batch, those more rows chose first (a read-ahead cut short keeps the surest)."""
        nxt = self._next.get(layer)
        if nxt is None:
            return None
        if x.ndim == 2 and nxt == self._final:
            x = x[-1]
        if x.ndim == 1:
            top = np.argpartition(self._routers[nxt] @ x, -self._k)[-self._k:]
        else:
            scores = x @ self._routers[nxt].T
            union, votes = np.unique(np.argpartition(scores, -self._k, axis=1)[:, -self._k:], return_counts=True)
            top = union[np.argsort(-votes, kind="stable")]  # most rows first: the surest guesses lead
        self._pending[nxt] = top
        return nxt, top

    def score(self, layer: int, routed: tuple[int, ...]) -> None:
        """Score the prediction for ``layer`` against what it routed: right over the larger of
        the two sets, so a batch's union is charged for what it named and was not routed (a read
        for nothing) as much as for what it missed. One token: both sets are k, as before."""
        predicted = self._pending.pop(layer, None)
        if predicted is None:
            return
        right = len(set(predicted.tolist()) & set(routed))
        n = max(len(routed), len(predicted))
        self.correct[layer] = self.correct.get(layer, 0) + right
        self.total[layer] = self.total.get(layer, 0) + n
        self._recent.setdefault(layer, deque(maxlen=self.RECENT)).append((right, n))

    def trusted(self, layer: int) -> bool:
        """Whether to read ahead what is predicted for ``layer``: yes until there is evidence."""
        recent = self._recent.get(layer)
        if not recent or len(recent) < self.RECENT // 2:
            return True
        right = sum(r for r, _ in recent)
        routed = sum(n for _, n in recent)
        return 100.0 * right >= self.TRUST_PCT * routed

    def accuracy_pct(self) -> dict[int, float]:
        return {il: 100.0 * self.correct[il] / n for il, n in sorted(self.total.items()) if n}

    def overall_pct(self) -> float | None:
        """Right over scored across every layer (None before any score)."""
        total = sum(self.total.values())
        return 100.0 * sum(self.correct.values()) / total if total else None

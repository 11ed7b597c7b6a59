"""The boundary between the compute thread and the pipeline: what crosses it, and how.

``ComputeModes``: the modes of one streaming run, as one value. Which points the compute thread
waits at (at routing, or per projection), what observes it (route-trace taps), what guesses
ahead of it (predictor, temporal look-ahead): decided once, at open or at the start of a replay,
and never changed while a decode could be reading them. The routing gate, the eval callback and
the prefetch stage each take this value whole and copy the fields they read on a hot path into
plain attributes, so the boundary costs nothing per node.

``FastPath``: the two structures both sides touch with no hop, when every routed expert of a
layer is resident. Everything else crosses by a channel (``bmoe.pipeline.events.GateItem``) and a
thread-safe future the compute thread waits on.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import NamedTuple, Protocol, TypeAlias

import numpy as np

from bmoe.errors import ConfigError

# Called on the compute thread for every routed layer once it is served, when set (route traces):
# step, phase, layer, the routed ids (rows x k), the layer's unique experts, which of them were
# resident beforehand, and the seconds the thread waited for the rest.
Tap = Callable[[int, int, int, np.ndarray, np.ndarray, np.ndarray, float], None]
# Called on the compute thread with a layer's routed experts' router probabilities (tokens x k).
WeightsTap = Callable[[int, np.ndarray], None]


class RoutePredictor(Protocol):
    """Guesses a later layer's experts on the compute thread; scored on the loop against the real
    routing (``bmoe.stages.predict.Predictor``)."""

    def predict(self, layer: int, x: np.ndarray) -> tuple[int, np.ndarray] | None: ...

    def trusted(self, layer: int) -> bool: ...

    def score(self, layer: int, routed: tuple[int, ...]) -> None: ...

    def accuracy_pct(self) -> dict[int, float]: ...


@dataclass(frozen=True)
class OverlapPlan:
    """Overlap's wait points. ``consumption``: per MoE layer, its expert projections in the order
    the graph consumes them; routing waits for the first, and each later one is waited for just
    before its matmul. ``wait_after`` (live runs): the graph node after which the compute thread
    waits for (layer, next projection); a replay's modelled compute waits by itself."""

    consumption: Mapping[int, tuple[int, ...]]
    wait_after: Mapping[bytes, tuple[int, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for layer, order in self.consumption.items():
            if not order or len(set(order)) != len(order):
                raise ConfigError(f"overlap: layer {layer} consumes projections {order!r}: need each once")
        for name, (layer, proj) in self.wait_after.items():
            if proj not in self.consumption.get(layer, ()):
                raise ConfigError(f"overlap: node {name!r} waits for projection {proj} of layer {layer}, "
                                  "which the plan does not consume")
        object.__setattr__(self, "consumption", MappingProxyType(dict(self.consumption)))
        object.__setattr__(self, "wait_after", MappingProxyType(dict(self.wait_after)))

    @classmethod
    def in_order(cls, layers: list[int], n_proj: int) -> OverlapPlan:
        """Every layer consumes its projections as stored (a replay's modelled compute)."""
        return cls({il: tuple(range(n_proj)) for il in layers})

    def first_proj(self) -> dict[int, int]:
        return {il: order[0] for il, order in self.consumption.items()}

    def last_proj(self) -> dict[int, int]:
        return {il: order[-1] for il, order in self.consumption.items()}


@dataclass(frozen=True)
class ComputeModes:
    """``overlap``: per-projection wait points (None: wait for a layer's every byte at routing;
    a replay's modelled per-expert overlap is a gate of its own, ``bmoe.engine.per_expert``).
    ``tap`` / ``weights_tap``: route-trace observers. ``predictor``: predictive read-ahead from
    the next layer's router, in one-token calls (``predict_steps``) and in batched ones, a prompt's
    (``predict_batches``: the union over its rows). ``lookahead``: MoE layers ahead whose previous
    routing is read ahead while a layer is served (0: off)."""

    overlap: OverlapPlan | None = None
    tap: Tap | None = None
    weights_tap: WeightsTap | None = None
    predictor: RoutePredictor | None = None
    predict_steps: bool = True
    predict_batches: bool = False
    lookahead: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.lookahead, bool) or not isinstance(self.lookahead, int) or self.lookahead < 0:
            raise ConfigError(f"lookahead must be a non-negative integer, got {self.lookahead!r}")
        for name in ("tap", "weights_tap"):
            if getattr(self, name) is not None and not callable(getattr(self, name)):
                raise ConfigError(f"{name} must be callable")


SERIAL = ComputeModes()  # wait for a layer's every byte at routing; nothing observes or guesses

# A layer the gate served alone: (layer, its unique routed experts, each one's best router rank).
# A plain tuple: it is made on the compute thread at every all-resident layer.
FastHit: TypeAlias = tuple[int, np.ndarray, np.ndarray]


class UnseenHits(NamedTuple):
    """Hits of one-token routings nobody looked at: while the cache holds every expert, the C
    filter does not ask for a wholly resident layer's routing, so llama.cpp computes on without
    splitting its graph there (``NodeFilter.set_unseen``). Counted as hits; the policy is not told,
    as nothing can be evicted for room until the budget falls below the bank."""

    count: int


class FastPath(NamedTuple):
    """What the gate's fast path shares with the loop, without a hop.

    ``resident``: per layer, a bool per expert, true while that expert's bytes are in place. The
    ready stage sets it once a layer's reads have landed; evictions clear it, only while the compute
    thread waits on the loop; the gate reads it at every routing. ``hits``: the layers the gate
    served alone, appended on the compute thread and drained in order by the cache writer
    (``PrefetchStage.account_fast_hits``), so the cache sees one plan per routed layer."""

    resident: list[np.ndarray]
    hits: deque[FastHit | UnseenHits]

    @classmethod
    def over(cls, resident: list[np.ndarray]) -> FastPath:
        """A fast path over a residency's maps, with no hit yet."""
        return cls(resident, deque())  # wait for a layer's every byte at routing; nothing observes or guesses

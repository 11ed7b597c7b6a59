"""Test and diagnosis hooks into the stages: the fault injection the gates need to show they can
fail (skip a routed read, poison memory before reads) and observation of plans. Each is None in
normal runs and costs one attribute test per layer event, never per node.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from bmoe.pipeline.cache import Plan
from bmoe.pipeline.events import ReadRequest, RoutingEvent


@dataclass
class Hooks:
    # Called on the I/O lane before each read: False skips it (the bytes stay whatever the memory
    # held); an exception fails the read like an I/O error would.
    before_read: Callable[[ReadRequest], bool] | None = None
    # Called with the layer and its per-projection (base address, nbytes) before its reads start.
    before_layer_reads: Callable[[int, list[tuple[int, int]]], None] | None = None
    on_plan: Callable[[RoutingEvent, Plan], None] | None = None

"""Byte-identity gates: greedy tokens streamed == resident on the same file, across the matrix,
with a poison run showing only routed slices matter and negative controls showing the gate fails
when a routed expert is missing."""

from __future__ import annotations

import ctypes
import itertools
from collections import Counter

import pytest

from bmoe.engine.config import RunConfig
from bmoe.pipeline.hooks import Hooks
from bmoe.synth.tiny import TinySpec
from tests.helpers import N_TOKENS, generate_tokens

ARCHS = ("qwen3moe", "qwen2moe", "gemma4")
TYPES = ("f32", "f16", "q8_0")


def stream_config(**kw: object) -> RunConfig:
    return RunConfig(mode="stream", n_ctx=256, **kw)


@pytest.mark.parametrize("arch,wtype", list(itertools.product(ARCHS, TYPES)))
def test_streamed_equals_resident_matrix(tiny, arch: str, wtype: str) -> None:
    for shards in (1, 3):
        path = tiny.path(TinySpec(arch=arch, wtype=wtype, shards=shards))
        resident = tiny.resident_tokens(path)
        assert len(set(resident)) >= 6, "fixture is degenerate; the gate would prove little"
        for odirect, lanes in itertools.product((True, False), (1, 4)):
            got = generate_tokens(path, stream_config(odirect=odirect, io_threads=lanes))
            assert got == resident, f"shards={shards} odirect={odirect} lanes={lanes}"


def poison(layer: int, spans: list[tuple[int, int]]) -> None:
    for base, nbytes in spans:
        ctypes.memset(base, 0xFF, nbytes)  # 0xFF bytes are NaN in f32 and f16


@pytest.mark.parametrize("arch,wtype", [("qwen3moe", "f32"), ("gemma4", "f16"), ("qwen2moe", "q8_0")])
def test_poisoned_regions_still_identical(tiny, arch: str, wtype: str) -> None:
    path = tiny.path(TinySpec(arch=arch, wtype=wtype))
    got = generate_tokens(path, stream_config(), Hooks(before_layer_reads=poison))
    assert got == tiny.resident_tokens(path)


def skip_top_expert(layer: int = 0) -> Hooks:
    """Hooks that never read the first missed expert of ``layer``: the negative control."""

    def before_read(request) -> bool:  # noqa: ANN001
        return not (request.key.layer == layer and request.key.expert == skip_state["expert"])

    def on_plan(event, plan) -> None:  # noqa: ANN001
        if event.layer == layer:
            skip_state["expert"] = plan.misses[0] if plan.misses else -1

    skip_state = {"expert": -1}
    return Hooks(before_read=before_read, on_plan=on_plan)


def test_negative_control_missing_expert_changes_output(tiny) -> None:
    path = tiny.path(TinySpec(arch="qwen3moe", wtype="f32"))
    got = generate_tokens(path, stream_config(), skip_top_expert())
    assert got != tiny.resident_tokens(path)


def test_negative_control_under_poison_changes_output(tiny) -> None:
    path = tiny.path(TinySpec(arch="qwen3moe", wtype="f16"))
    hooks = skip_top_expert()
    hooks.before_layer_reads = poison
    got = generate_tokens(path, stream_config(), hooks)
    assert got != tiny.resident_tokens(path)


@pytest.mark.parametrize("arch", ARCHS)
def test_exactly_k_experts_per_layer_per_decode_token(tiny, arch: str) -> None:
    spec = TinySpec(arch=arch)
    assert_exact_reads(tiny.path(spec), spec, moe_layers=range(spec.n_layer), n_proj=2 if arch == "gemma4" else 3)


def assert_exact_reads(path, spec: TinySpec, moe_layers, n_proj: int) -> None:  # noqa: ANN001
    """Cache off: every decode step reads exactly k experts x n_proj slices in each MoE layer and
    nothing anywhere else (dense, recurrent and MTP blocks never route); the prompt reads each
    routed expert of a MoE layer once."""
    moe_layers = list(moe_layers)
    slices: Counter[tuple[int, int]] = Counter()
    current = {}

    def on_plan(event, plan) -> None:  # noqa: ANN001
        current[event.layer] = event.step
        assert plan.hits == (), "cache off: nothing is resident when a layer is routed"

    def before_read(request) -> bool:  # noqa: ANN001
        slices[current[request.key.layer], request.key.layer] += 1
        return True

    generate_tokens(path, stream_config(), Hooks(before_read=before_read, on_plan=on_plan))
    decode_steps = sorted({step for step, _ in slices if step >= 1})
    assert len(decode_steps) == N_TOKENS - 1
    assert {layer for _, layer in slices} == set(moe_layers), "reads only for MoE layers"
    for step in decode_steps:
        for layer in moe_layers:
            assert slices[step, layer] == spec.n_expert_used * n_proj
    # The prompt routes a union of experts per layer: at least k of them, read once each.
    for layer in moe_layers:
        assert spec.n_expert_used * n_proj <= slices[0, layer] <= spec.n_expert * n_proj

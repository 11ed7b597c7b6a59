"""Opt-in lossy levers: speed bought with exactness, off by default and labelled wherever they show.

Everything else in bmoe is lossless (streamed == resident, byte for byte). A lever here changes the
model's computation, so its output is a different model's output; ``bmoe quality`` measures how
different, beside how much faster.

``n_expert_used`` (top-K instead of the file's own k) is a key-value override of
``<arch>.expert_used_count`` handed to llama.cpp at load (``llama_model_params.kv_overrides``, the
public parameter; both open paths, ``llama_model_load_from_file`` and ``init_from_user``, pass it to
the model loader, which reads every hparam through it). llama.cpp then builds each MoE layer with
``argsort_top_k(probs, K)``, so the K highest-probability experts are used and the weight
normalisation (where the architecture has one) runs over those K. The layout's ``n_expert_used``
follows K, so the cache's working set and the budgets are sized for what is really read.

The levers' flags are declared with the engine's other options in ``bmoe.cli.options`` (which also
reads a lever string, ``bmoe quality --lossy "FLAGS"``); ``lossy_flags`` spells a config back in
them for the label every figure carries.
"""

from __future__ import annotations

import ctypes
import dataclasses
from typing import Any

from bmoe.engine.config import RunConfig
from bmoe.llama.drop_cold import DropCold, DropColdCallback
from bmoe.llama.route_ahead import RouteAhead, RouteAheadCallback
from bmoe.llama.seam import llama_lib, model_params
from bmoe.errors import ConfigError
from bmoe.io.layout import ModelLayout
from bmoe.io.recipes import recipe_for
from bmoe.pipeline.gate import RoutingGate
from bmoe.stages.predict import load_routers


def lossy_flags(config: RunConfig) -> list[str]:
    """The command-line spelling of every lossy lever ``config`` turns on (empty: exact run)."""
    flags = []
    if config.n_expert_used is not None:
        flags += ["--n-expert-used", str(config.n_expert_used)]
    if config.drop_cold_experts is not None:
        flags += ["--drop-cold-experts", f"{config.drop_cold_experts:g}"]
        flags += [] if config.drop_renorm else ["--drop-no-renorm"]
        flags += ["--drop-prefill"] if config.drop_prefill else []
    if config.route_ahead is not None:
        flags += ["--route-ahead", str(config.route_ahead)]
    return flags


def lossy_label(config: RunConfig) -> dict[str, object]:
    """What every figure of a run carries: ``lossy`` and, when true, the flags that made it so."""
    flags = lossy_flags(config)
    return {"lossy": bool(flags), "lossy_flags": " ".join(flags) if flags else None}


@dataclasses.dataclass
class LoadOverrides:
    """The layout as the levers change it, and the model params that make llama.cpp agree.

    ``params`` points into ``_keep`` (the override array): keep this object alive until the
    model is loaded."""

    layout: ModelLayout
    params: Any | None  # llama_cpp.llama_model_params, or None: load as the file says
    _keep: list[Any] = dataclasses.field(default_factory=list, repr=False)


def load_overrides(layout: ModelLayout, config: RunConfig) -> LoadOverrides:
    """Apply ``config``'s load-time levers to ``layout``; a K outside 1..k is a ConfigError, and so
    is a route-ahead distance no layer is that far from (a run labelled lossy that changed nothing)."""
    n_moe = len(layout.moe_layers)
    if config.route_ahead and config.route_ahead >= n_moe:
        raise ConfigError(f"route_ahead {config.route_ahead} reaches past the model's {n_moe} MoE layers: "
                          f"no layer would be routed ahead (at most {n_moe - 1})")
    k = config.n_expert_used
    if k is None:
        return LoadOverrides(layout, None)
    key = recipe_for(layout.arch).key("expert_used_count")
    if not 1 <= k <= layout.n_expert_used:
        raise ConfigError(
            f"n_expert_used must be 1..{layout.n_expert_used} (the file's {key}), got {k}"
        )
    lib = llama_lib()
    overrides = (lib.llama_model_kv_override * 2)()  # the second, zeroed, ends the list (key[0] == 0)
    overrides[0].key = key.encode()
    overrides[0].tag = lib.LLAMA_KV_OVERRIDE_TYPE_INT
    overrides[0].value.val_i64 = k
    params = model_params()
    params.kv_overrides = ctypes.cast(overrides, ctypes.POINTER(lib.llama_model_kv_override))
    return LoadOverrides(dataclasses.replace(layout, n_expert_used=k), params, [overrides])


def lossy_callback(
    gate: RoutingGate, layout: ModelLayout, config: RunConfig,
) -> DropColdCallback | RouteAheadCallback | None:
    """The eval callback the node-level levers need, or None: the plain one serves (no extra test
    per node when they are off). The config allows at most one of them."""
    if config.route_ahead is not None:
        routers = load_routers(layout) if config.route_ahead else {}
        return RouteAheadCallback(gate, RouteAhead(layout, config.route_ahead, routers))
    if config.drop_cold_experts is None:
        return None
    why = drop_cold_refusal(layout)
    if why is not None:
        raise ConfigError(f"drop_cold_experts: not on this model: {why}")
    drop = DropCold(layout, config.drop_cold_experts, renorm=config.drop_renorm, prefill=config.drop_prefill)
    return DropColdCallback(gate, drop)


def drop_cold_refusal(layout: ModelLayout) -> str | None:
    """Why ``--drop-cold-experts`` cannot weigh this model's routed experts, or None. Its rule
    reads each expert's share of the routed mass from the scores the router's top-k sorts, which
    must be the weights' own probabilities. Where they are not, a share was negative or past 1:
    F = 0 dropped experts and changed llama4's output, and renormalising could flip the survivors'
    sign. Refused at open (gpt-oss was refused only at its first decode)."""
    if layout.arch == "llama4":
        return "llama4 sorts raw router logits and applies a sigmoid after the choice (scores are not shares)"
    if layout.arch == "gpt-oss":
        return "gpt-oss re-softmaxes the chosen experts' logits (a zeroed weight would still count)"
    if any(name.endswith("exp_probs_b.bias") for name in layout.tensors):
        return "its router chooses with a bias added to the probabilities (exp_probs_b), so the sorted scores are not shares"
    return None

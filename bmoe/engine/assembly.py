"""Assembly: one function builds every part of an opened run, complete, and hands back one frozen
``Run``.

``assemble`` loads the model the way ``open_model`` chose, makes the context with the eval callback
in front of it, finds the expert tensors (the cheap open's tensor callback, or a one-token warm-up
capture), and when streaming builds the pipeline's parts (``StreamParts``), the overlap plan, the
predictor, the route recorder, expert-major compute, and the streamer, then starts the callback
streaming through the streamer's gate with all of it; the dense part is copied out where asked.
Nothing is set on a part after ``assemble`` returns. The session holds the ``Run`` and owns its
teardown; the step scheduler (``bmoe.engine.scheduler``) drives its model.

The callback is the one part built in two moves, by necessity: llama.cpp takes its function when
the context is made, and the warm-ups that find the expert tensors, the expert-major shapes and the
overlap wait points are decodes through that very callback; ``EvalCallback.stream`` is its second
move, made once, here.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from bmoe.engine.config import RunConfig
from bmoe.engine.lossy import LoadOverrides, lossy_callback
from bmoe.engine.streaming import Streamer, StreamParts
from bmoe.errors import ConfigError, SeamMismatchError
from bmoe.io.ggml import check_live_tensor
from bmoe.io.layout import ModelLayout
from bmoe.io.pagecache import mapping_spans, release_file_pages
from bmoe.io.watch import FileWatch
from bmoe.llama.blas import hold_one_blas_thread
from bmoe.llama.callback import Capture, Consumption, EvalCallback
from bmoe.llama.expert_major import GROUP_EXPERTS, ExpertMajor, Shapes
from bmoe.llama.loader import OpenedModel, capture_weights, open_model
from bmoe.llama.seam import LlamaModel
from bmoe.metrics.route_trace import RouteRecorder
from bmoe.pipeline.boundary import ComputeModes, OverlapPlan
from bmoe.pipeline.cache import ExpertCache
from bmoe.pipeline.gate import RoutingGate
from bmoe.pipeline.hooks import Hooks
from bmoe.stages.compute import on_compute_thread
from bmoe.stages.dense import AnonDense
from bmoe.stages.predict import LiveRouters, Predictor, router_name

_EXPERT_TENSOR = re.compile(rb"^blk\.(\d+)\.([a-z_]+_exps)\.weight$")


@dataclass(frozen=True)
class Run:
    """An opened run, every part complete: what ``Session`` holds, generates on and tears down."""

    layout: ModelLayout
    config: RunConfig
    model: LlamaModel
    callback: EvalCallback
    opened: OpenedModel
    streamer: Streamer | None  # None when resident
    dense: AnonDense | None  # the dense weights copied out of the file mapping, where asked
    recorder: RouteRecorder | None  # the route trace being written, where asked
    watch: FileWatch  # the model files as loaded
    blas_held: bool  # this run holds BLAS to one thread (bmoe.llama.blas): give it back at close


def assemble(layout: ModelLayout, config: RunConfig, overrides: LoadOverrides, streaming: bool,
             hooks: Hooks | None, watch: FileWatch) -> Run:
    """The model loaded and, streamed, its experts' pipeline built (``Session.open``'s second
    half). On failure everything built so far is freed (the watch stays the caller's)."""
    opened = open_model(
        layout, streaming=streaming, mode=config.open_mode if streaming else "mmap", mparams=overrides.params,
    )
    gate = RoutingGate()  # warm-up and resident runs; a streamed run routes through the streamer's
    callback = lossy_callback(gate, layout, config) or EvalCallback(gate)
    model = LlamaModel(
        opened, n_ctx=config.n_ctx, n_threads=config.threads, callback=callback,
        install=streaming or config.eval_filter, n_seq_max=config.parallel,
    )
    streamer = parts = dense = recorder = None
    try:
        if config.draft != "none" and not model.can_drop_tail():
            raise ConfigError(f"draft {config.draft!r}: a rejected draft's positions must be taken back, "
                              "which a recurrent or hybrid model's state cannot do (run it without --draft)")
        if streaming:
            # Which layers expert-major can compute, seen by the capture's warm-up decode when
            # there is one, else by a warm-up of its own (experts not yet bound: no pages).
            shapes = Shapes() if _may_run_expert_major(callback, config) else None
            tensors = opened.expert_tensors(layout) or _capture_experts(model, callback, shapes)
            if shapes is not None and not shapes.looked:
                _warm_up(model, callback, shapes)
            check_live_tensor(next(iter(tensors.values())))
            if opened.open_mode == "mmap-drop":
                release_file_pages(layout, mapping_spans(layout, tensors))
            # The user and reserved opens copy the dense part into anonymous memory.
            in_file = opened.open_mode not in ("user", "reserved")
            # Where every MoE layer can run expert-major, no prompt's union is ever held whole
            # beside the budget (auto takes expert-major exactly when it would not fit): one
            # token's experts a layer is the most the budget must make room for. Counting a
            # whole batch's union refused a small cache, or made auto choose none, on
            # machines where expert-major keeps within it.
            grouped = shapes is not None and set(layout.moe_layers) <= shapes.layers
            parts = StreamParts.live(layout, tensors, config, dense_in_file=in_file,
                                     union_tokens=1 if grouped else model.n_batch)
            overlap = _plan_overlap(model, callback, layout, tensors) if config.overlap else None
            predictor = None
            if config.predict_prefetch or config.predicts_prompts:
                routers = LiveRouters(layout, _router_addresses(layout, opened, model, config))
                predictor = Predictor(routers, layout.n_expert_used, final_layer=layout.main_layers - 1)
            if config.route_trace is not None:
                recorder = RouteRecorder(config.route_trace, layout, _run_line(config, parts))
            modes = ComputeModes(
                overlap=overlap, predictor=predictor, predict_steps=config.predict_prefetch,
                predict_batches=config.predicts_prompts, lookahead=config.prefetch_layers,
                tap=recorder.tap if recorder is not None else None,
                weights_tap=recorder.tap_weights if recorder is not None else None,
            )
            expert_layers = frozenset(shapes.layers) if shapes is not None and parts.budget.bytes > 0 else frozenset()
            streamer = Streamer(parts, hooks or Hooks(), config.io_threads, modes)
            if config.prefill == "expert" and not expert_layers:
                raise ConfigError("prefill 'expert': no MoE layer of this model has an expert chain bmoe can "
                                  "compute (gate and up matmuls, SwiGLU, down; no biases)")
            expert_major = ExpertMajor(
                streamer.gate, expert_layers, config.threads, _group_size(layout, streamer.cache),
            ) if expert_layers else None
            # A run that saves a cache profile sends every routing to the policy (see_routing).
            callback.stream(streamer.gate, expert_major=expert_major, see_routing=bool(config.cache_profile))
        if config.dense_weights == "anon":
            dense = _anon_dense(layout, opened, model, config)
    except BaseException:
        if recorder is not None:
            recorder.close()
        if streamer is not None:
            streamer.close()
        elif parts is not None:
            parts.close()
        model.close()
        raise
    blas_held = streamer is not None and (streamer.modes.predictor is not None or config.route_ahead is not None)
    if blas_held:
        hold_one_blas_thread()  # router products on the compute thread (bmoe.llama.blas)
    return Run(layout, config, model, callback, opened, streamer, dense, recorder, watch, blas_held)


def _plan_overlap(
    model: LlamaModel, callback: EvalCallback, layout: ModelLayout, tensors: dict[tuple[int, str], int],
) -> OverlapPlan:
    """Find, from a one-token warm-up graph (the regions bound: a reserved open has nothing else
    behind its expert tensors), where each layer consumes each expert projection: the wait points
    are, at routing, the first consumed; after each consuming node, the next."""
    proj_of = {}
    for (layer, suffix), addr in tensors.items():
        suffixes = [et.suffix for et in layout.layer_experts(layer)]
        proj_of[addr] = (layer, suffixes.index(suffix))
    found = Consumption(proj_of)
    _warm_up(model, callback, found)
    consumption: dict[int, tuple[int, ...]] = {}
    wait_after: dict[bytes, tuple[int, int]] = {}
    for layer in layout.moe_layers:
        order = found.order.get(layer, [])
        if len(order) != len(layout.layer_experts(layer)):
            raise SeamMismatchError(f"overlap: could not find where layer {layer} consumes its experts")
        consumption[layer] = tuple(p for _, p in order)
        for (name, _), (_, nxt) in zip(order, order[1:]):
            wait_after[name] = (layer, nxt)
    return OverlapPlan(consumption, wait_after)


def _run_line(config: RunConfig, parts: StreamParts) -> dict[str, object]:
    """How the traced run was made, for the trace's ``# run`` line."""
    return {
        "engine": "bmoe", "cache_bytes": parts.cache.budget_bytes, "policy": parts.cache.policy_name,
        "io_threads": config.io_threads, "io": parts.reader.mode, "threads": config.threads,
    }


def _router_addresses(layout: ModelLayout, opened: OpenedModel, model: LlamaModel, config: RunConfig) -> dict[int, int]:
    """Per MoE layer, llama.cpp's router tensor (the predictors read it in place): from the user
    open's tensor callback, else found by a throwaway one-token decode, as ``_anon_dense`` does."""
    names = {router_name(il): il for il in layout.moe_layers}
    if opened.tensors:
        return {il: opened.tensors[n] for n, il in names.items() if n in opened.tensors}
    found = on_compute_thread(lambda: capture_weights(model.model, names, n_threads=config.threads))
    return {names[n]: addrs[0] for n, addrs in found.items() if addrs}


def _anon_dense(layout: ModelLayout, opened: OpenedModel, model: LlamaModel, config: RunConfig) -> AnonDense:
    """Copy the dense weights into anonymous memory so page-cache churn cannot evict them."""
    expert_names = {et.span.name for et in layout.experts.values()}
    names = [n for n in layout.tensors if n not in expert_names]
    tensors = opened.tensors or on_compute_thread(lambda: capture_weights(model.model, names, n_threads=config.threads))
    dense = AnonDense(layout, tensors, open_mode=opened.open_mode)
    dense.apply()
    return dense


def _warm_up(model: LlamaModel, callback: EvalCallback, visitor: Capture | Consumption | Shapes) -> None:
    """One-token decode with ``visitor`` shown every MoE node of the graph, then the KV cleared; on
    the compute thread, as every decode (``bmoe.stages.compute``)."""
    on_compute_thread(_warm_up_here, model, callback, visitor)


def _warm_up_here(model: LlamaModel, callback: EvalCallback, visitor: Capture | Consumption | Shapes) -> None:
    callback.capture = visitor
    try:
        model.decode(model.tokenize("a", add_special=False)[:1] or [0])
    finally:
        callback.capture = None
        restore = getattr(visitor, "restore", None)  # ops a visitor set aside during the decode
        if restore is not None:
            restore()
        model.clear_memory()


def _may_run_expert_major(callback: EvalCallback, config: RunConfig) -> bool:
    """Whether this run may compute a prompt's experts group by group: it needs a cache to read the
    groups into, and no mode that watches or rewrites the expert nodes."""
    return (
        config.prefill in ("auto", "expert") and config.cache_bytes != 0 and type(callback) is EvalCallback
        and not config.overlap and not config.predict_prefetch and config.route_trace is None
    )


def _group_size(layout: ModelLayout, cache: ExpertCache) -> Callable[[int], int]:
    """Experts per expert-major group at a layer: at most a quarter of what the cache budget
    holds of that layer's experts (the group computing and the group reading both fit beside
    what the cache keeps), at least one, at most ``GROUP_EXPERTS``."""
    entry = layout.entry_bytes()

    def size(layer: int) -> int:
        return max(1, min(GROUP_EXPERTS, cache.budget_bytes // (4 * max(1, entry[layer]))))

    return size


def _capture_experts(model: LlamaModel, callback: EvalCallback, shapes: Shapes | None = None) -> dict[tuple[int, str], int]:
    """One-token warm-up decode that records each expert tensor the graph uses, then clears the KV.
    Needed after an mmap open, where no tensor callback told us the addresses. ``shapes``, if
    given, looks at the same graph (one warm-up, not two)."""
    capture = Capture(lambda name: _EXPERT_TENSOR.match(name) is not None, also=shapes)
    _warm_up(model, callback, capture)
    if not capture.tensors:
        raise SeamMismatchError("the warm-up decode saw no expert matmul: node names changed?")
    out = {}
    for name, addr in capture.tensors.items():
        m = _EXPERT_TENSOR.match(name)
        assert m is not None
        out[int(m[1]), m[2].decode()] = addr
    return out

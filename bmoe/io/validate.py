"""Check a model file set in Python before llama.cpp ever sees it.

Malformed metadata can trip a GGML_ASSERT that kills the process (a missing expert count, an
absent ``expert_gating_func`` where the graph needs one, expert groups that do not divide, all-zero
rope sections, a hybrid with no attending block, non-F32 sinks: ARCHITECTURES.md section 6 and
``docs/facts.md``), and many other faults only surface as a failed load after seconds of reading.
What differs per architecture comes from its recipe (``bmoe.io.recipes``), never a name test here. Everything
llama.cpp would trip on that can be seen from the index is checked here instead, each fault as
one line naming the file, raised as its own class from ``bmoe.errors``. The index parse itself
(``layout.read_index``) already refuses what is structurally broken.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from gguf import GGMLQuantizationType

from bmoe.errors import (
    ExpertLayoutError,
    MissingKeyError,
    MissingShardError,
    ModelFileError,
)
from bmoe.io.hparams import check_hparams
from bmoe.io.layout import (
    ModelLayout,
    ShardIndex,
    build_layout,
    expert_key,
    read_index,
    split_shard_paths,
)
from bmoe.io.recipes import Recipe, recipe_for

GGML_F32 = int(GGMLQuantizationType.F32)

_ARCH_KEY = "general.architecture"


def open_layout(path: str | os.PathLike[str]) -> ModelLayout:
    """Validate the model file(s) in Python before llama.cpp ever sees them, then return the layout."""
    first = Path(path)
    if not first.is_file():
        raise ModelFileError(f"{first}: no such file" if not first.exists() else f"{first}: not a regular file")
    shards = _check_shard_names(first)
    indexes = [read_index(p, i) for i, p in enumerate(shards)]
    _check_split_keys(indexes)
    recipe = _recipe(indexes[0])
    _check_required_keys(indexes[0], recipe)
    _check_aborting_metadata(indexes[0], recipe)
    layout = build_layout(indexes)
    _check_expert_counts(first, layout, recipe)
    _check_expert_tensors(first, layout, recipe)
    _check_f32_tensors(first, layout, recipe)
    check_hparams(indexes[0], layout)
    return layout


def _check_shard_names(first: Path) -> tuple[Path, ...]:
    shards = split_shard_paths(first)
    if first != shards[0]:
        raise MissingShardError(f"{first}: is not the first shard of its split set; open {shards[0]}")
    missing = [p.name for p in shards if not p.is_file()]
    if missing:
        raise MissingShardError(f"{first}: split set of {len(shards)} lacks {', '.join(missing)}")
    return shards


def _check_split_keys(indexes: Sequence[ShardIndex]) -> None:
    """The split.* keys must agree with the names: llama.cpp trusts the keys, bmoe the names. A
    set's keys must all be there (llama.cpp's loader requires them: without, ``--resident``
    refused a set the streamed run opened), and every shard must count the same shards."""
    if len(indexes) > 1:
        for i, index in enumerate(indexes):
            needs = ("split.no", "split.count", "split.tensors.count") if i == 0 else ("split.no",)
            missing = [k for k in needs if k not in index.metadata]
            if missing:
                raise ModelFileError(f"{index.path}: shard {i + 1} of a split set lacks {', '.join(missing)}")
            count = index.metadata.get("split.count", len(indexes))
            if count != len(indexes):
                raise MissingShardError(f"{index.path}: split.count says {count} shards, the file name {len(indexes)}")
    for i, index in enumerate(indexes):
        no = index.metadata.get("split.no", 0)
        if no != i:
            raise MissingShardError(
                f"{index.path}: split.no is {no!r} where shard {i + 1} of the set should say {i}; "
                "llama.cpp must be given shard 1 of a complete set"
            )
    first = indexes[0]
    count = first.metadata.get("split.count", 1)
    if count != len(indexes):
        raise MissingShardError(f"{first.path}: split.count says {count} shards, the file name {len(indexes)}")
    found = sum(len(ix.tensors) for ix in indexes)
    expected = first.metadata.get("split.tensors.count", found)
    if expected != found:
        raise ModelFileError(f"{first.path}: split.tensors.count says {expected} tensors, the shards hold {found}")


def _recipe(first: ShardIndex) -> Recipe:
    arch = first.metadata.get(_ARCH_KEY)
    if not isinstance(arch, str):
        raise MissingKeyError(f"{first.path}: metadata key {_ARCH_KEY!r} is missing or not a string")
    return recipe_for(arch)


def _check_required_keys(first: ShardIndex, recipe: Recipe) -> None:
    missing = [recipe.key(k) for k in recipe.required_keys if recipe.key(k) not in first.keys]
    if recipe.key("expert_count") in missing and not any("_exps" in t.name for t in first.tensors):
        raise MissingKeyError(f"{first.path}: a dense {recipe.arch} model, not a Mixture-of-Experts one (no expert "
                              f"count, no expert tensors): bmoe streams experts, plain llama.cpp runs this file")
    if missing:
        raise MissingKeyError(f"{first.path}: {recipe.arch} needs metadata key(s) {', '.join(missing)}")


# llama-hparams.h of the pin; beyond either llama.cpp asserts (abort) while loading.
MAX_LAYERS = 512
MAX_EXPERTS = 1024
_GATING_FUNCS = (1, 2, 3, 4)  # softmax, sigmoid, softmax-weight, sqrt-softplus; 0 or others abort
_ROPE_SCALING = ("none", "linear", "yarn", "longrope")


def _int_key(first: ShardIndex, key: str) -> int | None:
    value = first.metadata.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise ModelFileError(f"{first.path}: metadata key {key!r} is {value!r}, not an integer")
    return value


def _check_aborting_metadata(first: ShardIndex, recipe: Recipe) -> None:
    """Values the pinned llama.cpp meets with GGML_ASSERT / GGML_ABORT (the process dies) rather
    than a load error (ARCHITECTURES.md section 6). Each becomes one clear line here."""
    path, key = first.path, recipe.key
    n_layer = _int_key(first, key("block_count"))
    if n_layer is not None and not 1 <= n_layer <= MAX_LAYERS:
        raise ModelFileError(f"{path}: {key('block_count')} is {n_layer}, outside 1..{MAX_LAYERS}")
    if n_layer is not None:
        _check_layer_arrays(first, recipe, n_layer)
    nextn = _int_key(first, key("nextn_predict_layers"))
    if nextn is not None and n_layer is not None and not 0 <= nextn <= n_layer:
        raise ModelFileError(f"{path}: {key('nextn_predict_layers')} is {nextn}, more than {key('block_count')} {n_layer}")
    n_expert = _int_key(first, key("expert_count")) or 0
    if n_expert > MAX_EXPERTS:
        raise ExpertLayoutError(f"{path}: {key('expert_count')} is {n_expert}, llama.cpp allows at most {MAX_EXPERTS}")
    groups = _int_key(first, key("expert_group_count")) or 0
    used_groups = _int_key(first, key("expert_group_used_count")) or 0
    if groups > 1:
        if groups >= n_expert:
            raise ExpertLayoutError(f"{path}: {key('expert_group_count')} is {groups}, not fewer than the {n_expert} experts")
        if n_expert % groups:
            raise ExpertLayoutError(f"{path}: {key('expert_group_count')} {groups} does not divide {n_expert} experts into groups")
        if n_expert // groups < 2:
            raise ExpertLayoutError(f"{path}: {groups} expert groups of {n_expert // groups}: grouped routing needs at least 2 per group")
        if not 0 < used_groups < groups:
            raise ExpertLayoutError(f"{path}: {key('expert_group_used_count')} is {used_groups}, outside 1..{groups - 1}")
    gating_key = key("expert_gating_func")
    gating = _int_key(first, gating_key)
    if gating is None and recipe.gating_required:
        raise MissingKeyError(f"{path}: {recipe.arch} needs metadata key {gating_key} (llama.cpp aborts without it)")
    if gating is not None and gating not in _GATING_FUNCS and (gating != 0 or recipe.gating_required):
        raise ModelFileError(f"{path}: {gating_key} is {gating}, not one of {', '.join(map(str, _GATING_FUNCS))}")
    scaling = first.metadata.get(key("rope.scaling.type"))
    if scaling is not None and scaling not in _ROPE_SCALING:
        raise ModelFileError(f"{path}: {key('rope.scaling.type')} is {scaling!r}, not one of {', '.join(_ROPE_SCALING)}")
    step = _int_key(first, key("interleave_moe_layer_step"))
    if recipe.moe_step_positive and step == 0:
        raise ModelFileError(f"{path}: {key('interleave_moe_layer_step')} is 0; llama.cpp aborts unless it is positive")
    if recipe.kda:
        _check_kda_gate(first, recipe)
    inner, embd = _int_key(first, key("ssm.inner_size")), _int_key(first, key("embedding_length"))
    if recipe.mamba_inner_twice_embd and inner is not None and embd is not None and inner != 2 * embd:
        raise ModelFileError(f"{path}: {key('ssm.inner_size')} is {inner}; llama.cpp asserts twice "
                             f"{key('embedding_length')} ({2 * embd})")
    for name, want in recipe.exact_keys:
        value = first.metadata.get(key(name))
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)
                                  or abs(value - want) > 1e-4):
            raise ModelFileError(f"{path}: {key(name)} is {value!r}; llama.cpp's {recipe.arch} graph asserts {want:g}")
    if n_layer is not None and recipe.recurrent_marker:
        _check_some_block_attends(first, recipe, n_layer - (nextn or 0))
    sections = first.arrays.get(key("rope.dimension_sections"))
    if recipe.rope_sections and key("rope.dimension_sections") in first.keys:
        if sections is None or not any(sections[:3]):
            raise ModelFileError(f"{path}: {key('rope.dimension_sections')} is {sections!r}: all-zero sections abort the first decode")


def _check_kda_gate(first: ShardIndex, recipe: Recipe) -> None:
    """Kimi delta attention's gate: the loader asserts safe_gate and a lower bound below 0."""
    bound_key, safe_key = recipe.key("kda.gate_lower_bound"), recipe.key("kda.safe_gate")
    bound = first.metadata.get(bound_key)
    if bound is not None and (isinstance(bound, bool) or not isinstance(bound, int | float) or not bound < 0):
        raise ModelFileError(f"{first.path}: {bound_key} is {bound!r}; llama.cpp aborts unless it is below 0")
    if safe_key in first.keys and first.metadata.get(safe_key) is not True:
        raise ModelFileError(f"{first.path}: {safe_key} is {first.metadata.get(safe_key)!r}; llama.cpp aborts "
                             "unless it is true")


# Per-layer arrays (llama.cpp's get_key_or_arr): a short one is taken as is, the layers past its
# end left at the default (a sliding-window pattern of one value made every other layer full
# attention, silently); and the checks below that read them said "missing" or "no block attends".
_LAYER_ARRAYS = ("attention.head_count", "attention.head_count_kv", "attention.recurrent_layers",
                 "attention.sliding_window_pattern", "feed_forward_length")


def _check_layer_arrays(first: ShardIndex, recipe: Recipe, n_layer: int) -> None:
    """Every per-layer array holds one value per block, before anything reads one."""
    for name in (*_LAYER_ARRAYS, recipe.width_key):
        span = first.array_spans.get(recipe.key(name))
        if span is not None and span[1] != n_layer:
            raise ModelFileError(f"{first.path}: {recipe.key(name)!r} has {span[1]} values for {n_layer} layers")


def _check_some_block_attends(first: ShardIndex, recipe: Recipe, n_main: int) -> None:
    """A hybrid whose main blocks are all recurrent has no KV cache buffer: llama.cpp asserts."""
    key = recipe.key
    if recipe.recurrent_marker == "interval":
        marks = first.arrays.get(key("attention.recurrent_layers"))
        if marks is not None:
            attends = not all(marks[:n_main])
        else:
            interval = _int_key(first, key("full_attention_interval"))
            interval = 4 if interval is None else interval  # the loaders' default
            attends = 0 < interval <= n_main
        what = f"{key('full_attention_interval')} / attention.recurrent_layers"
    else:
        heads = first.arrays.get(key("attention.head_count_kv"))
        scalar = first.metadata.get(key("attention.head_count_kv"))
        attends = any(heads[:n_main]) if heads is not None else bool(scalar)
        what = key("attention.head_count_kv")
    if not attends:
        raise ModelFileError(
            f"{first.path}: none of the {n_main} blocks attends ({what}); llama.cpp cannot run a hybrid without one"
        )


def _check_expert_counts(path: Path, layout: ModelLayout, recipe: Recipe) -> None:
    if not 1 <= layout.n_expert_used <= layout.n_expert:
        raise ExpertLayoutError(
            f"{path}: {recipe.key('expert_used_count')} is {layout.n_expert_used}, "
            f"outside 1..{layout.n_expert} ({recipe.key('expert_count')})"
        )


def _check_f32_tensors(path: Path, layout: ModelLayout, recipe: Recipe) -> None:
    """Tensors whose kernels assert F32 (gpt-oss sinks and biases): another type aborts at decode."""
    for name, span in layout.tensors.items():
        if span.ggml_type != GGML_F32 and any(name.endswith(s) for s in recipe.f32_suffixes):
            raise ModelFileError(f"{path}: {name} is {GGMLQuantizationType(span.ggml_type).name}; llama.cpp needs F32 there")


def _expert_width(layout: ModelLayout, recipe: Recipe, layer: int) -> int | None:
    """The width key's value for ``layer`` (a scalar, or a per-layer array); None if absent."""
    key = recipe.key(recipe.width_key)
    value = layout.metadata.get(key)
    if value is None and key in layout.arrays and layer < len(layout.arrays[key]):
        value = layout.arrays[key][layer]
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _check_expert_tensors(path: Path, layout: ModelLayout, recipe: Recipe) -> None:
    suffixes = recipe.expert_suffixes
    for name, span in layout.tensors.items():
        key = expert_key(name, suffixes)
        if key is not None and key[0] >= layout.n_layer:
            raise ExpertLayoutError(f"{path}: expert tensors in layer {key[0]}, but block_count is {layout.n_layer}")
        if key is not None and key[0] >= layout.main_layers:
            continue  # an MTP block's experts: llama.cpp skips them, so does bmoe
        if key is not None and key not in layout.experts:
            raise ExpertLayoutError(f"{path}: expert tensor {name!r} has shape {span.ne}, not [.., .., n_expert]")
    if not layout.experts:
        raise ExpertLayoutError(f"{path}: no expert tensors (blk.N.{{{','.join(suffixes)}}}.weight)")
    shapes: dict[str, tuple[int, ...]] = {}
    for layer in layout.moe_layers:
        _check_layer(path, layout, recipe, layer)
        for e in layout.layer_experts(layer):
            # Shapes must agree across layers; types need not (mixed quantizations are normal).
            first = shapes.setdefault(e.suffix, e.span.ne)
            if e.span.ne != first:
                raise ExpertLayoutError(f"{path}: {e.span.name} has shape {e.span.ne}, other layers have {first}")
    # One layout for the whole file: bind and overlap plan per layer, but a mixed file is not one
    # any converter writes and llama.cpp's fused/split choice is per layer too; refuse it plainly.
    kinds = {tuple(e.suffix for e in layout.layer_experts(il)) for il in layout.moe_layers}
    if len(kinds) > 1:
        raise ExpertLayoutError(f"{path}: layers mix expert layouts {sorted(kinds)}")


def _check_layer(path: Path, layout: ModelLayout, recipe: Recipe, layer: int) -> None:
    if layer >= layout.n_layer:
        raise ExpertLayoutError(f"{path}: expert tensors in layer {layer}, but block_count is {layout.n_layer}")
    have = tuple(e.suffix for e in layout.layer_experts(layer))
    if not any(set(have) == set(choice) for choice in recipe.layouts):
        nearest = max(recipe.layouts, key=lambda c: len(set(c) & set(have)))
        missing = [s for s in nearest if s not in have]
        if missing:
            raise ExpertLayoutError(f"{path}: layer {layer} lacks expert tensor(s) {', '.join(missing)}")
        want = " or ".join("{" + ",".join(c) + "}" for c in recipe.layouts)
        raise ExpertLayoutError(f"{path}: layer {layer} has expert tensors {', '.join(have)}; {recipe.arch} takes {want}")
    width = _expert_width(layout, recipe, layer)
    if width is None:
        raise MissingKeyError(
            f"{path}: {recipe.key(recipe.width_key)} is missing or not an integer; {recipe.arch} sizes its experts by it"
        )
    for e in layout.layer_experts(layer):
        if e.n_expert != layout.n_expert:
            raise ExpertLayoutError(
                f"{path}: {e.span.name} holds {e.n_expert} experts, expert_count is {layout.n_expert}"
            )
        rows = e.span.ne[0] if e.suffix == "ffn_down_exps" else e.span.ne[1] // (2 if e.suffix == "ffn_gate_up_exps" else 1)
        if rows != width:
            raise ExpertLayoutError(
                f"{path}: {e.span.name} has shape {e.span.ne}, but {recipe.key(recipe.width_key)} is {width}"
            )

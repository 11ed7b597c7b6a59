"""Check a model file set in Python before llama.cpp ever sees it.

Malformed metadata can trip a GGML_ASSERT that kills the process (a missing expert count, for
one), and many other faults only surface as a failed load after seconds of reading. Everything
llama.cpp would trip on that can be seen from the index is checked here instead, each fault as
one line naming the file, raised as its own class from ``bmoe.errors``. The index parse itself
(``layout.read_index``) already refuses what is structurally broken.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

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
    layout = build_layout(indexes)
    _check_expert_counts(first, layout, recipe)
    _check_expert_tensors(first, layout, recipe)
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
    """The split.* keys must agree with the names: llama.cpp trusts the keys, bmoe the names."""
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
    if missing:
        raise MissingKeyError(f"{first.path}: {recipe.arch} needs metadata key(s) {', '.join(missing)}")


def _check_expert_counts(path: Path, layout: ModelLayout, recipe: Recipe) -> None:
    if not 1 <= layout.n_expert_used <= layout.n_expert:
        raise ExpertLayoutError(
            f"{path}: {recipe.key('expert_used_count')} is {layout.n_expert_used}, "
            f"outside 1..{layout.n_expert} ({recipe.key('expert_count')})"
        )


def _check_expert_tensors(path: Path, layout: ModelLayout, recipe: Recipe) -> None:
    suffixes = recipe.expert_suffixes
    for name, span in layout.tensors.items():
        key = expert_key(name, suffixes)
        if key is not None and key not in layout.experts:
            raise ExpertLayoutError(f"{path}: expert tensor {name!r} has shape {span.ne}, not [.., .., n_expert]")
    if not layout.experts:
        raise ExpertLayoutError(f"{path}: no expert tensors (blk.N.{{{','.join(suffixes)}}}.weight)")
    shapes: dict[str, tuple[int, ...]] = {}
    for layer in layout.moe_layers:
        _check_layer(path, layout, suffixes, layer)
        for e in layout.layer_experts(layer):
            # Shapes must agree across layers; types need not (mixed quantizations are normal).
            first = shapes.setdefault(e.suffix, e.span.ne)
            if e.span.ne != first:
                raise ExpertLayoutError(f"{path}: {e.span.name} has shape {e.span.ne}, other layers have {first}")


def _check_layer(path: Path, layout: ModelLayout, suffixes: tuple[str, ...], layer: int) -> None:
    if layer >= layout.n_layer:
        raise ExpertLayoutError(f"{path}: expert tensors in layer {layer}, but block_count is {layout.n_layer}")
    missing = [s for s in suffixes if (layer, s) not in layout.experts]
    if missing:
        raise ExpertLayoutError(f"{path}: layer {layer} lacks expert tensor(s) {', '.join(missing)}")
    for e in layout.layer_experts(layer):
        if e.n_expert != layout.n_expert:
            raise ExpertLayoutError(
                f"{path}: {e.span.name} holds {e.n_expert} experts, expert_count is {layout.n_expert}"
            )

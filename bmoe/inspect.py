"""``bmoe inspect MODEL``: what a model file is, and whether and how it runs here, from its index.

Reads only the GGUF index (the same validation every run makes first; milliseconds, llama.cpp is
never loaded): architecture, blocks by kind, experts, quant types, the byte budget of
the experts and the dense part, and for a RAM size (default: what this machine has available now)
whether the model runs resident, streamed, or not at all, the cache budget ``auto`` would choose,
and a decode speed forecast for a few budgets with every input shown and labelled by where it
came from:

- read rate: the device probe ``inspect --probe`` stored for this device, at the size of one
  projection of one expert (the slice the engine reads) and the lane count; until it has run, a
  prior (``READ_PRIOR_MIB_S``), labelled so (``bmoe replay`` probes whole experts, so its probes
  serve inspect only where the two sizes agree);
- hit rate: a prior, the decode hit rate of an LRU cache replayed over a route trace of
  Qwen3-30B-A3B, as a function of budget / expert bank (``HIT_PRIOR``); real models route differently;
- compute: the bytes a token touches (dense part + the routed experts) over a memory throughput,
  a prior unless ``--compute-gbs`` gives a measured one.

It also says how a streamed run would open the file here (``--open-mode auto``) and what that
open reads: the dense part (the user open), or the whole file once (MTP blocks, split gate/up
experts of archs whose user open fuses them, or not enough memory for the user open's allocation).

forecast tok/s = 1 / (read bytes per token / read rate + active bytes per token / compute rate),
reads and compute in series (no overlap, no read-ahead). A model that cannot run gets no forecast.

A file of an architecture with no bmoe recipe gets no report: the validation refuses it with one
line (``UnsupportedArchitectureError``: "architecture 'X' has no bmoe recipe (supported: ...)").
So a report's ``supported`` is always true; the field stays for the JSON's readers.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from gguf import GGMLQuantizationType

from bmoe.llama.loader import choose_open_mode
from bmoe.io.layout import ModelLayout, block_of
from bmoe.io.probe import cached_probe, stored_rate
from bmoe.io.recipes import RECIPES, recipe_for
from bmoe.io.validate import open_layout
from bmoe.pipeline.budget import (
    INTERPRETER_GROWTH,
    Needs,
    margin_bytes,
    mib_text,
    read_meminfo,
    resolve_budget,
    transient_bytes,
)

MiB, GiB = 1 << 20, 1 << 30
DEFAULT_LANES = 2  # RunConfig's io_threads default
# Prior compute rate: bytes of weights a 2-core CPU decode streams through per second. Not
# measured per machine; --compute-gbs replaces it with a figure from a resident run.
COMPUTE_PRIOR_GBS = 5.0
# Decode hit % of a byte-budgeted global LRU, replayed (``bmoe replay --policy lru``) over a route
# trace of Qwen3-30B-A3B (the project's shared traces, not shipped): 128 decode tokens, 48 layers,
# top-6 of 128, 17 928 MiB bank, 840 MiB working set (0.047 of the bank; below it LRU hits
# nothing). By budget / bank.
HIT_PRIOR: tuple[tuple[float, float], ...] = (
    (0.047, 0.0), (0.1, 53.2), (0.2, 76.7), (0.3, 89.4), (0.4, 94.7), (0.5, 96.7), (0.6, 97.1), (1.0, 97.1),
)
HIT_PRIOR_SOURCE = ("prior: an LRU cache's decode hit % replayed over a Qwen3-30B-A3B route trace (128 tokens), "
                    "by budget / bank")
# Prior read rate of one projection's slice at 2 lanes: the order bmoe's runs measured on cloud
# NVMe volumes (docs/facts.md: 1,000 to 1,700 MiB/s). A forecast made with it says so; ``--probe``
# measures this device instead.
READ_PRIOR_MIB_S = 1000.0


def hit_prior(budget: int, bank: int, working_set: int) -> float:
    """Prior decode hit % at ``budget``: 0 below one token's working set, else the trace's curve."""
    if budget <= 0 or budget < working_set or bank <= 0:
        return 0.0
    f = min(1.0, budget / bank)
    points = HIT_PRIOR
    if f <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if f <= x1:
            return y0 + (y1 - y0) * (f - x0) / (x1 - x0)
    return points[-1][1]


@dataclass
class Forecast:
    budget_bytes: int
    label: str
    hit_pct_prior: float
    read_bytes_per_token: int
    read_s: float | None  # None: read rate unmeasured
    compute_s: float
    tok_s: float | None


@dataclass
class Report:
    path: str
    arch: str
    supported: bool
    parameters: int  # weights in the file (every tensor's elements, MTP blocks included)
    context_length: int | None  # the context the model was trained for (<arch>.context_length)
    blocks: int
    moe_layers: list[int]
    layers: dict[str, int]  # moe / dense / recurrent / mtp
    experts: int
    experts_used: int
    shared_experts: int
    expert_types: dict[str, int]  # ggml type -> bytes
    dense_types: dict[str, int]
    expert_bytes_per_layer: dict[int, int]  # one expert, all its projections
    expert_bank_bytes: int
    dense_bytes: int
    mtp_bytes: int
    bytes_per_token_cache_off: int
    ram_bytes: int
    ram_how: str
    verdict: str
    verdict_why: str
    floor_bytes: int  # what the process needs beside dense + one token's experts (others, and a prompt layer's union beyond them)
    auto_budget_bytes: int
    auto_budget_how: str
    open_mode: str  # what a streamed run's --open-mode auto picks on this machine
    open_reason: str
    open_read_bytes: int  # what that open reads: the dense part, or the whole file once
    read_mib_s: float | None  # measured (a stored or fresh probe); None: unmeasured, the forecast uses a prior
    read_how: str
    compute_gbs: float
    compute_how: str
    hit_how: str = HIT_PRIOR_SOURCE
    forecasts: list[Forecast] = field(default_factory=list)


def _type_bytes(spans) -> dict[str, int]:  # noqa: ANN001
    out: Counter[str] = Counter()
    for s in spans:
        out[GGMLQuantizationType(s.ggml_type).name] += s.nbytes
    return dict(out.most_common())


def recurrent_blocks(layout: ModelLayout) -> list[int]:
    """Main blocks whose attention is a recurrent state (gated delta net, short conv)."""
    recipe = recipe_for(layout.arch)
    n_main, key = layout.main_layers, recipe.key
    if recipe.recurrent_marker == "interval":
        marks = layout.arrays.get(key("attention.recurrent_layers"))
        if marks is not None:
            return [il for il in range(n_main) if marks[il]]
        interval = int(layout.metadata.get(key("full_attention_interval"), 4))
        return [il for il in range(n_main) if (il + 1) % interval != 0]
    if recipe.recurrent_marker == "kv_heads":
        heads = layout.arrays.get(key("attention.head_count_kv"))
        return [il for il in range(n_main) if heads is not None and heads[il] == 0]
    return []


def _verdict(dense: int, bank: int, mtp: int, ws: int, needs: Needs, ram: int, ram_of: str) -> tuple[str, str]:
    """Resident, streamed or cannot run, and why, naming every figure the RAM was compared with:
    beside the model's bytes, the margin left to the kernel and other programs and the interpreter's
    allowance (``bmoe.pipeline.budget``; the index cannot know llama.cpp's buffers, counted as 0)."""
    beside = [(f"the margin (3 % of {ram_of}, at least 256 MiB)", needs.margin),
              ("the interpreter's allowance", needs.interpreter)]

    def compared(parts: list[tuple[str, int]], fits: bool) -> str:
        names = [n for n, _ in parts]
        total = sum(b for _, b in parts)
        figures = " + ".join(mib_text(b) for _, b in parts)
        left, right = mib_text(total), mib_text(ram)
        if left == right:  # rounded to the same whole MiB: show the decimal that tells them apart
            left, right = f"{total / MiB:.1f}", f"{ram / MiB:.1f}"
        return (f"{', '.join(names[:-1])} and {names[-1]} {'fit' if fits else 'exceed the RAM'}: "
                f"{figures} = {left} MiB {'<=' if fits else '>'} {right} MiB")

    whole = [("the dense part", dense), ("every expert", bank), *([("the MTP blocks", mtp)] if mtp else []), *beside]
    if sum(b for _, b in whole) <= ram:
        return "resident", compared(whole, True) + ": no streaming needed"
    token = [("the dense part", dense), *beside, ("one token's working set", ws)]
    union = [("the dense part", dense), *beside,
             ("a prompt layer's expert union (at 512 tokens a batch, held whole while the layer computes)",
              needs.transient)]
    if sum(b for _, b in token) <= ram and needs.transient > ws:
        if sum(b for _, b in union) <= ram:
            return "streamed", compared(union, True) + "; the expert bank does not"
        return "cannot run", compared(union, False) + "; one token's working set would fit in its place"
    if sum(b for _, b in token) <= ram:
        return "streamed", compared(token, True) + "; the expert bank does not"
    return "cannot run", compared(token, False)


def inspect_model(path: str | os.PathLike[str], *, ram_bytes: int | None = None, probe: bool = False,
                  lanes: int = DEFAULT_LANES, compute_gbs: float | None = None) -> Report:
    layout = open_layout(path)
    recipe = recipe_for(layout.arch)
    info = read_meminfo()
    if ram_bytes is None:
        ram_bytes, ram_how = info.get("MemAvailable", 0), "MemAvailable of this machine now"
        mem_total = info.get("MemTotal", ram_bytes)
    else:
        ram_how, mem_total = "given (--ram)", ram_bytes
    expert_names = {et.span.name for et in layout.experts.values()}
    mtp_names = {n for n in layout.tensors if block_of(n) >= layout.main_layers}
    kinds = layout.layer_kinds()
    recurrent = recurrent_blocks(layout)
    shared = int(layout.metadata.get(recipe.key("expert_shared_count"), 0) or 0)
    if not shared and any(n.endswith("_shexp.weight") for n in layout.tensors):
        shared = 1
    entry = layout.entry_bytes()
    bank, dense, ws = layout.expert_bytes, layout.dense_bytes, layout.expert_bytes_per_token()
    # The engine's memory model (bmoe.pipeline.budget) from the index alone: llama.cpp's KV and
    # compute buffers and the code's page cache are only known once a context exists, so they
    # count as 0 here and the margin stands for them.
    needs = Needs(dense=dense, buffers=0, code=0,
                  transient=transient_bytes(layout.n_expert, layout.n_expert_used, 512, max(entry.values())),
                  interpreter=INTERPRETER_GROWTH, margin=margin_bytes(mem_total))
    others = needs.total - dense
    # Streaming needs one token's experts, or a prompt layer's union where that is more: the cache
    # pins it whole (the budget model holds it inside the cache, never beside it).
    floor = others + max(0, needs.transient - ws)
    verdict, why = _verdict(dense, bank, layout.skipped_bytes, ws, needs, ram_bytes,
                            "the RAM given" if ram_how.startswith("given") else "MemTotal")
    if ram_how.startswith("given"):  # the machine --ram describes: no swap, the kernel's default overcommit
        given = {"MemTotal": ram_bytes, "SwapTotal": 0, "CommitLimit": ram_bytes, "Committed_AS": 0}
        open_mode, open_reason = choose_open_mode(layout, streaming=True, meminfo=lambda: given, overcommit=lambda: 0)
        open_reason += " (for the RAM given, no swap)"
    else:
        open_mode, open_reason = choose_open_mode(layout, streaming=True)
    open_read = dense if open_mode in ("user", "reserved") else layout.file_bytes  # both read the dense bytes only
    budget = resolve_budget(None, ceiling=None, mem_available=ram_bytes, needs=needs,
                            expert_bank_bytes=bank, working_set_bytes=ws)
    first = layout.layer_experts(layout.moe_layers[0])[0]
    directory = Path(layout.shards[0]).resolve().parent
    rate = cached_probe(directory, first.stride, lanes) if probe else stored_rate(directory, first.stride, lanes)
    read_how = rate.how + (" (cached)" if not probe else "") if rate else (
        f"prior, not measured here: no stored probe of this device at {first.stride}-byte slices, {lanes} lanes "
        "(--probe measures it)")
    read_mib_s = rate.mib_s if rate else READ_PRIOR_MIB_S
    gbs = compute_gbs if compute_gbs is not None else COMPUTE_PRIOR_GBS
    compute_how = (f"given (--compute-gbs {gbs:g})" if compute_gbs is not None
                   else f"prior: {gbs:g} GB/s of weights per second, not measured here")
    report = Report(
        path=str(layout.shards[0]), arch=layout.arch, supported=layout.arch in RECIPES,
        parameters=sum(math.prod(s.ne) for s in layout.tensors.values()),
        context_length=_int_or_none(layout.metadata.get(recipe.key("context_length"))),
        blocks=layout.n_layer, moe_layers=list(layout.moe_layers),
        layers={"moe": sum(k == "moe" for k in kinds.values()), "dense": sum(k == "dense" for k in kinds.values()),
                "recurrent": len(recurrent), "mtp": layout.n_nextn},
        experts=layout.n_expert, experts_used=layout.n_expert_used, shared_experts=shared,
        expert_types=_type_bytes(et.span for et in layout.experts.values()),
        dense_types=_type_bytes(s for n, s in layout.tensors.items() if n not in expert_names | mtp_names),
        expert_bytes_per_layer=entry, expert_bank_bytes=bank, dense_bytes=dense,
        mtp_bytes=layout.skipped_bytes, bytes_per_token_cache_off=ws, ram_bytes=ram_bytes, ram_how=ram_how,
        verdict=verdict, verdict_why=why, floor_bytes=floor, auto_budget_bytes=budget.bytes, auto_budget_how=budget.how,
        open_mode=open_mode, open_reason=open_reason, open_read_bytes=open_read,
        read_mib_s=rate.mib_s if rate else None, read_how=read_how, compute_gbs=gbs, compute_how=compute_how,
    )
    # A token touches the dense part (of the embeddings only its own row) and its routed experts.
    embd = layout.tensors.get("token_embd.weight")
    active = dense - (embd.nbytes if embd is not None and "output.weight" in layout.tensors else 0) + ws
    budgets = [(0, "cache off"), (budget.bytes, "auto"), (bank // 4, "quarter bank"), (bank // 2, "half bank"),
               (bank, "whole bank")]
    for b, label in budgets if verdict != "cannot run" else ():
        hit = hit_prior(b, bank, ws)
        read_bytes = round(ws * (1 - hit / 100))
        read_s = read_bytes / (read_mib_s * MiB)
        compute_s = active / (gbs * 1e9)
        report.forecasts.append(Forecast(b, label, round(hit, 1), read_bytes, read_s, compute_s, 1 / (read_s + compute_s)))
    return report


def _int_or_none(value: object) -> int | None:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _count(n: int) -> str:
    """A parameter count as a model card says it: 30.5B, 3.3M."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def _mib(n: int) -> str:
    return f"{n / MiB:,.1f} MiB"


def render(r: Report) -> str:
    per = sorted(set(r.expert_bytes_per_layer.values()))
    lines = [
        f"{r.path}",
        f"  architecture   {r.arch} ({'supported' if r.supported else 'not supported'}), {_count(r.parameters)} "
        f"parameters, trained context {f'{r.context_length:,} tokens' if r.context_length else 'not given'}",
        f"  blocks         {r.blocks}: {r.layers['moe']} MoE, {r.layers['dense']} without experts, "
        f"{r.layers['recurrent']} recurrent, {r.layers['mtp']} MTP (skipped by llama.cpp)",
        f"  experts        {r.experts}, {r.experts_used} used per token, {r.shared_experts} shared (resident)",
        "  expert types   " + ", ".join(f"{t} {_mib(b)}" for t, b in r.expert_types.items()),
        "  dense types    " + ", ".join(f"{t} {_mib(b)}" for t, b in r.dense_types.items()),
        f"  one expert     {' / '.join(_mib(b) for b in per)} per MoE layer (all projections)",
        f"  expert bank    {_mib(r.expert_bank_bytes)}; dense {_mib(r.dense_bytes)}; MTP {_mib(r.mtp_bytes)} (never read)",
        f"  per token      {_mib(r.bytes_per_token_cache_off)} read with the cache off",
        f"  RAM            {_mib(r.ram_bytes)} ({r.ram_how}): {r.verdict.upper()} - {r.verdict_why}",
        f"  auto budget    {_mib(r.auto_budget_bytes)} ({r.auto_budget_how})",
        f"  open           {r.open_mode}, reads {_mib(r.open_read_bytes)} ({r.open_reason})",
        f"  read rate      {f'{r.read_mib_s:,.0f} MiB/s' if r.read_mib_s else f'{READ_PRIOR_MIB_S:,.0f} MiB/s'} "
        f"({r.read_how})",
        f"  compute        {r.compute_gbs:g} GB/s ({r.compute_how})",
        f"  hit rate       {r.hit_how}",
    ]
    if not r.forecasts:
        lines.append("  forecast       none: the model cannot run with this RAM")
        return "\n".join(lines)
    lines.append(f"  forecast       {'cache':<12} {'budget':>13} {'hit%':>5} {'read/token':>13} {'read ms':>8} "
                 f"{'compute ms':>10}  {'tok/s':>6}")
    for f in r.forecasts:
        read_ms = f"{f.read_s * 1e3:8.1f}" if f.read_s is not None else "       -"
        tok = f"{f.tok_s:6.2f}" if f.tok_s is not None else "     -"
        lines.append(f"                 {f.label:<12} {mib_text(f.budget_bytes, grouped=True):>9} MiB {f.hit_pct_prior:5.1f} "
                     f"{f.read_bytes_per_token / MiB:9,.1f} MiB {read_ms} {f.compute_s * 1e3:10.1f}  {tok}")
    return "\n".join(lines)


def list_archs() -> str:
    """One line per supported architecture: what the recipe knows about it."""
    lines = []
    for arch in sorted(RECIPES):
        r = RECIPES[arch]
        fused = any("ffn_gate_up_exps" in layout for layout in r.layouts)
        split = any("ffn_gate_exps" in layout for layout in r.layouts)
        notes = ["fused or split gate/up" if fused and split else "fused gate/up" if fused else "split gate/up"]
        if r.recurrent:
            notes.append("hybrid recurrent")
        if any("ffn_gate_exps" not in layout and "ffn_gate_up_exps" not in layout for layout in r.layouts):
            notes.append("gate experts optional")
        if r.width_key != "expert_feed_forward_length":
            notes.append(f"experts sized by {r.width_key}")
        if r.mla:
            notes.append("latent attention (MLA)")
        if r.gating_required:
            notes.append("expert_gating_func required")
        lines.append(f"{arch:<14} " + ", ".join(notes))
    return "\n".join(lines)


__all__ = ["Report", "hit_prior", "inspect_model", "list_archs", "render"]

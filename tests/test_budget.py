"""Budget sizing at open: the memory model of everything else the process needs, a fixed budget
that cannot fit refused with the figure that would (or warned when forced), and the smaps reading
the model rests on."""

from __future__ import annotations

import re

import pytest

from bmoe.engine.config import RunConfig
from bmoe.engine.session import Session
from bmoe.errors import BudgetError
from bmoe.pipeline.budget import (
    INTERPRETER_GROWTH,
    Memory,
    MiB,
    Needs,
    SmapsTotals,
    guard_ceiling,
    margin_bytes,
    needs_from,
    parse_smaps,
    resolve_budget,
    transient_bytes,
)
from bmoe.synth.tiny import TinySpec

GiB = 1 << 30
NEEDS = Needs(dense=500 * MiB, buffers=300 * MiB, code=100 * MiB, transient=340 * MiB,
              interpreter=64 * MiB, margin=700 * MiB)  # 1664 MiB besides the cache, whose budget holds the union


def resolve(requested: int | None, available: int = 8 * GiB, **kw: object):  # noqa: ANN201
    args = {"ceiling": None, "mem_available": available, "needs": NEEDS, "expert_bank_bytes": 16 * GiB,
            "working_set_bytes": 800 * MiB} | kw
    return resolve_budget(requested, **args)  # type: ignore[arg-type]


def test_auto_gives_the_cache_what_every_other_need_leaves() -> None:
    b = resolve(None)
    assert b.bytes == b.fit_bytes == 8 * GiB - NEEDS.total
    for term in ("500 MiB dense", "300 MiB KV + compute", "100 MiB code", "340 MiB prefill union is held inside",
                 "64 MiB interpreter", "700 MiB margin"):
        assert term in b.how, f"{term!r} missing from {b.how!r}"
    assert resolve(None, expert_bank_bytes=1 * GiB).bytes == 1 * GiB, "never more than the bank"
    assert resolve(None, ceiling=2 * GiB).bytes == 2 * GiB
    assert resolve(None, available=NEEDS.total - 1).bytes == 0, "nothing spare: cache off, not negative"


def test_the_prefill_union_is_held_inside_the_budget_and_must_fit_there() -> None:
    """A layer's union is pinned while the cache evicts everything else for it: the experts take
    the larger of budget and union, so the union is not added to the budget, but it must fit."""
    assert NEEDS.total == 1664 * MiB
    assert resolve(None).bytes == 8 * GiB - 1664 * MiB, "not 340 MiB less for the union"
    assert resolve(None, available=NEEDS.total + 340 * MiB).bytes == 340 * MiB, "room for the union: the cache has it"
    assert resolve(None, available=NEEDS.total + 339 * MiB).bytes == 0, "the union alone does not fit: cache off"
    with pytest.raises(BudgetError, match="does not fit"):
        resolve(100 * MiB, available=NEEDS.total + 339 * MiB)


def test_a_fixed_budget_that_cannot_fit_is_refused_with_the_figure_that_would() -> None:
    fit = 8 * GiB - NEEDS.total
    assert resolve(fit).bytes == fit, "exactly what fits is accepted"
    with pytest.raises(BudgetError, match=rf"a {(fit + MiB) // MiB} MiB cache does not fit.*{fit // MiB} MiB would"):
        resolve(fit + MiB)
    forced = resolve(7 * GiB, force=True)
    assert forced.bytes == 7 * GiB and forced.warning is not None and "forced" in forced.warning
    assert resolve(0, available=0).bytes == 0, "cache off always fits"
    whole = resolve(20 * GiB, expert_bank_bytes=1 * GiB)  # fits: only the bank's worth is ever held
    assert whole.bytes == 1 * GiB and whole.how == "1024 MiB, the whole expert bank (20480 MiB asked)", \
        "a budget past the bank is the bank, and says so (it had reported 20480 MiB and the guard a shrink)"


def test_below_the_working_set_still_warns() -> None:
    b = resolve(100 * MiB)
    assert b.warning is not None and "working set" in b.warning


def test_needs_terms() -> None:
    smaps = SmapsTotals(untouched_anon=123 * MiB, code_file=45 * MiB)
    mapped = needs_from(smaps=smaps, dense_bytes=600 * MiB, dense_in_file=True, transient=7, mem_total=32 * GiB)
    assert (mapped.dense, mapped.buffers, mapped.code, mapped.transient) == (600 * MiB, 123 * MiB, 45 * MiB, 7)
    assert mapped.interpreter == INTERPRETER_GROWTH and mapped.margin == margin_bytes(32 * GiB) == 32 * GiB * 3 // 100
    filled = needs_from(smaps=smaps, dense_bytes=600 * MiB, dense_in_file=False, transient=7, mem_total=32 * GiB)
    assert filled.dense == 0, "dense weights the open filled into anonymous memory are paid already"
    assert margin_bytes(2 * GiB) == 256 * MiB
    assert transient_bytes(128, 8, 512, 3 * MiB) == 128 * 3 * MiB, "a long prompt pins a whole layer"
    assert transient_bytes(128, 8, 4, 3 * MiB) == 32 * 3 * MiB


SMAPS = """\
55d0-55d2 r-xp 00000000 fe:00 11 /usr/lib/libllama.so
Size:                  8 kB
Rss:                   8 kB
Anonymous:             0 kB
VmFlags: rd ex
55d2-55d3 rw-p 00002000 fe:00 11 /usr/lib/libllama.so
Size:                  4 kB
Rss:                   4 kB
Anonymous:             4 kB
7f0000000000-7f0000100000 rw-p 00000000 00:00 0
Size:               1024 kB
Rss:                 256 kB
Anonymous:           256 kB
7f40-7f41 ---p 00000000 00:00 0
Size:               2048 kB
Rss:                   0 kB
7f50-7f60 r--s 00000000 fe:00 99 /models/m.gguf
Size:              40960 kB
Rss:               20480 kB
Anonymous:             0 kB
7f70-7f71 rw-p 00000000 00:00 0                          [heap]
Size:                100 kB
Rss:                  60 kB
Anonymous:            60 kB
7f80-7f81 rw-p 00000000 00:00 0                          [stack]
Size:                132 kB
Rss:                  32 kB
"""


def test_smaps_totals() -> None:
    t = parse_smaps(SMAPS, ["/models/m.gguf"])
    assert t.untouched_anon == (1024 - 256 + 100 - 60) * 1024, "writable private anonymous, heap included"
    assert t.code_file == 8 * 1024, "file pages of code; copy-on-write pages are anonymous; the model aside"
    assert parse_smaps(SMAPS).code_file == (8 + 20480) * 1024
    assert parse_smaps("") == SmapsTotals(0, 0)
    experts = parse_smaps(SMAPS, ["/models/m.gguf"], exclude_ranges=[(0x7F0000080000, 0x7F0000180000)])
    assert experts.untouched_anon == (1024 - 256 - 512 + 100 - 60) * 1024, "expert bytes are no need (the part inside the mapping)"


def test_smaps_excludes_the_model_however_its_path_was_typed(tmp_path, monkeypatch) -> None:
    """smaps names files by their real path: a relative -m path or a link never matched, and the
    model's own mapped pages counted as code (the whole file under --open-mode mmap)."""
    model = tmp_path / "real" / "m.gguf"
    model.parent.mkdir()
    model.write_bytes(b"x")
    (tmp_path / "link.gguf").symlink_to(model)
    text = SMAPS.replace("/models/m.gguf", str(model.resolve()))
    monkeypatch.chdir(tmp_path)
    for typed in ("real/m.gguf", "link.gguf", str(tmp_path / "link.gguf"), str(model)):
        assert parse_smaps(text, [typed]).code_file == 8 * 1024, typed


@pytest.mark.parametrize("open_mode,in_file", [("user", False), ("reserved", False), ("mmap", True)])
def test_dense_bytes_count_as_file_pages_only_where_they_are(tiny, open_mode: str, in_file: bool) -> None:
    """The reserved open copies the dense part into anonymous memory as the user open does; it was
    counted again as file pages, taking its size off ``auto`` and off the guard's watermarks."""
    path = tiny.path(TinySpec())
    with Session.open(path, RunConfig(mode="stream", n_ctx=256, open_mode=open_mode, cache_bytes=None)) as s:
        how = s.budget_how
    dense = re.search(r"([\d.,]+) MiB dense in the file mapping", how or "")
    assert dense is not None and (float(dense.group(1).replace(",", "")) > 0) == in_file, how


def test_session_refuses_a_budget_that_cannot_fit_and_runs_it_forced(tiny, monkeypatch) -> None:
    import bmoe.engine.streaming as streaming

    path = tiny.path(TinySpec(n_embd=256, n_ff=256, n_layer=3))
    monkeypatch.setattr(streaming, "read_memory", lambda: Memory(16 * GiB, 600 * MiB, "MemAvailable"))
    cfg = RunConfig(mode="stream", n_ctx=256, cache_bytes=8 * MiB)
    with pytest.raises(BudgetError, match=r"a 8 MiB cache does not fit in memory: 0 MiB would"):
        Session.open(path, cfg)
    with Session.open(path, RunConfig(mode="stream", n_ctx=256, cache_bytes=8 * MiB, force_cache=True)) as s:
        assert s.budget_bytes == 8 * MiB and any("forced" in w for w in s.warnings)
    with Session.open(path, RunConfig(mode="stream", n_ctx=256, cache_bytes=None)) as s:
        assert s.budget_bytes == 0 and "= 0 MiB" in s.budget_how, "auto on a full machine: cache off"
    monkeypatch.setattr(streaming, "read_memory", lambda: Memory(16 * GiB, 8 * GiB, "MemAvailable"))
    with Session.open(path, cfg) as s:
        assert s.budget_bytes == 8 * MiB and "KV + compute buffers" not in s.budget_how
    with Session.open(path, RunConfig(mode="stream", n_ctx=256, cache_bytes=None)) as s:
        assert s.budget_bytes == s.layout.expert_bytes and "KV + compute buffers untouched" in s.budget_how


def test_auto_may_grow_into_the_room_of_buffers_not_touched_yet() -> None:
    """The guard's ceiling: auto's budget plus the untouched KV / compute room, never past the bank
    or a ceiling asked for; a fixed budget never grows."""
    budget = resolve(None).bytes
    top = guard_ceiling(budget, requested=None, needs=NEEDS, expert_bank_bytes=16 * GiB, ceiling=None)
    assert top == budget + NEEDS.buffers
    assert guard_ceiling(budget, requested=None, needs=NEEDS, expert_bank_bytes=budget + MiB, ceiling=None) \
        == budget + MiB
    assert guard_ceiling(budget, requested=None, needs=NEEDS, expert_bank_bytes=16 * GiB,
                         ceiling=budget + 10 * MiB) == budget + 10 * MiB
    assert guard_ceiling(4 * GiB, requested=4 * GiB, needs=NEEDS, expert_bank_bytes=16 * GiB, ceiling=None) == 4 * GiB


def test_a_live_auto_guard_grows_past_the_open_budget_and_a_fixed_one_does_not(tiny, monkeypatch) -> None:
    """A session's guard takes its ceiling from the memory model: auto's budget plus the untouched
    buffers' room; a fixed budget its own figure. The needs are pinned so the figures are exact."""
    import bmoe.engine.streaming as streaming

    path = tiny.path(TinySpec(n_embd=256, n_ff=256, n_layer=3))
    with Session.open(path, RunConfig(mode="stream", n_ctx=256, cache_bytes=None)) as s:
        bank = s.layout.expert_bytes
    needs = Needs(dense=0, buffers=4 * MiB, code=0, transient=MiB, interpreter=0, margin=0)
    monkeypatch.setattr(streaming, "measure_needs", lambda *a, **k: needs)
    monkeypatch.setattr(streaming, "read_memory",
                        lambda: Memory(16 * GiB, needs.buffers + bank // 2, "MemAvailable"))
    with Session.open(path, RunConfig(mode="stream", n_ctx=256, cache_bytes=None)) as s:
        assert s.budget_bytes == bank // 2
        assert s.pressure_guard.ceiling == bank // 2 + needs.buffers
    with Session.open(path, RunConfig(mode="stream", n_ctx=256, cache_bytes=bank // 2)) as fixed:
        assert fixed.budget_bytes == bank // 2 and fixed.pressure_guard.ceiling == bank // 2


def test_where_expert_major_can_run_the_budget_makes_room_for_one_tokens_experts_not_a_batch(tiny) -> None:
    """The memory model counted a whole batch's expert union beside the budget even where every
    layer can run expert-major (auto takes it exactly when the union would not fit): on a tight
    machine a small cache was refused, or auto chose none, though expert-major keeps within it."""
    path = tiny.path(TinySpec())

    def union_mib(prefill: str) -> float:
        with Session.open(path, RunConfig(mode="stream", n_ctx=256, cache_bytes=None, prefill=prefill)) as s:
            entry = max(s.layout.entry_bytes().values())
            k, n = s.layout.n_expert_used, s.layout.n_expert
            how = s.budget_how or ""
        found = re.search(r"the ([\d.]+) MiB prefill union", how)
        assert found is not None, how
        return float(found.group(1)), entry, k, n

    grouped, entry, k, n = union_mib("auto")
    batch, *_ = union_mib("batch")
    assert grouped == pytest.approx(k * entry / MiB, abs=0.06) and batch == pytest.approx(n * entry / MiB, abs=0.06)


# --- the memory figure: the host's, or the container's ---------------------------------------


def _meminfo(tmp_path, total_mib: int, avail_mib: int):  # noqa: ANN001, ANN202
    p = tmp_path / "meminfo"
    p.write_text(f"MemTotal: {total_mib * 1024} kB\nMemFree: 1 kB\nMemAvailable: {avail_mib * 1024} kB\n")
    return str(p)


@pytest.mark.pure
def test_auto_in_a_container_sizes_from_the_cgroup_limit_not_the_host(tmp_path) -> None:  # noqa: ANN001
    """Issue 39: under a 1,100 MiB cgroup limit on a 24 GiB host, auto planned 20,665 MiB."""
    from bmoe.pipeline.budget import read_memory
    from bmoe.pipeline.cgroup import CgroupMemory

    host = _meminfo(tmp_path, 24 * 1024, 20 * 1024)
    limited = CgroupMemory(limit=1100 * MiB, usage=200 * MiB, file_pages=100 * MiB, what="memory.max", oom_kills=0)
    mem = read_memory(host, cgroup=lambda: limited)
    assert (mem.total, mem.available) == (1100 * MiB, 1000 * MiB)
    assert "container" in mem.how and "memory.max 1100 MiB" in mem.how
    needs = Needs(dense=100 * MiB, buffers=50 * MiB, code=30 * MiB, transient=10 * MiB,
                  interpreter=INTERPRETER_GROWTH, margin=margin_bytes(mem.total))
    b = resolve_budget(None, ceiling=None, mem_available=mem.available, needs=needs, expert_bank_bytes=16 * GiB,
                       working_set_bytes=1, source=mem.how)
    assert b.bytes == 1000 * MiB - needs.total < 1100 * MiB
    assert "in the container" in b.how
    # Negative control: the host's figures alone, as before, plan tens of GiB.
    host_only = read_memory(host, cgroup=lambda: None)
    assert (host_only.total, host_only.available, host_only.how) == (24 * GiB, 20 * GiB, "MemAvailable")
    b = resolve_budget(None, ceiling=None, mem_available=host_only.available, needs=needs,
                       expert_bank_bytes=16 * GiB, working_set_bytes=1)
    assert b.bytes == 16 * GiB


@pytest.mark.pure
def test_a_roomy_container_leaves_the_host_figure(tmp_path) -> None:  # noqa: ANN001
    from bmoe.pipeline.budget import read_memory
    from bmoe.pipeline.cgroup import CgroupMemory

    roomy = CgroupMemory(limit=64 * GiB, usage=1 * GiB, file_pages=0, what="memory.max", oom_kills=None)
    mem = read_memory(_meminfo(tmp_path, 24 * 1024, 20 * 1024), cgroup=lambda: roomy)
    assert (mem.total, mem.available) == (24 * GiB, 20 * GiB) and mem.how.startswith("MemAvailable")


def test_a_session_in_a_container_sizes_auto_from_the_limit(tiny, monkeypatch) -> None:  # noqa: ANN001
    """The wiring: a session's ``auto`` budget and its guard's samples take the cgroup's room (a
    fake limit here: this machine's cgroup sets none) and ``budget_how`` says so."""
    import bmoe.pipeline.budget as budget_module
    import bmoe.pipeline.pressure as pressure_module
    from bmoe.pipeline.cgroup import CgroupMemory

    path = tiny.path(TinySpec(n_embd=256, n_ff=256, n_layer=3))
    with Session.open(path, RunConfig(mode="stream", n_ctx=256, cache_bytes=None)) as s:
        free = s.budget_bytes
        assert free == s.layout.expert_bytes and "container" not in s.budget_how  # negative control: the host
    room = CgroupMemory(limit=2 * GiB, usage=2 * GiB - 300 * MiB, file_pages=0, what="memory.max", oom_kills=0)
    monkeypatch.setattr(budget_module, "read_cgroup_memory", lambda: room)
    monkeypatch.setattr(pressure_module, "read_cgroup_memory", lambda: room)
    with Session.open(path, RunConfig(mode="stream", n_ctx=256, cache_bytes=None)) as s:
        assert "available in the container (memory.max 2048 MiB" in s.budget_how, s.budget_how
        assert s.budget_bytes == 0 < free  # 300 MiB less every need (a 256 MiB margin alone): no cache
        assert pressure_module.live_sample().mem_available == 300 * MiB

"""The reserved open: the experts in an uncommitted PROT_NONE reservation of bmoe's own buffer type,
so that a model bigger than RAM + swap opens reading only its dense bytes. Gated like every open
path: the resident tokens, with a negative control; open bytes <= 1.1x dense + 1 MiB; a data
limit that refuses the user open's one allocation admits the reserved open."""

from __future__ import annotations

import ctypes
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bmoe.llama import loader
from bmoe.engine.config import RunConfig
from bmoe.llama.loader import (
    UserPathUnsupported,
    choose_open_mode,
    open_model,
    reserved_commit_bytes,
    user_alloc_bytes,
)
from bmoe.llama.open_reserved import (
    check_buft_mirror,
    check_tensors_in_reservation,
    expert_pattern,
)
from bmoe.errors import ConfigError, SeamError
from bmoe.io.ggml import GgmlTensor
from bmoe.io.layout import read_layout
from bmoe.io.pagecache import evict_file_cache, read_io_bytes
from bmoe.io.regions import resident_bytes_of
from bmoe.pipeline.hooks import Hooks
from bmoe.synth.tiny import TinySpec, write_tiny
from tests.helpers import generate_tokens

GIB = 1 << 30
MIB = 1 << 20
CASES = [("qwen3moe", "f32"), ("qwen2moe", "q8_0"), ("gemma4", "f16"), ("qwen3moe", "q8_0")]
# Most of the file is experts: 4 layers x 3 x 32 experts x 256 x 256 f16 = 48 MiB of 50 MiB.
BIG_EXPERTS = TinySpec(arch="qwen3moe", wtype="f16", n_layer=4, n_embd=256, n_expert=32, n_ff=256)


def stream(open_mode: str, cache_bytes: int = 2 * MIB) -> RunConfig:
    return RunConfig(mode="stream", n_ctx=256, open_mode=open_mode, cache_bytes=cache_bytes)


@pytest.mark.parametrize("arch,wtype", CASES)
def test_reserved_open_streams_the_resident_tokens(tiny, arch: str, wtype: str) -> None:
    path = tiny.path(TinySpec(arch=arch, wtype=wtype))
    resident = tiny.resident_tokens(path)
    assert len(set(resident)) > 2, "degenerate fixture: the comparison would prove little"
    # A cache that evicts every token (test_gates_open holds the other open paths to the same
    # resident tokens); the first case also with no cache at all.
    assert generate_tokens(path, stream("reserved")) == resident
    if (arch, wtype) == CASES[0]:
        assert generate_tokens(path, stream("reserved", 0)) == resident


def test_reserved_open_negative_control(tiny) -> None:
    """The same gate catches one routed expert left unread in the reserved open."""
    path = tiny.path(TinySpec(arch="qwen3moe", wtype="f32"))
    skip = {"expert": -1}

    def on_plan(event, plan) -> None:  # noqa: ANN001
        if event.layer == 0 and skip["expert"] == -1 and plan.misses:
            skip["expert"] = plan.misses[0]

    def before_read(request) -> bool:  # noqa: ANN001
        return not (request.key.layer == 0 and request.key.expert == skip["expert"])

    got = generate_tokens(path, stream("reserved", 0), Hooks(before_read=before_read, on_plan=on_plan))
    assert skip["expert"] != -1
    assert got != tiny.resident_tokens(path)


def test_reserved_poisoned_regions_still_identical(tiny) -> None:
    """Every region byte that is not a routed expert's is NaN: only routed slices matter."""
    path = tiny.path(TinySpec(arch="qwen2moe", wtype="q8_0"))

    def poison(_layer: int, spans: list[tuple[int, int]]) -> None:
        for base, nbytes in spans:
            ctypes.memset(base, 0xFF, nbytes)

    got = generate_tokens(path, stream("reserved", 0), Hooks(before_layer_reads=poison))
    assert got == tiny.resident_tokens(path)


def test_experts_live_in_the_reservation(tmp_path: Path) -> None:
    layout = read_layout(write_tiny(tmp_path / "t.gguf", TinySpec(arch="gemma4", wtype="q8_0"))[0])
    opened = open_model(layout, streaming=True, mode="reserved")
    try:
        assert opened.open_mode == "reserved"
        assert check_tensors_in_reservation(opened, layout) == []
        # The dense tensors are filled in llama.cpp's own buffer, outside the reservation.
        dense = [n for n in layout.tensors if n not in {et.span.name for et in layout.experts.values()}]
        assert all(opened.tensors[n] for n in dense)
        # Nothing of the reservation is in RAM: it is PROT_NONE and never touched.
        for et in layout.experts.values():
            data = GgmlTensor.from_address(opened.tensors[et.span.name]).data
            assert resident_bytes_of(data, et.span.nbytes) == 0
        assert set(opened.expert_tensors(layout)) == set(layout.experts)
    finally:
        opened.free()
        opened.free()  # idempotent


@pytest.mark.pure
def test_expert_pattern_matches_only_expert_weights(tmp_path: Path) -> None:
    layout = read_layout(write_tiny(tmp_path / "t.gguf", TinySpec(arch="qwen2moe"))[0])
    pattern = re.compile(expert_pattern(layout))
    experts = {et.span.name for et in layout.experts.values()}
    assert experts and all(pattern.search(n) for n in experts)
    others = [n for n in layout.tensors if n not in experts] + ["blk.0.ffn_down_exps.scale"]
    assert not any(pattern.search(n) for n in others)


def test_buft_mirror_checks_against_libggml() -> None:
    cpu = check_buft_mirror()
    assert cpu.iface.alloc_buffer and cpu.iface.get_alignment


def test_reserved_open_is_for_streaming_only(tmp_path: Path) -> None:
    layout = read_layout(write_tiny(tmp_path / "t.gguf", TinySpec())[0])
    with pytest.raises(SeamError, match="streamed runs only"):
        open_model(layout, streaming=False, mode="reserved")
    with pytest.raises(ConfigError):
        RunConfig(open_mode="lazy")
    assert RunConfig(open_mode="reserved").open_mode == "reserved"


def test_reserved_refuses_what_user_cannot_fill(tmp_path: Path) -> None:
    """gemma4 with separate gate/up experts cannot be built faithfully by either user open."""
    layout = read_layout(write_tiny(tmp_path / "t.gguf", TinySpec(arch="gemma4", fuse_gate_up=False))[0])
    with pytest.raises(UserPathUnsupported, match="ffn_gate_up_exps"):
        open_model(layout, streaming=True, mode="reserved")


_DATA_LIMIT_CHILD = """
import json, resource, sys
from bmoe.llama.loader import UserPathUnsupported, open_model, reserved_commit_bytes, user_alloc_bytes
from bmoe.errors import SeamError
from bmoe.io.layout import read_layout

MIB = 1 << 20
layout = read_layout(sys.argv[1])
open_model(layout, streaming=True, mode="user").free()  # first use: libllama's own allocations
headroom = 24 * MIB
assert reserved_commit_bytes(layout) + 4 * MIB < headroom < user_alloc_bytes(layout)
with open("/proc/self/status") as f:
    vm_data = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmData:"))
resource.setrlimit(resource.RLIMIT_DATA, (vm_data + headroom, resource.getrlimit(resource.RLIMIT_DATA)[1]))
results = {}
for mode in ("user", "reserved"):
    try:
        opened = open_model(layout, streaming=True, mode=mode)
    except UserPathUnsupported as e:
        results[mode] = "refused: " + str(e)
    except SeamError as e:
        results[mode] = "error: " + str(e)
    else:
        results[mode] = opened.open_mode
        opened.free()
print(json.dumps(results))
"""


def test_data_limit_refuses_user_admits_reserved(tmp_path: Path) -> None:
    """RLIMIT_DATA counts private writable memory, as the overcommit heuristic counts one
    allocation against RAM + swap: a limit below the model but above its dense bytes refuses the
    user open's one allocation and admits the reserved open (whose reservation is PROT_NONE).

    In a fresh process: in a long-lived one the allocator may serve the user open from memory it
    already holds (counted in VmData before the limit was set), and the limit then never bites."""
    path = write_tiny(tmp_path / "t.gguf", BIG_EXPERTS)[0]
    proc = subprocess.run(
        [sys.executable, "-c", _DATA_LIMIT_CHILD, str(path)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert results["user"].startswith("refused: "), results
    assert results["reserved"] == "reserved", results


def test_reserved_open_reads_only_the_dense_bytes(tmp_path: Path) -> None:
    layout = read_layout(write_tiny(tmp_path / "t.gguf", BIG_EXPERTS)[0])
    assert layout.expert_bytes >= 0.9 * layout.file_bytes
    if read_io_bytes() is None:
        pytest.skip("/proc/self/io is unreadable here")
    open_model(layout, streaming=True, mode="reserved").free()  # first use pages in libllama's code
    evict_file_cache(layout.shards)
    opened = open_model(layout, streaming=True, mode="reserved")
    try:
        got = opened.open_bytes_read
    finally:
        opened.free()
    evict_file_cache(layout.shards)
    plain = open_model(layout, streaming=True, mode="mmap")
    try:
        control = plain.open_bytes_read
    finally:
        plain.free()
    if not control:
        pytest.skip(f"/proc/self/io read_bytes did not move across a plain open ({control}): unmeasurable here")
    assert control >= 0.9 * layout.file_bytes, "the control: a plain load reads the whole file"
    assert got is not None and got <= 1.1 * layout.dense_bytes + MIB, (got, layout.dense_bytes)


def fake_memory(mem_total: int, commit_limit: int = 0, committed: int = 0):  # noqa: ANN201
    return lambda: {"MemTotal": mem_total, "SwapTotal": 0, "CommitLimit": commit_limit, "Committed_AS": committed}


def test_auto_chooses_reserved_where_user_would_be_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    layout = read_layout(write_tiny(tmp_path / "t.gguf", BIG_EXPERTS)[0])
    need, dense = user_alloc_bytes(layout), reserved_commit_bytes(layout)
    assert dense < 0.1 * need
    margin = loader._MARGIN_MIN
    assert choose_open_mode(layout, True, meminfo=fake_memory(16 * GIB), overcommit=lambda: 0)[0] == "user"
    # One byte short for the user allocation and its margin; plenty for the dense bytes.
    mode, reason = choose_open_mode(layout, True, meminfo=fake_memory(need + margin - 1), overcommit=lambda: 0)
    assert mode == "reserved" and "would be refused" in reason and "\n" not in reason
    # Not even the dense bytes fit: the plain load, whose pages are clean page cache.
    assert choose_open_mode(layout, True, meminfo=fake_memory(dense + margin - 1), overcommit=lambda: 0)[0] == "mmap-drop"
    # Strict overcommit: what is left of the commit limit decides the same way.
    strict = fake_memory(64 * GIB, commit_limit=8 * GIB, committed=8 * GIB - need - margin + 1)
    assert choose_open_mode(layout, True, meminfo=strict, overcommit=lambda: 2)[0] == "reserved"

    monkeypatch.setattr(loader, "read_overcommit", lambda: 0)
    monkeypatch.setattr(loader, "read_meminfo", fake_memory(need + margin - 1))
    opened = open_model(layout, streaming=True)
    try:
        assert opened.open_mode == "reserved" and opened.tensors
    finally:
        opened.free()


def test_auto_falls_back_when_the_mirror_disagrees(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from bmoe.llama import open_reserved
    from bmoe.errors import SeamMismatchError

    layout = read_layout(write_tiny(tmp_path / "t.gguf", TinySpec())[0])

    def refuse():  # noqa: ANN202
        raise SeamMismatchError("mirror disagrees (test)")

    monkeypatch.setattr(open_reserved, "check_buft_mirror", refuse)
    with pytest.raises(SeamMismatchError):
        open_model(layout, streaming=True, mode="reserved")
    monkeypatch.setattr(loader, "choose_open_mode", lambda *a, **k: ("reserved", "test"))
    opened = open_model(layout, streaming=True)
    try:
        assert opened.open_mode == "mmap-drop" and "mirror disagrees" in opened.open_reason
    finally:
        opened.free()

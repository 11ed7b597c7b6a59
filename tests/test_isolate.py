"""The first open of a new file runs in a child process, for real: a child that aborts inside
llama.cpp, a child that never finishes, and the memo that makes a good file pay the check once."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGUFReader

from bmoe.llama import isolate
from bmoe.errors import ModelFileError
from bmoe.io.layout import read_layout
from bmoe.io.validate import open_layout
from bmoe.synth.tiny import TinySpec


@pytest.fixture(autouse=True)
def isolation_on(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(isolate.ENV_SWITCH, "1")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def _edited(src: Path, dst: Path, key: str, value: float) -> Path:
    if src != dst:
        shutil.copy(src, dst)
    reader = GGUFReader(dst, "r+")
    field = reader.fields[key]
    field.parts[field.data[0]][0] = value
    del reader
    return dst


def test_a_good_file_is_checked_once_and_again_when_it_changes(tiny, tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    shutil.copy(tiny.path(TinySpec()), path)
    layout = read_layout(path)
    memo = tmp_path / "memo.txt"
    assert isolate.check_first_open(layout, memo=memo) is True  # a child ran and passed
    assert isolate.check_first_open(layout, memo=memo) is False  # remembered
    assert memo.read_text().count("\n") == 1
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert isolate.check_first_open(layout, memo=memo) is False  # touched only: the same header
    _edited(path, path, "qwen3moe.context_length", 1024)
    assert isolate.check_first_open(read_layout(path), memo=memo) is True  # new header: new check


def test_a_file_rewritten_in_place_with_its_mtime_set_back_is_checked_again(tiny, tmp_path: Path) -> None:
    """The memo was keyed on device, inode, size and mtime: a value llama.cpp aborts on, written
    into a file that had passed (same size, same inode) with its mtime restored, kept the old
    verdict, and the user's process loaded it and died of SIGABRT. The key is the header's digest."""
    path = tmp_path / "m.gguf"
    shutil.copy(tiny.path(TinySpec()), path)
    memo = tmp_path / "memo.txt"
    assert isolate.check_first_open(read_layout(path), memo=memo) is True
    before = path.stat()
    reader = GGUFReader(path, "r+")
    field = reader.fields["qwen3moe.attention.layer_norm_rms_epsilon"]
    field.parts[field.data[0]][0] = float("nan")  # in place: same bytes count, same inode
    del reader
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = path.stat()
    assert (after.st_dev, after.st_ino, after.st_size, after.st_mtime_ns) == (
        before.st_dev, before.st_ino, before.st_size, before.st_mtime_ns)  # what the old key saw: no change
    with pytest.raises(ModelFileError, match=r"SIGABRT.*eps >= 0\.0f"):  # the child ran again, and died
        isolate.check_first_open(read_layout(path), memo=memo)
    assert memo.read_text().count("\n") == 1  # the failed bytes are not remembered


def test_the_memo_key_follows_the_header_not_the_path(tiny, tmp_path: Path) -> None:
    """A copy of a checked file is the same header: no second check. A tensor's data changed is
    not llama.cpp's business at load: the same key too. Negative control: a header byte changed."""
    src = tiny.path(TinySpec())
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    shutil.copy(src, a)
    shutil.copy(src, b)
    layout = read_layout(a)
    span = next(iter(layout.tensors.values()))
    with b.open("r+b") as f:
        f.seek(span.offset)
        f.write(b"\x01\x02\x03\x04")
    assert isolate.file_key(read_layout(a)) == isolate.file_key(read_layout(b))
    _edited(src, b, "qwen3moe.context_length", 1024)
    assert isolate.file_key(read_layout(a)) != isolate.file_key(read_layout(b))


def test_a_child_that_aborts_becomes_one_error_with_the_assertion(tiny, tmp_path: Path) -> None:
    """Python's checks are bypassed (read_layout) so that llama.cpp really aborts in the child."""
    bad = _edited(tiny.path(TinySpec()), tmp_path / "nan.gguf", "qwen3moe.attention.layer_norm_rms_epsilon", float("nan"))
    memo = tmp_path / "memo.txt"
    with pytest.raises(ModelFileError, match=r"SIGABRT.*GGML_ASSERT\(eps >= 0\.0f\) failed"):
        isolate.check_first_open(read_layout(bad), memo=memo)
    assert not memo.exists()  # a failed file is not remembered


def test_a_child_that_never_finishes_is_killed_at_the_limit(tiny, tmp_path: Path) -> None:
    """gemma4 with a rope over 0 dimensions decodes forever (hparams refuses it; bypassed here)."""
    bad = _edited(tiny.path(TinySpec(arch="gemma4")), tmp_path / "spin.gguf", "gemma4.rope.dimension_count", 0)
    with pytest.raises(ModelFileError, match="did not finish"):
        isolate.check_first_open(read_layout(bad), timeout_s=5, memo=tmp_path / "memo.txt")


def test_cli_run_on_a_file_that_passes_validation_but_aborts_is_one_line(tiny, tmp_path: Path) -> None:
    """qwen2moe with a shared-expert width of 0 and no feed_forward_length: llama.cpp sizes a tensor
    0 and asserts. Whatever catches it (a Python check or the child), the user sees one line."""
    bad = _edited(tiny.path(TinySpec(arch="qwen2moe")), tmp_path / "shexp0.gguf",
                  "qwen2moe.expert_shared_feed_forward_length", 0)
    for extra in ((), ("--resident",)):
        proc = subprocess.run(
            [sys.executable, "-m", "bmoe.cli", "run", "-m", str(bad), "-p", "hi", "-n", "2", "-c", "256", *extra],
            capture_output=True, text=True, timeout=60, env=os.environ.copy(),
        )
        assert proc.returncode == 1, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("bmoe: error: "), proc.stderr
    try:
        open_layout(bad)
    except ModelFileError:
        return  # validation learnt this case; the child is then not needed for it
    assert "SIGABRT" in lines[0] and "GGML_ASSERT" in lines[0], lines[0]


def test_cli_run_on_a_good_file_remembers_it(tiny, tmp_path: Path) -> None:
    path = tiny.path(TinySpec())
    for _ in range(2):
        proc = subprocess.run(
            [sys.executable, "-m", "bmoe.cli", "run", "-m", str(path), "-p", "hi", "-n", "2", "-c", "256", "--json"],
            capture_output=True, text=True, timeout=60, env=os.environ.copy(),
        )
        assert proc.returncode == 0, proc.stderr
    memo = Path(os.environ["XDG_CACHE_HOME"]) / "bmoe" / isolate.MEMO_NAME
    assert memo.read_text().count("\n") == 1


def test_isolation_can_be_turned_off(tiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(isolate.ENV_SWITCH, "0")
    assert isolate.check_first_open(read_layout(tiny.path(TinySpec())), memo=tmp_path / "memo.txt") is False
    assert not (tmp_path / "memo.txt").exists()


_RESERVED_CHILD = r"""
import sys
from bmoe.llama import isolate, loader
from bmoe.io.layout import read_layout

layout = read_layout(sys.argv[1])
short = loader.user_alloc_bytes(layout) + loader._MARGIN_MIN - 1  # one byte short for the user open
loader.read_overcommit = lambda: 0
loader.read_meminfo = lambda: {"MemTotal": short, "SwapTotal": 0, "CommitLimit": 0, "Committed_AS": 0}
opened_with = loader.open_model
def spy(*args, **kwargs):
    opened = opened_with(*args, **kwargs)
    print("open mode", opened.open_mode, flush=True)
    return opened
loader.open_model = spy
sys.exit(isolate._child(sys.argv[1]))
"""


def test_the_test_open_of_a_model_past_ram_decodes_on_zeros_not_the_reservation(tmp_path: Path) -> None:
    """A model past RAM + swap opens ``reserved``: its experts sit in a PROT_NONE reservation until
    a session binds its regions. The first-open check decoded on that reservation and died of
    SIGSEGV, so every such model was refused as a file llama.cpp kills; the child now reads zeros."""
    from bmoe.synth.tiny import write_tiny

    spec = TinySpec(arch="qwen3moe", wtype="f16", n_layer=4, n_embd=256, n_expert=32, n_ff=256)
    path = write_tiny(tmp_path / "t.gguf", spec)[0]
    env = os.environ | {isolate.ENV_SWITCH: "0", "GGML_NO_BACKTRACE": "1"}
    proc = subprocess.run([sys.executable, "-c", _RESERVED_CHILD, str(path)], capture_output=True, text=True,
                          timeout=300, env=env)
    assert "open mode reserved" in proc.stdout, (proc.stdout, proc.stderr[-2000:])
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])


def test_the_checks_reads_are_not_counted_as_the_opens(tiny, monkeypatch) -> None:  # noqa: ANN001
    """A reaped child's reads are added to the parent's /proc/self/io: the check's load of the dense
    part doubled the first open's ``open_bytes_read``. Simulated: the check 'reads' a GiB."""
    from bmoe.engine import session as session_module
    from bmoe.engine.config import RunConfig
    from bmoe.synth.tiny import TinySpec

    counter = [0]
    monkeypatch.setattr(session_module, "read_io_bytes", lambda: counter[0])

    def check(_layout) -> None:  # noqa: ANN001
        counter[0] += 1 << 30

    monkeypatch.setattr(session_module, "check_first_open", check)
    with session_module.Session.open(tiny.path(TinySpec()), RunConfig(n_ctx=256)) as s:
        assert s.open_bytes_read == 0, "only the check 'read': nothing of this open's own"


def test_a_size_that_multiplies_into_a_runaway_allocation_is_one_line_at_the_childs_cap(tiny, tmp_path: Path) -> None:
    """qwen35moe's ssm.inner_size = 0xffffffff sizes a 16 GiB recurrent state: uncapped, the child
    grew past 10 GB. Under its memory cap the allocation is refused and the verdict says so. The
    same file with its own inner size passes under the same cap (the cap refuses the value, not
    the model). Python's checks are bypassed (read_layout) so that the child meets the value."""
    good = tiny.path(TinySpec(arch="qwen35moe"))
    memo = tmp_path / "memo.txt"
    assert isolate.check_first_open(read_layout(good), memo=memo) is True
    bad = _edited(good, tmp_path / "inner.gguf", "qwen35moe.ssm.inner_size", 0xFFFFFFFF)
    with pytest.raises(ModelFileError, match=r"first open needed more than \d+ MiB.*failed to allocate") as e:
        isolate.check_first_open(read_layout(bad), memo=memo)
    assert "\n" not in str(e.value) and "SIGKILL" not in str(e.value)


def _killed_child(monkeypatch: pytest.MonkeyPatch, oom_counts: list[int | None]) -> None:
    """A child that dies of SIGKILL, as the OOM killer ends one, and the cgroup's oom_kill count
    the parent reads before and after it."""
    from bmoe.pipeline.cgroup import CgroupMemory

    killer = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    monkeypatch.setattr(isolate, "_child_command", lambda path: [sys.executable, "-c", killer])
    counts = iter(oom_counts + [oom_counts[-1]] * 4)
    monkeypatch.setattr(isolate, "read_cgroup_memory", lambda: CgroupMemory(
        limit=512 << 20, usage=500 << 20, file_pages=0, what="memory.max", oom_kills=next(counts)))


def test_a_child_the_containers_oom_killer_ends_is_blamed_on_the_limit_not_the_file(
        tiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from bmoe.errors import BudgetError

    layout = read_layout(tiny.path(TinySpec()))
    _killed_child(monkeypatch, [3, 4])
    with pytest.raises(BudgetError, match=r"killed by the container's memory limit \(512 MiB, memory\.max\)") as e:
        isolate.check_first_open(layout, memo=tmp_path / "memo.txt")
    assert "llama.cpp kills" not in str(e.value)
    # Negative control: no OOM kill counted in the cgroup meanwhile: a SIGKILL still not blamed on
    # the file, nor on the container.
    _killed_child(monkeypatch, [4, 4])
    with pytest.raises(BudgetError, match=r"killed \(SIGKILL, which llama.cpp never sends") as e:
        isolate.check_first_open(layout, memo=tmp_path / "memo.txt")
    assert "container" not in str(e.value)
    assert not (tmp_path / "memo.txt").exists()


@pytest.mark.pure
def test_the_verdict_of_a_child_that_ran_out_at_its_cap_or_aborted_or_was_killed() -> None:
    """``verdict`` alone, on what a child could print: an allocation refused at its cap (a C++
    bad_alloc ends in SIGABRT) names the cap, not llama.cpp killing the process; a GGML_ASSERT with
    the cap line present still quotes the assertion (negative control); a SIGKILL outside a
    container blames neither the file nor a container."""
    from types import SimpleNamespace

    from bmoe.errors import BudgetError

    layout = SimpleNamespace(shards=(Path("m.gguf"),), dense_bytes=300 << 20)
    cap = f"bmoe: memory cap {1200 << 20}\n"
    e = isolate.verdict(layout, -6, cap + "terminate called after throwing an instance of 'std::bad_alloc'\n",
                        None, None)
    assert isinstance(e, ModelFileError) and "first open needed more than 1200 MiB" in str(e)
    e = isolate.verdict(layout, -6, cap + "/src/ops.cpp:4132: GGML_ASSERT(eps >= 0.0f) failed\n", None, None)
    assert "llama.cpp kills the process" in str(e) and "ops.cpp:4132: GGML_ASSERT(eps >= 0.0f) failed" in str(e)
    e = isolate.verdict(layout, 1, cap + "bmoe: error: a context (failed to allocate buffer for rs cache)\n", 0, 0)
    assert "needed more than 1200 MiB" in str(e) and "rs cache" in str(e)
    e = isolate.verdict(layout, -9, cap, None, None)
    assert isinstance(e, BudgetError) and "SIGKILL" in str(e) and "container" not in str(e)

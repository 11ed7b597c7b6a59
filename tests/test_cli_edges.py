"""The CLI audit's small cases: a Ctrl-C while the command line is still importing, demo --dir on a
file and an interrupted demo, a route trace that cannot be written, -q with -v, and empty prompts.
Each is one line on stderr (status 2 for a bad command line, 1 for a failure, 130 for an
interrupt), never a traceback, and nothing is left half-written. Nothing here depends on timing:
interrupts are raised where the test puts them."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from bmoe.synth.tiny import TinySpec
from tests.helpers import CLI_TIMEOUT_S as GUARD_S
from tests.helpers import bmoe, cli, one_line


# --- a Ctrl-C at any point ------------------------------------------------------------------------

# A Ctrl-C that lands while the command line's modules load: an import hook raises it where the
# signal would, deterministically, then the entry point runs the way the bmoe script, python -m bmoe
# and python -m bmoe.cli run it.
_INTERRUPT_IMPORT = textwrap.dedent("""
    import importlib.abc, runpy, sys

    class CtrlC(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == {module!r}:
                raise KeyboardInterrupt
            return None

    sys.meta_path.insert(0, CtrlC())
    sys.argv = ["bmoe", "run", "-m", "missing.gguf", "-p", "hi"]
    {entry}
""")
ENTRIES = {
    "script": "from bmoe.cli import main; sys.exit(main())",  # what pip's bmoe script does
    "python -m bmoe": "runpy.run_module('bmoe', run_name='__main__', alter_sys=True)",
    "python -m bmoe.cli": "runpy.run_module('bmoe.cli', run_name='__main__', alter_sys=True)",
}


@pytest.mark.pure
@pytest.mark.parametrize("module", ["bmoe.cli.app", "bmoe.cli.run", "bmoe.engine.config"])
@pytest.mark.parametrize("entry", sorted(ENTRIES))
def test_a_ctrl_c_while_the_cli_imports_is_status_130_without_a_traceback(entry: str, module: str) -> None:
    code = _INTERRUPT_IMPORT.format(module=module, entry=ENTRIES[entry])
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=GUARD_S)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert (proc.returncode, proc.stderr) == (130, "bmoe: interrupted\n")


@pytest.mark.pure
def test_a_ctrl_c_from_the_parser_or_the_command_is_status_130(monkeypatch, capsys) -> None:
    from bmoe.cli import app, main, run

    def ctrl_c(*_: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(run, "_cmd_run", ctrl_c)  # the dispatch
    assert main(["run", "-m", "missing.gguf", "-p", "hi"]) == 130
    monkeypatch.setattr(app, "build_parser", ctrl_c)  # the parser (and the lazy imports it makes)
    assert main(["run", "-m", "missing.gguf", "-p", "hi"]) == 130
    assert capsys.readouterr().err == "bmoe: interrupted\n" * 2


@pytest.mark.pure
def test_build_parser_is_still_importable_from_bmoe_cli() -> None:
    from bmoe.cli import _LAZY, build_parser

    assert "bench" in _LAZY and callable(build_parser)


# --- -q with -v ----------------------------------------------------------------------------------

@pytest.mark.pure
@pytest.mark.parametrize("flags", [("-q", "run", "-v"), ("-v", "run", "-q"), ("--quiet", "run", "--verbose")])
def test_quiet_and_verbose_together_are_refused(flags: tuple[str, str, str]) -> None:
    top, command, sub = flags
    line = one_line(cli(top, command, sub, "-m", "m.gguf", "-p", "hi", "-n", "2"), 2)
    assert "-q/--quiet" in line and "-v/--verbose" in line


# --- demo ----------------------------------------------------------------------------------------

@pytest.mark.pure
def test_demo_dir_that_is_a_file_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("not a folder")
    line = one_line(cli("demo", "--dir", str(tmp_path / "afile")), 1)
    assert f"--dir {tmp_path / 'afile'} is a file, not a folder" in line
    assert "--dir" in one_line(cli("demo", "--dir", str(tmp_path / "afile" / "sub")), 1)
    assert (tmp_path / "afile").read_text() == "not a folder"


@pytest.mark.pure
@pytest.mark.parametrize("stop", [KeyboardInterrupt, OSError(28, "No space left on device")])
def test_an_interrupted_or_failed_demo_leaves_no_partial_model(tmp_path: Path, monkeypatch, capsys,
                                                                 stop: BaseException) -> None:
    import bmoe.synth.tiny
    from bmoe.cli import main

    def half_written(path: Path, spec: object, progress: object = None) -> list[Path]:
        Path(path).write_bytes(b"GGUF" + bytes(1000))  # the first bytes are out when the stop comes
        raise stop

    monkeypatch.setattr(bmoe.synth.tiny, "write_tiny", half_written)
    status = main(["demo", "--dir", str(tmp_path), "-n", "2"])
    assert status == (130 if stop is KeyboardInterrupt else 1)
    assert list(tmp_path.iterdir()) == [], "a half-written demo model was left behind"
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.pure
@pytest.mark.parametrize("shards", [1, 3])
def test_an_interrupted_make_tiny_leaves_no_half_written_file(tmp_path: Path, monkeypatch, capsys, shards: int) -> None:
    import bmoe.synth.tiny
    from bmoe.cli import main

    def half_written(path: Path, spec: object, progress: object = None) -> list[Path]:
        for file in bmoe.synth.tiny.tiny_files(Path(path), shards)[:2]:
            file.write_bytes(b"GGUF" + bytes(1000))
        raise KeyboardInterrupt

    monkeypatch.setattr(bmoe.synth.tiny, "write_tiny", half_written)
    (tmp_path / "keep.gguf").write_bytes(b"someone else's")
    assert main(["make-tiny", str(tmp_path / "t.gguf"), "--shards", str(shards)]) == 130
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.gguf"], "a half-written model was left behind"
    assert "Traceback" not in capsys.readouterr().err


# --- a route trace that cannot be written --------------------------------------------------------

def test_a_route_trace_on_a_full_disk_is_one_line_naming_it(tiny, full_device: str) -> None:
    proc = bmoe("run", "-m", str(tiny.path(TinySpec())), "-p", "hi", "-n", "3", "-c", "256",
                "--route-trace", full_device)
    assert one_line(proc, 1) == f"bmoe: error: cannot write the route trace {full_device}: No space left on device"
    assert proc.stdout == "", "the header is written at open: the run stops before its first token"


def test_a_route_trace_that_fills_up_mid_run_names_it_and_the_session_still_closes(tiny, tmp_path: Path) -> None:
    """A file size limit (RLIMIT_FSIZE; Python ignores SIGXFSZ, so a write past it is EFBIG) stands
    for a disk that fills up during the run: by bytes, not by time."""
    import resource

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (1500, 1500))  # the header fits, 20 tokens' rows do not

    trace, profile = tmp_path / "route.csv", tmp_path / "profile.json"
    proc = subprocess.run([sys.executable, "-m", "bmoe.cli", "run", "-m", str(tiny.path(TinySpec())), "-p", "hi",
                           "-n", "20", "-c", "256", "--cache-mb", "4", "--cache-profile", str(profile),
                           "--route-trace", str(trace)], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=GUARD_S, preexec_fn=limit)
    assert one_line(proc, 1) == f"bmoe: error: cannot write the route trace {trace}: File too large"
    assert trace.read_text().startswith("# route_trace v2\n")
    assert profile.exists(), "the session's teardown stopped at the trace: the cache profile was not saved"


# --- empty prompts -------------------------------------------------------------------------------

@pytest.mark.pure
@pytest.mark.parametrize("how", ["-p ''", "-f empty", "-p - (empty stdin)"])
def test_run_refuses_an_empty_prompt(tmp_path: Path, how: str) -> None:
    (tmp_path / "empty.txt").write_bytes(b"")
    given = {"-p ''": ["-p", ""], "-f empty": ["-f", str(tmp_path / "empty.txt")], "-p - (empty stdin)": ["-p", "-"]}
    argv = ("run", "-m", str(tmp_path / "m.gguf"), *given[how], "-n", "2", "-c", "256")
    # Standard input is the child's own (empty) one; the others need no process of their own.
    line = one_line(bmoe(*argv) if how.endswith("stdin)") else cli(*argv), 2)
    assert line.startswith("bmoe: error: the prompt is empty"), line


def test_bench_refuses_an_empty_prompt_as_run_does(tiny, tmp_path: Path) -> None:
    line = one_line(bmoe("bench", str(tiny.path(TinySpec())), "--prompt", "", "--out", str(tmp_path / "out")), 2)
    assert "the prompt is empty" in line
    assert not (tmp_path / "out").exists()


def test_chat_skips_empty_lines_silently(tiny) -> None:
    proc = bmoe("chat", "-m", str(tiny.path(TinySpec())), "-n", "2", "-c", "256", "-q", stdin="\n   \n\t\n\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "", "an empty line was sent to the model"
    assert "error" not in proc.stderr and "tok/s" not in proc.stderr, proc.stderr


@pytest.mark.pure
def test_out_of_memory_is_said_as_such(capsys) -> None:  # noqa: ANN001
    """Under ``ulimit -v`` the index's mapping was refused with ENOMEM and said "writing the output:
    Cannot allocate memory"; a read lane that could not start was an internal error."""
    import errno

    from bmoe.cli.app import _fail

    assert _fail(OSError(errno.ENOMEM, "Cannot allocate memory")) == 1
    assert capsys.readouterr().err.startswith("bmoe: error: out of memory: Cannot allocate memory")
    assert _fail(RuntimeError("can't start new thread")) == 1
    assert capsys.readouterr().err.startswith("bmoe: error: out of memory or threads")
    assert _fail(OSError(errno.ENOSPC, "No space left on device")) == 1
    assert capsys.readouterr().err.startswith("bmoe: error: writing the output: No space left on device")


@pytest.mark.pure
def test_a_groups_cause_is_shown_not_the_reads_it_cancelled() -> None:
    """A read lane that could not start cancelled the reads waiting on it, and the line shown was
    "read of ExpertKey(...) cancelled" (a bmoe error was preferred to the RuntimeError behind it)."""
    from bmoe.errors import ReadCancelled, ReadError, first_error

    cause = RuntimeError("can't start new thread")
    group = BaseExceptionGroup("stages", [ReadCancelled("read of 1 cancelled"), cause])
    assert first_error(group) is cause
    real = ReadError("short read")
    assert first_error(BaseExceptionGroup("stages", [cause, ReadCancelled("x"), real])) is real  # bmoe's first
    only = ReadCancelled("read of 2 cancelled")
    assert first_error(BaseExceptionGroup("stages", [only])) is only


def test_a_prompt_past_the_context_names_the_flags(tmp_path: Path) -> None:
    """It said "max_tokens (64) ... raise the context size (-c; -c on the command line)"."""
    from bmoe.synth.tiny import write_tiny

    (path,) = write_tiny(tmp_path / "t.gguf", TinySpec())
    proc = bmoe("run", "-m", path, "-p", "word " * 230, "-c", "256", "-n", "64")
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert "+ -n (64) exceed the context (256); raise the context size (-c)" in proc.stderr, proc.stderr

"""Numbers, paths and streams a user hands the CLI: each bad one is one line, never a traceback.

Malformed numbers are refused by the parser (status 2, argparse's convention for a bad command
line); a file or write failure is status 1; a reader that closes stdout early gets the quiet
status of SIGPIPE (141)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from bmoe.synth.tiny import TinySpec
from tests.helpers import cli, one_line
from tests.helpers import bmoe as _bmoe


def bmoe(*args: str | bytes, stdout: int | None = subprocess.PIPE) -> subprocess.CompletedProcess[bytes]:
    """The shared helper, in bytes: these tests hand it bytes that are not UTF-8."""
    return _bmoe(*args, binary=True, stdout=stdout)


@pytest.mark.parametrize("flags", [
    ("--cache-mb", "nan"), ("--cache-mb", "inf"), ("--cache-mb", "1e308"), ("--cache-mb", "-1"),
    ("--cache-ceil-mb", "nan"), ("--cache-ceil-mb", "inf"), ("-t", "0"), ("-t", "nan"), ("-c", "1e9"),
    ("-c", "99999999999"), ("-n", "0"), ("-n", "-5"), ("--io-threads", "99999999999999999999"),
    ("--prefetch", "1000"),
])
@pytest.mark.pure
def test_bad_numbers_are_refused_at_parse_time(flags: tuple[str, str]) -> None:
    line = one_line(cli("run", "-m", "m.gguf", "-p", "hi", *flags), 2)
    assert flags[0] in line


@pytest.mark.pure
def test_replay_budgets_must_be_finite(tmp_path: Path) -> None:
    one_line(cli("replay", str(tmp_path / "t.trace"), "--cache-mb", "100,nan"), 2)


@pytest.mark.parametrize("flag", ["--csv", "--route-trace"])
def test_a_full_disk_under_an_output_is_one_line(tiny, full_device: str, flag: str) -> None:
    line = one_line(bmoe("run", "-m", str(tiny.path(TinySpec())), "-p", "hi", "-n", "3", "-c", "256",
                         flag, full_device), 1)
    assert "No space left on device" in line


def test_make_tiny_and_demo_into_unwritable_places_are_one_line(tmp_path: Path, full_device: str) -> None:
    assert full_device in one_line(bmoe("make-tiny", full_device), 1)
    one_line(bmoe("make-tiny", str(tmp_path / "missing" / "m.gguf")), 1)
    one_line(bmoe("demo", "--dir", full_device), 1)
    assert stat.S_ISCHR(os.stat(full_device).st_mode)


def test_whole_file_writers_never_remove_or_replace_a_device(tmp_path: Path, full_device: str) -> None:
    """Run as root, ``make-tiny /dev/full`` removed the device node when its write failed (the
    cleanup of a half-written model), and the next test's ``demo --dir /dev/full`` made a folder
    in its place; synth's rename would have put a model where /dev/null was. A device is refused."""
    for argv in (("make-tiny", full_device), ("make-tiny", full_device, "--force"),
                 ("synth", "--like", "qwen3-30b-a3b", "--layers", "1", full_device)):
        line = one_line(bmoe(*argv), 1)
        assert "is a character device, not a file" in line, line
        assert stat.S_ISCHR(os.stat(full_device).st_mode), argv


def test_stdout_to_a_full_disk_is_one_line(tiny, full_device: str) -> None:
    with open(full_device, "wb") as full:
        line = one_line(bmoe("run", "-m", str(tiny.path(TinySpec())), "-p", "hi", "-n", "8", "-c", "256",
                             stdout=full.fileno()), 1)
    assert "No space left on device" in line


def test_a_closed_pipe_ends_quietly_with_sigpipe_status(tiny) -> None:
    r, w = os.pipe()
    os.close(r)  # the reader is gone before the first token
    try:
        proc = bmoe("run", "-m", str(tiny.path(TinySpec())), "-p", "hi", "-n", "8", "-c", "256", stdout=w)
    finally:
        os.close(w)
    assert proc.returncode == 141, proc.stderr
    assert proc.stderr.strip() == b"", proc.stderr


def test_a_prompt_that_is_not_utf8_is_accepted_with_a_warning(tiny) -> None:
    proc = bmoe("run", "-m", str(tiny.path(TinySpec())), "-p", b"caf\xe9 \xff ok", "-n", "3", "-c", "256", "--json")
    assert proc.returncode == 0, proc.stderr
    assert b"not valid UTF-8" in proc.stderr


def test_a_prompt_longer_than_the_context_is_refused_at_once_with_both_numbers(tiny) -> None:
    prompt = "word " * 20_000  # 100 KB
    line = one_line(bmoe("run", "-m", str(tiny.path(TinySpec())), "-p", prompt, "-n", "3", "-c", "256"), 1)
    assert "(256)" in line and "tokens" in line


@pytest.mark.pure
def test_a_300_character_file_name_is_one_line(tmp_path: Path) -> None:
    one_line(cli("run", "-m", str(tmp_path / ("x" * 300 + ".gguf")), "-p", "hi"), 1)


@pytest.mark.pure
def test_a_model_that_is_a_folder_or_unreadable_is_one_line(tmp_path: Path) -> None:
    one_line(cli("run", "-m", str(tmp_path), "-p", "hi"), 1)
    fifo = tmp_path / "fifo.gguf"
    os.mkfifo(fifo)
    one_line(cli("run", "-m", str(fifo), "-p", "hi"), 1)


@pytest.mark.parametrize("fd", [0, 1, 2])
def test_a_closed_standard_descriptor_is_no_signal(tiny, fd: int) -> None:
    """``0<&-``, ``>&-`` or ``2>&-``: the next file opened took the free number and libuv aborted
    the process when it closed it (SIGABRT); the missing stream is now /dev/null. (The prompt is
    given, as ``-p -`` on a closed stdin is an empty prompt, refused before any file is opened.)"""
    proc = subprocess.run([sys.executable, "-m", "bmoe.cli", "run", "-m", str(tiny.path(TinySpec())), "-p", "hi",
                           "-n", "3", "-c", "256"], stdin=subprocess.DEVNULL, capture_output=True,
                          preexec_fn=lambda: os.close(fd), timeout=120)
    assert proc.returncode == 0, (proc.returncode, proc.stderr)
    assert b"Traceback" not in proc.stderr and b"Assertion" not in proc.stderr


@pytest.mark.pure
def test_stop_takes_the_escapes_of_llama_cpps_command_line() -> None:
    from bmoe.cli.flags import _escaped

    assert _escaped(r"\n\n") == "\n\n"
    assert _escaped(r"a\tb\\n") == "a\tb\\n"
    assert _escaped(r"\x plain") == r"\x plain"  # an unknown escape is left as typed


@pytest.mark.parametrize("flags", [("--io-threads", "0"), ("--io-threads", "-3"), ("--ram", "-1"), ("--ram", "inf"),
                                   ("--compute-gbs", "nan")])
@pytest.mark.pure
def test_inspect_numbers_out_of_range_are_one_line(flags: tuple[str, str]) -> None:
    line = one_line(cli("inspect", "m.gguf", *flags), 2)  # refused by the parser
    assert flags[0] in line


@pytest.mark.pure
def test_a_plot_matplotlib_cannot_write_is_refused_before_the_work(tmp_path: Path) -> None:
    trace = tmp_path / "t.route.csv"
    trace.write_text("route_trace v1\n")  # never read: the plot's name is checked first
    line = one_line(cli("replay", str(trace), "--cache-mb", "1", "--plot", str(tmp_path / "r.out")), 1)
    assert "cannot write 'out'" in line and "png" in line


def test_run_json_interrupted_still_prints_one_json_object(tiny) -> None:
    import json
    import signal

    proc = subprocess.Popen([sys.executable, "-m", "bmoe.cli", "run", "-m", str(tiny.path(TinySpec())), "-p", "hi",
                             "-n", "1900", "-c", "2048", "--json", "--progress"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stderr is not None
    for line in proc.stderr:  # the first token's metrics line: the generation is under way
        if line.startswith(b"{"):
            break
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    result = json.loads(out)
    assert result["finish_reason"] == "cancelled" and 0 < result["n_tokens"] == len(result["tokens"]) < 1900


def test_a_dense_model_is_told_apart_from_a_broken_moe(tmp_path: Path) -> None:
    import numpy as np
    from gguf import GGUFWriter

    path = tmp_path / "dense.gguf"
    w = GGUFWriter(path, "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(1)
    w.add_tensor("blk.0.ffn_up.weight", np.zeros((16, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    line = one_line(bmoe("run", "-m", str(path), "-p", "hi"), 1)
    assert "not a Mixture-of-Experts" in line


def test_a_grammar_llama_cpp_cannot_parse_is_one_line_with_its_reason(tiny, tmp_path: Path) -> None:
    bad = tmp_path / "bad.gbnf"
    bad.write_text("root ::= ((")
    line = one_line(bmoe("run", "-m", str(tiny.path(TinySpec())), "-p", "hi", "--grammar-file", str(bad)), 1)
    assert "could not parse the grammar" in line and "expecting ')'" in line

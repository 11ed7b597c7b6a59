"""No output flag may overwrite an input: the model, any shard of its set, or the trace being read.

Each case runs the real command in a subprocess and checks the model's bytes afterwards: the
refusal must come before anything is opened for writing (a truncated model under llama.cpp's
mapping used to end in SIGBUS with a 0-byte model).
"""

from __future__ import annotations

import hashlib
import os
import socket
import stat
from pathlib import Path

import pytest

from bmoe.errors import MissingShardError, OutputPathError
from bmoe.io.layout import split_shard_paths
from bmoe.io.paths import check_output, check_output_dir
from bmoe.synth.tiny import TinySpec, write_tiny
from tests.test_cli import bmoe


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def split_model(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    folder = tmp_path_factory.mktemp("outputs")
    return write_tiny(folder / "m.gguf", TinySpec(wtype="q8_0", shards=2))


@pytest.mark.pure
@pytest.mark.parametrize("flag,extra", [
    ("--csv", ()), ("--route-trace", ()), ("--route-trace", ("--resident",)),
    ("--route-trace", ("--open-mode", "mmap-drop")),
])
@pytest.mark.parametrize("target", [0, 1])  # shard 1 (the -m path) and shard 2
def test_run_refuses_an_output_onto_the_model(split_model, flag, extra, target) -> None:  # noqa: ANN001
    before = [digest(p) for p in split_model]
    proc = bmoe("run", "-m", str(split_model[0]), "-p", "hi", "-n", "2", flag, str(split_model[target]), *extra)
    assert proc.returncode == 1
    assert proc.stderr.count("\n") == 1 and "refusing to overwrite" in proc.stderr, proc.stderr
    assert [digest(p) for p in split_model] == before


@pytest.mark.pure
def test_a_hard_link_or_symlink_to_the_model_is_refused(split_model, tmp_path: Path) -> None:  # noqa: ANN001
    link, sym = tmp_path / "link.csv", tmp_path / "sym.csv"
    os.link(split_model[1], link)
    sym.symlink_to(split_model[0])
    for out in (link, sym):
        with pytest.raises(OutputPathError, match="is an input"):
            check_output(out, "--csv", split_model)


@pytest.mark.pure
def test_replay_refuses_outputs_onto_its_trace(tmp_path: Path) -> None:
    trace = tmp_path / "t.route.csv"
    trace.write_text("route_trace v1\n")
    before = digest(trace)
    for flag in ("--csv", "--plot"):
        proc = bmoe("replay", str(trace), "--cache-mb", "100", flag, str(trace))
        assert proc.returncode == 1 and "refusing to overwrite" in proc.stderr, proc.stderr
    assert digest(trace) == before


@pytest.mark.pure
def test_output_folders_and_permissions_are_checked_first(tmp_path: Path) -> None:
    with pytest.raises(OutputPathError, match="does not exist"):
        check_output(tmp_path / "no" / "x.csv", "--csv")
    with pytest.raises(OutputPathError, match="is a folder"):
        check_output(tmp_path, "--csv")
    assert check_output("/dev/null", "--csv") == Path("/dev/null")  # character devices are fine
    assert check_output(tmp_path / "new.csv", "--csv") == tmp_path / "new.csv"
    (tmp_path / "f").write_text("")
    with pytest.raises(OutputPathError, match="not a folder"):
        check_output_dir(tmp_path / "f", "--out")


@pytest.mark.pure
def test_a_disk_or_a_socket_is_never_an_output(tmp_path: Path) -> None:
    """Run as root (CI is), ``--csv /dev/vda`` passed the writable check and would have written
    over the disk's first blocks. A block device node of the test's own (never opened) and a
    socket are refused by what they are."""
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.bind(str(tmp_path / "s"))
        with pytest.raises(OutputPathError, match="is a socket, not a file"):
            check_output(tmp_path / "s", "--csv")
    finally:
        sock.close()
    try:
        os.mknod(tmp_path / "disk", 0o600 | stat.S_IFBLK, os.makedev(7, 0))
    except OSError:
        pytest.skip("mknod refused (not root): the socket case ran")
    with pytest.raises(OutputPathError, match="--route-trace .* is a block device, not a file"):
        check_output(tmp_path / "disk", "--route-trace")


@pytest.mark.pure
def test_a_split_name_with_an_absurd_shard_count_is_refused_without_building_paths() -> None:
    with pytest.raises(MissingShardError, match="99999999999 shards"):
        split_shard_paths(Path("m-00001-of-99999999999.gguf"))


@pytest.mark.pure
def test_an_output_onto_a_prompt_grammar_or_another_output_is_refused(split_model, tmp_path: Path) -> None:  # noqa: ANN001
    prompt, grammar = tmp_path / "p.txt", tmp_path / "g.gbnf"
    prompt.write_text("hello")
    grammar.write_text('root ::= "a"')
    model = str(split_model[0])
    cases = [
        (("-f", str(prompt), "--csv", str(prompt)), "is an input"),
        (("-p", "hi", "--grammar-file", str(grammar), "--route-trace", str(grammar)), "is an input"),
        (("-p", "hi", "--csv", str(tmp_path / "x"), "--route-trace", str(tmp_path / "x")), "the same file"),
        (("-p", "hi", "--csv", str(tmp_path / "y"), "--cache-profile", str(tmp_path / "y")), "the same file"),
    ]
    for flags, why in cases:
        proc = bmoe("run", "-m", model, "-n", "2", *flags)
        assert proc.returncode == 1 and proc.stderr.count("\n") == 1 and why in proc.stderr, (flags, proc.stderr)
    assert prompt.read_text() == "hello" and grammar.read_text() == 'root ::= "a"'
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


@pytest.mark.pure
def test_make_tiny_and_synth_never_overwrite_a_file_or_write_through_a_link(tmp_path: Path) -> None:
    real = write_tiny(tmp_path / "real.gguf", TinySpec())[0]
    before = digest(real)
    sym, hard = tmp_path / "sym.gguf", tmp_path / "hard.gguf"
    sym.symlink_to(real)
    os.link(real, hard)
    for out in (real, sym, hard):
        proc = bmoe("make-tiny", str(out), "--seed", "5")
        assert proc.returncode == 1 and "refusing to overwrite" in proc.stderr, proc.stderr
    proc = bmoe("synth", str(real), "--like", "qwen3-30b-a3b", "--layers", "1")
    assert proc.returncode == 1 and "refusing to overwrite" in proc.stderr, proc.stderr
    proc = bmoe("synth", str(tmp_path), "--like", "qwen3-30b-a3b", "--layers", "1")
    assert proc.returncode == 1 and "is a folder" in proc.stderr, proc.stderr
    assert digest(real) == before
    # Forced, the link itself is replaced: the file it pointed at keeps its bytes.
    proc = bmoe("make-tiny", str(sym), "--seed", "5", "--force")
    assert proc.returncode == 0, proc.stderr
    assert not sym.is_symlink() and digest(sym) != before
    assert digest(real) == before == digest(hard)


@pytest.mark.pure
def test_a_forced_command_that_is_refused_keeps_the_file_it_would_replace(tmp_path: Path) -> None:
    """--force used to unlink the old file before the rest was checked: a bad spec, a disk too
    small or a second shard's name then left the user with neither model."""
    keep = tmp_path / "keep.gguf"
    keep.write_bytes(b"the user's model")
    proc = bmoe("synth", str(keep), "--like", "qwen3-30b-a3b", "--experts-used", "999", "--force")
    assert proc.returncode == 1 and "experts used" in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    assert keep.read_bytes() == b"the user's model"
    shards = [tmp_path / f"s-0000{i}-of-00002.gguf" for i in (1, 2)]
    shards[0].write_bytes(b"shard one")
    shards[1].mkdir()  # the second name cannot be written: refused before the first is touched
    proc = bmoe("make-tiny", str(tmp_path / "s.gguf"), "--shards", "2", "--force")
    assert proc.returncode == 1 and "is a folder" in proc.stderr, proc.stderr
    assert shards[0].read_bytes() == b"shard one"


def test_streams_may_take_two_outputs_or_share_a_terminal_with_an_input(tiny, tmp_path: Path) -> None:
    """``--csv /dev/null --route-trace /dev/null`` was refused as 'the same file', and so was
    ``-f /dev/stdin --csv /dev/stdout`` on one terminal: a stream holds no file to overwrite."""
    model = str(tiny.path(TinySpec()))
    proc = bmoe("run", "-m", model, "-p", "hi", "-n", "2", "-c", "256", "--csv", "/dev/null", "--route-trace", "/dev/null")
    assert proc.returncode == 0, proc.stderr
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert check_output(fifo, "--csv", [fifo]) == fifo  # a pipe named as input too: nothing to destroy

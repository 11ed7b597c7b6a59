"""No output flag may overwrite an input: the model, any shard of its set, or the trace being read.

Each case runs the real command in a subprocess and checks the model's bytes afterwards: the
refusal must come before anything is opened for writing (a truncated model under llama.cpp's
mapping used to end in SIGBUS with a 0-byte model).
"""

from __future__ import annotations

import hashlib
import os
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


def test_a_hard_link_or_symlink_to_the_model_is_refused(split_model, tmp_path: Path) -> None:  # noqa: ANN001
    link, sym = tmp_path / "link.csv", tmp_path / "sym.csv"
    os.link(split_model[1], link)
    sym.symlink_to(split_model[0])
    for out in (link, sym):
        with pytest.raises(OutputPathError, match="is an input"):
            check_output(out, "--csv", split_model)


def test_replay_refuses_outputs_onto_its_trace(tmp_path: Path) -> None:
    trace = tmp_path / "t.route.csv"
    trace.write_text("route_trace v1\n")
    before = digest(trace)
    for flag in ("--csv", "--plot"):
        proc = bmoe("replay", str(trace), "--cache-mb", "100", flag, str(trace))
        assert proc.returncode == 1 and "refusing to overwrite" in proc.stderr, proc.stderr
    assert digest(trace) == before


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


def test_a_split_name_with_an_absurd_shard_count_is_refused_without_building_paths() -> None:
    with pytest.raises(MissingShardError, match="99999999999 shards"):
        split_shard_paths(Path("m-00001-of-99999999999.gguf"))

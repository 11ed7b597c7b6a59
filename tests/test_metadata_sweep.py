"""The metadata sweep with the first-open child off (issue 39.3): every scalar key of every recipe's
tiny fixture set to 0, to its type's maximum (NaN for a float) or deleted, each file run by bmoe's
own CLI (``run -n 2``) in worker processes with ``BMOE_ISOLATE=0``. The docs promise the Python
checks alone refuse whatever would kill the process, so every case must end as a normal run or one
``bmoe: error:`` line with status 1: a worker killed by a signal (or hung) fails the test, even
though ``bench/fuzz.py`` would then re-run the file with the child and get one line.

``python bench/fuzz.py --sweep --no-isolate --arch A,B`` runs the same cases (and 1 besides) by hand.
"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from bench.fuzz import BAD, OK, ONE_LINE, Pool, Target
from bmoe.io.recipes import RECIPES
from bmoe.synth.tiny import TinySpec, write_tiny

_ONES = {b"\x01", b"\x01\x00", b"\x01\x00\x00\x00", b"\x01" + b"\x00" * 7, struct.pack("<f", 1.0),
         struct.pack("<d", 1.0)}


def sweep_cases(folder: Path, arch: str, start: int, shared_keys: bool = True) -> list:
    """The fixture's scalar keys at 0 / max / NaN / deleted (the fuzzer's sweep less its 1s);
    without ``shared_keys`` only the architecture's own (``<arch>.*``): the tokenizer and general
    keys are the same in every fixture, so one architecture sweeps them for all."""
    valid = write_tiny(folder / f"valid-{arch}.gguf", TinySpec(arch=arch, n_embd=64, n_ff=32))[0]
    target = Target(valid, arch)
    cases = [c for c in target.sweep(start) if not (c.kind.startswith("set ") and c.data in _ONES)
             and (shared_keys or c.kind.split(" ", 1)[1].startswith(arch + "."))]
    return [(c, target.write(c, folder / f"case-{c.index}.gguf")) for c in cases]


def test_every_scalar_key_of_every_recipe_is_a_run_or_one_line_without_the_child(tmp_path: Path) -> None:
    pool = Pool(2, str(tmp_path / "cache"), isolate=False)
    results = []
    try:
        for i, arch in enumerate(RECIPES):  # one arch's files at a time: the disk holds a few MB, not all
            results += pool.run(sweep_cases(tmp_path, arch, len(results), shared_keys=i == 0))
    finally:
        pool.close()
    killed = [f"{c.describe()}: {text[-300:]}" for c, _, text in results if text.startswith("without isolation")]
    bad = [f"{c.describe()}: {o}: {text[-300:]}" for c, o, text in results if o in BAD]
    assert not killed, f"{len(killed)} case(s) killed or hung a worker with the child off:\n" + "\n".join(killed)
    assert not bad, "\n".join(bad)
    outcomes = {o for _, o, _ in results}
    assert outcomes == {OK, ONE_LINE}, outcomes  # both ends exercised, or it proves little
    assert {c.arch for c, _, _ in results} == set(RECIPES)


@pytest.mark.pure
def test_the_sweep_covers_zero_max_nan_and_deletion(tmp_path: Path) -> None:
    """The case list itself: each kind present for a key the pin reads (a negative control of the
    filter: no 1 slips in, so the run time stays what the docstring says)."""
    jobs = sweep_cases(tmp_path, "qwen3moe", 0)
    kinds = {(c.kind, c.data) for c, _ in jobs}
    key = "qwen3moe.expert_used_count"
    assert (f"set {key}", b"\x00" * 4) in kinds and (f"set {key}", b"\xff" * 4) in kinds
    assert (f"delete {key}", b"X") in kinds
    eps = "qwen3moe.attention.layer_norm_rms_epsilon"
    assert any(k == f"set {eps}" and struct.unpack("<f", d)[0] != struct.unpack("<f", d)[0] for k, d in kinds)
    assert not any(d in _ONES for k, d in kinds if k.startswith("set "))

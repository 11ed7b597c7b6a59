"""The device probe: on the model's own expert slices (what a benchmark compares its reads with) and
on a scratch file (what a replay models reads with)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bmoe.io import probe
from bmoe.io.validate import open_layout
from tests.helpers import TinySpec, write_tiny

MiB = 1 << 20


@pytest.mark.pure
def test_the_model_probe_reads_distinct_expert_slices_of_the_model_and_writes_nothing(tmp_path: Path) -> None:
    model = write_tiny(tmp_path / "tiny.gguf", TinySpec())[0]
    layout = open_layout(model)
    before = sorted(p.name for p in tmp_path.iterdir())
    slices = sum(e.n_expert for e in layout.experts.values())
    result = probe.measure_model(layout, 2, reads=10_000)
    assert result.reads == slices  # every slice once: none is read twice (a cache could serve it)
    assert result.mib_s > 0 and result.lanes == 2
    assert result.slice_bytes == max(e.stride for e in layout.experts.values())
    assert "expert slices of the model" in result.how
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert probe.measure_model(layout, 1, reads=5).reads == 5


@pytest.mark.pure
def test_the_model_probe_refuses_nonsense(tmp_path: Path) -> None:
    layout = open_layout(write_tiny(tmp_path / "tiny.gguf", TinySpec())[0])
    with pytest.raises(ValueError, match="lanes"):
        probe.measure_model(layout, 0)


@pytest.mark.pure
def test_the_scratch_probe_leaves_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(probe, "_SCRATCH_BYTES", 4 * MiB)
    result = probe.measure(tmp_path, 64 * 1024, 2, reads=16)
    assert result.mib_s > 0 and result.reads == 16 and "scratch file" in result.how
    assert list(tmp_path.iterdir()) == []


@pytest.mark.pure
@pytest.mark.parametrize("entry", [
    [], {"mib_s": 0, "slice_bytes": 4096, "lanes": 2, "mode": "odirect", "reads": 1, "how": "x"},
    {"mib_s": "fast", "slice_bytes": 4096, "lanes": 2, "mode": "odirect", "reads": 1, "how": "x"},
    {"mib_s": 900.0, "slice_bytes": 4096, "lanes": 0, "mode": "odirect", "reads": 1, "how": "x"},
    {"mib_s": 900.0, "lanes": 2},
])
def test_a_bad_stored_probe_is_measured_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, entry) -> None:  # noqa: ANN001
    """A hand-edited or torn probe.json ended replay and inspect in ZeroDivisionError or TypeError."""
    import json
    import os

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    (tmp_path / "cache" / "bmoe").mkdir(parents=True)
    key = f"{os.stat(tmp_path).st_dev}:4096:2"
    (tmp_path / "cache" / "bmoe" / "probe.json").write_text(json.dumps({key: entry}))
    fresh = probe.ProbeResult(mib_s=900.0, slice_bytes=4096, lanes=2, mode="odirect", reads=256, how="measured")
    monkeypatch.setattr(probe, "measure", lambda *a, **k: fresh)
    assert probe.stored_probe(entry) is None
    assert probe.cached_probe(tmp_path, 4096, 2) == fresh
    assert probe.stored_probe(probe.read_store()[key]) == fresh, "the store holds the new one"


@pytest.mark.pure
def test_a_probe_where_no_scratch_file_can_be_made_says_why(tmp_path: Path) -> None:
    from bmoe.errors import ConfigError

    with pytest.raises(ConfigError, match="cannot measure the read rate of the disk holding .*writable folder"):
        probe._unnamed_scratch(tmp_path / "missing")

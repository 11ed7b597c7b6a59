"""The cgroup memory reader on fake cgroup trees: v2 and v1, limits on an ancestor, no limit."""

from __future__ import annotations

from pathlib import Path

import pytest

from bmoe.pipeline.cgroup import own_paths, read_cgroup_memory

pytestmark = pytest.mark.pure

MiB = 1 << 20


def _files(d: Path, **files: str) -> None:
    d.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (d / name.replace("_", ".", 1)).write_text(text)


def _self(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "self-cgroup"
    p.write_text(text)
    return p


def _v2(tmp_path: Path, rel: str, levels: dict[str, dict[str, str]]) -> tuple[Path, Path]:
    root = tmp_path / "sys"
    _files(root, cgroup_controllers="cpu memory\n")
    for sub, files in levels.items():
        _files(root / sub if sub else root, **files)
    return root, _self(tmp_path, f"0::{rel}\n")


def test_own_paths_reads_v2_and_v1_lines() -> None:
    assert own_paths("0::/user.slice/app.scope\n") == ("/user.slice/app.scope", None)
    hybrid = "9:name=systemd:/\n4:memory:/process_api/abc\n3:cpu,cpuacct:/\n0::/\n"
    assert own_paths(hybrid) == ("/", "/process_api/abc")
    assert own_paths("") == (None, None)


def test_v2_limit_less_usage_plus_page_cache(tmp_path: Path) -> None:
    root, me = _v2(tmp_path, "/pod/ctr", {"pod/ctr": {
        "memory_max": f"{1100 * MiB}\n", "memory_high": "max\n", "memory_current": f"{500 * MiB}\n",
        "memory_stat": f"anon {300 * MiB}\nfile {250 * MiB}\nactive_file {120 * MiB}\ninactive_file {80 * MiB}\n",
        "memory_events": "low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n",
        "memory_pressure": "some avg10=0.00 avg60=0.00 avg300=0.00 total=1234\n",
    }})
    m = read_cgroup_memory(root, me)
    assert m is not None
    assert (m.limit, m.usage, m.file_pages, m.what) == (1100 * MiB, 500 * MiB, 200 * MiB, "memory.max")
    assert m.available == 800 * MiB  # 1100 - 500 + the 200 MiB of active + inactive file pages
    assert (m.oom_kills, m.psi_some_us) == (1, 1234)
    assert "memory.max 1100 MiB" in m.describe()


def test_v2_memory_high_binds_when_lower(tmp_path: Path) -> None:
    root, me = _v2(tmp_path, "/a", {"a": {"memory_max": f"{2048 * MiB}", "memory_high": f"{1024 * MiB}",
                                          "memory_current": f"{24 * MiB}"}})
    m = read_cgroup_memory(root, me)
    assert m is not None and (m.limit, m.what, m.available) == (1024 * MiB, "memory.high", 1000 * MiB)


def test_v2_the_ancestor_with_least_room_binds(tmp_path: Path) -> None:
    """Kubernetes sets the pod's limit on the pod's cgroup and the container's below it."""
    root, me = _v2(tmp_path, "/pod/ctr", {
        "pod": {"memory_max": f"{1000 * MiB}", "memory_current": f"{900 * MiB}"},  # a sidecar holds 880
        "pod/ctr": {"memory_max": f"{4000 * MiB}", "memory_current": f"{20 * MiB}"},
    })
    m = read_cgroup_memory(root, me)
    assert m is not None and (m.limit, m.available) == (1000 * MiB, 100 * MiB)


def test_v2_unlimited_or_missing_is_none(tmp_path: Path) -> None:
    root, me = _v2(tmp_path, "/a", {"a": {"memory_max": "max\n", "memory_high": "max\n", "memory_current": "5\n"}})
    assert read_cgroup_memory(root, me) is None
    assert read_cgroup_memory(tmp_path / "nothing", me) is None
    assert read_cgroup_memory(root, tmp_path / "no-self") is None


def test_v2_own_cgroup_mounted_as_the_root(tmp_path: Path) -> None:
    """Docker without a cgroup namespace: /proc/self/cgroup names /docker/ID, the mount is it."""
    root, me = _v2(tmp_path, "/docker/abc", {"": {"memory_max": f"{512 * MiB}", "memory_current": f"{12 * MiB}"}})
    m = read_cgroup_memory(root, me)
    assert m is not None and m.available == 500 * MiB


def test_v2_under_a_hybrid_unified_mount(tmp_path: Path) -> None:
    root = tmp_path / "sys"
    _files(root / "unified", cgroup_controllers="")
    _files(root / "unified" / "svc", memory_max=f"{300 * MiB}", memory_current=f"{100 * MiB}")
    m = read_cgroup_memory(root, _self(tmp_path, "0::/svc\n"))
    assert m is not None and m.available == 200 * MiB


def test_v1_limit_usage_and_oom_kills(tmp_path: Path) -> None:
    root = tmp_path / "sys"
    _files(root / "memory", memory_limit_in_bytes="9223372036854771712\n", memory_usage_in_bytes="1\n")
    _files(root / "memory" / "job", memory_limit_in_bytes=f"{1100 * MiB}\n", memory_usage_in_bytes=f"{600 * MiB}\n",
           memory_stat=f"cache 9\nactive_file 1\ninactive_file 1\ntotal_active_file {50 * MiB}\n"
                       f"total_inactive_file {50 * MiB}\n",
           memory_oom_control="oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    me = _self(tmp_path, "4:memory:/job\n0::/\n")
    m = read_cgroup_memory(root, me)
    assert m is not None
    assert (m.limit, m.available, m.what, m.oom_kills) == (1100 * MiB, 600 * MiB, "memory.limit_in_bytes", 2)
    # The v1 "unlimited" (the largest page count) is no limit.
    _files(root / "memory" / "job", memory_limit_in_bytes="9223372036854771712\n")
    assert read_cgroup_memory(root, me) is None


def test_this_machine_reads_without_error() -> None:
    """Whatever this machine has (no cgroup limit, v1, v2): a figure or None, never an exception."""
    m = read_cgroup_memory()
    assert m is None or m.limit > 0

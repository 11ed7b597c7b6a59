"""Open paths and the dense-weight policy: each gives the resident tokens, and the cheap open reads
only the dense bytes."""

from __future__ import annotations

import asyncio

import pytest

from bmoe.engine.config import RunConfig
from bmoe.engine.session import Session
from bmoe.io.pagecache import evict_file_cache
from bmoe.synth.tiny import TinySpec
from tests.helpers import PROMPT, generate_tokens

CASES = [("qwen3moe", "f32"), ("qwen2moe", "q8_0"), ("gemma4", "f16")]


@pytest.mark.parametrize("arch,wtype", CASES)
@pytest.mark.parametrize("open_mode", ["user", "mmap", "mmap-drop"])
def test_every_open_path_streams_the_resident_tokens(tiny, arch: str, wtype: str, open_mode: str) -> None:
    path = tiny.path(TinySpec(arch=arch, wtype=wtype))
    config = RunConfig(mode="stream", n_ctx=256, open_mode=open_mode, cache_bytes=2 << 20)
    assert generate_tokens(path, config) == tiny.resident_tokens(path)


@pytest.mark.parametrize("mode,open_mode", [("resident", "auto"), ("stream", "mmap"), ("stream", "user")])
def test_anon_dense_weights_equal_resident(tiny, mode: str, open_mode: str) -> None:
    path = tiny.path(TinySpec(arch="qwen2moe"))
    config = RunConfig(mode=mode, n_ctx=256, dense_weights="anon", open_mode=open_mode)
    assert generate_tokens(path, config) == tiny.resident_tokens(path)


def test_streamed_open_reads_only_the_dense_bytes(tiny) -> None:
    path = tiny.path(TinySpec(n_layer=4, n_embd=256, n_expert=32, n_ff=256, wtype="f16"))

    async def open_twice() -> list[Session]:
        # The process's first open also pages in llama.cpp's own libraries: not the model's bytes.
        Session.open(path, RunConfig(mode="stream", n_ctx=256, open_mode="user")).close()
        out = []
        for mode in ("user", "mmap"):
            evict_file_cache([path])
            s = Session.open(path, RunConfig(mode="stream", n_ctx=256, open_mode=mode))
            out.append((s.open_mode, s.open_bytes_read, s.layout))
            g = await s.generate(PROMPT, 4, stop_at_end=False)
            assert g.stats.open_bytes_read == s.open_bytes_read
            s.close()
        return out

    (user_mode, user_read, layout), (mmap_mode, mmap_read, _) = asyncio.run(open_twice())
    if user_read is None:
        pytest.skip("/proc/self/io read_bytes is not available here: open bytes are unmeasurable")
    if not mmap_read:  # tmpfs: nothing to evict, no block I/O to count
        pytest.skip("a plain open of an evicted file read 0 bytes: page cache not evictable here (tmpfs?)")
    assert user_mode == "user" and mmap_mode == "mmap"
    assert layout.expert_bytes > 0.9 * layout.file_bytes
    assert user_read <= 1.1 * layout.dense_bytes + 512 * 1024
    assert mmap_read >= 0.9 * layout.file_bytes, "the control: a plain load reads the whole file"

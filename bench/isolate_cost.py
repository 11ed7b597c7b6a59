"""What the first-open check costs on a model, side by side with the parent's own open.

The check (``bmoe.llama.isolate``) loads a file bmoe has not seen in a child process and decodes
two tokens there, so that an assertion inside llama.cpp kills the child, not the user's run. This
script measures, on one model and in one run:

- validation in Python (``open_layout``, the index and the metadata checks);
- the child check with the file evicted from the page cache (cold) and cached (warm): wall time,
  the child's CPU, bytes it read (``ru_inblock``) and its peak RSS;
- the remembered case (a second check of the same file: a lookup);
- the parent's own ``Session.open``, cold and warm, for scale.

Nothing is asserted. ``python bench/isolate_cost.py MODEL.gguf``
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
import time
from pathlib import Path

from bmoe.llama import isolate
from bmoe.engine.config import RunConfig
from bmoe.engine.session import Session
from bmoe.io.pagecache import evict_file_cache
from bmoe.io.validate import open_layout

MiB = 1 << 20


def child_check(layout, memo: Path) -> str:  # noqa: ANN001 - a bmoe.io.layout.Layout
    memo.unlink(missing_ok=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    isolate.check_first_open(layout, memo=memo)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    read = (after.ru_inblock - before.ru_inblock) * 512 / MiB
    return f"{wall:.2f} s wall, child cpu {cpu:.2f} s, child read {read:.0f} MiB, peak RSS {after.ru_maxrss / 1024:.0f} MiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    args = ap.parse_args()
    path: Path = args.model

    t = time.perf_counter()
    layout = open_layout(path)
    print(f"validate (open_layout with the metadata checks): {time.perf_counter() - t:.3f} s; "
          f"dense {layout.dense_bytes / MiB:.0f} MiB of {layout.file_bytes / (1 << 30):.1f} GiB")

    memo = Path(tempfile.mkdtemp()) / "opened-ok.txt"
    for cold in (True, False):
        if cold:
            evict_file_cache(layout.shards)
        print(f"child check ({'cold' if cold else 'warm'} page cache): {child_check(layout, memo)}")
    t = time.perf_counter()
    isolate.check_first_open(layout, memo=memo)
    print(f"remembered: {time.perf_counter() - t:.4f} s")

    os.environ["BMOE_ISOLATE"] = "0"  # the parent's open alone
    for cold in (True, False):
        if cold:
            evict_file_cache(layout.shards)
        t = time.perf_counter()
        with Session.open(path, RunConfig(n_ctx=256)) as s:
            wall = time.perf_counter() - t
            read = "unmeasured" if s.open_bytes_read is None else f"{s.open_bytes_read / MiB:.0f} MiB"
            print(f"parent Session.open ({'cold' if cold else 'warm'}): {wall:.2f} s, "
                  f"open_mode {s.open_mode}, open read {read}")


if __name__ == "__main__":
    main()

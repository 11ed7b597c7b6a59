"""Cost of the first-open check on a full-depth model, side by side with the parent's own open."""
import os, sys, time, resource
from pathlib import Path
os.environ["BMOE_ISOLATE"] = "1"
from bmoe.io.validate import open_layout
from bmoe.engine import isolate
from bmoe.engine.session import Session
from bmoe.engine.config import RunConfig
path = Path(sys.argv[1])
def drop():
    fd = os.open(path, os.O_RDONLY); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)
import tempfile
memo = Path(tempfile.mkdtemp()) / "memo.txt"; memo.unlink(missing_ok=True)
t = time.perf_counter(); layout = open_layout(path); t_val = time.perf_counter() - t
print(f"validate (open_layout incl. hparams): {t_val:.3f} s; dense {layout.dense_bytes/2**20:.0f} MiB of {layout.file_bytes/2**30:.1f} GiB")
for cold in (True, False):
    if cold: drop()
    memo.unlink(missing_ok=True)
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    io0 = int(next(l for l in open("/proc/self/io") if l.startswith("read_bytes")).split()[1])
    t = time.perf_counter(); isolate.check_first_open(layout, memo=memo); wall = time.perf_counter() - t
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(f"child check ({'cold' if cold else 'warm'} page cache): {wall:.2f} s wall, child cpu {r1.ru_utime+r1.ru_stime-r0.ru_utime-r0.ru_stime:.2f} s, child read {(r1.ru_inblock-r0.ru_inblock)*512/2**20:.0f} MiB, max rss {r1.ru_maxrss/1024:.0f} MiB")
t = time.perf_counter(); isolate.check_first_open(layout, memo=memo); print(f"remembered: {time.perf_counter()-t:.4f} s")
os.environ["BMOE_ISOLATE"] = "0"
for cold in (True, False):
    if cold: drop()
    t = time.perf_counter()
    with Session.open(path, RunConfig(n_ctx=256)) as s:
        wall = time.perf_counter() - t
        print(f"parent Session.open ({'cold' if cold else 'warm'}): {wall:.2f} s, open_mode {s.open_mode}, open read {s.open_bytes_read and s.open_bytes_read/2**20:.0f} MiB")

"""One BLAS thread while bmoe's own matrix products run beside llama.cpp's compute.

The predictors (``bmoe.stages.predict``, route-ahead) multiply a router by a layer's input on the
compute thread, between llama.cpp's graph splits. numpy hands the product to OpenBLAS, which wakes
a thread per core and leaves them spinning for a while after each call: on a machine whose cores
all compute, they take the CPU from ggml's threads, whose barriers then spin too. Measured on the
2-core bench machine (a warm 50-token prompt with ``--predict-prompt``, 48-layer model): 5.7 s and
10.7 s of user CPU with OpenBLAS's default threads, 3.3-3.5 s and 6.0-6.3 s with one
(``docs/facts.md``). The products are small (a router is n_expert x n_embd): one thread loses
nothing.

OpenBLAS's thread count is process-wide, so sessions that need the limit share one hold: the first
takes it (``threadpoolctl``), the last gives the user's setting back.
"""

from __future__ import annotations

import threading

from threadpoolctl import threadpool_limits

_lock = threading.Lock()
_holders = 0
_limits: threadpool_limits | None = None


def hold_one_blas_thread() -> None:
    """Limit BLAS libraries to one thread until every holder has released."""
    global _holders, _limits
    with _lock:
        if _holders == 0:
            _limits = threadpool_limits(limits=1, user_api="blas")
        _holders += 1


def release_blas_threads() -> None:
    """Give back one hold; the last restores the BLAS thread counts seen at the first."""
    global _holders, _limits
    with _lock:
        if _holders == 0:
            return
        _holders -= 1
        if _holders == 0 and _limits is not None:
            _limits.restore_original_limits()
            _limits = None

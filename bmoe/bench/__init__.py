"""``bmoe bench``: every way of running one model, measured side by side in one invocation.

``bmoe.bench.harness`` holds the command (``add_bench_command``) and the per-configuration child
runs; ``bmoe.bench.balloon`` the memory balloon that emulates a smaller machine (``--ram-limit``).
Nothing is imported here: ``python -m bmoe.bench.harness`` and ``python -m bmoe.bench.balloon``
run those modules as child processes.
"""

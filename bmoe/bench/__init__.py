"""``bmoe bench``: every way of running one model, measured side by side in one invocation.

One module per job: ``harness`` the command (its parser, ``run_bench``: probes, balloon, the runs
in order); ``options`` what the flags parse to; ``plan`` the configurations; ``side`` one
configuration run in a child process, whose body is ``child``; ``summary`` the rows and key
figures; ``report`` the Markdown, CSV, JSON and plot; ``machine`` what the report says of the
machine; ``balloon`` the memory balloon that emulates a smaller machine (``--ram-limit``).
Nothing is imported here: ``python -m bmoe.bench.child`` and ``python -m bmoe.bench.balloon``
run those modules as child processes.
"""

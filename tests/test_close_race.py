"""``Session.close`` while other threads are inside native calls (issue 39, item 4).

``tokenize()`` on threads while ``close()`` ran freed the vocabulary under them: SIGSEGV or
SIGABRT (``std::out_of_range``) inside llama.cpp. Run in a child process, since what fails is the
process. Before ``close`` waited for native calls in flight (7206f85^), this script died of a
signal 6 times out of 6 on the tiny model (status 139 or 134); now every thread ends with
SessionClosedError.
"""

from __future__ import annotations

import os
import subprocess
import sys

from bmoe.synth.tiny import TinySpec

_SCRIPT = r"""
import sys, threading
from bmoe.engine.config import RunConfig
from bmoe.engine.session import Session
from bmoe.errors import SessionClosedError

s = Session.open(sys.argv[1], RunConfig(n_ctx=256))
text = "the quick brown fox jumps over the lazy dog; " * 20000  # each tokenize takes a while
started, calls, outcomes = threading.Barrier(5), [], []

def work():
    started.wait()
    try:
        while True:
            calls.append(1)
            s.tokenize(text)
    except SessionClosedError:
        outcomes.append("closed")

threads = [threading.Thread(target=work) for _ in range(4)]
for t in threads:
    t.start()
started.wait()
while len(calls) < 8:  # every thread in (or entering) its second tokenize: close lands mid-call
    pass
s.close()
for t in threads:
    t.join()
print(" ".join(outcomes))
"""


def test_close_waits_for_tokenize_calls_in_flight_on_other_threads(tiny) -> None:  # noqa: ANN001
    path = tiny.path(TinySpec())
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", _SCRIPT, str(path)], capture_output=True, text=True,
                              timeout=120, env=os.environ.copy())
        assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
        assert proc.stdout.split() == ["closed"] * 4, proc.stdout

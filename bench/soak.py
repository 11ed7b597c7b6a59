"""Soak: ``bmoe serve`` under a mixed load of good and hostile requests for minutes (issue 39).

The server runs as a subprocess (``python -m bmoe.cli serve``) on a free loopback port, on a tiny
model made for the run (``make-tiny`` into a temporary folder), with a 1 MiB expert cache so that
routed experts are read from disk all along. Before the load, each good prompt is run alone, one
request at a time, on the same server: those are the reference outputs. Then, for ``--minutes``:

- good clients send the fixed prompts in turn, greedy, streamed and not (alternating), and check
  each answer against the lone one: the tokens' texts (``logprobs: 0``) and the text with
  ``--parallel 1``; the text as the server returns it with ``--parallel`` > 1;
- hostile clients cycle through: a 4 MiB body with a bad field, malformed JSON, an unknown field,
  a huge ``max_tokens``, a stream dropped after two events, a body dropped half sent, JSON nested
  100000 deep, an empty prompt.

Every loop is bounded in count and in time. Recorded from ``/proc/PID`` of the server process:
RSS, open fds, threads, mapping lines, before the load (after the lone runs and a settle) and after
it (after ``--settle`` seconds), and RSS each 30 s between; the largest gap between two events of
any good stream (first event to last; the wait for a turn is not a gap); the count of each status
per kind of request, the slowest of each kind, and every request over 1 s with when it started (a
stall of the whole server shows as several at once); the load average before and after (the machine is shared: read the gaps with
it). Nothing is asserted; one JSON object is printed at the end.

    python bench/soak.py [--minutes 10] [--parallel 1] [--good 2] [--hostile 2] [--max-tokens 24]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

PROMPTS = (
    "Once upon a time",
    "The experts of a mixture are read from disk",
    "def fibonacci(n):",
    "A list of colours: red, green,",
    "Question: what is two plus two? Answer:",
    "In the beginning the",
)
TIMEOUT = httpx.Timeout(120.0, connect=10.0)


class Server:
    """``bmoe serve`` in its own process; its stderr drained by a thread (kept: the last lines and
    any traceback)."""

    def __init__(self, model: Path, parallel: int, cache_mb: str, ctx: int, queue: int) -> None:
        cmd = [sys.executable, "-m", "bmoe.cli", "serve", "-m", str(model), "--host", "127.0.0.1", "--port", "0",
               "-c", str(ctx), "--parallel", str(parallel), "--cache-mb", cache_mb, "--force", "--queue", str(queue),
               "--no-webui"]
        self.cmd = cmd
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True, errors="replace")
        self.lines: collections.deque[str] = collections.deque(maxlen=50)
        self.tracebacks = 0
        self.url = ""
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line.rstrip())
            if " on http://" in line:
                self.url = line.split(" on ", 1)[1].split()[0].removesuffix("/v1")
                break
        if not self.url:
            raise SystemExit("the server did not start:\n" + "\n".join(self.lines))
        self.drain = threading.Thread(target=self._drain, daemon=True)
        self.drain.start()

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line.rstrip())
            if "Traceback" in line:
                self.tracebacks += 1

    def probe(self) -> dict:
        """RSS (MiB), open fds, threads and mapping lines of the server process, now."""
        pid = self.proc.pid
        with open(f"/proc/{pid}/status") as f:
            rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))
        with open(f"/proc/{pid}/maps") as f:
            maps = sum(1 for _ in f)
        return {"rss_mib": round(rss / 1024, 1), "fds": len(os.listdir(f"/proc/{pid}/fd")),
                "threads": len(os.listdir(f"/proc/{pid}/task")), "maps": maps}

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.drain.join(5)
        return self.proc.returncode


def good_body(prompt: str, max_tokens: int, stream: bool, with_tokens: bool) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if with_tokens:
        body["logprobs"] = 0
    return body


def ask(client: httpx.Client, url: str, body: dict) -> tuple[int, str, list[str], float]:
    """One good completion: status, text, the tokens' texts, and the largest gap (s) between two
    of its stream's events (0 when not streamed)."""
    if not body["stream"]:
        r = client.post(f"{url}/v1/completions", json=body)
        if r.status_code != 200:
            return r.status_code, "", [], 0.0
        choice = r.json()["choices"][0]
        return 200, choice["text"], list((choice.get("logprobs") or {}).get("tokens") or []), 0.0
    text, tokens, gap, last = [], [], 0.0, None
    with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, "", [], 0.0
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            now = time.monotonic()
            if last is not None:
                gap = max(gap, now - last)
            last = now
            if line == "data: [DONE]":
                break
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                text.append(choice.get("text") or "")
                tokens.extend((choice.get("logprobs") or {}).get("tokens") or [])
    return 200, "".join(text), tokens, gap


class Tally:
    """Counts by (kind, outcome), mismatches and the largest stream gap; shared by the clients."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.good = self.good_equal = self.streams = 0
        self.mismatches: list[dict] = []
        self.max_gap = 0.0
        self.latency: list[float] = []
        self.slowest: dict[str, float] = collections.defaultdict(float)
        self.t0 = time.monotonic()
        self.slow: list[tuple[float, str, float]] = []  # (started at, kind, seconds) of requests over 1 s

    def count(self, kind: str, outcome: str | int, seconds: float = 0.0) -> None:
        with self.lock:
            self.counts[kind][str(outcome)] += 1
            self.slowest[kind] = max(self.slowest[kind], round(seconds, 3))
            if seconds > 1.0 and len(self.slow) < 50:
                self.slow.append((round(time.monotonic() - seconds - self.t0, 1), kind, round(seconds, 2)))


def good_client(i: int, url: str, lone: dict, args: argparse.Namespace, stop_at: float, tally: Tally) -> None:
    with httpx.Client(timeout=TIMEOUT) as client:
        for n in range(args.max_requests):
            if time.monotonic() >= stop_at:
                return
            prompt = PROMPTS[(i + n) % len(PROMPTS)]
            stream = (i + n) % 2 == 0
            t0 = time.monotonic()
            try:
                status, text, tokens, gap = ask(client, url, good_body(prompt, args.max_tokens, stream, args.parallel == 1))
            except httpx.HTTPError as e:
                tally.count("good", type(e).__name__)
                continue
            tally.count("good stream" if stream else "good", status, time.monotonic() - t0)
            if status != 200:
                time.sleep(0.2)  # a 503 (queue full): back off a little
                continue
            want_text, want_tokens = lone[prompt]
            equal = text == want_text and (args.parallel != 1 or tokens == want_tokens)
            with tally.lock:
                tally.good += 1
                tally.good_equal += equal
                tally.latency.append(time.monotonic() - t0)
                if stream:
                    tally.streams += 1
                    tally.max_gap = max(tally.max_gap, gap)
                if not equal and len(tally.mismatches) < 10:
                    tally.mismatches.append({"prompt": prompt, "stream": stream, "got": text, "want": want_text})


def _post(client: httpx.Client, url: str, content: bytes) -> int:
    return client.post(f"{url}/v1/completions", content=content,
                       headers={"content-type": "application/json"}).status_code


def hostile_kinds(url: str) -> dict:
    """Each hostile request, as a function of a client returning its outcome."""
    big = json.dumps({"prompt": list(range(1, 1000)) * 850, "max_tokens": "bad"}).encode()  # ~4 MiB
    deep = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b', "max_tokens": 4}'
    port = int(url.rsplit(":", 1)[1])

    def drop_stream(client: httpx.Client) -> str:
        body = {"prompt": "Once upon a time", "max_tokens": 200, "temperature": 0, "stream": True}
        with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            events = 0
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events += 1
                    if events == 2:
                        break
            return f"{r.status_code} dropped after {events}"

    def drop_body(client: httpx.Client) -> str:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 4194304\r\n\r\n" + b'{"prompt": "' + b"a" * 65536)
        return "dropped"

    return {
        "4 MiB bad field": lambda c: _post(c, url, big),
        "malformed JSON": lambda c: _post(c, url, b'{"prompt": "Once", "max_tokens": '),
        "unknown field": lambda c: _post(c, url, json.dumps({"prompt": "Once", "max_tokens": 2,
                                                             "frobnicate": True}).encode()),
        "huge max_tokens": lambda c: _post(c, url, json.dumps({"prompt": "Once", "max_tokens": 10**12}).encode()),
        "stream dropped": drop_stream,
        "body dropped": drop_body,
        "deep nesting": lambda c: _post(c, url, deep),
        "empty prompt": lambda c: _post(c, url, json.dumps({"prompt": "", "max_tokens": 4}).encode()),
    }


def hostile_client(i: int, url: str, args: argparse.Namespace, stop_at: float, tally: Tally) -> None:
    kinds = list(hostile_kinds(url).items())
    with httpx.Client(timeout=TIMEOUT) as client:
        for n in range(args.max_requests):
            if time.monotonic() >= stop_at:
                return
            name, fn = kinds[(i + n) % len(kinds)]
            t0 = time.monotonic()
            try:
                tally.count(name, fn(client), time.monotonic() - t0)
            except (httpx.HTTPError, OSError) as e:
                tally.count(name, type(e).__name__, time.monotonic() - t0)
            time.sleep(args.pause)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--parallel", type=int, default=1, help="the server's --parallel")
    ap.add_argument("--good", type=int, default=2, help="good clients")
    ap.add_argument("--hostile", type=int, default=2, help="hostile clients")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--max-requests", type=int, default=100_000, help="per client, a bound beside the time")
    ap.add_argument("--pause", type=float, default=0.05, help="seconds a hostile client waits between requests")
    ap.add_argument("--cache-mb", default="1")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--queue", type=int, default=8)
    ap.add_argument("--settle", type=float, default=5.0, help="seconds before the after probe")
    ap.add_argument("--arch", default="qwen3moe")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="bmoe-soak-") as tmp:
        model = Path(tmp) / "tiny.gguf"
        subprocess.run([sys.executable, "-m", "bmoe.cli", "make-tiny", "--arch", args.arch, str(model)], check=True,
                       stdout=subprocess.DEVNULL)
        server = Server(model, args.parallel, args.cache_mb, args.ctx, args.queue)
        try:
            lone: dict[str, tuple[str, list[str]]] = {}
            with httpx.Client(timeout=TIMEOUT) as client:
                for prompt in PROMPTS:  # one at a time, nothing else running: the reference
                    status, text, tokens, _ = ask(client, server.url, good_body(prompt, args.max_tokens, False,
                                                                                 args.parallel == 1))
                    if status != 200:
                        raise SystemExit(f"a lone run failed: status {status}")
                    lone[prompt] = (text, tokens)
            time.sleep(2.0)
            before, load_before = server.probe(), os.getloadavg()
            tally = Tally()
            t0 = tally.t0 = time.monotonic()
            stop_at = t0 + args.minutes * 60
            threads = [threading.Thread(target=good_client, args=(i, server.url, lone, args, stop_at, tally))
                       for i in range(args.good)]
            threads += [threading.Thread(target=hostile_client, args=(i, server.url, args, stop_at, tally))
                        for i in range(args.hostile)]
            for t in threads:
                t.start()
            rss_series = []
            while time.monotonic() < stop_at - 1 and server.proc.poll() is None:
                time.sleep(min(30.0, stop_at - time.monotonic()))
                if server.proc.poll() is None:
                    rss_series.append(server.probe()["rss_mib"])
            for t in threads:
                t.join(180)
            wall = time.monotonic() - t0
            alive = server.proc.poll() is None
            time.sleep(args.settle)
            after, load_after = (server.probe() if alive else None), os.getloadavg()
        finally:
            status = server.stop()
    lat = sorted(tally.latency)
    print(json.dumps({
        "command": " ".join(["python", "bench/soak.py", *sys.argv[1:]]),
        "server": " ".join(["bmoe", *server.cmd[3:]]).replace(str(model), "tiny.gguf"),
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "minutes": round(wall / 60, 2), "parallel": args.parallel, "good_clients": args.good,
        "hostile_clients": args.hostile, "max_tokens": args.max_tokens,
        "before": before, "after": after, "rss_mib_each_30s": rss_series,
        "good_ok": tally.good, "good_equal_to_lone": tally.good_equal, "mismatches": tally.mismatches,
        "compared": "token texts (logprobs) and text" if args.parallel == 1 else "text as returned",
        "good_streams": tally.streams, "max_gap_in_a_stream_s": round(tally.max_gap, 3),
        "good_latency_s": {"p50": round(lat[len(lat) // 2], 3), "max": round(lat[-1], 3)} if lat else None,
        "statuses": {k: dict(v) for k, v in sorted(tally.counts.items())},
        "slowest_s": dict(sorted(tally.slowest.items())),
        "over_1s": [list(x) for x in tally.slow],
        "server_alive_at_end": alive, "server_exit_status": status, "server_tracebacks": server.tracebacks,
        "server_last_lines": list(server.lines)[-5:],
        "load_avg_before": [round(x, 2) for x in load_before], "load_avg_after": [round(x, 2) for x in load_after],
        "how": ("server = a subprocess; /proc/PID/status VmRSS, /proc/PID/fd, /proc/PID/task, /proc/PID/maps lines; "
                "before = after the lone runs + 2 s, after = after the load + settle; gap = wall time between two "
                "SSE data lines of one good stream, seen by the client"),
    }, indent=1))


if __name__ == "__main__":
    main()

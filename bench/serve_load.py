"""Prompt reuse and server load, measured side by side in one run. Nothing is asserted.

1. Time to first token (TTFT) for a ~1000-token prompt, then for a follow-up turn that adds ~50
   tokens (the first prompt, the reply, then new text), on one session with prompt reuse and on one
   without, in interleaved rounds; reports the prompt tokens each call evaluated and the ratio.
2. An OpenAI-compatible server (``bmoe.server``, uvicorn on uvloop, in this process) on 127.0.0.1,
   loaded by 1, 2 and 4 concurrent clients; each client streams its own completions one after the
   other. Reports requests/s and p50 / p95 TTFT (request sent -> first text chunk received), with
   the number of requests each figure rests on.

The default model is the benchmark generator's qwen3-30b-a3b shape cut to 2 layers in q4_0 (written
once into the user cache directory). TTFT here includes the wait for a turn: with one generation at
a time, more clients means a longer queue, which is the point of the figure.

    python bench/serve_load.py [--model M] [--layers 2] [--cache-mb auto] [--rounds 2]
                               [--clients 1,2,4] [--requests 4] [--max-tokens 16]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx
import uvicorn

from bmoe.engine.aio import run as run_async
from bmoe.engine.config import MiB, RunConfig
from bmoe.engine.session import Session
from bmoe.io.probe import cache_dir
from bmoe.server.app import create_app
from bmoe.synth.big import SynthSpec, write_synth

TEXT = ("Streaming experts from disk keeps the dense part of a mixture of experts in memory and reads "
        "only the experts each token routes to, at the moment they are needed. ")


def prompt_tokens(session: Session, n: int, salt: str = "") -> list[int]:
    """About ``n`` tokens of text (exactly ``n`` after trimming)."""
    text = salt
    while len(session.tokenize(text)) < n:
        text += TEXT
    return session.tokenize(text)[:n]


async def ttft(session: Session, tokens: list[int], n: int) -> tuple[float, list[int], int]:
    """Seconds to the first piece, the tokens generated, and the prompt tokens evaluated."""
    t0 = time.perf_counter()
    first = None
    out: list[int] = []
    evaluated = -1
    async for piece in session.stream(tokens, n, stop_at_end=False):
        if first is None:
            first = time.perf_counter() - t0
        if piece.token is not None:
            out.append(piece.token)
        if piece.usage is not None:
            evaluated = piece.usage.prompt_evaluated
    assert first is not None
    return first, out, evaluated


async def reuse_round(path: Path, config: RunConfig, n_prompt: int, n_follow: int, n_reply: int) -> dict:
    with Session.open(path, config) as s:
        first = prompt_tokens(s, n_prompt)
        t1, reply, e1 = await ttft(s, first, n_reply)
        follow = first + reply + prompt_tokens(s, n_follow + 1, "And then: ")[1:]  # drop the second BOS
        t2, _, e2 = await ttft(s, follow, n_reply)
    return {"first_ttft_s": t1, "first_evaluated": e1, "follow_ttft_s": t2, "follow_evaluated": e2,
            "follow_prompt_tokens": len(follow)}


def measure_reuse(path: Path, base: dict, rounds: int, n_prompt: int, n_follow: int) -> dict:
    runs: dict[str, list[dict]] = {"reuse": [], "no reuse": []}
    for _ in range(rounds):
        for name, reuse in (("reuse", True), ("no reuse", False)):
            runs[name].append(run_async(reuse_round(path, RunConfig(**base, reuse_prompt=reuse), n_prompt, n_follow, 4)))
    table = {}
    for name, rs in runs.items():
        table[name] = {
            "first_ttft_s": round(statistics.median(r["first_ttft_s"] for r in rs), 3),
            "follow_ttft_s": round(statistics.median(r["follow_ttft_s"] for r in rs), 3),
            "first_evaluated": rs[0]["first_evaluated"], "follow_evaluated": rs[0]["follow_evaluated"],
            "follow_prompt_tokens": rs[0]["follow_prompt_tokens"],
        }
    table["follow_ttft_no_reuse_over_reuse"] = round(
        table["no reuse"]["follow_ttft_s"] / table["reuse"]["follow_ttft_s"], 2)
    return table


class Served:
    """The server on a free loopback port in a thread of this process."""

    def __init__(self, session: Session, max_waiting: int) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(create_app(session, max_waiting=max_waiting),
                                                    loop="uvloop", log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> Served:
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise SystemExit("the server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(60)
        self.sock.close()


def one_request(url: str, prompt: str, max_tokens: int) -> float:
    """Stream one completion; seconds from sending to the first text chunk."""
    t0 = time.perf_counter()
    first = None
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter() - t0
    assert first is not None
    return first


def measure_server(path: Path, base: dict, clients: list[int], requests: int, max_tokens: int,
                   parallel: int = 1) -> list[dict]:
    rows = []
    config = RunConfig(**{**base, "n_ctx": max(base["n_ctx"], 1024 * parallel)}, parallel=parallel)
    with Session.open(path, config) as session, Served(session, max(clients)) as served:
        one_request(served.url, "warm up", 2)
        for c in clients:
            ttfts: list[float] = []
            lock = threading.Lock()

            def client(i: int) -> None:
                for j in range(requests):
                    t = one_request(served.url, f"Client {i}, question {j}: {TEXT * 2}", max_tokens)
                    with lock:
                        ttfts.append(t)

            t0 = time.perf_counter()
            threads = [threading.Thread(target=client, args=(i,)) for i in range(c)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - t0
            q = statistics.quantiles(ttfts, n=20, method="inclusive")
            rows.append({"clients": c, "requests": len(ttfts), "requests_per_s": round(len(ttfts) / wall, 3),
                         "ttft_p50_s": round(statistics.median(ttfts), 3), "ttft_p95_s": round(q[18], 3),
                         "max_tokens": max_tokens, "parallel": parallel})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path)
    ap.add_argument("--layers", type=int, default=2, help="layers of the default synth model")
    ap.add_argument("--cache-mb", default="auto", help="expert cache budget (MiB or auto)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--follow-tokens", type=int, default=50)
    ap.add_argument("--clients", default="1,2,4")
    ap.add_argument("--requests", type=int, default=4, help="requests per client")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--parallel", default="1", help="server --parallel values to measure, e.g. 1,4 (the server part)")
    ap.add_argument("--server-only", action="store_true", help="skip the prompt-reuse part")
    args = ap.parse_args()
    spec = SynthSpec(like="qwen3-30b-a3b", n_layer=args.layers, wtype="q4_0")
    path = args.model or cache_dir() / "bench" / spec.file_name()
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        print(f"writing {path} once", file=sys.stderr)
        write_synth(path, spec)
    cache = None if args.cache_mb == "auto" else int(float(args.cache_mb) * MiB)
    base = {"cache_bytes": cache, "n_ctx": 2048, "n_threads": args.threads}
    reuse = None if args.server_only else measure_reuse(path, base, args.rounds, args.prompt_tokens, args.follow_tokens)
    print(json.dumps({"reuse": reuse}), file=sys.stderr)
    server = [row for p in (int(x) for x in args.parallel.split(","))
              for row in measure_server(path, base, [int(c) for c in args.clients.split(",")], args.requests,
                                        args.max_tokens, p)]
    print(json.dumps({
        "model": str(path), "cache": args.cache_mb, "how": (
            "TTFT = wall time from the call (or the HTTP request) to the first piece (or first SSE chunk); "
            "medians over rounds (reuse) or requests (server); requests/s = requests / wall time of the load"),
        "reuse": reuse, "server": server,
    }, indent=1))


if __name__ == "__main__":
    main()

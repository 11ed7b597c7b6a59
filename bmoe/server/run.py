"""Run the server: uvicorn on uvloop (when installed), on a socket bound before the model opens so
that a port of 0 can be reported, and a line on stderr once requests are accepted."""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import uvicorn

from bmoe.engine.config import RunConfig
from bmoe.engine.session import Session
from bmoe.errors import ConfigError
from bmoe.server.app import create_app


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (port 0: a free one), or one clear ConfigError."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ConfigError(f"--host {host}: {exc.strerror}") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Server(uvicorn.Server):
    """uvicorn that ends the app's work at once on a stop signal and leaves the exit to the caller.

    ``handle_exit`` first tells the app (``app.state.bmoe``) to shut down: the running generation
    is cancelled and ends normally (a stream with its last chunk and ``data: [DONE]``) and waiting
    requests get 503, where uvicorn alone waited out its graceful timeout and then cut the stream
    off and cancelled the tasks. It also stops gracefully on SIGHUP; its own signal capture
    re-raised SIGTERM at once after the shutdown, which killed the process before the session was
    closed (a route trace was left empty)."""

    stopped_by: int | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        state = getattr(self.config.app, "state", None)
        app_server = getattr(state, "bmoe", None)
        if app_server is not None:
            app_server.request_shutdown()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def on_signal(signum: int, frame: FrameType | None) -> None:
            if self.stopped_by is None:
                self.stopped_by = signum
            elif signum == signal.SIGINT:
                # A second SIGINT forces the exit: uvicorn cancels the app's lifespan task, and
                # starlette reports that cancel as a failed shutdown with its traceback.
                logging.getLogger("uvicorn.error").setLevel(logging.CRITICAL)
            self.handle_exit(signum, frame)  # a second SIGINT forces the exit

        originals = {sig: signal.signal(sig, on_signal) for sig in STOP_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)


def serve(model: str | Path, config: RunConfig, *, host: str = "127.0.0.1", port: int = 8080,
          api_key: str | None = None, max_waiting: int = 8, max_body: int | None = None,
          quiet: bool = False, reuse_prompt: bool = True, webui: bool = True,
          cors_origins: tuple[str, ...] = ()) -> int | None:
    """Serve until a stop signal; returns that signal's number (None if the server ended by
    itself), after the session is closed and its sinks (a route trace) are written out."""
    sock = bind(host, port)
    bound = sock.getsockname()[1]
    try:
        session = Session.open(model, config)  # before uvicorn: a bad file is one line, not a traceback
    except BaseException:
        sock.close()
        raise

    def ready(session: Session) -> None:
        for warning in session.warnings:
            print(f"bmoe: warning: {warning}", file=sys.stderr)
        if not quiet:
            where = f"[{host}]" if ":" in host else host
            page = f", chat page http://{where}:{bound}/," if webui else ""
            print(f"bmoe serve: {session.model_name}{page} on http://{where}:{bound}/v1"
                  f"{' (API key required)' if api_key else ''}", file=sys.stderr, flush=True)
            n = session.config.parallel
            print(f"bmoe serve: {n} sequence{'s' if n > 1 else ''} decoded together ({session.n_ctx_seq} tokens of "
                  f"context each; --parallel N changes it)" if n > 1 else
                  "bmoe serve: one generation at a time (--parallel N decodes N requests together)",
                  file=sys.stderr, flush=True)

    kw = {} if max_body is None else {"max_body": max_body}
    app = create_app(session, api_key=api_key, max_waiting=max_waiting, on_ready=ready, reuse_prompt=reuse_prompt,
                     webui=webui, cors_origins=cors_origins, **kw)
    try:
        import uvloop  # noqa: F401

        loop = "uvloop"
    except ImportError:
        loop = "asyncio"
    server = Server(uvicorn.Config(app, loop=loop, log_level="warning", lifespan="on", timeout_graceful_shutdown=5))
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        session.close()
    return server.stopped_by

"""The routes: OpenAI's chat and text completions (JSON or server-sent events), models, health and
Prometheus metrics, over one Session on the server's own event loop.

A generation request goes: body read within a size limit, validated (400 in OpenAI's error shape),
admitted to the wait list (503 with Retry-After when full), waits its turn (FIFO), then the engine's
``bmoe.engine.completions`` answers it. Nothing is sent before the engine has accepted the request,
so a prompt longer than the context is still a 400 when ``stream`` is true. From admission on, a
listener watches for the client going away: while the request waits, its wait is cancelled; while
it generates, the generation is cancelled at its next MoE layer and the next request runs normally.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing, asynccontextmanager
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from bmoe.engine.completions import chat_completion, completion
from bmoe.engine.config import RunConfig
from bmoe.engine.session import Session
from bmoe.errors import BmoeError, ConfigError, SessionClosedError
from bmoe.server.metrics import ServerMetrics
from bmoe.server.schemas import ChatRequest, CompletionRequest
from bmoe.server.turns import QueueFull, Turns

log = logging.getLogger("bmoe.server")
MAX_BODY_BYTES = 4 << 20
RETRY_AFTER_S = 2


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _error(status: int, message: str, kind: str = "invalid_request_error", **kw: Any) -> JSONResponse:
    headers = kw.pop("headers", None)
    return JSONResponse(error_body(message, kind, **kw), status_code=status, headers=headers)


class _BadRequest(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


async def _read_json(request: Request, limit: int) -> Any:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _BadRequest(413, f"the request body is larger than {limit} bytes")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise _BadRequest(413, f"the request body is larger than {limit} bytes")
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise _BadRequest(400, f"the body is not valid JSON: {exc}") from None


def _validation_message(exc: ValidationError) -> tuple[str, str | None]:
    first = exc.errors()[0]
    where = ".".join(str(x) for x in first.get("loc", ()))
    return (f"{where}: {first.get('msg')}" if where else str(first.get("msg"))), (where or None)


class _Server:
    """What the routes share: the session, the turns, the metrics, the settings."""

    def __init__(self, session: Session | None, opener: Callable[[], Session] | None, *, api_key: str | None,
                 max_waiting: int, max_body: int, model_name: str | None) -> None:
        self.session = session
        self._opener = opener
        self.api_key = api_key
        self.turns = Turns(max_waiting)
        self.metrics = ServerMetrics(lambda: self.turns.waiting)
        self.max_body = max_body
        self.model_name = model_name
        self.created = int(time.time())
        self._owns = session is None

    def open(self) -> None:
        if self.session is None and self._opener is not None:
            self.session = self._opener()
        if self.model_name is None and self.session is not None:
            self.model_name = self.session.model_name

    def close(self) -> None:
        if self._owns and self.session is not None:
            self.session.close()


class _Generation(Response):
    """The answer to one completion request, decided only once the engine has accepted it: an error
    (4xx / 503), a JSON body, or a stream of server-sent events ending ``data: [DONE]``."""

    def __init__(self, server: _Server, run: Callable[[], Awaitable[Any]], stream: bool) -> None:
        self._server, self._run, self._stream = server, run, stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        server = self._server
        try:
            server.turns.admit()
        except QueueFull:
            server.metrics.requests.labels("busy").inc()
            await _error(503, "the server is busy: every place in the queue is taken", "server_busy",
                         headers={"Retry-After": str(RETRY_AFTER_S)})(scope, receive, send)
            return
        me = asyncio.current_task()
        state = {"turn": False, "gone": False}

        async def listen() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            state["gone"] = True
            if state["turn"]:
                if server.session is not None:
                    server.session.cancel()  # ours is the running generation: stop it at its next MoE layer
            elif me is not None:
                me.cancel()  # still waiting: give up the place

        listener = asyncio.create_task(listen())
        outcome = "ok"
        try:
            await server.turns.wait_turn()
            state["turn"] = True
            if server.session is None or server.session.closed:
                raise SessionClosedError("the model is not open")
            result = await self._run()
            if not self._stream:
                await JSONResponse(result)(scope, receive, send)
                return
            await self._send_events(result, send, state)
        except asyncio.CancelledError:
            outcome = "disconnected"
            if not state["gone"]:
                raise
            if me is not None:
                me.uncancel()  # the listener's own cancel, now handled
        except ConfigError as exc:
            outcome = "bad_request"
            await _error(400, str(exc))(scope, receive, send)
        except SessionClosedError as exc:
            outcome = "unavailable"
            await _error(503, str(exc), "server_error")(scope, receive, send)
        except BmoeError as exc:
            outcome = "error"
            log.error("generation failed: %s", exc)
            await _error(500, str(exc), "server_error")(scope, receive, send)
        finally:
            listener.cancel()
            if state["gone"] and outcome == "ok":
                outcome = "disconnected"
            server.metrics.requests.labels(outcome).inc()
            if state["turn"] and server.session is not None:
                server.metrics.record(server.session.last_stats, server.session.last_usage)
            server.turns.leave(state["turn"])

    async def _send_events(self, chunks: AsyncIterator[dict[str, Any]], send: Send, state: dict) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
        ]})
        try:
            async with aclosing(chunks):
                async for chunk in chunks:
                    if state["gone"]:
                        break
                    data = b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"
                    await send({"type": "http.response.body", "body": data, "more_body": True})
        except BmoeError as exc:  # the status line is out: the failure goes as an event
            log.error("generation failed mid-stream: %s", exc)
            data = b"data: " + json.dumps(error_body(str(exc), "server_error")).encode() + b"\n\n"
            await send({"type": "http.response.body", "body": data, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


def create_app(
    session: Session | None = None, *, model: str | Path | None = None, config: RunConfig | None = None,
    api_key: str | None = None, max_waiting: int = 8, max_body: int = MAX_BODY_BYTES,
    model_name: str | None = None, on_ready: Callable[[Session], None] | None = None,
) -> Starlette:
    """The ASGI application: around an open ``session`` (left open at shutdown), or opening
    ``model`` with ``config`` at startup (closed at shutdown)."""
    if (session is None) == (model is None):
        raise ConfigError("give the server either an open session or a model path")
    opener = None if model is None else (lambda: Session.open(model, config))
    server = _Server(session, opener, api_key=api_key, max_waiting=max_waiting, max_body=max_body,
                     model_name=model_name)

    async def parse(request: Request, schema: type) -> Any:
        body = await _read_json(request, server.max_body)
        if not isinstance(body, dict):
            raise _BadRequest(400, "the body must be a JSON object")
        try:
            return schema.model_validate(body)
        except ValidationError as exc:
            message, param = _validation_message(exc)
            raise _BadRequest(400, message, param) from None

    async def chat(request: Request) -> Response:
        req = await parse(request, ChatRequest)
        kw = req.engine_kwargs()
        return _Generation(server, lambda: chat_completion(
            server.session, req.messages, stream=req.stream, model=req.model, **kw), req.stream)

    async def completions(request: Request) -> Response:
        req = await parse(request, CompletionRequest)
        kw = req.engine_kwargs()
        return _Generation(server, lambda: completion(
            server.session, req.prompt, stream=req.stream, model=req.model, **kw), req.stream)

    async def models(_: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": server.model_name, "object": "model", "created": server.created, "owned_by": "bmoe"}]})

    async def health(_: Request) -> Response:
        if server.session is None or server.session.closed:
            return _error(503, "the model is not open", "server_error")
        return JSONResponse({"status": "ok"})

    async def metrics(_: Request) -> Response:
        return Response(server.metrics.render(), media_type=server.metrics.content_type)

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        server.open()
        if on_ready is not None and server.session is not None:
            on_ready(server.session)
        try:
            yield
        finally:
            server.close()

    async def bad_request(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, _BadRequest)
        server.metrics.requests.labels("bad_request").inc()  # refused before it reached the queue
        return _error(exc.status, exc.message, param=exc.param)

    async def http_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return _error(exc.status_code, str(exc.detail))

    async def crash(_: Request, exc: Exception) -> Response:
        log.error("request failed: %r", exc)
        return _error(500, "internal error", "server_error")

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
        ],
        exception_handlers={_BadRequest: bad_request, HTTPException: http_error, Exception: crash},
        lifespan=lifespan,
    )
    app.state.bmoe = server
    if api_key is not None:
        return _with_api_key(app, api_key)
    return app


def _with_api_key(app: Starlette, key: str) -> Any:
    """Every route but /health requires ``Authorization: Bearer <key>`` (401 otherwise)."""
    expected = f"Bearer {key}".encode()

    async def guarded(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("path") != "/health":
            given = dict(scope.get("headers") or ()).get(b"authorization", b"")
            if not hmac.compare_digest(given, expected):
                await _error(401, "a valid API key is required (Authorization: Bearer KEY)",
                             code="invalid_api_key")(scope, receive, send)
                return
        await app(scope, receive, send)

    guarded.state = app.state  # type: ignore[attr-defined]
    return guarded

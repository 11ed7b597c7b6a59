"""``bmoe serve``: its parser, registered only when the command line names it (``_LAZY``), and
its command, which alone imports the server package (starlette, uvicorn)."""

from __future__ import annotations

import argparse
import os
import signal
import sys

from bmoe.cli.flags import (
    _check_outputs,
    _common_flags,
    _config,
    _Help,
    _model_files,
    _model_flag,
    _number,
    _verbosity_flags,
)
from bmoe.errors import ConfigError


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (chat and text completions)",
                       formatter_class=_Help)
    _model_flag(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (loopback by default)")
    p.add_argument("--port", type=_number(int, 0, 65535, "a port"), default=8080, help="port (0: any free one, printed at start)")
    # No default here: the help prints defaults, and $BMOE_API_KEY is a secret (read in _cmd_serve).
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health and the page "
                        "(default: $BMOE_API_KEY, never shown)")
    p.add_argument("--queue", type=_number(int, 0, 10_000, "a queue length"), default=8,
                   help="requests that may wait for their turn; more get 503 with Retry-After")
    p.add_argument("--no-prompt-reuse", action="store_true",
                   help="evaluate every prompt from its first token (no request reuses the context's; "
                        "a request's own cache_prompt: false does so for itself): two identical seeded "
                        "requests then give the same bits")
    p.add_argument("--no-webui", action="store_true",
                   help="no chat page at / (a JSON 404 there, as any unknown path)")
    p.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                   help="let a web page from ORIGIN (http://host:port, or * for any) call the server; "
                        "repeat for more (default: none, same origin only)")
    _common_flags(p)
    _verbosity_flags(p)
    p.set_defaults(mode="stream", func=_cmd_serve)


def _cmd_serve(args: argparse.Namespace) -> int:
    _check_outputs(args, _model_files(args.model), "--route-trace", "--cache-profile")
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be 0..65535, got {args.port}")
    if not 0 <= args.queue <= 10_000:
        raise ConfigError(f"--queue must be 0..10000, got {args.queue}")
    for origin in args.cors_origin:
        if origin != "*" and not (origin.startswith(("http://", "https://")) and origin.count("/") == 2):
            raise ConfigError(f"--cors-origin {origin!r}: an origin is scheme://host[:port] (no path), or *")
    config = _config(args)
    from bmoe.server.run import serve

    api_key = args.api_key if args.api_key is not None else os.environ.get("BMOE_API_KEY")
    stopped_by = serve(args.model, config, host=args.host, port=args.port, api_key=api_key or None,
                       max_waiting=args.queue, quiet=args.quiet, reuse_prompt=not args.no_prompt_reuse,
                       webui=not args.no_webui, cors_origins=tuple(args.cors_origin))
    if stopped_by is not None:
        # The session is closed and its route trace written. The line is the server's own: the
        # CLI's for Interrupted speaks of a run's output.
        if not args.quiet:
            print(f"bmoe serve: stopped by {signal.Signals(stopped_by).name}", file=sys.stderr, flush=True)
        return 128 + stopped_by
    return 0

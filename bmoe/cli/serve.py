"""``bmoe serve``: its parser, registered only when the command line names it (``_LAZY``), and
its command, which alone imports the server package (starlette, uvicorn)."""

from __future__ import annotations

import argparse
import os

from bmoe.cli.edge import Interrupted
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
    p.add_argument("--api-key", default=os.environ.get("BMOE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every route but /health (or $BMOE_API_KEY)")
    p.add_argument("--queue", type=_number(int, 0, 10_000, "a queue length"), default=8,
                   help="requests that may wait for their turn; more get 503 with Retry-After")
    _common_flags(p)
    _verbosity_flags(p)
    p.set_defaults(mode="stream", func=_cmd_serve)


def _cmd_serve(args: argparse.Namespace) -> int:
    _check_outputs(args, _model_files(args.model), "--route-trace", "--cache-profile")
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be 0..65535, got {args.port}")
    if not 0 <= args.queue <= 10_000:
        raise ConfigError(f"--queue must be 0..10000, got {args.queue}")
    config = _config(args)
    from bmoe.server.run import serve

    stopped_by = serve(args.model, config, host=args.host, port=args.port, api_key=args.api_key or None,
                       max_waiting=args.queue, quiet=args.quiet)
    if stopped_by is not None:
        raise Interrupted(stopped_by)  # the session is closed and its route trace written
    return 0

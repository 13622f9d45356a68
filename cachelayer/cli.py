"""The `cachelayer` console script: one table of subcommands, each a (configure, run) pair."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence


def _configure_controller(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address for HTTP and the worker monitor socket")
    parser.add_argument("--port", type=int, default=9000, help="HTTP port of the controller API")
    parser.add_argument(
        "--monitor-port",
        type=int,
        default=9001,
        help="ZMQ port workers register and heartbeat on (controller_pull_url)",
    )
    parser.add_argument(
        "--auth-secret-env",
        metavar="NAME",
        help="environment variable holding the shared secret: HTTP callers send it as a bearer token, "
        "workers sign their messages with it (controller_auth_secret_env on the engines)",
    )
    parser.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help="listen beyond loopback without a secret (only on a network where every host is trusted)",
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=1 << 20,
        help="most tokens one request may carry (413 beyond); engines: controller_max_tokens",
    )


def _run_controller(args: argparse.Namespace) -> int:
    from cachelayer.controller.server import serve

    serve(
        args.host,
        args.port,
        args.monitor_port,
        auth_secret_env=args.auth_secret_env,
        allow_unauthenticated=args.allow_unauthenticated,
        max_tokens=args.max_tokens,
    )
    return 0


def _configure_server(parser: argparse.ArgumentParser) -> None:
    from cachelayer.server.main import add_arguments

    add_arguments(parser)


def _run_server(args: argparse.Namespace) -> int:
    from cachelayer.server.main import run

    return run(args)


# name -> (help, add the arguments, run)
COMMANDS: dict[
    str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]
] = {
    "controller": ("LMCache-compatible controller API", _configure_controller, _run_controller),
    "server": ("shared cache daemon: ZMQ data plane, /healthcheck, /metrics", _configure_server, _run_server),
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cachelayer", description="kvgate's KV cache layer")
    subcommands = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, configure, _) in COMMANDS.items():
        configure(subcommands.add_parser(name, help=help_text))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return COMMANDS[args.command][2](args)


if __name__ == "__main__":
    sys.exit(main())

"""The `cachelayer` console script: one table of subcommands, each a (configure, run) pair."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from typing import NamedTuple

from kvgate_common.help_format import DefaultsHelpFormatter


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


class Command(NamedTuple):
    help: str  # one line, in `cachelayer --help`
    description: str  # what `cachelayer NAME --help` explains
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


COMMANDS: dict[str, Command] = {
    "controller": Command(
        "LMCache-compatible controller API",
        "Serve the LMCache controller's HTTP API (lookup, clear, pin, move, compress, health) over the "
        "cache-layer workers that register on the monitor socket; tools written for LMCache's "
        "controller work against it unchanged.",
        _configure_controller,
        _run_controller,
    ),
    "server": Command(
        "shared cache daemon: ZMQ data plane, /healthcheck, /metrics",
        "Run the cache daemon several engines share: their connectors store and fetch KV chunks over "
        "its ZMQ data plane (the port of LMCache's multiprocess server), so a prefix one engine "
        "computed is loaded by the others; /healthcheck and /metrics on the HTTP port.",
        _configure_server,
        _run_server,
    ),
}


# The top-level packages of pyproject.toml's extras: a plain `pip install kvgate` (the gateway) has
# none of them, and a command that needs one says which extra to install instead of a traceback.
EXTRA_FOR_MODULE = {"torch": "cachelayer", "numba": "cachelayer", "redis": "cachelayer", "triton": "gpu"}


def missing_extra_message(command_name: str, error: ModuleNotFoundError) -> str | None:
    """One line naming the extra that brings the module `error` lacks; None for any other module
    (a real bug, left to raise)."""
    missing = (error.name or "").split(".")[0]
    extra = EXTRA_FOR_MODULE.get(missing)
    if extra is None:
        return None
    return (
        f"cachelayer {command_name}: needs {missing}, which is not installed here; "
        f"install the cache layer with: pip install 'kvgate[{extra}]'"
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="cachelayer", description="kvgate's KV cache layer", formatter_class=DefaultsHelpFormatter
    )
    subcommands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    unavailable: dict[str, str] = {}  # command -> the one line that says what to install
    for name, command in COMMANDS.items():
        try:
            # On a parser of its own first: configuring imports the command's modules, and the
            # line in `cachelayer --help` must say when they are not installed.
            command.configure(argparse.ArgumentParser(add_help=False))
        except ModuleNotFoundError as error:
            message = missing_extra_message(name, error)
            if message is None:
                raise
            unavailable[name] = message
            extra = message.rsplit(": ", 1)[1]
            subcommands.add_parser(name, help=f"{command.help} (not installed: {extra})")
            continue
        subparser = subcommands.add_parser(
            name, help=command.help, description=command.description, formatter_class=DefaultsHelpFormatter
        )
        command.configure(subparser)
        subparser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    # The first word that is not an option names the command (the top level has only -h).
    chosen = next((word for word in argv if not word.startswith("-")), None)
    if chosen in unavailable:
        print(unavailable[chosen], file=sys.stderr)
        return 1
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return COMMANDS[args.command].run(args)
    except ModuleNotFoundError as error:
        message = missing_extra_message(args.command, error)
        if message is None:
            raise
        print(message, file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

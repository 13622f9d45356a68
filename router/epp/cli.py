"""`kvgate epp --config proxy.yaml`: run the endpoint picker, the ext_proc gRPC server on `epp.host:
epp.port`, over the same core as `kvgate serve`; the admin API, /metrics, /health and
/debug/prefix-map stay on the HTTP listener (`listen.host:listen.port`), without the proxy's
forwarded paths (the picker relays no bytes).

Its top-level imports are light: `kvgate` builds this parser without gRPC installed, and `run` says
how to install it when it is missing.
"""

from __future__ import annotations

import argparse
import os
import sys

from router.serve import CONFIG_ENV

INSTALL_HINT = "pip install 'kvgate[epp]'"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        default=os.environ.get(CONFIG_ENV) or None,
        help=f"path to proxy.yaml (its `epp:` section configures the picker); {CONFIG_ENV} gives it too",
    )
    parser.add_argument("--epp-host", help="gRPC listen address (overrides epp.host)")
    parser.add_argument("--epp-port", type=int, help="gRPC listen port (overrides epp.port)")
    parser.add_argument("--host", help="HTTP listen address for admin and metrics (overrides listen.host)")
    parser.add_argument(
        "--port", type=int, help="HTTP listen port for admin and metrics (overrides listen.port)"
    )
    parser.add_argument(
        "--log-level", choices=["debug", "info", "warning", "error"], help="overrides log_level of the config"
    )


def missing_grpc() -> str | None:
    """What is missing of the `epp` extra, None when it is all there."""
    try:
        import envoy.service.ext_proc.v3.external_processor_pb2  # noqa: F401
        import grpc_health.v1.health_pb2  # noqa: F401
        import hpack  # noqa: F401
    except ImportError as exc:
        return exc.name or str(exc)
    return None


def run(args: argparse.Namespace) -> int:
    missing = missing_grpc()
    if missing is not None:
        print(
            f"kvgate epp needs the packages of the `epp` extra (missing: {missing}): {INSTALL_HINT}",
            file=sys.stderr,
        )
        return 2
    from router.app import create_app
    from router.config import ConfigError, check_admin_exposure, check_epp_exposure, load_config
    from router.epp.server import EppServer
    from router.startup import cannot_listen, configure_logging, serve_app, server_class

    if args.config is None:
        print(f"kvgate: give --config proxy.yaml (or set {CONFIG_ENV})", file=sys.stderr)
        return 2
    try:
        config = load_config(args.config)
        if args.epp_host is not None:
            config.epp.host = args.epp_host
        if args.epp_port is not None:
            config.epp.port = args.epp_port
        host = args.host or config.listen.host
        port = config.listen.port if args.port is None else args.port
        check_admin_exposure(config, host, args.config, "--host" if args.host else "listen.host")
        epp_where = "--epp-host" if args.epp_host else "epp.host"
        check_epp_exposure(config, config.epp.host, args.config, epp_where)
        if config.listen.workers != 1:
            raise ConfigError(
                f"{args.config}: invalid configuration at `listen.workers`: kvgate epp runs one process; "
                "run several pickers behind Envoy (with `cluster:`) instead"
            )
    except ConfigError as exc:
        print(f"kvgate: {exc}", file=sys.stderr)
        return 2
    log_level = args.log_level or config.log_level
    configure_logging(log_level)
    for what, (listen_host, listen_port), fix in (
        ("HTTP", (host, port), "listen.port or --port"),
        ("gRPC", (config.epp.host, config.epp.port), "epp.port or --epp-port"),
    ):
        refusal = cannot_listen(listen_host, listen_port, fix=fix, what=what)
        if refusal is not None:
            print(refusal, file=sys.stderr)
            return 2
    # uvloop, as `kvgate serve`: the gRPC server (router/epp/grpc_server.py) runs on the same loop.
    options = {
        "host": host,
        "port": port,
        "loop": "uvloop",
        "log_level": log_level,
        "access_log": False,
        "lifespan": "on",
    }
    return serve_app(
        config,
        args.config,
        lambda: create_app(config, proxy=False, faces=[EppServer(config)]),
        lambda app: options,
        server=server_class(),
    )

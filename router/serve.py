"""`kvgate serve`: load proxy.yaml, build the gateway app and run it on uvicorn (uvloop + httptools,
with the gateway's own protocol class from router/http_server.py)."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys

# Where --config is read from when the flag is not given (a container sets it once).
CONFIG_ENV = "KVGATE_CONFIG"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from_env = os.environ.get(CONFIG_ENV) or None
    parser.add_argument(
        "--config",
        default=from_env,
        required=from_env is None,
        help=f"path to proxy.yaml; the environment variable {CONFIG_ENV} gives it for every run",
    )
    parser.add_argument("--host", help="listen address (overrides listen.host)")
    parser.add_argument("--port", type=int, help="listen port (overrides listen.port)")
    parser.add_argument(
        "--log-level", choices=["debug", "info", "warning", "error"], help="overrides log_level of the config"
    )


def check_listen_address(host: str, port: int) -> None:
    """Bind every address `host` resolves to on `port` as uvicorn will (SO_REUSEADDR), then let go:
    a port another process listens on fails here, at once, instead of after the simulated engines
    have started. Raises OSError (strerror says why)."""
    for family, kind, proto, _, address in socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    ):
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                # As asyncio's create_server: the IPv6 socket does not also claim the IPv4 port.
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from router.app import create_app
    from router.config import ConfigError, check_admin_exposure, load_config
    from router.http_server import gateway_http_protocol
    from router.policies import PolicyUnavailable

    try:
        config = load_config(args.config)
        host = args.host or config.listen.host
        check_admin_exposure(config, host, args.config, "--host" if args.host else "listen.host")
    except ConfigError as exc:
        print(f"kvgate: {exc}", file=sys.stderr)
        return 2
    port = config.listen.port if args.port is None else args.port
    log_level = args.log_level or config.log_level
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        check_listen_address(host, port)
    except OSError as exc:
        print(
            f"kvgate: cannot listen on {host}:{port} ({exc.strerror}): stop what holds the port, "
            "or choose another with listen.port in the config or --port",
            file=sys.stderr,
        )
        return 2
    fleet = None
    if config.launch is not None and config.launch.simulated_engines is not None:
        # `launch:` asks for simulated engines (router/sim): start them, route to them, stop them on exit.
        from router.sim.launcher import LaunchError, launch_simulated_engines

        try:
            fleet = launch_simulated_engines(config.launch.simulated_engines, config)
        except LaunchError as exc:
            print(f"kvgate: {args.config}: {exc}", file=sys.stderr)
            return 2
        config.backends.extend(fleet.backends)
    try:
        try:
            app = create_app(config)
        except PolicyUnavailable as exc:
            print(f"kvgate: {args.config}: {exc}", file=sys.stderr)
            return 2
        server = uvicorn.Server(
            uvicorn.Config(
                app,
                host=host,
                port=port,
                loop="uvloop",
                # uvicorn's httptools protocol plus the direct path for the generation routes.
                http=gateway_http_protocol(app.state.gateway, app.fast_endpoints.values()),
                log_level=log_level,
                access_log=False,
                # X-Forwarded-* rewriting is not used by the gateway and costs CPU on every request.
                proxy_headers=False,
                # The backend's own Server and Date headers pass through; uvicorn must not add a second pair.
                server_header=False,
                date_header=False,
                # Clients (and benchmark load) keep connections open between requests.
                timeout_keep_alive=75,
                backlog=4096,
            )
        )
        try:
            server.run()
        except KeyboardInterrupt:
            # uvicorn has already shut down gracefully; it re-raises the interrupt so the exit
            # status says so. Exit 130 (interrupted) without a traceback.
            return 130
        return 0
    finally:
        if fleet is not None:
            fleet.stop()

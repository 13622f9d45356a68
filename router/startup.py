"""The start-up `kvgate serve` (router/serve.py) and `kvgate epp` (router/epp/cli.py) share, once each
has its configuration: the log format, the check that a listen address is free before anything is
launched, the simulated engines `launch:` asks for, and the app served on uvicorn until it stops,
with the exit status that says how it ended.

Its top-level imports are light (the standard library): uvicorn and the app are imported when a
command runs.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from starlette.applications import Starlette

    from router.config import Config
    from router.launch import SimulatedFleet

# A worker writes a heartbeat this often from its event loop (uvicorn's 0.1 s tick, every 5th).
HEARTBEAT_TICKS = 5


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


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


def cannot_listen(host: str, port: int, *, fix: str, what: str | None = None) -> str | None:
    """The line to print when host:port cannot be listened on (`what`: which listener, where a
    command has several; `fix`: the settings that choose another port); None when it is free."""
    try:
        check_listen_address(host, port)
    except OSError as exc:
        listener = "" if what is None else f" ({what})"
        return (
            f"kvgate: cannot listen{listener} on {host}:{port} ({exc.strerror}): stop what holds the port, "
            f"or choose another with {fix}"
        )
    return None


@functools.cache
def server_class() -> type:
    """uvicorn's Server, noting whether SIGINT stopped it (imported when a command runs)."""
    import uvicorn

    class InterruptibleServer(uvicorn.Server):
        interrupted = False
        # A worker's end of its supervisor's heartbeat pipe (--heartbeat-fd).
        heartbeat_fd: int | None = None
        # `listen.huge_pages`: the heap onto huge pages once started (router/huge_pages.py).
        huge_pages = False

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets=sockets)
            if self.started and self.huge_pages:
                from router.huge_pages import collapse_heap_in_background

                collapse_heap_in_background()

        def handle_exit(self, sig: int, frame: Any) -> None:
            if sig == signal.SIGINT:
                self.interrupted = True
            super().handle_exit(sig, frame)

        async def on_tick(self, counter: int) -> bool:
            # Written from the event loop itself: a heartbeat says the loop runs, so requests do.
            if self.heartbeat_fd is not None and counter % HEARTBEAT_TICKS == 0:
                with contextlib.suppress(BlockingIOError, BrokenPipeError):
                    os.write(self.heartbeat_fd, b".")
            return await super().on_tick(counter)

    return InterruptibleServer


def launch_simulated_engines(config: Config) -> SimulatedFleet | None:
    """Start the simulated engines `launch:` asks for and add them to the backends (None when it asks
    for none); raises LaunchError."""
    if config.launch is None or config.launch.simulated_engines is None:
        return None
    from router.launch import launch_simulated_engines as launch

    fleet = launch(config.launch.simulated_engines, config)
    config.backends.extend(fleet.backends)
    return fleet


def serve_app(
    config: Config,
    source: str,
    make_app: Callable[[], Starlette],
    uvicorn_options: Callable[[Any], dict[str, Any]],
    *,
    server: type,
    sockets: list[socket.socket] | None = None,
    heartbeat_fd: int | None = None,
) -> int:
    """Start the simulated engines `launch:` asks for, build the app (`make_app`), serve it on
    uvicorn (a `server` from server_class(), configured with `uvicorn_options(app)`) until it stops,
    then stop the engines. Returns the exit status: 2 when the engines or the app could not start
    (printed, naming `source`), 130 when interrupted (SIGINT), 1 when uvicorn never started serving
    (the app's lifespan failed, or the port could not be bound: uvicorn logs why, a line printed
    here says it did not start), else 0."""
    import uvicorn

    from router.config import ConfigError
    from router.launch import LaunchError
    from router.policies import PolicyUnavailable

    try:
        fleet = launch_simulated_engines(config)
    except LaunchError as exc:
        print(f"kvgate: {source}: {exc}", file=sys.stderr)
        return 2
    try:
        try:
            app = make_app()
        except (PolicyUnavailable, ConfigError) as exc:  # ConfigError: discovery's credentials
            print(f"kvgate: {source}: {exc}", file=sys.stderr)
            return 2
        running = server(uvicorn.Config(app, **uvicorn_options(app)))
        running.huge_pages = config.listen.huge_pages
        if heartbeat_fd is not None:
            # Never blocks the loop: a supervisor that stops reading loses heartbeats, not the worker.
            os.set_blocking(heartbeat_fd, False)
            running.heartbeat_fd = heartbeat_fd
        try:
            running.run(sockets=sockets)
        except KeyboardInterrupt:
            # uvicorn has already shut down gracefully; it re-raises the interrupt so the exit
            # status says so. Exit 130 (interrupted) without a traceback.
            return 130
        except SystemExit:
            # Where its start-up fails, uvicorn exits (SystemExit(3), as 0.54 does; releases before
            # its exit-status rework returned without having started): both end below, in exit 1.
            if running.started:
                raise
        # The re-raised interrupt can also end as a cancellation of the loop's main task that
        # came too late to stop it (asyncio's SIGINT handler; a race at the very end): the exit
        # status still says the gateway was interrupted.
        if running.interrupted:
            return 130
        if not running.started:
            print(
                f"kvgate: {source}: the gateway did not start: its start-up failed (the error is "
                "logged above); nothing is listening",
                file=sys.stderr,
            )
            return 1
        return 0
    finally:
        if fleet is not None:
            fleet.stop()

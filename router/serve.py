"""`kvgate serve`: load proxy.yaml, build the gateway app and run it on uvicorn (uvloop + httptools,
with the gateway's own protocol class from router/http_server.py). Without a file, `--backend URL
... --model NAME` describes a load-balancing gateway (the quick start; the file is the full interface).

With `--workers N` (or `listen.workers`) above 1 this process supervises N gateway processes that
share the port through SO_REUSEPORT (the kernel spreads connections over them). Each is a replica
with its own KV index fed by the same events, joined to the others by the `cluster:` sync; the
supervisor restarts one that dies, stops them all on SIGINT/SIGTERM, and they die with it. Each
worker's event loop writes a heartbeat to a pipe the supervisor reads; a worker silent for
`listen.worker_liveness_timeout_s` (stopped, hung, its loop blocked) is killed and restarted, since
the kernel keeps handing it connections that nobody accepts.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from router.startup import cannot_listen, configure_logging, launch_simulated_engines, serve_app

# Looked up as router.serve._server_class when `run` starts (a test hands `run` its own server).
from router.startup import server_class as _server_class

if TYPE_CHECKING:
    from router.config import Config

log = logging.getLogger("kvgate")

# A worker that dies sooner than this after its start is restarted after a growing delay (up to the
# maximum), so a worker that cannot start does not spin.
_HEALTHY_RUN_S = 10.0
_MAX_RESTART_DELAY_S = 30.0
# How long stopping workers get to finish their requests before they are killed.
_STOP_GRACE_S = 15.0
# A worker writes its first heartbeat (router/startup.py) within this long of its start (it loads
# tokenizers and connects first), or it is taken for hung.
_FIRST_HEARTBEAT_S = 120.0

# Where --config is read from when the flag is not given (a container sets it once).
CONFIG_ENV = "KVGATE_CONFIG"


# What error messages name as the configuration's source when it comes from the quick-start flags.
FLAGS_SOURCE = "--backend/--model"
# The quick start's policy: it has no KV events to see the engines' caches with.
QUICK_START_POLICY = "least_loaded"
# What a backend name may hold (router/config.py Backend.name): an IPv6 [host]:port is not one.
_BACKEND_NAME = re.compile(r"[A-Za-z0-9_.:-]+")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from_env = os.environ.get(CONFIG_ENV) or None
    parser.add_argument(
        "--config",
        default=from_env,
        help=f"path to proxy.yaml (the full interface); the environment variable {CONFIG_ENV} gives it "
        "for every run",
    )
    quick = parser.add_argument_group(
        "quick start without a file (instead of --config; listen, limits and health keep their defaults)"
    )
    quick.add_argument(
        "--backend",
        action="append",
        metavar="URL",
        help="an engine's base URL, http://host:port; repeat it for each engine",
    )
    quick.add_argument(
        "--model",
        action="append",
        metavar="NAME",
        help="a model name clients send and the engines serve; repeat it for several",
    )
    quick.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="the models' tokenizer (a local directory or builtin:qwen3), for --policy approximate",
    )
    quick.add_argument(
        "--policy",
        default=QUICK_START_POLICY,
        help="routing policy: round_robin, least_loaded, session or approximate (kv_aware needs each "
        "engine's KV events: write a proxy.yaml)",
    )
    parser.add_argument("--host", help="listen address (overrides listen.host)")
    parser.add_argument("--port", type=int, help="listen port (overrides listen.port)")
    parser.add_argument(
        "--log-level", choices=["debug", "info", "warning", "error"], help="overrides log_level of the config"
    )
    parser.add_argument(
        "--workers",
        type=int,
        help="gateway processes on the port (overrides listen.workers); more than 1 needs `cluster:`",
    )
    # Set by the supervisor on the workers it starts.
    parser.add_argument("--worker-index", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--heartbeat-fd", type=int, help=argparse.SUPPRESS)


def config_from_flags(args: argparse.Namespace) -> Config:
    """The configuration the quick-start flags describe (`--backend URL ... --model NAME`); raises
    ConfigError, naming the flag, for a bad URL, a missing --model, or a policy the flags cannot
    feed (kv_aware without events, approximate without a tokenizer)."""
    from router.config import ConfigError, parse_config

    if not args.model:
        raise ConfigError(f"{FLAGS_SOURCE}: --backend needs --model NAME (the model the engines serve)")
    if args.policy == "kv_aware":
        # Without events it would route blind while looking cache-aware: refused, not served.
        raise ConfigError(
            f"{FLAGS_SOURCE}: --policy kv_aware reads each engine's KV events, which the quick start "
            "has none of: write a proxy.yaml with kv_events per backend (docs/real-engines.md), or use "
            "--policy approximate --tokenizer DIR (routes by the prefixes it sent where)"
        )
    backends = []
    for index, url in enumerate(args.backend):
        # Named by host:port, so that x-kvgate-backend and the metrics say which engine it was.
        name = urlsplit(url).netloc
        if not _BACKEND_NAME.fullmatch(name) or name in {b["name"] for b in backends}:
            name = f"backend-{index}"
        backends.append({"name": name, "url": url})
    if args.policy == "approximate" and args.tokenizer is None:
        raise ConfigError(
            f"{FLAGS_SOURCE}: --policy approximate routes by the prompt's tokens: give --tokenizer DIR "
            "(the engines' tokenizer directory, or builtin:qwen3)"
        )
    model = {} if args.tokenizer is None else {"tokenizer": args.tokenizer}
    data = {
        "models": [{"name": name, **model} for name in args.model],
        "backends": backends,
        "policy": {"name": args.policy},
    }
    return parse_config(data, FLAGS_SOURCE, Path.cwd())


def _load(args: argparse.Namespace) -> Config:
    """The configuration to serve: --config's file, or the quick-start flags; raises ConfigError."""
    from router.config import ConfigError, load_config

    quick_flags = [f"--{flag}" for flag in ("model", "tokenizer") if getattr(args, flag)]
    if args.policy != QUICK_START_POLICY:
        quick_flags.append("--policy")
    if args.backend:
        # An explicit --config beside --backend is a contradiction; KVGATE_CONFIG is only a default.
        if args.config is not None and args.config != os.environ.get(CONFIG_ENV):
            raise ConfigError("--config and --backend: give one of them (--backend starts without a file)")
        args.config = None
        return config_from_flags(args)
    if quick_flags:
        raise ConfigError(
            f"{', '.join(quick_flags)}: only with --backend URL (the quick start); a --config file says "
            "its models and policy itself"
        )
    if args.config is None:
        raise ConfigError(
            f"give --config proxy.yaml (or set {CONFIG_ENV}), or start without a file: "
            "--backend URL [--backend URL ...] --model NAME"
        )
    return load_config(args.config)


def run(args: argparse.Namespace) -> int:
    from router.app import create_app
    from router.config import ConfigError, check_admin_exposure
    from router.http_server import gateway_http_protocol

    try:
        config = _load(args)
        source = args.config or FLAGS_SOURCE
        host = args.host or config.listen.host
        check_admin_exposure(config, host, source, "--host" if args.host else "listen.host")
    except ConfigError as exc:
        print(f"kvgate: {exc}", file=sys.stderr)
        return 2
    port = config.listen.port if args.port is None else args.port
    log_level = args.log_level or config.log_level
    configure_logging(log_level)
    if args.worker_index is None:
        # Checked once, by the process that owns the port: a worker binds it beside its siblings.
        refusal = cannot_listen(host, port, fix="listen.port in the config or --port")
        if refusal is not None:
            print(refusal, file=sys.stderr)
            return 2
    workers = config.listen.workers if args.workers is None else args.workers
    if args.worker_index is None and workers != 1:
        return _supervise(args, config, workers, host, port, log_level)
    listening = None
    if args.worker_index is not None:
        listening = _reuse_port_socket(host, port)
        if config.cluster is not None and config.cluster.replica_id is not None:
            config.cluster.replica_id = f"{config.cluster.replica_id}-w{args.worker_index}"

    def uvicorn_options(app: Any) -> dict[str, Any]:
        return {
            "host": host,
            "port": port,
            "loop": "uvloop",
            # uvicorn's httptools protocol plus the direct path for the generation routes.
            "http": gateway_http_protocol(app.state.gateway, app.fast_endpoints.values()),
            "log_level": log_level,
            "access_log": False,
            # X-Forwarded-* rewriting is not used by the gateway and costs CPU on every request.
            "proxy_headers": False,
            # The backend's own Server and Date headers pass through; uvicorn must not add a second pair.
            "server_header": False,
            "date_header": False,
            # Clients (and benchmark load) keep connections open between requests.
            "timeout_keep_alive": 75,
            "backlog": 4096,
        }

    # `launch:` asks for simulated engines (router/sim): start them, route to them, stop them on exit.
    return serve_app(
        config,
        source,
        lambda: create_app(config),
        uvicorn_options,
        server=_server_class(),
        sockets=None if listening is None else [listening],
        heartbeat_fd=args.heartbeat_fd,
    )


def _reuse_port_socket(host: str, port: int) -> socket.socket:
    """A listening socket other workers bind too; the kernel deals connections out among them."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listening = socket.socket(family, socket.SOCK_STREAM)
    listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    listening.bind((host, port))
    listening.set_inheritable(True)
    return listening


def _refusal(config_path: str, workers: int, config: Config, port: int) -> str | None:
    if workers < 1:
        return f"--workers {workers}: give 1 or more"
    if config.cluster is None:
        return (
            f"{config_path}: {workers} workers are {workers} gateway replicas, and replicas need a "
            "`cluster:` section to share their in-flight load and predictions (without it each would "
            "route on a 1/N view); add `cluster: {url: redis://127.0.0.1:6379/0}` (a redis-server), "
            'or run one worker (docs/gateway.md, "Running replicas and workers")'
        )
    if port == 0:
        return "--workers needs a fixed port (listen.port or --port): port 0 would give each worker its own"
    return None


def _supervise(
    args: argparse.Namespace, config: Config, workers: int, host: str, port: int, log_level: str
) -> int:
    """Run `workers` gateway processes on host:port and keep them running until SIGINT/SIGTERM."""
    import msgspec
    import yaml

    from router.launch import LaunchError, die_with_parent

    refusal = _refusal(args.config or FLAGS_SOURCE, workers, config, port)
    if refusal is not None:
        print(f"kvgate: {refusal}", file=sys.stderr)
        return 2
    config_path = args.config
    written = None
    # Started once here, for every worker: the workers get a configuration naming them.
    try:
        fleet = launch_simulated_engines(config)
    except LaunchError as exc:
        print(f"kvgate: {args.config}: {exc}", file=sys.stderr)
        return 2
    # The workers read a file: the quick-start flags' configuration is written to one too.
    if fleet is not None or config_path is None:
        config.launch = None
        handle, written = tempfile.mkstemp(prefix="kvgate-workers-", suffix=".yaml")
        with os.fdopen(handle, "w") as file:
            yaml.safe_dump(msgspec.to_builtins(config), file)
        config_path = written
    stopping = threading.Event()
    interrupted = []

    def request_stop(signum: int, frame: object) -> None:
        interrupted.append(signum)
        stopping.set()

    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}

    liveness_timeout_s = config.listen.worker_liveness_timeout_s
    heartbeats: list[_Heartbeat | None] = [None] * workers

    def start(index: int) -> subprocess.Popen:
        if heartbeats[index] is not None:
            heartbeats[index].close()
        heartbeat = heartbeats[index] = _Heartbeat()
        command = [
            sys.executable, "-m", "router.cli", "serve", "--config", config_path,
            "--host", host, "--port", str(port), "--log-level", log_level, "--worker-index", str(index),
            "--heartbeat-fd", str(heartbeat.write_fd),
        ]  # fmt: skip
        try:
            return subprocess.Popen(command, preexec_fn=die_with_parent, pass_fds=(heartbeat.write_fd,))
        finally:
            heartbeat.started()

    processes = [start(index) for index in range(workers)]
    started = [time.monotonic()] * workers
    delays = [1.0] * workers
    restart_at: list[float | None] = [None] * workers
    log.info("kvgate: %d workers on %s:%d (pids %s)", workers, host, port, [p.pid for p in processes])
    try:
        while not stopping.wait(0.2):
            now = time.monotonic()
            for index, process in enumerate(processes):
                if restart_at[index] is not None:
                    if now >= restart_at[index]:
                        processes[index], started[index], restart_at[index] = start(index), now, None
                    continue
                status = process.poll()
                if status is None:
                    silent_s = heartbeats[index].silent_s(now)
                    allowed_s = liveness_timeout_s
                    if not heartbeats[index].beating:
                        allowed_s = max(allowed_s, _FIRST_HEARTBEAT_S)
                    if silent_s > allowed_s:
                        # SIGKILL, which a stopped process obeys too; restarted below once reaped.
                        log.warning(
                            "kvgate: worker %d (pid %d) sent no heartbeat for %.1f s "
                            "(listen.worker_liveness_timeout_s %g); killing it",
                            index, process.pid, silent_s, liveness_timeout_s,
                        )  # fmt: skip
                        process.kill()
                        try:
                            status = process.wait(10)
                        except subprocess.TimeoutExpired:
                            continue  # reaped on a later round
                    else:
                        continue
                ran_s = now - started[index]
                delays[index] = (
                    1.0 if ran_s >= _HEALTHY_RUN_S else min(2 * delays[index], _MAX_RESTART_DELAY_S)
                )
                wait_s = 0.0 if ran_s >= _HEALTHY_RUN_S else delays[index]
                log.warning(
                    "kvgate: worker %d (pid %d) exited with status %s; restarting it in %.0f s",
                    index, process.pid, status, wait_s,
                )  # fmt: skip
                restart_at[index] = now + wait_s
    finally:
        for heartbeat in heartbeats:
            if heartbeat is not None:
                heartbeat.close()
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + _STOP_GRACE_S
        for process in processes:
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if fleet is not None:
            fleet.stop()
        if written is not None:
            with contextlib.suppress(OSError):
                os.unlink(written)
    return 130 if signal.SIGINT in interrupted else 0


class _Heartbeat:
    """The pipe one worker's event loop writes heartbeats to (--heartbeat-fd), read by the supervisor."""

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        self.beating = False  # a first heartbeat has come
        self._last = time.monotonic()

    def started(self) -> None:
        """The worker has its end (or failed to start): the supervisor closes its copy, so the pipe
        reads as ended when the worker exits."""
        if self.write_fd >= 0:
            os.close(self.write_fd)
            self.write_fd = -1
        self._last = time.monotonic()

    def silent_s(self, now: float) -> float:
        """Seconds since the last heartbeat (since the start, before the first), after reading
        whatever came."""
        try:
            while os.read(self.read_fd, 4096):
                self.beating = True
                self._last = now
        except BlockingIOError:
            pass
        return now - self._last

    def close(self) -> None:
        for fd in (self.read_fd, self.write_fd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.read_fd = self.write_fd = -1

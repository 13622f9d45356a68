"""Start N simulated engines as `kvgate sim` subprocesses for a gateway (proxy.yaml `launch:`).

`launch_simulated_engines` picks ports (the configured consecutive ones where free, else ones the
OS offers), starts the engines, waits until each answers /health, and returns a `SimulatedFleet`:
the Backend entries (with their KV-event endpoints) to add to the gateway, and `stop()`, which the
gateway calls on shutdown. On Linux the engines also die if the gateway is killed outright.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field

from router.config import Backend, Config, KVEvents, SimulatedEngines
from router.errors import KvgateError

log = logging.getLogger("kvgate.launch")
TOPIC = "kv-events"


class LaunchError(KvgateError, RuntimeError):
    """The simulated engines could not be started; the message says which and why."""


@dataclass
class SimulatedFleet:
    backends: list[Backend]
    processes: list[subprocess.Popen] = field(default_factory=list)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Terminate every engine (SIGTERM, then SIGKILL after `timeout_s`) and reap it."""
        for process in self.processes:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for process in self.processes:
            try:
                process.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5)
        self.processes.clear()

    def __enter__(self) -> SimulatedFleet:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def port_is_free(host: str, port: int) -> bool:
    """Whether a listening socket could bind `port` on `host` now (nothing bound to it there)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def os_free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def _pick_ports(host: str, wanted: list[int]) -> list[int]:
    """The wanted ports where free, otherwise ports the OS offers; never the same port twice."""
    chosen: list[int] = []
    for port in wanted:
        if port > 65535 or port in chosen or not port_is_free(host, port):
            replacement = os_free_port(host)
            while replacement in chosen:
                replacement = os_free_port(host)
            log.info("port %d is taken; using %d instead", port, replacement)
            port = replacement
        chosen.append(port)
    return chosen


def die_with_parent() -> None:  # runs in the child between fork and exec
    if sys.platform == "linux":
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def launch_simulated_engines(
    spec: SimulatedEngines, config: Config, ready_timeout_s: float | None = None, quiet: bool = False
) -> SimulatedFleet:
    """Start `spec.count` simulated engines for `config` and wait until all are healthy."""
    model = config.model(spec.model) if spec.model else config.models[0]
    if model is None:
        names = [m.name for m in config.models]
        raise LaunchError(
            f"launch.simulated_engines.model {spec.model!r} is not a configured model; choose from {names}"
        )
    taken = {backend.name for backend in config.backends}
    names = [f"sim-{i}" for i in range(spec.count)]
    if clash := taken.intersection(names):
        raise LaunchError(
            f"backend names {sorted(clash)} are reserved for launched simulated engines; rename yours"
        )
    host = spec.host
    # One call for both kinds, so an HTTP port never doubles as an event port.
    ports = _pick_ports(
        host,
        [spec.base_port + i for i in range(spec.count)]
        + [spec.events_base_port + i for i in range(2 * spec.count)],
    )
    http_ports, event_ports = ports[: spec.count], ports[spec.count :]
    served_name = model.served_name or model.name
    fleet = SimulatedFleet(backends=[])
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    try:
        for i, name in enumerate(names):
            endpoint = f"tcp://{host}:{event_ports[2 * i]}"
            replay_endpoint = f"tcp://{host}:{event_ports[2 * i + 1]}"
            events_config = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": endpoint,
                "replay_endpoint": replay_endpoint,
                "topic": TOPIC,
            }
            command = [
                sys.executable, "-m", "router.sim",
                "--model", served_name,
                "--tokenizer", model.tokenizer or "builtin:qwen3",
                "--host", host,
                "--port", str(http_ports[i]),
                "--block-size", str(spec.block_size),
                "--num-gpu-blocks-override", str(spec.num_gpu_blocks),
                "--kv-events-config", json.dumps(events_config),
                *(["--log-level", "warning"] if quiet else []),
                *spec.extra_args,
            ]  # fmt: skip
            output = subprocess.DEVNULL if quiet else None
            fleet.processes.append(
                subprocess.Popen(command, env=env, stdout=output, stderr=output, preexec_fn=die_with_parent)
            )
            fleet.backends.append(
                Backend(
                    name=name,
                    url=f"http://{host}:{http_ports[i]}",
                    models=[model.name],
                    kv_events=KVEvents(
                        endpoint=endpoint,
                        replay_endpoint=replay_endpoint,
                        topic=TOPIC,
                        # The engine holds at most its pool; an eighth more leaves room for a
                        # removal that arrives after the store that replaced its block.
                        max_blocks=spec.num_gpu_blocks + spec.num_gpu_blocks // 8,
                    ),
                )
            )
        # Every engine imports and loads its tokenizer at once: on two cores, start-up grows with the count.
        _wait_healthy(
            fleet, ready_timeout_s if ready_timeout_s is not None else max(180.0, 10.0 * spec.count)
        )
    except BaseException:
        fleet.stop()
        raise
    log.warning(
        "started %d SIMULATED engines (%s) for model %r",
        spec.count,
        ", ".join(b.url for b in fleet.backends),
        model.name,
    )
    return fleet


def _wait_healthy(fleet: SimulatedFleet, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    pending = dict(zip((b.url for b in fleet.backends), fleet.processes, strict=True))
    while pending:
        for url, process in list(pending.items()):
            if process.poll() is not None:
                raise LaunchError(
                    f"simulated engine {url} exited with status {process.returncode} before it was "
                    "healthy; its log says why (run `kvgate sim` with the same flags to see it)"
                )
            # urllib, not httpx: polling must not flood the gateway's log with request lines.
            with (
                contextlib.suppress(OSError, http.client.HTTPException),
                urllib.request.urlopen(f"{url}/health", timeout=1.0) as answer,
            ):
                if answer.status == 200:
                    del pending[url]
        if pending and time.monotonic() > deadline:
            raise LaunchError(f"simulated engines {sorted(pending)} not healthy after {timeout_s:.0f}s")
        if pending:
            time.sleep(0.1)

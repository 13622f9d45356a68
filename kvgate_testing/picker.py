"""Run the real endpoint picker (`python -m router.cli epp`) on free loopback ports, and the pair a test
or benchmark puts in front of engines: the picker and the real Envoy that asks it.

The picker gets a proxy.yaml mapping (the engines under `backends:`, as for `kvgate serve`); its gRPC
address (`epp:`) and its HTTP listener (`listen:`: /health, /metrics, the admin API) are filled in with
free ports, its other `epp:` and `listen:` keys kept. Start-up waits, bounded, for its gRPC readiness
(grpc.health.v1, service `readiness`). The ports stay the picker's for its life: `kill()` (a crash)
then `start()` again brings it back where Envoy looks for it. Tests that play Envoy themselves talk
to it over `channel()` (kvgate_testing/ext_proc_client.py).
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import yaml

from kvgate_testing.envoy import BodyMode, EnvoyProcess, ResponseBodyMode, start_envoy_with_picker
from kvgate_testing.metrics import metric_samples
from kvgate_testing.ports import free_port
from kvgate_testing.processes import ManagedProcess, python_command

if TYPE_CHECKING:
    import grpc

READINESS_SERVICE = "readiness"


def grpc_health(address: str, service: str = READINESS_SERVICE, timeout_s: float = 2.0) -> str:
    """The picker's gRPC health status for `service` (SERVING, NOT_SERVING...), or the error's name."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError as exc:
            return str(exc.code().name)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


class PickerProcess:
    """A running `kvgate epp`: `grpc_address` ("127.0.0.1:port") and `url` (its HTTP listener)."""

    def __init__(self, config: dict[str, Any], huge_pages: bool = False):
        """`huge_pages`: `listen.huge_pages` where `config` does not set it (kvgate_testing/gateway.py's
        start_gateway says why the tests leave it off)."""
        self.config = dict(config)
        self.grpc_port = free_port()
        self.http_port = free_port()
        self.config["epp"] = {**self.config.get("epp", {}), "host": "127.0.0.1", "port": self.grpc_port}
        listen = {"huge_pages": huge_pages, **self.config.get("listen", {})}
        self.config["listen"] = {**listen, "host": "127.0.0.1", "port": self.http_port}
        self.grpc_address = f"127.0.0.1:{self.grpc_port}"
        self.url = f"http://127.0.0.1:{self.http_port}"
        self.config_path: Path | None = None
        self.process: ManagedProcess | None = None

    def start(self, timeout_s: float = 60.0) -> PickerProcess:
        """Start it (again, after kill() or stop(): the same ports) on its config, written to a
        temporary file that stop() and kill() remove."""
        assert self.process is None, "picker already running"
        handle, name = tempfile.mkstemp(prefix="kvgate-epp-", suffix=".yaml")
        with os.fdopen(handle, "w") as file:
            yaml.safe_dump(self.config, file)
        self.config_path = Path(name)
        self.process = ManagedProcess(python_command("-m", "router.cli", "epp", "--config", name))
        deadline = time.monotonic() + timeout_s
        status = "no answer"
        while time.monotonic() < deadline:
            if not self.process.alive():
                output = self.process.output()
                self.stop()
                raise RuntimeError(f"kvgate epp exited:\n{output[-4000:]}")
            status = grpc_health(self.grpc_address)
            if status == "SERVING":
                return self
            time.sleep(0.1)
        output = self.process.output()
        self.stop()
        raise TimeoutError(
            f"kvgate epp not ready within {timeout_s}s (readiness: {status}):\n{output[-4000:]}"
        )

    @property
    def pid(self) -> int:
        assert self.process is not None, "picker not started"
        return self.process.pid

    def output(self) -> str:
        return self.process.output() if self.process is not None else ""

    def backends(self) -> dict[str, dict]:
        """GET /backends of its admin API: each engine's state (in_flight, healthy...) by name."""
        listed = httpx.get(f"{self.url}/backends", timeout=10.0).json()["backends"]
        return {entry["name"]: entry for entry in listed}

    def finished(self) -> dict[str, float]:
        """kvgate_epp_finished_total by `how`: how the picks' accounting was closed (the answer's
        end, its access-log entry, a timeout...)."""
        samples = metric_samples(httpx.get(f"{self.url}/metrics", timeout=10.0).text)
        return {
            dict(labels)["how"]: value
            for (name, labels), value in samples.items()
            if name == "kvgate_epp_finished_total"
        }

    def channel(self) -> grpc.Channel:
        """A gRPC channel to its ext_proc server (close it: use it as a context manager)."""
        import grpc

        return grpc.insecure_channel(self.grpc_address)

    def kill(self) -> None:
        """SIGKILL, as a crash: no stream is closed cleanly. start() brings it back on the same ports."""
        if self.process is not None:
            self.process.kill()
        self.stop()

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()
            self.process = None
        if self.config_path is not None:
            self.config_path.unlink(missing_ok=True)
            self.config_path = None

    def __enter__(self) -> PickerProcess:
        if self.process is None:
            self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def start_picker(config: dict[str, Any], timeout_s: float = 60.0) -> PickerProcess:
    """`kvgate epp` on `config`, started and ready (use it as a context manager, or stop() it)."""
    return PickerProcess(config).start(timeout_s)


@dataclass
class EnvoyWithPicker:
    """Envoy in front of `kvgate epp`: clients call `url` (Envoy's listener)."""

    picker: PickerProcess
    envoy: EnvoyProcess

    @property
    def url(self) -> str:
        return self.envoy.url

    def stop(self) -> None:
        self.envoy.stop()
        self.picker.stop()

    def __enter__(self) -> EnvoyWithPicker:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def start_envoy_and_picker(
    picker_config: dict[str, Any],
    body_mode: BodyMode = BodyMode.FULL_DUPLEX_STREAMED,
    buffer_limit_bytes: int | None = None,
    filters_before_picker: list[dict] | None = None,
    concurrency: int = 1,
    timeout_s: float = 60.0,
    response_body_mode: ResponseBodyMode = ResponseBodyMode.FULL_DUPLEX_STREAMED,
) -> EnvoyWithPicker:
    picker = start_picker(picker_config, timeout_s)
    try:
        envoy = start_envoy_with_picker(
            ("127.0.0.1", picker.grpc_port),
            body_mode,
            buffer_limit_bytes=buffer_limit_bytes,
            filters_before_picker=filters_before_picker or (),
            concurrency=concurrency,
            response_body_mode=response_body_mode,
        )
    except BaseException:
        picker.stop()
        raise
    return EnvoyWithPicker(picker, envoy)

"""Run the real endpoint picker process (`python -m router.cli epp`) on free ports with a given config."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import grpc
import yaml

from kvgate_testing.ports import free_port
from kvgate_testing.processes import ManagedProcess, python_command, start_process


class EppProcess:
    """The running picker: its gRPC address, its HTTP URL (admin, /metrics), its process."""

    def __init__(self, process: ManagedProcess, grpc_address: str, url: str, config_path: Path) -> None:
        self.process = process
        self.grpc_address = grpc_address
        self.url = url
        self.config_path = config_path

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.grpc_address)

    def stop(self) -> None:
        self.process.stop()
        self.config_path.unlink(missing_ok=True)

    def __enter__(self) -> EppProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def start_epp(config: dict, timeout_s: float = 60.0) -> EppProcess:
    """Write `config` (a proxy.yaml mapping; listen and epp host/port are filled in with free loopback
    ports, its other epp keys kept) and start `kvgate epp` on it; returns once GET /health answers."""
    config = dict(config)
    http_port, grpc_port = free_port(), free_port()
    config["listen"] = {**config.get("listen", {}), "host": "127.0.0.1", "port": http_port}
    config["epp"] = {**config.get("epp", {}), "host": "127.0.0.1", "port": grpc_port}
    handle, name = tempfile.mkstemp(prefix="kvgate-epp-", suffix=".yaml")
    with os.fdopen(handle, "w") as file:
        yaml.safe_dump(config, file)
    args = python_command("-m", "router.cli", "epp", "--config", name)
    try:
        process = start_process(
            args, f"http://127.0.0.1:{http_port}/health", timeout_s=timeout_s, any_status=True
        )
    except BaseException:
        Path(name).unlink(missing_ok=True)
        raise
    return EppProcess(process, f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{http_port}", Path(name))

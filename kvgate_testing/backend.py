"""Run kvgate_testing/openai_backend.py as a real process on a free loopback port."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from kvgate_testing.ports import free_port
from kvgate_testing.processes import ManagedProcess, python_command, start_process

# The model a test backend serves unless told otherwise.
TEST_MODEL = "test-model"


class BackendProcess:
    """One running test backend: its name, URL, and handles to script and inspect it."""

    def __init__(self, name: str, models: list[str], record: bool = True):
        self.name = name
        self.models = models
        self.record = record
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: ManagedProcess | None = None

    def start(self) -> BackendProcess:
        # The port is asked again on a restart only if the old one was taken meanwhile.
        args = ["-m", "kvgate_testing.openai_backend", "--port", str(self.port), "--name", self.name]
        args += ["--models", ",".join(self.models)]
        if not self.record:
            args.append("--no-record")
        self.process = start_process(python_command(*args), f"{self.url}/health")
        return self

    def kill(self) -> None:
        """Kill it hard, as a crash would."""
        if self.process is not None:
            self.process.kill()

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()
            self.process = None

    def received(self) -> list[dict]:
        return httpx.get(f"{self.url}/_test/received", timeout=5).json()

    def reset(self) -> None:
        httpx.post(f"{self.url}/_test/reset", timeout=5).raise_for_status()

    def set_mode(self, **mode: int) -> None:
        """E.g. set_mode(status=503, health_status=503) to fail every request and health probe."""
        httpx.post(f"{self.url}/_test/mode", json=mode, timeout=5).raise_for_status()


def start_backend(name: str, models: list[str] | None = None, record: bool = True) -> BackendProcess:
    return BackendProcess(name, models or [TEST_MODEL], record).start()


@contextmanager
def running_backends(*names: str, models: list[str]) -> Iterator[list[BackendProcess]]:
    """Test backends with these names, all serving `models`; every one started is stopped after."""
    started: list[BackendProcess] = []
    try:
        for name in names:
            started.append(start_backend(name, models))
        yield started
    finally:
        for backend in started:
            backend.stop()

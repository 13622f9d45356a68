"""A real `redis-server` on a free loopback port, started and stopped by the test that needs it."""

from __future__ import annotations

import contextlib
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import redis

from kvgate_testing.ports import free_port
from kvgate_testing.processes import ManagedProcess


class RedisServer:
    """One redis-server process: no persistence, its own directory; kill, pause and restart it."""

    def __init__(self, *extra_args: str) -> None:
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise RuntimeError(
                "redis-server is not installed: apt-get install -y redis-server (make test does)"
            )
        self.port = free_port()
        self.extra_args = list(extra_args)
        self._directory = tempfile.TemporaryDirectory(prefix="kvgate-redis-")
        self.process: ManagedProcess | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        args = [
            self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", self._directory.name, *self.extra_args,
        ]  # fmt: skip
        self.process = ManagedProcess(args)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.process.alive():
                raise RuntimeError(f"redis-server exited:\n{self.process.output()}")
            with contextlib.suppress(redis.RedisError), self.client() as client:
                if client.ping():
                    return self
            time.sleep(0.02)
        output = self.process.output()
        self.stop()
        raise TimeoutError(f"redis-server did not answer on port {self.port} within {timeout_s}s:\n{output}")

    def kill(self) -> None:
        """SIGKILL: the server vanishes with its data, as a crashed host would."""
        if self.process is not None:
            self.process.kill(signal.SIGKILL)
            self.process.stop()
            self.process = None

    def pause(self) -> None:
        """SIGSTOP: connections stay open but nothing answers (a hung or overloaded server)."""
        assert self.process is not None
        self.process.popen.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.popen.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                self.process.popen.send_signal(signal.SIGCONT)
            self.process.stop()
            self.process = None

    def close(self) -> None:
        self.stop()
        self._directory.cleanup()

    @property
    def directory(self) -> Path:
        return Path(self._directory.name)


@contextlib.contextmanager
def running_redis(*extra_args: str) -> Iterator[RedisServer]:
    server = RedisServer(*extra_args).start()
    try:
        yield server
    finally:
        server.close()

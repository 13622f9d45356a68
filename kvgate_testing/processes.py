"""Start a subprocess, wait until it answers over HTTP, and always kill it afterwards."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]


class ManagedProcess:
    """A child process in its own process group, with its output captured to a temporary file."""

    def __init__(self, args: Sequence[str], env: dict[str, str] | None = None, cwd: str | None = None):
        self.args = list(args)
        # Kept open for the child's whole life, closed in stop().
        self._log = tempfile.NamedTemporaryFile(prefix="kvgate-test-", suffix=".log", delete=False)  # noqa: SIM115
        full_env = dict(os.environ)
        full_env.setdefault("PYTHONUNBUFFERED", "1")
        # The children import `kvgate_testing`, `benchmarks` and `router` from this checkout.
        full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), full_env.get("PYTHONPATH")]))
        full_env.update(env or {})
        self.popen = subprocess.Popen(
            self.args,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=full_env,
            cwd=cwd or str(REPO_ROOT),
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def output(self) -> str:
        """Everything the process wrote to stdout and stderr so far."""
        return Path(self._log.name).read_text(errors="replace")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the whole process group (uvicorn may have children) and reap the process."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, sig)
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(timeout=10)

    def stop(self) -> None:
        """Ask politely (SIGTERM), then force; remove the log file."""
        self.kill(signal.SIGTERM)
        self._log.close()
        Path(self._log.name).unlink(missing_ok=True)

    def __enter__(self) -> ManagedProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def wait_for_http(
    url: str, process: ManagedProcess | None = None, timeout_s: float = 30.0, any_status: bool = False
) -> None:
    """Poll `url` until it answers 2xx (any status with `any_status`); fail early, with the process's
    output, if the process died."""
    deadline = time.monotonic() + timeout_s
    last_error = "no attempt"
    while time.monotonic() < deadline:
        if process is not None and not process.alive():
            raise RuntimeError(f"{process.args} exited with {process.popen.returncode}:\n{process.output()}")
        try:
            response = httpx.get(url, timeout=1.0)
            if response.status_code < 300 or any_status:
                return
            last_error = f"HTTP {response.status_code}"
        except httpx.HTTPError as exc:
            last_error = repr(exc)
        time.sleep(0.05)
    output = process.output() if process is not None else ""
    raise TimeoutError(f"{url} did not answer within {timeout_s}s ({last_error}):\n{output}")


def start_process(
    args: Sequence[str],
    ready_url: str,
    env: dict[str, str] | None = None,
    timeout_s: float = 30.0,
    any_status: bool = False,
) -> ManagedProcess:
    """Start `args` and return once `ready_url` answers; the process is killed if it never does."""
    process = ManagedProcess(args, env=env)
    try:
        wait_for_http(ready_url, process, timeout_s, any_status)
    except BaseException:
        process.stop()
        raise
    return process


def python_command(*args: str) -> list[str]:
    """A command line running this interpreter (the project's venv)."""
    return [sys.executable, *args]


def exit_on_sigterm(signum: int, _frame: object) -> None:
    """A SIGTERM handler for a benchmark's main process: `signal.signal(signal.SIGTERM, exit_on_sigterm)`.

    Python's default for SIGTERM ends the process at once: the engines and the routers it started,
    each in a session of its own, would outlive it. As SystemExit the context managers' cleanup runs."""
    raise SystemExit(128 + signum)

"""Containers run with podman for the image tier (`make test-image`): start, inspect, stop, remove.

The flags are the ones these machines need (scripts/build_image.sh says why): runc with the cgroupfs
manager and file events, explicit nofile and nproc ulimits (the defaults cannot be applied here),
and `--init`, so SIGTERM reaches the Python process as a signal it handles rather than as PID 1's.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

from kvgate_testing.processes import REPO_ROOT

PODMAN = ["podman", "--runtime", "runc", "--cgroup-manager", "cgroupfs", "--events-backend", "file"]
RUN_FLAGS = [
    "--init",
    "--health-interval",
    "disable",
    "--ulimit",
    "nofile=20000:20000",
    "--ulimit",
    "nproc=32768:32768",
]
BUILD_SCRIPT = REPO_ROOT / "scripts" / "build_image.sh"


def podman(*args: str, timeout_s: float = 120.0, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([*PODMAN, *args], capture_output=True, text=True, timeout=timeout_s)
    if check and result.returncode != 0:
        raise RuntimeError(f"podman {' '.join(args)} failed ({result.returncode}):\n{result.stderr}")
    return result


def missing_tools() -> list[str]:
    return [tool for tool in ("podman", "runc") if shutil.which(tool) is None]


def build_images(targets: str, timeout_s: float = 1800.0) -> str:
    """Run scripts/build_image.sh for `targets` ("gateway", "cache" or both); its output."""
    result = subprocess.run(
        ["bash", str(BUILD_SCRIPT)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**os.environ, "TARGETS": targets},
    )
    if result.returncode != 0:
        raise RuntimeError(
            f"scripts/build_image.sh failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
        )
    return result.stdout


class Container:
    """One container started detached on the host's network (its loopback is the host's)."""

    def __init__(self, name: str, image: str, args: list[str], volumes: dict[Path, str], env: dict[str, str]):
        self.name = name
        command = [*RUN_FLAGS, "--detach", "--name", name, "--network", "host"]
        for source, target in volumes.items():
            command += ["--volume", f"{source}:{target}:ro"]
        for key, value in env.items():
            command += ["--env", f"{key}={value}"]
        podman("run", *command, image, *args)

    def state(self, field: str) -> str:
        return podman("inspect", "--format", "{{.State." + field + "}}", self.name).stdout.strip()

    def running(self) -> bool:
        return self.state("Running") == "true"

    def logs(self) -> str:
        result = podman("logs", self.name, check=False)
        return result.stdout + result.stderr

    def process_uids(self) -> dict[int, int]:
        """Real uid of every process in the container, by host pid (from /proc: not what `exec` sees)."""
        init_pid = int(self.state("Pid"))
        pids = {init_pid}
        frontier = [init_pid]
        while frontier:  # the init's descendants
            pid = frontier.pop()
            children = Path(f"/proc/{pid}/task/{pid}/children")
            found = [int(child) for child in children.read_text().split()] if children.exists() else []
            pids.update(found)
            frontier.extend(found)
        uids = {}
        for pid in pids:
            status = Path(f"/proc/{pid}/status")
            if status.exists():
                line = next(line for line in status.read_text().splitlines() if line.startswith("Uid:"))
                uids[pid] = int(line.split()[1])
        return uids

    def stop(self, grace_s: int) -> tuple[int, float]:
        """`podman stop -t grace_s`: the exit code and how long the stop took."""
        started = time.monotonic()
        podman("stop", "--time", str(grace_s), self.name, timeout_s=grace_s + 60)
        return int(self.state("ExitCode")), time.monotonic() - started

    def remove(self) -> None:
        podman("rm", "--force", "--time", "0", self.name, check=False)

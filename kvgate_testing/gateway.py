"""Run the real gateway process (`python -m router.cli serve`) on a free port with a given config."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from kvgate_testing.backend import TEST_MODEL, BackendProcess
from kvgate_testing.ports import free_port
from kvgate_testing.processes import ManagedProcess, python_command, start_process

# What the gateway logs only when handling a request went wrong in a way it did not expect (a bug):
# an unhandled error, an ASGI answer left incomplete, an unawaited coroutine, a traceback, uvloop's
# refusal to write to a closed transport.
BUG_LOG_LINES = (
    "unhandled error",
    "ASGI callable returned without completing",
    "never awaited",
    "Traceback",
    "RuntimeError",
)


def gateway_config(backends: Iterable[BackendProcess], model: str = TEST_MODEL, **sections: Any) -> dict:
    """A proxy.yaml mapping: `model` served by `backends` (by their names and URLs), plus `sections`
    (e.g. `limits={...}`, `policy={...}`; a `models` section replaces the one model)."""
    return {
        "models": [{"name": model}],
        "backends": [{"name": backend.name, "url": backend.url} for backend in backends],
        **sections,
    }


def simulated_fleet_config(
    model: str, policy: str, num_gpu_blocks: int, prefill_us_per_token: int, count: int = 2
) -> dict:
    """A proxy.yaml mapping whose gateway launches `count` simulated engines itself (`launch:`, on
    free ports, publishing KV events) and routes `model` (the builtin Qwen3 tokenizer) by `policy`."""
    return {
        "models": [{"name": model, "tokenizer": "builtin:qwen3"}],
        "launch": {
            "simulated_engines": {
                "count": count,
                "base_port": free_port(),
                "events_base_port": free_port(),
                "num_gpu_blocks": num_gpu_blocks,
                "extra_args": ["--prefill-us-per-token", str(prefill_us_per_token)],
            }
        },
        "policy": {"name": policy},
    }


class GatewayProcess:
    """The running gateway: its URL, config file and process handle."""

    def __init__(self, process: ManagedProcess, url: str, config_path: Path):
        self.process = process
        self.url = url
        self.config_path = config_path

    def stop(self) -> None:
        self.process.stop()
        self.config_path.unlink(missing_ok=True)

    def __enter__(self) -> GatewayProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def start_gateway(
    config: dict,
    extra_args: list[str] | None = None,
    timeout_s: float = 60.0,
    extensions: list[str] | None = None,
    open_file_limit: int | None = None,
    huge_pages: bool = False,
) -> GatewayProcess:
    """Write `config` (a proxy.yaml mapping; `listen.host` and `listen.port` are filled in) and start
    the gateway on it.

    `huge_pages` is `listen.huge_pages` where the config does not set it: off for the tests' many
    short-lived gateways (the heap's collapse costs a tokenizer-loading gateway about 0.6 s of CPU,
    two minutes of the default suite on two cores; tests/test_huge_pages.py tests it), on for the
    benchmarks' routers (kvgate_testing/routers.py), which measure the gateway as users run it.

    `extensions` adds test-only extension factories ("module:function") to the gateway's own
    (kvgate_testing/gateway_with_extensions.py); `open_file_limit` runs it under that RLIMIT_NOFILE
    (util-linux prlimit). Returns once GET /health answers, with any status
    (it says 503 while no backend is healthy). The caller must stop() it, or use it as a context manager.
    """
    config = dict(config)
    port = free_port()
    # The config's other listen settings (workers, worker_liveness_timeout_s) are kept.
    listen = {"huge_pages": huge_pages, **config.get("listen", {})}
    config["listen"] = {**listen, "host": "127.0.0.1", "port": port}
    handle, name = tempfile.mkstemp(prefix="kvgate-test-", suffix=".yaml")
    with os.fdopen(handle, "w") as file:
        yaml.safe_dump(config, file)
    command = ["-m", "router.cli"]
    if extensions:
        command = ["-m", "kvgate_testing.gateway_with_extensions", ",".join(extensions)]
    args = python_command(*command, "serve", "--config", name, *(extra_args or []))
    if open_file_limit is not None:
        args = ["prlimit", f"--nofile={open_file_limit}", *args]
    try:
        process = start_process(args, f"http://127.0.0.1:{port}/health", timeout_s=timeout_s, any_status=True)
    except BaseException:
        Path(name).unlink(missing_ok=True)
        raise
    return GatewayProcess(process, f"http://127.0.0.1:{port}", Path(name))

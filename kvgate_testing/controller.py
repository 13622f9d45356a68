"""Helpers for the controller tests: a real `cachelayer controller` process, and engines registered
with it through LMCache's controller protocol."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import torch

from cachelayer import CacheEngine
from cachelayer.controller.worker import attach_controller_worker
from kvgate_testing.cachelayer import CHUNK
from kvgate_testing.ports import free_port
from kvgate_testing.processes import REPO_ROOT, python_command, start_process


@contextlib.contextmanager
def controller_process(*extra_args: str, env: dict[str, str] | None = None) -> Iterator[tuple[str, int]]:
    """A real `cachelayer controller` on free loopback ports: (its HTTP URL, its monitor port)."""
    port, monitor_port = free_port(), free_port()
    command = ["-m", "cachelayer.cli", "controller", "--host", "127.0.0.1", "--port", str(port)]
    process = start_process(
        python_command(*command, "--monitor-port", str(monitor_port), *extra_args),
        f"http://127.0.0.1:{port}/health",
        any_status=True,  # every route is POST: any answer means it is up
        timeout_s=120,  # imports alone can take half a minute on a saturated machine
        env=env,
    )
    try:
        yield f"http://127.0.0.1:{port}", monitor_port
    finally:
        process.stop()


def worker_config(monitor_port: int, instance_id: str, **extra: Any) -> dict:
    """Engine config keys that register it with the controller on `monitor_port` as `instance_id`,
    heartbeating every 0.2 s; `extra` adds or replaces keys."""
    return {
        "enable_controller": True,
        "controller_pull_url": f"127.0.0.1:{monitor_port}",
        "lmcache_instance_id": instance_id,
        "lmcache_worker_heartbeat_time": 0.2,
        **extra,
    }


def registered(engine: CacheEngine) -> CacheEngine:
    """`engine` with the controller worker attached that its config asks for (`enable_controller`,
    worker_config), as the engine's owner attaches it (the daemon, the vLLM connector's store)."""
    attach_controller_worker(engine, engine.config)
    return engine


def wait_registered(client: httpx.Client, instance_id: str, count: int) -> dict:
    """Until the controller lists `count` workers of `instance_id`; its /query_worker_info answer."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        response = client.post("/query_worker_info", json={"instance_id": instance_id, "worker_ids": []})
        if response.status_code == 200 and len(response.json()["worker_infos"]) == count:
            return response.json()
        time.sleep(0.05)
    raise AssertionError(f"{instance_id} never had {count} registered worker(s)")


def wait_gone(client: httpx.Client, instance_id: str) -> None:
    """Until the controller no longer knows `instance_id` (404)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        response = client.post("/query_worker_info", json={"instance_id": instance_id, "worker_ids": []})
        if response.status_code == 404:
            return
        time.sleep(0.05)
    raise AssertionError(f"{instance_id} was never dropped")


def same_bits(left: torch.Tensor, right: torch.Tensor) -> bool:
    """Same shape and the same bf16 bit patterns (NaNs and signed zeros included)."""
    return left.shape == right.shape and torch.equal(left.view(torch.int16), right.view(torch.int16))


# A cache engine registered with a controller, alone in a fresh interpreter (nothing compiled or
# imported before it), holding request(seed, 2) for each seed given: it prints "ready" and the
# seconds its codec warm-up took once the warm-up is done, then serves until its stdin closes.
_WORKER_SCRIPT = """
import json, sys, torch
from cachelayer import CacheEngine
from cachelayer.controller.worker import attach_controller_worker
from kvgate_testing.cachelayer import HEAD_DIM, HEADS, LAYERS, request
config = json.loads(sys.argv[1])
engine = CacheEngine.from_config(config["engine"], num_layers=LAYERS, num_kv_heads=HEADS,
                                 head_dim=HEAD_DIM, dtype=torch.bfloat16)
worker = attach_controller_worker(engine, engine.config)
for seed in config["seeds"]:
    tokens, kv = request(seed, 2)
    engine.store(tokens, kv)
engine.flush()
worker.codecs_warm.wait()
print("ready", worker.codec_warm_up_s, flush=True)
sys.stdin.read()
engine.close()
"""


@contextlib.contextmanager
def worker_process(
    monitor_port: int, instance_id: str, seeds: list[int], ready_timeout_s: float = 300.0
) -> Iterator[float]:
    """A fresh engine process registered as `instance_id` (module comment above); yields the seconds
    its codec warm-up took, once it is done (a machine without numba's cache compiles for about half
    a minute: `ready_timeout_s` bounds that)."""
    engine_config = {
        "chunk_size": CHUNK,
        "max_local_cpu_size": 0.01,
        **worker_config(monitor_port, instance_id),
    }
    config = json.dumps({"engine": engine_config, "seeds": seeds})
    process = subprocess.Popen(
        python_command("-c", _WORKER_SCRIPT, config),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
        env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)),
    )
    try:
        ready: list[str] = []
        reader = threading.Thread(target=lambda: ready.append(process.stdout.readline()), daemon=True)
        reader.start()
        reader.join(ready_timeout_s)
        if not ready or not ready[0].startswith("ready"):
            raise AssertionError(f"the worker process was not ready within {ready_timeout_s}s: {ready}")
        yield float(ready[0].split()[1])
    finally:
        if process.stdin is not None:
            process.stdin.close()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

"""Helpers for the cache-layer tests: a small KV geometry, engines sized in chunks, random requests."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import httpx
import torch

from cachelayer import CacheEngine
from kvgate_testing.ports import free_port
from kvgate_testing.processes import python_command, start_process

LAYERS, HEADS, HEAD_DIM, CHUNK = 2, 2, 8, 16
CHUNK_BYTES = LAYERS * 2 * CHUNK * HEADS * HEAD_DIM * 2  # bf16


def make_engine(chunks_in_pool: float, **config) -> CacheEngine:
    """An engine whose CPU pool holds `chunks_in_pool` full chunks."""
    pool_gb = chunks_in_pool * CHUNK_BYTES / 2**30
    return CacheEngine.from_config(
        {"chunk_size": CHUNK, "max_local_cpu_size": pool_gb, **config},
        num_layers=LAYERS,
        num_kv_heads=HEADS,
        head_dim=HEAD_DIM,
        dtype=torch.bfloat16,
    )


def request(seed: int, chunks: int) -> tuple[list[int], torch.Tensor]:
    """Random tokens and matching random KV, `chunks` full chunks long."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 50_000, (chunks * CHUNK,), generator=generator).tolist()
    kv = torch.randn(LAYERS, 2, chunks * CHUNK, HEADS * HEAD_DIM, generator=generator).to(torch.bfloat16)
    return tokens, kv


def assert_no_leak(engine: CacheEngine) -> None:
    """No reference left behind, and exactly one pool allocation per chunk held.

    Waits for the disk writer first: until it is idle it legitimately holds a reference on the
    CPU chunk it is copying (and keeps an evicted chunk's space until that copy ends)."""
    engine.flush()
    entries = engine.cpu.committed_entries()
    assert all(entry.refcount == 0 for entry in entries)
    assert engine.cpu.allocator.num_allocations == len(entries)


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


# ---- engines registered with a controller (LMCache's controller protocol) ----


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

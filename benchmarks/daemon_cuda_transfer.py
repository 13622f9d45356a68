"""`cachelayer server` on a GPU host: a 4k-token Llama-8B-shaped request moved between GPU memory
and the daemon's shared pool, with the pool page-locked for CUDA in the client (cudaHostRegister)
and without, against same-run copies between the GPU and pinned host memory (the PCIe ceiling).

KV of 32 layers x 2 x 4096 tokens x 8 KV heads x 128 x bf16 = 512 MiB a request, chunk_size 256,
one real daemon process, one client process holding the KV on the GPU. Store: GPU tensor -> pool
(the client's `store`); retrieve: pool -> GPU tensor (`retrieve(out=...)`, as a connector loads).
Median over rounds; ratios are the pinned copy's time over the operation's time.

    python -m benchmarks.daemon_cuda_transfer [--rounds 7] [--pool-gb 3]

Writes benchmarks/results/daemon_cuda_transfer.{json,md}. Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch

from cachelayer.server import KeySpace, StoreClient
from kvgate_testing.provenance import with_source

LAYERS, KV_HEADS, HEAD_DIM, TOKENS, CHUNK = 32, 8, 128, 4096, 256
REQUEST_BYTES = LAYERS * 2 * TOKENS * KV_HEADS * HEAD_DIM * 2
SPACE = KeySpace(
    model="llama-8b-shaped", dtype="bfloat16", num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM
)
RESULTS = Path(__file__).parent / "results"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def timed(operation, rounds: int) -> float:
    """Median seconds of `operation()` over rounds, each ended by a device sync."""
    seconds = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        started = time.perf_counter()
        operation()
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def measure_client(endpoint: str, register: bool, rounds: int, warm_stores: int) -> dict:
    client = StoreClient(
        endpoint, chunk_size=CHUNK, timeout_s=300, transport="shm", register_with_cuda=register
    )
    started = time.perf_counter()
    assert client.transport == "shm"
    attach_seconds = time.perf_counter() - started
    assert client.pool_registered_with_cuda == register
    generator = torch.Generator(device="cuda").manual_seed(int(register))
    kv = torch.randn(LAYERS, 2, TOKENS, KV_HEADS * HEAD_DIM, device="cuda", generator=generator).to(
        torch.bfloat16
    )
    out = torch.empty_like(kv)
    counter = iter(range(1_000_000))

    def fresh_tokens() -> list[int]:
        base = (int(register) * 10**6 + next(counter)) * TOKENS
        return list(range(base, base + TOKENS))

    for _ in range(warm_stores):  # cycle the pool once: page faults are not charged to a round
        client.store(SPACE, fresh_tokens(), kv)
    stored: list[list[int]] = []

    def store() -> None:
        tokens = fresh_tokens()
        held, _ = client.store(SPACE, tokens, kv)
        assert held == TOKENS, f"stored {held} of {TOKENS}"
        stored.append(tokens)

    store_seconds = timed(store, rounds)

    def retrieve() -> None:
        hit, _ = client.retrieve(SPACE, stored[-1], out=out)
        assert hit == TOKENS, f"retrieved {hit} of {TOKENS}"

    out.zero_()
    retrieve()
    assert torch.equal(out.view(torch.int16), kv.view(torch.int16)), "retrieve returned other bytes"
    retrieve_seconds = timed(retrieve, rounds)

    def lease_only() -> None:  # the control plane of a retrieve: lease and release, no copy
        with client.leased(SPACE, stored[-1]) as lease:
            assert lease.hit_tokens == TOKENS

    lease_seconds = timed(lease_only, rounds)
    client.close()
    return {
        "registered": register,
        "attach_and_register_seconds": attach_seconds,
        "store_seconds": store_seconds,
        "retrieve_seconds": retrieve_seconds,
        "lease_and_release_seconds": lease_seconds,
        "store_GBps": REQUEST_BYTES / store_seconds / 1e9,
        "retrieve_GBps": REQUEST_BYTES / retrieve_seconds / 1e9,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--pool-gb", type=float, default=3.0, help="the daemon's --l1-size-gb")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("daemon_cuda_transfer needs CUDA")

    pinned = torch.empty(LAYERS, 2, TOKENS, KV_HEADS * HEAD_DIM, dtype=torch.bfloat16, pin_memory=True)
    device = torch.empty_like(pinned, device="cuda")
    pinned_h2d = timed(lambda: device.copy_(pinned, non_blocking=True), args.rounds)
    pinned_d2h = timed(lambda: pinned.copy_(device, non_blocking=True), args.rounds)

    port, http_port = free_port(), free_port()
    daemon_args = [sys.executable, "-m", "cachelayer.cli", "server", "--host", "127.0.0.1",
                   "--port", str(port), "--http-port", str(http_port), "--chunk-size", str(CHUNK),
                   "--l1-size-gb", str(args.pool_gb)]  # fmt: skip
    daemon = subprocess.Popen(daemon_args)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{http_port}/healthcheck", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if daemon.poll() is not None or time.monotonic() > deadline:
                sys.exit("the daemon did not start")
            time.sleep(0.2)
        warm = int(args.pool_gb * 2**30 // REQUEST_BYTES) + 1
        rows = [
            measure_client(f"tcp://127.0.0.1:{port}", register, args.rounds, warm)
            for register in (True, False)
        ]
    finally:
        daemon.terminate()
        daemon.wait(timeout=30)
    for row in rows:
        row["store_over_pinned_d2h"] = pinned_d2h / row["store_seconds"]
        row["retrieve_over_pinned_h2d"] = pinned_h2d / row["retrieve_seconds"]
    results = {
        "pinned_h2d_GBps": REQUEST_BYTES / pinned_h2d / 1e9,
        "pinned_d2h_GBps": REQUEST_BYTES / pinned_d2h / 1e9,
        "rows": rows,
        "request_bytes": REQUEST_BYTES,
        "pool_gb": args.pool_gb,
        "gpu": torch.cuda.get_device_name(),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "torch": torch.__version__,
        "command": "python -m benchmarks.daemon_cuda_transfer " + " ".join(sys.argv[1:]),
    }
    print(json.dumps(results, indent=2))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "daemon_cuda_transfer.json").write_text(json.dumps(with_source(results), indent=2) + "\n")
    write_report(results)


def write_report(results: dict) -> None:
    lines = [
        "# `cachelayer server` on a GPU host: the shared pool page-locked for CUDA, or not",
        "",
        f"A 4096-token Llama-8B-shaped request ({results['request_bytes'] / 2**20:.0f} MiB, bf16) between "
        f"GPU memory ({results['gpu']}) and one real `cachelayer server`'s shared pool "
        f"(L1 {results['pool_gb']} GB), chunk_size {CHUNK}, one client. The ceiling is the same run's "
        f"copy between the GPU and pinned host memory: {results['pinned_h2d_GBps']:.1f} GB/s host to "
        f"device, {results['pinned_d2h_GBps']:.1f} GB/s device to host. Median of rounds. "
        f"Command: `{results['command']}`.",
        "",
        "| pool | store GPU -> pool GB/s | retrieve pool -> GPU GB/s | store / pinned | retrieve / pinned "
        "| lease + release, no copy (ms) | attach (+ register) s |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in results["rows"]:
        lines.append(
            f"| {'registered (cudaHostRegister)' if row['registered'] else 'pageable'} "
            f"| {row['store_GBps']:.1f} | {row['retrieve_GBps']:.1f} | {row['store_over_pinned_d2h']:.0%} "
            f"| {row['retrieve_over_pinned_h2d']:.0%} | {row['lease_and_release_seconds'] * 1e3:.1f} "
            f"| {row['attach_and_register_seconds']:.2f} |"
        )
    lines += [
        "",
        "Registered: the client page-locks the daemon's pool once when it maps it "
        "(`StoreClient(register_with_cuda=True)`, which the vLLM connector sets when its KV is on a "
        "GPU), so each chunk moves between the pool and the GPU in one DMA copy. Pageable: the same "
        "copies through memory the driver must stage in its own pinned buffers.",
        "",
    ]
    (RESULTS / "daemon_cuda_transfer.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()

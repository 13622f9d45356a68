"""`cachelayer server` on the same host: store / retrieve GB/s of a 4k-token Llama-8B-shaped request,
through shared memory and through TCP, against a same-run memcpy of the same bytes.

KV of 32 layers x 2 x 4096 tokens x 8 KV heads x 128 x bf16 = 512 MiB a request, chunk_size 256.
One real daemon process; 1, 2 and 4 client processes that run each operation at the same moment
(a barrier before each): memcpy of the request into a buffer (the ceiling, contending for memory
bandwidth like the transfers do), store of a fresh request, retrieve of it into a caller buffer
(`StoreClient.retrieve(out=)`: on shared memory a lease, each leased chunk copied into one
contiguous tensor), and the connector's own read (`connector_load`): what vLLM's connector runs for
a hit, `cachelayer.connectors.transfers.load_request` through `RemoteChunkStore`, which on shared
memory holds the chunks under a lease and scatters the leased views straight into a paged KV cache
in vLLM's CPU layout (`cpu_blocks`, blocks of CONNECTOR_BLOCK_SIZE tokens; over TCP it retrieves,
then scatters). Median over rounds; each ratio compares one client's operation to the same
clients' memcpy in the same run.

    .venv/bin/python -m benchmarks.daemon_transfer [--rounds 5] [--tcp-rounds 2] [--clients 1,2,4]

Writes benchmarks/results/daemon_transfer.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from cachelayer.connectors.transfers import PagedKV, RemoteChunkStore, load_request
from cachelayer.engine import copy_tensor
from cachelayer.server import KeySpace, StoreClient
from kvgate_testing.ports import free_port
from kvgate_testing.processes import ManagedProcess, wait_for_http
from kvgate_testing.provenance import with_source

LAYERS, KV_HEADS, HEAD_DIM, TOKENS, CHUNK = 32, 8, 128, 4096, 256
REQUEST_BYTES = LAYERS * 2 * TOKENS * KV_HEADS * HEAD_DIM * 2
SPACE = KeySpace(
    model="llama-8b-shaped", dtype="bfloat16", num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM
)
RESULTS = Path(__file__).parent / "results"
# The connector's paged cache: vLLM's CPU layout, per layer [blocks, KV heads, block size, 2 x head dim].
CONNECTOR_BLOCK_SIZE = 32
OPERATIONS = ("memcpy", "store", "retrieve", "connector_load")


def client_process(endpoint, transport, worker, rounds, warm_stores, barrier, results) -> None:
    """One engine-like client: times memcpy, store and retrieve, each started with the others."""
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(worker)
    kv = torch.randn(LAYERS, 2, TOKENS, KV_HEADS * HEAD_DIM, generator=generator).to(torch.bfloat16)
    # The memcpy target is the retrieve target too (the phases never overlap): less memory per client.
    out = destination = torch.empty_like(kv)
    client = StoreClient(endpoint, chunk_size=CHUNK, timeout_s=300, transport=transport)
    assert client.transport == transport, f"asked for {transport}, got {client.transport}"
    counter = iter(range(1_000_000))

    def fresh_tokens() -> list[int]:
        base = worker * 10**9 + next(counter) * TOKENS
        return list(range(base, base + TOKENS))

    # Touch the buffers and cycle the daemon's pool once, so no page fault is charged to a round.
    copy_tensor(destination, kv)
    for _ in range(warm_stores):
        client.store(SPACE, fresh_tokens(), kv)
    blocks = TOKENS // CONNECTOR_BLOCK_SIZE
    paged = PagedKV(
        [torch.zeros(blocks, KV_HEADS, CONNECTOR_BLOCK_SIZE, 2 * HEAD_DIM, dtype=torch.bfloat16)
         for _ in range(LAYERS)],
        layout="cpu_blocks", block_size=CONNECTOR_BLOCK_SIZE, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
    )  # fmt: skip
    store = RemoteChunkStore(client, SPACE)
    warm_tokens = fresh_tokens()  # one untimed load: the paged cache's pages faulted in before round 0
    client.store(SPACE, warm_tokens, kv)
    load_request(paged, store, token_ids=warm_tokens, block_ids=range(blocks), first_block=0, cache_salt=None)
    paged.kv_caches[0].zero_()  # so round 0's check sees what its own load wrote (layer 0 at least)
    times: dict[str, list[float]] = {operation: [] for operation in OPERATIONS}
    for round_ in range(rounds):
        barrier.wait()
        started = time.perf_counter()
        copy_tensor(destination, kv)
        times["memcpy"].append(time.perf_counter() - started)

        tokens = fresh_tokens()
        barrier.wait()
        started = time.perf_counter()
        held, _ = client.store(SPACE, tokens, kv)
        times["store"].append(time.perf_counter() - started)
        assert held == TOKENS, f"stored {held} of {TOKENS} tokens"

        if round_ == 0:
            out.zero_()  # so the check below sees what retrieve wrote, not the memcpy
        barrier.wait()
        started = time.perf_counter()
        hit, _ = client.retrieve(SPACE, tokens, out=out)
        times["retrieve"].append(time.perf_counter() - started)
        assert hit == TOKENS, f"retrieved {hit} of {TOKENS} tokens"
        if round_ == 0:
            assert torch.equal(out.view(torch.int16), kv.view(torch.int16)), "retrieve returned other bytes"

        barrier.wait()
        started = time.perf_counter()
        failed = load_request(
            paged, store, token_ids=tokens, block_ids=range(blocks), first_block=0, cache_salt=None
        )
        times["connector_load"].append(time.perf_counter() - started)
        assert not failed, f"the connector could not load blocks {sorted(failed)[:8]}"
        if round_ == 0:
            loaded = paged.gather(range(blocks))
            same = torch.equal(loaded.view(torch.int16), kv.view(torch.int16))
            assert same, "the connector loaded other bytes than were stored"
    client.close()
    results.put((worker, times))


def run_clients(endpoint: str, transport: str, clients: int, rounds: int, warm_stores: int) -> dict:
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(clients), context.Queue()
    processes = [
        context.Process(
            target=client_process, args=(endpoint, transport, worker, rounds, warm_stores, barrier, results)
        )
        for worker in range(clients)
    ]
    for process in processes:
        process.start()
    per_worker = [results.get(timeout=1800) for _ in processes]
    for process in processes:
        process.join(timeout=60)
        if process.exitcode != 0:
            raise RuntimeError(f"a {transport} client failed (exit code {process.exitcode})")
    # Per operation: the median over rounds of the slowest client (the round's wall time for all).
    row: dict = {"transport": transport, "clients": clients, "rounds": rounds}
    for operation in OPERATIONS:
        slowest = [max(times[operation][r] for _, times in per_worker) for r in range(rounds)]
        seconds = statistics.median(slowest)
        row[f"{operation}_seconds"] = seconds
        row[f"{operation}_GBps_per_client"] = REQUEST_BYTES / seconds / 1e9
        row[f"{operation}_GBps_total"] = clients * REQUEST_BYTES / seconds / 1e9
    row["store_over_memcpy"] = row["memcpy_seconds"] / row["store_seconds"]
    row["retrieve_over_memcpy"] = row["memcpy_seconds"] / row["retrieve_seconds"]
    row["connector_load_over_memcpy"] = row["memcpy_seconds"] / row["connector_load_seconds"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds on the shared-memory path")
    parser.add_argument(
        "--tcp-rounds", type=int, default=2, help="measured rounds on the TCP path (slow; 0 leaves TCP out)"
    )
    parser.add_argument("--clients", default="1,2,4", help="concurrent client counts")
    parser.add_argument("--pool-gb", type=float, default=2.5, help="the daemon's --l1-size-gb")
    parser.add_argument(
        "--output", default=str(RESULTS / "daemon_transfer"), help="path prefix of the .json, .md and .png"
    )
    args = parser.parse_args()
    counts = [int(count) for count in args.clients.split(",")]

    port, http_port = free_port(), free_port()
    daemon_args = [sys.executable, "-m", "cachelayer.cli", "server", "--host", "127.0.0.1",
                   "--port", str(port), "--http-port", str(http_port), "--chunk-size", str(CHUNK),
                   "--l1-size-gb", str(args.pool_gb)]  # fmt: skip
    rows = []
    with ManagedProcess(daemon_args) as daemon:
        wait_for_http(f"http://127.0.0.1:{http_port}/healthcheck", daemon, timeout_s=120)
        endpoint = f"tcp://127.0.0.1:{port}"
        # Steady state: every shared-memory client first stores enough to cycle the whole pool, so
        # its own page tables cover the pool (a fresh process pays a page fault per 4 KiB it first
        # touches) and the daemon's pages exist; a TCP client never maps the pool.
        pool_requests = int(args.pool_gb * 2**30 // REQUEST_BYTES) + 1
        for count in counts:
            for transport, rounds in (("shm", args.rounds), ("tcp", args.tcp_rounds)):
                if rounds < 1:
                    continue
                warm = pool_requests if transport == "shm" or not rows else 1
                row = run_clients(endpoint, transport, count, rounds, warm)
                row["warm_stores_per_client"] = warm
                rows.append(row)
                print(json.dumps(row), flush=True)

    single_shm = next(row for row in rows if row["transport"] == "shm" and row["clients"] == 1)
    single_tcp = next((row for row in rows if row["transport"] == "tcp" and row["clients"] == 1), {})
    results = {
        "store_over_memcpy": single_shm["store_over_memcpy"],
        "retrieve_over_memcpy": single_shm["retrieve_over_memcpy"],
        "connector_load_over_memcpy": single_shm["connector_load_over_memcpy"],
        "tcp_store_over_memcpy": single_tcp.get("store_over_memcpy"),
        "tcp_retrieve_over_memcpy": single_tcp.get("retrieve_over_memcpy"),
        "tcp_connector_load_over_memcpy": single_tcp.get("connector_load_over_memcpy"),
        "shape": dict(
            layers=LAYERS,
            kv_heads=KV_HEADS,
            head_dim=HEAD_DIM,
            dtype="bfloat16",
            tokens=TOKENS,
            chunk_size=CHUNK,
            connector_block_size=CONNECTOR_BLOCK_SIZE,
        ),
        "request_bytes": REQUEST_BYTES,
        "pool_gb": args.pool_gb,
        "rows": rows,
        "cpu_count": os.cpu_count(),
        "load_average_at_end": os.getloadavg(),
        "machine": platform.machine(),
        "torch": torch.__version__,
        "command": "python -m benchmarks.daemon_transfer " + " ".join(sys.argv[1:]),
    }
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.with_suffix(".json").write_text(json.dumps(with_source(results), indent=2) + "\n")
    write_report(results, output)
    plot(results, output)


def write_report(results: dict, output: Path) -> None:
    lines = [
        "# `cachelayer server` on the same host: shared memory against TCP",
        "",
        f"A 4096-token Llama-8B-shaped request (32 layers x 2 x 8 KV heads x 128 x bf16 = "
        f"{results['request_bytes'] / 2**20:.0f} MiB), chunk_size {CHUNK}, through one real "
        f"`cachelayer server` (L1 {results['pool_gb']} GB, full, so stores evict) from "
        f"{' / '.join(str(c) for c in dict.fromkeys(row['clients'] for row in results['rows']))} "
        "client processes that start each operation together. memcpy is the same clients copying "
        "the same bytes in the same run; ratios are memcpy time / operation time (1.0 = memcpy speed). "
        "Times are the median over rounds of the slowest client. Retrieve is "
        "`StoreClient.retrieve(out=)` into one contiguous caller buffer; connector load is what vLLM's "
        "connector runs for a hit (`load_request` through `RemoteChunkStore`: on shared memory the "
        "leased views of the pool scattered into a paged KV cache in vLLM's CPU layout, blocks of "
        f"{results['shape'].get('connector_block_size', CONNECTOR_BLOCK_SIZE)} tokens). "
        f"Command: `{results['command']}`.",
        "",
        f"Single client, shared memory: store {results['store_over_memcpy']:.0%}, retrieve "
        f"{results['retrieve_over_memcpy']:.0%} and connector load "
        f"{results['connector_load_over_memcpy']:.0%} of memcpy; "
        + (
            f"TCP: store {results['tcp_store_over_memcpy']:.1%}, "
            f"retrieve {results['tcp_retrieve_over_memcpy']:.1%}, "
            f"connector load {results['tcp_connector_load_over_memcpy']:.1%}."
            if results.get("tcp_store_over_memcpy") is not None
            else "TCP not measured in this run (`--tcp-rounds 0`)."
        ),
        "",
        "| path | clients | memcpy GB/s per client | store GB/s per client | retrieve GB/s per client "
        "| connector load GB/s per client | store / memcpy | retrieve / memcpy | connector load / memcpy "
        "| store GB/s total | retrieve GB/s total | connector load GB/s total |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in results["rows"]:
        lines.append(
            f"| {row['transport']} | {row['clients']} | {row['memcpy_GBps_per_client']:.2f} "
            f"| {row['store_GBps_per_client']:.2f} | {row['retrieve_GBps_per_client']:.2f} "
            f"| {row['connector_load_GBps_per_client']:.2f} "
            f"| {row['store_over_memcpy']:.0%} | {row['retrieve_over_memcpy']:.0%} "
            f"| {row['connector_load_over_memcpy']:.0%} "
            f"| {row['store_GBps_total']:.2f} | {row['retrieve_GBps_total']:.2f} "
            f"| {row['connector_load_GBps_total']:.2f} |"
        )
    lines += [
        "",
        "Shared memory: store and retrieve copy each chunk straight between the client's tensor and "
        "the daemon's pool (one copy), and the socket carries only keys, offsets and lease ids; the "
        "connector's load reorders each leased chunk into vLLM's block layout on its way (a copy into "
        "a block-ordered buffer, then a scatter into the blocks). TCP: the bytes "
        "cross the socket and are copied again on each side. Each shared-memory client first "
        "stores enough to cycle the whole pool (`warm_stores_per_client` in the JSON), so the "
        "figures are a long-running engine's: a fresh process pays a page fault for each 4 KiB of "
        "the pool it touches for the first time, which made concurrent stores of fresh clients "
        "run at about a quarter of memcpy in an earlier run. "
        f"This machine ({results['cpu_count']} cores) was shared with other jobs during the run "
        f"(load average at the end {results['load_average_at_end'][0]:.1f}): absolute numbers move "
        "between runs, the same-run ratios much less.",
        "",
        f"![throughput]({output.with_suffix('.png').name})",
        "",
    ]
    output.with_suffix(".md").write_text("\n".join(lines))


def plot(results: dict, output: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 3.8))
    rows = results["rows"]
    labels = [f"{row['transport']} x{row['clients']}" for row in rows]
    positions = range(len(rows))
    width = 0.27
    for offset, key, label in ((-width, "store_over_memcpy", "store / memcpy"),
                               (0.0, "retrieve_over_memcpy", "retrieve(out=) / memcpy"),
                               (width, "connector_load_over_memcpy", "connector load / memcpy")):  # fmt: skip
        bars = axis.bar([p + offset for p in positions], [row[key] for row in rows], width, label=label)
        axis.bar_label(bars, fmt="%.2f", fontsize=6)
    axis.axhline(0.5, color="grey", linestyle="--", linewidth=0.8, label="goal 0.5")
    axis.set_xticks(list(positions), labels)
    axis.set_ylabel("share of a same-run memcpy")
    axis.set_title("cachelayer server, 512 MiB request: shared memory vs TCP")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(output.with_suffix(".png"), dpi=120)


if __name__ == "__main__":
    main()

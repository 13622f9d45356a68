"""The remote tier on a real redis-server: two cache-layer processes, separate L1, one Redis.

A 4096-token request of a Llama-8B-shaped KV (32 layers, 8 KV heads x 128, bf16: 128 KiB a
token, 512 MiB a request, chunk_size 256) is stored by process A and retrieved by process B,
whose L1 starts empty, so every byte crosses Redis. Side by side in the same run and the same
processes, the ceiling: redis-py SETs (A) and an MGET (B) of the same bytes as plain values, in
one pipeline, as the store would send them. Each round uses fresh tokens (new keys), runs the raw
operation and the cache layer's right after each other, and Redis is flushed between rounds; a
first round warms the processes up (L1 pool pages, buffers) and is not counted. Ratios are the
median over rounds of each round's ratio (the machine's load moves both sides of a round alike).

- store: `store()` (the copy into L1) until the background writer has put every chunk in Redis
  (`flush_remote`), against the raw SETs; the write-through alone (from `store()` returning) is
  reported too. retrieve: `retrieve(out=)` into a preallocated buffer as the vLLM connector does
  (fetch, check, promote to L1, copy out), against the raw MGET.
- bytes on the wire: what the writer sent for the same tokens with remote_serde naive and
  cachegen (cachegen on the first --cachegen-tokens tokens: its CPU encoder runs at ~0.1 GB/s).

    .venv/bin/python -m benchmarks.remote_tier [--repeats 3] [--tokens 4096] [--layers 32]

Writes benchmarks/results/remote_tier.{json,md,png}.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import platform
import statistics
import subprocess
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import redis
import torch

from kvgate_testing.provenance import with_source

KV_HEADS, HEAD_DIM, CHUNK = 8, 128, 256
RESULTS = Path(__file__).parent / "results"
RAW_PREFIX = "raw-bench:"


def request(seed: int, tokens: int, layers: int) -> tuple[list[int], torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    token_ids = list(range(seed * tokens, (seed + 1) * tokens))
    kv = torch.randn(layers, 2, tokens, KV_HEADS * HEAD_DIM, generator=generator).to(torch.bfloat16)
    return token_ids, kv


def chunk_bytes(kv: torch.Tensor) -> list[bytes]:
    """The request's chunks as contiguous bytes, as a plain Redis client would have them."""
    return [
        kv[:, :, start : start + CHUNK].contiguous().view(torch.uint8).numpy().tobytes()
        for start in range(0, kv.shape[2], CHUNK)
    ]


def worker(conn: Connection, url: str, tokens: int, layers: int, serde: str) -> None:
    """One cache-layer process (its own L1) that runs the commands it is sent, timing each."""
    from cachelayer import CacheEngine

    request_bytes = layers * 2 * tokens * KV_HEADS * HEAD_DIM * 2
    engine = CacheEngine.from_config(
        {
            "chunk_size": CHUNK,
            "max_local_cpu_size": 1.5 * request_bytes / 2**30,
            "remote_url": url,
            "remote_serde": serde,
            "remote_timeout_s": 30.0,
            "blocking_timeout_secs": 30,
        },
        num_layers=layers,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        dtype=torch.bfloat16,
        model_name="meta-llama/Llama-3.1-8B",
    )
    client = redis.Redis.from_url(url, socket_timeout=60)
    prepared: dict[int, tuple[list[int], torch.Tensor]] = {}
    out = torch.zeros(layers, 2, tokens, KV_HEADS * HEAD_DIM, dtype=torch.bfloat16)  # touched once
    while True:
        command, seed = conn.recv()
        if command == "stop":
            break
        if command == "prepare":  # untimed: make the request's tensors
            prepared[seed] = request(seed, tokens, layers)
            conn.send(None)
            continue
        token_ids, kv = prepared[seed]
        started = time.perf_counter()
        parts: dict[str, float] = {}
        if command == "store":
            engine.store(token_ids, kv)
            parts["store_call"] = time.perf_counter() - started
            assert engine.flush_remote(timeout_s=300)
        elif command == "retrieve":
            engine.clear()  # L1 empty: every chunk comes from Redis
            started = time.perf_counter()
            hit, loaded = engine.retrieve(token_ids, out=out)
            parts["retrieve"] = time.perf_counter() - started
            assert hit == tokens and torch.equal(loaded, kv), f"retrieve hit {hit} of {tokens}"
        elif command == "lookup":
            engine.clear()
            started = time.perf_counter()
            assert engine.lookup(token_ids) == tokens
        elif command in ("raw_set", "raw_get"):
            values = chunk_bytes(kv)
            keys = [f"{RAW_PREFIX}{seed}:{index}" for index in range(len(values))]
            started = time.perf_counter()
            if command == "raw_set":
                pipeline = client.pipeline(transaction=False)
                for key, value in zip(keys, values, strict=True):
                    pipeline.set(key, value)
                pipeline.execute()
            else:
                fetched = client.mget(keys)
                assert fetched == values
        elapsed = time.perf_counter() - started
        conn.send((elapsed, parts | engine.stats()))
    engine.close()
    client.close()


class Worker:
    def __init__(self, url: str, tokens: int, layers: int, serde: str = "naive") -> None:
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(target=worker, args=(child, url, tokens, layers, serde), daemon=True)
        self.process.start()

    def __call__(self, command: str, seed: int) -> Any:
        self.conn.send((command, seed))
        return self.conn.recv()

    def stop(self) -> None:
        with contextlib.suppress(OSError):  # it died already
            self.conn.send(("stop", 0))
        self.process.join(timeout=60)
        if self.process.is_alive():
            self.process.kill()


def start_redis() -> tuple[subprocess.Popen, str]:
    import socket
    import tempfile

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    directory = tempfile.mkdtemp(prefix="remote-tier-bench-")
    process = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", directory, "--proto-max-bulk-len", "1gb"],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    for _ in range(200):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    client.close()
    return process, url


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--cachegen-tokens", type=int, default=1024)
    args = parser.parse_args()
    request_bytes = args.layers * 2 * args.tokens * KV_HEADS * HEAD_DIM * 2

    server, url = start_redis()
    client = redis.Redis.from_url(url)
    writer = reader = None
    try:
        writer, reader = Worker(url, args.tokens, args.layers), Worker(url, args.tokens, args.layers)
        names = ("store", "store_call", "write_through", "raw_set", "retrieve", "raw_get", "lookup")
        times: dict[str, list[float]] = {name: [] for name in names}
        for round_index in range(args.repeats + 1):  # round 0 warms up
            seed = round_index + 1
            client.flushall()
            writer("prepare", seed), reader("prepare", seed)
            raw_set_s, _ = writer("raw_set", seed)
            store_s, stats = writer("store", seed)
            raw_get_s, _ = reader("raw_get", seed)
            retrieve_s, _ = reader("retrieve", seed)
            lookup_s, _ = reader("lookup", seed)
            if round_index == 0:
                print(f"warm-up: store {store_s * 1e3:.0f}, retrieve {retrieve_s * 1e3:.0f} ms", flush=True)
                continue
            measured = {
                "store": store_s, "store_call": stats["store_call"],
                "write_through": store_s - stats["store_call"], "raw_set": raw_set_s,
                "retrieve": retrieve_s, "raw_get": raw_get_s, "lookup": lookup_s,
            }  # fmt: skip
            for name, value in measured.items():
                times[name].append(value)
            done = ", ".join(f"{name} {values[-1] * 1e3:.0f} ms" for name, values in times.items())
            print(f"round {round_index}: {done}", flush=True)
        writer.stop(), reader.stop()
        writer = reader = None

        # Bytes on the wire per serde, for the same tokens.
        wire: dict[str, int] = {}
        for serde in ("naive", "cachegen"):
            client.flushall()
            one = Worker(url, args.cachegen_tokens, args.layers, serde)
            try:
                one("prepare", 99)
                _, stats = one("store", 99)
                wire[serde] = stats["remote_bytes_out"]
            finally:
                one.stop()
    finally:
        try:
            for process in (writer, reader):
                if process is not None:
                    process.stop()
            client.close()
        finally:
            server.terminate()
            server.wait(timeout=30)

    median = {name: statistics.median(values) for name, values in times.items()}
    gbps = {name: request_bytes / value / 1e9 for name, value in median.items() if name != "lookup"}

    def paired(raw: str, ours: str) -> float:
        return statistics.median(r / o for r, o in zip(times[raw], times[ours], strict=True))

    results = {
        "retrieve_over_raw_redis": paired("raw_get", "retrieve"),
        "store_over_raw_redis": paired("raw_set", "store"),
        "write_through_over_raw_redis": paired("raw_set", "write_through"),
        "bytes_ratio_cachegen_over_naive": wire["cachegen"] / wire["naive"],
        "goal": "retrieve and store >= 0.70 of raw Redis",
        "shape": {
            "layers": args.layers,
            "kv_heads": KV_HEADS,
            "head_dim": HEAD_DIM,
            "dtype": "bfloat16",
            "tokens": args.tokens,
            "chunk_size": CHUNK,
            "request_bytes": request_bytes,
            "cachegen_tokens": args.cachegen_tokens,
        },
        "median_s": median,
        "GBps": gbps,
        "lookup_ms": median["lookup"] * 1e3,
        "wire_bytes": wire,
        "rounds_s": times,
        "repeats": args.repeats,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "redis": redis_version()},
        "command": "python -m benchmarks.remote_tier "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "remote_tier.json").write_text(json.dumps(with_source(results), indent=2) + "\n")
    write_report(results)
    plot(results)
    print(json.dumps({k: results[k] for k in list(results)[:3]} | {"GBps": gbps}, indent=2))


def redis_version() -> str:
    output = subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout
    return output.strip()


def round_ratios(rounds: dict[str, list[float]], raw: str, ours: str) -> str:
    return ", ".join(f"{r / o:.2f}" for r, o in zip(rounds[raw], rounds[ours], strict=True))


def write_report(results: dict) -> None:
    shape = results["shape"]
    gbps = results["GBps"]
    rounds = results["rounds_s"]
    lines = [
        "# Remote tier on Redis: two cache-layer processes, one redis-server",
        "",
        f"Request: {shape['tokens']} tokens x {shape['layers']} layers x {shape['kv_heads']} KV heads x "
        f"{shape['head_dim']} ({shape['dtype']}), {shape['request_bytes'] / 2**20:.0f} MiB, chunk "
        f"{shape['chunk_size']}. Stored by process A, retrieved by process B (separate L1, B's empty). "
        f"{results['repeats']} rounds after a warm-up; ratios are medians of per-round ratios, GB/s "
        f"medians of the rounds. Command: `{results['command']}`.",
        "",
        "| | cache layer | raw redis-py, same bytes | ratio (goal >= 0.70) |",
        "|---|---|---|---|",
        f"| store (L1 copy + write-through done) | {gbps['store']:.2f} GB/s | SET pipeline "
        f"{gbps['raw_set']:.2f} GB/s | {results['store_over_raw_redis']:.2f} |",
        f"| of which the write-through (behind the engine) | {gbps['write_through']:.2f} GB/s | | "
        f"{results['write_through_over_raw_redis']:.2f} |",
        f"| retrieve (B, promote to L1) | {gbps['retrieve']:.2f} GB/s | MGET {gbps['raw_get']:.2f} GB/s "
        f"| {results['retrieve_over_raw_redis']:.2f} |",
        "",
        f"Per-round ratios (this machine's load moves them a lot): retrieve "
        f"{round_ratios(rounds, 'raw_get', 'retrieve')}; store {round_ratios(rounds, 'raw_set', 'store')}.",
        "",
        f"Lookup of the whole prompt from B (one EXISTS round trip): {results['lookup_ms']:.1f} ms.",
        "",
        f"Bytes on the wire for {shape['cachegen_tokens']} tokens: naive {results['wire_bytes']['naive']:,}, "
        f"cachegen {results['wire_bytes']['cachegen']:,} "
        f"(ratio {results['bytes_ratio_cachegen_over_naive']:.3f}).",
        "",
        f"Machine: {results['machine']['cpus']} CPUs, {results['machine']['redis']}.",
        "",
        "![throughput](remote_tier.png)",
        "",
        *RELATED_RESULTS,
    ]
    (RESULTS / "remote_tier.md").write_text("\n".join(lines))


# The other measurements, each in its own results file (written by its own benchmark).
RELATED_RESULTS = [
    "## The issue's other measurements",
    "",
    "| measurement | results |",
    "|---|---|",
    "| routing with a shared tier (simulated engines, `routing_bench --shared-tier`): kv_aware told of "
    "the tier against kv_aware not told, least_loaded and the peers; load max/mean, TTFT p90 | "
    "[routing_shared_tier.md](routing_shared_tier.md) |",
    "",
]


def plot(results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gbps = results["GBps"]
    figure, (throughput, wire) = plt.subplots(1, 2, figsize=(10, 4))
    names = ["store", "raw_set", "retrieve", "raw_get"]
    colors = ["tab:blue", "tab:gray", "tab:green", "tab:gray"]
    throughput.bar(names, [gbps[name] for name in names], color=colors)
    throughput.set_ylabel("GB/s")
    throughput.set_title("cache layer vs raw redis-py (same bytes)")
    wire_bytes = results["wire_bytes"]
    wire.bar(["naive", "cachegen"], [wire_bytes["naive"] / 2**20, wire_bytes["cachegen"] / 2**20])
    wire.set_ylabel("MiB on the wire")
    wire.set_title(f"bytes sent for {results['shape']['cachegen_tokens']} tokens")
    figure.tight_layout()
    figure.savefig(RESULTS / "remote_tier.png", dpi=120)


if __name__ == "__main__":
    main()

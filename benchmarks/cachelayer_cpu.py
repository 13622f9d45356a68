"""Cache layer on CPU: store and retrieve GB/s for 4k-token requests of a Llama-8B-shaped KV.

KV of 32 layers, 8 KV heads, head_dim 128, bf16 (128 KiB a token, 512 MiB per 4096-token
request), chunk_size 256. Measured side by side in one run: a plain torch copy of the same bytes
(the memcpy ceiling), CacheEngine.store of fresh requests (eviction running once the pool is
full), the same store by a tenant at its quota (tenant_quotas: every store evicts the tenant's
own oldest chunks), retrieve into a new tensor and into a caller buffer (out=), lookup, and the
key hashing alone for both algorithms. Each round runs every operation once, in turn; median of
the rounds. A second part times the bookkeeping alone: stores of tiny chunks (2 KiB), with and
without quotas, where the copy costs next to nothing.

    .venv/bin/python -m benchmarks.cachelayer_cpu [--repeats 7] [--pool-gb 2.5]

Writes benchmarks/results/cachelayer_cpu.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from cachelayer import CacheEngine
from cachelayer.keys import CacheIdentity, chunk_spans
from kvgate_testing.provenance import with_source

LAYERS, KV_HEADS, HEAD_DIM, TOKENS, CHUNK = 32, 8, 128, 4096, 256
RESULTS = Path(__file__).parent / "results"


def timed(function, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        times.append(time.perf_counter() - started)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--pool-gb", type=float, default=2.5)
    args = parser.parse_args()

    request_bytes = LAYERS * 2 * TOKENS * KV_HEADS * HEAD_DIM * 2
    generator = torch.Generator().manual_seed(0)
    kv = torch.randn(LAYERS, 2, TOKENS, KV_HEADS * HEAD_DIM, generator=generator).to(torch.bfloat16)
    out = torch.empty_like(kv)
    destination = torch.empty_like(kv)
    next_request = iter(range(1_000_000))

    def fresh_tokens() -> list[int]:
        base = next(next_request) * TOKENS
        return list(range(base, base + TOKENS))

    results: dict[str, object] = {
        "shape": {
            "layers": LAYERS,
            "kv_heads": KV_HEADS,
            "head_dim": HEAD_DIM,
            "dtype": "bfloat16",
            "tokens": TOKENS,
            "chunk_size": CHUNK,
        },
        "request_bytes": request_bytes,
        "repeats": args.repeats,
        "pool_gb": args.pool_gb,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "torch": torch.__version__,
    }

    engine = CacheEngine.from_config(
        {"chunk_size": CHUNK, "max_local_cpu_size": args.pool_gb, "pre_caching_hash_algorithm": "xxhash"},
        num_layers=LAYERS,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        dtype=torch.bfloat16,
    )
    # Touch every pool page once so that page faults are not charged to the first stores.
    engine.cpu.pool.fill_(0)
    destination.copy_(kv)
    pool_requests = int(args.pool_gb * 2**30 // request_bytes)
    for _ in range(pool_requests):
        engine.store(fresh_tokens(), kv)

    # The same pool with tenant quotas: tenant "bench" may hold half of it and is filled to its cap,
    # so that each of its stores evicts its own oldest chunks first.
    quota_engine = CacheEngine.from_config(
        {
            "chunk_size": CHUNK,
            "max_local_cpu_size": args.pool_gb,
            "pre_caching_hash_algorithm": "xxhash",
            "tenant_quotas": {"tenants": {"bench": {"l1_share": 0.5}}},
        },
        num_layers=LAYERS,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        dtype=torch.bfloat16,
    )
    quota_engine.cpu.pool.fill_(0)
    for _ in range(pool_requests):
        quota_engine.store(fresh_tokens(), kv, cache_salt="bench")

    stored_tokens: list[list[int]] = []

    def store_once() -> None:
        tokens = fresh_tokens()
        assert engine.store(tokens, kv) == TOKENS
        stored_tokens.append(tokens)

    def store_at_quota() -> None:
        assert quota_engine.store(fresh_tokens(), kv, cache_salt="bench:client") == TOKENS

    store_once()
    hit, loaded = engine.retrieve(stored_tokens[-1])
    assert hit == TOKENS and torch.equal(loaded, kv), "retrieve returned wrong KV"
    del loaded

    # Rounds interleave the operations, so that the load of this shared machine weighs on all alike.
    operations = {
        "memcpy_ceiling": lambda: destination.copy_(kv),  # one contiguous copy of the same bytes
        "store": store_once,
        "store_tenant_at_quota": store_at_quota,
        "retrieve_new_tensor": lambda: engine.retrieve(stored_tokens[-1]),
        "retrieve_into_out": lambda: engine.retrieve(stored_tokens[-1], out=out),
        "lookup_4k_tokens": lambda: engine.lookup(stored_tokens[-1]),
    }
    times: dict[str, list[float]] = {name: [] for name in operations}
    for _ in range(args.repeats):
        for name, operation in operations.items():
            times[name].extend(timed(operation, 1))
    memcpy, store = times["memcpy_ceiling"], times["store"]
    retrieve_new, retrieve_out, lookup = (
        times["retrieve_new_tensor"],
        times["retrieve_into_out"],
        times["lookup_4k_tokens"],
    )
    last = stored_tokens[-1]
    evicted = engine.stats()["cpu_evicted_chunks"]
    quota_usage = quota_engine.stats()["cpu_tenant_usage"]["bench"]
    assert quota_usage["bytes"] <= quota_usage["cap_bytes"], "the tenant went past its cap"
    engine.close()
    quota_engine.close()
    results["bookkeeping_us_per_chunk"] = small_chunk_bookkeeping(args.repeats)

    hashing = {}
    for algorithm in ("sha256_cbor_64bit", "xxhash"):
        hashing[algorithm] = statistics.median(
            timed(
                lambda a=algorithm: chunk_spans(
                    last, chunk_size=CHUNK, identity=CacheIdentity(), algorithm=a
                ),
                args.repeats,
            )
        )

    def gbps(times: list[float]) -> float:
        return request_bytes / statistics.median(times) / 1e9

    results["GBps"] = {
        "memcpy_ceiling": gbps(memcpy),
        "store": gbps(store),
        "store_tenant_at_quota": gbps(times["store_tenant_at_quota"]),
        "retrieve_new_tensor": gbps(retrieve_new),
        "retrieve_into_out": gbps(retrieve_out),
    }
    results["median_seconds"] = {
        "memcpy_ceiling": statistics.median(memcpy),
        "store": statistics.median(store),
        "store_tenant_at_quota": statistics.median(times["store_tenant_at_quota"]),
        "retrieve_new_tensor": statistics.median(retrieve_new),
        "retrieve_into_out": statistics.median(retrieve_out),
        "lookup_4k_tokens": statistics.median(lookup),
        "chunk_keys_4k_tokens": hashing,
    }
    results["evicted_chunks_during_run"] = evicted
    results["all_seconds"] = times
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "cachelayer_cpu.json").write_text(json.dumps(with_source(results), indent=2) + "\n")
    write_report(results)
    plot(results)
    print(json.dumps(results["GBps"], indent=2))


def small_chunk_bookkeeping(repeats: int) -> dict[str, float]:
    """Microseconds a chunk for stores of 16 tiny chunks (2 layers, 2 heads, head_dim 8, 16 tokens:
    2 KiB) into a full pool of 4096, without quotas (the pool evicts) and with them (the tenant, at
    half the pool, evicts its own); interleaved rounds of 200 stores, median."""
    layers, heads, head_dim, chunk, chunks_a_store = 2, 2, 8, 16, 16
    pool_gb = 4096 * layers * 2 * chunk * heads * head_dim * 2 / 2**30
    quotas = {"tenants": {"t": {"l1_share": 0.5}}}
    engines = {
        name: CacheEngine.from_config(
            {
                "chunk_size": chunk,
                "max_local_cpu_size": pool_gb,
                "pre_caching_hash_algorithm": "xxhash",
                **({"tenant_quotas": quotas} if name == "with_quotas" else {}),
            },
            num_layers=layers,
            num_kv_heads=heads,
            head_dim=head_dim,
            dtype=torch.bfloat16,
        )
        for name in ("without_quotas", "with_quotas")
    }
    kv = torch.randn(layers, 2, chunk * chunks_a_store, heads * head_dim).to(torch.bfloat16)
    counter = iter(range(10**9))

    def stores(engine: CacheEngine, count: int) -> None:
        for _ in range(count):
            base = next(counter) * chunk * chunks_a_store
            engine.store(list(range(base, base + chunk * chunks_a_store)), kv, cache_salt="t")

    for engine in engines.values():
        stores(engine, 4096 // chunks_a_store * 2)  # full (and the tenant at its cap)
    per_chunk: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(repeats):
        for name, engine in engines.items():
            started = time.perf_counter()
            stores(engine, 200)
            per_chunk[name].append((time.perf_counter() - started) / (200 * chunks_a_store) * 1e6)
    for engine in engines.values():
        engine.close()
    return {name: statistics.median(values) for name, values in per_chunk.items()}


def write_report(results: dict) -> None:
    speeds, seconds = results["GBps"], results["median_seconds"]
    ceiling = speeds["memcpy_ceiling"]
    lines = [
        "# Cache layer on CPU: store / retrieve throughput",
        "",
        f"Llama-8B-shaped KV (32 layers, 8 KV heads, head_dim 128, bf16), {TOKENS}-token requests "
        f"({results['request_bytes'] / 2**20:.0f} MiB each), chunk_size {CHUNK}, "
        f"L1 pool {results['pool_gb']} GB "
        f"(full, so stores evict: {results['evicted_chunks_during_run']} chunks evicted in the run). "
        f"Median of {results['repeats']} interleaved rounds, torch {results['torch']} "
        f"with {results['torch_threads']} threads "
        f"on {results['cpu_count']} shared cores. Command: `.venv/bin/python -m benchmarks.cachelayer_cpu`.",
        "",
        "| operation | GB/s | share of the memcpy ceiling | median time |",
        "| --- | --- | --- | --- |",
    ]
    for name in (
        "memcpy_ceiling",
        "store",
        "store_tenant_at_quota",
        "retrieve_new_tensor",
        "retrieve_into_out",
    ):
        lines.append(
            f"| {name} | {speeds[name]:.2f} | {speeds[name] / ceiling:.0%} | {seconds[name] * 1000:.1f} ms |"
        )
    keys = seconds["chunk_keys_4k_tokens"]
    lines += [
        "",
        f"Lookup of a 4k-token prompt: {seconds['lookup_4k_tokens'] * 1000:.2f} ms. "
        f"Chunk keys for 4k tokens: sha256_cbor_64bit {keys['sha256_cbor_64bit'] * 1000:.2f} ms, "
        f"xxhash {keys['xxhash'] * 1000:.2f} ms.",
        "",
        f"Tenant quotas: a store by a tenant at its cap (evicting its own oldest chunks) ran at "
        f"{speeds['store_tenant_at_quota'] / speeds['store']:.2f}x the store without quotas (evicting "
        "from the whole pool). Bookkeeping alone, stores of 2 KiB chunks into full pools: "
        f"{results['bookkeeping_us_per_chunk']['without_quotas']:.1f} us a chunk without quotas, "
        f"{results['bookkeeping_us_per_chunk']['with_quotas']:.1f} us with them.",
        "",
        "store copies each chunk's strided slice of the request into its pool allocation and retrieve "
        "copies it back (numpy copyto between CPU tensors: torch's strided copy_ reached only ~60% of "
        "memcpy here); store also hashes the chunk keys and evicts (the pool is full). retrieve into a "
        "new tensor pays for allocating and first touching 512 MiB (page faults) on every call, which "
        "`out=` avoids: connectors should pass their buffer. These machines are shared by several "
        "jobs: absolute numbers move between runs, the ratios much less.",
        "",
        "![throughput](cachelayer_cpu.png)",
        "",
    ]
    (RESULTS / "cachelayer_cpu.md").write_text("\n".join(lines))


def plot(results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    speeds = results["GBps"]
    names = list(speeds)
    figure, axis = plt.subplots(figsize=(7, 3.5))
    bars = axis.bar(
        names,
        [speeds[name] for name in names],
        color=["grey", "tab:blue", "tab:cyan", "tab:orange", "tab:green"],
    )
    axis.bar_label(bars, fmt="%.2f")
    axis.set_ylabel("GB/s")
    axis.set_title("cachelayer on CPU, 4096-token Llama-8B-shaped KV (512 MiB)")
    figure.tight_layout()
    figure.savefig(RESULTS / "cachelayer_cpu.png", dpi=120)


if __name__ == "__main__":
    main()

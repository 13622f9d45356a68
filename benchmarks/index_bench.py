"""Prefix-index benchmark: events applied per second, lookup latency, memory per cached block.

Setup: 16 backends and 1M cached 16-token blocks (vLLM-style prefill events of 64 blocks each),
plus four 32k-token documents cached to different depths on different backends. Measured in one
run, side by side:
- ingest: blocks/s and events/s for prefill events (64 blocks), decode events (1 block), removals;
- lookup: 1k / 8k / 32k-token prompts against all 16 backends, the index's vectorized lookup next
  to a straightforward per-backend, per-block Python walk over the same keys;
- memory: process RSS growth per cached block.
Targets (issue 3): >= 500k block events/s on one core; an 8k-token lookup under 200 us.
Anchor (not measured here): Dynamo's Rust indexer reports about 1M events/s, microsecond lookups.

Run: .venv/bin/python benchmarks/index_bench.py [--blocks 1000000] [--out benchmarks/results]
CPU times are process CPU seconds (the machines are shared; wall time would count other work).
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from router.index.events import BlockRemoved, BlockStored
from router.index.prefix_index import PrefixIndex, namespace_seed, prefix_keys

BACKENDS = 16
PREFILL_BLOCKS = 64  # 1024-token prompts
LONG_DOC_TOKENS = 32 * 1024
TARGET_EVENTS_PER_S = 500_000
TARGET_LOOKUP_8K_US = 200.0


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def apply_timed(index: PrefixIndex, backend: str, events: list) -> float:
    started = time.process_time()
    index.apply(backend, events)
    return time.process_time() - started


def build(index: PrefixIndex, total_blocks: int, rng: np.random.Generator) -> dict:
    """Fill the index with prefill events; returns the ingest measurement."""
    per_backend = total_blocks // BACKENDS
    prompts_per_backend = per_backend // PREFILL_BLOCKS
    seconds = 0.0
    blocks = events = 0
    next_hash = 1
    for prompt in range(prompts_per_backend):
        tokens = rng.integers(0, 150_000, size=(BACKENDS, PREFILL_BLOCKS * 16), dtype=np.int64)
        for b in range(BACKENDS):
            hashes = list(range(next_hash, next_hash + PREFILL_BLOCKS))
            next_hash += PREFILL_BLOCKS
            event = BlockStored(
                block_hashes=hashes, token_ids=tokens[b].tolist(), block_size=16, medium="GPU"
            )
            seconds += apply_timed(index, f"b{b}", [event])
            blocks += PREFILL_BLOCKS
            events += 1
        del prompt
    return {"blocks": blocks, "events": events, "cpu_s": seconds, "blocks_per_s": blocks / seconds,
            "events_per_s": events / seconds, "blocks_per_event": PREFILL_BLOCKS}  # fmt: skip


def decode_ingest(index: PrefixIndex, count: int, rng: np.random.Generator) -> dict:
    """Single-block events chained on each other, as decode steps announce them."""
    seconds = 0.0
    parent = None
    base = 10**12
    for i in range(count):
        event = BlockStored(
            block_hashes=[base + i],
            parent_block_hash=parent,
            token_ids=rng.integers(0, 150_000, size=16).tolist(),
            block_size=16,
        )
        seconds += apply_timed(index, "b0", [event])
        parent = base + i
    return {"blocks": count, "events": count, "cpu_s": seconds, "blocks_per_s": count / seconds,
            "events_per_s": count / seconds, "blocks_per_event": 1}  # fmt: skip


def decode_batched_ingest(index: PrefixIndex, steps: int, running: int, rng: np.random.Generator) -> dict:
    """Engine steps of `running` concurrent requests, each step's batch holding one new block per request."""
    seconds = 0.0
    parents: list[int | None] = [None] * running
    base = 2 * 10**12
    for step in range(steps):
        batch = []
        for request in range(running):
            block_hash = base + step * running + request
            batch.append(
                BlockStored(
                    block_hashes=[block_hash],
                    parent_block_hash=parents[request],
                    token_ids=rng.integers(0, 150_000, size=16).tolist(),
                    block_size=16,
                )
            )
            parents[request] = block_hash
        seconds += apply_timed(index, "b2", batch)
    count = steps * running
    return {"blocks": count, "events": count, "cpu_s": seconds, "blocks_per_s": count / seconds,
            "events_per_s": count / seconds, "blocks_per_event": 1, "events_per_batch": running}  # fmt: skip


def removal_ingest(index: PrefixIndex, count_events: int) -> dict:
    """BlockRemoved of 64 blocks each (the first prompts stored on b1)."""
    seconds = 0.0
    blocks = 0
    # Hashes of b1's prompts: prompt p on backend b got hashes from 1 + (p * BACKENDS + b) * 64.
    for p in range(count_events):
        first = 1 + (p * BACKENDS + 1) * PREFILL_BLOCKS
        event = BlockRemoved(block_hashes=list(range(first, first + PREFILL_BLOCKS)), medium="GPU")
        seconds += apply_timed(index, "b1", [event])
        blocks += PREFILL_BLOCKS
    stats = index.stats("b1")
    assert stats is not None and stats.unknown_removals == 0, "removal benchmark removed unknown blocks"
    return {"blocks": blocks, "events": count_events, "cpu_s": seconds, "blocks_per_s": blocks / seconds,
            "events_per_s": count_events / seconds, "blocks_per_event": PREFILL_BLOCKS}  # fmt: skip


def cache_long_documents(index: PrefixIndex, rng: np.random.Generator) -> list[np.ndarray]:
    """Four 32k-token documents; backend b holds document b % 4 up to (b // 4 + 1) quarters."""
    docs = [rng.integers(0, 150_000, size=LONG_DOC_TOKENS, dtype=np.int64) for _ in range(4)]
    for b in range(BACKENDS):
        doc = docs[b % 4]
        held = LONG_DOC_TOKENS * (b // 4 + 1) // 4
        first = 10**13 + b * 10**6
        event = BlockStored(
            block_hashes=list(range(first, first + held // 16)), token_ids=doc[:held].tolist(), block_size=16
        )
        index.apply(f"b{b}", [event])
    return docs


def naive_walk(per_backend_keys: dict[str, set[int]], tokens: np.ndarray) -> dict[str, int]:
    """The straightforward alternative: per backend, walk the prompt's blocks until one is missing."""
    keys = prefix_keys(np.asarray(tokens, dtype=np.uint32), namespace_seed((None, None))).tolist()
    result = {}
    for name, held in per_backend_keys.items():
        count = 0
        for key in keys:
            if key not in held:
                break
            count += 1
        result[name] = count * 16
    return result


def time_lookups(function, prompts: list[np.ndarray], repeat: int) -> dict:
    """Wall and process-CPU time per lookup (CPU time is what a shared machine distorts least)."""
    wall, cpu = [], []
    for _ in range(repeat):
        for prompt in prompts:
            started, started_cpu = time.perf_counter(), time.process_time()
            function(prompt)
            cpu.append(time.process_time() - started_cpu)
            wall.append(time.perf_counter() - started)
    wall.sort()
    cpu.sort()
    return {
        "median_us": statistics.median(wall) * 1e6,
        "p90_us": wall[int(len(wall) * 0.9)] * 1e6,
        "p99_us": wall[int(len(wall) * 0.99)] * 1e6,
        "min_us": wall[0] * 1e6,
        "cpu_median_us": statistics.median(cpu) * 1e6,
        "samples": len(wall),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=1_000_000)
    parser.add_argument("--decode-events", type=int, default=50_000)
    parser.add_argument("--repeat", type=int, default=100)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    rng = np.random.default_rng(2026)
    gc.collect()
    rss_before = rss_bytes()
    index = PrefixIndex()
    prefill = build(index, args.blocks, rng)
    docs = cache_long_documents(index, rng)
    gc.collect()
    engine_blocks = index.size()["engine_blocks"]
    rss_after = rss_bytes()
    memory = {
        "engine_blocks": engine_blocks,
        "router_keys": index.size()["router_keys"],
        "rss_growth_bytes": rss_after - rss_before,
        "bytes_per_block": (rss_after - rss_before) / engine_blocks,
    }
    print(f"built {engine_blocks:,} blocks: {prefill['blocks_per_s']:,.0f} blocks/s (prefill events), "
          f"{memory['bytes_per_block']:.0f} B/block")  # fmt: skip

    lookups = {}
    per_backend_keys: dict[str, set[int]] = {f"b{b}": set() for b in range(BACKENDS)}
    for key, mask in index._holders.items():  # the naive baseline's own structure, built once
        for b in range(BACKENDS):
            slot = index._backends[f"b{b}"].tier_slots["gpu"]
            if mask >> slot & 1:
                per_backend_keys[f"b{b}"].add(key)
    # Prompts reusing a cached document almost whole (the worst case: every block is probed), and
    # "8192-new-after-1k": 1k cached tokens then new text (the common case: a shared system prompt).
    for length, cached_part in ((1024, 960), (8192, 8128), (32768, 32704), (8192, 1024)):
        prompts = [
            np.concatenate([doc[:cached_part], rng.integers(0, 150_000, size=length - cached_part)])
            for doc in docs
        ]
        prompts32 = [p.astype(np.uint32) for p in prompts]
        expected = index.longest_cached_prefix(prompts32[0])
        naive = naive_walk(per_backend_keys, prompts32[0])
        assert {n: m.tokens for n, m in expected.items()} == naive, "baseline and index disagree"
        label = str(length) if cached_part > length // 2 else f"{length}-new-after-{cached_part // 1024}k"
        lookups[label] = {
            "index": time_lookups(index.longest_cached_prefix, prompts32, args.repeat),
            "naive_per_backend_walk": time_lookups(
                lambda p: naive_walk(per_backend_keys, p), prompts32, max(5, args.repeat // 10)
            ),
            "matched_tokens_example": {n: m.tokens for n, m in expected.items()},
        }
        print(f"lookup {label:>20}: index median {lookups[label]['index']['median_us']:.0f} us, "
              f"naive {lookups[label]['naive_per_backend_walk']['median_us']:.0f} us")  # fmt: skip

    decode = decode_ingest(index, args.decode_events, rng)
    decode_batched = decode_batched_ingest(index, max(1, args.decode_events // 32), 32, rng)
    removal = removal_ingest(index, min(2000, prefill["events"] // BACKENDS))
    print(
        f"decode events: {decode['blocks_per_s']:,.0f} blocks/s one per batch, "
        f"{decode_batched['blocks_per_s']:,.0f} blocks/s 32 per batch; "
        f"removals: {removal['blocks_per_s']:,.0f} blocks/s"
    )
    results = {
        "benchmark": "index_bench",
        "command": "python benchmarks/index_bench.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
        "machine": {
            "python": platform.python_version(),
            "cpu": platform.processor() or platform.machine(),
            "load_average": list(Path("/proc/loadavg").read_text().split()[:3]),
        },
        "setup": {"backends": BACKENDS, "cached_blocks_target": args.blocks, "block_tokens": 16},
        "ingest": {
            "prefill_events": prefill,
            "decode_events": decode,
            "decode_events_batched": decode_batched,
            "removal_events": removal,
        },
        "lookup": lookups,
        "memory": memory,
        "targets": {"block_events_per_s": TARGET_EVENTS_PER_S, "lookup_8k_us": TARGET_LOOKUP_8K_US},
        "anchor": "Dynamo (Rust) reports ~1M events/s and microsecond lookups (not measured here)",
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "index_bench.json").write_text(json.dumps(results, indent=2))
    plot(results, out / "index_bench.png")
    (out / "index_bench.md").write_text(report(results))
    print(f"wrote {out / 'index_bench.json'}, .md and .png")


def report(results: dict) -> str:
    """The short markdown report committed beside the JSON."""
    ingest = results["ingest"]
    lookup = results["lookup"]
    memory = results["memory"]
    lines = [
        "# Prefix index benchmark",
        "",
        f"Command: `{results['command']}` (load average at the end: "
        f"{' '.join(results['machine']['load_average'])} on a 2-core machine shared with other work).",
        f"Index: {memory['engine_blocks']:,} cached 16-token blocks on "
        f"{results['setup']['backends']} backends.",
        "",
        "## Ingest (blocks applied per CPU second, one core)",
        "",
        "| events | blocks/event | events/batch | blocks/s | events/s | target 500k blocks/s |",
        "|---|---|---|---|---|---|",
    ]
    for name, label in (
        ("prefill_events", "prefill BlockStored"),
        ("decode_events", "decode BlockStored"),
        ("decode_events_batched", "decode BlockStored"),
        ("removal_events", "BlockRemoved"),
    ):
        entry = ingest[name]
        met = "met" if entry["blocks_per_s"] >= results["targets"]["block_events_per_s"] else "not met"
        lines.append(
            f"| {label} | {entry['blocks_per_event']} | {entry.get('events_per_batch', 1)} | "
            f"{entry['blocks_per_s']:,.0f} | {entry['events_per_s']:,.0f} | {met} |"
        )
    lines += [
        "",
        "## Lookup (all 16 backends, per prompt)",
        "",
        "| prompt | index median (wall) | index p99 (wall) | index median (CPU) | per-backend Python walk "
        "median (wall) | target (8k) |",
        "|---|---|---|---|---|---|",
    ]
    for length, entry in lookup.items():
        target = f"< {results['targets']['lookup_8k_us']:.0f} us" if length == "8192" else ""
        if target:
            wall_met = entry["index"]["median_us"] < results["targets"]["lookup_8k_us"]
            cpu_met = entry["index"]["cpu_median_us"] < results["targets"]["lookup_8k_us"]
            target += f": wall {'met' if wall_met else 'not met'}, CPU {'met' if cpu_met else 'not met'}"
        lines.append(
            f"| {_label(length)} | {entry['index']['median_us']:.0f} us | "
            f"{entry['index']['p99_us']:.0f} us | {entry['index']['cpu_median_us']:.0f} us | "
            f"{entry['naive_per_backend_walk']['median_us']:.0f} us | {target} |"
        )
    lines += [
        "",
        f"## Memory: {memory['bytes_per_block']:.0f} bytes per cached block "
        f"(process RSS growth {memory['rss_growth_bytes'] / 2**20:.0f} MiB "
        f"for {memory['engine_blocks']:,} blocks, "
        "engine-hash map, node tuples and prefix-key map together)",
        "",
        f"Anchor: {results['anchor']}.",
        "",
        "![index benchmark](index_bench.png)",
        "",
    ]
    return "\n".join(lines)


def _label(name: str) -> str:
    length, _, rest = name.partition("-")
    label = f"{int(length) // 1024}k tokens"
    return f"{label}, 1k cached" if rest else label


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    lengths = list(results["lookup"])
    x = np.arange(len(lengths))
    index_us = [results["lookup"][n]["index"]["median_us"] for n in lengths]
    naive_us = [results["lookup"][n]["naive_per_backend_walk"]["median_us"] for n in lengths]
    left.bar(x - 0.2, index_us, 0.4, label="kvgate index (vectorized)")
    left.bar(x + 0.2, naive_us, 0.4, label="per-backend Python walk")
    left.axhline(TARGET_LOOKUP_8K_US, color="red", linestyle="--", label="target for 8k: 200 us")
    left.set_xticks(x, [_label(n) for n in lengths])
    left.set_yscale("log")
    left.set_ylabel("median lookup latency (us, log)")
    left.set_title("Lookup, 16 backends, 1M cached blocks")
    left.legend(fontsize=8)
    kinds = ["prefill_events", "decode_events", "decode_events_batched", "removal_events"]
    labels = [
        "prefill\n64 blocks/event",
        "decode\n1 event/batch",
        "decode\n32 events/batch",
        "removal\n64 blocks/event",
    ]
    rates = [results["ingest"][k]["blocks_per_s"] for k in kinds]
    right.bar(labels, rates, color=["#4c72b0", "#dd8452", "#c44e52", "#55a868"])
    right.axhline(TARGET_EVENTS_PER_S, color="red", linestyle="--", label="target: 500k block events/s")
    right.set_ylabel("blocks applied per CPU second")
    right.set_title("Ingest (one core, process CPU time)")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()

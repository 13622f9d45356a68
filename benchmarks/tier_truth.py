"""Tier truth under churn: the fraction of the remote-tier tokens the router credits that Redis really
holds, with the cache layer retracting what Redis evicted (reconciliation, keyspace notifications)
against not retracting it (before this work), side by side in one run.

Setup, per variant (the same seeded workload each time): one real redis-server under `maxmemory` with
`allkeys-lru`, sized to hold about a third of the working set, so it evicts all the time; two cache
engines (`CacheEngine`, in this process, each with its own small L1 and KV-event publisher on real
ZMQ) writing through to it; the router's index (`KVIndexService`) subscribed to both, and
`SharedTiers` crediting the `remote` tier to both, as kv_aware does. A writer thread stores prompts of
a pool of families, each from a random engine (L1 is small, so a family is often stored again and its
lost chunks written back). Every `--sample-every-s` the benchmark takes random families, asks the
router what it credits in the remote tier and Redis which chunks it holds (EXISTS, the ground truth),
and adds up credited tokens and credited tokens that were loadable (the credited prefix cut at the
first chunk Redis lacks).

Cost: Redis's CPU seconds (INFO cpu) per second of run, the commands and network bytes the engines'
retractions add (INFO commandstats, INFO stats), next to the evictions per second.

    python -m benchmarks.tier_truth [--seconds 20] [--output benchmarks/results/tier_truth]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvgate_testing.cachelayer import CHUNK, make_engine, request
from kvgate_testing.provenance import with_source
from kvgate_testing.redis_server import running_redis
from router.config import KVEvents, SharedTier
from router.index.service import KVIndexService
from router.policies.shared_tiers import SharedTiers

ENGINES = ("engine-a", "engine-b")


@dataclass(frozen=True)
class Variant:
    name: str
    reconcile_interval_s: float
    notifications: bool


VARIANTS = (
    Variant("before: no retraction", 0.0, False),
    Variant("reconcile every 5 s (default)", 5.0, False),
    Variant("reconcile every 1 s", 1.0, False),
    Variant("notifications + reconcile every 5 s", 5.0, True),
)


def _redis_counters(client: Any) -> dict[str, float]:
    cpu = client.info("cpu")
    stats = client.info("stats")
    commands = client.info("commandstats")
    exists = commands.get("cmdstat_exists", {})
    return {
        "exists_usec": float(exists.get("usec", 0)),
        "cpu_s": float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]),
        "evicted_keys": float(stats["evicted_keys"]),
        "net_input_bytes": float(stats["total_net_input_bytes"]),
        "net_output_bytes": float(stats["total_net_output_bytes"]),
        "exists_calls": float(exists.get("calls", 0)),
        "commands": float(stats["total_commands_processed"]),
    }


def run_variant(variant: Variant, args: argparse.Namespace) -> dict[str, Any]:
    flags = ["--maxmemory", f"{args.maxmemory_mb}mb", "--maxmemory-policy", "allkeys-lru"]
    if variant.notifications:
        flags += ["--notify-keyspace-events", "Exeg"]
    rng = random.Random(args.seed)
    families = [request(seed, args.chunks_per_prompt) for seed in range(args.families)]
    with running_redis(*flags) as server:
        engines = [
            make_engine(
                args.l1_chunks,
                remote_url=server.url,
                enable_kv_events=True,
                kv_events_endpoint="tcp://127.0.0.1:*",
                kv_events_replay_endpoint="tcp://127.0.0.1:*",
                remote_reconcile_interval_s=variant.reconcile_interval_s,
                remote_eviction_notifications=variant.notifications,
                remote_timeout_s=2.0,
            )
            for _ in ENGINES
        ]
        service = KVIndexService(replay_timeout_s=1.0)
        for name, engine in zip(ENGINES, engines, strict=True):
            service.add_backend(
                name,
                KVEvents(
                    endpoint=engine.publisher.endpoint, replay_endpoint=engine.publisher.replay_endpoint
                ),
            )
        service.start()
        shared = SharedTiers([SharedTier(name="remote", backends=list(ENGINES))])
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(
            service.status()[name]["last_seq"] is None for name in ENGINES
        ):
            for engine in engines:
                engine.publisher.publish([])
            time.sleep(0.05)

        stop = threading.Event()
        stores = [0]

        def write() -> None:
            writer_rng = random.Random(args.seed + 1)
            while not stop.is_set():
                tokens, kv = families[writer_rng.randrange(len(families))]
                writer_rng.choice(engines).store(tokens, kv)
                stores[0] += 1
                time.sleep(args.store_pause_s)

        client = server.client()
        writer = threading.Thread(target=write, daemon=True)
        warm_until = time.monotonic() + args.warmup_s
        writer.start()
        while time.monotonic() < warm_until:
            time.sleep(0.1)
        before = _redis_counters(client)
        started = time.monotonic()
        samples: list[dict[str, float]] = []
        credited_total = loadable_total = 0
        while time.monotonic() - started < args.seconds:
            time.sleep(args.sample_every_s)
            credited_sample = loadable_sample = 0
            for index in rng.sample(range(len(families)), args.sample_size):
                tokens, _ = families[index]
                matches = shared.credit(service.longest_cached_prefix(tokens, backends=list(ENGINES)))
                credited = max((match.by_tier.get("remote", 0) for match in matches.values()), default=0)
                if not credited:
                    continue
                keys = [
                    engines[0].remote.redis_key(span.key) for span in engines[0]._spans(tokens, None, None)
                ]
                with client.pipeline(transaction=False) as pipe:
                    for key in keys:
                        pipe.exists(key)
                    present = pipe.execute()
                held_chunks = next((i for i, held in enumerate(present) if not held), len(present))
                loadable = min(credited, held_chunks * CHUNK)
                credited_sample += credited
                loadable_sample += loadable
            credited_total += credited_sample
            loadable_total += loadable_sample
            if credited_sample:
                samples.append(
                    {
                        "t_s": round(time.monotonic() - started, 2),
                        "fraction": loadable_sample / credited_sample,
                    }
                )
        elapsed = time.monotonic() - started
        after = _redis_counters(client)
        stop.set()
        writer.join(timeout=10)
        engine_stats = [engine.stats() for engine in engines]
        service.stop()
        for engine in engines:
            engine.close()
        client.close()
    delta = {key: after[key] - before[key] for key in after}
    retracted = sum(stats.get("remote_retracted_chunks", 0) for stats in engine_stats)
    return {
        "variant": variant.name,
        "reconcile_interval_s": variant.reconcile_interval_s,
        "notifications": variant.notifications,
        "seconds": round(elapsed, 2),
        "stores": stores[0],
        "credited_tokens": credited_total,
        "loadable_credited_tokens": loadable_total,
        "credited_loadable_fraction": loadable_total / credited_total if credited_total else None,
        "sample_fraction_median": statistics.median(s["fraction"] for s in samples) if samples else None,
        "samples": samples,
        "evictions_per_s": delta["evicted_keys"] / elapsed,
        "redis_cpu_s_per_s": delta["cpu_s"] / elapsed,
        "redis_exists_per_s": delta["exists_calls"] / elapsed,
        "redis_commands_per_s": delta["commands"] / elapsed,
        "redis_net_in_bytes_per_s": delta["net_input_bytes"] / elapsed,
        "redis_net_out_bytes_per_s": delta["net_output_bytes"] / elapsed,
        "redis_exists_usec_per_s": delta["exists_usec"] / elapsed,
        "redis_net_out_bytes_per_eviction": (
            delta["net_output_bytes"] / delta["evicted_keys"] if delta["evicted_keys"] else None
        ),
        "reconciled_chunks_per_s": sum(stats.get("remote_reconciled_chunks", 0) for stats in engine_stats)
        / (elapsed + args.warmup_s),
        "retracted_chunks": retracted,
        "reconciliations": sum(stats.get("remote_reconciliations", 0) for stats in engine_stats),
        "notified_chunks": sum(stats.get("remote_notifications", 0) for stats in engine_stats),
    }


def write_report(results: dict[str, Any], output: Path) -> None:
    output.parent.mkdir(parents=True, exist_ok=True)
    output.with_suffix(".json").write_text(json.dumps(with_source(results), indent=2) + "\n")
    runs = results["runs"]
    source = with_source(results)["source"]
    lines = [
        "# Tier truth under churn (benchmarks/tier_truth.py)",
        "",
        f"Commit {source.get('commit')} (dirty: {source.get('dirty')}). Two cache engines writing through "
        f"to one redis-server (maxmemory {results['config']['maxmemory_mb']} MB, allkeys-lru, about a third "
        "of the working set), the router's index subscribed to both over ZMQ, the remote tier credited to "
        f"both (SharedTiers). {results['config']['seconds']} s per variant after "
        f"{results['config']['warmup_s']} s of warm-up, same seeded workload.",
        "",
        "| variant | credited tokens loadable | median per sample | evictions/s | reconciliation EXISTS/s "
        "| Redis EXISTS CPU ms/s | Redis bytes out per eviction | Redis CPU s/s (all) | retracted chunks |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for run in runs:
        lines.append(
            f"| {run['variant']} | {run['credited_loadable_fraction']:.3f} "
            f"| {run['sample_fraction_median']:.3f} "
            f"| {run['evictions_per_s']:.0f} | {run['reconciled_chunks_per_s']:.0f} "
            f"| {run['redis_exists_usec_per_s'] / 1000:.1f} "
            f"| {run['redis_net_out_bytes_per_eviction'] or 0:.0f} "
            f"| {run['redis_cpu_s_per_s']:.3f} | {run['retracted_chunks']} |"
        )
    lines += [
        "",
        "`credited tokens loadable`: over every sample, the remote-tier tokens the router credited that "
        "Redis held as a leading run of chunks when sampled, over all it credited. Redis CPU and bytes "
        "include the workload's own writes and lookups (the writer's EXISTS before each SET, the samples' "
        "EXISTS): the difference between a row and the first is what retraction costs. "
        "`reconciliation EXISTS/s`: the keys the engines asked about (one pipelined EXISTS each, 1024 per "
        "round trip). `bytes out per eviction`: every notification goes to every subscribed engine "
        "(two here); only the engine that announced the chunk retracts it.",
        "",
    ]
    output.with_suffix(".md").write_text("\n".join(lines))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 4.5))
    for run in runs:
        axis.plot(
            [s["t_s"] for s in run["samples"]], [s["fraction"] for s in run["samples"]], label=run["variant"]
        )
    axis.set_xlabel("seconds into the run")
    axis.set_ylabel("credited remote tokens that were loadable")
    axis.set_ylim(0, 1.05)
    axis.legend(loc="lower right", fontsize=8)
    axis.set_title("Router's credit vs Redis's contents under allkeys-lru churn")
    figure.tight_layout()
    figure.savefig(output.with_suffix(".png"), dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--warmup-s", type=float, default=5.0)
    parser.add_argument("--families", type=int, default=600)
    parser.add_argument("--chunks-per-prompt", type=int, default=4)
    parser.add_argument("--l1-chunks", type=float, default=96)
    parser.add_argument("--maxmemory-mb", type=int, default=3)
    parser.add_argument("--store-pause-s", type=float, default=0.002)
    parser.add_argument("--sample-every-s", type=float, default=0.5)
    parser.add_argument("--sample-size", type=int, default=60)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/tier_truth"))
    args = parser.parse_args()
    runs = []
    for variant in VARIANTS:
        run = run_variant(variant, args)
        print(json.dumps({key: value for key, value in run.items() if key != "samples"}), flush=True)
        runs.append(run)
    config = {key: value for key, value in vars(args).items() if key != "output"}
    write_report({"config": config, "runs": runs}, args.output)


if __name__ == "__main__":
    main()

"""Replicas of the gateway in front of one fleet: does the `cluster:` sync keep one view?

For each workload with reuse (chat_sessions, shared_system_prompts, document_qa) and each setup
(1, 2 and 4 kv_aware replicas synced through a redis-server; 2 and 4 replicas with the sync off),
the engines' caches are emptied, the replicas start, the workload is replayed open-loop with the
client sending its requests to the replicas in turn, and the replicas stop. Measured per run, as the
routing benchmark does (benchmarks/routing_bench.py, kvgate_testing/replay.py): hit ratio from the
responses' usage, TTFT p50/p90 (ms), and load max/mean from the engines' own request counters.

    .venv/bin/python -m benchmarks.replicas_bench                 # 8 simulated engines, about 10 min
    .venv/bin/python -m benchmarks.replicas_bench --scale 0.5     # shorter

Writes <output>.json (top-level hit_ratio_by_replicas, max_over_mean_load_by_replicas and
ttft_p90_by_replicas, each {"1": .., "2": .., "4": ..} averaged over the workloads, and their
*_sync_off twins), .md and .png. Loopback only; it stops what it starts.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import datetime
import json
import os
import platform
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from kvgate_testing import workloads as workload_catalog
from kvgate_testing.gateway import GatewayProcess, start_gateway
from kvgate_testing.processes import exit_on_sigterm
from kvgate_testing.provenance import with_source
from kvgate_testing.redis_server import RedisServer
from kvgate_testing.replay import replay, summarize
from kvgate_testing.replicas_report import (
    REPLICA_COUNTS,
    averages_by_replicas,
    check_targets,
    write_markdown,
    write_plot,
)
from kvgate_testing.routers import kvgate_backends, wait_until_synced
from kvgate_testing.sim_fleet import DEFAULT_SIM_ARGS, MODEL, EngineFleet

WORKLOADS = ("chat_sessions", "shared_system_prompts", "document_qa")


def _log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _replica_config(fleet: EngineFleet, redis_url: str | None, channel: str, replica: int) -> dict:
    config: dict[str, Any] = {
        "models": [{"name": MODEL, "tokenizer": "builtin:qwen3"}],
        "backends": kvgate_backends(fleet, "kv_aware"),
        "policy": {"name": "kv_aware"},
        "log_level": "warning",
    }
    if redis_url is not None:
        config["cluster"] = {"url": redis_url, "channel": channel, "replica_id": f"replica-{replica}"}
    return config


def start_replicas(fleet: EngineFleet, count: int, redis_url: str | None) -> list[GatewayProcess]:
    """`count` kv_aware gateways on the fleet, synced on a channel of their own when `redis_url` is given."""
    channel = f"kvgate:bench:{uuid.uuid4().hex[:8]}"
    configs = [_replica_config(fleet, redis_url, channel, i) for i in range(count)]
    with concurrent.futures.ThreadPoolExecutor(count) as pool:
        futures = [pool.submit(start_gateway, config, None, 120.0) for config in configs]
        started = []
        failure: BaseException | None = None
        for future in futures:
            try:
                started.append(future.result())
            except BaseException as exc:
                failure = exc
    if failure is not None:
        for gateway in started:
            gateway.stop()
        raise failure
    try:
        for gateway in started:
            wait_until_synced(gateway.url, 120.0)
        if redis_url is not None:
            _wait_for_peers(started, count - 1)
    except BaseException:
        for gateway in started:
            gateway.stop()
        raise
    return started


def _wait_for_peers(gateways: list[GatewayProcess], peers: int, timeout_s: float = 30.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    for gateway in gateways:
        while True:
            text = httpx.get(gateway.url + "/metrics", timeout=5).text
            if f"kvgate_cluster_peers {float(peers)}" in text:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"replica {gateway.url} did not hear its {peers} peers")
            time.sleep(0.1)


def run_setup(
    fleet: EngineFleet,
    workload: workload_catalog.Workload,
    count: int,
    redis_url: str | None,
    concurrency: int,
) -> dict:
    fleet.reset_caches()
    replicas = start_replicas(fleet, count, redis_url)
    try:
        before = fleet.counters()
        outcomes = asyncio.run(replay([r.url for r in replicas], workload, MODEL, concurrency))
        after = fleet.counters()
    finally:
        for gateway in replicas:
            gateway.stop()
    result = summarize(workload, outcomes)
    requests = [round(a.minus(b).requests) for a, b in zip(after, before, strict=True)]
    mean = sum(requests) / len(requests)
    result["requests_per_engine"] = requests
    result["max_over_mean_load"] = round(max(requests) / mean, 3) if mean else 0.0
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", type=int, default=8)
    parser.add_argument("--num-gpu-blocks", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--scale", type=float, default=1.0, help="multiply workload populations and rates")
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--output", default="benchmarks/results/replicas")
    args = parser.parse_args(argv)
    started = time.monotonic()
    names = [n for n in args.workloads.split(",") if n]
    tokenizer = workload_catalog.qwen3_tokenizer()
    built = [workload_catalog.build(name, tokenizer, args.scale, 1.0) for name in names]
    results: dict[str, Any] = {
        "meta": {
            "engines": args.engines,
            "num_gpu_blocks": args.num_gpu_blocks,
            "block_size": args.block_size,
            "sim_args": DEFAULT_SIM_ARGS,
            "scale": args.scale,
            "concurrency": args.concurrency,
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "command": " ".join(["python -m benchmarks.replicas_bench", *(argv or sys.argv[1:])]),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs (shared)",
            "load_average_start": round(os.getloadavg()[0], 2),
        },
        "workloads": {},
    }
    setups = [(1, True)] + [(count, sync) for count in REPLICA_COUNTS[1:] for sync in (True, False)]
    redis = RedisServer().start()
    fleet = EngineFleet(args.engines, args.num_gpu_blocks, args.block_size, DEFAULT_SIM_ARGS)
    try:
        _log(f"starting {args.engines} simulated engines")
        with fleet:
            for workload in built:
                entry = results["workloads"].setdefault(
                    workload.name, {"workload": workload.summary(args.block_size), "setups": {}}
                )
                for count, sync in setups:
                    label = "1" if count == 1 else f"{count}_{'sync_on' if sync else 'sync_off'}"
                    _log(f"{workload.name}: {count} replica(s), sync {'on' if sync else 'off'}")
                    try:
                        run = run_setup(fleet, workload, count, redis.url if sync else None, args.concurrency)
                    except Exception as exc:  # one setup failing must not lose the others
                        _log(f"  failed: {exc}")
                        run = {"failed": str(exc)[-2000:]}
                    else:
                        _log(
                            f"  hit {run['hit_ratio']:.3f}  load {run['max_over_mean_load']:.2f}  "
                            f"ttft p50/p90 {run['ttft_p50']:.0f}/{run['ttft_p90']:.0f} ms  "
                            f"errors {run['errors']}"
                        )
                    entry["setups"][label] = run
    finally:
        redis.close()
    for suffix, key in (("", "sync_on"), ("_sync_off", "sync_off")):
        averages = averages_by_replicas(results, key)
        for measure, values in averages.items():
            results[f"{measure}_by_replicas{suffix}"] = values
    results["targets"] = check_targets(results)
    results["meta"]["wall_s"] = round(time.monotonic() - started, 1)
    results["meta"]["load_average_end"] = round(os.getloadavg()[0], 2)
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    ordered = {key: results[key] for key in sorted(results, key=lambda k: (k in ("meta", "workloads"), k))}
    output.with_suffix(".json").write_text(json.dumps(with_source(ordered), indent=1) + "\n")
    write_markdown(results, output.with_suffix(".md"))
    write_plot(results, output.with_suffix(".png"))
    _log(f"wrote {output}.json, .md and .png in {results['meta']['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    sys.exit(main())

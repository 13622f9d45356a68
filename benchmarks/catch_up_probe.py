"""How long and how much CPU a new kv_aware gateway takes to catch up with engines that have history.

Starts `engines` simulated engines, replays document_qa `history_runs` times through least_loaded
(filling the engines' replay buffers), empties the caches as the routing benchmark does before every
run, then starts a kv_aware gateway with `kvgate_testing.routers.start_router` (which returns once it
forwards and every subscriber is synced) and prints one JSON line: time to synced, the gateway's CPU
at that moment, and its subscribers' replay counters.

    python -m benchmarks.catch_up_probe [engines] [history_runs]
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import httpx

from kvgate_testing import workloads as workload_catalog
from kvgate_testing.proc_stats import cpu_seconds
from kvgate_testing.replay import replay
from kvgate_testing.routers import start_router
from kvgate_testing.sim_fleet import DEFAULT_SIM_ARGS, MODEL, EngineFleet


def main(argv: list[str]) -> int:
    engines = int(argv[0]) if argv else 8
    history_runs = int(argv[1]) if len(argv) > 1 else 3
    workload = workload_catalog.build_all(["document_qa"], workload_catalog.qwen3_tokenizer(), 1.0, 1.0)[0]
    with EngineFleet(engines, 512, 16, DEFAULT_SIM_ARGS) as fleet:
        for _ in range(history_runs):
            fleet.reset_caches()
            router = start_router("least_loaded", fleet)
            try:
                asyncio.run(replay(router.url, workload, MODEL, 128))
            finally:
                router.stop()
        fleet.reset_caches()
        started = time.monotonic()
        router = start_router("kv_aware", fleet)
        try:
            data = httpx.get(f"{router.url}/debug/prefix-map", params={"format": "json"}, timeout=30).json()
            ranks = [rank for entry in data["backends"].values() for rank in entry["ranks"]]
            result = {
                "engines": engines,
                "history_runs": history_runs,
                "start_to_synced_s": round(time.monotonic() - started, 2),
                "gateway_cpu_s_at_synced": round(cpu_seconds(router.process.pid), 2),
                "replays": sum(rank["replays"] for rank in ranks),
                "replayed_batches": sum(rank["replayed_batches"] for rank in ranks),
                "superseded_batches": sum(rank["superseded_batches"] for rank in ranks),
                "applied_batches": sum(rank["batches"] for rank in ranks),
                "uncertain": sum(1 for rank in ranks if rank["uncertain"]),
                "blocks": sum(sum(entry["blocks"].values()) for entry in data["backends"].values()),
            }
        finally:
            router.stop()
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

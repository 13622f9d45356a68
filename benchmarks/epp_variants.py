"""The endpoint picker's cost under several Envoy processing modes, side by side (issue 37).

    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.epp_variants cpu \\
        --routers 'kv_aware,kv_aware_via_envoy,kv_aware_via_envoy_streamed_body'
    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.epp_variants probe --rounds 300 \\
        --routers 'kv_aware,kv_aware_via_envoy,kv_aware_via_envoy@response_header_mode=SEND'

A via-Envoy router takes ext_proc processing_mode fields as knobs (kvgate_testing/routers.py).

- `cpu`: every router up at once over one fleet of simulated engines; rounds of closed-loop load
  (short streamed chat requests) go to each in turn, the order alternating; per router its process's
  CPU per request, the same split by thread name (the event loop's thread carries the process's
  name; grpc's core runs in `event_engine`, each KV-event subscriber in a ZMQ thread of its own),
  the requests' p50 and the in-flight load left on the engines afterwards.
- `probe`: kvgate_testing/epp_runs.latency_probe over these routers (Envoy alone is added as the
  reference): each one's p50/p99 and what it adds over Envoy alone.

One JSON line per router on stdout. The machine is shared: compare within one run.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from typing import Any

import httpx
import numpy as np

from kvgate_testing import epp_runs
from kvgate_testing.proc_stats import cpu_seconds, thread_cpu_seconds
from kvgate_testing.routers import ENVOY_ALONE_POLICY, RunningRouter, start_router
from kvgate_testing.sim_fleet import MODEL, EngineFleet


def _closed_loop(router: RunningRouter, clients: int, seconds: float, tokens: int, tag: str) -> dict:
    stop = time.monotonic() + seconds
    latencies: list[float] = []
    errors = [0]

    def client(number: int) -> None:
        with httpx.Client(base_url=router.url, timeout=30) as http:
            sent = 0
            while time.monotonic() < stop:
                sent += 1
                content = f"{tag} {number} {sent} " + "hello there " * 20
                body = {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": content}],
                    "max_tokens": tokens,
                    "stream": True,
                }
                started = time.perf_counter()
                with http.stream("POST", "/v1/chat/completions", json=body) as response:
                    for _ in response.iter_bytes():
                        pass
                    errors[0] += response.status_code != 200
                latencies.append(time.perf_counter() - started)

    pid = router.process.pid
    before, threads_before = cpu_seconds(pid), thread_cpu_seconds(pid)
    threads = [threading.Thread(target=client, args=(number,)) for number in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    threads_after = thread_cpu_seconds(pid)
    by_thread = {name: seconds - threads_before.get(name, 0.0) for name, seconds in threads_after.items()}
    return {
        "cpu_s": cpu_seconds(pid) - before,
        "cpu_s_by_thread": by_thread,
        "latencies": latencies,
        "errors": errors[0],
    }


def closed_loop_rounds(
    routers: dict[str, RunningRouter], rounds: int, clients: int, seconds: float, tokens: int
) -> dict[str, dict[str, Any]]:
    """`rounds` rounds of closed-loop load to each router in turn, the order alternating each round;
    per router the totals of its rounds: CPU seconds (all, and by thread name), latencies, errors."""
    names = list(routers)
    totals: dict[str, dict[str, Any]] = {
        name: {"cpu_s": 0.0, "cpu_s_by_thread": {}, "latencies": [], "errors": 0} for name in names
    }
    for round_number in range(rounds):
        for name in names if round_number % 2 == 0 else names[::-1]:
            run = _closed_loop(routers[name], clients, seconds, tokens, f"r{round_number}")
            total = totals[name]
            total["cpu_s"] += run["cpu_s"]
            for thread, thread_seconds in run["cpu_s_by_thread"].items():
                total["cpu_s_by_thread"][thread] = total["cpu_s_by_thread"].get(thread, 0.0) + thread_seconds
            total["latencies"] += run["latencies"]
            total["errors"] += run["errors"]
    return totals


def _in_flight_left(router: RunningRouter) -> int | None:
    if router.metrics_url is None:
        return None
    listed = httpx.get(router.metrics_url.rsplit("/", 1)[0] + "/backends", timeout=10).json()["backends"]
    return sum(backend["in_flight"] for backend in listed)


def cpu(args: argparse.Namespace) -> list[dict[str, Any]]:
    policies = args.routers.split(",")
    sim_args = ["--decode-ms-per-token", str(args.decode_ms_per_token)]
    with EngineFleet(count=args.engines, num_gpu_blocks=256, sim_args=sim_args) as fleet:
        routers = {policy: start_router(policy, fleet) for policy in policies}
        try:
            totals = closed_loop_rounds(routers, args.rounds, args.clients, args.seconds, args.tokens)
            time.sleep(1.0)  # the last access-log batch
            rows = []
            for policy in policies:
                total = totals[policy]
                count = len(total["latencies"])
                rows.append(
                    {
                        "router": policy,
                        "requests": count,
                        "errors": total["errors"],
                        "cpu_ms_per_request": round(total["cpu_s"] * 1000 / max(count, 1), 3),
                        "cpu_ms_per_request_by_thread": {
                            name: round(seconds * 1000 / max(count, 1), 3)
                            for name, seconds in sorted(
                                total["cpu_s_by_thread"].items(), key=lambda item: -item[1]
                            )
                            if seconds > 0
                        },
                        "p50_ms": round(1000 * float(np.percentile(total["latencies"], 50)), 2),
                        "in_flight_left": _in_flight_left(routers[policy]),
                    }
                )
            return rows
        finally:
            for router in routers.values():
                router.stop()


def probe(args: argparse.Namespace) -> list[dict[str, Any]]:
    policies = [policy for policy in args.routers.split(",") if policy != ENVOY_ALONE_POLICY]
    epp_runs.VIA_ENVOY_POLICIES = (*policies, ENVOY_ALONE_POLICY)
    sim_args = ["--prefill-us-per-token", "100"]
    with EngineFleet(count=8, num_gpu_blocks=512, sim_args=sim_args) as fleet:
        measured = epp_runs.latency_probe(fleet, args.rounds)
    alone = measured[ENVOY_ALONE_POLICY]
    return [
        {
            "router": policy,
            "p50_ms": row["p50_ms"],
            "p99_ms": row["p99_ms"],
            "added_p50_ms": round(row["p50_ms"] - alone["p50_ms"], 3),
            "added_p99_ms": round(row["p99_ms"] - alone["p99_ms"], 3),
            "process_cpu_ms_per_request": row["process_cpu_ms_per_request"],
            "errors": row["errors"],
        }
        for policy, row in measured.items()
    ]


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    sub = parser.add_subparsers(dest="what", required=True)
    load = sub.add_parser("cpu", help="CPU per request under closed-loop load")
    load.add_argument("--routers", required=True, help="comma-separated router names (routers.py)")
    load.add_argument("--engines", type=int, default=4)
    load.add_argument("--clients", type=int, default=4)
    load.add_argument("--rounds", type=int, default=4)
    load.add_argument("--seconds", type=float, default=6.0, help="per router per round")
    load.add_argument("--tokens", type=int, default=8, help="tokens per streamed answer")
    load.add_argument("--decode-ms-per-token", type=float, default=2.0)
    latency = sub.add_parser("probe", help="added latency over Envoy alone")
    latency.add_argument("--routers", required=True, help="comma-separated router names (routers.py)")
    latency.add_argument("--rounds", type=int, default=300)
    args = parser.parse_args()
    for row in cpu(args) if args.what == "cpu" else probe(args):
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

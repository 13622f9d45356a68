"""`routing_bench --via envoy`: kv_aware as Envoy's endpoint picker against kv_aware as the proxy, and
Envoy alone (LEAST_REQUEST) as the latency reference, on one fleet in one run; its report.

Two measurements:
- the workloads replayed through each of `kv_aware` (the proxy), `kv_aware_via_envoy` (Envoy +
  `kvgate epp` on the deployed modes), `kv_aware_via_envoy_one_round_trip` (the request body
  STREAMED, sent without waiting), `kv_aware_via_envoy_streamed_body` (the earlier design) and
  `envoy_least_request` (`run_policy`: caches emptied, a fresh router, open-loop
  replay): hit ratio, TTFT, load max/mean, and the router process's CPU per request (the picker's
  alone behind Envoy: it relays no bytes);
- a latency probe: the routers up at once, short requests with prompts no engine has seen (no
  cache hit anywhere, one token out), sent one at a time and in turn to each router, so that each
  sees the same engines in the same state. What a router adds is its latency over Envoy alone's.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from kvgate_testing.proc_stats import cpu_seconds
from kvgate_testing.routers import (
    ENVOY_ALONE_POLICY,
    VIA_ENVOY_ONE_ROUND_TRIP_POLICY,
    VIA_ENVOY_POLICY,
    VIA_ENVOY_STREAMED_BODY_POLICY,
    RunningRouter,
    start_router,
)
from kvgate_testing.sim_fleet import MODEL, EngineFleet

PROXY_POLICY = "kv_aware"
VIA_ENVOY_POLICIES = (
    PROXY_POLICY,
    VIA_ENVOY_POLICY,
    VIA_ENVOY_ONE_ROUND_TRIP_POLICY,
    VIA_ENVOY_STREAMED_BODY_POLICY,
    ENVOY_ALONE_POLICY,
)
# The goals: the picker within 1 ms p50 and 3 ms p99 of Envoy alone, at <= 0.6x the proxy's CPU.
SUMMARY_KEYS = (
    "hit_ratio_epp",
    "hit_ratio_proxy",
    "load_max_over_mean_epp",
    "load_max_over_mean_proxy",
    "added_latency_p50_ms",
    "added_latency_p99_ms",
    "cpu_per_request_epp_over_proxy",
    "hit_ratio_epp_one_round_trip",
    "added_latency_p50_ms_one_round_trip",
    "added_latency_p99_ms_one_round_trip",
    "cpu_per_request_epp_one_round_trip_over_proxy",
    "hit_ratio_epp_streamed_body",
    "added_latency_p50_ms_streamed_body",
    "added_latency_p99_ms_streamed_body",
    "cpu_per_request_epp_streamed_body_over_proxy",
)
GOALS = {"added_latency_p50_ms": 1.0, "added_latency_p99_ms": 3.0, "cpu_per_request_epp_over_proxy": 0.6}


def _probe_body(number: int) -> dict:
    # The number first: the prompt's first KV block differs from every other request's.
    content = f"{number} probe " + "of the added latency of a router in front of the engines " * 3
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 1}


def latency_probe(fleet: EngineFleet, rounds: int, warmup: int = 20) -> dict[str, Any]:
    """probe_routers over the routers of VIA_ENVOY_POLICIES, started on `fleet` for it."""
    routers: dict[str, RunningRouter] = {}
    try:
        for policy in VIA_ENVOY_POLICIES:
            routers[policy] = start_router(policy, fleet)
        return probe_routers(routers, rounds, warmup)
    finally:
        for router in routers.values():
            router.stop()


def probe_routers(routers: dict[str, RunningRouter], rounds: int, warmup: int = 20) -> dict[str, Any]:
    """`rounds` requests to each running router, in turn (the order rotating each round), after
    `warmup` rounds not counted; each router's end-to-end latency percentiles (ms) and its
    process's CPU per request (ms)."""
    clients = {policy: httpx.Client(base_url=router.url, timeout=30.0) for policy, router in routers.items()}
    latencies: dict[str, list[float]] = {policy: [] for policy in routers}
    errors: dict[str, int] = dict.fromkeys(routers, 0)
    cpu_before: dict[str, float] = {}
    order = list(routers)
    number = 0
    try:
        for round_number in range(warmup + rounds):
            if round_number == warmup:
                cpu_before = {policy: cpu_seconds(router.process.pid) for policy, router in routers.items()}
            rotated = order[round_number % len(order) :] + order[: round_number % len(order)]
            for policy in rotated:
                number += 1
                started = time.perf_counter()
                response = clients[policy].post("/v1/chat/completions", json=_probe_body(number))
                elapsed_ms = (time.perf_counter() - started) * 1000.0
                if round_number < warmup:
                    continue
                if response.status_code == 200:
                    latencies[policy].append(elapsed_ms)
                else:
                    errors[policy] += 1
        cpu_ms = {
            policy: (cpu_seconds(router.process.pid) - cpu_before[policy]) * 1000.0 / rounds
            for policy, router in routers.items()
        }
    finally:
        for client in clients.values():
            client.close()
    return {
        policy: {
            "requests": rounds,
            "errors": errors[policy],
            "p50_ms": round(float(np.percentile(latencies[policy], 50)), 3) if latencies[policy] else None,
            "p90_ms": round(float(np.percentile(latencies[policy], 90)), 3) if latencies[policy] else None,
            "p99_ms": round(float(np.percentile(latencies[policy], 99)), 3) if latencies[policy] else None,
            "mean_ms": round(float(np.mean(latencies[policy])), 3) if latencies[policy] else None,
            "process_cpu_ms_per_request": round(cpu_ms[policy], 3),
        }
        for policy in routers
    }


def summary(results: dict[str, Any]) -> dict[str, Any]:
    """The top-level keys: hit ratios pooled over the workloads (sum cached / sum prompt tokens is what
    each run reports; here the mean over workloads), added latency from the probe, CPU ratio from the
    replays (the picker's process against the proxy's, per kv_aware request)."""
    runs = [
        workload["policies"]
        for workload in results["workloads"].values()
        if all("hit_ratio" in workload["policies"].get(p, {}) for p in (PROXY_POLICY, VIA_ENVOY_POLICY))
    ]
    probe = results["latency_probe"]

    def mean(policy: str, key: str) -> float | None:
        values = [run[policy][key] for run in runs if key in run.get(policy, {})]
        return round(float(np.mean(values)), 4) if values else None

    proxy_cpu = mean(PROXY_POLICY, "router_cpu_ms_per_request")
    alone = probe.get(ENVOY_ALONE_POLICY, {})

    def added(policy: str, key: str) -> float | None:
        via = probe.get(policy, {})
        if via.get(key) is None or alone.get(key) is None:
            return None
        return round(via[key] - alone[key], 3)

    def cpu_ratio(policy: str) -> float | None:
        epp_cpu = mean(policy, "router_cpu_ms_per_request")
        return round(epp_cpu / proxy_cpu, 3) if epp_cpu and proxy_cpu else None

    def variant(policy: str, suffix: str) -> dict[str, float | None]:
        # A variant's keys, as the deployed modes' (its CPU only where every workload ran it).
        return {
            f"hit_ratio_epp_{suffix}": mean(policy, "hit_ratio"),
            f"added_latency_p50_ms_{suffix}": added(policy, "p50_ms"),
            f"added_latency_p99_ms_{suffix}": added(policy, "p99_ms"),
            f"cpu_per_request_epp_{suffix}_over_proxy": cpu_ratio(policy)
            if all(policy in run for run in runs)
            else None,
        }

    return {
        "hit_ratio_epp": mean(VIA_ENVOY_POLICY, "hit_ratio"),
        "hit_ratio_proxy": mean(PROXY_POLICY, "hit_ratio"),
        "load_max_over_mean_epp": mean(VIA_ENVOY_POLICY, "max_over_mean_load"),
        "load_max_over_mean_proxy": mean(PROXY_POLICY, "max_over_mean_load"),
        "added_latency_p50_ms": added(VIA_ENVOY_POLICY, "p50_ms"),
        "added_latency_p99_ms": added(VIA_ENVOY_POLICY, "p99_ms"),
        "cpu_per_request_epp_over_proxy": cpu_ratio(VIA_ENVOY_POLICY),
        **variant(VIA_ENVOY_ONE_ROUND_TRIP_POLICY, "one_round_trip"),
        **variant(VIA_ENVOY_STREAMED_BODY_POLICY, "streamed_body"),
    }


def goal_checks(top: dict[str, Any]) -> dict[str, str]:
    checks = {}
    for key, goal in GOALS.items():
        value = top.get(key)
        checks[key] = "not measured" if value is None else ("met" if value <= goal else "missed")
        checks[key] += f" (goal <= {goal})"
    return checks


def write_markdown(results: dict[str, Any], path: Path) -> None:
    meta = results["meta"]
    lines = [
        "# kvgate as Envoy's endpoint picker (`routing_bench --via envoy`)",
        "",
        f"{meta['engines']} simulated engines (`kvgate sim`, {' '.join(meta['sim_args'])}), "
        f"{meta['num_gpu_blocks']} KV blocks each; Envoy {meta.get('envoy_version', '?')} "
        f"(--concurrency 1); {meta['machine']}, load average {meta['load_average_start']} at the start. "
        f"Run {meta['date']}: `{meta['command']}` at {results['source'].get('commit')}"
        f"{' (dirty)' if results['source'].get('dirty') else ''}.",
        "",
        "| measure | value | goal |",
        "| --- | --- | --- |",
    ]
    checks = results["goals"]
    for key in SUMMARY_KEYS:
        lines.append(f"| `{key}` | {results.get(key)} | {checks.get(key, '')} |")
    lines += [
        "",
        "Hit ratios and loads: the mean over the workloads of each run's figures. Added latency: the probe's",
        "p50 and p99 through Envoy + picker minus through Envoy alone (LEAST_REQUEST). CPU: the picker",
        "process's CPU per request over the replays against the proxy's (Envoy's own CPU is not counted",
        "on either side; the proxy relays the bytes itself).",
        "",
        "## Replays",
        "",
        "| workload | router | hit ratio | TTFT p50 / p90 ms | load max/mean | router CPU ms/req | errors |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, workload in results["workloads"].items():
        for policy, run in workload["policies"].items():
            if "failed" in run:
                lines.append(f"| {name} | {policy} | failed: {run['failed'][:80]} | | | | |")
                continue
            ttft = f"{run['ttft_p50']:.1f} / {run['ttft_p90']:.1f}"
            lines.append(
                f"| {name} | {policy} | {run['hit_ratio']:.3f} | {ttft} | {run['max_over_mean_load']:.2f} | "
                f"{run['router_cpu_ms_per_request']:.3f} | {run['errors']} |"
            )
    lines += [
        "",
        "## Latency probe",
        "",
        f"{meta['probe_rounds']} rounds; each round one request to each router, in rotating order; prompts",
        "no engine holds, one token out.",
        "",
        "| router | p50 ms | p90 ms | p99 ms | mean ms | process CPU ms/request | errors |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for policy, probe in results["latency_probe"].items():
        lines.append(
            f"| {policy} | {probe['p50_ms']} | {probe['p90_ms']} | {probe['p99_ms']} | {probe['mean_ms']} | "
            f"{probe['process_cpu_ms_per_request']} | {probe['errors']} |"
        )
    path.write_text("\n".join(lines) + "\n")


def write_plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    workloads = list(results["workloads"])
    width = 0.2
    for offset, policy in enumerate(VIA_ENVOY_POLICIES):
        ratios = [
            results["workloads"][w]["policies"].get(policy, {}).get("hit_ratio", 0.0) for w in workloads
        ]
        left.bar([i + (offset - 1.5) * width for i in range(len(workloads))], ratios, width, label=policy)
    left.set_xticks(range(len(workloads)), workloads, rotation=20)
    left.set_ylabel("hit ratio")
    left.set_title("Routing quality per workload")
    left.set_ylim(0, 1.25)
    left.legend(fontsize=7, ncol=2, loc="upper center")
    probe = results["latency_probe"]
    names = list(probe)
    for offset, key in enumerate(("p50_ms", "p99_ms")):
        values = [probe[name][key] or 0.0 for name in names]
        right.bar([i + (offset - 0.5) * 0.35 for i in range(len(names))], values, 0.35, label=key)
    right.set_xticks(range(len(names)), names, rotation=15, fontsize=7)
    right.set_ylabel("end-to-end latency, ms")
    right.set_title("Latency probe (no cache hits, 1 token)")
    right.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def write_results(results: dict[str, Any], output: Path) -> None:
    output.parent.mkdir(parents=True, exist_ok=True)
    output.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    write_markdown(results, output.with_suffix(".md"))
    write_plot(results, output.with_suffix(".png"))

"""Router and cache as one system (issue 39), measured in one run: the churn figure (credited
shared-tier tokens that were loadable, before and after the tier's removals reach the router) and
the gateway's CPU per request with the issue's features on against off.

Churn: routing_bench's churn scenario (kvgate_testing/churn_runs.py: simulated engines sharing a tier
in a redis-server under maxmemory + allkeys-lru, restarted halfway; `kvgate sim
--shared-tier-removals` off, then on).

Overhead: the gateway_overhead benchmark's kv_aware workload (its `chat_bodies`: chat_sessions
prompts of 1-2k tokens, `max_tokens` 1, through its closed-loop `run_load`) through two kvgate
kv_aware gateways at once, one with every feature of `FEATURES` merged into its configuration ("on"),
one without ("off"), in front of the same simulated engines (`kvgate sim` with no simulated delays
and KV events on, so the contract check has events, a `/tokenize` and a replay endpoint to probe).
Rounds alternate the order (off-on, on-off); each phase sends fresh conversations. CPU per request:
utime+stime of the gateway's process tree over the phase (/proc) over the requests it served.
`cpu_overhead_ratio` is the median over rounds of on/off.

`FEATURES` maps a feature to its `Feature`: a configuration fragment merged (recursively) into the
gateway's proxy.yaml mapping, and headers sent on every request (to both gateways, so the bytes
are the same). What exists on main today:
- `contract_check`: router/contract.py, with `interval_s` 1 s (300 times the default, so that a
  phase of a few seconds sees several rounds of probes; the default would cost nothing measurable).
- `missed_reuse`: router/missed_reuse.py (`kvgate_missed_reuse_tokens_total`), off in "off" with
  `missed_reuse.enabled: false` (it is on by default).
- `tenant_salts`: router/tenants.py: the client's API key belongs to a tenant, whose name becomes
  the request's `cache_salt` (the body re-encoded for the engine). "Off" checks the same key, with
  no tenant, so both gateways pay the key check and only the tenant's work differs.

    .venv/bin/python -m benchmarks.one_system                 # writes benchmarks/results/one_system.*
    .venv/bin/python -m benchmarks.one_system --rounds 6 --requests 800
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.gateway_overhead import chat_bodies, run_load
from kvgate_testing import churn_runs
from kvgate_testing.gateway import GatewayProcess, start_gateway
from kvgate_testing.proc_stats import tree_cpu_seconds
from kvgate_testing.provenance import run_source, with_source
from kvgate_testing.routers import kvgate_config, wait_until_synced
from kvgate_testing.sim_fleet import EngineFleet

RESULTS = Path("benchmarks/results/one_system")
# Simulated engines that answer at once: the gateway, not the engines' simulated time, bounds the load.
INSTANT_SIM_ARGS = [
    "--prefill-us-per-token", "0", "--prefill-overhead-ms", "0",
    "--decode-ms-per-token", "0", "--decode-batch-slope", "0",
]  # fmt: skip


@dataclass(frozen=True)
class Feature:
    """One feature's switch: what it adds to the gateway's configuration and to each request."""

    config: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)
    # What "off" needs instead (a feature on by default is switched off here).
    off_config: dict[str, Any] = field(default_factory=dict)


# The one client key both gateways check (tenant_salts); the admin endpoints stay open on loopback.
_BENCH_KEY = "kvgate-one-system-bench-key"


FEATURES: dict[str, Feature] = {
    "contract_check": Feature({"contract_check": {"enabled": True, "interval_s": 1.0}}),
    "missed_reuse": Feature(
        {"missed_reuse": {"enabled": True}}, off_config={"missed_reuse": {"enabled": False}}
    ),
    "tenant_salts": Feature(
        {"auth": {"api_keys": [], "tenants": [{"name": "bench", "api_keys": [_BENCH_KEY]}]}},
        headers={"authorization": f"Bearer {_BENCH_KEY}"},
        off_config={"auth": {"api_keys": [_BENCH_KEY]}, "admin": {"open": True}},
    ),
}


def merged(base: dict, overlay: dict) -> dict:
    """`base` with `overlay` merged in: mappings key by key, anything else replaced."""
    result = dict(base)
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(result.get(key), dict):
            result[key] = merged(result[key], value)
        else:
            result[key] = value
    return result


def gateway_configs(fleet: EngineFleet, features: dict[str, Feature]) -> tuple[dict, dict]:
    """(off, on): kv_aware over the fleet, and the same with every feature's fragment merged in."""
    off = kvgate_config("kv_aware", {}, fleet)
    for feature in features.values():
        off = merged(off, feature.off_config)
    on = off
    for feature in features.values():
        on = merged(on, feature.config)
    return off, on


def _port(gateway: GatewayProcess) -> int:
    return int(gateway.url.rsplit(":", 1)[1])


def measure_overhead(args: argparse.Namespace, log: Any) -> dict:
    headers: dict[str, str] = {}
    for feature in FEATURES.values():
        headers.update(feature.headers)
    fleet = EngineFleet(args.engines, args.num_gpu_blocks, 16, INSTANT_SIM_ARGS)
    rounds: list[dict] = []
    with fleet:
        off_config, on_config = gateway_configs(fleet, FEATURES)
        gateways = {"off": start_gateway(off_config), "on": start_gateway(on_config)}
        try:
            for gateway in gateways.values():
                wait_until_synced(gateway.url, 60, headers)
            # Warm-up: both gateways' tokenizer caches and pools, and the first contract rounds.
            for index, gateway in enumerate(gateways.values()):
                bodies, _ = chat_bodies(args.warmup_requests, seed=9000 + index)
                asyncio.run(
                    run_load(_port(gateway), False, len(bodies), args.concurrency, 60, bodies, headers)
                )
            for round_index in range(args.rounds):
                order = ("off", "on") if round_index % 2 == 0 else ("on", "off")
                measured: dict[str, Any] = {"order": list(order)}
                for position, name in enumerate(order):
                    gateway = gateways[name]
                    bodies, _ = chat_bodies(args.requests, seed=100 * round_index + position)
                    cpu_before = tree_cpu_seconds(gateway.process.pid)
                    load = asyncio.run(
                        run_load(_port(gateway), False, len(bodies), args.concurrency, 120, bodies, headers)
                    )
                    cpu_s = tree_cpu_seconds(gateway.process.pid) - cpu_before
                    served = max(1, load["requests"])
                    measured[name] = {
                        "requests": load["requests"],
                        "errors": load["errors"],
                        "requests_per_s": round(load["requests_per_s"], 1),
                        "cpu_ms_per_request": round(cpu_s * 1000 / served, 4),
                        "load_average": round(os.getloadavg()[0], 2),
                    }
                measured["ratio"] = round(
                    measured["on"]["cpu_ms_per_request"] / measured["off"]["cpu_ms_per_request"], 4
                )
                off_ms, on_ms = (measured[name]["cpu_ms_per_request"] for name in ("off", "on"))
                log(
                    f"overhead round {round_index + 1}/{args.rounds}: off {off_ms:.3f} ms, on {on_ms:.3f} ms "
                    f"per request, ratio {measured['ratio']:.3f}"
                )
                rounds.append(measured)
        finally:
            for gateway in gateways.values():
                gateway.stop()
    pooled = {
        name: sum(r[name]["cpu_ms_per_request"] * r[name]["requests"] for r in rounds)
        / max(1, sum(r[name]["requests"] for r in rounds))
        for name in ("off", "on")
    }
    return {
        "features": {
            name: {"config": f.config, "headers": sorted(f.headers)} for name, f in FEATURES.items()
        },
        "cpu_overhead_ratio": round(statistics.median(r["ratio"] for r in rounds), 4),
        "cpu_overhead_ratio_pooled": round(pooled["on"] / pooled["off"], 4),
        "cpu_ms_per_request_off_pooled": round(pooled["off"], 4),
        "cpu_ms_per_request_on_pooled": round(pooled["on"], 4),
        "errors": sum(r[name]["errors"] for r in rounds for name in ("off", "on")),
        "rounds": rounds,
    }


def write_markdown(results: dict, path: Path) -> None:
    source, meta, overhead = results["source"], results["meta"], results["overhead"]
    lines = [
        "# Router and cache as one system (benchmarks/one_system.py)",
        "",
        f"Commit {source.get('commit')} (dirty: {source.get('dirty')}), {meta['date']}, {meta['machine']}; "
        f"load average {meta['load_average_start']} at start, {meta['load_average_end']} at end. "
        f"`{meta['command']}`.",
        "",
        "| measure | value | goal |",
        "| --- | --- | --- |",
        f"| credited_loadable_fraction_before | {results['credited_loadable_fraction_before']} | (today) |",
        f"| credited_loadable_fraction_after | {results['credited_loadable_fraction_after']} | >= 0.98 |",
        f"| cpu_overhead_ratio (median of rounds) | {results['cpu_overhead_ratio']} | <= 1.05 |",
        f"| cpu_overhead_ratio, pooled | {overhead['cpu_overhead_ratio_pooled']} | |",
        "",
        f"Features on: {', '.join(overhead['features'])} (`FEATURES` in the module says what each adds).",
        "",
        "| round | order | off ms/request | on ms/request | on/off | off req/s | on req/s | load average |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for index, run in enumerate(overhead["rounds"], 1):
        lines.append(
            f"| {index} | {' then '.join(run['order'])} | {run['off']['cpu_ms_per_request']} "
            f"| {run['on']['cpu_ms_per_request']} | {run['ratio']} | {run['off']['requests_per_s']} "
            f"| {run['on']['requests_per_s']} | {run['on']['load_average']} |"
        )
    lines += [
        "",
        *churn_runs.markdown_lines({**results["churn"], "source": source, "meta": results["churn_meta"]}),
    ]
    path.write_text("\n".join(lines) + "\n")


def write_plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (churn_axis, cpu_axis) = plt.subplots(1, 2, figsize=(12, 4.5))
    for run in results["churn"]["runs"]:
        credited = [s for s in run["samples"] if s["fraction"] is not None]
        churn_axis.plot([s["t_s"] for s in credited], [s["fraction"] for s in credited], label=run["variant"])
        if run["store_restarted_at_s"] is not None:
            churn_axis.axvline(run["store_restarted_at_s"], linestyle=":", color="grey")
    churn_axis.set_ylim(0, 1.05)
    churn_axis.set_xlabel("seconds into the variant (dotted: the store restarted)")
    churn_axis.set_ylabel("credited shared-tier tokens that were loadable")
    churn_axis.legend(loc="lower left", fontsize=8)
    churn_axis.set_title("Churn: the router's credit against the tier")
    rounds = results["overhead"]["rounds"]
    positions = range(1, len(rounds) + 1)
    cpu_axis.plot(positions, [r["off"]["cpu_ms_per_request"] for r in rounds], "o-", label="features off")
    cpu_axis.plot(positions, [r["on"]["cpu_ms_per_request"] for r in rounds], "s-", label="features on")
    cpu_axis.set_xlabel("round")
    cpu_axis.set_ylabel("gateway CPU ms per request")
    cpu_axis.set_ylim(bottom=0)
    cpu_axis.legend(fontsize=8)
    cpu_axis.set_title(f"Overhead: median on/off {results['cpu_overhead_ratio']}")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6, help="overhead rounds (orders alternate)")
    parser.add_argument("--requests", type=int, default=600, help="chat requests per gateway per round")
    parser.add_argument("--warmup-requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--engines", type=int, default=2, help="simulated engines behind the gateways")
    parser.add_argument("--num-gpu-blocks", type=int, default=4096)
    parser.add_argument("--churn-capacity", type=float, default=0.5, help="as routing_bench --churn-capacity")
    parser.add_argument("--skip-overhead", action="store_true", help="churn only (a quick look)")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.requests < 1:
        parser.error("--rounds and --requests must be at least 1")
    run_source()  # the commit as the run starts
    started = time.monotonic()
    load_start = round(os.getloadavg()[0], 2)
    from benchmarks.routing_bench import SHARED_TIER_DEFAULT_BLOCKS, SHARED_TIER_NAME, SHARED_TIER_SIM_ARGS
    from kvgate_testing import workloads as workload_catalog

    workload = workload_catalog.build(
        workload_catalog.SHARED_TIER_WORKLOADS[0], workload_catalog.qwen3_tokenizer(), 1.0, 1.0
    )
    settings = churn_runs.ChurnSettings(
        engines=8, num_gpu_blocks=SHARED_TIER_DEFAULT_BLOCKS, block_size=16, sim_args=SHARED_TIER_SIM_ARGS,
        tier=SHARED_TIER_NAME, concurrency=128, capacity_share=args.churn_capacity,
    )  # fmt: skip
    churn = churn_runs.run_churn(workload, settings, _log)
    overhead = {"cpu_overhead_ratio": None, "rounds": [], "features": {}} if args.skip_overhead else None
    if overhead is None:
        overhead = measure_overhead(args, _log)
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs (shared)"
    meta = {
        "date": date,
        "machine": machine,
        "command": " ".join(
            ["python -m benchmarks.one_system", *(argv if argv is not None else sys.argv[1:])]
        ),
        "load_average_start": load_start,
        "load_average_end": round(os.getloadavg()[0], 2),
        "wall_s": round(time.monotonic() - started, 1),
        "settings": {key: str(value) for key, value in vars(args).items()},
    }
    results = with_source(
        {
            "credited_loadable_fraction_before": churn["credited_loadable_fraction_before"],
            "credited_loadable_fraction_after": churn["credited_loadable_fraction_after"],
            "cpu_overhead_ratio": overhead["cpu_overhead_ratio"],
            "meta": meta,
            "churn": churn,
            "churn_meta": {
                **meta,
                "workload": workload.name,
                "workload_description": workload.description,
                "settings": vars(settings),
            },
            "overhead": overhead,
        }
    )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.with_suffix(".json").write_text(json.dumps(with_source(results), indent=1) + "\n")
    if not args.skip_overhead:
        write_markdown(results, args.output.with_suffix(".md"))
        write_plot(results, args.output.with_suffix(".png"))
    _log(
        f"wrote {args.output}.json: before {results['credited_loadable_fraction_before']}, after "
        f"{results['credited_loadable_fraction_after']}, cpu ratio {results['cpu_overhead_ratio']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

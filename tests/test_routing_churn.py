"""routing_bench's churn scenario, run small: simulated engines sharing a tier in a real redis-server
under allkeys-lru pressure, restarted halfway; the router's credit is checked against Redis."""

from __future__ import annotations

import pytest

from kvgate_testing import churn_runs, workloads
from kvgate_testing.sim_fleet import DEFAULT_SIM_ARGS


@pytest.mark.slow
def test_announced_removals_keep_the_routers_credit_loadable_and_without_them_it_is_not():
    workload = workloads.build(
        "shared_tier_documents", workloads.qwen3_tokenizer(), documents=8, document_tokens=800,
        requests=192, rate=24.0, question_tokens=(20, 40), max_tokens=4,
    )  # fmt: skip
    settings = churn_runs.ChurnSettings(
        engines=3, num_gpu_blocks=128, block_size=16, tier="documents",
        sim_args=[*DEFAULT_SIM_ARGS, "--shared-load-us-per-token", "20"], concurrency=32,
        capacity_share=0.5, sample_every_s=0.2, sample_size=16,
    )  # fmt: skip
    results = churn_runs.run_churn(workload, settings, lambda message: None)
    before, after = results["runs"]
    assert before["store_restarted_at_s"] is not None and after["store_restarted_at_s"] is not None
    assert before["evicted_keys_after_restart"] > 0  # the store was under pressure after the restart too
    assert before["credited_tokens"] > 0 and after["credited_tokens"] > 0
    assert results["credited_loadable_fraction_after"] >= 0.98
    # Without removals the router keeps crediting what the store evicted and what the restart lost.
    assert results["credited_loadable_fraction_before"] < 0.9
    assert results["credited_loadable_fraction_before"] < results["credited_loadable_fraction_after"]

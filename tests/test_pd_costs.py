"""The disaggregation's cost model (router/pd_costs.py): priors until measured, then what the
engines' reports measure."""

from __future__ import annotations

import pytest

from router.config import Disaggregation
from router.pd_costs import CostModel, EngineCosts

CONFIG = Disaggregation(
    min_observations=4,
    prior_prefill_us_per_token=100.0,
    prior_load_us_per_token=20.0,
    prior_transfer_us_per_token=5.0,
)


def test_an_engine_not_yet_measured_costs_the_configured_priors():
    figures = EngineCosts(CONFIG).figures()
    assert (
        figures.prefill_s_per_token,
        figures.load_s_per_token,
        figures.transfer_s_per_token,
    ) == pytest.approx((100e-6, 20e-6, 5e-6))
    assert not (figures.prefill_measured or figures.load_measured or figures.transfer_measured)


def test_the_prefill_cost_is_the_slope_of_time_on_computed_tokens_once_enough_are_seen():
    costs = EngineCosts(CONFIG)
    # An engine at 40 us per token with 3 ms of fixed cost per request.
    for tokens in (100, 1800, 600, 1200):
        costs.prefill.observe(tokens, 40e-6 * tokens + 0.003)
        if tokens != 1200:
            assert not costs.figures().prefill_measured  # fewer than min_observations: the prior
    figures = costs.figures()
    assert figures.prefill_measured
    assert figures.prefill_s_per_token == pytest.approx(40e-6, rel=0.01)
    assert costs.prefill.constant == pytest.approx(0.003, rel=0.05)


def test_load_and_transfer_costs_are_the_reported_seconds_per_token():
    costs = EngineCosts(CONFIG)
    for tokens in (256, 512, 1024, 2048):
        costs.load.observe(tokens * 12e-6, tokens)
        costs.transfer.observe(tokens * 3e-6, tokens)
    figures = costs.figures()
    assert figures.load_measured and figures.transfer_measured
    assert figures.load_s_per_token == pytest.approx(12e-6)
    assert figures.transfer_s_per_token == pytest.approx(3e-6)


def test_recent_reports_outweigh_old_ones():
    costs = EngineCosts(Disaggregation(min_observations=1, half_life_observations=4))
    for _ in range(40):
        costs.load.observe(1000 * 50e-6, 1000)  # the tier was slow
    for _ in range(40):
        costs.load.observe(1000 * 10e-6, 1000)  # and is fast now
    assert costs.figures().load_s_per_token == pytest.approx(10e-6, rel=0.01)


def test_reports_that_cannot_be_costs_are_ignored():
    costs = EngineCosts(Disaggregation(min_observations=1))
    costs.load.observe(float("nan"), 100)
    costs.load.observe(-1.0, 100)
    costs.load.observe(0.01, 0)
    costs.prefill.observe(100, float("inf"))
    assert (costs.load.observed, costs.prefill.observed) == (0, 0)
    assert not costs.figures().load_measured


def test_the_model_keeps_one_engine_costs_per_backend_and_describes_them():
    model = CostModel(CONFIG)
    model.engine("a").load.observe(0.001, 100)
    assert model.engine("a") is model.engine("a")
    assert model.names() == ["a"]
    described = model.describe()["a"]
    assert (
        described["observations"]["load"] == 1 and described["load_us_per_token"] == 20.0
    )  # still the prior
    model.forget("a")
    assert model.names() == []


def test_an_unmeasured_engine_costs_the_median_of_measured_peers_prefill_not_the_prior():
    model = CostModel(CONFIG)
    assert model.figures("decode").prefill_s_per_token == pytest.approx(100e-6)  # nobody measured: prior
    for name, us_per_token in (("a", 600.0), ("b", 800.0)):
        for tokens in (100, 1800, 600, 1200):
            model.engine(name).prefill.observe(tokens, us_per_token * 1e-6 * tokens)
    figures = model.figures("decode")
    assert not figures.prefill_measured
    assert figures.prefill_s_per_token == pytest.approx(700e-6, rel=0.01)
    assert figures.load_s_per_token == pytest.approx(20e-6)  # the other priors stand
    assert model.figures("a").prefill_s_per_token == pytest.approx(600e-6, rel=0.01)

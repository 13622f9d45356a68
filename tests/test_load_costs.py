"""kv_aware's measured load costs: the TTFT fit (router/policies/load_costs.py), the weights the
policy takes from it, and the gateway feeding it the first-piece times of streamed answers."""

from __future__ import annotations

import numpy as np

from kvgate_testing.index_oracle import WritableIndex
from kvgate_testing.policy_inputs import PROMPTS, backends, request, store
from router.backends import BackendState
from router.config import KVAwarePolicy
from router.index.keys import Namespace
from router.index.store import PrefixIndex
from router.policies.base import RouteRequest
from router.policies.kv_aware import KVAware
from router.policies.load_costs import MeasuredLoadCosts


def feed(costs: MeasuredLoadCosts, count: int, *, us_per_token: float, ms_per_request: float,
         us_per_queued_token: float = 0.0, seed: int = 3, vary_tokens: bool = True) -> None:  # fmt: skip
    rng = np.random.default_rng(seed)
    for _ in range(count):
        uncached = int(rng.integers(0, 3000)) if vary_tokens else 500
        in_flight = int(rng.integers(0, 8))
        queued = int(rng.integers(0, 4000))
        ttft = (
            0.03
            + uncached * us_per_token * 1e-6
            + in_flight * ms_per_request * 1e-3
            + queued * us_per_queued_token * 1e-6
        )
        costs.observe(uncached, in_flight, queued, ttft * float(rng.normal(1.0, 0.05)))


def test_the_fit_recovers_what_a_request_in_flight_costs_in_prompt_tokens() -> None:
    costs = MeasuredLoadCosts(half_life_requests=200, min_requests=32)
    feed(costs, 400, us_per_token=85, ms_per_request=120, us_per_queued_token=40)
    assert costs.request_weight is not None and costs.prefill_weight is not None
    # 120 ms per request at 85 us per token: about 1400 tokens; a queued token about 0.47 of one.
    assert abs(costs.request_weight - 120e3 / 85) < 0.1 * 120e3 / 85
    assert abs(costs.prefill_weight - 40 / 85) < 0.1
    described = costs.describe()
    assert abs(described["ttft_model"]["us_per_uncached_token"] - 85) < 5
    assert abs(described["ttft_model"]["ms_per_request_in_flight"] - 120) < 10


def test_no_weights_before_enough_requests_or_from_a_degenerate_fit() -> None:
    costs = MeasuredLoadCosts(half_life_requests=200, min_requests=64)
    feed(costs, 40, us_per_token=85, ms_per_request=120)
    assert costs.request_weight is None and costs.describe()["ttft_model"] is None
    # Every request with the same uncached tokens: the cost per token is not measurable.
    flat = MeasuredLoadCosts(half_life_requests=200, min_requests=32)
    feed(flat, 200, us_per_token=85, ms_per_request=120, vary_tokens=False)
    assert flat.request_weight is None or flat.request_weight < 1e5
    # TTFT that falls with more tokens to compute: no sensible weights.
    upside_down = MeasuredLoadCosts(half_life_requests=200, min_requests=32)
    feed(upside_down, 200, us_per_token=-50, ms_per_request=120)
    assert upside_down.request_weight is None


def test_recent_requests_outweigh_old_ones() -> None:
    costs = MeasuredLoadCosts(half_life_requests=50, min_requests=32)
    feed(costs, 400, us_per_token=85, ms_per_request=10)
    early = costs.request_weight
    feed(costs, 400, us_per_token=85, ms_per_request=150, seed=4)
    assert early is not None and costs.request_weight is not None
    assert early < 300 and costs.request_weight > 1500


def _holder_with_followers_in_flight() -> tuple[PrefixIndex, list[BackendState]]:
    index = WritableIndex()
    store(index, "b0", PROMPTS[0][:384])
    candidates = backends(2)
    candidates[0].in_flight = 3
    return index, candidates


def test_measured_load_costs_move_a_request_off_a_busy_holder() -> None:
    index, candidates = _holder_with_followers_in_flight()
    policy = KVAware(KVAwarePolicy(measure_load_costs=True), index)
    # Configured weights (128 tokens a request): 384 cached tokens outweigh 3 requests in flight.
    assert policy.choose(request(PROMPTS[0]), candidates).backend.name == "b0"
    assert policy.load_costs is not None
    feed(policy.load_costs, 200, us_per_token=85, ms_per_request=150)
    request_weight, _ = policy.load_weights()
    assert request_weight > 1000
    choice = policy.choose(request(PROMPTS[0]), candidates)
    assert choice.backend.name == "b1"
    assert choice.candidates["b0"]["load"] > 3000


def test_measured_weights_never_go_below_the_configured_ones() -> None:
    index, _ = _holder_with_followers_in_flight()
    floors = KVAwarePolicy(request_load_weight=128, prefill_load_weight=0.5, measure_load_costs=True)
    policy = KVAware(floors, index)
    assert policy.load_costs is not None
    feed(policy.load_costs, 200, us_per_token=100, ms_per_request=0.3)  # the simulator's engines
    assert policy.load_costs.request_weight is not None and policy.load_costs.request_weight < 20
    assert policy.load_weights() == (128, 0.5)
    off = KVAware(KVAwarePolicy(), index)  # the default: configured weights only
    assert off.load_costs is None and off.load_weights() == (128, 0.5)


def test_the_policy_learns_from_streamed_requests_it_routed() -> None:
    index, candidates = _holder_with_followers_in_flight()
    policy = KVAware(KVAwarePolicy(measure_load_costs=True, load_fit_min_requests=8), index)
    assert policy.load_costs is not None
    for n in range(16):
        req = RouteRequest(request_id=f"r{n}", model="m", body={}, tokens=PROMPTS[n % 4][: 64 * (1 + n % 8)],
                           namespace=Namespace())  # fmt: skip
        choice = policy.choose(req, candidates)
        chosen = choice.backend
        chosen.in_flight += 1  # as the gateway counts it before on_routed
        policy.on_routed(choice)
        load = choice.state.load_at_send
        assert load[1] == chosen.in_flight - 1  # the load the request met, not counting itself
        ttft_s = 0.05 + 1e-4 * load[0] + 0.2 * load[1]
        chosen.in_flight -= 1
        policy.on_finished(choice, 200, ttft_s)
    assert policy.load_costs.observed == 16
    # A request whose answer was not streamed (no first-piece time) teaches nothing.
    choice = policy.choose(request(PROMPTS[5]), candidates)
    policy.on_routed(choice)
    policy.on_finished(choice, 200, None)
    assert policy.load_costs.observed == 16

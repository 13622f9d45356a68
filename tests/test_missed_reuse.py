"""Missed reuse (router/missed_reuse.py): each reason is counted when its situation happens and
not otherwise, the reasons never count a token twice, and the gateway publishes the counter on
/metrics and /debug/prefix-map."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from kvgate_testing.kv_fleet import DOCS, Fleet, chat_body
from kvgate_testing.metrics import metric_samples, sample_key
from router.config import builtin_tokenizer_dir
from router.missed_reuse import MissedReuse
from router.policies.base import Choice
from router.tokenize import PromptTokenizer


def choice(winner: str, reason: str, candidates: dict, cached: int | None = None) -> Choice:
    held = candidates[winner].get("cached", 0) if cached is None else cached
    return Choice(SimpleNamespace(name=winner), reason, held, None, candidates)  # type: ignore[arg-type]


def totals(missed: MissedReuse) -> dict[str, int]:
    return {reason: tokens for reason, tokens in missed.totals.items() if tokens}


def test_a_better_cached_engine_passed_over_for_load_is_load_guard() -> None:
    missed = MissedReuse(CollectorRegistry())
    missed.routed(
        choice("b0", "load_guard", {"b0": {"cached": 0}, "b1": {"cached": 512, "by_tier": {"gpu": 512}}})
    )
    assert totals(missed) == {"load_guard": 512}
    # The per-backend detail names the engine that computed the tokens.
    assert missed.describe()["by_backend"] == {"b0": {"load_guard": 512}}


def test_the_winner_holding_the_best_prefix_misses_nothing() -> None:
    missed = MissedReuse(CollectorRegistry())
    missed.routed(
        choice(
            "b1",
            "cache_hit",
            {"b0": {"cached": 256, "by_tier": {"gpu": 256}}, "b1": {"cached": 512, "by_tier": {"gpu": 512}}},
        )
    )
    missed.routed(choice("b0", "cold_spread", {"b0": {"cached": 0}, "b1": {"cached": 0}}))
    assert totals(missed) == {}
    assert missed.requests_with_miss == 0


def test_tokens_held_only_in_another_engines_cpu_tier_are_tier_unreachable() -> None:
    missed = MissedReuse(CollectorRegistry())
    # b1 has 128 tokens on GPU and 384 more on its CPU tier; b0 holds 64: 64 of the GPU part and
    # the whole CPU part were missed, each counted once.
    missed.routed(
        choice(
            "b0",
            "cache_vs_load",
            {
                "b0": {"cached": 64, "by_tier": {"gpu": 64}},
                "b1": {"cached": 512, "by_tier": {"gpu": 128, "cpu": 512}},
            },
        )
    )
    assert totals(missed) == {"load_guard": 64, "tier_unreachable": 384}


def test_a_learned_credit_without_tiers_passed_over_is_load_guard_not_a_tier() -> None:
    """approximate's candidates carry only `cached` (what it learned it sent there): no tier holds
    it, so a gap of its is the policy's choice, not an unreachable tier."""
    missed = MissedReuse(CollectorRegistry())
    missed.routed(
        choice("b0", "load_guard", {"b0": {"cached": 0, "cost": 9.0}, "b1": {"cached": 256, "cost": 1.0}})
    )
    assert totals(missed) == {"load_guard": 256}


def test_a_winner_routed_by_load_for_a_contract_mismatch_is_contract_mismatch() -> None:
    missed = MissedReuse(CollectorRegistry())
    missed.uncredited = {"b0": "contract mismatch on block_size"}
    missed.routed(
        choice("b0", "load_guard", {"b0": {"cached": 0}, "b1": {"cached": 512, "by_tier": {"gpu": 512}}})
    )
    assert totals(missed) == {"contract_mismatch": 512}


def test_credit_the_engine_did_not_have_is_stale_index_and_only_that() -> None:
    missed = MissedReuse(CollectorRegistry())
    credited = choice("b1", "cache_hit", {"b1": {"cached": 512, "by_tier": {"gpu": 512}}})
    assert missed.wants_tail(credited)
    forgot = b'data: {"usage":{"prompt_tokens":600,"prompt_tokens_details":{"cached_tokens":128}}}\n\n'
    missed.finished(credited, 200, forgot)
    assert totals(missed) == {"stale_index": 384}
    # An engine that had it all, one that reports no usage, or a failed answer: nothing more.
    missed.finished(credited, 200, b'{"usage":{"prompt_tokens_details":{"cached_tokens":512}}}')
    missed.finished(credited, 200, b'{"usage":{"prompt_tokens":600}}')
    missed.finished(credited, 502, forgot)
    assert totals(missed) == {"stale_index": 384}


def test_switched_off_it_counts_nothing() -> None:
    missed = MissedReuse(CollectorRegistry(), enabled=False)
    lost = choice("b0", "load_guard", {"b0": {"cached": 0}, "b1": {"cached": 512, "by_tier": {"gpu": 512}}})
    missed.routed(lost)
    missed.finished(choice("b1", "cache_hit", {"b1": {"cached": 512}}), 200, b'"cached_tokens":0')
    assert totals(missed) == {}


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    qwen3 = PromptTokenizer(builtin_tokenizer_dir("qwen3"))
    fleet = Fleet()
    try:
        fleet.cache("b1", qwen3.tokens_for(chat_body(DOCS["b1"], "What is this about?")), 1000)
        fleet.wait_for(lambda m: m["backends"]["b1"]["blocks"])
        yield fleet
    finally:
        fleet.close()


def test_the_gateway_publishes_missed_reuse_on_metrics_and_the_debug_page(fleet: Fleet) -> None:
    response = fleet.client.post("/v1/chat/completions", json=chat_body(DOCS["b1"], "And then?"))
    assert response.status_code == 200 and response.headers["x-kvgate-backend"] == "b1"
    samples = metric_samples(fleet.client.get("/metrics").text)
    # A cache hit on the engine holding the prefix misses nothing, under every reason.
    for reason in ("load_guard", "stale_index", "tier_unreachable", "contract_mismatch"):
        assert samples[sample_key("kvgate_missed_reuse_tokens_total", reason=reason)] == 0
    section = fleet.prefix_map()["missed_reuse"]
    assert section["enabled"] is True
    assert sum(section["tokens"].values()) == 0

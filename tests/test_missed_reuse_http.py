"""Missed reuse per reason through a real `kvgate serve` process on loopback: each reason's situation
made for real, and its tokens counted on kvgate_missed_reuse_tokens_total{reason} and in
/debug/prefix-map's `missed_reuse` section, equal to the gap the recorded routing decision shows
(router/missed_reuse.py; docs/gateway.md, "Missed reuse").

- load_guard and tier_unreachable: three test backends with KV-event publishers (kvgate_testing/
  kv_fleet.py); the holder is kept busy by a request the backend delays, and kv_aware's load term
  (request_load_weight) is made to outweigh any hit, so the next request goes elsewhere.
- contract_mismatch and stale_index: simulated engines (`kvgate sim`), one with another block size
  (the contract check routes it by load only), one that empties its cache without announcing it
  (`--unannounced-prefix-cache-reset`).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator

import httpx
import pytest

from kvgate_testing import waiting
from kvgate_testing.gateway import start_gateway
from kvgate_testing.kv_fleet import Fleet, chat_body
from kvgate_testing.metrics import metric_samples, sample_key
from kvgate_testing.sim_fleet import MODEL, EngineFleet, gateway_backend
from router.config import builtin_tokenizer_dir
from router.missed_reuse import REASONS
from router.tokenize import PromptTokenizer

wait_for = functools.partial(waiting.wait_for, timeout_s=90.0)
# One request in flight outweighs any cache hit: the next request goes to an idle backend.
LOAD_DECIDES = {"name": "kv_aware", "request_load_weight": 1_000_000.0}
TEXTS = {
    "hot": "A field guide to the lichens of granite boulders, their colours and their slow growth. " * 6,
    "busy": "Notes on restoring a clockwork orrery: gears, arbors and the ratios of the planets. " * 6,
    "offloaded": "The history of canal locks, from pound locks to inclined planes and boat lifts. " * 6,
}


def missed(url: str, headers: dict | None = None) -> dict[str, float]:
    samples = metric_samples(httpx.get(f"{url}/metrics", headers=headers, timeout=10).text)
    return {
        reason: samples[sample_key("kvgate_missed_reuse_tokens_total", reason=reason)] for reason in REASONS
    }


def counted_since(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    return {
        reason: round(after[reason] - before[reason]) for reason in REASONS if after[reason] != before[reason]
    }


def decision(prefix_map: dict, request_id: str) -> dict:
    return next(d for d in prefix_map["decisions"] if d["request_id"] == request_id)


def gap(made: dict) -> int:
    """The routing gap of a recorded decision: the best other candidate's credit less the winner's."""
    winner = made["backend"]
    others = [score["cached"] for name, score in made["candidates"].items() if name != winner]
    return max(0, max(others, default=0) - made["candidates"][winner]["cached"])


class Blocker:
    """A request kept in flight on `backend` (it answers after `hold_ms`), in a thread."""

    def __init__(self, post) -> None:  # type: ignore[no-untyped-def]
        self.response: httpx.Response | None = None
        self._thread = threading.Thread(target=self._run, args=(post,), daemon=True)
        self._thread.start()

    def _run(self, post) -> None:  # type: ignore[no-untyped-def]
        self.response = post()

    def join(self) -> httpx.Response:
        self._thread.join(timeout=120)
        assert self.response is not None
        return self.response


# ---- load_guard and tier_unreachable: test backends, events published by the test ----


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    qwen3 = PromptTokenizer(builtin_tokenizer_dir("qwen3"))
    fleet = Fleet(policy=LOAD_DECIDES)
    try:
        # b1 holds "hot" and "busy" on its GPU, and "offloaded" only in its CPU tier.
        held = {name: qwen3.tokens_for(chat_body(text, "First question?")) for name, text in TEXTS.items()}
        fleet.cache("b1", held["hot"], 10_000)
        fleet.cache("b1", held["busy"], 20_000)
        fleet.cache("b1", held["offloaded"], 30_000, medium="CPU")
        expected = {
            "gpu": (len(held["hot"]) // 16) + (len(held["busy"]) // 16),
            "cpu": len(held["offloaded"]) // 16,
        }
        fleet.wait_for(lambda m: m["backends"]["b1"]["blocks"] == expected)
        yield fleet
    finally:
        fleet.close()


def keep_b1_busy(fleet: Fleet, text: str) -> Blocker:
    """A request for a prefix b1 holds on its GPU, answered after 3 s: b1 has one in flight."""
    body = chat_body(text, "A question that keeps b1 busy?")
    blocker = Blocker(
        lambda: fleet.client.post("/v1/chat/completions", json=body, headers={"x-test-delay-ms": "3000"})
    )
    fleet.wait_for(lambda m: m["backends"]["b1"]["in_flight"] == 1)
    return blocker


def test_a_holder_passed_over_for_its_load_counts_its_gpu_prefix_as_load_guard(fleet: Fleet) -> None:
    before = missed(fleet.gateway.url)
    blocker = keep_b1_busy(fleet, TEXTS["hot"])
    response = fleet.client.post("/v1/chat/completions", json=chat_body(TEXTS["hot"], "Another question?"))
    assert response.status_code == 200 and response.headers["x-kvgate-backend"] != "b1"
    assert blocker.join().headers["x-kvgate-backend"] == "b1"
    prefix_map = fleet.prefix_map()
    made = decision(prefix_map, response.headers["x-request-id"])
    assert made["candidates"]["b1"]["cached"] > 0 and gap(made) == made["candidates"]["b1"]["cached"]
    # The whole gap sits on b1's GPU (its blocks, and the blocker's prompt predicted there).
    assert counted_since(before, missed(fleet.gateway.url)) == {"load_guard": gap(made)}
    by_backend = prefix_map["missed_reuse"]["by_backend"][response.headers["x-kvgate-backend"]]
    assert by_backend["load_guard"] >= gap(made)


def test_a_prefix_held_only_in_the_busy_holders_cpu_tier_is_tier_unreachable(fleet: Fleet) -> None:
    before = missed(fleet.gateway.url)
    before_section = fleet.prefix_map()["missed_reuse"]["tokens"]
    blocker = keep_b1_busy(fleet, TEXTS["busy"])  # another prefix: nothing of "offloaded" is predicted on b1
    response = fleet.client.post(
        "/v1/chat/completions", json=chat_body(TEXTS["offloaded"], "Another question?")
    )
    assert response.status_code == 200 and response.headers["x-kvgate-backend"] != "b1"
    blocker.join()
    prefix_map = fleet.prefix_map()
    made = decision(prefix_map, response.headers["x-request-id"])
    assert gap(made) > 0
    # b1 holds it in its CPU tier only, which the winner cannot load from.
    assert counted_since(before, missed(fleet.gateway.url)) == {"tier_unreachable": gap(made)}
    section = prefix_map["missed_reuse"]["tokens"]
    assert section["tier_unreachable"] - before_section["tier_unreachable"] == gap(made)


# ---- contract_mismatch and stale_index: simulated engines ----


@pytest.fixture(scope="module")
def engines() -> Iterator[EngineFleet]:
    # engine-0: the reference, decoding slowly enough for a request to stay in flight; engine-1:
    # 32-token blocks (a contract mismatch).
    with EngineFleet(
        2, num_gpu_blocks=512, per_engine_args=[["--decode-ms-per-token", "25"], ["--block-size", "32"]]
    ) as fleet:
        yield fleet


@pytest.fixture(scope="module")
def forgetful() -> Iterator[EngineFleet]:
    # An engine that empties its cache without announcing it.
    with EngineFleet(1, num_gpu_blocks=512, per_engine_args=[["--unannounced-prefix-cache-reset"]]) as fleet:
        yield fleet


def credited(gateway_url: str, engine_url: str, prompt: str, backend: str) -> int:
    """The tokens of `prompt` the gateway's index credits `backend` with (0 until its events arrive)."""
    tokens = httpx.post(f"{engine_url}/tokenize", json={"model": MODEL, "prompt": prompt}, timeout=10).json()[
        "tokens"
    ]
    answer = httpx.post(f"{gateway_url}/lookup", json={"tokens": tokens}, timeout=10).json()
    return answer["layout_info"][backend][1] if backend in answer["layout_info"] else 0


@pytest.mark.slow  # two simulated engines, the contract check's rounds: ~30-50 s on the loaded 2 cores
def test_a_winner_routed_by_load_only_for_a_contract_mismatch_counts_the_gap_as_contract_mismatch(
    engines: EngineFleet,
) -> None:
    reference, mismatched = engines.engines[0], engines.engines[1]
    config = {
        "models": [{"name": MODEL, "tokenizer": "builtin:qwen3"}],
        "backends": [gateway_backend(reference), gateway_backend(mismatched)],
        "policy": LOAD_DECIDES,
        # engine-1's probe events never match the gateway's blocks: each round waits timeout_s for them.
        "contract_check": {"enabled": True, "timeout_s": 5},
    }
    prompt = "The contract mismatch test's shared document, read by every question. " * 12
    with start_gateway(config) as gateway, httpx.Client(base_url=gateway.url, timeout=60) as client:
        wait_for(
            lambda: (
                "engine-1" in client.get("/debug/prefix-map", params={"format": "json"}).json()["backends"]
            )
        )
        wait_for(
            lambda: any(
                w["subject"] == "engine-1/block_size"
                for w in client.get("/health").json().get("warnings", [])
            )
        )
        # engine-0 computes the document; its events credit it there.
        httpx.post(
            f"{reference.url}/v1/completions",
            json={"model": MODEL, "prompt": prompt, "max_tokens": 1},
            timeout=30,
        ).raise_for_status()
        wait_for(lambda: credited(gateway.url, reference.url, prompt, "engine-0") or None)
        before = missed(gateway.url)
        body = {"model": MODEL, "prompt": prompt + " Summarize it.", "max_tokens": 160}
        blocker = Blocker(lambda: client.post("/v1/completions", json=body))  # ~4 s of decode on engine-0
        wait_for(
            lambda: (
                client.get("/debug/prefix-map", params={"format": "json"}).json()["backends"]["engine-0"][
                    "in_flight"
                ]
                == 1
            )
        )
        response = client.post(
            "/v1/completions", json={"model": MODEL, "prompt": prompt + " List its parts.", "max_tokens": 1}
        )
        assert response.status_code == 200 and response.headers["x-kvgate-backend"] == "engine-1"
        assert blocker.join().headers["x-kvgate-backend"] == "engine-0"
        prefix_map = client.get("/debug/prefix-map", params={"format": "json"}).json()
        made = decision(prefix_map, response.headers["x-request-id"])
        assert gap(made) > 0
        # Not load_guard: the winner gets no credit until its contract agrees, so the gap is charged there.
        assert counted_since(before, missed(gateway.url)) == {"contract_mismatch": gap(made)}
        assert prefix_map["missed_reuse"]["by_backend"]["engine-1"]["contract_mismatch"] == gap(made)


def test_credit_for_blocks_the_engine_lost_unannounced_is_stale_index(forgetful: EngineFleet) -> None:
    engine = forgetful.engines[0]
    config = {
        "models": [{"name": MODEL, "tokenizer": "builtin:qwen3"}],
        "backends": [gateway_backend(engine)],
        "policy": {"name": "kv_aware"},
    }
    prompt = "The stale index test's document, which its engine forgets without a word. " * 12
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
    with start_gateway(config) as gateway, httpx.Client(base_url=gateway.url, timeout=60) as client:
        wait_for(
            lambda: (
                client.get("/debug/prefix-map", params={"format": "json"}).json()["backends"]["engine-0"][
                    "connected"
                ]
                or None
            )
        )
        first = client.post("/v1/completions", json=body)
        assert first.status_code == 200
        wait_for(lambda: credited(gateway.url, engine.url, prompt, "engine-0") or None)
        # The engine empties its cache and publishes no AllBlocksCleared: the index still credits it.
        httpx.post(f"{engine.url}/reset_prefix_cache", timeout=10).raise_for_status()
        assert credited(gateway.url, engine.url, prompt, "engine-0") > 0
        before = missed(gateway.url)
        again = client.post("/v1/completions", json=body)
        assert again.status_code == 200
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        prefix_map = client.get("/debug/prefix-map", params={"format": "json"}).json()
        made = decision(prefix_map, again.headers["x-request-id"])
        assert made["cached_tokens"] > 0
        # Everything the winner was credited with, it computed again.
        assert counted_since(before, missed(gateway.url)) == {"stale_index": made["cached_tokens"]}
        assert prefix_map["missed_reuse"]["tokens"]["stale_index"] == made["cached_tokens"]

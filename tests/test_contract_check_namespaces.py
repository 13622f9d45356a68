"""The contract check's model and cache-layer fields on simulated engines (router/contract.py):
- `model`: a configured model (a LoRA adapter here) that an engine's /v1/models does not list is a
  mismatch naming the field and what the engine lists; adapters it does serve agree, their probe
  found in the adapter's namespace;
- `cache_lookup` and `chunk_size` from a backend's `cache_controller`: the real `cachelayer
  controller` process on loopback, with a real CacheEngine per engine registered with it. A proxy in
  front of each simulated engine stores every completion's prompt into that engine's cache layer,
  as a KV connector does: one keyed with the request's salt agrees, one that drops the salt is
  found disagreeing, and so is a chunk size other than the configured one."""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Iterator

import httpx
import pytest
import torch
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from cachelayer import CacheEngine
from kvgate_testing import waiting
from kvgate_testing.cachelayer import CHUNK, HEAD_DIM, HEADS, LAYERS, make_engine
from kvgate_testing.controller import controller_process, registered, wait_registered, worker_config
from kvgate_testing.gateway import start_gateway
from kvgate_testing.in_thread_server import serving_in_thread
from kvgate_testing.sim_fleet import MODEL, EngineFleet, gateway_backend

wait_for = functools.partial(waiting.wait_for, timeout_s=120.0)


def contract_warnings(gateway_url: str) -> dict[str, str]:
    body = httpx.get(f"{gateway_url}/health", timeout=10).json()
    return {w["subject"]: w["message"] for w in body.get("warnings", []) if w["kind"] == "contract_mismatch"}


@pytest.fixture(scope="module")
def lora_engines() -> Iterator[EngineFleet]:
    # engine-0 serves both adapters, engine-1 only adapter-a.
    with EngineFleet(
        2,
        num_gpu_blocks=512,
        per_engine_args=[
            ["--lora-modules", "adapter-a=/adapters/a", "adapter-b=/adapters/b"],
            ["--lora-modules", "adapter-a=/adapters/a"],
        ],
    ) as fleet:
        yield fleet


@pytest.mark.slow  # two simulated engines, three models' rounds
def test_a_configured_lora_adapter_an_engine_does_not_serve_is_a_model_mismatch(
    lora_engines: EngineFleet,
) -> None:
    config = {
        "models": [
            {"name": name, "tokenizer": "builtin:qwen3"} for name in (MODEL, "adapter-a", "adapter-b")
        ],
        "backends": [gateway_backend(engine) for engine in lora_engines.engines],
        "policy": {"name": "kv_aware"},
        "contract_check": {"enabled": True, "timeout_s": 5},
    }
    with start_gateway(config) as gateway:
        found = wait_for(lambda: contract_warnings(gateway.url) or None)
        assert set(found) == {"engine-1/model"}, found
        message = found["engine-1/model"]
        assert "expects it to serve 'adapter-b'" in message
        assert "'tiny-qwen3', 'adapter-a' (LoRA adapter of 'tiny-qwen3')" in message
        assert "routed by load only" in message
        # The rounds go by model name: adapter-a's came first, the base model's after adapter-b's;
        # give that one time to end (each probe waits at most timeout_s).
        time.sleep(2 * config["contract_check"]["timeout_s"] + 2)
        # adapter-a's probes were found in the adapter's namespace on both engines: no kv_events
        # warning came with it, nor with the base model.
        debug = httpx.get(f"{gateway.url}/debug/prefix-map", params={"format": "json"}, timeout=10).json()
        assert {w["subject"] for w in debug["warnings"] if w["kind"] == "contract_mismatch"} == {
            "engine-1/model"
        }
        metrics = httpx.get(f"{gateway.url}/metrics", timeout=10).text
        assert 'kvgate_routing_warnings{kind="contract_mismatch"} 1.0' in metrics


# ---- the cache layer's controller ----


def storing_proxy(engine_url: str, cache: CacheEngine, *, keep_salt: bool) -> Starlette:
    """Forwards everything to the engine; a completion's prompt is first stored into `cache` (zeros
    for KV), with the request's cache_salt unless `keep_salt` is False (a store that drops it)."""

    async def forward(request: Request) -> Response:
        body = await request.body()
        async with httpx.AsyncClient(base_url=engine_url, timeout=60) as client:
            if request.method == "POST" and request.url.path == "/v1/completions":
                data = json.loads(body)
                tokenized = await client.post(
                    "/tokenize", json={"model": data["model"], "prompt": data["prompt"]}
                )
                tokens = tokenized.json()["tokens"]
                kv = torch.zeros(LAYERS, 2, len(tokens), HEADS * HEAD_DIM, dtype=torch.bfloat16)
                cache.store(tokens, kv, cache_salt=data.get("cache_salt") if keep_salt else None)
            answer = await client.request(
                request.method, request.url.path, content=body, headers={"content-type": "application/json"}
            )
        return Response(answer.content, answer.status_code, media_type=answer.headers.get("content-type"))

    return Starlette(routes=[Route("/{path:path}", forward, methods=["GET", "POST"])])


@pytest.fixture(scope="module")
def cache_fleet() -> Iterator[tuple[EngineFleet, str, list[str]]]:
    """Two simulated engines, each behind a storing proxy into its own registered CacheEngine
    (instances cache-0, keyed with the salt, and cache-1, without): (fleet, controller URL, proxy URLs)."""
    with (
        EngineFleet(2, num_gpu_blocks=512) as fleet,
        controller_process() as (controller_url, monitor_port),
        httpx.Client(base_url=controller_url, timeout=10) as client,
    ):
        caches = [registered(make_engine(64, **worker_config(monitor_port, f"cache-{i}"))) for i in range(2)]
        try:
            for index in range(2):
                wait_registered(client, f"cache-{index}", 1)
            apps = [
                storing_proxy(engine.url, cache, keep_salt=index == 0)
                for index, (engine, cache) in enumerate(zip(fleet.engines, caches, strict=True))
            ]
            with serving_in_thread(apps[0]) as first, serving_in_thread(apps[1]) as second:
                yield fleet, controller_url, [first, second]
        finally:
            for cache in caches:
                cache.close()


def controller_config(cache_fleet, **contract_check) -> dict:  # type: ignore[no-untyped-def]
    fleet, controller_url, proxies = cache_fleet
    return {
        "models": [{"name": MODEL, "tokenizer": "builtin:qwen3"}],
        "backends": [
            gateway_backend(
                engine, url=url, cache_controller={"url": controller_url, "instance_id": f"cache-{index}"}
            )
            for index, (engine, url) in enumerate(zip(fleet.engines, proxies, strict=True))
        ],
        "policy": {"name": "kv_aware"},
        "contract_check": {"enabled": True, "timeout_s": 5, **contract_check},
    }


@pytest.mark.slow  # a controller process, two simulated engines, two gateways
def test_the_cache_controllers_lookup_names_a_store_that_keys_chunks_without_the_salt(cache_fleet) -> None:  # type: ignore[no-untyped-def]
    with start_gateway(controller_config(cache_fleet)) as gateway:
        found = wait_for(lambda: contract_warnings(gateway.url) or None)
        assert set(found) == {"engine-1/cache_lookup"}, found
        message = found["engine-1/cache_lookup"]
        assert f"whole {CHUNK}-token chunks" in message and "kvgate-contract-probe" in message
        assert "the backend reports 0 tokens" in message
        # engine-0's store, keyed as the gateway keys the probe, holds its whole chunks: no warning.

    # A gateway expecting 32-token chunks: both stores registered 16 (their /query_worker_info).
    with start_gateway(controller_config(cache_fleet, chunk_size=2 * CHUNK)) as gateway:
        found = wait_for(
            lambda: contract_warnings(gateway.url) if len(contract_warnings(gateway.url)) >= 3 else None
        )
        assert set(found) == {"engine-0/chunk_size", "engine-1/chunk_size", "engine-1/cache_lookup"}, found
        assert (
            f"expects {2 * CHUNK} tokens, the backend reports {CHUNK} tokens" in found["engine-0/chunk_size"]
        )

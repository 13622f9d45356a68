"""The conditional split: one cost estimate per request, from the engines' measured costs, decides
colocated or split (router/disaggregation.py, router/pd_costs.py). A real gateway over a prefill-role
and a decode-role simulated engine sharing a real redis-server."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import pytest

from kvgate_testing.gateway import GatewayProcess, start_gateway
from kvgate_testing.pd_fleet import MODEL, RoledFleet


@pytest.fixture(scope="module")
def fleet() -> Iterator[RoledFleet]:
    decode_args = {"decode-0": ["--decode-ms-per-token", "10"]}
    with RoledFleet({"prefill-0": "prefill", "decode-0": "decode"}, sim_args=decode_args) as started:
        yield started


@pytest.fixture(scope="module")
def gateway(fleet: RoledFleet) -> Iterator[GatewayProcess]:
    # Priors only (min_observations out of reach): each decision is the estimate's arithmetic.
    with start_gateway(fleet.gateway_config("conditional", min_observations=1000)) as started:
        yield started


def decision(gateway: GatewayProcess, request_id: str) -> dict:
    page = httpx.get(f"{gateway.url}/debug/prefix-map", params={"format": "json"}, timeout=10).json()
    return next(d for d in page["disaggregation"]["decisions"] if d["request_id"] == request_id)


def complete(gateway: GatewayProcess, request_id: str, prompt: str, max_tokens: int = 2) -> dict:
    response = httpx.post(
        f"{gateway.url}/v1/completions",
        json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens},
        headers={"x-request-id": request_id},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    return response.json()


class LongDecode:
    """A streamed request decoding many tokens on the decode engine while the test goes on."""

    def __init__(self, gateway: GatewayProcess) -> None:
        self.first_token = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(gateway,), daemon=True)

    def _run(self, gateway: GatewayProcess) -> None:
        body = {"model": MODEL, "prompt": "keep decoding", "max_tokens": 400, "stream": True}
        with httpx.stream("POST", f"{gateway.url}/v1/completions", json=body, timeout=60) as response:
            for _ in response.iter_lines():
                self.first_token.set()

    def __enter__(self) -> LongDecode:
        self._thread.start()
        assert self.first_token.wait(30), "the long decode never started"
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._thread.join(60)


def test_a_short_prompt_stays_colocated_on_the_decode_engine(fleet: RoledFleet, gateway: GatewayProcess):
    before = fleet.counters("prefill-0")["vllm:request_success_total"]
    complete(gateway, "short", "hello there")
    chosen = decision(gateway, "short")
    assert (chosen["option"], chosen["backend"], chosen["prefill_backend"]) == (
        "colocated_gpu",
        "decode-0",
        None,
    )
    assert chosen["estimates"]["split"]["total_s"] > chosen["estimates"]["colocated_gpu"]["total_s"]
    assert fleet.counters("prefill-0")["vllm:request_success_total"] == before


def test_a_long_prompt_is_split_while_the_decode_engine_decodes_and_stays_when_cached_there(
    gateway: GatewayProcess,
):
    long_prompt = "a long document to read " * 160
    # Idle: a split only adds the transfer and the load to the same prefill.
    complete(gateway, "idle", "another document altogether " * 160)
    assert decision(gateway, "idle")["option"] == "colocated_gpu"
    with LongDecode(gateway):
        # Its streams would wait for this prefill on the decode engine: the split is cheaper.
        complete(gateway, "busy", long_prompt)
        busy = decision(gateway, "busy")
        assert (busy["option"], busy["prefill_backend"], busy["backend"]) == (
            "split",
            "prefill-0",
            "decode-0",
        )
        assert busy["estimates"]["colocated_gpu"]["stall_s"] > busy["estimates"]["split"]["stall_s"]
        # The same prompt again: the decode engine holds it now, so it stays there.
        complete(gateway, "cached", long_prompt)
        assert decision(gateway, "cached")["option"] == "colocated_gpu"

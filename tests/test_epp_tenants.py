"""Tenants apart behind Envoy: `kvgate epp` salts a tenant's request (auth.tenants) as `kvgate serve`
does (router/request_routing.py), routes it by the salted prompt and sends the salted body on to the
engine, in both request body modes; a request of a key without tenant, or off the salted paths,
passes byte for byte.

First the picker alone, driven by a real gRPC client speaking ext_proc as Envoy does
(kvgate_testing/ext_proc_client.py): the exact answers (a BUFFERED body replaced with its
content-length, streamed chunks replaced by one body, nothing changed without a tenant, a bad
client salt refused). Then end to end through the real Envoy (slow): a simulated engine's own
prefix cache and the picker's routing decisions show that neither crosses tenants, and a recording
test backend shows the well-formed request the engine received.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import grpc
import httpx
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc

from kvgate_testing.backend import BackendProcess, start_backend
from kvgate_testing.envoy import BodyMode
from kvgate_testing.ext_proc_client import (
    BODY_MODES,
    FULL_DUPLEX_STREAMED,
    ExtProcStream,
    bearer,
    body_message,
    exchange_with_key,
    headers_message,
)
from kvgate_testing.metrics import metric_samples, sample_key
from kvgate_testing.picker import EnvoyWithPicker, PickerProcess, start_envoy_and_picker, start_picker
from kvgate_testing.sim_fleet import MODEL, EngineFleet, gateway_backend

RECORDED_MODEL = "test-model"
ACME_KEY = "kvgate-test-acme-key-0011"
BETA_KEY = "kvgate-test-beta-key-2233"
PLAIN_KEY = "kvgate-test-plain-key-4455"
ADMIN = "kvgate-test-admin-token-6677"
AUTH = {
    "api_keys": [PLAIN_KEY],
    "tenants": [{"name": "acme", "api_keys": [ACME_KEY]}, {"name": "beta", "api_keys": [BETA_KEY]}],
}
# Unusual spacing: a body the picker re-encoded would not come out byte for byte.
CLIENT_BODY = (
    b'{"model":  "test-model", "messages": [{"role": "user", "content": "h\\u00e9llo"}], "max_tokens": 2}'
)


# ---- the picker alone, its answers read as Envoy reads them ----


@pytest.fixture(scope="module")
def recorder() -> Iterator[BackendProcess]:
    backend = start_backend("recorder", [RECORDED_MODEL])
    yield backend
    backend.stop()


@pytest.fixture(scope="module")
def picker(recorder: BackendProcess) -> Iterator[PickerProcess]:
    config = {
        "models": [{"name": RECORDED_MODEL}],
        "backends": [{"name": recorder.name, "url": recorder.url}],
        "policy": {"name": "least_loaded"},
        "auth": AUTH,
        "admin": {"token": ADMIN},
    }
    with start_picker(config) as picker:
        yield picker


@pytest.fixture(scope="module")
def channel(picker: PickerProcess) -> Iterator[grpc.Channel]:
    with picker.channel() as channel:
        yield channel


def salted(body: bytes, salt: str) -> dict:
    return {**json.loads(body), "cache_salt": salt}


@pytest.mark.parametrize("mode", BODY_MODES)
@pytest.mark.parametrize(("client_salt", "expected"), [(None, "acme"), ("user-7", "acme:user-7")])
def test_a_tenants_body_goes_on_salted(
    channel: grpc.Channel, mode: str, client_salt: str | None, expected: str
) -> None:
    body = (
        CLIENT_BODY
        if client_salt is None
        else json.dumps({**json.loads(CLIENT_BODY), "cache_salt": client_salt}).encode()
    )
    picked = exchange_with_key(channel, ACME_KEY, body, mode)
    assert picked.header, picked.body
    if mode == "buffered":
        # One body in place of the client's, and a content-length that matches it.
        assert picked.replaced_body is not None and json.loads(picked.replaced_body) == salted(body, expected)
        assert picked.set_headers["content-length"] == str(len(picked.replaced_body))
        assert picked.echoed == []
    elif mode == "streamed":
        # Envoy holds the chunks: the first answered with the salted body, the others cleared, and
        # the headers' answer sets the content-length that matches.
        assert picked.replaced_body is not None and json.loads(picked.replaced_body) == salted(body, expected)
        assert picked.chunk_answers == [picked.replaced_body] + [b""] * (len(picked.chunk_answers) - 1)
        assert len(picked.chunk_answers) > 1 and picked.echoed == []
        assert picked.set_headers["content-length"] == str(len(picked.replaced_body))
    else:
        # The chunks held (40 bytes each) replaced by the salted body, once, ending the stream.
        assert len(picked.echoed) == 1, picked.echoed
        sent, end = picked.echoed[0]
        assert end and json.loads(sent) == salted(body, expected)
        assert picked.replaced_body is None and "content-length" not in picked.set_headers


def test_a_streamed_body_ending_with_trailers_is_replaced_and_the_trailers_follow(
    channel: grpc.Channel,
) -> None:
    stream = ExtProcStream(channel)
    stream.send(
        headers_message("/v1/chat/completions", extra=[bearer(BETA_KEY)], body_mode=FULL_DUPLEX_STREAMED)
    )
    stream.send(body_message(CLIENT_BODY[:30], False))
    stream.send(body_message(CLIENT_BODY[30:], False))
    stream.send(ext_proc.ProcessingRequest(request_trailers=ext_proc.HttpTrailers()))
    kinds, chunks = [], []
    while len(kinds) < 3:
        response = stream.recv()
        assert response is not None, stream.error
        kind = response.WhichOneof("response")
        kinds.append(kind)
        if kind == "request_body":
            mutation = response.request_body.response.body_mutation.streamed_response
            chunks.append((mutation.body, mutation.end_of_stream))
    stream.close()
    assert kinds == ["request_headers", "request_body", "request_trailers"]
    # Not the end of the stream: the trailers end it.
    assert len(chunks) == 1 and chunks[0][1] is False
    assert json.loads(chunks[0][0]) == salted(CLIENT_BODY, "beta")


@pytest.mark.parametrize("mode", BODY_MODES)
@pytest.mark.parametrize(
    ("key", "path"),
    [(PLAIN_KEY, "/v1/chat/completions"), (ACME_KEY, "/tokenize")],
    ids=["no_tenant", "unsalted_path"],
)
def test_without_a_tenant_or_off_the_salted_paths_the_body_passes_unchanged(
    channel: grpc.Channel, mode: str, key: str, path: str
) -> None:
    picked = exchange_with_key(channel, key, CLIENT_BODY, mode, path)
    assert picked.header, picked.body
    assert picked.replaced_body is None and "content-length" not in picked.set_headers
    if mode == "buffered":
        assert picked.echoed == []
    elif mode == "streamed":
        # Every chunk passed on as it came, nothing sent back.
        assert picked.chunk_answers == [None] * len(picked.chunk_answers) and len(picked.chunk_answers) > 1
        assert picked.echoed == []
    else:
        assert b"".join(chunk for chunk, _ in picked.echoed) == CLIENT_BODY and len(picked.echoed) > 1


@pytest.mark.parametrize("mode", BODY_MODES)
@pytest.mark.parametrize("bad_salt", [5, "", ["acme"]], ids=["number", "empty", "list"])
def test_a_bad_client_salt_of_a_tenant_gets_the_400_serve_gives(
    channel: grpc.Channel, mode: str, bad_salt: object
) -> None:
    body = json.dumps({**json.loads(CLIENT_BODY), "cache_salt": bad_salt}).encode()
    picked = exchange_with_key(channel, ACME_KEY, body, mode)
    assert picked.status == 400 and picked.details == "kvgate_epp_bad_request"
    error = json.loads(picked.body)["error"]
    assert error["param"] == "cache_salt" and error["message"] == "`cache_salt` must be a non-empty string"


# ---- end to end through the real Envoy ----


@pytest.fixture(scope="module")
def engine() -> Iterator[EngineFleet]:
    # One engine: every request of MODEL lands on it, so its own cached_tokens tell whether the
    # salt reached it, and the picker's decision tells what the router credited.
    with EngineFleet(count=1, num_gpu_blocks=512, sim_args=["--prefill-us-per-token", "5"]) as fleet:
        yield fleet


@pytest.fixture(scope="module", params=list(BodyMode), ids=lambda mode: mode.value.lower())
def gateway(
    request: pytest.FixtureRequest, engine: EngineFleet, recorder: BackendProcess
) -> Iterator[EnvoyWithPicker]:
    config = {
        "models": [
            {"name": MODEL, "tokenizer": "builtin:qwen3"},
            {"name": RECORDED_MODEL, "tokenizer": "builtin:qwen3"},
        ],
        "backends": [
            gateway_backend(engine.engines[0], models=[MODEL]),
            {"name": recorder.name, "url": recorder.url, "models": [RECORDED_MODEL]},
        ],
        "policy": {"name": "kv_aware"},
        "health": {"interval_s": 0.5},
        "auth": AUTH,
        "admin": {"token": ADMIN},
        "log_level": "warning",
    }
    with start_envoy_and_picker(config, request.param) as pair:
        deadline = time.monotonic() + 60
        while not prefix_map(pair)["backends"]["engine-0"]["connected"]:
            assert time.monotonic() < deadline, "the picker never subscribed to the engine's events"
            time.sleep(0.1)
        time.sleep(0.3)  # PUB/SUB: let the subscription reach the publisher
        yield pair


def prefix_map(pair: EnvoyWithPicker) -> dict:
    headers = {"authorization": f"Bearer {ADMIN}"}
    return httpx.get(f"{pair.picker.url}/debug/prefix-map?format=json", headers=headers, timeout=10).json()


def gpu_tokens(pair: EnvoyWithPicker) -> int:
    return prefix_map(pair)["backends"]["engine-0"]["tokens"].get("gpu", 0)


def complete(pair: EnvoyWithPicker, key: str, prompt: str, request_id: str) -> dict:
    """(the engine's cached tokens, the picker's credited tokens) for one completion through Envoy;
    waits until the engine's new blocks reached the picker's index, so a repeat can be credited."""
    before = gpu_tokens(pair)
    response = httpx.post(
        f"{pair.url}/v1/completions",
        json={"model": MODEL, "prompt": prompt, "max_tokens": 1},
        headers={"authorization": f"Bearer {key}", "x-request-id": request_id},
        timeout=30,
    )
    assert response.status_code == 200, response.text
    engine_cached = response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    decisions = [d for d in prefix_map(pair)["decisions"] if d["request_id"] == request_id]
    assert decisions, f"no routing decision for {request_id}"
    deadline = time.monotonic() + 15
    while engine_cached == 0 and gpu_tokens(pair) <= before:
        assert time.monotonic() < deadline, "the engine never published the new blocks"
        time.sleep(0.05)
    return {"engine": engine_cached, "router": decisions[0]["cached_tokens"]}


@pytest.mark.slow
def test_through_envoy_tenants_never_share_cached_kv_and_each_tenants_repeats_do(
    gateway: EnvoyWithPicker,
) -> None:
    prompt = f"shared ({gateway.envoy.url}): " + " ".join(
        f"clause {i} of the contract on item {i * 3}." for i in range(40)
    )
    tag = gateway.envoy.url.rsplit(":", 1)[-1]  # request ids of this gateway's run alone
    assert complete(gateway, ACME_KEY, prompt, f"acme-1-{tag}") == {"engine": 0, "router": 0}
    again = complete(gateway, ACME_KEY, prompt, f"acme-2-{tag}")
    assert again["engine"] >= 160 and again["router"] >= 160, again
    # The same prompt on the same engine, from the other tenant: no credit, no hit.
    assert complete(gateway, BETA_KEY, prompt, f"beta-1-{tag}") == {"engine": 0, "router": 0}
    beta_again = complete(gateway, BETA_KEY, prompt, f"beta-2-{tag}")
    assert beta_again["engine"] >= 160 and beta_again["router"] >= 160, beta_again
    # A key without a tenant keeps the unsalted cache, shared with neither tenant.
    assert complete(gateway, PLAIN_KEY, prompt, f"plain-1-{tag}") == {"engine": 0, "router": 0}
    samples = metric_samples(httpx.get(f"{gateway.picker.url}/metrics", timeout=10).text)
    assert samples[sample_key("kvgate_tenant_requests_total", tenant="acme", status="200")] >= 2


@pytest.mark.slow
def test_through_envoy_the_engine_receives_the_salted_body_well_formed(
    gateway: EnvoyWithPicker, recorder: BackendProcess, request: pytest.FixtureRequest
) -> None:
    recorder.reset()
    base = {"model": RECORDED_MODEL, "messages": [{"role": "user", "content": "h\u00e9llo " * 50}]}
    bodies = {
        "salted": (ACME_KEY, json.dumps({**base, "cache_salt": "beta"}).encode()),
        "plain": (PLAIN_KEY, CLIENT_BODY),
    }
    for name, (key, body) in bodies.items():
        headers = {"authorization": f"Bearer {key}", "x-request-id": name, "content-type": "application/json"}
        response = httpx.post(f"{gateway.url}/v1/chat/completions", content=body, headers=headers, timeout=30)
        assert response.status_code == 200, response.text
    received = {entry["request_id"]: entry for entry in recorder.received()}
    # A client salt is namespaced under the client's own tenant: acme naming "beta" gets "acme:beta".
    salted_entry = received["salted"]
    assert json.loads(salted_entry["body"]) == {**base, "cache_salt": "acme:beta"}
    headers = salted_entry["headers"]
    if request.node.callspec.params["gateway"] is BodyMode.BUFFERED:
        # The length of the body the engine read, the picker's content-length.
        assert headers["content-length"] == str(len(salted_entry["body"].encode())), headers
    else:
        assert headers.get("transfer-encoding") == "chunked" and "content-length" not in headers, headers
    # Without a tenant: the client's bytes, as they were.
    assert received["plain"]["body"].encode() == CLIENT_BODY


@pytest.mark.slow
def test_through_envoy_a_wrong_key_gets_401_and_a_tenants_bad_salt_400_from_the_picker(
    gateway: EnvoyWithPicker,
) -> None:
    def immediate(reason: str, status: str) -> float:
        samples = metric_samples(httpx.get(f"{gateway.picker.url}/metrics", timeout=10).text)
        return samples.get(
            sample_key("kvgate_epp_immediate_responses_total", reason=reason, status=status), 0
        )

    body = {"model": MODEL, "prompt": "hello", "max_tokens": 1}
    before = immediate("unauthorized", "401"), immediate("bad_request", "400")
    wrong = httpx.post(
        f"{gateway.url}/v1/completions", json=body, headers={"authorization": "Bearer not-a-key"}, timeout=30
    )
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "Unauthorized"
    bad = httpx.post(
        f"{gateway.url}/v1/completions",
        json={**body, "cache_salt": ""},
        headers={"authorization": f"Bearer {ACME_KEY}"},
        timeout=30,
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt", bad.text
    # Both answered by the picker itself (the engine would refuse an empty salt too, but never sees it).
    assert (immediate("unauthorized", "401"), immediate("bad_request", "400")) == (
        before[0] + 1,
        before[1] + 1,
    )

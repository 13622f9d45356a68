"""A model the engines know by another name (models[].served_name) behind Envoy: `kvgate epp` sends
the request on with `model` set to the engines' name, as `kvgate serve` does
(router/request_routing.py, engine_body), in both request body modes; a tenant's request to such a
model is salted and renamed in one body; a model without a served name passes byte for byte. The
answer is left as the engine wrote it, as serve leaves it (its `model` is the engines' name).

First the picker alone, driven by a real gRPC client speaking ext_proc as Envoy does
(kvgate_testing/ext_proc_client.py): the exact answers. Then end to end through the real Envoy
(slow): a simulated engine, which answers 404 for a model it does not serve, answers 200, and a
recording test backend shows the request the engine received.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import grpc
import httpx
import pytest

from kvgate_testing.backend import BackendProcess, start_backend
from kvgate_testing.envoy import BodyMode
from kvgate_testing.ext_proc_client import (
    BODY_MODES,
    Picked,
    exchange_with_key,
)
from kvgate_testing.picker import EnvoyWithPicker, PickerProcess, start_envoy_and_picker, start_picker
from kvgate_testing.sim_fleet import MODEL, EngineFleet

RECORDED_MODEL = "test-model"
# The clients' names for the models the engines serve as RECORDED_MODEL and MODEL.
RECORDED_ALIAS = "client-name"
ENGINE_ALIAS = "client-qwen"
# A served_name equal to the name: nothing to rename.
SAME_NAME = "same-name"
ACME_KEY = "kvgate-test-acme-key-0011"
PLAIN_KEY = "kvgate-test-plain-key-4455"
AUTH = {"api_keys": [PLAIN_KEY], "tenants": [{"name": "acme", "api_keys": [ACME_KEY]}]}
ADMIN = {"token": "kvgate-test-admin-token-6677"}


def client_body(model: str) -> bytes:
    # Unusual spacing: a body the picker re-encoded would not come out byte for byte.
    return (
        b'{"model":  "' + model.encode() + b'", "messages": [{"role": "user", "content": "h\\u00e9llo"}],'
        b' "max_tokens": 2}'
    )


# ---- the picker alone, its answers read as Envoy reads them ----


@pytest.fixture(scope="module")
def recorder() -> Iterator[BackendProcess]:
    backend = start_backend("recorder", [RECORDED_MODEL, SAME_NAME])
    yield backend
    backend.stop()


@pytest.fixture(scope="module")
def channel(recorder: BackendProcess) -> Iterator[grpc.Channel]:
    config = {
        "models": [
            {"name": RECORDED_MODEL},
            {"name": RECORDED_ALIAS, "served_name": RECORDED_MODEL},
            {"name": SAME_NAME, "served_name": SAME_NAME},
        ],
        "backends": [{"name": recorder.name, "url": recorder.url}],
        "policy": {"name": "least_loaded"},
        "auth": AUTH,
        "admin": ADMIN,
    }
    picker: PickerProcess
    with start_picker(config) as picker, picker.channel() as channel:
        yield channel


def body_sent_on(picked: Picked, mode: str) -> dict:
    """The one body the picker sent in place of the client's, parsed; asserts it is one, whole."""
    assert picked.header, picked.body
    if mode == "buffered":
        assert picked.replaced_body is not None and picked.echoed == []
        assert picked.set_headers["content-length"] == str(len(picked.replaced_body))
        return json.loads(picked.replaced_body)
    if mode == "streamed":
        # Envoy holds the chunks (40 bytes each): the first answered with the body, the others cleared.
        assert picked.replaced_body is not None and picked.echoed == []
        assert picked.chunk_answers == [picked.replaced_body] + [b""] * (len(picked.chunk_answers) - 1)
        assert picked.set_headers["content-length"] == str(len(picked.replaced_body))
        return json.loads(picked.replaced_body)
    # The chunks held (40 bytes each) replaced by one body, ending the stream.
    assert picked.replaced_body is None and "content-length" not in picked.set_headers
    assert len(picked.echoed) == 1 and picked.echoed[0][1], picked.echoed
    return json.loads(picked.echoed[0][0])


@pytest.mark.parametrize("mode", BODY_MODES)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_a_model_with_a_served_name_goes_on_under_that_name(
    channel: grpc.Channel, mode: str, path: str
) -> None:
    body = client_body(RECORDED_ALIAS)
    sent = body_sent_on(exchange_with_key(channel, PLAIN_KEY, body, mode, path), mode)
    assert sent == {**json.loads(body), "model": RECORDED_MODEL}


@pytest.mark.parametrize("mode", BODY_MODES)
def test_a_tenants_request_to_a_served_name_is_salted_and_renamed_in_one_body(
    channel: grpc.Channel, mode: str
) -> None:
    body = client_body(RECORDED_ALIAS)
    sent = body_sent_on(exchange_with_key(channel, ACME_KEY, body, mode), mode)
    assert sent == {**json.loads(body), "model": RECORDED_MODEL, "cache_salt": "acme"}


@pytest.mark.parametrize("mode", BODY_MODES)
@pytest.mark.parametrize("model", [RECORDED_MODEL, SAME_NAME], ids=["no_served_name", "served_name_is_name"])
def test_a_model_the_engines_know_by_its_name_passes_unchanged(
    channel: grpc.Channel, mode: str, model: str
) -> None:
    body = client_body(model)
    picked = exchange_with_key(channel, PLAIN_KEY, body, mode)
    assert picked.header, picked.body
    assert picked.replaced_body is None and "content-length" not in picked.set_headers
    if mode == "buffered":
        assert picked.echoed == []
    elif mode == "streamed":
        assert picked.chunk_answers == [None] * len(picked.chunk_answers) and len(picked.chunk_answers) > 1
        assert picked.echoed == []
    else:
        assert b"".join(chunk for chunk, _ in picked.echoed) == body and len(picked.echoed) > 1


# ---- end to end through the real Envoy ----


@pytest.fixture(scope="module")
def engine() -> Iterator[EngineFleet]:
    with EngineFleet(count=1, num_gpu_blocks=256) as fleet:
        yield fleet


@pytest.fixture(scope="module", params=list(BodyMode), ids=lambda mode: mode.value.lower())
def gateway(
    request: pytest.FixtureRequest, engine: EngineFleet, recorder: BackendProcess
) -> Iterator[EnvoyWithPicker]:
    simulated = engine.engines[0]
    config = {
        "models": [
            {"name": MODEL},
            {"name": ENGINE_ALIAS, "served_name": MODEL},
            {"name": RECORDED_MODEL},
            {"name": RECORDED_ALIAS, "served_name": RECORDED_MODEL},
        ],
        "backends": [
            {"name": simulated.name, "url": simulated.url, "models": [MODEL, ENGINE_ALIAS]},
            {"name": recorder.name, "url": recorder.url, "models": [RECORDED_MODEL, RECORDED_ALIAS]},
        ],
        "policy": {"name": "least_loaded"},
        "auth": AUTH,
        "admin": ADMIN,
        "log_level": "warning",
    }
    with start_envoy_and_picker(config, request.param) as pair:
        yield pair


def post(gateway: EnvoyWithPicker, body: bytes, request_id: str, key: str = PLAIN_KEY) -> httpx.Response:
    headers = {
        "authorization": f"Bearer {key}",
        "x-request-id": request_id,
        "content-type": "application/json",
    }
    return httpx.post(f"{gateway.url}/v1/chat/completions", content=body, headers=headers, timeout=30)


@pytest.mark.slow
@pytest.mark.parametrize("model", [ENGINE_ALIAS, MODEL])
def test_through_envoy_the_engine_answers_200_under_its_own_name(
    gateway: EnvoyWithPicker, model: str
) -> None:
    response = post(gateway, client_body(model), f"engine-{model}")
    # The simulated engine answers 404 for a model it does not know (ENGINE_ALIAS sent as it came).
    assert response.status_code == 200, response.text
    # The answer as the engine wrote it, as serve relays it: the engines' name for the model.
    assert response.json()["model"] == MODEL


@pytest.mark.slow
def test_through_envoy_the_engine_receives_the_served_name_and_an_unnamed_model_byte_for_byte(
    gateway: EnvoyWithPicker, recorder: BackendProcess, request: pytest.FixtureRequest
) -> None:
    recorder.reset()
    bodies = {
        "renamed": (PLAIN_KEY, client_body(RECORDED_ALIAS)),
        "renamed-salted": (ACME_KEY, client_body(RECORDED_ALIAS)),
        "plain": (PLAIN_KEY, client_body(RECORDED_MODEL)),
    }
    for name, (key, body) in bodies.items():
        response = post(gateway, body, name, key)
        assert response.status_code == 200, response.text
    received = {entry["request_id"]: entry for entry in recorder.received()}
    client = json.loads(client_body(RECORDED_ALIAS))
    assert json.loads(received["renamed"]["body"]) == {**client, "model": RECORDED_MODEL}
    assert json.loads(received["renamed-salted"]["body"]) == {
        **client,
        "model": RECORDED_MODEL,
        "cache_salt": "acme",
    }
    for name in ("renamed", "renamed-salted"):
        headers = received[name]["headers"]
        if request.node.callspec.params["gateway"] is BodyMode.BUFFERED:
            assert headers["content-length"] == str(len(received[name]["body"].encode())), headers
        else:
            assert headers.get("transfer-encoding") == "chunked" and "content-length" not in headers, headers
    # Without a served name: the client's bytes, as they were.
    assert received["plain"]["body"].encode() == client_body(RECORDED_MODEL)

"""`kvgate epp` as a real process, driven by a real gRPC client speaking Envoy's ext_proc v3 (as Envoy
does, kvgate_testing/ext_proc_client.py), in front of three test backends whose KV-event publishers
speak vLLM's protocol: the pick follows the cached prefix in every body mode, obeys the subset
hint, avoids an engine marked down, credits the endpoint Envoy says served, and every bad request
gets its immediate response in vLLM's error shape."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import grpc
import pytest

from kvgate_testing.ext_proc_client import (
    BODY_MODES,
    ExtProcStream,
    Picked,
    exchange,
    headers_message,
    response_body_message,
    response_headers_message,
)
from kvgate_testing.kv_fleet import DOCS, MODEL, Fleet, chat_body
from kvgate_testing.metrics import metric_samples, sample_key
from kvgate_testing.picker import start_picker
from router.config import builtin_tokenizer_dir
from router.tokenize import PromptTokenizer

BODY_LIMIT = 8192


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    qwen3 = PromptTokenizer(builtin_tokenizer_dir("qwen3"))
    fleet = Fleet(start=start_picker, epp={"max_body_bytes": BODY_LIMIT}, health={"interval_s": 0.2})
    try:
        for n, (name, doc) in enumerate(DOCS.items()):
            fleet.cache(name, qwen3.tokens_for(chat_body(doc, "What is this about?")), 1000 * (n + 1))
        fleet.wait_for(lambda m: m["backends"]["b1"]["blocks"] and m["backends"]["b2"]["blocks"])
        yield fleet
    finally:
        fleet.close()


@pytest.fixture(scope="module")
def channel(fleet: Fleet) -> Iterator[grpc.Channel]:
    with fleet.gateway.channel() as channel:
        yield channel


def endpoint(fleet: Fleet, name: str) -> str:
    backend = next(backend for backend in fleet.backends if backend.name == name)
    return backend.url.removeprefix("http://")


def finish(stream: ExtProcStream, status: int = 200) -> None:
    """Play the response phase as Envoy does, then close the stream."""
    stream.send(response_headers_message(status))
    assert stream.recv().WhichOneof("response") == "response_headers"
    stream.send(response_body_message(b'{"choices": []}', True))
    assert stream.recv().WhichOneof("response") == "response_body"
    stream.close()


def in_flight(fleet: Fleet) -> dict[str, int]:
    listed = fleet.client.get("/backends").json()["backends"]
    return {backend["name"]: backend["in_flight"] for backend in listed}


@pytest.mark.parametrize("mode", BODY_MODES)
def test_a_repeated_long_prompt_is_picked_for_the_engine_that_holds_it(
    fleet: Fleet, channel: grpc.Channel, mode: str
) -> None:
    for round_ in range(2):
        for name, doc in DOCS.items():
            body = json.dumps(chat_body(doc, f"Follow-up {round_}?")).encode()
            stream = ExtProcStream(channel)
            picked = exchange(stream, "/v1/chat/completions", body, mode=BODY_MODES[mode], chunk_size=500)
            assert picked.status is None, picked.body
            # The header names one endpoint, the one holding the prefix; the envoy.lb metadata lists
            # it first, then the next best (another engine) for a proxy that retries down the list.
            assert picked.header == endpoint(fleet, name)
            listed = picked.metadata.split(",")
            assert listed[0] == picked.header and len(listed) == 2
            others = {backend.url.removeprefix("http://") for backend in fleet.backends} - {picked.header}
            assert listed[1] in others
            if mode == "full_duplex_streamed":
                assert picked.kinds[0] == "request_headers"
                # Every chunk re-emitted unchanged, in order, the last one ending the body.
                assert b"".join(chunk for chunk, _ in picked.echoed) == body
                assert len(picked.echoed) == -(-len(body) // 500)
                assert [end for _, end in picked.echoed][-1] is True
            elif mode == "streamed":
                # The pick on the headers' answer, then every chunk answered, passed on as it came.
                assert picked.kinds == ["request_headers"] + ["request_body"] * -(-len(body) // 500)
                assert picked.chunk_answers == [None] * -(-len(body) // 500) and picked.echoed == []
            else:
                assert picked.kinds == ["request_headers", "request_body"]
            finish(stream)


def test_the_subset_hint_is_obeyed_and_one_naming_no_endpoint_is_a_503(
    fleet: Fleet, channel: grpc.Channel
) -> None:
    body = json.dumps(chat_body(DOCS["b1"], "Subset?")).encode()
    allowed = [endpoint(fleet, "b2"), "10.255.0.1:8000"]
    stream = ExtProcStream(channel)
    picked = exchange(stream, "/v1/chat/completions", body, subset=allowed)
    # b1 holds the prefix, but the gateway allows only b2 (and an endpoint it does not know); no
    # fallback outside the hint is listed.
    assert picked.header == picked.metadata == endpoint(fleet, "b2")
    finish(stream)
    stream = ExtProcStream(channel)
    picked = exchange(stream, "/v1/chat/completions", body, subset=["10.255.0.1:8000"])
    assert picked.status == 503 and picked.details == "kvgate_epp_subset_no_endpoint"
    assert "subset hint" in json.loads(picked.body)["error"]["message"]
    assert stream.recv() is None  # the picker ended the stream


def test_the_endpoint_envoy_says_served_takes_the_load_and_the_credit(
    fleet: Fleet, channel: grpc.Channel
) -> None:
    body = json.dumps(chat_body(DOCS["b1"], "Served elsewhere?")).encode()
    stream = ExtProcStream(channel)
    picked = exchange(stream, "/v1/chat/completions", body)
    assert picked.header == endpoint(fleet, "b1")
    assert in_flight(fleet)["b1"] == 1
    # Envoy retried on b2 (the header's fallback or its own retry policy) and says so.
    stream.send(response_headers_message(200, served=endpoint(fleet, "b2"), content_type="text/event-stream"))
    assert stream.recv().WhichOneof("response") == "response_headers"
    assert in_flight(fleet) == {"b0": 0, "b1": 0, "b2": 1}
    stream.send(response_body_message(b"data: [DONE]\n\n", True))
    stream.recv()
    stream.close()
    deadline = time.monotonic() + 10
    while in_flight(fleet)["b2"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert in_flight(fleet) == {"b0": 0, "b1": 0, "b2": 0}
    samples = metric_samples(fleet.client.get("/metrics").text)
    assert samples[sample_key("kvgate_epp_served_elsewhere_total")] >= 1
    assert samples[sample_key("kvgate_requests_total", backend="b2", status="200")] >= 1


@pytest.mark.parametrize(
    ("body", "status", "reason", "param"),
    [
        (b"", 400, "missing_body", "body"),
        (b"{not json", 400, "bad_request", "body"),
        (b'["a list"]', 400, "bad_request", "body"),
        (json.dumps({"model": MODEL}).encode(), 400, "bad_request", "body.messages"),
        (json.dumps({"model": "no-such-model", "messages": []}).encode(), 404, "unknown_model", "model"),
    ],
    ids=["missing body", "bad json", "not an object", "no messages", "unknown model"],
)
def test_bad_requests_get_a_clear_immediate_response_in_vllm_shape(
    channel: grpc.Channel, body: bytes, status: int, reason: str, param: str
) -> None:
    stream = ExtProcStream(channel)
    picked = exchange(stream, "/v1/chat/completions", body)
    assert picked.status == status and picked.header is None
    assert picked.details == f"kvgate_epp_{reason}"
    error = json.loads(picked.body)["error"]
    assert error["code"] == status and error["param"] == param and error["message"]
    assert stream.recv() is None


@pytest.mark.parametrize("mode", BODY_MODES)
def test_a_body_just_over_the_limit_is_a_413_and_one_at_the_limit_is_picked(
    channel: grpc.Channel, mode: str
) -> None:
    base = json.dumps(chat_body("", "")).encode()
    pad = BODY_LIMIT - len(base)
    at_limit = json.dumps(chat_body("x" * pad, "")).encode()
    assert len(at_limit) == BODY_LIMIT
    stream = ExtProcStream(channel)
    picked = exchange(stream, "/v1/chat/completions", at_limit, mode=BODY_MODES[mode], chunk_size=1000)
    assert picked.status is None and picked.header
    finish(stream)
    over = json.dumps(chat_body("x" * (pad + 1), "")).encode()
    stream = ExtProcStream(channel)
    picked = exchange(stream, "/v1/chat/completions", over, mode=BODY_MODES[mode], chunk_size=1000)
    assert picked.status == 413 and picked.details == "kvgate_epp_body_too_large"
    assert str(BODY_LIMIT) in json.loads(picked.body)["error"]["message"]
    # Answered at the chunk that crossed the limit, nothing re-emitted, and the stream is over.
    assert picked.echoed == []
    assert stream.recv() is None


@pytest.mark.parametrize("mode", BODY_MODES)
@pytest.mark.parametrize("declared", [str(BODY_LIMIT + 1), "9" * 5000], ids=["one_over", "5000_digits"])
def test_a_declared_content_length_over_the_limit_is_a_413_on_the_headers(
    channel: grpc.Channel, mode: str, declared: str
) -> None:
    stream = ExtProcStream(channel)
    headers = [("content-length", declared)]
    stream.send(headers_message("/v1/chat/completions", extra=headers, body_mode=BODY_MODES[mode]))
    picked = Picked()
    picked.take(stream.recv())
    assert picked.kinds == ["immediate_response"]  # the headers' answer: no body was read
    assert picked.status == 413 and picked.details == "kvgate_epp_body_too_large"
    assert stream.recv() is None


def test_a_request_with_no_body_to_route_by_goes_by_load_on_its_headers(channel: grpc.Channel) -> None:
    stream = ExtProcStream(channel)
    stream.send(headers_message("/v1/models", method="GET", end_of_stream=True))
    response = stream.recv()
    assert response.WhichOneof("response") == "request_headers"
    (option,) = response.request_headers.response.header_mutation.set_headers
    assert option.header.key == "x-gateway-destination-endpoint"
    assert option.header.raw_value.startswith(b"127.0.0.1:")
    finish(stream)


def test_an_engine_marked_down_is_avoided(fleet: Fleet, channel: grpc.Channel) -> None:
    b1 = next(backend for backend in fleet.backends if backend.name == "b1")
    body = json.dumps(chat_body(DOCS["b1"], "Down?")).encode()
    b1.set_mode(health_status=503)
    try:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if not {b["name"]: b["healthy"] for b in fleet.client.get("/backends").json()["backends"]}["b1"]:
                break
            time.sleep(0.05)
        else:
            raise AssertionError("the health checker never marked b1 down")
        for _ in range(3):
            stream = ExtProcStream(channel)
            picked = exchange(stream, "/v1/chat/completions", body)
            assert picked.header in {endpoint(fleet, "b0"), endpoint(fleet, "b2")}
            finish(stream)
    finally:
        b1.reset()


@pytest.mark.parametrize("answer", ["json", "event_stream"])
def test_credit_the_answers_usage_says_the_engine_did_not_have_counts_as_stale_index(
    fleet: Fleet, channel: grpc.Channel, answer: str
) -> None:
    request_id = f"stale-{answer}"
    body = json.dumps(chat_body(DOCS["b1"], "Stale?")).encode()
    fleet.wait_for(lambda m: m["backends"]["b1"]["healthy"])  # after the test that marks it down
    before = metric_samples(fleet.client.get("/metrics").text)
    stream = ExtProcStream(channel)
    picked = exchange(stream, "/v1/chat/completions", body, extra=[("x-request-id", request_id)])
    assert picked.header == endpoint(fleet, "b1")
    credited = next(d for d in fleet.prefix_map()["decisions"] if d["request_id"] == request_id)[
        "cached_tokens"
    ]
    assert credited > 16
    # The engine reports 16 of the credited tokens cached (it lost the rest without a word).
    usage = {
        "prompt_tokens": credited + 8,
        "completion_tokens": 1,
        "prompt_tokens_details": {"cached_tokens": 16},
    }
    if answer == "json":
        stream.send(response_headers_message(200))
        chunks = [json.dumps({"choices": [], "usage": usage}).encode()]
    else:
        stream.send(response_headers_message(200, content_type="text/event-stream"))
        line = b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n"
        # The usage line split across two chunks, as Envoy may pass it on.
        chunks = [b'data: {"choices": [{"delta": {}}]}\n\n' + line[:20], line[20:] + b"data: [DONE]\n\n"]
    assert stream.recv().WhichOneof("response") == "response_headers"
    for index, chunk in enumerate(chunks):
        stream.send(response_body_message(chunk, index == len(chunks) - 1))
        assert stream.recv().WhichOneof("response") == "response_body"
    stream.close()
    key = sample_key("kvgate_missed_reuse_tokens_total", reason="stale_index")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        counted = metric_samples(fleet.client.get("/metrics").text)[key] - before[key]
        if counted:
            break
        time.sleep(0.05)
    assert counted == credited - 16

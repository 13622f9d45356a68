"""The Envoy configuration users are given (deploy/envoy/envoy-epp.yaml) and the harness that runs it
(kvgate_testing/envoy.py), with the real Envoy binary and no picker: Envoy accepts the file, the
harness runs that same file, and what Envoy does when the picker is missing is what docs/gateway.md
says ("Behind an Envoy gateway")."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from kvgate_testing.envoy import (
    DEPLOY_CONFIG,
    DESTINATION_HEADER,
    BodyMode,
    EnvoyProcess,
    ResponseBodyMode,
    envoy_alone_config,
    ext_proc_settings,
    load_deploy_config,
    picker_config,
    start_envoy_alone,
    start_envoy_with_picker,
    subset_hint_filter,
    validate_config,
)
from kvgate_testing.ports import free_port
from kvgate_testing.sim_fleet import MODEL, EngineFleet

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def fleet() -> Iterator[EngineFleet]:
    with EngineFleet(count=2, num_gpu_blocks=64) as engines:
        yield engines


def _requests_served(fleet: EngineFleet) -> list[float]:
    return [counters.requests for counters in fleet.counters()]


def _dead_picker() -> tuple[str, int]:
    """An address nothing listens on (a picker that is down)."""
    return ("127.0.0.1", free_port())


def test_envoy_accepts_the_deployed_config() -> None:
    output = validate_config(DEPLOY_CONFIG)
    assert "OK" in output


@pytest.mark.parametrize("body_mode", list(BodyMode))
def test_envoy_accepts_every_variant_the_harness_runs(body_mode: BodyMode, tmp_path: Path) -> None:
    variants = {
        "picker": picker_config(free_port(), free_port(), ("127.0.0.1", 9002), body_mode),
        "fail_open": picker_config(free_port(), free_port(), ("127.0.0.1", 9002), body_mode, True),
        "subset_hint": picker_config(
            free_port(),
            free_port(),
            ("127.0.0.1", 9002),
            body_mode,
            filters_before_picker=[subset_hint_filter("x-test-subset")],
        ),
        "alone": envoy_alone_config(free_port(), free_port(), ["http://127.0.0.1:8000"]),
    }
    for name, config in variants.items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config))
        validate_config(path)


def test_harness_runs_the_deployed_file_itself() -> None:
    """Given the file's own ports and body mode, the harness's config is the file, key for key: the
    tests exercise what the docs point users to, not a copy that could drift from it."""
    deployed = load_deploy_config()
    listener = deployed["static_resources"]["listeners"][0]
    picker = next(c for c in deployed["static_resources"]["clusters"] if c["name"] == "endpoint_picker")
    picker_address = picker["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
    generated = picker_config(
        listener["address"]["socket_address"]["port_value"],
        deployed["admin"]["address"]["socket_address"]["port_value"],
        (picker_address["socket_address"]["address"], picker_address["socket_address"]["port_value"]),
        BodyMode(ext_proc_settings(deployed)["processing_mode"]["request_body_mode"]),
        ext_proc_settings(deployed)["failure_mode_allow"],
        response_body_mode=ResponseBodyMode(
            ext_proc_settings(deployed)["processing_mode"]["response_body_mode"]
        ),
    )
    expected = copy.deepcopy(deployed)
    # The harness binds loopback only; everything else must be the file's.
    expected["static_resources"]["listeners"][0]["address"]["socket_address"]["address"] = "127.0.0.1"
    assert generated == expected


def test_deployed_config_buffers_the_request_learns_the_end_from_the_access_log_and_fails_closed() -> None:
    deployed = load_deploy_config()
    settings = ext_proc_settings(deployed)
    mode = settings["processing_mode"]
    assert settings["failure_mode_allow"] is False
    # One message for the body, answered with the pick; the headers pass at once.
    assert (mode["request_body_mode"], mode["request_trailer_mode"]) == ("BUFFERED", "SKIP")
    # The answer does not go through the picker at all...
    assert (mode["response_header_mode"], mode["response_body_mode"]) == ("SKIP", "NONE")
    assert mode["response_trailer_mode"] == "SKIP"
    # ...its end (status, engine served, time to first byte) comes in the access log, to the picker.
    manager = deployed["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    (logger,) = manager["access_log"]
    assert logger["name"] == "envoy.access_loggers.http_grpc"
    common = logger["typed_config"]["common_config"]
    assert common["grpc_service"]["envoy_grpc"]["cluster_name"] == "endpoint_picker"
    assert common["transport_api_version"] == "V3"
    assert "content-type" in logger["typed_config"]["additional_response_headers_to_log"]


def test_a_config_envoy_refuses_fails_start_with_its_log() -> None:
    config = picker_config(free_port(), free_port(), _dead_picker())
    config["static_resources"]["clusters"][0]["lb_policy"] = "NO_SUCH_POLICY"
    with pytest.raises(RuntimeError, match="NO_SUCH_POLICY"):
        EnvoyProcess(config).start(timeout_s=20)


def test_envoy_alone_balances_over_the_engines(fleet: EngineFleet) -> None:
    before = _requests_served(fleet)
    with start_envoy_alone([engine.url for engine in fleet.engines]) as envoy:
        for _ in range(24):
            response = httpx.post(f"{envoy.url}/v1/chat/completions", json=CHAT, timeout=30)
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["message"]["content"]
    served = [after - earlier for after, earlier in zip(_requests_served(fleet), before, strict=True)]
    assert sum(served) == 24
    # One request at a time: LEAST_REQUEST sees equal loads and picks at random between the two.
    assert all(count > 0 for count in served), served


@pytest.mark.parametrize("body_mode", list(BodyMode))
def test_a_dead_picker_fails_requests_closed(fleet: EngineFleet, body_mode: BodyMode) -> None:
    before = _requests_served(fleet)
    engine = fleet.engines[0].url.removeprefix("http://")
    with start_envoy_with_picker(_dead_picker(), body_mode) as envoy:
        for headers in ({}, {DESTINATION_HEADER: engine}):
            response = httpx.post(f"{envoy.url}/v1/chat/completions", json=CHAT, headers=headers, timeout=30)
            assert response.status_code == 500
        assert httpx.get(f"{envoy.admin_url}/ready", timeout=10).status_code == 200  # Envoy itself is fine
        assert (
            envoy.stats("http.inference.ext_proc.streams_failed")["http.inference.ext_proc.streams_failed"]
            == 2
        )
    assert _requests_served(fleet) == before


def test_fail_open_buffered_never_lets_the_client_choose_the_engine(fleet: EngineFleet) -> None:
    """failure_mode_allow true, BUFFERED, picker down: Envoy skips the picker. The destination header
    the client sent was dropped before the picker (the file's header_mutation filter), so ORIGINAL_DST
    has no address: 503 `no healthy upstream`, and the engine the client named is never reached."""
    before = _requests_served(fleet)
    engine = fleet.engines[0].url.removeprefix("http://")
    with start_envoy_with_picker(_dead_picker(), BodyMode.BUFFERED, failure_mode_allow=True) as envoy:
        response = httpx.post(
            f"{envoy.url}/v1/chat/completions", json=CHAT, headers={DESTINATION_HEADER: engine}, timeout=30
        )
        assert response.status_code == 503
        assert "no healthy upstream" in response.text
        stats = envoy.stats("http.inference.ext_proc")
        assert stats["http.inference.ext_proc.failure_mode_allowed"] == 1
    assert _requests_served(fleet) == before


def test_fail_open_in_full_duplex_streaming_still_reaches_no_engine(fleet: EngineFleet) -> None:
    """In FULL_DUPLEX_STREAMED mode, Envoy fails open only when the picker's failure shows before the
    body has started streaming to it (then 503 as in BUFFERED), else closed (500): which one depends on
    timing. Either way the client gets a 5xx and no engine is reached."""
    before = _requests_served(fleet)
    engine = fleet.engines[0].url.removeprefix("http://")
    picker = _dead_picker()
    with start_envoy_with_picker(picker, BodyMode.FULL_DUPLEX_STREAMED, failure_mode_allow=True) as envoy:
        for _ in range(4):
            response = httpx.post(
                f"{envoy.url}/v1/chat/completions",
                json=CHAT,
                headers={DESTINATION_HEADER: engine},
                timeout=30,
            )
            assert response.status_code in (500, 503)
    assert _requests_served(fleet) == before


def _header_from(source: str) -> dict:
    """A Lua filter standing in for the picker's header mutation: it copies request header `source`
    into the destination header (placed after the ext_proc filter, so the client-header drop and a
    fail-open picker leave it alone)."""
    lua = (
        f'function envoy_on_request(handle) local value = handle:headers():get("{source}") '
        f'if value then handle:headers():replace("{DESTINATION_HEADER}", value) end end'
    )
    return {
        "name": "envoy.filters.http.lua",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua",
            "default_source_code": {"inline_string": lua},
        },
    }


def test_original_dst_goes_where_the_header_says_and_fails_as_documented(fleet: EngineFleet) -> None:
    config = picker_config(
        free_port(), free_port(), _dead_picker(), BodyMode.BUFFERED, failure_mode_allow=True
    )
    filters = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    filters["http_filters"].insert(len(filters["http_filters"]) - 1, _header_from("x-test-destination"))
    engine = fleet.engines[1].url.removeprefix("http://")
    before = _requests_served(fleet)
    with EnvoyProcess(config).start() as envoy:

        def send(destination: str) -> httpx.Response:
            return httpx.post(
                f"{envoy.url}/v1/chat/completions",
                json=CHAT,
                headers={"x-test-destination": destination},
                timeout=30,
            )

        assert send(engine).status_code == 200
        unreachable = send(f"127.0.0.1:{free_port()}")
        assert unreachable.status_code == 503
        assert "remote connection failure" in unreachable.text  # UF
        for not_one_address in ("not-an-address", f"{engine},{fleet.engines[0].url.removeprefix('http://')}"):
            refused = send(not_one_address)
            assert refused.status_code == 503
            assert "no healthy upstream" in refused.text  # UH: the header takes one ip:port, no list
    served = [after - earlier for after, earlier in zip(_requests_served(fleet), before, strict=True)]
    assert served == [0, 1]

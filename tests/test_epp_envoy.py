"""kvgate as Envoy's endpoint picker, end to end with real processes on loopback: the real Envoy
(deploy/envoy/envoy-epp.yaml, kvgate_testing/envoy.py), the real `kvgate epp`, and simulated engines
publishing KV events. Every request goes client -> Envoy -> engine, the engine chosen by the picker."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from kvgate_testing.envoy import (
    BodyMode,
    ResponseBodyMode,
    ext_proc_settings,
    load_deploy_config,
    subset_hint_filter,
)
from kvgate_testing.picker import EnvoyWithPicker, start_envoy_and_picker
from kvgate_testing.routers import kvgate_backends, start_envoy_and_picker_with_modes
from kvgate_testing.sim_fleet import MODEL, EngineFleet
from kvgate_testing.waiting import wait_for

# Each test starts engines, a picker and Envoy (tens of seconds on a shared 2-core machine).
pytestmark = pytest.mark.slow

SUBSET_HEADER = "x-test-subset-hint"
# A prompt of a few hundred tokens: many KV blocks, so the engine that holds it clearly wins.
LONG_PROMPT = " ".join(f"word{i} of the shared document about envoy routing" for i in range(80))


def picker_config(fleet: EngineFleet, **epp: object) -> dict:
    return {
        "models": [{"name": MODEL, "tokenizer": "builtin:qwen3"}],
        "backends": kvgate_backends(fleet, "kv_aware"),
        "policy": {"name": "kv_aware"},
        "health": {"interval_s": 0.5, "min_down_s": 0.5},
        "log_level": "warning",
        "epp": dict(epp),
    }


def chat(content: str, max_tokens: int = 4, stream: bool = False) -> dict:
    body: dict = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
    }
    if stream:
        body["stream"] = True
    return body


def served_by(fleet: EngineFleet) -> list[float]:
    return [counters.requests for counters in fleet.counters()]


def delta(after: list[float], before: list[float]) -> list[int]:
    return [round(a - b) for a, b in zip(after, before, strict=True)]


def endpoint(fleet: EngineFleet, index: int) -> str:
    return fleet.engines[index].url.removeprefix("http://")


@pytest.fixture(scope="module")
def fleet() -> Iterator[EngineFleet]:
    with EngineFleet(count=3, num_gpu_blocks=256, sim_args=["--prefill-us-per-token", "20"]) as engines:
        yield engines


@pytest.fixture(scope="module", params=list(BodyMode), ids=lambda mode: mode.value.lower())
def gateway(request: pytest.FixtureRequest, fleet: EngineFleet) -> Iterator[EnvoyWithPicker]:
    with start_envoy_and_picker(
        picker_config(fleet), request.param, filters_before_picker=[subset_hint_filter(SUBSET_HEADER)]
    ) as pair:
        yield pair


def post(
    pair: EnvoyWithPicker, body: dict, headers: dict | None = None, timeout: float = 30
) -> httpx.Response:
    return httpx.post(f"{pair.url}/v1/chat/completions", json=body, headers=headers, timeout=timeout)


def test_a_repeated_long_prompt_lands_on_the_engine_that_holds_it(
    gateway: EnvoyWithPicker, fleet: EngineFleet
) -> None:
    fleet.reset_caches()
    prompt = f"{LONG_PROMPT} ({gateway.envoy.url})"  # a prompt no other test sends
    before = served_by(fleet)
    first = post(gateway, chat(prompt))
    assert first.status_code == 200, first.text
    holder = delta(served_by(fleet), before).index(1)
    cached = []
    for _ in range(4):
        time.sleep(0.3)  # the engine's KV events reach the picker's index
        response = post(gateway, chat(prompt))
        assert response.status_code == 200, response.text
        cached.append(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    counts = delta(served_by(fleet), before)
    assert counts[holder] == 5, counts
    assert all(tokens > 0 for tokens in cached), cached


def test_streaming_passes_through_intact(gateway: EnvoyWithPicker, fleet: EngineFleet) -> None:
    body = chat("tell me a story about a gateway", max_tokens=24, stream=True)
    direct = httpx.post(f"{fleet.engines[0].url}/v1/chat/completions", json=body, timeout=30)

    def contents(text: str) -> tuple[str, int, str]:
        events = [line.removeprefix("data: ") for line in text.splitlines() if line.startswith("data: ")]
        pieces = [
            json.loads(event)["choices"][0]["delta"].get("content") or ""
            for event in events[:-1]
            if json.loads(event)["choices"]
        ]
        return "".join(pieces), len(events), events[-1]

    with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        text = "".join(response.iter_text())
    through, events, last = contents(text)
    expected, expected_events, _ = contents(direct.text)
    assert last == "[DONE]"
    assert events == expected_events > 3
    assert through == expected


def test_the_subset_hint_is_obeyed(gateway: EnvoyWithPicker, fleet: EngineFleet) -> None:
    before = served_by(fleet)
    for number in range(8):
        response = post(
            gateway, chat(f"subset request {number}"), headers={SUBSET_HEADER: endpoint(fleet, 2)}
        )
        assert response.status_code == 200, response.text
    assert delta(served_by(fleet), before) == [0, 0, 8]


def test_a_subset_hint_naming_no_known_engine_gets_503(gateway: EnvoyWithPicker, fleet: EngineFleet) -> None:
    before = served_by(fleet)
    response = post(gateway, chat("nowhere to go"), headers={SUBSET_HEADER: "127.0.0.1:1"})
    assert response.status_code == 503, response.text
    assert served_by(fleet) == before


@pytest.mark.parametrize("body_mode", list(BodyMode), ids=lambda mode: mode.value.lower())
def test_a_body_just_under_the_limit_passes_and_just_over_gets_413(
    body_mode: BodyMode, fleet: EngineFleet
) -> None:
    limit = 16384
    # BUFFERED: Envoy's own buffer limit refuses first; streamed: the picker's. Each side's limit is the
    # same number, so both modes refuse the same bodies.
    with start_envoy_and_picker(
        picker_config(fleet, max_body_bytes=limit), body_mode, buffer_limit_bytes=limit
    ) as pair:

        def body_of(size: int) -> bytes:
            # Padded in `user`, which no one tokenizes: the prompt stays short whatever the size.
            empty = json.dumps({**chat("a short prompt"), "user": ""}).encode()
            padded = json.dumps({**chat("a short prompt"), "user": "u" * (size - len(empty))}).encode()
            assert len(padded) == size
            return padded

        under = httpx.post(f"{pair.url}/v1/chat/completions", content=body_of(limit - 16),
                           headers={"content-type": "application/json"}, timeout=30)  # fmt: skip
        assert under.status_code == 200, under.text
        over = httpx.post(f"{pair.url}/v1/chat/completions", content=body_of(limit + 1),
                          headers={"content-type": "application/json"}, timeout=30)  # fmt: skip
        assert over.status_code == 413, over.text
        # Far over Envoy's buffer too: STREAMED holds the body there, and with the picker's limit at
        # or under that buffer (docs/gateway.md, "Body modes") the picker refuses it at once rather
        # than Envoy stalling it until message_timeout (then 504).
        started = time.monotonic()
        far_over = httpx.post(f"{pair.url}/v1/chat/completions", content=body_of(8 * limit),
                              headers={"content-type": "application/json"}, timeout=30)  # fmt: skip
        assert far_over.status_code == 413, far_over.text
        assert time.monotonic() - started < 3


@pytest.fixture
def own_fleet() -> Iterator[EngineFleet]:
    """Engines a test may stop or slow down, without disturbing the module's."""
    with EngineFleet(count=2, num_gpu_blocks=128, sim_args=["--decode-ms-per-token", "20"]) as engines:
        yield engines


def test_an_engine_marked_down_is_avoided_and_none_left_gives_503(own_fleet: EngineFleet) -> None:
    with start_envoy_and_picker(picker_config(own_fleet)) as pair:
        own_fleet.stop_engine(0)
        wait_for(lambda: not pair.picker.backends()["engine-0"]["healthy"], 15, "engine-0 marked down")
        for number in range(6):
            response = post(pair, chat(f"after the fall {number}"))
            assert response.status_code == 200, response.text
        own_fleet.stop_engine(1)
        wait_for(lambda: not pair.picker.backends()["engine-1"]["healthy"], 15, "engine-1 marked down")
        response = post(pair, chat("no engine left"))
        assert response.status_code == 503, response.text


def _hold_stream(
    url: str, body: dict, started: threading.Event, release: threading.Event, abort: bool, results: list
) -> None:
    """Stream `body` through `url`; once the first chunk came, wait for `release`, then either walk away
    (`abort`: the client closes mid-stream) or read the answer to its end."""
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as response:
            chunks = response.iter_raw()
            next(chunks, None)
            started.set()
            release.wait(60)
            if not abort:
                for _ in chunks:
                    pass
            results.append(response.status_code)
    except httpx.HTTPError as exc:
        results.append(repr(exc))
    finally:
        started.set()


def _hold_streams(url: str, count: int, body: dict, aborts: int) -> tuple[threading.Event, list, list]:
    """`count` streams held open after their first chunk (the first `aborts` to be abandoned once
    released): returns the release event, the threads and their results."""
    release = threading.Event()
    started = [threading.Event() for _ in range(count)]
    results: list = []
    threads = [
        threading.Thread(target=_hold_stream, args=(url, body, event, release, number < aborts, results))
        for number, event in enumerate(started)
    ]
    for thread in threads:
        thread.start()
    for event in started:
        assert event.wait(30)
    return release, threads, results


# How the picker learns the answer's end: the response body through ext_proc (its last chunk), or,
# with the body not sent, Envoy's gRPC access log: with the response headers sent, or with
# deploy/envoy/envoy-epp.yaml's own modes (headers skipped too: the log entry brings the status and
# the served endpoint; the request body BUFFERED).
ANSWER_END_MODES = {
    "response_body": None,
    "access_log_with_response_headers": {
        "response_header_mode": "SEND",
        "response_body_mode": "NONE",
        "response_trailer_mode": "SKIP",
    },
    "access_log_deployed": {
        str(key): str(value)
        for key, value in ext_proc_settings(load_deploy_config())["processing_mode"].items()
    },
}


@contextlib.contextmanager
def envoy_and_picker(config: dict, answer_end: str) -> Iterator[EnvoyWithPicker]:
    modes = ANSWER_END_MODES[answer_end]
    if modes is None:
        with start_envoy_and_picker(config) as pair:
            yield pair
        return
    response_body_mode = ResponseBodyMode(modes["response_body_mode"])
    # No warm-up: Envoy opens its access-log stream with its first entry, and the picker's picks
    # wait for theirs before it has (epp.envoy_access_log, tests/test_epp_access_log.py).
    with start_envoy_and_picker_with_modes(config, response_body_mode, modes, 60.0) as pair:
        yield pair


@pytest.mark.parametrize("answer_end", ANSWER_END_MODES)
def test_load_shedding_gets_429_and_in_flight_load_returns_to_zero(
    own_fleet: EngineFleet, answer_end: str
) -> None:
    with envoy_and_picker(picker_config(own_fleet, max_in_flight=4), answer_end) as pair:
        long_answer = chat("a long answer please", max_tokens=100, stream=True)  # 2 s of decoding
        release, threads, results = _hold_streams(pair.url, 4, long_answer, aborts=2)
        # Four picked requests still run: the fifth is shed.
        shed = post(pair, chat("one too many"))
        assert shed.status_code == 429, shed.text
        release.set()  # two clients walk away mid-stream, two read to the end
        for thread in threads:
            thread.join(60)
        assert results == [200] * 4, results

        # A burst of short ones, some of them aborted by their clients before any answer.
        def short(number: int) -> None:
            with contextlib.suppress(httpx.TimeoutException):
                httpx.post(
                    f"{pair.url}/v1/chat/completions",
                    json=chat(f"burst {number}", max_tokens=30),
                    timeout=0.05 if number % 3 == 0 else 30,
                )

        burst = [threading.Thread(target=short, args=(number,)) for number in range(12)]
        for thread in burst:
            thread.start()
        for thread in burst:
            thread.join(60)
        wait_for(
            lambda: all(entry["in_flight"] == 0 for entry in pair.picker.backends().values()),
            30,
            "every engine's in-flight load back to zero",
        )
        assert post(pair, chat("served again")).status_code == 200
        if answer_end != "response_body":
            # The held streams' loads were closed by their log entries, at their real end.
            assert pair.picker.finished().get("access_log", 0) >= 4, pair.picker.finished()


def test_a_killed_picker_fails_requests_and_a_restarted_one_serves_again(own_fleet: EngineFleet) -> None:
    with start_envoy_and_picker(picker_config(own_fleet)) as pair:
        assert post(pair, chat("before the crash")).status_code == 200
        long_answer = chat("keep streaming", max_tokens=150, stream=True)
        release, threads, results = _hold_streams(pair.url, 3, long_answer, aborts=0)
        pair.picker.kill()
        release.set()
        # Envoy answers for the dead picker (500), and is itself unharmed.
        for _ in range(3):
            assert post(pair, chat("while it is down")).status_code == 500
        for thread in threads:
            thread.join(60)
            assert not thread.is_alive()  # no open stream hangs on the dead picker
        assert len(results) == 3, results
        assert httpx.get(f"{pair.envoy.admin_url}/ready", timeout=10).status_code == 200
        pair.picker.start()  # the same ports and config
        wait_for(
            lambda: post(pair, chat("after the restart")).status_code == 200, 30, "a restarted picker serving"
        )

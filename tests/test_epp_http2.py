"""HTTP/2 clients through Envoy with `kvgate epp` as its picker, end to end (real Envoy, real picker,
simulated engines publishing KV events). Envoy speaks HTTP/2 to clients that ask for it (cleartext,
with prior knowledge, as gRPC-style and many SDK clients do) and HTTP/1.1 to the engines; the picker
sees the same ext_proc messages either way. The clients are real ones, Debian's: curl (built with
nghttp2) for single streams and their answers, nghttp for many streams on one connection."""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvgate_testing.envoy import BodyMode, ResponseBodyMode
from kvgate_testing.picker import EnvoyWithPicker, start_envoy_and_picker
from kvgate_testing.routers import kvgate_backends
from kvgate_testing.sim_fleet import MODEL, EngineFleet
from kvgate_testing.waiting import wait_for

# curl and nghttp come with the test command's system packages (scripts/install_system_packages.sh).
pytestmark = pytest.mark.slow

# A prompt of a few hundred tokens: many KV blocks, so the engine that holds it clearly wins.
LONG_PROMPT = " ".join(f"part {i} of the document that http2 clients share" for i in range(80))


def chat(content: str, max_tokens: int = 4, stream: bool = False) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream": stream,
    }


@pytest.fixture(scope="module")
def fleet() -> Iterator[EngineFleet]:
    with EngineFleet(count=3, num_gpu_blocks=256, sim_args=["--prefill-us-per-token", "20"]) as engines:
        yield engines


# (request body mode, response body mode, how a pick's load closes at the answer's end): the
# deployed file's answer is not sent through the picker, its end comes with Envoy's access-log
# entry; the usage variant sends the answer through the picker, which sees it end.
MODES = [(body, ResponseBodyMode.NONE, "access_log") for body in BodyMode] + [
    (body, ResponseBodyMode.FULL_DUPLEX_STREAMED, "response_end") for body in BodyMode
]


@pytest.fixture(
    scope="module", params=MODES, ids=lambda mode: f"{mode[0].value.lower()}-answer_{mode[1].value.lower()}"
)
def gateway(request: pytest.FixtureRequest, fleet: EngineFleet) -> Iterator[EnvoyWithPicker]:
    body_mode, response_body_mode, closed_how = request.param
    config = {
        "models": [{"name": MODEL, "tokenizer": "builtin:qwen3"}],
        "backends": kvgate_backends(fleet, "kv_aware"),
        "policy": {"name": "kv_aware"},
        "log_level": "warning",
    }
    with start_envoy_and_picker(config, body_mode, response_body_mode=response_body_mode) as pair:
        pair.closed_how = closed_how  # type: ignore[attr-defined]
        yield pair


def http2_posts(url: str, bodies: list[dict], folder: Path, max_time_s: float = 30) -> list[dict]:
    """POST every body at once over HTTP/2 with prior knowledge (curl --parallel: one connection
    per request, as curl 7.88 multiplexes no uploads; multiplexed_posts below for streams of one
    connection); per request its status, the HTTP version curl spoke, and the answer's text."""
    command = [
        "curl",
        "--silent",
        "--show-error",
        "--parallel",
        "--parallel-immediate",
        "--parallel-max",
        "50",
    ]
    for number, body in enumerate(bodies):
        body_file = folder / f"body{number}.json"
        body_file.write_text(json.dumps(body))
        if number:
            command.append("--next")
        command += [
            "--http2-prior-knowledge", "--max-time", str(max_time_s),
            "--header", "content-type: application/json", "--data-binary", f"@{body_file}",
            "--output", str(folder / f"answer{number}"),
            "--write-out", f"{number} %{{http_code}} %{{http_version}}\\n",
            f"{url}/v1/chat/completions",
        ]  # fmt: skip
    finished = subprocess.run(command, capture_output=True, text=True, timeout=max_time_s + 30)
    results: dict[int, dict] = {}
    for line in finished.stdout.splitlines():
        number, status, version = line.split()
        answer = folder / f"answer{number}"
        results[int(number)] = {
            "status": int(status),
            "version": version,
            "text": answer.read_text() if answer.exists() else "",
        }
    assert sorted(results) == list(range(len(bodies))), (finished.stdout, finished.stderr)
    return [results[number] for number in range(len(bodies))]


def envoy_counter(pair: EnvoyWithPicker, name: str) -> int:
    """One of Envoy's counters, from its admin API."""
    text = httpx.get(f"{pair.envoy.admin_url}/stats", params={"filter": f"^{name}$"}, timeout=10).text
    values = [int(line.split(": ")[1]) for line in text.splitlines() if line.startswith(f"{name}: ")]
    assert len(values) == 1, text
    return values[0]


def served_by(fleet: EngineFleet) -> list[int]:
    return [round(counters.requests) for counters in fleet.counters()]


def closed_since(pair: EnvoyWithPicker, before: dict[str, float]) -> dict[str, float]:
    after = pair.picker.finished()
    return {how: after[how] - before.get(how, 0) for how in after if after[how] != before.get(how, 0)}


def loads_back_to_zero(pair: EnvoyWithPicker) -> None:
    wait_for(
        lambda: all(entry["in_flight"] == 0 for entry in pair.picker.backends().values()),
        30,
        "every engine's in-flight load back to zero",
    )


def test_an_http2_client_gets_a_repeated_prompt_from_the_engine_that_holds_it(
    gateway: EnvoyWithPicker, fleet: EngineFleet, tmp_path: Path
) -> None:
    prompt = f"{LONG_PROMPT} ({gateway.envoy.url})"  # a prompt no other test sends
    before = served_by(fleet)
    (first,) = http2_posts(gateway.url, [chat(prompt)], tmp_path)
    assert (first["status"], first["version"]) == (200, "2"), first
    holder = [a - b for a, b in zip(served_by(fleet), before, strict=True)].index(1)
    cached = []
    for _ in range(3):
        time.sleep(0.3)  # the engine's KV events reach the picker's index
        (again,) = http2_posts(gateway.url, [chat(prompt)], tmp_path)
        assert (again["status"], again["version"]) == (200, "2"), again
        cached.append(json.loads(again["text"])["usage"]["prompt_tokens_details"]["cached_tokens"])
    counts = [a - b for a, b in zip(served_by(fleet), before, strict=True)]
    assert counts[holder] == 4, counts
    assert all(tokens > 0 for tokens in cached), cached


def multiplexed_posts(url: str, body: dict, streams: int, folder: Path) -> dict[int, int]:
    """POST `body` `streams` times at once as streams of one HTTP/2 connection (nghttp, the nghttp2
    project's client: curl 7.88 fails multiplexed uploads with "Error in the HTTP2 framing layer");
    the status each stream got, by stream id."""
    body_file = folder / "multiplexed.json"
    body_file.write_text(json.dumps(body))
    command = [
        "nghttp", "--null-out", "--verbose", "--timeout=30", f"--multiply={streams}",
        f"--data={body_file}", "--header=content-type: application/json", f"{url}/v1/chat/completions",
    ]  # fmt: skip
    finished = subprocess.run(command, capture_output=True, text=True, timeout=60)
    statuses = {
        int(match[1]): int(match[2])
        for match in re.finditer(r"recv \(stream_id=(\d+)\) :status: (\d+)", finished.stdout)
    }
    assert len(statuses) == streams, (finished.returncode, finished.stdout[-3000:], finished.stderr)
    return statuses


def test_multiplexed_http2_streams_are_each_picked_answered_and_released(
    gateway: EnvoyWithPicker, fleet: EngineFleet, tmp_path: Path
) -> None:
    body = chat("tell me a story about multiplexing", max_tokens=16, stream=True)
    before, finished_before = served_by(fleet), gateway.picker.finished()
    connections = envoy_counter(gateway, "http.inference.downstream_cx_http2_total")
    requests = envoy_counter(gateway, "http.inference.downstream_rq_http2_total")
    statuses = multiplexed_posts(gateway.url, body, 12, tmp_path)
    assert sorted(statuses.values()) == [200] * 12, statuses
    # Twelve streams of one HTTP/2 connection, each picked and served by an engine.
    assert envoy_counter(gateway, "http.inference.downstream_cx_http2_total") - connections == 1
    assert envoy_counter(gateway, "http.inference.downstream_rq_http2_total") - requests == 12
    assert sum(served_by(fleet)) - sum(before) == 12
    loads_back_to_zero(gateway)
    # Each stream's load closed at its own end (with the deployed file, by its log entry, keyed by
    # its x-request-id), not by a timeout.
    assert closed_since(gateway, finished_before) == {gateway.closed_how: 12}  # type: ignore[attr-defined]


def test_an_http2_stream_is_answered_intact(
    gateway: EnvoyWithPicker, fleet: EngineFleet, tmp_path: Path
) -> None:
    body = chat("tell me a story about http2", max_tokens=16, stream=True)
    direct = httpx.post(f"{fleet.engines[0].url}/v1/chat/completions", json=body, timeout=30)

    def contents(text: str) -> list[str]:
        events = [line.removeprefix("data: ") for line in text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        return [json.loads(event)["choices"][0]["delta"].get("content") or "" for event in events[:-1]]

    (answer,) = http2_posts(gateway.url, [body], tmp_path)
    assert (answer["status"], answer["version"]) == (200, "2"), answer
    assert contents(answer["text"]) == contents(direct.text)
    assert len(contents(direct.text)) > 3


def test_an_http2_stream_its_client_abandons_releases_its_load(
    gateway: EnvoyWithPicker, fleet: EngineFleet, tmp_path: Path
) -> None:
    long_answer = chat("a long answer over http2, please", max_tokens=400, stream=True)
    started, finished_before = time.monotonic(), gateway.picker.finished()
    # curl gives up after 1 s, mid-answer: Envoy resets the stream to the engine, and the
    # request's access-log entry closes its load on the picker.
    answers = http2_posts(gateway.url, [long_answer, long_answer], tmp_path, max_time_s=1.0)
    assert time.monotonic() - started < 20
    assert all(answer["text"].startswith("data: ") for answer in answers), answers
    assert not any("[DONE]" in answer["text"] for answer in answers), answers
    loads_back_to_zero(gateway)
    # In every mode by the log entry: a stream that ended before its answer waits for it
    # (epp.envoy_access_log), which tells the real end.
    assert closed_since(gateway, finished_before) == {"access_log": 2}
    (after,) = http2_posts(gateway.url, [chat("served again over http2")], tmp_path)
    assert after["status"] == 200

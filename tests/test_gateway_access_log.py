"""The access log (`access_log:`, router/access_log.py) of a real gateway process in front of real
test backends (kvgate_testing/openai_backend.py): off by default; on, one JSON line per request with
its backend, the policy's reason, token counts, status, TTFT and total time, written when the
request ends, streamed or not, aborted by the client or answered by the gateway; to a file that
survives rotation, or to stderr."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from kvgate_testing.backend import BackendProcess, running_backends
from kvgate_testing.gateway import GatewayProcess, start_gateway
from kvgate_testing.ports import free_port
from router.access_log import FIELDS
from router.config import ConfigError, parse_config

MODEL = "test-model"
SYSTEM = "You are the archivist of a lighthouse museum; answer in one sentence. " * 8
MAX_BODY_BYTES = 64 * 1024


def _config(backends: list[BackendProcess], access_log: dict | None, tokenizer: bool = False) -> dict:
    """`tokenizer`: the real Qwen3 one, for token counts (it adds seconds to the gateway's start)."""
    config = {
        "models": [{"name": MODEL, "tokenizer": "builtin:qwen3"} if tokenizer else {"name": MODEL}],
        # kv_aware: its decisions carry a reason and token counts. Nobody publishes on these
        # endpoints: every prompt is a cold one, which is all the log needs.
        "backends": [
            {"name": b.name, "url": b.url, "kv_events": {"endpoint": f"tcp://127.0.0.1:{free_port()}"}}
            for b in backends
        ],
        "policy": {"name": "kv_aware"},
        "limits": {"max_body_bytes": MAX_BODY_BYTES},
    }
    if access_log is not None:
        config["access_log"] = access_log
    return config


def _chat(question: str, **extra: object) -> dict:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return {"model": MODEL, "messages": messages, "max_tokens": 4, **extra}


def _lines(read: Callable[[], str], count: int, timeout_s: float = 15.0) -> list[dict]:
    """The access log's lines once `count` have been written (the writer thread is asynchronous)."""
    deadline = time.monotonic() + timeout_s
    while True:
        lines = [json.loads(line) for line in read().splitlines() if line.startswith('{"ts"')]
        if len(lines) >= count or time.monotonic() > deadline:
            return lines
        time.sleep(0.05)


def _by_id(lines: list[dict]) -> dict[str, dict]:
    by_id = {line["request_id"]: line for line in lines}
    assert len(by_id) == len(lines), "one line per request"
    return by_id


@pytest.fixture(scope="module")
def backends() -> Iterator[list[BackendProcess]]:
    with running_backends("b0", "b1", models=[MODEL]) as started:
        yield started


@pytest.fixture(scope="module")
def logged(backends, tmp_path_factory) -> Iterator[tuple[GatewayProcess, Path]]:
    path = tmp_path_factory.mktemp("access") / "access.log"
    with start_gateway(_config(backends, {"enabled": True, "path": str(path)}, tokenizer=True)) as gateway:
        yield gateway, path


def _read(path: Path) -> Callable[[], str]:
    return lambda: path.read_text() if path.exists() else ""


def test_each_request_is_one_json_line_with_its_fields(logged):
    gateway, path = logged
    before = len(_lines(_read(path), 0))
    with httpx.Client(base_url=gateway.url, timeout=30) as client:
        whole = client.post(
            "/v1/chat/completions", json=_chat("Who lit it?"), headers={"x-request-id": "r-whole"}
        )
        refused = client.post("/v1/chat/completions", json={**_chat("?"), "model": "nope"},
                              headers={"x-request-id": "r-unknown-model"})  # fmt: skip
        passed = client.post("/v1/chat/completions", json=_chat("Error?"),
                             headers={"x-request-id": "r-400", "x-test-status": "400"})  # fmt: skip
        too_big = client.post("/v1/chat/completions", content=b"x" * (MAX_BODY_BYTES + 1),
                              headers={"x-request-id": "r-413", "content-type": "text/plain"})  # fmt: skip
    assert (whole.status_code, refused.status_code, passed.status_code, too_big.status_code) == (
        200,
        404,
        400,
        413,
    )
    lines = _by_id(_lines(_read(path), before + 4)[before:])
    for line in lines.values():
        assert list(line) == list(FIELDS)
        assert line["path"] == "/v1/chat/completions" and line["total_ms"] > 0
        assert line["ts"].endswith("Z") and line["stream"] is False and line["ttft_ms"] is None

    ok = lines["r-whole"]
    assert ok["backend"] == whole.headers["x-kvgate-backend"] and ok["model"] == MODEL
    assert ok["status"] == 200 and ok["outcome"] == "ok" and ok["error"] is None
    assert ok["policy"] == "kv_aware" and ok["reason"] in ("cold_spread", "least_load")
    assert ok["prompt_tokens"] > 100 and ok["cached_tokens"] == 0  # a cold prompt: nothing cached

    unknown = lines["r-unknown-model"]
    assert unknown["status"] == 404 and unknown["outcome"] == "gateway_error"
    assert unknown["backend"] is None and "`nope` does not exist" in unknown["error"]

    backend_error = lines["r-400"]  # the backend's own error status, passed through
    assert backend_error["status"] == 400 and backend_error["outcome"] == "ok"
    assert backend_error["backend"] == passed.headers["x-kvgate-backend"]

    over = lines["r-413"]  # refused before its body was read
    assert over["status"] == 413 and over["outcome"] == "gateway_error" and over["model"] is None


def test_a_streamed_request_logs_its_ttft_apart_from_its_total_time(logged):
    gateway, path = logged
    before = len(_lines(_read(path), 0))
    # The backend waits 150 ms before its first chunk, then 100 ms between the next four.
    headers = {"x-request-id": "r-stream", "x-test-delay-ms": "150", "x-test-chunks": "5",
               "x-test-chunk-delay-ms": "100"}  # fmt: skip
    with httpx.Client(base_url=gateway.url, timeout=30) as client:
        response = client.post("/v1/chat/completions", json=_chat("Stream it", stream=True), headers=headers)
    assert response.status_code == 200 and response.text.count("data: ") == 6
    (line,) = _lines(_read(path), before + 1)[before:]
    assert line["request_id"] == "r-stream" and line["stream"] is True
    assert line["status"] == 200 and line["outcome"] == "ok"
    # Lower bounds only (the sleeps are at least that long, however slow the machine): the first
    # token came after the 150 ms wait, the whole answer after 150 + 4 x 100 ms. Their difference is
    # no bound: on a loaded machine the first chunk can reach the gateway late, shrinking the gap.
    assert line["ttft_ms"] >= 150
    assert line["total_ms"] >= 550
    assert line["ttft_ms"] < line["total_ms"]  # the first token's time, not the whole answer's


def test_client_aborts_are_logged_with_their_status(logged):
    gateway, path = logged
    before = len(_lines(_read(path), 0))
    slow_stream = {"x-request-id": "r-left-mid-stream", "x-test-chunks": "50", "x-test-chunk-delay-ms": "200"}
    with httpx.Client(base_url=gateway.url, timeout=30) as client:
        with client.stream(
            "POST", "/v1/chat/completions", json=_chat("Go", stream=True), headers=slow_stream
        ) as r:
            assert r.status_code == 200
            next(r.iter_lines())  # the first token arrives; then the client hangs up
        with pytest.raises(httpx.ReadTimeout):  # the client gives up before any answer
            client.post("/v1/chat/completions", json=_chat("Wait"), timeout=0.5,
                        headers={"x-request-id": "r-left-early", "x-test-delay-ms": "5000"})  # fmt: skip
    lines = _by_id(_lines(_read(path), before + 2)[before:])
    mid = lines["r-left-mid-stream"]
    assert mid["outcome"] == "client_gone" and mid["status"] == 200 and mid["stream"] is True
    assert mid["ttft_ms"] is not None and mid["backend"] in ("b0", "b1")
    early = lines["r-left-early"]
    assert early["outcome"] == "client_gone" and early["status"] == 499  # nothing had been sent
    assert early["ttft_ms"] is None


def test_a_rotated_file_is_reopened(logged):
    gateway, path = logged
    rotated = path.with_name("access.log.1")
    path.rename(rotated)  # what logrotate does before it signals nobody
    deadline = time.monotonic() + 20
    with httpx.Client(base_url=gateway.url, timeout=30) as client:
        for n in range(400):  # the writer checks the path at most once a second
            client.post(
                "/v1/chat/completions", json=_chat("After"), headers={"x-request-id": f"r-rotated-{n}"}
            )
            if path.exists() or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    assert path.exists(), "no new file after the old one was renamed away"
    assert _lines(_read(path), 1), "the new file gets the lines"
    assert rotated.read_text(), "the old file kept its lines"


def test_off_by_default_logs_nothing(backends, tmp_path):
    path = tmp_path / "access.log"
    # A path alone does not turn it on; and no section at all is off too (checked on stderr).
    for access_log in ({"path": str(path)}, None):
        with start_gateway(_config(backends, access_log)) as gateway:
            with httpx.Client(base_url=gateway.url, timeout=30) as client:
                stream = client.post("/v1/chat/completions", json=_chat("Quiet", stream=True),
                                     headers={"x-request-id": "r-quiet-stream"})  # fmt: skip
                whole = client.post(
                    "/v1/chat/completions", json=_chat("Quiet"), headers={"x-request-id": "r-quiet"}
                )
                assert stream.status_code == whole.status_code == 200
            time.sleep(0.5)  # what a writer thread would have needed to write
            output = gateway.process.output()
        assert not path.exists()
        assert "r-quiet" not in output and '{"ts"' not in output


def test_without_a_path_lines_go_to_stderr(backends):
    with start_gateway(_config(backends, {"enabled": True})) as gateway:
        with httpx.Client(base_url=gateway.url, timeout=30) as client:
            client.post("/v1/chat/completions", json=_chat("Where?"), headers={"x-request-id": "r-stderr"})
        (line,) = _lines(gateway.process.output, 1)
    assert line["request_id"] == "r-stderr" and line["status"] == 200 and line["backend"] in ("b0", "b1")


def test_a_path_that_cannot_be_written_is_refused_at_load(tmp_path):
    base = {"models": [{"name": MODEL}], "backends": [{"name": "b0", "url": "http://127.0.0.1:9"}]}
    missing = tmp_path / "no-such-dir" / "access.log"
    with pytest.raises(ConfigError) as error:
        parse_config({**base, "access_log": {"enabled": True, "path": str(missing)}}, "proxy.yaml")
    message = str(error.value)
    assert message.startswith("proxy.yaml: invalid configuration at `access_log.path`")
    assert "does not exist" in message and "path: null" in message
    with pytest.raises(ConfigError, match="is a directory"):
        parse_config({**base, "access_log": {"enabled": True, "path": str(tmp_path)}}, "proxy.yaml")
    # A relative path is the configuration file's directory's.
    config = parse_config({**base, "access_log": {"path": "access.log"}}, "proxy.yaml", tmp_path)
    assert config.access_log.path == str(tmp_path / "access.log") and config.access_log.enabled is False
    # Off, a path is resolved but not checked: one kept for another host does not stop this one.
    config = parse_config({**base, "access_log": {"path": str(missing)}}, "proxy.yaml")
    assert config.access_log.path == str(missing)

"""Every error the gateway answers itself: vLLM's shape, right status, no stack trace, still serving."""

from __future__ import annotations

import logging
import time

import httpx
import pytest

from kvgate_testing.backend import TEST_MODEL
from kvgate_testing.gateway import gateway_config, start_gateway
from kvgate_testing.ports import free_port
from router.errors import log_unexpected

MODEL = TEST_MODEL
BODY_LIMIT = 4096


@pytest.fixture(scope="module")
def gateway(backend):
    limits = {"max_body_bytes": BODY_LIMIT, "upstream_timeout_s": 0.5}
    with start_gateway(gateway_config([backend], limits=limits)) as running:
        yield running


@pytest.fixture
def client(gateway):
    with httpx.Client(base_url=gateway.url, timeout=30) as http:
        yield http


def assert_openai_error(response: httpx.Response, status: int, fragment: str) -> None:
    assert response.status_code == status
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}  # vLLM's ErrorResponse
    assert error["code"] == status
    assert fragment in error["message"]
    assert "Traceback" not in response.text
    assert response.headers["x-request-id"]


@pytest.mark.parametrize(
    ("path", "body", "fragment"),
    [
        ("/v1/completions", b"{not json", "not valid JSON"),
        ("/v1/completions", b"", "empty request body"),
        ("/v1/completions", b"[1, 2]", "must be a JSON object"),
        ("/v1/completions", b'{"prompt": "x"}', "missing `model`"),
        ("/v1/completions", b'{"model": 7, "prompt": "x"}', "missing `model`"),
        ("/v1/completions", b'{"model": "test-model"}', "missing `prompt`"),
        ("/v1/chat/completions", b'{"model": "test-model", "prompt": "x"}', "missing `messages`"),
    ],
)
def test_bad_requests_get_400(client, path, body, fragment):
    response = client.post(path, content=body)
    assert_openai_error(response, 400, fragment)
    # A body that fails the request schema: vLLM's validation type, its location as `param`.
    error = response.json()["error"]
    assert error["type"] == "Bad Request" and error["param"].startswith("body")


def test_unknown_model_gets_404_naming_the_known_ones(client):
    response = client.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"})
    assert_openai_error(response, 404, "`gpt-9` does not exist")
    assert MODEL in response.json()["error"]["message"]
    assert response.json()["error"]["type"] == "NotFoundError"
    assert response.json()["error"]["param"] == "model"


def test_body_over_the_limit_gets_413(client):
    big = b'{"model": "test-model", "prompt": "' + b"x" * BODY_LIMIT + b'"}'
    assert_openai_error(client.post("/v1/completions", content=big), 413, "over the limit")

    # Without a content-length (chunked upload) the limit holds as well.
    def chunks():
        for _ in range(8):
            yield b"x" * 1024

    assert_openai_error(client.post("/v1/completions", content=chunks()), 413, "over the limit")


def test_upstream_timeout_gets_504(client):
    response = client.post(
        "/v1/completions", json={"model": MODEL, "prompt": "slow"}, headers={"x-test-delay-ms": "3000"}
    )
    assert_openai_error(response, 504, "no response within 0.5 s")


def test_unknown_route_and_method_get_openai_errors(client):
    unknown_route = client.get("/v2/nothing")
    assert unknown_route.status_code == 404
    assert unknown_route.json()["error"]["code"] == 404
    assert unknown_route.json()["error"]["type"] == "Not Found"  # vLLM's type for a route it lacks
    wrong_method = client.get("/v1/completions")
    assert wrong_method.status_code == 405
    assert wrong_method.json()["error"]["code"] == 405
    assert wrong_method.json()["error"]["type"] == "Method Not Allowed"


def test_gateway_keeps_serving_after_errors(client):
    for _ in range(3):
        client.post("/v1/completions", content=b"{broken")
        client.post(
            "/v1/completions", json={"model": MODEL, "prompt": "slow"}, headers={"x-test-delay-ms": "900"}
        )
    response = client.post("/v1/completions", json={"model": MODEL, "prompt": "fine"})
    assert response.status_code == 200
    assert response.json()["backend"] == "a"


def test_no_healthy_backend_gets_503():
    dead_url = f"http://127.0.0.1:{free_port()}"
    config = {"models": [{"name": MODEL}], "backends": [{"name": "dead", "url": dead_url}]}
    with start_gateway(config) as gateway:
        response = httpx.post(
            f"{gateway.url}/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=30
        )
        assert response.status_code == 503
        assert response.json()["error"]["type"] == "Service Unavailable"
        # Marked down now, yet still tried (panic routing: it might be back) before the 503.
        response = httpx.post(
            f"{gateway.url}/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=30
        )
        assert_openai_error(response, 503, "no backend could take the request for `test-model` (tried dead)")
        assert httpx.get(f"{gateway.url}/health").status_code == 503


def test_repeated_unexpected_errors_log_one_traceback_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("kvgate.test_throttle")

    def fail(kind: type[Exception]) -> Exception:
        try:
            raise kind("boom")
        except Exception as exc:
            return exc

    with caplog.at_level(logging.ERROR, logger="kvgate.test_throttle"):
        for _ in range(20):
            log_unexpected(logger, fail(ValueError), "request failed", interval_s=0.2)
        log_unexpected(logger, fail(KeyError), "request failed", interval_s=0.2)  # another kind: logged
        time.sleep(0.25)
        log_unexpected(logger, fail(ValueError), "request failed", interval_s=0.2)
    records = [record for record in caplog.records if record.name == "kvgate.test_throttle"]
    assert [record.exc_info[0] for record in records] == [ValueError, KeyError, ValueError]
    assert "19 more like it since the last one were not logged" in records[-1].getMessage()

"""The extension seams (router/extensions.py) with a sample extension, on a real uvicorn server."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from kvgate_testing.backend import TEST_MODEL
from kvgate_testing.gateway import gateway_config
from kvgate_testing.in_thread_server import serving_in_thread
from kvgate_testing.sample_extension import CACHED_TOKENS, PROMPT_TOKENS, SampleExtension
from router.app import create_app
from router.config import parse_config

MODEL = TEST_MODEL


@pytest.fixture(scope="module")
def served(backends):
    """The gateway app with the sample extension, served by uvicorn in a thread of this process."""
    a, _ = backends
    config = parse_config(gateway_config([a]))
    app = create_app(config, extension_factories=["kvgate_testing.sample_extension:create"])
    with serving_in_thread(app) as url:
        yield app, url


def test_extension_is_built_started_and_mounted(served):
    app, url = served
    extension = app.state.gateway.extensions[0]
    assert isinstance(extension, SampleExtension)
    assert app.state.gateway.kv_index is extension
    assert httpx.get(f"{url}/debug/sample").json() == {"events": ["start"], "backends": ["a"]}


def test_extension_follows_backend_changes(served, backends):
    _, url = served
    _, b = backends
    assert httpx.post(f"{url}/backends", json={"name": "b", "url": b.url}).status_code == 201
    assert httpx.get(f"{url}/debug/sample").json()["backends"] == ["a", "b"]
    assert httpx.delete(f"{url}/backends/b").status_code == 200
    assert httpx.get(f"{url}/debug/sample").json()["backends"] == ["a"]


def test_preparer_tokens_feed_the_in_flight_prefill_accounting(served):
    _, url = served
    result: list[httpx.Response] = []
    slow = threading.Thread(
        target=lambda: result.append(
            httpx.post(
                f"{url}/v1/completions",
                json={"model": MODEL, "prompt": "x"},
                headers={"x-test-delay-ms": "800"},
                timeout=30,
            )
        )
    )
    slow.start()
    seen = 0
    for _ in range(200):
        [backend] = httpx.get(f"{url}/backends").json()["backends"]
        if backend["in_flight"]:
            seen = backend["in_flight_prefill_tokens"]
            break
        time.sleep(0.01)
    slow.join()
    assert result[0].status_code == 200
    assert seen == PROMPT_TOKENS - CACHED_TOKENS
    [backend] = httpx.get(f"{url}/backends").json()["backends"]
    assert backend["in_flight"] == 0
    assert backend["in_flight_prefill_tokens"] == 0

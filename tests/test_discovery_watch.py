"""router/discovery.py against a fake Kubernetes API server on loopback (kvgate_testing/fake_kube_api.py)
that speaks the real list/watch protocol: pods come, become ready, terminate and vanish; watches end
and resume from the last version (bookmarks included); 410 Gone leads to a re-list; a wrong token is
refused with a clear error; an API server that goes down leaves the last known set in place."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress

import pytest

from kvgate_testing.fake_kube_api import FakeKubeAPI, endpoint_slice
from kvgate_testing.waiting import wait_for
from router.discovery import DiscoveredEndpoint, EndpointSliceWatcher, endpoints_of

NAMESPACE = "llm"
TOKEN = "test-bearer-token"
SELECTOR = "kubernetes.io/service-name=vllm"


@contextmanager
def watching(api: FakeKubeAPI, token: str = TOKEN) -> Iterator[EndpointSliceWatcher]:
    """The watcher running on an event loop of its own thread, stopped on exit."""
    changes: list[dict[str, DiscoveredEndpoint]] = []
    watcher = EndpointSliceWatcher(
        api.url, NAMESPACE, SELECTOR, token, changes.append, retry_s=0.05, max_retry_s=0.2, watch_timeout_s=30
    )
    loop = asyncio.new_event_loop()
    task = loop.create_task(watcher.run())

    def run_until_cancelled() -> None:
        with suppress(asyncio.CancelledError):
            loop.run_until_complete(task)

    thread = threading.Thread(target=run_until_cancelled, daemon=True)
    thread.start()
    try:
        yield watcher
    finally:
        loop.call_soon_threadsafe(task.cancel)
        thread.join(timeout=10)
        loop.close()


@pytest.fixture
def api() -> Iterator[FakeKubeAPI]:
    server = FakeKubeAPI(NAMESPACE, TOKEN).start()
    yield server
    server.stop()


def logged(caplog: pytest.LogCaptureFixture, text: str) -> str | None:
    """The first captured message holding `text`, or None."""
    return next((r.getMessage() for r in list(caplog.records) if text in r.getMessage()), None)


def states(watcher: EndpointSliceWatcher) -> dict[str, tuple[bool, bool]]:
    return {pod: (e.ready, e.terminating) for pod, e in watcher.endpoints.items()}


def test_pods_that_come_become_ready_terminate_and_vanish_are_followed(api):
    api.apply(endpoint_slice("vllm-a", "vllm", {"vllm-0": {"address": "10.0.0.1"}}, 8000))
    api.apply(endpoint_slice("other", "sglang", {"sg-0": {"address": "10.0.9.9"}}, 30000))  # not selected
    with watching(api) as watcher:
        wait_for(lambda: states(watcher) == {"vllm-0": (True, False)}, 10, "the listed pod")
        assert watcher.endpoints["vllm-0"].address == "10.0.0.1"
        assert watcher.endpoints["vllm-0"].port("http") == 8000

        pods = {"vllm-0": {"address": "10.0.0.1"}, "vllm-1": {"address": "10.0.0.2", "ready": False}}
        api.apply(endpoint_slice("vllm-a", "vllm", pods, 8000))
        wait_for(lambda: states(watcher).get("vllm-1") == (False, False), 10, "a new pod, not ready")
        pods["vllm-1"]["ready"] = True
        api.apply(endpoint_slice("vllm-a", "vllm", pods, 8000))
        wait_for(lambda: states(watcher).get("vllm-1") == (True, False), 10, "the pod ready")
        pods["vllm-0"]["terminating"] = True
        api.apply(endpoint_slice("vllm-a", "vllm", pods, 8000))
        wait_for(lambda: states(watcher).get("vllm-0") == (False, True), 10, "the pod terminating")
        api.delete("vllm-a")
        wait_for(lambda: states(watcher) == {}, 10, "every pod gone")
        # One list, then watches only: changes came through the watch stream.
        assert watcher.counts["lists"] == 1 and watcher.counts["gone"] == 0


def test_a_watch_that_ends_resumes_from_the_last_version_a_bookmark_gave(api):
    api.apply(endpoint_slice("vllm-a", "vllm", {"vllm-0": {"address": "10.0.0.1"}}, 8000))
    with watching(api) as watcher:
        wait_for(lambda: "vllm-0" in watcher.endpoints, 10, "the listed pod")
        wait_for(lambda: any(r.startswith("watch") for r in api.requests), 10, "a watch")
        bookmark_version = api.bookmark()
        wait_for(lambda: watcher.counts["bookmarks"] == 1, 10, "the bookmark")
        api.drop_watches()  # the server ends the stream (a timeout, an API server restart)
        wait_for(
            lambda: f"watch {bookmark_version}" in api.requests, 10, "a watch from the bookmark's version"
        )
        api.apply(endpoint_slice("vllm-b", "vllm", {"vllm-1": {"address": "10.0.0.2"}}, 8000))
        wait_for(lambda: set(watcher.endpoints) == {"vllm-0", "vllm-1"}, 10, "the change after the resume")
        assert watcher.counts["lists"] == 1


def test_410_gone_is_answered_by_a_fresh_list(api):
    api.apply(endpoint_slice("vllm-a", "vllm", {"vllm-0": {"address": "10.0.0.1"}}, 8000))
    with watching(api) as watcher:
        wait_for(lambda: "vllm-0" in watcher.endpoints, 10, "the listed pod")
        api.stop()  # down while pods change, and the history it held is compacted away
        api.delete("vllm-a")
        api.apply(endpoint_slice("vllm-b", "vllm", {"vllm-1": {"address": "10.0.0.2"}}, 8000))
        api.compact()
        api.start()
        wait_for(lambda: set(watcher.endpoints) == {"vllm-1"}, 10, "the set after the re-list")
        assert watcher.counts["gone"] >= 1 and watcher.counts["lists"] == 2


def test_an_api_server_that_is_down_leaves_the_last_known_set_and_warns(api, caplog):
    api.apply(endpoint_slice("vllm-a", "vllm", {"vllm-0": {"address": "10.0.0.1"}}, 8000))
    caplog.set_level(logging.WARNING, logger="kvgate.discovery")
    with watching(api) as watcher:
        wait_for(lambda: "vllm-0" in watcher.endpoints, 10, "the listed pod")
        api.stop()
        wait_for(lambda: logged(caplog, "keeping the last 1 endpoints"), 10, "the warning while down")
        assert set(watcher.endpoints) == {"vllm-0"}
        api.start()  # back on the same port, the same history: the watch resumes
        api.apply(
            endpoint_slice("vllm-a", "vllm", {"vllm-0": {"address": "10.0.0.1", "terminating": True}}, 8000)
        )
        wait_for(lambda: states(watcher) == {"vllm-0": (False, True)}, 10, "the change after the outage")


def test_a_wrong_token_is_refused_with_what_the_service_account_needs(api, caplog):
    api.apply(endpoint_slice("vllm-a", "vllm", {"vllm-0": {"address": "10.0.0.1"}}, 8000))
    caplog.set_level(logging.WARNING, logger="kvgate.discovery")
    with watching(api, token="wrong") as watcher:
        # The warning is logged on the watcher's thread just after the refusal is counted.
        message = wait_for(lambda: logged(caplog, "401"), 10, "the refusal's warning")
        assert "get, list and watch on endpointslices" in message
        assert watcher.endpoints == {}
        assert "unauthorized" in api.requests


def test_a_pod_two_slices_list_counts_as_ready_when_either_says_so():
    # While a slice is replaced, the old and the new one can both list the pod for a moment.
    old = endpoint_slice("vllm-a", "vllm", {"vllm-0": {"address": "10.0.0.1", "ready": False}}, 8000)
    new = endpoint_slice("vllm-b", "vllm", {"vllm-0": {"address": "10.0.0.1"}}, 8000)
    for slices in ({"a": old, "b": new}, {"b": new, "a": old}):
        assert endpoints_of(slices)["vllm-0"].ready is True

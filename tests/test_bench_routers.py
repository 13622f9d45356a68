"""kvgate_testing/routers.py's wait for synced KV-event subscribers, against a real HTTP server that
answers /debug/prefix-map the way the gateway does."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvgate_testing import routers
from kvgate_testing.processes import REPO_ROOT
from kvgate_testing.routers import wait_until_synced


class PrefixMapServer:
    """Serves `backends` as the gateway's /debug/prefix-map?format=json on a free loopback port."""

    def __init__(self) -> None:
        self.backends: dict[str, dict] = {}
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if not self.path.startswith("/debug/prefix-map?format=json"):
                    self.send_error(404)
                    return
                body = json.dumps({"backends": server.backends, "prefixes": [], "decisions": []}).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self._http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._http.server_address[1]}"
        self._thread = threading.Thread(target=self._http.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()
        self._thread.join(timeout=2)


@pytest.fixture
def server() -> Iterator[PrefixMapServer]:
    s = PrefixMapServer()
    yield s
    s.close()


def backend(synced: bool | None, events: bool = True) -> dict:
    return {"events": events, "synced": synced, "connected": True, "last_seq": 41, "replayed_batches": 7}


def test_the_wait_ends_once_every_backend_with_events_is_synced(server: PrefixMapServer) -> None:
    server.backends = {"engine-0": backend(True), "engine-1": backend(False), "plain": backend(None, False)}
    synced = threading.Event()

    def sync_engine_1() -> None:
        synced.set()  # before the page says so: a wait that ended sooner would find it unset
        server.backends.update({"engine-1": backend(True)})

    threading.Timer(0.3, sync_engine_1).start()
    wait_until_synced(server.url, timeout_s=10)  # past 10 s: TimeoutError
    assert synced.is_set()  # it waited for engine-1, and ended once engine-1 was synced


def test_a_gateway_without_kv_events_needs_no_wait(server: PrefixMapServer) -> None:
    server.backends = {"plain": backend(None, False)}
    wait_until_synced(server.url, timeout_s=0.5)


def test_the_wait_names_the_backends_that_never_synced(server: PrefixMapServer) -> None:
    server.backends = {"engine-0": backend(True), "engine-1": backend(False)}
    with pytest.raises(TimeoutError) as caught:
        wait_until_synced(server.url, timeout_s=0.5)
    message = str(caught.value)
    assert "not synced within 0.5s" in message
    assert "engine-1 (connected=True last_seq=41 replayed_batches=7)" in message
    assert "engine-0" not in message
    assert "replay_endpoint" in message  # what to check


def test_the_wait_reports_a_gateway_that_does_not_answer(server: PrefixMapServer) -> None:
    url = server.url
    server.close()
    with pytest.raises(TimeoutError, match="prefix-map"):
        wait_until_synced(url, timeout_s=0.3)


def test_peer_versions_are_read_from_each_peer_environment(tmp_path, monkeypatch):
    site_packages = tmp_path / "sglang-router" / "lib" / "python3.11" / "site-packages"
    dist_info = site_packages / "sglang_router-0.3.2.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang-router\nVersion: 0.3.2\n")
    monkeypatch.setattr(routers, "PEERS_DIR", tmp_path)
    versions = routers.peer_versions()
    assert versions == {"sglang-router": "0.3.2", "vllm-router": "not installed"}
    assert routers.peer_versions_line(versions) == (
        "Peer routers: sglang-router 0.3.2, vllm-router not installed "
        "(PyPI, installed by scripts/install_peers.sh)."
    )


def test_a_routing_report_that_ran_the_peers_names_their_versions(tmp_path):
    from kvgate_testing import routing_report

    results = json.loads((REPO_ROOT / "benchmarks" / "results" / "routing_real.json").read_text())
    routing_report.write_markdown(results, tmp_path / "report.md")
    assert "Peer routers: sglang-router 0.3.2, vllm-router 0.1.17 (" in (tmp_path / "report.md").read_text()

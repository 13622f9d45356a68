"""Runtime backend management over /backends, behind the admin token."""

from __future__ import annotations

import os
import threading
import time

import httpx
import pytest

from tests.support import running_backends, start_gateway

MODEL = "test-model"
TOKEN = "s3cret-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def backends():
    with running_backends("a", "b", models=[MODEL]) as started:
        yield started


@pytest.fixture(scope="module")
def gateway(backends):
    a, _ = backends
    config = {
        "models": [{"name": MODEL}],
        "backends": [{"name": "a", "url": a.url}],
        "admin": {"token_env": "KVGATE_TEST_ADMIN_TOKEN"},
    }
    # The gateway process inherits this environment.
    os.environ["KVGATE_TEST_ADMIN_TOKEN"] = TOKEN
    try:
        with start_gateway(config) as running:
            yield running
    finally:
        del os.environ["KVGATE_TEST_ADMIN_TOKEN"]


@pytest.fixture
def client(gateway, backends):
    """A client of the gateway as configured, with only `a`: tests add and remove backends, so
    each starts by undoing what the ones before it left."""
    with httpx.Client(base_url=gateway.url, timeout=30) as http:
        for name in names(http):
            if name != "a":
                assert http.delete(f"/backends/{name}", headers=AUTH).status_code == 200
        if "a" not in names(http):
            added = http.post("/backends", headers=AUTH, json={"name": "a", "url": backends[0].url})
            assert added.status_code == 201
        yield http


def names(client: httpx.Client) -> list[str]:
    return [b["name"] for b in client.get("/backends", headers=AUTH).json()["backends"]]


@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer wrong"}, {"authorization": TOKEN}])
def test_admin_endpoints_need_the_token(client, headers):
    for method, path in (("GET", "/backends"), ("POST", "/backends"), ("DELETE", "/backends/a")):
        response = client.request(method, path, headers=headers, json={"name": "x", "url": "http://h:1"})
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"
    assert names(client) == ["a"]  # nothing was added or removed


def test_list_shows_state_health_and_in_flight(client):
    [backend] = client.get("/backends", headers=AUTH).json()["backends"]
    assert backend["name"] == "a"
    assert backend["state"] == "healthy"
    assert backend["healthy"] is True
    assert backend["in_flight"] == 0


def test_add_a_backend_then_it_takes_traffic(client, backends):
    _, b = backends
    response = client.post("/backends", headers=AUTH, json={"name": "b", "url": b.url})
    assert response.status_code == 201
    assert response.json()["name"] == "b"
    served = {
        client.post("/v1/completions", json={"model": MODEL, "prompt": str(i)}).headers["x-kvgate-backend"]
        for i in range(4)
    }
    assert served == {"a", "b"}


@pytest.mark.parametrize(
    ("body", "status", "fragment"),
    [
        ({"name": "a", "url": "http://127.0.0.1:1"}, 409, "already exists"),
        ({"name": "c", "url": "not a url"}, 400, "must look like http://host:port"),
        ({"name": "c", "url": "http://h:1", "colour": "red"}, 400, "unknown field `colour`"),
        ({"name": "c", "url": "http://h:1", "models": ["nope"]}, 400, "unknown models ['nope']"),
    ],
)
def test_bad_additions_are_refused(client, body, status, fragment):
    response = client.post("/backends", headers=AUTH, json=body)
    assert response.status_code == status
    assert fragment in response.json()["error"]["message"]


def test_delete_drains_in_flight_requests_then_removes(client, gateway, backends):
    added = client.post("/backends", headers=AUTH, json={"name": "b", "url": backends[1].url})
    assert added.status_code == 201
    slow_results: list[httpx.Response] = []

    def slow_request() -> None:
        with httpx.Client(base_url=gateway.url, timeout=30) as http:
            slow_results.append(
                http.post(
                    "/v1/completions",
                    json={"model": MODEL, "prompt": "slow"},
                    headers={"x-test-delay-ms": "1500", "x-session-id": "drain"},
                )
            )

    thread = threading.Thread(target=slow_request)
    thread.start()
    busy = None
    for _ in range(200):
        busy = next(
            (b["name"] for b in client.get("/backends", headers=AUTH).json()["backends"] if b["in_flight"]),
            None,
        )
        if busy:
            break
        time.sleep(0.02)
    assert busy is not None
    other = "a" if busy == "b" else "b"
    deleted: list[httpx.Response] = []
    deleter = threading.Thread(
        target=lambda: deleted.append(client.delete(f"/backends/{busy}", headers=AUTH))
    )
    deleter.start()
    time.sleep(0.2)
    # While it drains, it takes nothing new.
    with httpx.Client(base_url=gateway.url, timeout=30) as http:
        during = {
            http.post("/v1/completions", json={"model": MODEL, "prompt": f"d{i}"}).headers["x-kvgate-backend"]
            for i in range(3)
        }
    assert during == {other}
    deleter.join()
    thread.join()
    assert slow_results[0].status_code == 200
    assert slow_results[0].headers["x-kvgate-backend"] == busy
    assert deleted[0].status_code == 200
    assert deleted[0].json() == {"removed": busy, "drained": True, "in_flight_at_removal": 0}
    assert names(client) == [other]


def test_delete_unknown_backend_is_404(client):
    response = client.delete("/backends/ghost", headers=AUTH)
    assert response.status_code == 404
    assert "ghost" in response.json()["error"]["message"]

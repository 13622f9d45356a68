"""Runtime backend management over /backends, behind the admin token."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from kvgate_testing.backend import TEST_MODEL
from kvgate_testing.gateway import gateway_config, start_gateway
from kvgate_testing.ports import free_port
from kvgate_testing.processes import REPO_ROOT, python_command

MODEL = TEST_MODEL
TOKEN = "s3cret-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def gateway(backends):
    a, _ = backends
    config = gateway_config([a], admin={"token_env": "KVGATE_TEST_ADMIN_TOKEN"})
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
        assert response.json()["error"]["type"] == "Unauthorized"
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


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_an_admin_post_that_is_not_json_is_refused_with_415_and_adds_nothing(client, backends, content_type):
    # A web page can POST text/plain (or a form) to any address without a CORS preflight.
    headers = dict(AUTH) if content_type is None else {**AUTH, "content-type": content_type}
    body = json.dumps({"name": "b", "url": backends[1].url})
    response = client.post("/backends", headers=headers, content=body)
    assert response.status_code == 415
    assert "application/json" in response.json()["error"]["message"]
    assert names(client) == ["a"]


def serve_refusal(config: dict, *args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run `kvgate serve` on `config`, expecting it to refuse at once: its exit status and stderr."""
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as file:
        yaml.safe_dump(config, file)
    try:
        environment = {**os.environ, "PYTHONPATH": str(REPO_ROOT), **(env or {})}
        environment.pop("KVGATE_TEST_UNSET_TOKEN", None)
        done = subprocess.run(
            python_command("-m", "router.cli", "serve", "--config", file.name, *args),
            capture_output=True,
            text=True,
            timeout=30,
            env=environment,
        )
    finally:
        Path(file.name).unlink()
    return done.returncode, done.stderr


def test_a_token_env_naming_an_unset_variable_refuses_to_start(backends):
    config = {
        "models": [{"name": MODEL}],
        "backends": [{"name": "a", "url": backends[0].url}],
        "listen": {"host": "127.0.0.1", "port": free_port()},
        "admin": {"token_env": "KVGATE_TEST_UNSET_TOKEN"},
    }
    status, stderr = serve_refusal(config)
    assert status == 2
    [line] = stderr.strip().splitlines()
    assert "`admin.token_env`" in line and "'KVGATE_TEST_UNSET_TOKEN' is not set" in line
    assert "export KVGATE_TEST_UNSET_TOKEN" in line


def test_admin_endpoints_without_a_token_beyond_loopback_need_admin_open(backends):
    config = {"models": [{"name": MODEL}], "backends": [{"name": "a", "url": backends[0].url}]}
    status, stderr = serve_refusal({**config, "listen": {"host": "0.0.0.0", "port": free_port()}})
    assert status == 2
    assert "`listen.host`" in stderr and "admin: {open: true}" in stderr
    # --host overrides the configured (loopback) address, and is checked the same way.
    status, stderr = serve_refusal(config, "--host", "0.0.0.0")
    assert status == 2 and "`--host`" in stderr
    # An explicit opt-in starts it, and its admin endpoints are open.
    with start_gateway({**config, "admin": {"open": True}}, extra_args=["--host", "0.0.0.0"]) as running:
        listed = httpx.get(f"{running.url}/backends", timeout=10)
        assert listed.status_code == 200 and [b["name"] for b in listed.json()["backends"]] == ["a"]


CLIENT_KEY = "kvgate-test-client-key-0123456789"


def test_client_keys_without_an_admin_token_refuse_to_start_unless_admin_is_opened(backends):
    # Before, any holder of a client key could read other clients' prompts on /debug/prefix-map and
    # replace the backends: a client key opens every route, and no admin token was asked for.
    config = {
        "models": [{"name": MODEL}],
        "backends": [{"name": "a", "url": backends[0].url}],
        "listen": {"host": "127.0.0.1", "port": free_port()},
        "auth": {"api_keys": [CLIENT_KEY]},
    }
    status, stderr = serve_refusal(config)
    assert status == 2
    [line] = stderr.strip().splitlines()
    assert "`admin`" in line and "admin.token_env" in line and "admin: {open: true}" in line
    # An admin token that is also a client key is no credential of its own.
    status, stderr = serve_refusal({**config, "admin": {"token": CLIENT_KEY}})
    assert status == 2 and "also a client API key" in stderr
    # Opened explicitly, it starts, and a client key opens the admin endpoints as the operator said.
    opened = {key: value for key, value in config.items() if key != "listen"}
    with start_gateway({**opened, "admin": {"open": True}}) as running:
        client_auth = {"authorization": f"Bearer {CLIENT_KEY}"}
        assert httpx.get(f"{running.url}/backends", headers=client_auth, timeout=10).status_code == 200
        assert httpx.get(f"{running.url}/backends", timeout=10).status_code == 401


def test_a_client_key_opens_no_admin_or_debug_endpoint(backends):
    a, b = backends
    config = gateway_config([a], auth={"api_keys": [CLIENT_KEY]}, admin={"token": TOKEN})
    client_auth = {"authorization": f"Bearer {CLIENT_KEY}"}
    with start_gateway(config) as running, httpx.Client(base_url=running.url, timeout=10) as http:
        completion = http.post("/v1/completions", headers=client_auth, json={"model": MODEL, "prompt": "hi"})
        assert completion.status_code == 200
        attempts = [
            ("GET", "/backends", None),
            ("POST", "/backends", {"name": "evil", "url": b.url}),
            ("DELETE", "/backends/a", None),
            ("GET", "/debug/prefix-map?format=json", None),
            ("POST", "/lookup", {"model": MODEL, "prompt": "hi"}),
        ]
        for method, path, body in attempts:
            answer = http.request(method, path, headers=client_auth, json=body)
            assert answer.status_code == 401, (method, path, answer.text)
            assert "admin" in answer.json()["error"]["message"]
        # Nothing changed, and the admin token opens them.
        assert names_with(http, AUTH) == ["a"]
        assert http.get("/debug/prefix-map?format=json", headers=AUTH).status_code == 200


def names_with(client: httpx.Client, headers: dict[str, str]) -> list[str]:
    return [b["name"] for b in client.get("/backends", headers=headers).json()["backends"]]

"""Routing policies: their choices in isolation, and their distribution through the real gateway."""

from __future__ import annotations

import collections
import collections.abc
import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml

from kvgate_testing.backend import TEST_MODEL, running_backends
from kvgate_testing.gateway import gateway_config, start_gateway
from kvgate_testing.ports import free_port
from kvgate_testing.processes import REPO_ROOT, python_command
from router import config as config_schema
from router.backends import BackendState
from router.policies import POLICY_MODULES, Choice, Policy, PolicyUnavailable, RouteRequest, make_policy

MODEL = TEST_MODEL


def states(*names: str) -> list[BackendState]:
    return [BackendState(name=name, url=f"http://127.0.0.1:{9000 + i}") for i, name in enumerate(names)]


def request(session_key: str | None = None) -> RouteRequest:
    return RouteRequest("id", MODEL, {}, session_key)


# ---- the policies alone ----


def test_round_robin_rotates_strictly():
    policy = make_policy(config_schema.RoundRobinPolicy())
    candidates = states("a", "b", "c")
    assert [policy.choose(request(), candidates).backend.name for _ in range(7)] == [
        "a",
        "b",
        "c",
        "a",
        "b",
        "c",
        "a",
    ]


def test_least_loaded_picks_fewest_in_flight_and_rotates_ties():
    policy = make_policy(config_schema.LeastLoadedPolicy())
    a, b, c = candidates = states("a", "b", "c")
    a.in_flight, b.in_flight, c.in_flight = 3, 1, 2
    assert policy.choose(request(), candidates).backend is b
    a.in_flight = b.in_flight = c.in_flight = 0
    assert sorted(policy.choose(request(), candidates).backend.name for _ in range(6)) == [
        "a",
        "a",
        "b",
        "b",
        "c",
        "c",
    ]


def test_session_pins_until_its_backend_leaves():
    policy = make_policy(config_schema.SessionPolicy())
    candidates = states("a", "b", "c")
    first_choice = policy.choose(request("s1"), candidates)
    policy.on_routed(first_choice)
    first = first_choice.backend
    for _ in range(5):
        assert policy.choose(request("s1"), candidates).backend is first
    # Its backend goes down: the session moves, then stays on its new backend.
    remaining = [backend for backend in candidates if backend is not first]
    moved_choice = policy.choose(request("s1"), remaining)
    policy.on_routed(moved_choice)
    moved = moved_choice.backend
    assert moved is not first
    assert policy.choose(request("s1"), candidates).backend is moved


def test_session_without_key_balances_by_load():
    policy = make_policy(config_schema.SessionPolicy())
    a, b, c = candidates = states("a", "b", "c")
    a.in_flight = 5
    assert policy.choose(request(None), candidates).backend in (b, c)


def test_every_configured_policy_returns_an_immutable_choice_and_answers_the_whole_interface():
    """What any caller (the forwarder, an endpoint picker, a prefill/decode split) may call on a policy
    works on every one of them, with nothing but the Choice handed back; the Choice cannot be changed."""
    for policy_config in (
        config_schema.RoundRobinPolicy(),
        config_schema.LeastLoadedPolicy(),
        config_schema.SessionPolicy(),
        config_schema.KVAwarePolicy(),
        config_schema.ApproximatePolicy(),
    ):
        policy = make_policy(policy_config)
        candidates = states("a", "b")
        choice = policy.choose(request("s1"), candidates)
        assert choice.backend in candidates
        with pytest.raises(AttributeError):
            choice.backend = candidates[0]  # type: ignore[misc]
        policy.on_routed(choice)
        policy.on_finished(choice, 200, 0.01)
        placement = policy.for_peers(choice)
        assert isinstance(placement.prefix_keys, list) and placement.ttl_s >= 0
        assert isinstance(policy.recent_decisions(), collections.abc.Sequence)
        assert policy.measured_load_costs() is None  # none measures load costs unless configured to


def test_a_policy_that_only_chooses_gets_the_rest_of_the_interface_from_the_base():
    class First(Policy):
        name = "first"

        def choose(self, request, candidates):
            return Choice(candidates[0])

    policy = First()
    candidates = states("a", "b")
    choice = policy.choose(request(), candidates)
    policy.on_routed(choice)
    policy.on_finished(choice, 502, None)
    assert policy.for_peers(choice).prefix_keys == [] and policy.for_peers(choice).hot_prefix_key is None
    assert list(policy.recent_decisions()) == [] and policy.measured_load_costs() is None
    assert not policy.needs_tokens and choice.reason is None and choice.prefill_tokens is None


def test_missing_policy_module_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(POLICY_MODULES, config_schema.ApproximatePolicy, "router.policies.not_installed_here")
    with pytest.raises(PolicyUnavailable, match="policy 'approximate' is not available"):
        make_policy(config_schema.ApproximatePolicy())


# ---- through the gateway ----


@pytest.fixture(scope="module")
def backends():
    with running_backends("a", "b", "c", models=[MODEL]) as started:
        yield started


def served_by(url: str, count: int, **kwargs) -> list[str]:
    with httpx.Client(base_url=url, timeout=30) as client:
        return [
            client.post("/v1/completions", json={"model": MODEL, "prompt": f"p{i}"}, **kwargs).headers[
                "x-kvgate-backend"
            ]
            for i in range(count)
        ]


def test_round_robin_distribution_through_the_gateway(backends):
    with start_gateway(gateway_config(backends, policy={"name": "round_robin"})) as gateway:
        order = served_by(gateway.url, 30)
    assert collections.Counter(order) == {"a": 10, "b": 10, "c": 10}
    assert order[:3] == order[3:6] == order[27:30]  # strict rotation


def test_least_loaded_avoids_busy_backends_through_the_gateway(backends):
    with start_gateway(gateway_config(backends, policy={"name": "least_loaded"})) as gateway:
        sequential = served_by(gateway.url, 30)
        assert collections.Counter(sequential) == {"a": 10, "b": 10, "c": 10}  # ties broken fairly
        slow = {"x-test-delay-ms": "2500"}
        with ThreadPoolExecutor(2) as pool:
            busy = [pool.submit(served_by, gateway.url, 1, headers=slow) for _ in range(2)]
            # Wait until both slow requests are in flight on two backends.
            for _ in range(200):
                in_flight = {
                    b["name"]: b["in_flight"] for b in httpx.get(f"{gateway.url}/backends").json()["backends"]
                }
                if sum(in_flight.values()) == 2:
                    break
                time.sleep(0.02)
            idle = [name for name, count in in_flight.items() if count == 0]
            assert len(idle) == 1
            assert set(served_by(gateway.url, 5)) == set(idle)
            busy_names = {name for future in busy for name in future.result()}
        assert busy_names.isdisjoint(idle)


def test_session_affinity_through_the_gateway(backends):
    with start_gateway(gateway_config(backends, policy={"name": "session"})) as gateway:
        by_header = {
            session: set(served_by(gateway.url, 6, headers={"x-session-id": session}))
            for session in ("alice", "bob", "carol")
        }
        assert all(len(names) == 1 for names in by_header.values())
        # Three new sessions on idle backends spread over all three.
        assert set().union(*by_header.values()) == {"a", "b", "c"}
        with httpx.Client(base_url=gateway.url) as client:
            by_user = {
                client.post("/v1/completions", json={"model": MODEL, "prompt": "u", "user": "dave"}).headers[
                    "x-kvgate-backend"
                ]
                for _ in range(6)
            }
        assert len(by_user) == 1


def test_a_policy_value_the_policy_refuses_stops_kvgate_serve_with_one_line(tmp_path):
    config_path = tmp_path / "proxy.yaml"
    config_path.write_text(
        yaml.safe_dump(
            {
                "models": [{"name": MODEL}],
                "backends": [{"name": "a", "url": f"http://127.0.0.1:{free_port()}"}],
                "policy": {"name": "approximate", "block_size": 24},
            }
        )
    )
    result = subprocess.run(
        python_command("-m", "router.cli", "serve", "--config", str(config_path), "--port", str(free_port())),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO_ROOT,
        env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)),
    )
    assert result.returncode == 2, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert str(config_path) in line
    assert "policy.block_size 24 must be a multiple of 16" in line


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def test_distinct_huge_session_keys_do_not_stay_in_the_gateways_memory(backends):
    # A client sending a new 1 MiB `user` field each time (the OpenAI field the session policy pins
    # on). Bound: 300 of them grow the gateway's RSS by less than 100 MB after 20 warm-up requests of
    # the same size (kept whole, the keys alone would hold 300 MiB).
    def body(n: int) -> dict:
        return {"model": MODEL, "prompt": "u", "max_tokens": 1, "user": f"{n:08d}" + "k" * (1 << 20)}

    with (
        start_gateway(gateway_config(backends, policy={"name": "session"})) as gateway,
        httpx.Client(base_url=gateway.url, timeout=30) as client,
    ):
        for n in range(20):
            assert client.post("/v1/completions", json=body(n)).status_code == 200
        before = _rss_bytes(gateway.process.pid)
        for n in range(20, 320):
            assert client.post("/v1/completions", json=body(n)).status_code == 200
        grown = _rss_bytes(gateway.process.pid) - before
        assert grown < 100 << 20, f"the gateway grew by {grown >> 20} MiB"
        # The long key still pins its session: the same 1 MiB user lands on the same backend.
        served = {client.post("/v1/completions", json=body(7)).headers["x-kvgate-backend"] for _ in range(4)}
        assert len(served) == 1

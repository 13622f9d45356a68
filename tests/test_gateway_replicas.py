"""Gateway replicas with one view (`cluster:`, router/cluster.py) and `kvgate serve --workers`.

Real processes on loopback: a redis-server started here, scriptable OpenAI backends with KV-event
publishers that speak vLLM's protocol (they publish only what a test tells them to, so a prompt
another replica routed can be found only through the sync), and the real gateway processes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from kvgate_testing.backend import start_backend
from kvgate_testing.event_publisher import EventPublisher, block_stored
from kvgate_testing.gateway import GatewayProcess, start_gateway
from kvgate_testing.metrics import metric_samples, sample_key
from kvgate_testing.ports import free_port
from kvgate_testing.redis_server import RedisServer

MODEL = "test-model"
PEER_TIMEOUT_S = 1.5
DOCUMENT = "A field report on the migration of arctic terns, counted from three islands every June. " * 50


def chat(question: str, stream: bool = False) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "system", "content": DOCUMENT}, {"role": "user", "content": question}],
        "max_tokens": 4,
        "stream": stream,
    }


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout_s} s"
        time.sleep(0.05)


def backends_of(gateway: GatewayProcess) -> dict[str, dict]:
    listing = httpx.get(gateway.url + "/backends", timeout=5).json()["backends"]
    return {backend["name"]: backend for backend in listing}


def cluster_metrics(gateway: GatewayProcess) -> dict[str, float]:
    samples = metric_samples(httpx.get(gateway.url + "/metrics", timeout=5).text)
    return {name: value for (name, labels), value in samples.items() if name.startswith("kvgate_cluster_")}


class Engines:
    """Three test backends, each with its KV-event publisher."""

    def __init__(self) -> None:
        self.backends = [start_backend(f"b{i}", [MODEL]) for i in range(3)]
        self.publishers: dict[str, EventPublisher] = {}
        self.specs = []
        for backend in self.backends:
            endpoint, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
            self.publishers[backend.name] = EventPublisher(endpoint, replay, topic="kv-events")
            self.specs.append(
                {
                    "name": backend.name,
                    "url": backend.url,
                    "kv_events": {"endpoint": endpoint, "replay_endpoint": replay, "topic": "kv-events"},
                }
            )

    def close(self) -> None:
        for publisher in self.publishers.values():
            publisher.close()
        for backend in self.backends:
            backend.stop()


@pytest.fixture(scope="module")
def engines() -> Iterator[Engines]:
    engines = Engines()
    try:
        yield engines
    finally:
        engines.close()


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.close()


def replica_config(
    engines: Engines, redis_server: RedisServer, replica_id: str, policy: str = "kv_aware", **cluster: object
) -> dict:
    return {
        "models": [{"name": MODEL, "tokenizer": "builtin:qwen3"}],
        "backends": engines.specs,
        "policy": {"name": policy},
        "cluster": {
            "url": redis_server.url,
            "replica_id": replica_id,
            "heartbeat_s": 0.3,
            "peer_timeout_s": PEER_TIMEOUT_S,
            **cluster,
        },
    }


@pytest.fixture
def start_replicas(
    engines: Engines, redis_server: RedisServer
) -> Iterator[Callable[..., list[GatewayProcess]]]:
    started: list[GatewayProcess] = []

    def start(
        count: int, policy: str = "kv_aware", first: int = 0, **cluster: object
    ) -> list[GatewayProcess]:
        replicas = [
            start_gateway(replica_config(engines, redis_server, f"replica-{chr(97 + i)}", policy, **cluster))
            for i in range(first, first + count)
        ]
        started.extend(replicas)
        # Each one hears every other before the test begins.
        for replica in replicas:
            wait_until(
                lambda replica=replica: cluster_metrics(replica).get("kvgate_cluster_peers") == count - 1,
                20,
                "the replicas meeting on the channel",
            )
        return replicas

    try:
        yield start
    finally:
        for gateway in started:
            gateway.stop()


class SlowRequest:
    """A streamed request held open by its backend for `seconds`, sent through one replica."""

    def __init__(self, gateway: GatewayProcess, body: dict, seconds: float) -> None:
        self.response: httpx.Response | None = None
        chunks = 4
        headers = {"x-test-chunks": str(chunks), "x-test-chunk-delay-ms": str(int(seconds * 1000 / chunks))}

        def send() -> None:
            # A test may kill the replica mid-answer: then there is no response.
            with (
                httpx.Client(base_url=gateway.url, timeout=30) as client,
                contextlib.suppress(httpx.HTTPError),
            ):
                self.response = client.post("/v1/chat/completions", json=body, headers=headers)

        self.thread = threading.Thread(target=send)
        self.thread.start()

    def join(self) -> httpx.Response | None:
        self.thread.join(timeout=30)
        return self.response


def gpu_blocks(gateway: GatewayProcess, backend: str) -> int:
    listing = httpx.get(gateway.url + "/debug/prefix-map", params={"format": "json"}, timeout=5).json()
    return listing["backends"][backend]["blocks"].get("gpu", 0)


def peer_load(gateway: GatewayProcess) -> dict[str, int]:
    return {name: backend["in_flight_peers"] for name, backend in backends_of(gateway).items()}


def test_three_replicas_see_each_others_in_flight_requests_and_predicted_prefixes(
    engines: Engines, start_replicas: Callable[..., list[GatewayProcess]]
) -> None:
    first, second, third = start_replicas(3)
    slow = SlowRequest(first, chat("How many terns were counted?", stream=True), seconds=3.0)
    try:
        wait_until(lambda: sum(peer_load(second).values()) == 1, 10, "replica b seeing a's request in flight")
        wait_until(lambda: sum(peer_load(third).values()) == 1, 10, "replica c seeing a's request in flight")
        (engine,) = [name for name, count in peer_load(second).items() if count == 1]
        # Replica b has routed nothing and no engine published an event: only a's routing note can
        # tell it where this document's prefix is being computed.
        follow_up = httpx.post(
            second.url + "/v1/chat/completions", json=chat("On which islands?"), timeout=30
        )
        assert follow_up.status_code == 200
        assert follow_up.headers["x-kvgate-backend"] == engine
        decision = httpx.get(second.url + "/debug/prefix-map", params={"format": "json"}, timeout=5).json()
        latest = decision["decisions"][0]
        assert latest["backend"] == engine and latest["reason"] == "cache_hit"
        assert latest["candidates"][engine]["cached"] > 500
        assert not any(sum(backend["blocks"].values()) for backend in decision["backends"].values())
    finally:
        response = slow.join()
    assert response is not None and response.status_code == 200
    assert response.headers["x-kvgate-backend"] == engine
    # Finished: the peers' counts go back to zero with the next message.
    wait_until(lambda: sum(peer_load(second).values()) == 0, 5, "replica b seeing a's request end")
    wait_until(lambda: sum(peer_load(third).values()) == 0, 5, "replica c seeing a's request end")
    # And every replica indexes every engine's events itself (PUB fans out to each subscriber).
    engines.publishers["b2"].publish([block_stored(list(range(7000, 7004)), list(range(64)), 16)])
    for replica in (first, second, third):
        wait_until(
            lambda replica=replica: gpu_blocks(replica, "b2") >= 4, 10, "b2's event reaching every replica"
        )


def test_a_killed_replicas_in_flight_requests_vanish_from_its_peers(
    start_replicas: Callable[..., list[GatewayProcess]],
) -> None:
    # least_loaded: the loads travel whatever the policy, and it starts without a tokenizer.
    first, second = start_replicas(2, policy="least_loaded")
    slow = SlowRequest(first, chat("Which island had the most nests?", stream=True), seconds=20.0)
    try:
        wait_until(lambda: sum(peer_load(second).values()) == 1, 10, "replica b seeing a's request in flight")
        killed_at = time.monotonic()
        first.process.kill(signal.SIGKILL)
        wait_until(lambda: sum(peer_load(second).values()) == 0, PEER_TIMEOUT_S + 2.0, "a's load expiring")
        assert time.monotonic() - killed_at >= PEER_TIMEOUT_S * 0.5  # expired by silence, not by a goodbye
        assert sum(backend["in_flight"] for backend in backends_of(second).values()) == 0
        assert cluster_metrics(second)["kvgate_cluster_peers"] == 0
    finally:
        slow.join()


def test_replicas_route_on_their_own_view_while_redis_is_down_and_resync_after(
    redis_server: RedisServer, start_replicas: Callable[..., list[GatewayProcess]]
) -> None:
    # least_loaded: the loads travel whatever the policy, and it starts without a tokenizer.
    first, second = start_replicas(2, policy="least_loaded")
    redis_server.kill()
    for replica in (first, second):
        wait_until(
            lambda replica=replica: cluster_metrics(replica)["kvgate_cluster_connected"] == 0,
            10,
            "the replica noticing the transport is gone",
        )
    with httpx.Client(timeout=30) as client:
        for n in range(6):
            for replica in (first, second):
                answer = client.post(replica.url + "/v1/chat/completions", json=chat(f"Question {n}?"))
                assert answer.status_code == 200, answer.text
    redis_server.start()
    for replica in (first, second):
        wait_until(
            lambda replica=replica: (
                cluster_metrics(replica)["kvgate_cluster_connected"] == 1
                and cluster_metrics(replica)["kvgate_cluster_peers"] == 1
            ),
            15,
            "the replica rejoining when Redis is back",
        )
    slow = SlowRequest(first, chat("What did the June count show?", stream=True), seconds=2.0)
    try:
        wait_until(lambda: sum(peer_load(second).values()) == 1, 10, "replica b seeing a's request again")
    finally:
        response = slow.join()
    assert response is not None and response.status_code == 200


def test_session_pins_follow_a_session_across_replicas(
    start_replicas: Callable[..., list[GatewayProcess]],
) -> None:
    first, second = start_replicas(2, policy="session")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
    with httpx.Client(timeout=30) as client:
        # Ten sessions placed by replica a (least loaded: spread over the engines) ...
        placed = {}
        for n in range(10):
            answer = client.post(
                first.url + "/v1/chat/completions", json=body, headers={"x-session-id": f"s{n}"}
            )
            placed[f"s{n}"] = answer.headers["x-kvgate-backend"]
        assert len(set(placed.values())) > 1
        time.sleep(0.5)
        # ... continue on replica b, each on its engine.
        for session, engine in placed.items():
            answer = client.post(
                second.url + "/v1/chat/completions", json=body, headers={"x-session-id": session}
            )
            assert answer.headers["x-kvgate-backend"] == engine, session


def test_two_workers_serve_one_port_restart_when_they_crash_and_stop_with_the_supervisor(
    engines: Engines, redis_server: RedisServer
) -> None:
    config = replica_config(engines, redis_server, "host", policy="least_loaded")
    with start_gateway(config, ["--workers", "2"]) as gateway:
        pids: set[str] = set()
        replicas: set[str] = set()
        deadline = time.monotonic() + 30
        while len(pids) < 2:
            assert time.monotonic() < deadline, f"only workers {pids} answered"
            # A new connection each time: the kernel spreads connections over the workers' sockets.
            samples = metric_samples(httpx.get(gateway.url + "/metrics", timeout=5).text)
            for (name, labels), _ in samples.items():
                if name == "kvgate_cluster_replica":
                    pids.add(dict(labels)["pid"])
                    replicas.add(dict(labels)["replica"])
            time.sleep(0.05)
        assert replicas == {"host-w0", "host-w1"}
        answer = httpx.post(gateway.url + "/v1/chat/completions", json=chat("Which month?"), timeout=30)
        assert answer.status_code == 200
        before = {int(pid) for pid in pids}
        assert gateway.process.pid not in before
        # A worker that crashes is replaced.
        os.kill(min(before), signal.SIGKILL)
        wait_until(
            lambda: len(_worker_pids(gateway, 2, timeout_s=2.0, strict=False) - before) == 1,
            40,
            "a new worker answering in the crashed one's place",
        )
        worker_pids = _worker_pids(gateway, 2)
        # SIGTERM to the supervisor alone: it stops its workers and leaves none behind.
        os.kill(gateway.process.pid, signal.SIGTERM)
        gateway.process.popen.wait(timeout=20)
        assert gateway.process.popen.returncode == 0
        for pid in worker_pids:
            wait_until(lambda pid=pid: not _alive(pid), 5, f"worker {pid} exiting")


WORKER_LIVENESS_TIMEOUT_S = 2.0
# New connections succeed again within this long of a worker's stop: its liveness timeout, the
# supervisor's 0.2 s round, and slack for a loaded 2-core machine (the survivor takes every new
# connection once the stopped one is killed; its replacement starts after).
RECOVERY_BOUND_S = WORKER_LIVENESS_TIMEOUT_S + 10.0
# Consecutive new connections that must succeed: with the stopped worker still in the port's group,
# each would land on it with probability about 1/2.
RECOVERED_STREAK = 20


def test_a_stopped_worker_is_killed_and_replaced_so_new_connections_succeed_again(
    engines: Engines, redis_server: RedisServer
) -> None:
    # Before, the supervisor restarted only workers that exited: a SIGSTOPped one kept its share of
    # the port, and its new connections timed out for as long as it stayed stopped.
    config = replica_config(engines, redis_server, "host", policy="least_loaded")
    config["listen"] = {"worker_liveness_timeout_s": WORKER_LIVENESS_TIMEOUT_S}
    with start_gateway(config, ["--workers", "2"]) as gateway:
        stopped = min(_worker_pids(gateway, 2))
        os.kill(stopped, signal.SIGSTOP)
        try:
            started = time.monotonic()
            streak, failures = 0, 0
            while streak < RECOVERED_STREAK and time.monotonic() - started < RECOVERY_BOUND_S:
                try:
                    # A new connection each time; 1 s: a live worker answers /health in milliseconds.
                    httpx.get(gateway.url + "/health", timeout=1.0)
                    streak += 1
                except httpx.HTTPError:
                    streak, failures = 0, failures + 1
            assert streak == RECOVERED_STREAK, (
                f"new connections still failed {time.monotonic() - started:.0f} s after a worker "
                f"stopped ({failures} failed)"
            )
            assert not _alive(stopped)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(stopped, signal.SIGCONT)
        assert "sent no heartbeat" in gateway.process.output()
        # Replaced: two workers answer again, the stopped one not among them.
        assert stopped not in _worker_pids(gateway, 2)


def test_workers_without_a_cluster_section_are_refused_with_the_fix(engines: Engines) -> None:
    config = {"models": [{"name": MODEL}], "backends": engines.specs, "policy": {"name": "least_loaded"}}
    with pytest.raises(RuntimeError) as failure:
        start_gateway(config, ["--workers", "2"], timeout_s=20)
    assert "cluster:" in str(failure.value) and "redis://" in str(failure.value)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for every purpose but its exit status.
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(") ")[1][0] != "Z"


def _worker_pids(
    gateway: GatewayProcess, count: int, timeout_s: float = 30.0, strict: bool = True
) -> set[int]:
    pids: set[int] = set()
    deadline = time.monotonic() + timeout_s
    while len(pids) < count and time.monotonic() < deadline:
        try:
            samples = metric_samples(httpx.get(gateway.url + "/metrics", timeout=5).text)
        except httpx.HTTPError:
            time.sleep(0.1)
            continue
        pids |= {int(dict(labels)["pid"]) for (name, labels) in samples if name == "kvgate_cluster_replica"}
        time.sleep(0.05)
    assert not strict or len(pids) == count, f"workers {pids} answered"
    return pids


# ---- a hostile client of the replicas' Redis ----

CLUSTER_SECRET_ENV = "KVGATE_TEST_CLUSTER_SECRET"
CHANNEL = "kvgate:cluster"


def attack_command(redis_server: RedisServer, *args: str) -> list[str]:
    """The forging Redis client (kvgate_testing/redis_attacker.py): a process without the secret."""
    return [
        sys.executable,
        "-m",
        "kvgate_testing.redis_attacker",
        "publish",
        redis_server.url,
        CHANNEL,
        *args,
    ]


def refused(gateway: GatewayProcess, kind: str) -> float:
    samples = metric_samples(httpx.get(gateway.url + "/metrics", timeout=5).text)
    return samples.get(sample_key("kvgate_cluster_messages_total", kind=kind), 0.0)


def refusal_log_lines(gateway: GatewayProcess) -> int:
    return sum("replica sync: refused messages" in line for line in gateway.process.output().splitlines())


@pytest.fixture
def cluster_secret(monkeypatch: pytest.MonkeyPatch) -> dict:
    monkeypatch.setenv(CLUSTER_SECRET_ENV, "a secret every replica is given")
    return {"auth_secret_env": CLUSTER_SECRET_ENV}


def test_signed_replicas_refuse_a_forging_clients_session_pins_and_loads(
    redis_server: RedisServer, cluster_secret: dict, start_replicas: Callable[..., list[GatewayProcess]]
) -> None:
    first, second = start_replicas(2, policy="session", **cluster_secret)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
    with httpx.Client(timeout=30) as client:
        placed = client.post(
            first.url + "/v1/chat/completions", json=body, headers={"x-session-id": "victim"}
        )
        engine = placed.headers["x-kvgate-backend"]
        elsewhere = next(name for name in ("b0", "b1", "b2") if name != engine)
        # 200 messages re-pinning the victim's session elsewhere (half unsigned, half with a made-up
        # signature) and 2,000 fake peers each claiming 50 requests on the victim's engine.
        subprocess.run(
            attack_command(redis_server, "pin", "200", f"victim={elsewhere}"), check=True, timeout=60
        )
        subprocess.run(attack_command(redis_server, "fake-peers", "2000", engine), check=True, timeout=60)
        for replica in (first, second):
            wait_until(
                lambda replica=replica: refused(replica, "unauthenticated") >= 2200,
                20,
                "the replica refusing every forged message",
            )
            assert cluster_metrics(replica)["kvgate_cluster_peers"] == 1
            assert sum(peer_load(replica).values()) == 0
        for _ in range(5):
            answer = client.post(
                second.url + "/v1/chat/completions", json=body, headers={"x-session-id": "victim"}
            )
            assert answer.headers["x-kvgate-backend"] == engine
    # Bound: 2,200 refusals within seconds log at most 3 lines on each replica (one per 10 s).
    for replica in (first, second):
        assert 1 <= refusal_log_lines(replica) <= 3


def test_a_flood_of_fake_peers_does_not_keep_a_genuine_new_replica_out(
    engines: Engines,
    redis_server: RedisServer,
    cluster_secret: dict,
    start_replicas: Callable[..., list[GatewayProcess]],
) -> None:
    first, second = start_replicas(2, policy="least_loaded", **cluster_secret)
    # Fake peers (the table holds 1,024), new ones published for as long as the third replica takes
    # to start and join; the flood is ended by the test (bounded: 200,000 messages at most).
    flood = subprocess.Popen(
        attack_command(redis_server, "fake-peers", "200000", "b0"), stdout=subprocess.DEVNULL
    )
    third = None
    try:
        third = start_gateway(
            replica_config(engines, redis_server, "replica-c", "least_loaded", **cluster_secret)
        )
        for replica in (first, second, third):
            wait_until(
                lambda replica=replica: cluster_metrics(replica).get("kvgate_cluster_peers") == 2,
                20,
                "every replica hearing both others through the flood",
            )
        slow = SlowRequest(third, chat("Which island had the fewest nests?", stream=True), seconds=2.0)
        try:
            wait_until(lambda: sum(peer_load(first).values()) == 1, 10, "replica a counting c's request")
        finally:
            slow.join()
        assert flood.poll() is None, "the flood ended before the checks: it proved nothing"
    finally:
        if third is not None:
            third.stop()
        flood.terminate()
        flood.wait(timeout=30)
    assert refused(first, "unauthenticated") > 1024 and refused(first, "peer_table_full") == 0


def test_a_burst_of_huge_messages_leaves_the_replicas_in_sync(
    redis_server: RedisServer, start_replicas: Callable[..., list[GatewayProcess]]
) -> None:
    first, second = start_replicas(2, policy="least_loaded")
    # 30 messages of 7.9 MiB in one pipeline: far more than Redis buffers for a subscriber (32 MB),
    # so Redis drops the subscriptions (the replicas log it). Bound: within 10 s both replicas are
    # subscribed again and hear each other; the huge messages are refused before decoding.
    subprocess.run(attack_command(redis_server, "huge", "30", "7.9"), check=True, timeout=120)
    for replica in (first, second):
        wait_until(
            lambda replica=replica: (
                cluster_metrics(replica)["kvgate_cluster_connected"] == 1
                and cluster_metrics(replica)["kvgate_cluster_peers"] == 1
            ),
            10,
            "the replica subscribed again and hearing its peer",
        )
    slow = SlowRequest(first, chat("How many nests on the last island?", stream=True), seconds=2.0)
    try:
        wait_until(
            lambda: sum(peer_load(second).values()) == 1, 10, "replica b seeing a's request after the burst"
        )
    finally:
        slow.join()
    assert refused(second, "oversized") >= 1


def test_sessions_with_keys_over_4096_characters_follow_across_replicas(
    start_replicas: Callable[..., list[GatewayProcess]],
) -> None:
    # Peers used to refuse a whole sync message for one session key over 4,096 characters (no log
    # line): the pins never arrived. Bound: none of a's messages refused by b, every pin followed.
    first, second = start_replicas(2, policy="session")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
    sessions = [f"{n:04d}-" + "s" * 5000 for n in range(10)]
    with httpx.Client(timeout=30) as client:
        placed = {
            session: client.post(
                first.url + "/v1/chat/completions", json=body, headers={"x-session-id": session}
            ).headers["x-kvgate-backend"]
            for session in sessions
        }
        assert len(set(placed.values())) > 1
        time.sleep(0.5)
        # In reverse order: b's own least-loaded rotation would not place them as a did.
        followed = 0
        for session in reversed(sessions):
            answer = client.post(
                second.url + "/v1/chat/completions", json=body, headers={"x-session-id": session}
            )
            followed += answer.headers["x-kvgate-backend"] == placed[session]
    assert (followed, refused(second, "invalid")) == (len(sessions), 0)

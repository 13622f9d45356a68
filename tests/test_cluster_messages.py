"""What a replica does with the messages on the sync channel (router/cluster.py), without a transport:
peers' loads counted and expired, notes applied to the policy, bad messages refused and counted."""

from __future__ import annotations

import msgspec
import numpy as np
from prometheus_client import CollectorRegistry

from router.backends import BackendState
from router.cluster import MAX_MESSAGE_BYTES, BackendLoad, ClusterSync, RoutedNote, SyncMessage
from router.config import Cluster, KVAwarePolicy
from router.index.keys import ROUTER_BLOCK_TOKENS, Namespace, prompt_prefix_keys
from router.policies.base import RouteRequest
from router.policies.kv_aware import KVAware
from router.policies.session import SessionAffinity

encode = msgspec.msgpack.encode


def make_sync(policy=None, peer_timeout_s: float = 3.0) -> tuple[ClusterSync, dict[str, BackendState]]:
    backends = {
        name: BackendState(name=name, url=f"http://127.0.0.1:{9000 + i}") for i, name in enumerate("abc")
    }
    config = Cluster(
        url="redis://127.0.0.1:1/0", replica_id="me", heartbeat_s=1.0, peer_timeout_s=peer_timeout_s
    )
    policy = policy or KVAware(KVAwarePolicy())
    return ClusterSync(config, backends, policy, CollectorRegistry()), backends


def test_peer_loads_add_to_the_backends_and_vanish_when_the_peer_falls_silent() -> None:
    sync, backends = make_sync()
    backends["a"].in_flight = 2  # this replica's own
    sync.receive(encode(SyncMessage("peer-1", [BackendLoad("a", 3, 900), BackendLoad("b", 1, 0)])), now=10.0)
    sync.receive(encode(SyncMessage("peer-2", [BackendLoad("a", 1, 100)])), now=10.5)
    assert (backends["a"].in_flight, backends["a"].in_flight_prefill_tokens) == (6, 1000)
    assert backends["a"].peer_in_flight == 4 and backends["b"].in_flight == 1
    # Absolute numbers: peer-1's next message replaces its last one.
    sync.receive(encode(SyncMessage("peer-1", [BackendLoad("a", 1, 0)])), now=11.0)
    assert (backends["a"].in_flight, backends["b"].in_flight) == (4, 0)
    # peer-2 silent since 10.5: gone after peer_timeout_s; peer-1 (11.0) stays.
    sync.expire_peers(13.7)
    assert sync.peers == ["peer-1"] and backends["a"].in_flight == 3
    sync.expire_peers(14.1)
    assert sync.peers == [] and backends["a"].in_flight == 2 and backends["a"].peer_in_flight == 0


def test_a_leaving_peer_is_forgotten_at_once() -> None:
    sync, backends = make_sync()
    sync.receive(encode(SyncMessage("peer-1", [BackendLoad("c", 5, 0)])), now=1.0)
    sync.receive(encode(SyncMessage("peer-1", [], leaving=True)), now=1.1)
    assert sync.peers == [] and backends["c"].in_flight == 0


def test_a_peers_routed_prompt_is_predicted_on_its_backend_here() -> None:
    policy = KVAware(KVAwarePolicy(prediction_ttl_s=5.0))
    sync, backends = make_sync(policy)
    tokens = np.arange(1000, 1000 + 40 * ROUTER_BLOCK_TOKENS, dtype=np.uint32)
    keys = prompt_prefix_keys(tokens)
    note = RoutedNote("b", prefill_tokens=len(tokens), prefix_keys=keys, ttl_s=5.0)
    sync.receive(encode(SyncMessage("peer-1", [BackendLoad("b", 1, len(tokens))], [note])), now=1.0)
    request = RouteRequest("r1", "m", {}, tokens=tokens, namespace=Namespace())
    chosen = policy.choose(request, list(backends.values()))
    assert chosen.name == "b"
    assert request.decision.candidates["b"]["predicted"] == len(keys) * ROUTER_BLOCK_TOKENS


def test_a_peers_session_pin_is_kept_here() -> None:
    policy = SessionAffinity()
    sync, backends = make_sync(policy)
    sync.receive(encode(SyncMessage("peer-1", [], [RoutedNote("c", session="user-7")])), now=1.0)
    request = RouteRequest("r1", "m", {}, session_key="user-7")
    assert policy.choose(request, list(backends.values())).name == "c"
    assert request.decision.session == "pinned"


def test_bad_messages_are_refused_and_counted_never_applied() -> None:
    sync, backends = make_sync()
    bad = [
        b"\xff\x00 not msgpack",
        encode({"replica": "x"}),  # not the message shape
        encode(["peer-1", [["a", -5, 0]], []]),  # a negative load
        encode(["peer-1", [], [["a", 0, list(range(70_000))]]]),  # too many keys in a note
        b"\x90" * (MAX_MESSAGE_BYTES + 1),  # too large to decode at all
    ]
    for data in bad:
        sync.receive(data, now=1.0)
    assert sync.peers == [] and all(b.in_flight == 0 for b in backends.values())
    assert sync._counters["invalid"]._value.get() == len(bad)


def test_loads_and_notes_for_unknown_backends_are_ignored() -> None:
    sync, backends = make_sync()
    note = RoutedNote("nowhere", prefix_keys=[1, 2, 3], ttl_s=5.0)
    sync.receive(encode(SyncMessage("peer-1", [BackendLoad("nowhere", 9, 9)], [note])), now=1.0)
    assert sync.peers == ["peer-1"] and all(b.in_flight == 0 for b in backends.values())


def test_own_messages_only_prove_the_subscription_alive() -> None:
    sync, backends = make_sync()
    sync.receive(encode(SyncMessage("me", [BackendLoad("a", 4, 0)])), now=5.0)
    assert sync.peers == [] and backends["a"].in_flight == 0 and sync._last_echo == 5.0


def test_the_logged_url_leaves_the_password_out() -> None:
    config = Cluster(url="redis://kvgate:s3cret@10.0.0.5:6379/0")
    sync = ClusterSync(config, {}, KVAware(KVAwarePolicy()), CollectorRegistry())
    assert sync.where == "redis://10.0.0.5:6379/0"

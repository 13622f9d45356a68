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
    choice = policy.choose(request, list(backends.values()))
    assert choice.backend.name == "b"
    assert choice.candidates["b"]["predicted"] == len(keys) * ROUTER_BLOCK_TOKENS


def test_a_peers_session_pin_is_kept_here() -> None:
    policy = SessionAffinity()
    sync, backends = make_sync(policy)
    sync.receive(encode(SyncMessage("peer-1", [], [RoutedNote("c", session="user-7")])), now=1.0)
    request = RouteRequest("r1", "m", {}, session_key="user-7")
    choice = policy.choose(request, list(backends.values()))
    assert choice.backend.name == "c"
    assert choice.reason == "session_pinned"


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
    assert sync._counters["invalid"]._value.get() == len(bad) - 1
    assert sync._counters["oversized"]._value.get() == 1


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
    config = Cluster(url="redis://kvgate:s3cret@10.0.0.5:6379/0", allow_unauthenticated=True)
    sync = ClusterSync(config, {}, KVAware(KVAwarePolicy()), CollectorRegistry())
    assert sync.where == "redis://10.0.0.5:6379/0"


# ---- signed messages ----

SECRET = "a secret every replica shares"


def signed_sync(monkeypatch, replica_id: str = "me", policy=None, **settings) -> tuple[ClusterSync, dict]:
    monkeypatch.setenv("KVGATE_TEST_CLUSTER_SECRET", SECRET)
    backends = {
        name: BackendState(name=name, url=f"http://127.0.0.1:{9000 + i}") for i, name in enumerate("abc")
    }
    config = Cluster(
        url="redis://127.0.0.1:1/0",
        replica_id=replica_id,
        auth_secret_env="KVGATE_TEST_CLUSTER_SECRET",
        **settings,
    )
    return ClusterSync(config, backends, policy or SessionAffinity(), CollectorRegistry()), backends


def test_signed_messages_are_applied_and_unsigned_forged_or_replayed_ones_refused(monkeypatch) -> None:
    sync, backends = signed_sync(monkeypatch)
    peer, _ = signed_sync(monkeypatch, "peer-1")
    message = encode(SyncMessage("peer-1", [BackendLoad("a", 2, 0)]))
    sealed = peer._seal(message)
    sync.receive(sealed, now=1.0)
    assert sync.peers == ["peer-1"] and backends["a"].in_flight == 2
    forged = bytearray(sealed)
    forged[-1] ^= 1
    for data in (message, bytes(forged), sealed):  # unsigned, tampered, replayed
        sync.receive(data, now=1.1)
    assert sync._counters["unauthenticated"]._value.get() == 3
    # A newer message of the same peer still counts.
    sync.receive(peer._seal(encode(SyncMessage("peer-1", [BackendLoad("a", 5, 0)]))), now=1.2)
    assert backends["a"].in_flight == 5


def test_a_message_signed_for_another_channel_or_long_ago_is_refused(monkeypatch) -> None:
    sync, backends = signed_sync(monkeypatch)
    other_channel, _ = signed_sync(monkeypatch, "peer-1", channel="another-deployment")
    sync.receive(other_channel._seal(encode(SyncMessage("peer-1", [BackendLoad("a", 2, 0)]))), now=1.0)
    peer, _ = signed_sync(monkeypatch, "peer-2")
    monkeypatch.setattr("time.time_ns", lambda: 1_000_000_000)  # 1970: far outside the clock skew
    stale = peer._seal(encode(SyncMessage("peer-2", [BackendLoad("a", 2, 0)])))
    monkeypatch.undo()
    monkeypatch.setenv("KVGATE_TEST_CLUSTER_SECRET", SECRET)
    sync.receive(stale, now=1.0)
    assert sync.peers == [] and backends["a"].in_flight == 0
    assert sync._counters["unauthenticated"]._value.get() == 2


def test_a_message_over_max_message_bytes_is_never_sent_its_notes_are_split(monkeypatch) -> None:
    sync, _ = signed_sync(monkeypatch, max_message_bytes=64 * 1024)
    keys = list(range(1 << 40, (1 << 40) + 3000))  # ~27 KB of keys a note
    notes = [RoutedNote("a", prefix_keys=keys, ttl_s=5.0) for _ in range(8)]
    sent = []
    while notes or sync._pending:
        batch = notes or [sync._pending.popleft() for _ in range(len(sync._pending))]
        notes = []
        sent.append(sync._message_within_bound(batch))
    assert all(len(data) <= 64 * 1024 for data in sent)
    receiver, _ = signed_sync(monkeypatch, "peer-1")
    delivered = [receiver._decoder.decode(receiver._open(data, 1.0)[0]) for data in sent]
    assert sum(len(message.routed) for message in delivered) == 8  # none lost, none cut
    assert all(note.prefix_keys == keys for message in delivered for note in message.routed)
    # One note larger than the bound alone: its prefix keys are cut to fit, the note still goes.
    (data,) = [
        sync._message_within_bound([RoutedNote("a", prefix_keys=list(range(1 << 40, (1 << 40) + 20_000)))])
    ]
    assert len(data) <= 64 * 1024


def test_a_long_session_key_travels_as_its_digest_and_pins_the_same_session_on_the_peer(monkeypatch) -> None:
    from router.policies.session import MAX_SESSION_KEY_CHARS, session_table_key

    long_key = "u" * (1 << 20)
    sender_policy = SessionAffinity()
    sender, backends = signed_sync(monkeypatch, "peer-1", policy=sender_policy)
    request = RouteRequest("r1", "m", {}, session_key=long_key)
    sender.routed(request, sender_policy.choose(request, [backends["b"]]), 0)
    data = sender._message_within_bound([sender._pending.popleft()])
    assert len(data) < 1024
    receiver_policy = SessionAffinity()
    receiver, receiver_backends = signed_sync(monkeypatch, policy=receiver_policy)
    receiver.receive(data, now=1.0)
    assert receiver.peers == ["peer-1"]
    again = RouteRequest("r2", "m", {}, session_key=long_key)
    choice = receiver_policy.choose(again, list(receiver_backends.values()))
    assert choice.backend.name == "b"
    assert choice.reason == "session_pinned"
    assert len(session_table_key(long_key)) <= MAX_SESSION_KEY_CHARS


def test_an_unset_or_short_secret_and_an_unsigned_redis_beyond_loopback_are_refused(monkeypatch) -> None:
    import pytest

    monkeypatch.delenv("KVGATE_TEST_CLUSTER_SECRET", raising=False)
    with pytest.raises(ValueError, match=r"KVGATE_TEST_CLUSTER_SECRET.*is not set"):
        Cluster(url="redis://127.0.0.1:6379/0", auth_secret_env="KVGATE_TEST_CLUSTER_SECRET")
    monkeypatch.setenv("KVGATE_TEST_CLUSTER_SECRET", "short")
    with pytest.raises(ValueError, match="holds 5 characters"):
        Cluster(url="redis://127.0.0.1:6379/0", auth_secret_env="KVGATE_TEST_CLUSTER_SECRET")
    with pytest.raises(ValueError, match=r"beyond loopback.*auth_secret_env.*allow_unauthenticated"):
        Cluster(url="redis://cache.invalid:6379/0")
    assert Cluster(url="redis://cache.invalid:6379/0", allow_unauthenticated=True).secret() is None
    assert Cluster(url="redis://localhost:6379/0").secret() is None

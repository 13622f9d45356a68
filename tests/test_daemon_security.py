"""Issue 34, the shared daemon: each finding replayed by a hostile client (a raw ZMQ socket or a
process of its own, on loopback) against a real daemon, with the bound that must hold.

The pool sizes, TTLs and token counts are the issue's scaled down (KiB pools, sub-second TTLs, a
few hundred junk key spaces); each property is the same."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
import torch
import zmq

from cachelayer.config import parse_config
from cachelayer.server import KeySpace, StoreClient, StoreRefused, StoreServer, StoreUnavailable, protocol
from cachelayer.server.access import Credential
from cachelayer.server.daemon import MAX_KEY_SPACES, start_http
from cachelayer.server.leases import process_start_time
from cachelayer.server.protocol import Request, kv_nbytes, tokens_to_bytes
from kvgate_testing.daemon import RawClient, running_daemon

CHUNK = 16
SPACE = KeySpace(model="victim-model@rev", dtype="bfloat16", num_layers=2, num_kv_heads=2, head_dim=8)
OTHER = KeySpace(model="other-model@rev", dtype="bfloat16", num_layers=2, num_kv_heads=2, head_dim=8)
CHUNK_BYTES = kv_nbytes(SPACE, CHUNK)  # 2 KiB
SECRET = "host-secret-0123456789abcdef"
TENANT_SECRET = "tenant-secret-0123456789abcd"


def kv_of(num_tokens: int, value: float) -> torch.Tensor:
    return torch.full((SPACE.num_layers, 2, num_tokens, 16), value, dtype=torch.bfloat16)


def start_daemon(
    pool_chunks: int, *, lease_ttl_s: float = 30.0, credentials: list[Credential] | None = None, **bounds
) -> StoreServer:
    config = parse_config(
        {
            "chunk_size": CHUNK,
            "max_local_cpu_size": pool_chunks * CHUNK_BYTES / (1 << 30),
            "save_unfull_chunk": True,
        }
    )
    return StoreServer(
        config,
        "tcp://127.0.0.1:0",
        shared_memory=True,
        lease_ttl_s=lease_ttl_s,
        credentials=credentials,
        **bounds,
    ).start()


def own_process() -> dict[str, int]:
    """The pid fields of a request naming this test process (the victim's, in these tests)."""
    return {"pid": os.getpid(), "pid_start": process_start_time(os.getpid()) or 0}


# ---- 1. authentication ----


def test_an_unauthenticated_client_gets_no_service_and_the_victims_kv_is_unchanged():
    """Without the secret (none, or a wrong one) a client is refused at the handshake: its lookup,
    retrieve and store get no answer, and the victim's chunks read back unchanged."""
    env = {"DAEMON_SECRET": SECRET}
    with running_daemon("--auth-secret-env", "DAEMON_SECRET", env=env) as daemon:
        victim = StoreClient(daemon.endpoint, chunk_size=CHUNK, timeout_s=10, secret=SECRET.encode())
        tokens = list(range(64))
        try:
            assert victim.store(SPACE, tokens, kv_of(64, 1.5))[0] == 64
            for secret in (None, b"wrong-secret-0123456789"):
                attacker = RawClient(daemon.endpoint, secret)
                try:
                    asked = [
                        Request(op="lookup", space=SPACE, tokens=tokens_to_bytes(tokens)),
                        Request(op="retrieve", space=SPACE, tokens=tokens_to_bytes(tokens)),
                    ]
                    for request in asked:
                        assert attacker.ask(request, timeout_s=0.5) is None
                    store = Request(op="store", space=SPACE, tokens=tokens_to_bytes(tokens), chunk_size=CHUNK)
                    assert attacker.ask(store, kv_of(64, -7.0).view(torch.uint8).numpy().tobytes(),
                                        timeout_s=0.5) is None  # fmt: skip
                finally:
                    attacker.close()
            # A StoreClient without the secret is told why, not left to time out silently. It waits
            # long enough for the refused handshake to be reported on a loaded host.
            unauthenticated = StoreClient(daemon.endpoint, chunk_size=CHUNK, timeout_s=5)
            with pytest.raises(StoreRefused, match="disagree on authentication"):
                unauthenticated.lookup(SPACE, tokens)
            unauthenticated.close()
            hit, kv = victim.retrieve(SPACE, tokens)
            assert hit == 64 and torch.equal(kv, kv_of(64, 1.5))
        finally:
            victim.close()


def test_a_daemon_beyond_loopback_without_a_secret_refuses_to_start():
    """A host beyond loopback and no secret: exit 2 with one line naming the fix, before binding
    anything. The host is a name that resolves nowhere, so even a regression binds nothing."""
    command = [sys.executable, "-m", "cachelayer.cli", "server", "--host", "beyond-loopback.invalid",
               "--port", "0", "--http-port", "0", "--l1-size-gb", "0.001"]  # fmt: skip
    refused = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "without authentication" in refused.stdout and "--auth-secret-env" in refused.stdout
    assert "Traceback" not in refused.stdout + refused.stderr
    unset = subprocess.run(
        [*command, "--auth-secret-env", "KVGATE_TEST_UNSET_SECRET"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert unset.returncode == 2 and "KVGATE_TEST_UNSET_SECRET" in unset.stdout


def test_a_daemon_with_a_remote_tier_beyond_loopback_needs_its_secret_flag():
    """The remote tier's values are only authenticated with a secret the engines share: a
    --remote-url beyond loopback without one stops the daemon, naming the flags that fix it."""
    command = [sys.executable, "-m", "cachelayer.cli", "server", "--port", "0", "--http-port", "0",
               "--l1-size-gb", "0.001", "--remote-url", "redis://beyond-loopback.invalid:6379"]  # fmt: skip
    refused = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "--remote-auth-secret-env" in refused.stdout and "--remote-allow-unauthenticated" in refused.stdout
    assert "Traceback" not in refused.stdout + refused.stderr


# ---- 2. ownership ----


def test_a_pid_named_by_another_client_never_pins_the_pool_past_two_ttls():
    """The attacker reserves the whole pool naming pid 1 (alive forever) and never commits. Its
    reservation expires and its space comes back within two TTLs: the victim's store then holds
    every token (it held 0 until a restart before)."""
    server = start_daemon(8, lease_ttl_s=0.4)
    attacker = RawClient(server.endpoint)
    victim = StoreClient(server.endpoint, chunk_size=CHUNK, timeout_s=5)
    try:
        pid_one = {"pid": 1, "pid_start": process_start_time(1) or 0}
        reserve = Request(op="reserve", space=OTHER, tokens=tokens_to_bytes(range(8 * CHUNK)), **pid_one)
        reply = attacker.ask(reserve)
        assert reply is not None and reply.ok and len(reply.slots) == 8  # the whole pool
        deadline = time.monotonic() + 10  # generous: 2 TTLs are 0.8 s; the machine may be loaded
        while (held := victim.store(SPACE, list(range(1000, 1000 + 4 * CHUNK)), kv_of(64, 2.0))[0]) < 64:
            assert time.monotonic() < deadline, f"the victim's store still holds {held} tokens"
            time.sleep(0.1)
        assert server.metric_values()["cachelayer_daemon_expired_leases_total"] >= 1
    finally:
        victim.close()
        attacker.close()
        server.close()


def test_another_connection_cannot_commit_or_release_a_lease_and_ids_are_unguessable():
    """The attacker, on its own connection and naming the victim's own pid, commits and releases
    lease ids 1..64 (sequential ids were guessable) while the victim writes: all refused, and the
    victim's commit stores the victim's bytes."""
    server = start_daemon(16)
    victim = StoreClient(server.endpoint, chunk_size=CHUNK, timeout_s=5)
    attacker = RawClient(server.endpoint)
    try:
        tokens = list(range(2 * CHUNK))
        with victim.reserved(SPACE, tokens) as reservation:
            assert len(reservation.chunks) == 2
            for guess in range(1, 65):
                for op in ("commit", "release"):
                    frames = [b"", msgspec.msgpack.encode({"op": op, "lease": guess, **own_process()})]
                    assert attacker.send_frames(frames)
                    answer = attacker.receive(5.0)
                    assert answer is not None and b"error" in answer[1]
            for chunk in reservation.chunks:
                chunk.kv.copy_(kv_of(chunk.end - chunk.start, 3.0))
        assert reservation.held_tokens == 2 * CHUNK
        hit, kv = victim.retrieve(SPACE, tokens)
        assert hit == 2 * CHUNK and torch.equal(kv, kv_of(2 * CHUNK, 3.0))
        # Lease ids are 16 random bytes: two leases of one client share nothing guessable.
        leases = []
        for _ in range(2):
            reply = attacker.ask(
                Request(op="lease", space=SPACE, tokens=tokens_to_bytes(tokens), **own_process())
            )
            assert reply is not None and reply.ok
            leases.append(reply.lease)
        assert all(len(lease) == 16 for lease in leases) and leases[0] != leases[1]
    finally:
        attacker.close()
        victim.close()
        server.close()


def test_write_leases_opened_in_a_live_engines_pid_do_not_lock_it_out():
    """64 write leases opened by another connection naming the victim's pid leave the victim's own
    cap untouched: its store succeeds at once. The attacker's own expired leases stop counting."""
    server = start_daemon(80, lease_ttl_s=0.5)
    attacker = RawClient(server.endpoint)
    victim = StoreClient(server.endpoint, chunk_size=CHUNK, timeout_s=5)
    try:
        for index in range(64):
            tokens = tokens_to_bytes(range(index * 10_000, index * 10_000 + CHUNK))
            reply = attacker.ask(Request(op="reserve", space=OTHER, tokens=tokens, **own_process()))
            assert reply is not None and reply.ok and reply.slots, reply
        refused = attacker.ask(
            Request(
                op="reserve",
                space=OTHER,
                tokens=tokens_to_bytes(range(9_000_000, 9_000_016)),
                **own_process(),
            )
        )
        assert refused is not None and not refused.ok and "already holds 64 leases" in (refused.error or "")
        assert victim.transport == "shm"
        assert victim.store(SPACE, list(range(CHUNK)), kv_of(CHUNK, 4.0))[0] == CHUNK
        # Past the TTL the attacker's leases are expired: they no longer count against it either.
        time.sleep(0.8)
        again = attacker.ask(
            Request(
                op="reserve",
                space=OTHER,
                tokens=tokens_to_bytes(range(8_000_000, 8_000_016)),
                **own_process(),
            )
        )
        assert again is not None and again.ok, again
    finally:
        victim.close()
        attacker.close()
        server.close()


# ---- 3. no stale reads ----


def test_a_reservation_committed_without_writing_never_serves_another_models_bytes():
    """The victim's chunks fill the pool; the attacker reserves the same space for another model
    (evicting them), commits without writing and retrieves: it reads zeros, never the victim's KV."""
    server = start_daemon(4)
    victim = StoreClient(server.endpoint, chunk_size=CHUNK, timeout_s=5)
    attacker = RawClient(server.endpoint)
    try:
        assert victim.store(SPACE, list(range(4 * CHUNK)), kv_of(4 * CHUNK, 5.0))[0] == 4 * CHUNK
        tokens = tokens_to_bytes(range(500, 500 + 4 * CHUNK))
        reserved = attacker.ask(Request(op="reserve", space=OTHER, tokens=tokens, **own_process()))
        assert reserved is not None and len(reserved.slots) == 4
        committed = attacker.ask(Request(op="commit", lease=reserved.lease, **own_process()))
        assert committed is not None and committed.ok
        frames = [b"", msgspec.msgpack.encode(Request(op="retrieve", space=OTHER, tokens=tokens))]
        assert attacker.send_frames(frames)
        answer = attacker.receive(5.0)
        assert answer is not None and len(answer) == 3
        read = torch.frombuffer(bytearray(answer[2]), dtype=torch.bfloat16)
        assert read.numel() == 4 * CHUNK * 2 * 2 * 16
        assert not torch.any(read == 5.0) and torch.all(read == 0)
    finally:
        attacker.close()
        victim.close()
        server.close()


# ---- 4. bounds ----


def _resident_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def test_frames_over_the_message_bound_are_dropped_before_they_are_buffered():
    """Four 64 MiB frames (the issue's 1 GiB scaled down) against `--max-message-mb 4`: the daemon
    grows by less than one of them (it grew by all four before) and keeps answering a good client."""
    with running_daemon("--max-message-mb", "4") as daemon:
        good = StoreClient(daemon.endpoint, chunk_size=CHUNK, timeout_s=10)
        try:
            assert good.store(SPACE, list(range(CHUNK)), kv_of(CHUNK, 1.0))[0] == CHUNK
            baseline = _resident_bytes(daemon.process.pid)
            frame = bytes(64 << 20)
            for _ in range(4):
                attacker = RawClient(daemon.endpoint)
                attacker.send_frames([b"", frame, frame, frame, frame])
                time.sleep(0.3)  # let libzmq read what it will of it
                attacker.close()
            grown = _resident_bytes(daemon.process.pid) - baseline
            assert grown < 48 << 20, f"daemon grew by {grown >> 20} MiB"
            assert good.lookup(SPACE, list(range(CHUNK))) == CHUNK
        finally:
            good.close()


def test_a_client_that_pipelines_retrieves_and_never_reads_cannot_make_the_daemon_hold_their_answers():
    """128 retrieves of a held 4 MiB prefix, pipelined by a client whose socket reads nothing: the
    daemon holds at most its per-connection queue of answers (16), so it grows by well under the
    512 MiB that all the answers are, and keeps answering a good client."""
    big = KeySpace(model="big-model@rev", dtype="bfloat16", num_layers=4, num_kv_heads=8, head_dim=128)
    tokens = list(range(16 * CHUNK))  # 16 chunks of 256 KiB: a 4 MiB answer
    with running_daemon(l1_size_gb=0.008) as daemon:
        good = StoreClient(daemon.endpoint, chunk_size=CHUNK, timeout_s=30, transport="tcp")
        attacker = RawClient(daemon.endpoint)
        attacker.socket.setsockopt(zmq.RCVHWM, 1)  # its libzmq stops reading: TCP pushes back
        try:
            kv = torch.ones(4, 2, len(tokens), 1024, dtype=torch.bfloat16)
            assert good.store(big, tokens, kv)[0] == len(tokens)
            baseline = _resident_bytes(daemon.process.pid)
            request = protocol.encode(Request(op="retrieve", space=big, tokens=tokens_to_bytes(tokens)))
            sent = sum(attacker.send_frames([b"", request]) for _ in range(128))
            time.sleep(1.0)  # let the daemon answer what it took
            assert good.lookup(big, tokens) == len(tokens)
            grown = _resident_bytes(daemon.process.pid) - baseline
            assert grown < 160 << 20, f"daemon grew by {grown >> 20} MiB after {sent} pipelined retrieves"
        finally:
            attacker.close()
            good.close()


def test_a_long_lookup_is_refused_past_max_tokens_and_an_uncached_one_hashes_one_slice():
    """A lookup above `max_tokens` is refused with the bound; one of 512K uncached tokens answers
    in a small fraction of the time hashing all of them takes (it hashes only its first slice),
    so another client's lookup waits for neither (a 16M-token lookup blocked everyone 15.6 s)."""
    server = start_daemon(64, max_tokens=1 << 19)
    client = StoreClient(server.endpoint, chunk_size=CHUNK, timeout_s=30)
    try:
        client.store(SPACE, list(range(CHUNK)), kv_of(CHUNK, 1.0))
        with pytest.raises(StoreRefused, match=r"at most 524288 a request \(--max-tokens\)"):
            client.lookup(SPACE, range((1 << 19) + 1))
        junk = torch.randint(0, 50_000, (1 << 19,)).numpy()
        engine = server.engine_for(SPACE, create=False)
        assert engine is not None
        started = time.perf_counter()
        engine.lookup(junk)  # what the daemon did before: every chunk hashed
        full_hash_s = time.perf_counter() - started
        started = time.perf_counter()
        assert client.lookup(SPACE, junk) == 0
        sliced_s = time.perf_counter() - started
        # 16 of 32768 chunks hashed, plus the transfer: a ratio, not a timing, with a wide margin.
        assert sliced_s < full_hash_s / 4, (sliced_s, full_hash_s)
        assert server.metric_values()["lmcache_mp_lookup_requested_tokens_total"] >= 1 << 19
    finally:
        client.close()
        server.close()


def test_junk_key_spaces_cannot_lock_a_real_model_out():
    """An attacker stores one chunk under more invented key spaces than the daemon's whole table
    holds: a real model's first store still succeeds and reads back (it was refused until restart)."""
    server = start_daemon(8, max_key_spaces_per_client=8)
    attacker = StoreClient(server.endpoint, chunk_size=CHUNK, timeout_s=10, transport="tcp")
    victim = StoreClient(server.endpoint, chunk_size=CHUNK, timeout_s=10)
    try:
        for index in range(MAX_KEY_SPACES + 8):
            junk = KeySpace(**{**msgspec.structs.asdict(OTHER), "model": f"junk-{index}"})
            attacker.store(junk, list(range(CHUNK)), kv_of(CHUNK, 6.0))
        assert len(server.engines()) <= MAX_KEY_SPACES
        assert victim.store(SPACE, list(range(CHUNK)), kv_of(CHUNK, 7.0))[0] == CHUNK
        assert torch.equal(victim.retrieve(SPACE, list(range(CHUNK)))[1], kv_of(CHUNK, 7.0))
    finally:
        victim.close()
        attacker.close()
        server.close()


# ---- 5 and 6. tenancy and shared memory ----


def test_a_tenant_credential_reaches_only_its_models_and_never_maps_the_pool():
    """Two credentials: the host's (every model) and a tenant's (`other-model` only). The tenant's
    lookup, retrieve and store of the victim's model are refused and change nothing; it cannot
    attach to the shared pool (it would reach every model's chunks), so it works over TCP."""
    env = {"DAEMON_SECRET": SECRET, "TENANT_SECRET": TENANT_SECRET}
    flags = ("--auth-secret-env", "DAEMON_SECRET", "--tenant-secret-env", "TENANT_SECRET=other-model")
    with running_daemon(*flags, env=env) as daemon:
        host = StoreClient(daemon.endpoint, chunk_size=CHUNK, timeout_s=10, secret=SECRET.encode())
        tenant = StoreClient(daemon.endpoint, chunk_size=CHUNK, timeout_s=10, secret=TENANT_SECRET.encode())
        try:
            tokens = list(range(32))
            assert host.transport == "shm" and host.store(SPACE, tokens, kv_of(32, 8.0))[0] == 32
            assert tenant.transport == "tcp"
            for call in (
                lambda: tenant.lookup(SPACE, tokens),
                lambda: tenant.retrieve(SPACE, tokens),
                lambda: tenant.store(SPACE, tokens, kv_of(32, -1.0)),
            ):
                with pytest.raises(StoreRefused, match="may not use model 'victim-model'"):
                    call()
            shm_tenant = StoreClient(
                daemon.endpoint,
                chunk_size=CHUNK,
                timeout_s=10,
                secret=TENANT_SECRET.encode(),
                transport="shm",
            )
            with pytest.raises(StoreUnavailable, match="holds every model's chunks"):
                _ = shm_tenant.transport
            shm_tenant.close()
            assert tenant.store(OTHER, tokens, kv_of(32, 9.0))[0] == 32
            assert torch.equal(tenant.retrieve(OTHER, tokens)[1], kv_of(32, 9.0))
            assert torch.equal(host.retrieve(SPACE, tokens)[1], kv_of(32, 8.0))
        finally:
            tenant.close()
            host.close()


def test_the_pool_descriptor_goes_only_to_a_ticket_attach_issued_and_only_once():
    """A process that connects to the daemon's pool handout with a made-up ticket, or with one
    already used, gets no file descriptor; the ticket an authenticated `attach` answered gets it
    once (the pool is no longer opened through /proc/<daemon pid>/fd, which any process of the
    daemon's user could)."""
    server = start_daemon(4, credentials=[Credential("host", SECRET.encode())])
    client = RawClient(server.endpoint, SECRET.encode())
    try:
        assert server.pool_handout is not None
        reply = client.ask(Request(op="attach", **own_process()))
        assert reply is not None and reply.ok and reply.segment is not None
        segment = reply.segment

        def descriptors_for(ticket: bytes) -> list[int]:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.settimeout(10)
                conn.connect(segment.handout)
                conn.sendall(ticket)
                _, fds, _, _ = socket.recv_fds(conn, 16, 1)
            for fd in fds:
                os.close(fd)
            return fds

        assert descriptors_for(os.urandom(16)) == []
        assert len(descriptors_for(segment.ticket)) == 1
        assert descriptors_for(segment.ticket) == []  # one use only
        assert server.pool_handout.handed_out == 1 and server.pool_handout.refused == 2
    finally:
        client.close()
        server.close()


# ---- 7. logs and the HTTP side ----


def test_malformed_requests_log_one_line_each_at_most_and_no_traceback():
    """200 malformed frames (bad msgpack, wrong types, bad token bytes, unknown ops): every one is
    answered with an error, the daemon logs a few rate-limited lines and no traceback, and serves."""
    with running_daemon() as daemon:
        attacker = RawClient(daemon.endpoint)
        good = StoreClient(daemon.endpoint, chunk_size=CHUNK, timeout_s=10)
        try:
            bad = [
                b"\xc1 not msgpack",
                msgspec.msgpack.encode({"op": "lookup", "space": {"model": 3}}),
                msgspec.msgpack.encode(
                    {"op": "lookup", "space": msgspec.structs.asdict(SPACE), "tokens": b"123"}
                ),
                msgspec.msgpack.encode({"op": "explode"}),
                msgspec.msgpack.encode({"op": "commit", "lease": "x"}),
            ]
            for index in range(200):
                assert attacker.send_frames([b"", bad[index % len(bad)]])
                answer = attacker.receive(5.0)
                assert answer is not None and b"error" in answer[1]
            assert good.lookup(SPACE, list(range(CHUNK))) == 0
            time.sleep(0.3)
            output = daemon.process.output()
        finally:
            good.close()
            attacker.close()
    assert "Traceback" not in output
    refusal_lines = [line for line in output.splitlines() if "refused" in line]
    # 5 lines a second at most (the rest counted in the next line), over a few seconds of sending.
    assert 1 <= len(refusal_lines) < 60, len(refusal_lines)


def test_the_http_side_closes_idle_connections():
    """A connection that sends nothing is closed after the idle timeout instead of holding a thread."""
    server = start_daemon(4)
    http = start_http(server, "127.0.0.1", 0, idle_timeout_s=0.5)
    try:
        with socket.create_connection(("127.0.0.1", http.server_address[1]), timeout=10) as idle:
            started = time.monotonic()
            assert idle.recv(1) == b""  # closed by the daemon, well before our own 10 s timeout
            assert time.monotonic() - started < 8
    finally:
        http.shutdown()
        server.close()

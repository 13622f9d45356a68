"""The controller's surfaces under attack, on loopback: real controller processes, real engines and
workers, real ZMQ sockets. Authentication (shared secret), checked imports, bounded requests and
worker liveness (issue 21, items 9-11)."""

import os
import threading
import time

import httpx
import msgspec
import pytest
import torch
import zmq

from cachelayer.compress import get_codec
from cachelayer.controller.auth import COMMAND, REPORT, AuthConfigError, MessageAuth
from cachelayer.controller.protocol import Command, Reply, WorkerReport, encode
from cachelayer.controller.worker import attach_controller_worker
from kvgate_testing.cachelayer import CHUNK, HEAD_DIM, HEADS, LAYERS, make_engine, request, store_blob_as_is
from kvgate_testing.controller import (
    controller_process,
    registered,
    same_bits,
    wait_gone,
    wait_registered,
    worker_config,
)
from kvgate_testing.ports import free_port

SECRET_VARIABLE = "KVGATE_TEST_CONTROLLER_SECRET"
SECRET = "test-secret-0123456789abcdef"
MAX_TOKENS = 50_000


@pytest.fixture(scope="module")
def secured():
    """A controller with a shared secret; this process holds the secret too (for the engines)."""
    os.environ[SECRET_VARIABLE] = SECRET
    try:
        with controller_process("--auth-secret-env", SECRET_VARIABLE, env={SECRET_VARIABLE: SECRET}) as (
            url,
            monitor_port,
        ):
            headers = {"Authorization": f"Bearer {SECRET}"}
            with httpx.Client(base_url=url, timeout=20, headers=headers) as client:
                yield client, monitor_port
    finally:
        os.environ.pop(SECRET_VARIABLE, None)


@pytest.fixture(scope="module")
def open_controller():
    """A controller on loopback without a secret (LMCache's behaviour), bounded to MAX_TOKENS a request."""
    with (
        controller_process("--max-tokens", str(MAX_TOKENS)) as (url, monitor_port),
        httpx.Client(base_url=url, timeout=20) as client,
    ):
        yield client, monitor_port


class FakeWorker:
    """An impostor: reports itself as a worker of `instance_id` (signed with `secret`, or not) and
    answers every command from `answer(command) -> (Reply, bytes | None)`."""

    def __init__(self, monitor_port, instance_id, answer, *, secret=None, worker_id=0, interval=0.2):
        self.context = zmq.Context()
        self.commands = self.context.socket(zmq.REP)
        self.port = self.commands.bind_to_random_port("tcp://127.0.0.1")
        self.push = self.context.socket(zmq.PUSH)
        self.push.connect(f"tcp://127.0.0.1:{monitor_port}")
        self.auth = MessageAuth(secret)
        self.report = WorkerReport(
            kind="heartbeat",
            instance_id=instance_id,
            worker_id=worker_id,
            port=self.port,
            heartbeat_interval_s=interval,
        )
        self.answer = answer
        self.received: list[Command] = []
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stopped.is_set():
            self.push.send_multipart(self.auth.seal(REPORT, [encode(self.report)])[0])
            if self.commands.poll(int(self.report.heartbeat_interval_s * 1000)):
                frames = self.commands.recv_multipart()
                command = msgspec.msgpack.decode(frames[-1] if len(frames) == 1 else frames[0], type=Command)
                self.received.append(command)
                reply, data = self.answer(command)
                self.commands.send_multipart([encode(reply)] if data is None else [encode(reply), data])

    def close(self):
        self.stopped.set()
        self.thread.join(timeout=5)
        self.commands.close(linger=0)
        self.push.close(linger=0)
        self.context.term()


def impostor_source(destination, chunk_format, data):
    """Answers like a source instance of `destination`'s key space whose first chunk is `data`."""

    def answer(command):
        if command.op == "identity":
            return Reply(info=destination.transfer_identity()), None
        if command.op == "export_chunk" and command.chunk_index == 0:
            return Reply(num_tokens=CHUNK, chunk_format=chunk_format), data
        return Reply(num_tokens=0), None

    return answer


def move(client, source, destination, tokens):
    body = {"old_position": source, "new_position": destination, "tokens": tokens, "copy": True}
    return client.post("/move", json=body)


# ---- item 9: authentication ----


def test_http_calls_without_the_bearer_token_get_a_401(secured):
    client, _ = secured
    for headers in ({"Authorization": ""}, {"Authorization": "Bearer wrong-secret-wrong-secret"}):
        response = client.post("/lookup", json={"tokens": [1, 2, 3]}, headers=headers)
        assert response.status_code == 401
        assert "Authorization: Bearer" in response.json()["detail"]
        assert response.headers["www-authenticate"] == "Bearer"
    assert client.post("/lookup", json={"tokens": [1, 2, 3]}).status_code == 200


def test_a_fake_registration_is_dropped_and_a_move_from_it_cannot_poison_a_real_instance(secured):
    client, monitor_port = secured
    secured_config = worker_config(monitor_port, "secured-real", controller_auth_secret_env=SECRET_VARIABLE)
    real = registered(make_engine(8, **secured_config))
    tokens, kv = request(31, 1)
    real.store(tokens, kv)
    target, _ = request(35, 1)  # a prefix the real instance does not hold yet: the one to poison
    poison = torch.full((LAYERS, 2, CHUNK, HEADS * HEAD_DIM), 7.0).bfloat16()
    fakes = [
        FakeWorker(
            monitor_port,
            "unsigned-fake",
            impostor_source(real, "raw", poison.view(torch.uint8).numpy().tobytes()),
        ),
        FakeWorker(
            monitor_port,
            "wrong-secret-fake",
            impostor_source(real, "raw", poison.view(torch.uint8).numpy().tobytes()),
            secret=b"another-secret-of-some-length",
        ),
    ]
    try:
        wait_registered(client, "secured-real", 1)  # a worker that holds the secret registers
        time.sleep(1.0)  # five heartbeats from each impostor
        for fake in fakes:
            instance_id = fake.report.instance_id
            moved = move(
                client, [instance_id, "LocalCPUBackend"], ["secured-real", "LocalCPUBackend"], target
            )
            assert real.lookup(target) == 0, "the impostor planted KV in the real instance"
            assert moved.status_code == 404, moved.text
            assert fake.received == []  # the controller never contacted it
            response = client.post("/query_worker_info", json={"instance_id": instance_id, "worker_ids": []})
            assert response.status_code == 404, f"{instance_id} was registered"
        hit, retrieved = real.retrieve(tokens)
        assert hit == CHUNK and same_bits(retrieved, kv)
    finally:
        for fake in fakes:
            fake.close()
        real.close()


def ask_worker(port, frames, timeout_s=10.0):
    context = zmq.Context()
    socket = context.socket(zmq.REQ)
    socket.setsockopt(zmq.LINGER, 0)
    try:
        socket.connect(f"tcp://127.0.0.1:{port}")
        socket.send_multipart(frames)
        assert socket.poll(int(timeout_s * 1000)), "the worker did not answer"
        return socket.recv_multipart()
    finally:
        socket.close(linger=0)
        context.term()


def test_worker_commands_without_a_valid_signature_are_not_run_and_replays_are_refused(secured):
    client, monitor_port = secured
    engine = make_engine(
        8, **worker_config(monitor_port, "secured-commands", controller_auth_secret_env=SECRET_VARIABLE)
    )
    worker = attach_controller_worker(engine, engine.config)
    try:
        wait_registered(client, "secured-commands", 1)
        tokens, kv = request(32, 2)
        engine.store(tokens, kv)
        port = worker.port
        clear = [encode(Command(op="clear"))]
        unsigned = msgspec.msgpack.decode(ask_worker(port, clear)[-1], type=Reply)
        assert not unsigned.ok and "refused" in unsigned.error
        forged, _ = MessageAuth(b"another-secret-of-some-length").seal(COMMAND, clear)
        assert "bad signature" in msgspec.msgpack.decode(ask_worker(port, forged)[-1], type=Reply).error
        assert engine.lookup(tokens) == 2 * CHUNK  # nothing was cleared

        signed, _ = MessageAuth(SECRET.encode()).seal(COMMAND, [encode(Command(op="lookup", tokens=tokens))])
        first = msgspec.msgpack.decode(ask_worker(port, signed)[1], type=Reply)
        assert first.ok and first.num_tokens == 2 * CHUNK
        replayed = msgspec.msgpack.decode(ask_worker(port, signed)[-1], type=Reply)
        assert not replayed.ok and "replayed" in replayed.error
    finally:
        engine.close()


def test_listening_beyond_loopback_without_a_secret_is_refused_unless_opted_into():
    with pytest.raises(AuthConfigError, match="p2p_host"):
        registered(make_engine(4, **worker_config(free_port(), "anywhere", p2p_host="0.0.0.0")))
    with pytest.raises(AuthConfigError, match="NOT_SET_ANYWHERE"):
        unset = worker_config(free_port(), "unset", controller_auth_secret_env="NOT_SET_ANYWHERE")
        registered(make_engine(4, **unset))
    open_config = worker_config(
        free_port(), "opted-in", p2p_host="0.0.0.0", controller_allow_unauthenticated=True
    )
    opted_in = registered(make_engine(4, **open_config))
    opted_in.close()
    from cachelayer.controller.server import serve

    for host, options, named in (
        ("0.0.0.0", {}, "--allow-unauthenticated"),
        ("127.0.0.1", {"auth_secret_env": "NOT_SET_ANYWHERE"}, "NOT_SET_ANYWHERE"),
    ):
        with pytest.raises(SystemExit, match=named):  # refused before binding anything
            serve(host, free_port(), free_port(), **options)


# ---- item 10: imported chunks are checked ----


def test_a_move_of_a_wrong_shape_cachegen_blob_is_refused_and_nothing_is_stored(open_controller):
    client, monitor_port = open_controller
    destination = registered(make_engine(8, **worker_config(monitor_port, "shape-destination")))
    tokens, _ = request(33, 1)
    wrong = get_codec("cachegen").encode(torch.randn(LAYERS, 2, CHUNK // 2, HEADS * HEAD_DIM).bfloat16())
    source = FakeWorker(monitor_port, "shape-source", impostor_source(destination, "cachegen", wrong))
    try:
        wait_registered(client, "shape-destination", 1)
        wait_registered(client, "shape-source", 1)
        response = move(
            client, ["shape-source", "LocalCPUBackend"], ["shape-destination", "LocalCPUBackend"], tokens
        )
        assert response.status_code == 400, response.text
        assert "this engine keeps" in response.json()["detail"]
        assert destination.cpu.num_chunks == 0
    finally:
        source.close()
        destination.close()


def test_decompress_of_a_stored_wrong_shape_blob_is_a_400_and_changes_nothing(open_controller):
    client, monitor_port = open_controller
    engine = registered(make_engine(8, **worker_config(monitor_port, "shape-decompress")))
    try:
        wait_registered(client, "shape-decompress", 1)
        tokens, _ = request(34, 1)
        wrong = get_codec("cachegen").encode(torch.randn(LAYERS + 1, 2, CHUNK, HEADS * HEAD_DIM).bfloat16())
        store_blob_as_is(engine, tokens, "cachegen", wrong)
        body = {
            "instance_id": "shape-decompress",
            "method": "cachegen",
            "location": "LocalCPUBackend",
            "tokens": tokens,
        }
        response = client.post("/decompress", json=body)
        assert response.status_code == 400 and "this engine keeps" in response.json()["detail"]
        assert {entry.meta.fmt for entry in engine.cpu.committed_entries()} == {"cachegen"}
    finally:
        engine.close()


# ---- item 11: bounded requests, liveness, JSON errors ----


def test_a_request_with_too_many_tokens_is_a_413_on_the_controller_and_refused_by_the_worker(open_controller):
    client, monitor_port = open_controller
    response = client.post("/lookup", json={"tokens": list(range(MAX_TOKENS + 1))})
    assert response.status_code == 413 and f"at most {MAX_TOKENS}" in response.json()["detail"]
    engine = make_engine(4, **worker_config(monitor_port, "bounded-worker", controller_max_tokens=1000))
    worker = attach_controller_worker(engine, engine.config)
    try:
        answer = ask_worker(worker.port, [encode(Command(op="lookup", tokens=list(range(1001))))])
        reply = msgspec.msgpack.decode(answer[0], type=Reply)
        assert not reply.ok and "at most 1000" in reply.error
    finally:
        engine.close()


def test_heartbeats_continue_while_the_worker_runs_a_long_command(open_controller):
    client, monitor_port = open_controller
    engine = make_engine(4, **worker_config(monitor_port, "busy-worker"))  # heartbeat every 0.2 s
    worker = attach_controller_worker(engine, engine.config)
    try:
        wait_registered(client, "busy-worker", 1)
        answers = []
        # Chunk hashing of a million tokens on one worker: longer than the 0.6 s of silence that
        # drops it (asserted below, so a faster hash cannot make this test pass vacuously).
        command = encode(Command(op="lookup", tokens=list(range(1_000_000))))
        long_lookup = threading.Thread(target=lambda: answers.append(ask_worker(worker.port, [command])))
        started = time.monotonic()
        long_lookup.start()
        statuses = []
        while long_lookup.is_alive():
            response = client.post(
                "/query_worker_info", json={"instance_id": "busy-worker", "worker_ids": []}
            )
            statuses.append(response.status_code)
            time.sleep(0.05)
        long_lookup.join()
        took = time.monotonic() - started
        assert took > 1.0, f"the command took {took:.2f} s, too short to test heartbeats against"
        assert set(statuses) == {200}, f"dropped during the command: {statuses}"
        assert msgspec.msgpack.decode(answers[0][0], type=Reply).ok
    finally:
        engine.close()


def test_fan_out_while_the_reaper_drops_the_workers_answers_json(open_controller):
    client, monitor_port = open_controller
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    push = context.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{monitor_port}")
    reports = [
        WorkerReport(
            kind="heartbeat", instance_id="reaped", worker_id=rank, port=port, heartbeat_interval_s=0.3
        )
        for rank in range(2)
    ]
    try:
        for report in reports:
            push.send(encode(report))
        wait_registered(client, "reaped", 2)
        health = []
        asking = threading.Thread(
            target=lambda: health.append(client.post("/health", json={"instance_id": "reaped"}))
        )
        asking.start()
        # Hold both commands, unanswered, until the reaper (0.9 s of silence) has dropped both workers.
        pending = []
        while len(pending) < 2:
            assert router.poll(10_000)
            pending.append(router.recv_multipart())
        wait_gone(client, "reaped")
        for identity, empty, *_ in pending:
            router.send_multipart([identity, empty, encode(Reply())])
        asking.join(timeout=20)
        response = health[0]
        assert response.headers["content-type"] == "application/json", response.text
        assert response.status_code == 200 and response.json()["error_codes"] == {"0": 0, "1": 0}
    finally:
        router.close(linger=0)
        push.close(linger=0)
        context.term()


def test_unknown_routes_and_methods_answer_in_the_error_shape(open_controller):
    client, _ = open_controller
    for response in (client.get("/lookup"), client.post("/no-such-route", json={})):
        assert response.status_code in (404, 405)
        assert response.headers["content-type"] == "application/json"
        assert response.json()["detail"]

"""The controller as LMCache defines it, run as a real `cachelayer controller` process with real engines."""

import threading
import time

import httpx
import msgspec
import pytest
import torch
import zmq

from cachelayer import CacheEngine
from cachelayer.config import as_config
from cachelayer.controller.protocol import Command, WorkerReport
from cachelayer.controller.server import (
    COMMAND_SECONDS_PER_KV_BYTE,
    COMMAND_TIMEOUT_S,
    DEFAULT_KV_BYTES_PER_TOKEN,
    MISSED_HEARTBEATS,
    command_timeout_s,
)
from cachelayer.controller.worker import attach_controller_worker
from cachelayer.server.daemon import StoreServer
from cachelayer.server.protocol import KeySpace
from kvgate_testing.cachelayer import CHUNK, HEAD_DIM, HEADS, LAYERS, make_engine, request
from kvgate_testing.controller import (
    controller_process,
    registered,
    same_bits,
    wait_gone,
    wait_registered,
    worker_config,
    worker_process,
)
from kvgate_testing.ports import free_port

# The heartbeat interval a worker that announces none gets.
DEFAULT_HEARTBEAT_S = next(
    field.default for field in msgspec.structs.fields(WorkerReport) if field.name == "heartbeat_interval_s"
)


@pytest.fixture(scope="module")
def controller():
    with controller_process() as (url, monitor_port), httpx.Client(base_url=url, timeout=10) as client:
        yield client, monitor_port


def instance_engine(
    monitor_port,
    instance_id,
    tmp_path=None,
    *,
    model_name="",
    dtype=torch.bfloat16,
    world_size=1,
    worker_id=0,
    **extra,
):
    """One registered engine, worker `worker_id` of its instance; with tmp_path it has a disk tier too."""
    config = {
        "chunk_size": CHUNK,
        "max_local_cpu_size": 0.01,
        **worker_config(monitor_port, instance_id),
        **extra,
    }
    if tmp_path is not None:
        disk = tmp_path / instance_id if world_size == 1 else tmp_path / instance_id / f"w{worker_id}"
        config |= {"local_disk": str(disk), "max_local_disk_size": 0.01}
    return registered(
        CacheEngine.from_config(
            config,
            num_layers=LAYERS,
            num_kv_heads=HEADS,
            head_dim=HEAD_DIM,
            dtype=dtype,
            model_name=model_name,
            world_size=world_size,
            worker_id=worker_id,
        )
    )


def tensor_parallel_instance(monitor_port, instance_id, tmp_path=None):
    """The two registered workers (ranks 0 and 1) of one tensor-parallel instance."""
    return [
        instance_engine(monitor_port, instance_id, tmp_path, world_size=2, worker_id=rank)
        for rank in range(2)
    ]


def test_lmcache_documented_example_twelve_token_prompt(controller):
    client, monitor_port = controller
    engine = registered(
        CacheEngine.from_config(
            worker_config(monitor_port, "lmcache_default_instance", max_local_cpu_size=0.01),
            num_layers=LAYERS,
            num_kv_heads=HEADS,
            head_dim=HEAD_DIM,
            dtype=torch.bfloat16,
        )
    )
    try:
        wait_registered(client, "lmcache_default_instance", 1)
        tokens = list(range(100, 112))
        engine.store(tokens, torch.randn(LAYERS, 2, 12, HEADS * HEAD_DIM).to(torch.bfloat16))
        answer = client.post("/lookup", json={"tokens": tokens}).json()
        assert answer["layout_info"] == {"lmcache_default_instance": ["LocalCPUBackend", 12]}
        assert answer["event_id"].startswith("Lookup")
        finished = client.post("/check_finish", json={"event_id": answer["event_id"]}).json()
        assert finished["status"] == "finished"
        assert client.post("/check_finish", json={"event_id": "Lookup-unknown"}).status_code == 404
    finally:
        engine.close()
    wait_gone(client, "lmcache_default_instance")


def test_lookup_full_hit_partial_match_and_miss(controller):
    client, monitor_port = controller
    engine = registered(make_engine(16, **worker_config(monitor_port, "lookup-instance")))
    try:
        wait_registered(client, "lookup-instance", 1)
        tokens, kv = request(1, 3)
        engine.store(tokens, kv)

        def layout(prompt):
            response = client.post("/lookup", json={"tokens": prompt})
            assert response.status_code == 200, response.text
            return response.json()["layout_info"].get("lookup-instance")

        assert layout(tokens) == ["LocalCPUBackend", 3 * CHUNK]
        changed_second_chunk = tokens[:CHUNK] + [7] * CHUNK + tokens[2 * CHUNK :]
        assert layout(changed_second_chunk) == ["LocalCPUBackend", CHUNK]
        assert layout([7, *tokens[1:]]) is None
    finally:
        engine.close()


def test_lookup_takes_the_chunks_namespace_and_worker_info_names_the_chunk_size(controller):
    """kvgate's additions (the gateway's contract check reads them): /lookup's `cache_salt` and `lora`
    ask for the chunks of that namespace, and /query_worker_info gives each worker's chunk size."""
    client, monitor_port = controller
    engine = registered(make_engine(16, **worker_config(monitor_port, "salted-instance")))
    try:
        infos = wait_registered(client, "salted-instance", 1)["worker_infos"]
        assert [info["chunk_size"] for info in infos] == [CHUNK]
        tokens, kv = request(5, 2)
        engine.store(tokens, kv, cache_salt="tenant-a")

        def layout(**namespace):
            response = client.post("/lookup", json={"tokens": tokens, **namespace})
            assert response.status_code == 200, response.text
            return response.json()["layout_info"].get("salted-instance")

        assert layout(cache_salt="tenant-a") == ["LocalCPUBackend", 2 * CHUNK]
        assert layout() is None  # LMCache's body: the unsalted namespace, which holds nothing here
        assert layout(cache_salt="tenant-b") is None
        assert layout(cache_salt="tenant-a", lora="an-adapter") is None
    finally:
        engine.close()


def test_operations_fan_out_to_every_tensor_parallel_worker(controller, tmp_path):
    client, monitor_port = controller
    workers = tensor_parallel_instance(monitor_port, "tp", tmp_path)
    try:
        infos = wait_registered(client, "tp", 2)["worker_infos"]
        assert sorted(info["worker_id"] for info in infos) == [0, 1]
        tokens, kv = request(2, 2)
        for engine in workers:
            engine.store(tokens, kv)
            engine.flush()

        def post(path, **body):
            response = client.post(path, json=body)
            assert response.status_code == 200, response.text
            return response.json()

        assert post("/health", instance_id="tp")["error_codes"] == {"0": 0, "1": 0}
        assert (
            post("/pin", instance_id="tp", location="LocalCPUBackend", tokens=tokens)["num_tokens"]
            == 2 * CHUNK
        )
        assert (
            post("/compress", instance_id="tp", method="naive", location="LocalCPUBackend", tokens=tokens)[
                "num_tokens"
            ]
            == 2 * CHUNK
        )
        assert all({e.meta.fmt for e in engine.cpu.committed_entries()} == {"naive"} for engine in workers)
        assert (
            post("/decompress", instance_id="tp", method="naive", location="LocalCPUBackend", tokens=tokens)[
                "num_tokens"
            ]
            == 2 * CHUNK
        )
        assert post("/clear", instance_id="tp", location="LocalDiskBackend")["num_tokens"] == 2 * CHUNK
        moved = post(
            "/move",
            old_position=["tp", "LocalCPUBackend"],
            new_position=["tp", "LocalDiskBackend"],
            tokens=tokens,
            copy=False,
        )
        assert moved["num_tokens"] == 2 * CHUNK
        assert post("/lookup", tokens=tokens)["layout_info"]["tp"] == ["LocalDiskBackend", 2 * CHUNK]

        # Workers that disagree are reported, never averaged away.
        other_tokens, other_kv = request(3, 2)
        workers[0].store(other_tokens, other_kv)
        response = client.post("/pin", json={"instance_id": "tp", "location": None, "tokens": other_tokens})
        assert response.status_code == 500 and "disagree" in response.json()["detail"]
    finally:
        for engine in workers:
            engine.close()


@pytest.mark.parametrize(
    ("path", "body", "status", "detail"),
    [
        (
            "/clear",
            {"instance_id": "nobody", "location": "LocalCPUBackend"},
            404,
            "unknown instance_id 'nobody'",
        ),
        ("/pin", {"instance_id": "x"}, 422, "malformed /pin body"),
        ("/lookup", b"{not json", 400, "not valid JSON"),
        ("/lookup", {"tokens": "abc"}, 422, "Expected `array`"),
        (
            "/move",
            {
                "old_position": ["a", "LocalCPUBackend"],
                "new_position": ["b", "LocalCPUBackend"],
                "tokens": [],
            },
            404,
            "unknown instance_id",
        ),
    ],
)
def test_bad_requests_get_a_4xx_with_detail(controller, path, body, status, detail):
    client, _ = controller
    response = client.post(path, content=body) if isinstance(body, bytes) else client.post(path, json=body)
    assert response.status_code == status
    assert detail in response.json()["detail"]


def test_a_worker_that_stops_heartbeating_is_dropped(controller):
    client, monitor_port = controller
    context = zmq.Context()
    push = context.socket(zmq.PUSH)
    try:
        push.connect(f"tcp://127.0.0.1:{monitor_port}")
        report = WorkerReport(
            kind="register", instance_id="silent", worker_id=0, port=free_port(), heartbeat_interval_s=0.2
        )
        push.send(msgspec.msgpack.encode(report))
        wait_registered(client, "silent", 1)
        started = time.monotonic()
        wait_gone(client, "silent")  # no heartbeat ever follows
        # Dropped by its own announced interval (MISSED_HEARTBEATS x 0.2 s), not the default one:
        # that would take MISSED_HEARTBEATS x 2 s, 10 times as long (a bound, not a timing).
        assert time.monotonic() - started < MISSED_HEARTBEATS * DEFAULT_HEARTBEAT_S
    finally:
        push.close(linger=0)
        context.term()


def test_the_in_process_store_registers_the_engines_it_makes_and_the_shared_daemon_does_not(controller):
    """The engine starts no worker itself: its owner attaches one. The vLLM connector's in-process
    StoreServer (start_controller_worker) does, for every engine it makes; the shared daemon does not."""
    client, monitor_port = controller
    space = KeySpace(model="m", dtype="bfloat16", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM)

    def server(instance_id, **options):
        config = {"chunk_size": CHUNK, "max_local_cpu_size": 0.01, **worker_config(monitor_port, instance_id)}
        return StoreServer(as_config(config), "tcp://127.0.0.1:0", **options)

    in_process, shared = server("in-process-store", start_controller_worker=True), server("shared-daemon")
    try:
        in_process.engine_for(space)
        shared.engine_for(space)
        wait_registered(client, "in-process-store", 1)
        time.sleep(5 * 0.2)  # five heartbeat intervals of the shared daemon's engine, had it a worker
        unknown = client.post("/query_worker_info", json={"instance_id": "shared-daemon", "worker_ids": []})
        assert unknown.status_code == 404, unknown.text
    finally:
        in_process.close()
        shared.close()
    wait_gone(client, "in-process-store")  # the worker closed with its engine


def test_unknown_location_is_a_400_naming_the_choices(controller):
    client, monitor_port = controller
    engine = registered(make_engine(4, **worker_config(monitor_port, "bad-location")))
    try:
        wait_registered(client, "bad-location", 1)
        response = client.post("/clear", json={"instance_id": "bad-location", "location": "GPU"})
        assert response.status_code == 400
        assert "LocalCPUBackend" in response.json()["detail"]
        response = client.post(
            "/pin", json={"instance_id": "bad-location", "location": None, "tokens": [-1, 2**64 - 1]}
        )
        assert response.status_code == 400 and "token ids must be integers" in response.json()["detail"]
        # The worker survives bad commands.
        assert client.post("/health", json={"instance_id": "bad-location"}).json()["error_codes"] == {"0": 0}
    finally:
        engine.close()


def test_heartbeats_register_unknown_workers_and_silence_drops_them():
    from cachelayer.controller.server import Controller

    controller = Controller("tcp://127.0.0.1:*")
    try:
        heartbeat = WorkerReport(
            kind="heartbeat", instance_id="i", worker_id=0, port=1234, heartbeat_interval_s=1.0
        )
        # A heartbeat from a worker the controller never saw (the controller restarted) registers it.
        controller.apply_report(heartbeat, now=100.0)
        assert list(controller.instances["i"]) == [0]
        assert controller.drop_silent_workers(now=102.9) == []
        controller.apply_report(heartbeat, now=103.0)
        assert controller.drop_silent_workers(now=105.9) == []
        assert controller.drop_silent_workers(now=106.1) == [("i", 0)]
        assert "i" not in controller.instances
    finally:
        controller._pull.close(linger=0)


# ---- /move between instances: chunks relayed through the controller, worker to worker ----


def move(client, source, destination, tokens, *, copy):
    return client.post(
        "/move", json={"old_position": source, "new_position": destination, "tokens": tokens, "copy": copy}
    )


def test_move_to_another_instance_relays_the_chunks_and_drops_them_at_the_source(controller):
    client, monitor_port = controller
    source, destination = instance_engine(monitor_port, "move-a"), instance_engine(monitor_port, "move-b")
    try:
        wait_registered(client, "move-a", 1)
        wait_registered(client, "move-b", 1)
        tokens, kv = request(10, 3)
        assert source.store(tokens, kv) == 3 * CHUNK

        response = move(
            client, ["move-a", "LocalCPUBackend"], ["move-b", "LocalCPUBackend"], tokens, copy=False
        )
        assert response.status_code == 200, response.text
        assert response.json()["num_tokens"] == 3 * CHUNK
        assert response.json()["event_id"].startswith("Move")

        layout = client.post("/lookup", json={"tokens": tokens}).json()["layout_info"]
        assert layout == {"move-b": ["LocalCPUBackend", 3 * CHUNK]}
        assert source.lookup(tokens) == 0
        hit, retrieved = destination.retrieve(tokens)
        assert hit == 3 * CHUNK and same_bits(retrieved, kv)
    finally:
        source.close()
        destination.close()


def test_move_with_copy_keeps_the_source_and_carries_compressed_chunks_to_the_disk_tier(controller, tmp_path):
    client, monitor_port = controller
    source = instance_engine(monitor_port, "copy-a")
    destination = instance_engine(monitor_port, "copy-b", tmp_path)
    try:
        wait_registered(client, "copy-a", 1)
        wait_registered(client, "copy-b", 1)
        tokens, kv = request(11, 2)
        source.store(tokens, kv)
        compressed = client.post(
            "/compress",
            json={
                "instance_id": "copy-a",
                "method": "naive",
                "location": "LocalCPUBackend",
                "tokens": tokens,
            },
        )
        assert compressed.json()["num_tokens"] == 2 * CHUNK

        response = move(
            client, ["copy-a", "LocalCPUBackend"], ["copy-b", "LocalDiskBackend"], tokens, copy=True
        )
        assert response.status_code == 200, response.text
        assert response.json()["num_tokens"] == 2 * CHUNK

        layout = client.post("/lookup", json={"tokens": tokens}).json()["layout_info"]
        assert layout == {"copy-a": ["LocalCPUBackend", 2 * CHUNK], "copy-b": ["LocalDiskBackend", 2 * CHUNK]}
        assert destination.disk is not None
        assert {entry.meta.fmt for entry in destination.disk.committed_entries()} == {"naive"}
        assert destination.cpu.num_chunks == 0  # stored where it was asked, not in the CPU pool
        for engine in (source, destination):
            hit, retrieved = engine.retrieve(tokens)
            assert hit == 2 * CHUNK and same_bits(retrieved, kv)
    finally:
        source.close()
        destination.close()


def test_move_takes_only_the_leading_chunks_held_at_the_source(controller):
    client, monitor_port = controller
    source, destination = instance_engine(monitor_port, "prefix-a"), instance_engine(monitor_port, "prefix-b")
    try:
        wait_registered(client, "prefix-a", 1)
        wait_registered(client, "prefix-b", 1)
        tokens, kv = request(12, 4)
        source.store(tokens[: 2 * CHUNK], kv[:, :, : 2 * CHUNK])
        # The fourth chunk is held too, but behind a missing third one: it is not part of the prefix.
        other_third = tokens[: 2 * CHUNK] + [1] * CHUNK
        source.store(other_third, torch.zeros(LAYERS, 2, 3 * CHUNK, HEADS * HEAD_DIM, dtype=torch.bfloat16))

        response = move(
            client, ["prefix-a", "LocalCPUBackend"], ["prefix-b", "LocalCPUBackend"], tokens, copy=False
        )
        assert response.status_code == 200, response.text
        assert response.json()["num_tokens"] == 2 * CHUNK
        assert destination.lookup(tokens) == 2 * CHUNK
        assert destination.cpu.num_chunks == 2
        hit, retrieved = destination.retrieve(tokens)
        assert hit == 2 * CHUNK and same_bits(retrieved, kv[:, :, : 2 * CHUNK])
        assert source.lookup(tokens) == 0
        assert source.cpu.num_chunks == 1  # other_third's own chunk stays: it was not asked for

        nothing = move(
            client, ["prefix-a", "LocalCPUBackend"], ["prefix-b", "LocalCPUBackend"], tokens, copy=False
        )
        assert nothing.status_code == 200 and nothing.json()["num_tokens"] == 0
    finally:
        source.close()
        destination.close()


@pytest.mark.parametrize(
    ("identity", "named"),
    [({"model_name": "another-model"}, "model"), ({"dtype": torch.float16}, "dtype")],
)
def test_move_between_different_key_spaces_is_refused_and_moves_nothing(controller, identity, named):
    client, monitor_port = controller
    source = instance_engine(monitor_port, f"keys-a-{named}")
    destination = instance_engine(monitor_port, f"keys-b-{named}", **identity)
    try:
        wait_registered(client, f"keys-a-{named}", 1)
        wait_registered(client, f"keys-b-{named}", 1)
        tokens, kv = request(13, 2)
        source.store(tokens, kv)
        response = move(
            client,
            [f"keys-a-{named}", "LocalCPUBackend"],
            [f"keys-b-{named}", "LocalCPUBackend"],
            tokens,
            copy=False,
        )
        assert response.status_code == 409
        assert "keys its chunks differently" in response.json()["detail"]
        assert f"{named}:" in response.json()["detail"]
        assert source.lookup(tokens) == 2 * CHUNK
        assert destination.cpu.num_chunks == 0
    finally:
        source.close()
        destination.close()


def test_move_to_an_unknown_instance_or_one_with_other_workers_is_a_4xx(controller):
    client, monitor_port = controller
    source = instance_engine(monitor_port, "workers-a")
    sharded = tensor_parallel_instance(monitor_port, "workers-tp")
    try:
        wait_registered(client, "workers-a", 1)
        wait_registered(client, "workers-tp", 2)
        tokens, kv = request(14, 1)
        source.store(tokens, kv)
        unknown = move(
            client, ["workers-a", "LocalCPUBackend"], ["nobody", "LocalCPUBackend"], tokens, copy=False
        )
        assert unknown.status_code == 404 and "unknown instance_id 'nobody'" in unknown.json()["detail"]
        uneven = move(
            client, ["workers-a", "LocalCPUBackend"], ["workers-tp", "LocalCPUBackend"], tokens, copy=False
        )
        assert uneven.status_code == 400 and "same workers" in uneven.json()["detail"]
        destination = instance_engine(monitor_port, "workers-b")  # no disk tier
        try:
            wait_registered(client, "workers-b", 1)
            no_disk = move(
                client,
                ["workers-a", "LocalCPUBackend"],
                ["workers-b", "LocalDiskBackend"],
                tokens,
                copy=False,
            )
            assert no_disk.status_code == 400 and "is not configured" in no_disk.json()["detail"]
            assert destination.cpu.num_chunks == 0
        finally:
            destination.close()
        assert source.lookup(tokens) == CHUNK
        assert all(engine.cpu.num_chunks == 0 for engine in sharded)
    finally:
        source.close()
        for engine in sharded:
            engine.close()


def test_move_between_tensor_parallel_instances_pairs_workers_by_rank(controller):
    client, monitor_port = controller
    sources = tensor_parallel_instance(monitor_port, "tp-move-a")
    destinations = tensor_parallel_instance(monitor_port, "tp-move-b")
    try:
        wait_registered(client, "tp-move-a", 2)
        wait_registered(client, "tp-move-b", 2)
        tokens, _ = request(15, 2)
        shards = [request(16 + rank, 2)[1] for rank in range(2)]  # each rank holds its own shard
        for engine, shard in zip(sources, shards, strict=True):
            engine.store(tokens, shard)
        response = move(
            client, ["tp-move-a", "LocalCPUBackend"], ["tp-move-b", "LocalCPUBackend"], tokens, copy=False
        )
        assert response.status_code == 200, response.text
        assert response.json()["num_tokens"] == 2 * CHUNK
        for engine, shard in zip(destinations, shards, strict=True):
            hit, retrieved = engine.retrieve(tokens)
            assert hit == 2 * CHUNK and same_bits(retrieved, shard)
        assert all(engine.lookup(tokens) == 0 for engine in sources)
    finally:
        for engine in sources + destinations:
            engine.close()


# ---- the first compress: codecs warmed up at worker start ----


def test_a_fresh_workers_first_cachegen_compress_is_as_fast_as_the_next(controller):
    """A first /compress once took "worker 0 did not answer in 5.0s": numba compiled CacheGen's CPU
    kernels inside the command. A fresh worker process warms its codecs up at start; its first
    compress then answers well within the ordinary command timeout, as its second does."""
    client, monitor_port = controller
    with worker_process(monitor_port, "first-compress", seeds=[31, 32]) as warm_up_s:
        wait_registered(client, "first-compress", 1)
        took = []
        for seed in (31, 32):
            tokens, _ = request(seed, 2)
            body = {"instance_id": "first-compress", "method": "cachegen", "location": "LocalCPUBackend"}
            started = time.perf_counter()
            response = client.post("/compress", json={**body, "tokens": tokens})
            took.append(time.perf_counter() - started)
            assert response.status_code == 200, response.text
            assert response.json()["num_tokens"] == 2 * CHUNK
    first_s, second_s = took
    print(f"codec warm-up {warm_up_s:.2f} s; compress: first {first_s:.3f} s, second {second_s:.3f} s")
    # Bounds, not timings: the first compiled nothing (a compile takes seconds, the compress
    # milliseconds), so it is within the ordinary timeout with room to spare.
    assert first_s < COMMAND_TIMEOUT_S / 2
    assert first_s < second_s + 1.0


def test_a_compress_during_the_codec_warm_up_is_refused_with_what_to_do(controller, monkeypatch):
    import cachelayer.compress
    from cachelayer.controller import worker as worker_module

    release = threading.Event()
    monkeypatch.setattr(cachelayer.compress, "warm_up", lambda dtype: release.wait(60) and 0.0)
    monkeypatch.setattr(worker_module, "CODEC_WARM_UP_WAIT_S", 0.2)
    client, monitor_port = controller
    engine = make_engine(8, **worker_config(monitor_port, "warming"))
    worker = attach_controller_worker(engine, engine.config)
    try:
        wait_registered(client, "warming", 1)
        tokens, kv = request(33, 2)
        engine.store(tokens, kv)
        engine.flush()
        body = {
            "instance_id": "warming",
            "method": "cachegen",
            "location": "LocalCPUBackend",
            "tokens": tokens,
        }
        refused = client.post("/compress", json=body)
        assert refused.status_code == 503  # try again later, not a bad request
        detail = refused.json()["detail"]
        assert "still being compiled" in detail and "NUMBA_CACHE_DIR" in detail
        assert "send the compress again in" in detail
        assert {entry.meta.fmt for entry in engine.cpu.committed_entries()} != {"cachegen"}  # nothing ran
        release.set()
        assert worker.codecs_warm.wait(10)
        assert client.post("/compress", json=body).json()["num_tokens"] == 2 * CHUNK
    finally:
        release.set()
        engine.close()


def test_the_command_timeout_follows_the_kv_of_the_tokens_a_command_carries():
    many = list(range(100_000))
    per_token = 28 * 2 * 1024 * 2  # a 28-layer model's bf16 K and V, 8 heads of 128
    compress = Command(op="compress", tokens=many)
    expected = COMMAND_TIMEOUT_S + COMMAND_SECONDS_PER_KV_BYTE * 100_000 * per_token
    assert command_timeout_s(compress, per_token) == pytest.approx(expected)
    assert command_timeout_s(compress, 2 * per_token) > command_timeout_s(compress, per_token)
    # Not reported: an 8B model's size is assumed.
    assert command_timeout_s(compress) == pytest.approx(
        COMMAND_TIMEOUT_S + COMMAND_SECONDS_PER_KV_BYTE * 100_000 * DEFAULT_KV_BYTES_PER_TOKEN
    )
    assert command_timeout_s(Command(op="lookup", tokens=many), per_token) == COMMAND_TIMEOUT_S
    assert command_timeout_s(Command(op="health")) == COMMAND_TIMEOUT_S


def test_workers_report_their_kv_bytes_per_token(controller):
    client, monitor_port = controller
    engine = make_engine(4, **worker_config(monitor_port, "sized"))
    worker = attach_controller_worker(engine, engine.config)
    try:
        wait_registered(client, "sized", 1)
        report = worker._report("heartbeat")
        assert report.kv_bytes_per_token == LAYERS * 2 * HEADS * HEAD_DIM * 2  # bf16
    finally:
        engine.close()

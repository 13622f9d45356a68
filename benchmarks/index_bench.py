"""Prefix-index benchmark: events applied per second, lookup latency, memory per cached block.

Setup: 16 backends and 1M cached 16-token blocks (vLLM-style prefill events of 64 blocks each),
plus four 32k-token documents cached to different depths on different backends. Measured for
`before` (router/index/prefix_index.py at commit BASELINE_REVISION, read from git history at run
time: the index before the decode-step and lookup work) and `after` (router/index, one-block events
through the compiled path of router/index/_ingest.pyx when it is built; the report says which path
ran), and the ingest rows also for `after_python` (the same index with `compiled_ingest=False`: the
pure-Python fallback). Ingest is measured twice: each index alone in a child process of its own,
`--rounds` times in rotated order (`own_process_rounds`: the absolute rates, read against the
target), and side by side in one process, each batch applied to every index in turn (alternating
the order), so all see the same load on this shared machine and the ratios hold even when absolute
numbers drift. Lookups are side by side too.
- ingest: blocks/s for prefill events (64 blocks, alone or 8 per batch), decode events (1 block,
  alone or 32 per batch), removals (64 blocks an event; one block alone, as vLLM announces each
  evicted block), decode steps on a full cache (each step's batch: 32 one-block removals, then
  32 one-block stores); what the subscriber hands over for a drained burst of
  messages (16 decode steps of 32 requests in one call; 512 one-block events of one request in
  one call); and from the wire: msgpack payloads (vLLM >= 0.24 encoding) decoded and applied, or
  for `after` scanned and applied undecoded (`IndexWriter.wire_ingest`), one message per call;
- one-block events alone in their batch through a real ZMQ PUB -> SUB: the receiving thread's CPU
  per message for recv alone, + decode, + apply (the floor that ZMQ and msgpack set for that
  shape), the same with the GC paused, recv + scan + apply undecoded, and the real
  `EventSubscriber` as the gateway wires it (its drain loop, payloads scanned);
- lookup: 1k / 8k / 32k-token prompts against all 16 backends, next to a straightforward
  per-backend, per-block Python walk over the same keys; 8k prompts as Python lists with the
  router keys passed in (`keys=`), and kv_aware's pair of calls (keys + lookup);
- memory: process RSS growth per cached block (each implementation alone, in a child process).
Targets (issue 3): >= 500k block events/s on one core; an 8k-token lookup under 200 us.
Anchor (not measured here): Dynamo's Rust indexer reports about 1M events/s, microsecond lookups.

Run: .venv/bin/python -m benchmarks.index_bench [--blocks 1000000] [--rounds 3] [--out benchmarks/results]
CPU times are process CPU seconds (the machines are shared; wall time would count other work).
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import zmq

from kvgate_testing.index_bench_report import markdown_report, plot
from kvgate_testing.index_oracle import WritableIndex
from kvgate_testing.provenance import with_source
from kvwire import (
    BlockRemoved,
    BlockStored,
    decode_batch,
    decode_seq,
    encode_batch,
    encode_seq,
)
from router.index.ingest import WireIngest
from router.index.keys import namespace_seed, prefix_keys, prompt_prefix_keys
from router.index.store import BackendIndexStats
from router.index.transport import EventSubscriber, receive_frames

BACKENDS = 16
PREFILL_BLOCKS = 64  # 1024-token prompts
LONG_DOC_TOKENS = 32 * 1024
TARGET_EVENTS_PER_S = 500_000
# Lone one-block events: calls timed together on each index in turn (`SideBySide.apply_calls`).
LONE_CALLS_PER_TIMING = 256
TARGET_LOOKUP_8K_US = 200.0
# The index before the decode-step and lookup work (the commit before it), loaded from git history so
# that no frozen copy lives in the tree. (Runs before that compared with eee4511, the index before
# the first ingest work.)
BASELINE_REVISION = "fc54b18"


def load_baseline_index(revision: str = BASELINE_REVISION) -> ModuleType:
    root = Path(__file__).resolve().parent.parent
    source = subprocess.run(
        ["git", "show", f"{revision}:router/index/prefix_index.py"],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    # The wire types it imports have moved from router/index/events.py to kvwire since then.
    source = source.replace("from router.index.events import", "from kvwire import")
    module = ModuleType("index_baseline")
    module.__file__ = f"{revision}:router/index/prefix_index.py"
    sys.modules[module.__name__] = module  # dataclasses look their module up while the class is built
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    return module


IMPLEMENTATIONS: dict[str, Callable[[], Any]] = {
    "before": load_baseline_index().PrefixIndex,
    "after": WritableIndex,
    # The working tree's index with its compiled one-block path switched off: the pure-Python
    # paths `after` falls back to when the extension is not built (ingest rows only; lookups and
    # memory are the same code as `after`'s).
    "after_python": lambda: WritableIndex(compiled_ingest=False),
}
# Lookups and memory are measured for these (the fallback's are `after`'s).
COMPARED = ("before", "after")
# Every side decodes with the working tree's events.py (the wire rows compare the indexes).
DECODERS = dict.fromkeys(IMPLEMENTATIONS, decode_batch)


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def apply_payload(index: Any, wire: WireIngest | None, backend: str, payload: bytes,
                  decode: Callable[[bytes], Any] = decode_batch) -> None:  # fmt: skip
    """One message's payload to `index` as the subscriber hands it over: scanned and applied
    undecoded when `wire` (the index's `wire_ingest`) takes it, else decoded and applied."""
    scanned = wire.scan(payload) if wire is not None else None
    if scanned is not None:
        wire.apply([scanned])  # type: ignore[union-attr]
    else:
        index.apply(backend, decode(payload).events)


class SideBySide:
    """Applies each batch to every implementation's index in turn and sums each one's CPU time."""

    def __init__(self, names: Sequence[str] = tuple(IMPLEMENTATIONS)) -> None:
        self.indexes = {name: IMPLEMENTATIONS[name]() for name in names}
        self.seconds = dict.fromkeys(self.indexes, 0.0)
        self._turn = 0

    def order(self) -> list[str]:
        """The indexes in turn, rotated by one each batch: no index ever applies two batches in a
        row (with warm caches), and every index sees the same pattern of predecessors. (Reversing
        the order, as this did for two, lets the first and last of three apply twice in a row at
        each turn while the middle one never does: it made `after` look slower.)"""
        names = list(self.indexes)
        self._turn += 1
        shift = self._turn % len(names)
        return names[shift:] + names[:shift]

    def apply(self, backend: str, events: list) -> None:
        for name in self.order():
            index = self.indexes[name]
            started = time.process_time()
            index.apply(backend, events)
            self.seconds[name] += time.process_time() - started

    def apply_calls(self, backend: str, batches: list[list]) -> None:
        """Each batch in one `apply` call of its own, the whole list timed at once on each index in
        turn: for batches of one event, a timer pair per call (0.4 us of process_time here) would
        be a fifth of what is measured. The cyclic GC is paused meanwhile, as the subscriber pauses
        it while it drains and applies (`EventSubscriber._drain`)."""
        for name in self.order():
            apply = self.indexes[name].apply
            gc.disable()
            started = time.process_time()
            for events in batches:
                apply(backend, events)
            self.seconds[name] += time.process_time() - started
            gc.enable()

    def apply_wire(self, backend: str, payloads: list[bytes]) -> None:
        """Each payload as the subscriber hands over one message: scanned and applied undecoded
        where the index has a wire ingest (`IndexWriter.wire_ingest`: `after`) and the scan
        accepts it, else decoded and applied; the list timed at once on each index in turn.

        The cyclic GC is paused while one side decodes and applies (`apply` pauses it anyway):
        left on, a young-generation collection that both sides' allocations brought about lands
        on whichever side decodes next, and with the sides alternating that is often the same
        side (measured: 15% of the wire decode-step row charged to one side)."""
        for name in self.order():
            index, decode = self.indexes[name], DECODERS[name]
            wire = getattr(index, "wire_ingest", lambda _backend: None)(backend)
            gc.disable()
            started = time.process_time()
            for payload in payloads:
                apply_payload(index, wire, backend, payload, decode)
            self.seconds[name] += time.process_time() - started
            gc.enable()

    def measure(self, run: Callable[[], tuple[int, int]], **extra: Any) -> dict[str, Any]:
        """Run a workload; per implementation blocks/s and events/s, plus the ratio after/before."""
        self.seconds = dict.fromkeys(self.indexes, 0.0)
        blocks, events = run()
        result: dict[str, Any] = {"blocks": blocks, "events": events, **extra}
        for name, seconds in self.seconds.items():
            result[name] = {
                "cpu_s": seconds,
                "blocks_per_s": blocks / seconds,
                "events_per_s": events / seconds,
            }
        if len(self.indexes) == len(IMPLEMENTATIONS):
            result["speedup"] = result["after"]["blocks_per_s"] / result["before"]["blocks_per_s"]
            python = result["after_python"]["blocks_per_s"]
            result["after_over_python"] = result["after"]["blocks_per_s"] / python
        return result


def prefill_events(total_blocks: int, rng: np.random.Generator):
    """(backend, [event]) for 1024-token prompts spread over the backends, hashes 1, 2, ..."""
    prompts_per_backend = total_blocks // BACKENDS // PREFILL_BLOCKS
    next_hash = 1
    for _ in range(prompts_per_backend):
        tokens = rng.integers(0, 150_000, size=(BACKENDS, PREFILL_BLOCKS * 16), dtype=np.int64)
        for b in range(BACKENDS):
            hashes = list(range(next_hash, next_hash + PREFILL_BLOCKS))
            next_hash += PREFILL_BLOCKS
            yield (
                f"b{b}",
                [BlockStored(block_hashes=hashes, token_ids=tokens[b].tolist(), block_size=16, medium="GPU")],
            )


def build(bench: SideBySide, total_blocks: int, rng: np.random.Generator) -> dict:
    def run() -> tuple[int, int]:
        events = 0
        for backend, batch in prefill_events(total_blocks, rng):
            bench.apply(backend, batch)
            events += 1
        return events * PREFILL_BLOCKS, events

    return bench.measure(run, blocks_per_event=PREFILL_BLOCKS, events_per_batch=1)


def decode_ingest(bench: SideBySide, count: int, rng: np.random.Generator) -> dict:
    """Single-block events chained on each other, one per batch."""
    return bench.measure(_lone_events(bench, count, 10**12, rng), blocks_per_event=1, events_per_batch=1)


def _lone_events(
    bench: SideBySide, count: int, base: int, rng: np.random.Generator
) -> Callable[[], tuple[int, int]]:
    def run() -> tuple[int, int]:
        parent = None
        calls: list[list] = []
        for i in range(count):
            event = BlockStored(
                block_hashes=[base + i],
                parent_block_hash=parent,
                token_ids=rng.integers(0, 150_000, size=16).tolist(),
                block_size=16,
            )
            calls.append([event])
            parent = base + i
            if len(calls) == LONE_CALLS_PER_TIMING:
                bench.apply_calls("b0", calls)
                calls = []
        bench.apply_calls("b0", calls)
        return count, count

    return run


def decode_step_batches(steps: int, running: int, base: int, rng: np.random.Generator):
    """Engine steps of `running` concurrent requests, each step's batch one new block per request."""
    parents: list[int | None] = [None] * running
    for step in range(steps):
        batch = []
        for request in range(running):
            block_hash = base + step * running + request
            batch.append(
                BlockStored(
                    block_hashes=[block_hash],
                    parent_block_hash=parents[request],
                    token_ids=rng.integers(0, 150_000, size=16).tolist(),
                    block_size=16,
                )
            )
            parents[request] = block_hash
        yield batch


def decode_batched_ingest(bench: SideBySide, steps: int, running: int, rng: np.random.Generator) -> dict:
    def run(base: int) -> tuple[int, int]:
        for batch in decode_step_batches(steps, running, base, rng):
            bench.apply("b2", batch)
        return steps * running, steps * running

    return bench.measure(lambda: run(2 * 10**12), blocks_per_event=1, events_per_batch=running)


def drained_ingest(bench: SideBySide, calls: int, running: int, steps_per_call: int, base: int,
                   rng: np.random.Generator) -> dict:  # fmt: skip
    """What the subscriber hands the index after draining a burst of queued messages: the events
    of `steps_per_call` decode steps of `running` requests in one call (parents earlier in the list)."""

    def run(base: int) -> tuple[int, int]:
        steps = decode_step_batches(calls * steps_per_call, running, base, rng)
        backend = f"b{7 + running % 8}"
        for _ in range(calls):
            bench.apply(backend, [event for _ in range(steps_per_call) for event in next(steps)])
        blocks = calls * steps_per_call * running
        return blocks, blocks

    return bench.measure(lambda: run(base), blocks_per_event=1, events_per_batch=running * steps_per_call)


def prefill_batched_ingest(bench: SideBySide, batches: int, per_batch: int, rng: np.random.Generator) -> dict:
    """Prefills of several requests announced in one engine step's batch (chunked prefill)."""

    def run() -> tuple[int, int]:
        next_hash = 5 * 10**12
        for _ in range(batches):
            batch = []
            for _ in range(per_batch):
                hashes = list(range(next_hash, next_hash + PREFILL_BLOCKS))
                next_hash += PREFILL_BLOCKS
                tokens = rng.integers(0, 150_000, size=PREFILL_BLOCKS * 16).tolist()
                batch.append(BlockStored(block_hashes=hashes, token_ids=tokens, block_size=16, medium="GPU"))
            bench.apply("b5", batch)
        return batches * per_batch * PREFILL_BLOCKS, batches * per_batch

    return bench.measure(run, blocks_per_event=PREFILL_BLOCKS, events_per_batch=per_batch)


def wire_payload(events: list[BlockStored]) -> bytes:
    """An EventBatch as vLLM >= 0.24 publishes it: array batch, map-encoded events."""
    return encode_batch(events, ts=time.time(), data_parallel_rank=0)


def wire_ingest(bench: SideBySide, batches: list[list[BlockStored]], backend: str) -> dict:
    payloads = [wire_payload(batch) for batch in batches]
    blocks = sum(len(event.block_hashes) for batch in batches for event in batch)
    events = sum(len(batch) for batch in batches)

    def run() -> tuple[int, int]:
        for start in range(0, len(payloads), LONE_CALLS_PER_TIMING):
            bench.apply_wire(backend, payloads[start : start + LONE_CALLS_PER_TIMING])
        return blocks, events

    return bench.measure(
        run, blocks_per_event=blocks // events, events_per_batch=events // len(batches), decoded=True
    )


def _publish(connection: Any, payloads: list[bytes]) -> None:
    """Child process: bind a PUB, tell the parent its port, then send every payload as a live message."""
    context = zmq.Context()
    pub = context.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    connection.send(pub.bind_to_random_port("tcp://127.0.0.1"))
    time.sleep(1.0)  # PUB drops messages until the SUB's connection is up (ZMQ's slow joiner)
    for seq, payload in enumerate(payloads):
        pub.send_multipart([b"kv-events", encode_seq(seq), payload])
    pub.close(linger=-1)
    context.term()


FLOOR_STAGES = (
    "recv", "recv_decode", "recv_decode_apply", "recv_decode_apply_gc_paused", "recv_scan_apply",
    "subscriber",
)  # fmt: skip


def message_floor(payloads: list[bytes], index: Any, backend: str, rounds: int = 3) -> dict:
    """Per-message CPU cost of the subscriber's fixed work for one-event batches, from a real ZMQ
    PUB -> SUB over loopback TCP: receiving the 3 frames alone; + seq and msgpack decode; + apply;
    the same with the cyclic GC paused (what collections cost that loop); receiving, then the seq,
    and the payload scanned and applied undecoded (`IndexWriter.wire_ingest`); and the real
    `EventSubscriber` thread as the gateway makes it (drained messages scanned, applied together).

    The messages are all queued before the receiving thread drains them (as the subscriber does,
    with NOBLOCK), so the thread's CPU time counts the work, never a wait. Each stage gets its own
    publisher process (forked before this process opens any ZMQ context); apply stores into
    `index`, under a backend of its own per stage, removed after the stage. The stages run in turn,
    `rounds` times (this shared machine's load moves them by a third between runs): the median
    round is reported, every round kept.
    """
    rounds_us: dict[str, list[float]] = {stage: [] for stage in FLOOR_STAGES}
    for round_ in range(rounds):
        for number, stage in enumerate(FLOOR_STAGES):
            parent_end, child_end = multiprocessing.Pipe()
            publisher = multiprocessing.get_context("fork").Process(
                target=_publish, args=(child_end, payloads)
            )
            publisher.start()
            port = parent_end.recv()
            stage_backend = f"{backend}-{round_}-{number}"
            if stage == "subscriber":
                received, cpu = _through_subscriber(port, publisher, index, stage_backend, len(payloads))
            else:
                received, cpu = _drain_socket(port, publisher, stage, index, stage_backend)
            index.remove_backend(stage_backend)  # the next stage stores the same blocks afresh
            assert received == len(payloads), f"{stage}: received {received} of {len(payloads)} messages"
            rounds_us[stage].append(cpu / received * 1e6)
    result = {}
    for stage, values in rounds_us.items():
        median = statistics.median(values)
        result[stage] = {"messages": len(payloads), "us_per_message": median, "messages_per_s": 1e6 / median,
                         "rounds_us": values}  # fmt: skip
    return result


def _drain_socket(port: int, publisher: Any, stage: str, index: Any, backend: str) -> tuple[int, float]:
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.RCVHWM, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
        sub.connect(f"tcp://127.0.0.1:{port}")
        publisher.join(120)
        time.sleep(0.5)  # the last messages reach the SUB's queue
        received = 0
        wire = index.wire_ingest(backend)
        collecting = gc.isenabled()
        if stage.endswith("gc_paused"):
            gc.disable()
        started = time.thread_time()
        while True:
            try:
                _topic, seq_frame, payload = receive_frames(sub)
            except zmq.Again:
                break
            received += 1
            if stage == "recv_scan_apply":
                decode_seq(seq_frame)
                apply_payload(index, wire, backend, payload)
            elif stage != "recv":
                decode_seq(seq_frame)
                batch = decode_batch(payload)
                if stage.startswith("recv_decode_apply"):
                    index.apply(backend, batch.events)
        if collecting:
            gc.enable()
            gc.collect(0)  # the young collection the pause put off, counted with the drain
        cpu = time.thread_time() - started
    finally:
        if publisher.is_alive():
            publisher.kill()
        sub.close(0)
        context.term()
    return received, cpu


def _through_subscriber(port: int, publisher: Any, index: Any, backend: str, count: int) -> tuple[int, float]:
    """The real subscriber thread: its first apply waits until every message is queued (as in the
    other stages), then it drains them; its thread CPU clock counts its work only."""
    queued = threading.Event()

    def apply(events: list) -> None:
        queued.wait(120)
        index.apply(backend, events)

    def apply_payloads(payloads: list[bytes]) -> list:
        queued.wait(120)
        return index.apply_payloads(backend, payloads)

    context = zmq.Context()
    subscriber = EventSubscriber(
        backend, f"tcp://127.0.0.1:{port}", apply, lambda: index.clear_backend(backend), topic="kv-events",
        context=context, apply_payloads=apply_payloads,
    )  # fmt: skip
    subscriber.start()
    try:
        clock = time.pthread_getcpuclockid(subscriber._thread.ident)  # type: ignore[arg-type]
        started = time.clock_gettime(clock)
        publisher.join(120)
        time.sleep(0.5)  # the last messages reach the SUB's queue
        queued.set()
        deadline = time.monotonic() + 300
        # Every block in the index (the last ones are applied at the end of the last drain).
        while time.monotonic() < deadline:
            if (index.stats(backend) or BackendIndexStats()).stored_events >= count:
                break
            time.sleep(0.01)
        cpu = time.clock_gettime(clock) - started
    finally:
        if publisher.is_alive():
            publisher.kill()
        subscriber.stop()
        context.term()
    return subscriber.stats.batches, cpu


def _assert_known_removals(bench: SideBySide, backend: str) -> None:
    """Every index of `bench` removed only blocks it held on `backend` (the row measured removals)."""
    for index in bench.indexes.values():
        stats = index.stats(backend)
        assert stats is not None and stats.unknown_removals == 0, f"{backend}: removed unknown blocks"


def removal_ingest(bench: SideBySide, count_events: int) -> dict:
    """BlockRemoved of 64 blocks each (the first prompts stored on b1)."""

    def run() -> tuple[int, int]:
        # Hashes of b1's prompts: prompt p on backend b got hashes from 1 + (p * BACKENDS + b) * 64.
        for p in range(count_events):
            first = 1 + (p * BACKENDS + 1) * PREFILL_BLOCKS
            bench.apply(
                "b1", [BlockRemoved(block_hashes=list(range(first, first + PREFILL_BLOCKS)), medium="GPU")]
            )
        return count_events * PREFILL_BLOCKS, count_events

    result = bench.measure(run, blocks_per_event=PREFILL_BLOCKS, events_per_batch=1)
    _assert_known_removals(bench, "b1")
    return result


def _prompt_blocks_tail_first(backend_number: int, prompts: int) -> Iterator[int]:
    """The hashes of one backend's first `prompts` prompts of the build, each prompt's from its
    last block back: the order in which vLLM evicts a finished request's blocks."""
    for prompt in range(prompts):
        first = 1 + (prompt * BACKENDS + backend_number) * PREFILL_BLOCKS
        yield from range(first + PREFILL_BLOCKS - 1, first - 1, -1)


def lone_removal_ingest(bench: SideBySide, count: int, prompts_per_backend: int) -> dict:
    """One-block BlockRemoved, each alone in its batch: vLLM announces every evicted block in an
    event of its own, and a step that evicts one block publishes a batch of one (b10's prompts)."""
    count = min(count, prompts_per_backend * PREFILL_BLOCKS)

    def run() -> tuple[int, int]:
        victims = _prompt_blocks_tail_first(10, -(-count // PREFILL_BLOCKS))
        calls = [[BlockRemoved(block_hashes=[next(victims)], medium="GPU")] for _ in range(count)]
        for start in range(0, count, LONE_CALLS_PER_TIMING):
            bench.apply_calls("b10", calls[start : start + LONE_CALLS_PER_TIMING])
        return count, count

    result = bench.measure(run, blocks_per_event=1, events_per_batch=1)
    _assert_known_removals(bench, "b10")
    return result


def evicting_decode_ingest(
    bench: SideBySide, steps: int, running: int, prompts_per_backend: int, rng: np.random.Generator
) -> dict:
    """Decode steps on a full cache: each step's batch evicts one block per request (one-block
    BlockRemoved of b9's oldest prompts, as vLLM announces evictions, before the stores) and stores
    one block per request."""
    steps = min(steps, prompts_per_backend * PREFILL_BLOCKS // running)

    def run() -> tuple[int, int]:
        victims = _prompt_blocks_tail_first(9, -(-steps * running // PREFILL_BLOCKS))
        for batch in decode_step_batches(steps, running, 9 * 10**12, rng):
            evicted = [BlockRemoved(block_hashes=[next(victims)], medium="GPU") for _ in range(running)]
            bench.apply("b9", evicted + batch)
        return 2 * steps * running, 2 * steps * running

    result = bench.measure(run, blocks_per_event=1, events_per_batch=2 * running)
    _assert_known_removals(bench, "b9")
    return result


def ingest_rows(bench: SideBySide, decode_events: int, prefill_events_applied: int,
                rng: np.random.Generator) -> dict[str, dict]:  # fmt: skip
    """Every ingest row but the build's (`build`), in one order, on the indexes of `bench`."""
    rows = {
        "decode_events": decode_ingest(bench, decode_events, rng),
        "decode_events_batched": decode_batched_ingest(bench, max(1, decode_events // 32), 32, rng),
        "prefill_events_batched": prefill_batched_ingest(bench, max(1, decode_events // 256), 8, rng),
        "decode_events_drained": drained_ingest(bench, max(1, decode_events // 512), 32, 16, 7 * 10**12, rng),
        "lone_events_drained": drained_ingest(bench, max(1, decode_events // 512), 1, 512, 8 * 10**12, rng),
    }
    rows["wire_prefill_events"] = wire_ingest(
        bench,
        [
            [
                BlockStored(
                    block_hashes=list(range(first, first + PREFILL_BLOCKS)),
                    token_ids=rng.integers(0, 150_000, size=PREFILL_BLOCKS * 16).tolist(),
                    block_size=16,
                )
            ]
            for first in range(
                3 * 10**12, 3 * 10**12 + PREFILL_BLOCKS * max(1, decode_events // 64), PREFILL_BLOCKS
            )
        ],
        "b3",
    )
    rows["wire_decode_events_batched"] = wire_ingest(
        bench, list(decode_step_batches(max(1, decode_events // 32), 32, 4 * 10**12, rng)), "b4"
    )
    rows["wire_decode_events_lone"] = wire_ingest(
        bench, list(decode_step_batches(decode_events, 1, 11 * 10**12, rng)), "b11"
    )
    rows["removal_events"] = removal_ingest(bench, min(2000, prefill_events_applied // BACKENDS))
    prompts_per_backend = prefill_events_applied // BACKENDS
    rows["removal_events_lone"] = lone_removal_ingest(bench, decode_events, prompts_per_backend)
    rows["evicting_decode_steps"] = evicting_decode_ingest(
        bench, max(1, decode_events // 64), 32, prompts_per_backend, rng
    )
    return rows


def grow_past_next_resize(mapping: dict) -> None:
    """Make `mapping` resize now, not inside a timed row: insert keys no event uses (negative
    ints) until its table grows, then delete them (a dict never shrinks on delete).

    The rows add about 450k keys to a 1M-key index, so the million-key dicts cross a resize
    threshold (2/3 of 2**21 slots: 1,398,101 keys) in one of them. Rebuilding 1.4M keys takes about
    0.1 s, as long as a whole row: it halved whichever row crossed it (the wire decode-step row
    here, every round: 341k blocks/s against 760-820k for the same row run again after the resize).
    Amortized over the keys that filled the table it is about 0.07 us a key."""
    size = sys.getsizeof(mapping)
    dummy = -1
    while sys.getsizeof(mapping) == size:
        mapping[dummy] = 0
        dummy -= 1
    for key in range(dummy + 1, 0):
        del mapping[key]


def ingest_in_own_process(name: str, total_blocks: int, decode_events: int) -> dict[str, float]:
    """Blocks/s of every ingest row for one implementation, built and run alone (in a child
    process): the index a gateway holds, with nothing else's dicts in the caches. Every child
    builds the same index and applies the same events (the same seed). The million-key dicts
    (the prefix-key map; each backend's engine-hash map) are grown past their next resize first
    (`grow_past_next_resize`), so that no row pays another's share of a resize."""
    rng = np.random.default_rng(2026)
    bench = SideBySide((name,))
    prefill = build(bench, total_blocks, rng)
    index = bench.indexes[name]
    # (the baseline index keeps its prefix map private)
    grow_past_next_resize(index.holders if hasattr(index, "holders") else index._holders)
    for backend in index._backends.values():
        grow_past_next_resize(backend.nodes)
    gc.collect()
    gc.freeze()
    rows = {"prefill_events": prefill, **ingest_rows(bench, decode_events, prefill["events"], rng)}
    return {row: entry[name]["blocks_per_s"] for row, entry in rows.items()}


def own_process_rounds(total_blocks: int, decode_events: int, rounds: int) -> dict[str, dict[str, Any]]:
    """`ingest_in_own_process` for every implementation, `rounds` times, the order rotated each
    round (a drift of the shared machine's load falls on each in turn): per implementation and
    row, every round's blocks/s and their median."""
    names = list(IMPLEMENTATIONS)
    measured: dict[str, dict[str, list[float]]] = {name: {} for name in names}
    for turn in range(rounds):
        for name in names[turn % len(names) :] + names[: turn % len(names)]:
            with multiprocessing.get_context("fork").Pool(1, maxtasksperchild=1) as pool:
                rates = pool.apply(ingest_in_own_process, (name, total_blocks, decode_events))
            for row, rate in rates.items():
                measured[name].setdefault(row, []).append(rate)
        latest = ", ".join(f"{row} {rates[-1]:,.0f}" for row, rates in measured["after"].items())
        print(f"own-process round {turn + 1}/{rounds}, after: {latest}", flush=True)
    return {
        name: {row: {"rounds": rates, "median": statistics.median(rates)} for row, rates in rows.items()}
        for name, rows in measured.items()
    }


def memory_per_block(name: str, total_blocks: int) -> dict:
    """RSS growth per cached block of one implementation alone (run in a child process)."""
    gc.collect()
    before = rss_bytes()
    index = IMPLEMENTATIONS[name]()
    for backend, batch in prefill_events(total_blocks, np.random.default_rng(2026)):
        index.apply(backend, batch)
    gc.collect()
    grown = rss_bytes() - before
    blocks = index.size()["engine_blocks"]
    return {"engine_blocks": blocks, "router_keys": index.size()["router_keys"],
            "rss_growth_bytes": grown, "bytes_per_block": grown / blocks}  # fmt: skip


def cache_long_documents(bench: SideBySide, rng: np.random.Generator) -> list[np.ndarray]:
    """Four 32k-token documents; backend b holds document b % 4 up to (b // 4 + 1) quarters."""
    docs = [rng.integers(0, 150_000, size=LONG_DOC_TOKENS, dtype=np.int64) for _ in range(4)]
    for b in range(BACKENDS):
        doc = docs[b % 4]
        held = LONG_DOC_TOKENS * (b // 4 + 1) // 4
        first = 10**13 + b * 10**6
        event = BlockStored(
            block_hashes=list(range(first, first + held // 16)), token_ids=doc[:held].tolist(), block_size=16
        )
        bench.apply(f"b{b}", [event])
    return docs


def naive_walk(per_backend_keys: dict[str, set[int]], tokens: np.ndarray) -> dict[str, int]:
    """The straightforward alternative: per backend, walk the prompt's blocks until one is missing."""
    keys = prefix_keys(np.asarray(tokens, dtype=np.uint32), namespace_seed((None, None))).tolist()
    result = {}
    for name, held in per_backend_keys.items():
        count = 0
        for key in keys:
            if key not in held:
                break
            count += 1
        result[name] = count * 16
    return result


def time_lookups(functions: dict[str, Callable], prompts: list[np.ndarray], repeat: int) -> dict:
    """Wall and process-CPU time per lookup, the functions interleaved prompt by prompt."""
    wall: dict[str, list[float]] = {name: [] for name in functions}
    cpu: dict[str, list[float]] = {name: [] for name in functions}
    for round_ in range(repeat):
        for prompt in prompts:
            names = list(functions) if round_ % 2 else list(functions)[::-1]
            for name in names:
                started, started_cpu = time.perf_counter(), time.process_time()
                functions[name](prompt)
                cpu[name].append(time.process_time() - started_cpu)
                wall[name].append(time.perf_counter() - started)
    results = {}
    for name in functions:
        w, c = sorted(wall[name]), sorted(cpu[name])
        results[name] = {
            "median_us": statistics.median(w) * 1e6,
            "p90_us": w[int(len(w) * 0.9)] * 1e6,
            "p99_us": w[int(len(w) * 0.99)] * 1e6,
            "min_us": w[0] * 1e6,
            "cpu_median_us": statistics.median(c) * 1e6,
            "samples": len(w),
        }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=1_000_000)
    parser.add_argument("--decode-events", type=int, default=50_000)
    parser.add_argument("--repeat", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3, help="ingest rounds, each index in its own process")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()

    # A fresh child per implementation, one at a time: RSS is per process and never shrinks.
    with multiprocessing.get_context("fork").Pool(1, maxtasksperchild=1) as pool:
        memory = {name: pool.apply(memory_per_block, (name, args.blocks)) for name in COMPARED}
    print("memory:", {name: f"{m['bytes_per_block']:.0f} B/block" for name, m in memory.items()})
    own_process = own_process_rounds(args.blocks, args.decode_events, args.rounds)

    rng = np.random.default_rng(2026)
    bench = SideBySide()
    prefill = build(bench, args.blocks, rng)
    docs = cache_long_documents(bench, rng)
    # The two built indexes move to the GC's permanent generation: otherwise a rare full collection
    # (hundreds of ms over both heaps) lands on whichever side happens to trigger it, and one such
    # lump decides a short workload's ratio. Applying a batch pauses the GC anyway.
    gc.collect()
    gc.freeze()
    print(f"prefill ingest: {_rates(prefill)}", flush=True)

    after = bench.indexes["after"]
    lookups = {}
    slots = {f"b{b}": after._backends[f"b{b}"].tier_slots["gpu"] for b in range(BACKENDS)}
    per_backend_keys: dict[str, set[int]] = {name: set() for name in slots}
    for key, mask in after.holders.items():  # the naive baseline's own structure, built once
        for name, slot in slots.items():
            if mask >> slot & 1:
                per_backend_keys[name].add(key)
    # Prompts reusing a cached document almost whole (the worst case: every block is probed), and
    # "8192-new-after-1k": 1k cached tokens then new text (the common case: a shared system prompt).
    # "8192-from-list": the 8k prompts as Python lists of ints, as the gateway's policies pass them;
    # "8192-with-keys": the same with the router keys passed in (`keys=`; `before` cannot take them
    # and computes them itself); "8192-kv-aware": kv_aware's pair of calls per request, the keys
    # (`prompt_prefix_keys`, which it keeps for its predictions) and the lookup: `after` computes
    # the keys once and passes them, `before` computes them in both calls.
    shapes = ((1024, 960, ""), (8192, 8128, ""), (32768, 32704, ""), (8192, 1024, ""))
    for length, cached_part, as_list in (*shapes, (8192, 8128, "from-list"), (8192, 8128, "with-keys"),
                                         (8192, 8128, "kv-aware")):  # fmt: skip
        prompts = [
            np.concatenate([doc[:cached_part], rng.integers(0, 150_000, size=length - cached_part)])
            for doc in docs
        ]
        prompts32 = [p.astype(np.uint32) for p in prompts]
        expected = {n: m.tokens for n, m in after.longest_cached_prefix(prompts32[0]).items()}
        before = {n: m.tokens for n, m in bench.indexes["before"].longest_cached_prefix(prompts32[0]).items()}
        assert expected == naive_walk(per_backend_keys, prompts32[0]) == before, "lookups disagree"
        label = str(length) if cached_part > length // 2 else f"{length}-new-after-{cached_part // 1024}k"
        functions = {name: bench.indexes[name].longest_cached_prefix for name in COMPARED}
        if as_list:
            label, prompts32 = f"{length}-{as_list}", [p.tolist() for p in prompts32]
        if as_list == "with-keys":
            given = {id(p): prompt_prefix_keys(p) for p in prompts32}
            functions["after"] = lambda p, lookup=after.longest_cached_prefix, given=given: lookup(
                p, keys=given[id(p)]
            )
        elif as_list == "kv-aware":
            functions = {
                "before": lambda p, lookup=bench.indexes["before"].longest_cached_prefix: (
                    lookup(p),
                    prompt_prefix_keys(p),
                ),
                "after": lambda p, lookup=after.longest_cached_prefix: lookup(p, keys=prompt_prefix_keys(p)),
            }
        timed = time_lookups(functions, prompts32, args.repeat)
        timed.update(
            time_lookups(
                {"naive_per_backend_walk": lambda p: naive_walk(per_backend_keys, p)},
                prompts32,
                max(5, args.repeat // 10),
            )
        )
        if label in ("8192", "8192-with-keys", "8192-kv-aware"):
            # `after` again on its own: side by side, each lookup follows one over the other index's
            # million keys, which leaves the caches cold (the ratio's price); alone is the gateway
            # with one index.
            alone = time_lookups({"after": functions["after"]}, prompts32, args.repeat)
            timed["after_alone"] = alone["after"]
        lookups[label] = {**timed, "matched_tokens_example": expected}
        print(f"lookup {label:>20}: " + ", ".join(f"{n} {t['median_us']:.0f} us" for n, t in timed.items()))

    ingest = {"prefill_events": prefill, **ingest_rows(bench, args.decode_events, prefill["events"], rng)}
    lone_blocks = [wire_payload(step) for step in decode_step_batches(args.decode_events, 1, 6 * 10**12, rng)]
    floor = message_floor(lone_blocks, bench.indexes["after"], "b6")
    print("one-event messages: " + ", ".join(f"{k} {v['us_per_message']:.1f} us" for k, v in floor.items()))
    for name, entry in ingest.items():
        print(f"{name}: {_rates(entry)}")
    results = {
        "benchmark": "index_bench",
        "command": "python -m benchmarks.index_bench "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
        "machine": {
            "python": platform.python_version(),
            "cpu": platform.processor() or platform.machine(),
            "load_average": list(Path("/proc/loadavg").read_text().split()[:3]),
        },
        "setup": {"backends": BACKENDS, "cached_blocks_target": args.blocks, "block_tokens": 16},
        "implementations": {
            "before": f"router/index/prefix_index.py at {BASELINE_REVISION} (from git history), "
            "whole-batch msgpack decoding",
            "after": "router/index (working tree), whole-batch msgpack decoding, "
            f"one-block events through the {bench.indexes['after'].ingest_path} path",
            "after_python": "the same with compiled_ingest=False: the pure-Python paths (ingest rows only)",
        },
        # Which path applied `after`'s one-block events of the decode shape: "compiled"
        # (router/index/_ingest.pyx, built) or "python" (the extension is not built here).
        "after_ingest_path": bench.indexes["after"].ingest_path,
        "ingest": ingest,
        "ingest_own_process": own_process,
        "lone_block_messages": floor,
        "lookup": lookups,
        "memory": memory,
        "targets": {"block_events_per_s": TARGET_EVENTS_PER_S, "lookup_8k_us": TARGET_LOOKUP_8K_US},
        "anchor": "Dynamo (Rust) reports ~1M events/s and microsecond lookups (not measured here)",
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "index_bench.json").write_text(json.dumps(with_source(results), indent=2))
    plot(results, out / "index_bench.png")
    (out / "index_bench.md").write_text(markdown_report(results, LONE_CALLS_PER_TIMING))
    print(f"wrote {out / 'index_bench.json'}, .md and .png")


def _rates(entry: dict) -> str:
    before, after = entry["before"]["blocks_per_s"], entry["after"]["blocks_per_s"]
    fallback = entry["after_python"]["blocks_per_s"]
    return (
        f"before {before:,.0f} blocks/s, after {after:,.0f} blocks/s (x{entry['speedup']:.2f}), "
        f"after in pure Python {fallback:,.0f} blocks/s"
    )


if __name__ == "__main__":
    main()

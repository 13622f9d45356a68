"""A KV-event publisher for tests that speaks vLLM's protocol exactly.

PUB socket: live messages `[topic, seq (8 bytes big-endian), msgpack EventBatch]`.
ROUTER socket: replay. A DEALER client sends `[b"", start_seq]`; the ROUTER (seeing the client
identity first) answers every buffered batch with seq >= start_seq as `[b"", topic, seq, payload]`
(vLLM >= 0.26) or `[b"", seq, payload]` (older), then the end marker, seq -1 with an empty payload.

Knobs let tests break it the way real deployments break: drop a live message (a gap), drop the
replay answer (a lost replay), forget old batches (buffer_steps), send raw malformed frames.
Event builders encode every dialect: array- or map-encoded events and batches, int or bytes hashes.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Literal

import msgspec
import zmq

END_MARKER = (-1).to_bytes(8, "big", signed=True)


def block_stored(
    block_hashes: list[Any],
    token_ids: list[int],
    block_size: int,
    parent_block_hash: Any = None,
    *,
    medium: str | None = "GPU",
    lora_name: str | None = None,
    extra_keys: list[Any] | None = None,
    group_idx: int | None = None,
    encoding: Literal["map", "array"] = "map",
    extra_fields: dict[str, Any] | None = None,
) -> Any:
    """A BlockStored event as vLLM >= 0.24 (map with "type") or <= 0.22 / SGLang (array, tag first)."""
    if encoding == "array":
        event: list[Any] = [
            "BlockStored",
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            None,
            medium,
        ]
        if lora_name is not None or extra_keys is not None or group_idx is not None:
            event += [lora_name, extra_keys, group_idx]
        if extra_fields:
            event += list(extra_fields.values())
        return event
    fields: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": block_hashes,
        "parent_block_hash": parent_block_hash,
        "token_ids": token_ids,
        "block_size": block_size,
        "lora_id": None,
        "medium": medium,
        "lora_name": lora_name,
        "extra_keys": extra_keys if extra_keys is not None else [None] * len(block_hashes),
        "group_idx": group_idx if group_idx is not None else 0,
        "kv_cache_spec_kind": "full_attention",
    }
    if medium is None:
        del fields["medium"]
    fields.update(extra_fields or {})
    return fields


def block_removed(block_hashes: list[Any], *, medium: str | None = "GPU", encoding: str = "map") -> Any:
    if encoding == "array":
        return ["BlockRemoved", block_hashes, medium]
    return {"type": "BlockRemoved", "block_hashes": block_hashes, "medium": medium, "group_idx": 0}


def all_blocks_cleared(*, encoding: str = "map") -> Any:
    return ["AllBlocksCleared"] if encoding == "array" else {"type": "AllBlocksCleared"}


def encode_batch(
    events: list[Any],
    *,
    ts: float | None = None,
    rank: int | None = 0,
    encoding: Literal["array", "map", "sglang-map"] = "array",
) -> bytes:
    """msgpack of an EventBatch: array `[ts, events, rank]`, or a map (vLLM or SGLang field names)."""
    stamp = time.time() if ts is None else ts
    if encoding == "array":
        return msgspec.msgpack.encode([stamp, events, rank])
    rank_field = "attn_dp_rank" if encoding == "sglang-map" else "data_parallel_rank"
    return msgspec.msgpack.encode({"ts": stamp, "events": events, rank_field: rank})


class EventPublisher:
    """An engine's KV-event publisher: PUB (+ ROUTER replay), seq from 0, a bounded replay buffer."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = "kv-events",
        buffer_steps: int = 10_000,
        replay_format: Literal["new", "old"] = "new",
        connect: bool = False,
        sndhwm: int = 100_000,
    ) -> None:
        self.topic = topic.encode()
        self.buffer_steps = buffer_steps
        self.replay_format = replay_format
        self.next_seq = 0
        self.buffer: list[tuple[int, bytes]] = []
        # Set to True to ignore replay requests entirely (the ROUTER dropped them at its HWM).
        self.drop_replays = False
        self.replay_requests: list[int] = []
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        # vLLM's publisher queues up to 100_000 messages per subscriber (ZMQ's default is 1000).
        # With the default, a burst of over 1000 messages on a busy machine drops its tail at the
        # PUB socket, and a dropped last message leaves no later seq to reveal the gap.
        self._pub.setsockopt(zmq.SNDHWM, sndhwm)
        if connect:  # the engine connects out; the gateway binds (kv_events.bind: true)
            self._pub.connect(endpoint)
        else:
            self._pub.bind(endpoint)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._router: zmq.Socket | None = None
        self._thread: threading.Thread | None = None
        if replay_endpoint is not None:
            self._router = self._context.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self._router.bind(replay_endpoint)
            self._thread = threading.Thread(target=self._serve_replay, name="test-replay", daemon=True)
            self._thread.start()

    def publish(self, events: list[Any], *, encoding: str = "array", send: bool = True, **kwargs: Any) -> int:
        """Encode and publish a batch; `send=False` buffers it without sending (a lost message)."""
        return self.publish_payload(encode_batch(events, encoding=encoding, **kwargs), send=send)  # type: ignore[arg-type]

    def publish_payload(self, payload: bytes, *, send: bool = True) -> int:
        with self._lock:
            seq = self.next_seq
            self.next_seq += 1
            self.buffer.append((seq, payload))
            del self.buffer[: -self.buffer_steps]
            if send:
                self._pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    def send_raw(self, frames: list[bytes]) -> None:
        """Send arbitrary frames on the PUB socket (malformed-message tests)."""
        self._pub.send_multipart(frames)

    def _serve_replay(self) -> None:
        assert self._router is not None
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(50):
                continue
            try:
                identity, _empty, start_frame = self._router.recv_multipart()
            except ValueError:
                continue
            start = int.from_bytes(start_frame, "big")
            self.replay_requests.append(start)
            if self.drop_replays:
                continue
            with self._lock:
                batches = [(seq, payload) for seq, payload in self.buffer if seq >= start]
            for seq, payload in batches:
                self._router.send_multipart(self._replay_frames(identity, seq.to_bytes(8, "big"), payload))
            self._router.send_multipart(self._replay_frames(identity, END_MARKER, b""))

    def _replay_frames(self, identity: bytes, seq: bytes, payload: bytes) -> list[bytes]:
        if self.replay_format == "old":
            return [identity, b"", seq, payload]
        return [identity, b"", self.topic, seq, payload]

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        self._pub.close(0)
        if self._router is not None:
            self._router.close(0)
        self._context.term()

    def __enter__(self) -> EventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

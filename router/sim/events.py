"""KV events of the simulated engine: the wire types and the ZMQ publisher with replay.

The wire protocol is vLLM's (docs/index.md, "Events" and "Subscriber"):
- PUB socket, messages of three frames [topic, seq (8 bytes big endian), msgpack(batch)];
- ROUTER socket for replay: a request [b"", start_seq] is answered with [b"", topic, seq, payload]
  for every buffered batch with seq >= start_seq, then [b"", topic, seq=-1, b""];
- a batch is the array [ts, [event, ...], data_parallel_rank].

Three encodings of the events themselves (`--kv-events-encoding`):
- "vllm": maps with a "type" key and vLLM 0.32's fields (the default);
- "vllm-array": arrays whose first element is the tag, trailing unset fields omitted (vLLM <= 0.22);
- "sglang": arrays with SGLang's field set and signed 64-bit block hashes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from typing import Any, Literal

import msgspec
import zmq
import zmq.asyncio

log = logging.getLogger("kvgate.sim.events")

Encoding = Literal["vllm", "vllm-array", "sglang"]
ENCODINGS: tuple[Encoding, ...] = ("vllm", "vllm-array", "sglang")
END_OF_REPLAY_SEQ = (-1).to_bytes(8, "big", signed=True)
MEDIUM_GPU = "GPU"


class BlockStored(msgspec.Struct, tag="BlockStored", tag_field="type", kw_only=True):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None
    # One entry per block: what its hash mixed in (LoRA name, cache_salt on the first block).
    extra_keys: list[list[str] | None] | None = None
    group_idx: int = 0
    kv_cache_spec_kind: str = "full_attention"


class BlockRemoved(msgspec.Struct, tag="BlockRemoved", tag_field="type", kw_only=True):
    block_hashes: list[int]
    medium: str | None = MEDIUM_GPU
    group_idx: int = 0


class AllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type"):
    pass


CacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventsConfig(msgspec.Struct, forbid_unknown_fields=False):
    """vLLM's --kv-events-config JSON (unknown keys ignored, as a newer vLLM's would be)."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    topic: str = ""


def parse_kv_events_config(text: str) -> KVEventsConfig:
    """Parse --kv-events-config; a ValueError names what is wrong."""
    try:
        config = msgspec.json.decode(text, type=KVEventsConfig)
    except msgspec.DecodeError as exc:
        raise ValueError(f"--kv-events-config is not valid JSON for vLLM's KVEventsConfig: {exc}") from None
    if config.enable_kv_cache_events and config.publisher not in ("zmq", "null"):
        raise ValueError(f'--kv-events-config: publisher {config.publisher!r} is not supported; use "zmq"')
    for name in ("endpoint", "replay_endpoint"):
        value = getattr(config, name)
        if value is not None and not value.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(
                f"--kv-events-config: {name} {value!r} must start with tcp://, ipc:// or inproc://"
            )
    return config


def _signed64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _as_array(event: CacheEvent, encoding: Encoding) -> list[Any]:
    if isinstance(event, AllBlocksCleared):
        return ["AllBlocksCleared"]
    if encoding == "sglang":
        hashes = [_signed64(h) for h in event.block_hashes]
        if isinstance(event, BlockRemoved):
            return ["BlockRemoved", hashes, event.medium]
        parent = None if event.parent_block_hash is None else _signed64(event.parent_block_hash)
        return ["BlockStored", hashes, parent, event.token_ids, event.block_size, event.lora_id, event.medium]
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", event.block_hashes, event.medium]
    fields = [
        "BlockStored",
        event.block_hashes,
        event.parent_block_hash,
        event.token_ids,
        event.block_size,
        event.lora_id,
        event.medium,
    ]
    # Trailing fields left at their defaults are omitted, as msgspec's omit_defaults does.
    if event.lora_name is not None or event.extra_keys is not None:
        fields += [event.lora_name, event.extra_keys]
    return fields


def encode_batch(events: list[CacheEvent], encoding: Encoding, ts: float, dp_rank: int = 0) -> bytes:
    """msgpack of one event batch in the chosen encoding."""
    if encoding == "vllm":
        return msgspec.msgpack.encode([ts, events, dp_rank])
    return msgspec.msgpack.encode([ts, [_as_array(e, encoding) for e in events], dp_rank])


class KVEventPublisher:
    """Publishes event batches on a PUB socket and answers replay requests on a ROUTER socket.

    Unlike vLLM, which connects its PUB socket unless the endpoint holds a wildcard, the simulator
    always binds: its endpoints are loopback addresses that the gateway connects to.
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        encoding: Encoding = "vllm",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
    ):
        if encoding not in ENCODINGS:
            raise ValueError(f"unknown KV-event encoding {encoding!r}; choose one of {', '.join(ENCODINGS)}")
        self.encoding = encoding
        self._topic = topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._next_seq = 0
        # A plain socket for PUB (sends never wait) and an asyncio one for the replay ROUTER.
        self._pub_context = zmq.Context()
        self._context = zmq.asyncio.Context()
        self._pub = self._pub_context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task | None = None
        try:
            self._pub.bind(endpoint)
            if replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError as exc:
            self.close()
            raise OSError(
                f"cannot bind KV-event socket ({endpoint}, replay {replay_endpoint}): {exc}"
            ) from None

    def start(self) -> None:
        """Start answering replay requests (needs a running event loop)."""
        if self._replay is not None and self._replay_task is None:
            self._replay_task = asyncio.get_running_loop().create_task(self._serve_replay())

    def publish(self, events: list[CacheEvent]) -> None:
        if not events:
            return
        seq = self._next_seq
        self._next_seq += 1
        payload = encode_batch(events, self.encoding, time.time())
        self._buffer.append((seq, payload))
        try:
            # PUB never blocks: past the high-water mark ZMQ drops, as it does for vLLM.
            self._pub.send_multipart([self._topic, seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("KV event batch %d not sent: %s", seq, exc)

    async def _serve_replay(self) -> None:
        assert self._replay is not None
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("ignoring a malformed replay request of %d frames", len(frames))
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    await self._replay.send_multipart(
                        [client, b"", self._topic, seq.to_bytes(8, "big"), payload]
                    )
            await self._replay.send_multipart([client, b"", self._topic, END_OF_REPLAY_SEQ, b""])

    def close(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
            self._replay_task = None
        for socket in (self._pub, self._replay):
            if socket is not None:
                with contextlib.suppress(zmq.ZMQError):
                    socket.close(linger=0)
        self._pub_context.term()
        self._context.term()

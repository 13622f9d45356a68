"""Raw KV-event payloads in every dialect engines publish, the token ids and hashes of the events
LMCache's documentation shows, and kvwire's publisher with test knobs.

The builders write events as plain maps and arrays, not as `kvwire` structs, so that the decoder
is tested against payloads written independently of it: array- or map-encoded events and
batches, int or bytes hashes, unknown extra fields. `EventPublisher` is `kvwire.EventPublisher`
with knobs that break it the way real deployments break: drop a live message (a gap), drop the
replay answer (a lost replay), forget old batches (buffer_steps), restart the seq, send raw
malformed frames, answer replays in the format without the topic frame.
"""

from __future__ import annotations

import time
from typing import Any, Literal

import msgspec

import kvwire


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


# LMCache's documentation, vLLM + LMCache (chunk_size 8): the documented event shows the first three
# and the last token ids of 36; the middle ones here are stand-ins, the shape is the documented one.
LMCACHE_VLLM_HASH = b"\x96\x95[h6\x1dE$v\x03\xe8\xf0\xc20\xcd\xe8\xa7#\x9cS\xe0\x16\xba\xab7\xf7z\x10P]\xfaT"
LMCACHE_VLLM_TOKENS = [27, 91, 7265, *range(1000, 1032), 29]
# LMCache's documentation, SGLang + LMCache (chunk_size 8): exactly as documented.
SGLANG_FIRST = [151644, 872, 198, 48, 16948, 18, 374, 279, 5535]
SGLANG_SECOND = [5535, 9471, 315, 3460, 4128, 4119, 304, 1207, 16948]
# The documented events as the engines publish them (arrays, tag first).
LMCACHE_VLLM_EVENT = ["BlockStored", [LMCACHE_VLLM_HASH], None, LMCACHE_VLLM_TOKENS, 36, None, "cpu"]
SGLANG_FIRST_EVENT = ["BlockStored", [-7651984371600085018], None, SGLANG_FIRST, 8, None]
SGLANG_SECOND_EVENT = ["BlockStored", [1717827842932260036], -7651984371600085018, SGLANG_SECOND, 8, None]


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


class EventPublisher(kvwire.EventPublisher):
    """An engine's publisher as tests drive it: kvwire's publisher, binding its PUB socket unless
    `connect` (the engine connects out; the gateway binds, kv_events.bind: true), with knobs to
    lose a live message (`send=False`), lose replay answers (`drop_replays`), restart the seq
    (`next_seq = 0`), answer replays in the topic-less format (`replay_format="old"`) and send
    raw frames. `replay_requests` lists the start seqs asked for."""

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
        # Set before the replay thread starts (in the base's constructor): it reads them.
        self.replay_format = replay_format
        # Set to True to ignore replay requests entirely (the ROUTER dropped them at its HWM).
        self.drop_replays = False
        self.replay_requests: list[int] = []
        self._mute_live = False
        # `sndhwm`: vLLM's publisher queues up to 100_000 messages per subscriber (ZMQ's default is
        # 1000). With the default, a burst of over 1000 messages on a busy machine drops its tail at
        # the PUB socket, and a dropped last message leaves no later seq to reveal the gap.
        super().__init__(
            endpoint, replay_endpoint, topic=topic, buffer_steps=buffer_steps, hwm=sndhwm, bind=not connect
        )

    @property
    def next_seq(self) -> int:
        with self._lock:
            return self._next_seq

    @next_seq.setter
    def next_seq(self, seq: int) -> None:
        """Count on from `seq` (0: the engine restarted)."""
        with self._lock:
            self._next_seq = seq

    @property
    def buffer(self) -> list[tuple[int, bytes]]:
        """The (seq, payload) batches held for replay, oldest first."""
        with self._lock:
            return list(self._buffer)

    def publish(  # type: ignore[override]
        self, events: list[Any], *, encoding: str = "array", send: bool = True, **kwargs: Any
    ) -> int:
        """Encode and publish a batch; `send=False` buffers it without sending (a lost message)."""
        return self.publish_payload(encode_batch(events, encoding=encoding, **kwargs), send=send)  # type: ignore[arg-type]

    def publish_payload(self, payload: bytes, *, send: bool = True) -> int:
        with self._lock:
            self._mute_live = not send
            try:
                return super().publish_payload(payload)
            finally:
                self._mute_live = False

    def _send_live(self, frames: list[bytes]) -> None:
        if not self._mute_live:
            super()._send_live(frames)

    def send_raw(self, frames: list[bytes]) -> None:
        """Send arbitrary frames on the PUB socket (malformed-message tests)."""
        with self._lock:
            self._pub.send_multipart(frames)

    def _accepts(self, request: bytes) -> bool:
        if len(request) == 8:
            self.replay_requests.append(int.from_bytes(request, "big"))
        return not self.drop_replays

    def _reply(self, client: bytes, seq_frame: bytes, payload: bytes) -> None:
        if self.replay_format == "old":
            assert self._replay is not None
            self._replay.send_multipart([client, b"", seq_frame, payload])
        else:
            super()._reply(client, seq_frame, payload)

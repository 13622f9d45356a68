"""Chunk keys: split tokens into chunks and give each a chained, deterministic 64-bit hash.

key(chunk i) = H(key(chunk i-1) or None, tokens of chunk i, identity), so a key names the whole
prefix up to its chunk. The identity (model, KV dtype, world size, worker, cache_salt, LoRA) is
folded into every key: a writer and a reader that disagree on any of it miss, never read a wrong
answer. Nothing depends on Python's hash() or PYTHONHASHSEED.

Algorithms:
- "sha256_cbor_64bit": SHA-256 of the deterministic CBOR encoding (RFC 8949 section 4.2.1:
  shortest heads, definite lengths) of `[parent, [tokens...], [model, dtype, world_size,
  worker_id, cache_salt, lora]]`; the key is the digest's last 8 bytes read big-endian. Any
  language with a CBOR library in canonical mode reproduces it.
- "xxhash" (alias "builtin"): xxh3_64 of parent (8 bytes little-endian, 0 for none), the
  identity's own xxh3_64 (8 bytes little-endian), then the tokens as int64 little-endian.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

HASH_ALGORITHMS = ("sha256_cbor_64bit", "xxhash", "builtin")


@dataclass(frozen=True, slots=True)
class CacheIdentity:
    """What must agree between the writer and the reader of a chunk besides its tokens."""

    model: str = ""
    dtype: str = ""
    world_size: int = 1
    worker_id: int = 0
    cache_salt: str | None = None
    lora: str | None = None

    def as_list(self) -> list[object]:
        return [self.model, self.dtype, self.world_size, self.worker_id, self.cache_salt, self.lora]


@dataclass(frozen=True, slots=True)
class ChunkSpan:
    """One chunk of a token sequence: tokens[start:end], its key and its parent's key."""

    start: int
    end: int
    key: int
    parent_key: int | None

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


# ---- deterministic CBOR (only the types a key needs) ----


def _cbor_head(major: int, value: int) -> bytes:
    if value < 24:
        return bytes([major << 5 | value])
    if value < 1 << 8:
        return bytes([major << 5 | 24, value])
    if value < 1 << 16:
        return bytes([major << 5 | 25]) + value.to_bytes(2, "big")
    if value < 1 << 32:
        return bytes([major << 5 | 26]) + value.to_bytes(4, "big")
    if value < 1 << 64:
        return bytes([major << 5 | 27]) + value.to_bytes(8, "big")
    raise ValueError(f"integer {value} does not fit CBOR's 64-bit heads")


def cbor_encode(value: object) -> bytes:
    """Deterministic CBOR of None, bool, int, str, bytes and (nested) lists/tuples."""
    out = bytearray()
    _cbor_append(out, value)
    return bytes(out)


def _cbor_append(out: bytearray, value: object) -> None:
    if value is None:
        out.append(0xF6)
    elif value is True:
        out.append(0xF5)
    elif value is False:
        out.append(0xF4)
    elif isinstance(value, int):
        out += _cbor_head(0, value) if value >= 0 else _cbor_head(1, -1 - value)
    elif isinstance(value, bytes):
        out += _cbor_head(2, len(value)) + value
    elif isinstance(value, str):
        encoded = value.encode()
        out += _cbor_head(3, len(encoded)) + encoded
    elif isinstance(value, (list, tuple)):
        out += _cbor_head(4, len(value))
        for item in value:
            _cbor_append(out, item)
    else:
        raise TypeError(f"cannot CBOR-encode a {type(value).__name__} in a chunk key")


_HEAD_BYTE = np.array([0x00, 0x18, 0x19, 0x1A, 0x1B], dtype=np.uint8)
_PAYLOAD_WIDTH = np.array([0, 1, 2, 4, 8])


def _cbor_token_array(tokens: np.ndarray) -> bytes:
    """CBOR of a list of non-negative ints, vectorized: the same bytes as cbor_encode(list(tokens))."""
    values = tokens.astype(np.uint64)
    width_class = (
        (values >= 24).astype(np.int64) + (values >= 1 << 8) + (values >= 1 << 16) + (values >= 1 << 32)
    )
    rows = np.empty((len(values), 9), dtype=np.uint8)
    rows[:, 1:] = values.astype(">u8").view(np.uint8).reshape(-1, 8)
    rows[:, 0] = np.where(width_class == 0, values.astype(np.uint8), _HEAD_BYTE[width_class])
    keep = np.arange(9) >= (9 - _PAYLOAD_WIDTH[width_class])[:, None]
    keep[:, 0] = True
    return _cbor_head(4, len(values)) + rows[keep].tobytes()


def _sha256_cbor_64bit(parent: int | None, tokens: np.ndarray, identity: CacheIdentity) -> int:
    if len(tokens) and tokens.min() < 0:
        token_part = cbor_encode(tokens.tolist())
    else:
        token_part = _cbor_token_array(tokens)
    # [parent, [tokens...], identity] as a 3-element array, the token list spliced in pre-encoded.
    encoded = b"\x83" + cbor_encode(parent) + token_part + cbor_encode(identity.as_list())
    return int.from_bytes(hashlib.sha256(encoded).digest()[-8:], "big")


def _identity_digest(identity: CacheIdentity) -> bytes:
    return struct.pack("<Q", xxhash.xxh3_64_intdigest(cbor_encode(identity.as_list())))


def chunk_spans(
    tokens: Sequence[int] | np.ndarray,
    *,
    chunk_size: int,
    identity: CacheIdentity,
    algorithm: str = "sha256_cbor_64bit",
    save_unfull_chunk: bool = True,
) -> list[ChunkSpan]:
    """The chunks of `tokens` in order; a shorter tail chunk is included when save_unfull_chunk."""
    if algorithm not in HASH_ALGORITHMS:
        raise ValueError(f"unknown hash algorithm {algorithm!r}; choose one of {', '.join(HASH_ALGORITHMS)}")
    token_array = np.asarray(tokens, dtype=np.int64)
    count = len(token_array)
    end_of_chunks = count if save_unfull_chunk else count - count % chunk_size
    spans: list[ChunkSpan] = []
    parent: int | None = None
    identity_digest = _identity_digest(identity) if algorithm != "sha256_cbor_64bit" else b""
    for start in range(0, end_of_chunks, chunk_size):
        end = min(start + chunk_size, end_of_chunks)
        if algorithm == "sha256_cbor_64bit":
            key = _sha256_cbor_64bit(parent, token_array[start:end], identity)
        else:
            hasher = xxhash.xxh3_64()
            hasher.update(struct.pack("<Q", parent or 0))
            hasher.update(identity_digest)
            hasher.update(token_array[start:end].astype("<i8", copy=False).tobytes())
            key = hasher.intdigest()
        spans.append(ChunkSpan(start, end, key, parent))
        parent = key
    return spans

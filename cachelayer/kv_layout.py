"""The KV of one key space as the cache holds it, and the checks on what comes in.

KV is one tensor `[num_layers, 2, num_tokens, channels]` (K then V; channels = kv heads x head dim)
of one dtype; a chunk is stored raw (those bytes) or as a codec's blob (cachelayer.compress).
`KVLayout` sizes chunks, views their bytes as KV (decoding blobs), and refuses KV or blobs of another
shape or dtype; `checked_tokens` and `as_dtype` refuse malformed token ids and dtypes; `copy_tensor` is
the copy every chunk's bytes go through. A refusal is a CacheEngineError that says what was wrong.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from cachelayer.compress import get_codec
from cachelayer.errors import CacheLayerError
from cachelayer.storage.tier import ChunkMeta

Tokens = Sequence[int] | np.ndarray | torch.Tensor


class CacheEngineError(CacheLayerError, ValueError):
    """A call the engine cannot serve as asked (wrong shape, dtype, location...); the message says why."""


def as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    resolved = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(resolved, torch.dtype):
        raise CacheEngineError(f"unknown KV dtype {dtype!r}; use a torch dtype such as 'bfloat16'")
    return resolved


def checked_tokens(tokens: Tokens) -> list[int]:
    """Token ids as a list of ints in [0, 2**63); anything else is refused with what was wrong."""
    values = tokens.tolist() if isinstance(tokens, (torch.Tensor, np.ndarray)) else list(tokens)
    if not values:
        return []
    try:
        array = np.asarray(values)
    except (ValueError, OverflowError):  # ragged nesting or ints beyond 64 bits: found by the loop below
        array = np.asarray([], dtype=np.float64)
    if array.ndim == 1 and array.dtype.kind in "iu" and array.min() >= 0 and array.max() < 2**63:
        return array.tolist()
    for position, token in enumerate(values):
        if not isinstance(token, (int, np.integer)) or isinstance(token, bool) or not 0 <= token < 2**63:
            raise CacheEngineError(f"token {position} is {token!r}: token ids must be integers in [0, 2**63)")
    return [int(token) for token in values]


_SAME_WIDTH_INTEGER = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def copy_tensor(destination: torch.Tensor, source: torch.Tensor, *, non_blocking: bool = False) -> None:
    """destination[...] = source. Between CPU tensors numpy's copy moves the strided chunk slices
    at memcpy speed, where torch's strided copy_ falls well short of it (docs/benchmarks.md).
    `non_blocking`: a copy to or from a GPU is only queued (the caller synchronizes)."""
    if destination.device.type == "cpu" and source.device.type == "cpu" and destination.dtype == source.dtype:
        as_integer = _SAME_WIDTH_INTEGER.get(destination.dtype.itemsize)
        try:
            np.copyto(destination.view(as_integer).numpy(), source.detach().view(as_integer).numpy())
            return
        except (RuntimeError, TypeError):  # no numpy view (e.g. conjugate or grad-tracking views)
            pass
    destination.copy_(source, non_blocking=non_blocking)


@dataclass(frozen=True, slots=True)
class KVLayout:
    """[num_layers, 2, tokens, channels] of `dtype`: one engine's KV."""

    num_layers: int
    channels: int
    dtype: torch.dtype

    @property
    def dtype_name(self) -> str:
        """The dtype as chunk keys, disk headers and remote values name it, e.g. "bfloat16"."""
        return str(self.dtype).removeprefix("torch.")

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.channels * self.dtype.itemsize

    def raw_nbytes(self, num_tokens: int) -> int:
        return num_tokens * self.bytes_per_token

    def check_kv(self, kv: torch.Tensor, num_tokens: int, name: str, *, at_least: bool = False) -> None:
        """Refuse `kv` unless it is [num_layers, 2, num_tokens (or more: `at_least`), channels] of
        the layout's dtype."""
        expected = (self.num_layers, 2, num_tokens, self.channels)
        shape = tuple(kv.shape)
        tokens_ok = kv.dim() == 4 and (shape[2] >= num_tokens if at_least else shape[2] == num_tokens)
        if kv.dim() != 4 or shape[:2] != expected[:2] or shape[3] != expected[3] or not tokens_ok:
            relation = "at least " if at_least else ""
            raise CacheEngineError(
                f"{name} must be [num_layers={self.num_layers}, 2, {relation}{num_tokens} tokens, "
                f"channels={self.channels}], got {list(shape)}"
            )
        if kv.dtype != self.dtype:
            raise CacheEngineError(f"{name} has dtype {kv.dtype}, the engine was built for {self.dtype}")

    def chunk_view(self, payload: torch.Tensor, meta: ChunkMeta) -> torch.Tensor:
        """A chunk's KV [num_layers, 2, n, channels] from its stored bytes (decoded if compressed).

        An encoded chunk whose header, checksum or shape is wrong raises CacheEngineError before
        anything is allocated for its values."""
        if meta.fmt == "raw":
            return payload.view(self.dtype).view(self.num_layers, 2, meta.num_tokens, self.channels)
        blob = payload.numpy().tobytes()
        self.check_blob(meta.fmt, blob, meta.num_tokens, f"chunk {meta.key:#x}")
        return get_codec(meta.fmt).decode(blob, device="cpu", dtype=self.dtype)

    def check_blob(self, fmt: str, blob: bytes, num_tokens: int, name: str) -> None:
        """Refuse an encoded chunk unless its header, length and checksum check out and it holds
        exactly [num_layers, 2, num_tokens, channels] of this layout's dtype."""
        try:
            info = get_codec(fmt).inspect(blob)
        except ValueError as exc:
            raise CacheEngineError(f"{name} ({fmt}) refused: {exc}") from None
        expected = (self.num_layers, 2, num_tokens, self.channels)
        if tuple(info.shape) != expected or info.dtype != self.dtype:
            raise CacheEngineError(
                f"{name} ({fmt}) refused: it holds {list(info.shape)} {info.dtype}, this engine "
                f"keeps [num_layers={self.num_layers}, 2, {num_tokens} tokens, channels={self.channels}] "
                f"{self.dtype}"
            )

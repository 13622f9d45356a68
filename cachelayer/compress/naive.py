"""The `naive` codec: no compression, the raw tensor bytes behind a small header (lossless).

Blob (little-endian): magic b"KVNAIVE2", u8 dtype-name length, the dtype name, shape int64[4],
checksum u64 (cachelayer.compress.checksum) of everything before it and of the payload; then the
payload, the tensor's bytes. Version 1 (b"KVNAIVE1") had no checksum and is refused.
"""

from __future__ import annotations

import struct

import numpy as np
import torch

from cachelayer.compress import BlobInfo
from cachelayer.compress.checksum import checksum
from cachelayer.errors import CacheLayerError

_MAGIC = b"KVNAIVE2"
_OLD_MAGICS = (b"KVNAIVE1",)
_SHAPE = struct.Struct("<4q")
_CHECKSUM = struct.Struct("<Q")
_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "uint8": torch.uint8,
}


class NaiveCodecError(CacheLayerError, ValueError):
    """A blob that is not a valid naive blob, or input the codec cannot encode."""


def _checksum(head: bytes | memoryview, payload: bytes | memoryview) -> int:
    return checksum(head, payload)


class NaiveCodec:
    def encode(self, kv: torch.Tensor, *, layer_offset: int = 0, total_layers: int | None = None) -> bytes:
        if kv.dim() != 4:
            raise NaiveCodecError(
                f"naive codec: kv must be [layers, 2, tokens, channels], got shape {tuple(kv.shape)}"
            )
        dtype_name = str(kv.dtype).removeprefix("torch.")
        if dtype_name not in _DTYPES:
            raise NaiveCodecError(f"naive codec: unsupported dtype {kv.dtype}")
        name = dtype_name.encode()
        head = _MAGIC + struct.pack("<B", len(name)) + name + _SHAPE.pack(*kv.shape)
        payload = kv.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()
        return head + _CHECKSUM.pack(_checksum(head, payload)) + payload

    def inspect(self, blob: bytes | memoryview) -> BlobInfo:
        info, _ = self._parse(memoryview(blob))
        return info

    def decode(
        self, blob: bytes, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        (shape, stored_dtype), payload_start = self._parse(memoryview(blob))
        raw = np.frombuffer(blob, dtype=np.uint8, offset=payload_start)
        kv = torch.from_numpy(raw.copy()).view(stored_dtype).view(shape)
        return kv.to(device=device, dtype=dtype or stored_dtype)

    @staticmethod
    def _parse(blob: memoryview) -> tuple[BlobInfo, int]:
        """The header's claims, checked against the blob's length and checksum before any allocation."""
        magic = bytes(blob[: len(_MAGIC)])
        if magic in _OLD_MAGICS:
            raise NaiveCodecError(
                f"naive blob of an older format ({magic!r}, no checksum); this build reads {_MAGIC!r}: "
                "store the chunk again"
            )
        if magic != _MAGIC:
            raise NaiveCodecError(f"not a naive blob: magic {magic!r}, expected {_MAGIC!r}")
        position = len(_MAGIC)
        if len(blob) < position + 1:
            raise NaiveCodecError("truncated naive blob: no dtype in its header")
        name_length = blob[position]
        position += 1
        header_end = position + name_length + _SHAPE.size + _CHECKSUM.size
        if len(blob) < header_end:
            raise NaiveCodecError(f"truncated naive blob: {len(blob)} bytes is shorter than its header")
        name = bytes(blob[position : position + name_length]).decode(errors="replace")
        stored_dtype = _DTYPES.get(name)
        if stored_dtype is None:
            raise NaiveCodecError(f"corrupt naive blob: unknown dtype {name!r}")
        position += name_length
        shape = _SHAPE.unpack_from(blob, position)
        position += _SHAPE.size
        if min(shape) < 0 or shape[1] != 2:
            raise NaiveCodecError(
                f"corrupt naive blob: shape {list(shape)} is not [layers, 2, tokens, channels]"
            )
        payload_bytes = shape[0] * shape[1] * shape[2] * shape[3] * stored_dtype.itemsize
        if len(blob) - header_end != payload_bytes:
            raise NaiveCodecError(
                f"corrupt or truncated naive blob: {len(blob) - header_end} payload bytes, but its header "
                f"describes {list(shape)} {name} ({payload_bytes} bytes)"
            )
        (expected,) = _CHECKSUM.unpack_from(blob, position)
        if _checksum(blob[:position], blob[header_end:]) != expected:
            raise NaiveCodecError("corrupt naive blob: checksum mismatch")
        return BlobInfo(shape, stored_dtype), header_end

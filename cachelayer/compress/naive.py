"""The `naive` codec: no compression, the raw tensor bytes behind a small header (lossless)."""

from __future__ import annotations

import struct

import numpy as np
import torch

_MAGIC = b"KVNAIVE1"
_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "uint8": torch.uint8,
}


class NaiveCodec:
    def encode(self, kv: torch.Tensor, *, layer_offset: int = 0, total_layers: int | None = None) -> bytes:
        if kv.dim() != 4:
            raise ValueError(
                f"naive codec: kv must be [layers, 2, tokens, channels], got shape {tuple(kv.shape)}"
            )
        dtype_name = str(kv.dtype).removeprefix("torch.")
        if dtype_name not in _DTYPES:
            raise ValueError(f"naive codec: unsupported dtype {kv.dtype}")
        name = dtype_name.encode()
        header = _MAGIC + struct.pack("<B", len(name)) + name + struct.pack("<4q", *kv.shape)
        payload = kv.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()
        return header + payload

    def decode(
        self, blob: bytes, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        if blob[: len(_MAGIC)] != _MAGIC:
            raise ValueError("naive codec: not a naive blob (bad magic)")
        position = len(_MAGIC)
        (name_length,) = struct.unpack_from("<B", blob, position)
        position += 1
        stored_dtype = _DTYPES[bytes(blob[position : position + name_length]).decode()]
        position += name_length
        shape = struct.unpack_from("<4q", blob, position)
        position += 32
        raw = np.frombuffer(blob, dtype=np.uint8, offset=position)
        kv = torch.from_numpy(raw.copy()).view(stored_dtype).view(shape)
        return kv.to(device=device, dtype=dtype or stored_dtype)

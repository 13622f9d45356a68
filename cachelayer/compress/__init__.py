"""The codec registry: `get_codec(name)` returns an object that encodes a KV chunk to bytes and back.

Every codec takes kv shaped [layers, 2, tokens, channels] and returns a self-describing blob
(shape, dtype and a checksum inside), so a chunk can be decoded anywhere without side information.
`inspect(blob)` reads and checks a blob's header, size and checksum without decoding it: a blob
from a socket or a file is checked against the shape its holder expects before anything is
allocated for its values.
`layer_offset` / `total_layers` tell a codec where the given layers sit in the model (CacheGen
quantizes early layers finer). Codecs live in modules of this package; the registry imports
them on first use, so an optional codec costs nothing until asked for.
`warm_up(dtype)` runs every codec once on a tiny chunk: CacheGen's CPU kernels are compiled by
numba on their first call in a process (seconds loaded from numba's cache, tens of seconds on a
machine that has none), which a caller with a deadline (a controller command) must not pay.
"""

from __future__ import annotations

import importlib
import time
from typing import NamedTuple, Protocol

import torch

from cachelayer.errors import CacheLayerError


class BlobInfo(NamedTuple):
    """What a blob's header says it holds; `inspect` has checked its size and checksum."""

    shape: tuple[int, int, int, int]  # [layers, 2, tokens, channels]
    dtype: torch.dtype


class Codec(Protocol):
    def encode(
        self, kv: torch.Tensor, *, layer_offset: int = 0, total_layers: int | None = None
    ) -> bytes: ...

    def decode(
        self, blob: bytes, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
    ) -> torch.Tensor: ...

    def inspect(self, blob: bytes | memoryview) -> BlobInfo:
        """The blob's shape and dtype, after checking its header, length and checksum (ValueError)."""
        ...


# name -> "module:class"; the class is instantiated without arguments.
_CODECS: dict[str, str] = {
    "naive": "cachelayer.compress.naive:NaiveCodec",
    "cachegen": "cachelayer.compress.cachegen:CacheGenCodec",
}
_instances: dict[str, Codec] = {}


class UnknownCodecError(CacheLayerError, ValueError):
    """No codec of that name, or its module is missing."""


def codec_names() -> tuple[str, ...]:
    return tuple(_CODECS)


def get_codec(name: str) -> Codec:
    codec = _instances.get(name)
    if codec is not None:
        return codec
    target = _CODECS.get(name)
    if target is None:
        raise UnknownCodecError(f"unknown compression method {name!r}; available: {', '.join(_CODECS)}")
    module_name, _, class_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        raise UnknownCodecError(
            f"compression method {name!r} is not available: {module_name} is missing"
        ) from None
    codec = _instances[name] = getattr(module, class_name)()
    return codec


def warm_up(dtype: torch.dtype) -> float:
    """Encode and decode a tiny chunk of `dtype` on the CPU with every codec, so that the first real
    call runs as fast as the next (CacheGen's kernels are then compiled, or loaded from numba's
    cache); the seconds it took. A codec whose module is missing is skipped."""
    started = time.perf_counter()
    # Values of several magnitudes: every kernel path runs (rANS words are written and read).
    chunk = (torch.arange(1 * 2 * 16 * 32, dtype=torch.float32).reshape(1, 2, 16, 32) % 7 - 3).to(dtype)
    for name in _CODECS:
        try:
            codec = get_codec(name)
        except UnknownCodecError:
            continue
        codec.decode(codec.encode(chunk, layer_offset=0, total_layers=1), dtype=dtype)
    return time.perf_counter() - started

"""CacheGen-style KV codec: per-token quantization with layer-dependent levels, then rANS coding.

One format on CPU and CUDA (a blob encoded on either decodes on either, bit for bit):

1. Quantization. For every (layer, K/V, token) row of `channels` values: scale = max|x| / qmax,
   symbol = round(x * (1 / scale)) + qmax in [0, 2 * qmax]. qmax depends on the layer's position in
   the model (`levels`, default 31 / 15 / 7 for the first / middle / last third): early layers,
   whose errors propagate through more of the network, get finer bins. Decoding gives
   (symbol - qmax) * scale, so |x - decoded| <= scale * (0.5 + 2**-20) in float32 (`error_bound`),
   plus the rounding of the output dtype.
2. Entropy coding. One static frequency table per (layer, K/V), 12-bit precision, in the header.
   Symbols are coded with rANS (32-bit state, 16-bit words) in independent lanes: lane =
   (layer, K/V, group of 256 tokens, channel), coding that channel's symbols over the group's
   tokens. Lanes share no state, so the CPU runs blocks of lanes on every core (numba kernels in
   cachegen_cpu.py) and the GPU runs one lane per thread (cachelayer/gpu/cachegen_kernels.py).

Blob, version 2 (little-endian; every section starts on an 8-byte boundary):
  header `_HEADER`: magic b"KVCG", version, dtype code, probability bits, num_layers, num_tokens,
  channels, layer_offset, total_layers, group_tokens, total_words, checksum;
  qmax uint8[num_layers]; scales float32[num_layers, 2, num_tokens];
  frequencies uint16[num_layers * 2, 64]; final states uint32[lanes]; words per lane uint16[lanes];
  words uint16[total_words] (lane after lane, each lane's words in the order its decoder reads them).
The checksum (cachelayer.compress.checksum: xxh3_64 over 4 MiB segments) covers the header before
it and every section after it: the rANS checks
alone let about one corrupted blob in ten decode to wrong values. Blobs in host memory always
carry it; a blob built on the GPU (`encode_to_device`) gets it when it is copied out (`sealed`),
so that the GPU path never waits for a host copy. Version 1 had no checksum and is refused.
"""

from __future__ import annotations

import struct

import numpy as np
import torch
from torch import Tensor

from cachelayer.compress import BlobInfo
from cachelayer.compress.checksum import checksum
from cachelayer.errors import CacheLayerError

MAGIC = b"KVCG"
VERSION = 2
PROBABILITY_BITS = 12
PROBABILITY_SCALE = 1 << PROBABILITY_BITS
STATE_LOWER_BOUND = 1 << 16  # rANS state lives in [2**16, 2**32); renormalization moves 16-bit words
GROUP_TOKENS = 256
ALPHABET = 64  # symbols 0 .. 2 * qmax; qmax <= 31
DEFAULT_LEVELS = (31, 15, 7)

_HEADER = struct.Struct("<4sHBBIIIIIIQQ")
_CHECKSUM = struct.Struct("<Q")
_CHECKSUM_OFFSET = _HEADER.size - _CHECKSUM.size
_MAGIC_AND_VERSION = struct.Struct("<4sH")
_DTYPE_CODES = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}
_CODE_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}


class CacheGenError(CacheLayerError, ValueError):
    """A blob that is not a valid CacheGen blob, or input the codec cannot encode."""


def layer_qmax(num_layers: int, layer_offset: int, total_layers: int, levels=DEFAULT_LEVELS) -> list[int]:
    """qmax of each given layer: levels[0] in the first third of the model, levels[1], then levels[2]."""
    return [levels[min(2, (layer_offset + i) * 3 // total_layers)] for i in range(num_layers)]


def error_bound(scales: Tensor) -> Tensor:
    """The largest |x - decoded| (before the output dtype's rounding) for rows with these scales."""
    return scales * (0.5 + 2.0**-20)


def normalized_frequencies(counts: np.ndarray) -> np.ndarray:
    """Scale symbol counts [rows, ALPHABET] to sum to PROBABILITY_SCALE, every seen symbol >= 1."""
    counts = counts.astype(np.int64)
    totals = counts.sum(axis=1, keepdims=True)
    frequencies = counts * PROBABILITY_SCALE // np.maximum(totals, 1)
    frequencies[(counts > 0) & (frequencies == 0)] = 1
    # The rounding slack (at most ALPHABET either way) goes to the most frequent symbol, which
    # holds at least PROBABILITY_SCALE / ALPHABET, so it stays positive.
    largest = frequencies.argmax(axis=1)
    frequencies[np.arange(len(frequencies)), largest] += PROBABILITY_SCALE - frequencies.sum(axis=1)
    return frequencies


def symbol_lookup(frequencies: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Cumulative frequencies [rows, ALPHABET] and the slot -> symbol table [rows, PROBABILITY_SCALE]."""
    cumulative = cumulative_frequencies(frequencies)
    # Each row's frequencies sum to PROBABILITY_SCALE, so repeating every symbol by its frequency
    # over all rows at once yields exactly rows x PROBABILITY_SCALE entries, row after row.
    symbols = np.tile(np.arange(frequencies.shape[1], dtype=np.uint8), len(frequencies))
    table = np.repeat(symbols, frequencies.reshape(-1)).reshape(len(frequencies), PROBABILITY_SCALE)
    return cumulative, table


def cumulative_frequencies(frequencies: np.ndarray) -> np.ndarray:
    cumulative = np.zeros_like(frequencies)
    cumulative[:, 1:] = np.cumsum(frequencies, axis=1)[:, :-1]
    return cumulative


def _align(size: int) -> int:
    return (size + 7) & ~7


class _Layout:
    """Byte offsets of the sections of a blob with these dimensions."""

    def __init__(self, num_layers: int, num_tokens: int, channels: int, total_words: int):
        self.num_groups = -(-num_tokens // GROUP_TOKENS)
        self.num_lanes = num_layers * 2 * self.num_groups * channels
        sizes = [
            ("qmax", num_layers),
            ("scales", num_layers * 2 * num_tokens * 4),
            ("frequencies", num_layers * 2 * ALPHABET * 2),
            ("states", self.num_lanes * 4),
            ("counts", self.num_lanes * 2),
            ("words", total_words * 2),
        ]
        position = _align(_HEADER.size)
        self.offsets: dict[str, tuple[int, int]] = {}
        for name, size in sizes:
            self.offsets[name] = (position, size)
            position = _align(position + size)
        self.total_size = position


class CacheGenCodec:
    """The `cachegen` codec of cachelayer.compress: encode(kv) -> bytes, decode(bytes) -> kv."""

    name = "cachegen"

    def __init__(self, levels: tuple[int, int, int] = DEFAULT_LEVELS):
        if len(levels) != 3 or not all(1 <= level <= (ALPHABET - 1) // 2 for level in levels):
            raise CacheGenError(f"levels must be three qmax values in 1..{(ALPHABET - 1) // 2}, got {levels}")
        self.levels = tuple(levels)

    # ---- encoding -------------------------------------------------------------------------------
    def encode(self, kv: Tensor, *, layer_offset: int = 0, total_layers: int | None = None) -> bytes:
        """Encode kv [layers, 2, tokens, channels] (bf16, fp16 or fp32; CPU or CUDA) to a blob."""
        if kv.device.type == "cuda":
            host = self.encode_to_host(kv, layer_offset=layer_offset, total_layers=total_layers)
            return bytes(host.numpy())
        return self._encode_cpu(kv, layer_offset, total_layers)

    def encode_to_host(self, kv: Tensor, *, layer_offset: int = 0, total_layers: int | None = None) -> Tensor:
        """Encode a CUDA kv to a blob in pinned host memory (a uint8 CPU tensor with encode()'s bytes).

        The blob crosses PCIe in one DMA into page-locked memory, and the caller gets that memory
        itself: `.numpy()` is a buffer a socket or a store can send without another copy. (A
        pageable copy and a conversion to `bytes` each cost more than the encoding.)
        """
        blob = self.encode_to_device(kv, layer_offset=layer_offset, total_layers=total_layers)
        # torch's caching host allocator hands back a freed pinned block of this size class, so a
        # steady stream of chunks does not pay for page-locking memory every time.
        host = torch.empty(blob.numel(), dtype=torch.uint8, pin_memory=True)
        host.copy_(blob, non_blocking=True)
        torch.cuda.current_stream(blob.device).synchronize()
        _seal(memoryview(host.numpy()))
        return host

    def encode_to_device(
        self, kv: Tensor, *, layer_offset: int = 0, total_layers: int | None = None
    ) -> Tensor:
        """Encode a CUDA kv to a blob that stays on the GPU (a uint8 tensor with encode()'s bytes,
        but for the checksum, which `sealed` adds once the bytes are in host memory)."""
        from cachelayer.gpu import cachegen_kernels

        qmax = self._check_input(kv, layer_offset, total_layers)
        num_layers, _, num_tokens, channels = kv.shape
        qmax_tensor = torch.tensor(qmax, dtype=torch.int32, device=kv.device)
        scales, symbols, counts, nonfinite = cachegen_kernels.quantize(kv.contiguous(), qmax_tensor)
        if nonfinite:
            raise CacheGenError("kv holds NaN or infinite values; CacheGen encodes finite values only")
        frequencies = normalized_frequencies(counts)
        tables = np.stack([frequencies, cumulative_frequencies(frequencies)]).astype(np.int32)
        tables_device = torch.from_numpy(tables).to(kv.device)
        states, word_counts, words = cachegen_kernels.rans_encode(symbols, tables_device[0], tables_device[1])
        header = self._header(
            kv.dtype, num_layers, num_tokens, channels, layer_offset, total_layers, words.numel()
        )
        layout = _Layout(num_layers, num_tokens, channels, words.numel())
        blob = torch.zeros(layout.total_size, dtype=torch.uint8, device=kv.device)
        blob[: len(header)] = torch.frombuffer(bytearray(header), dtype=torch.uint8).to(kv.device)
        sections = {
            "qmax": qmax_tensor.to(torch.uint8),
            "scales": scales,
            "frequencies": torch.from_numpy(frequencies.astype(np.int16)).to(kv.device),
            "states": states,
            "counts": word_counts,
            "words": words,
        }
        for name, tensor in sections.items():
            start, size = layout.offsets[name]
            blob[start : start + size] = tensor.contiguous().view(-1).view(torch.uint8)
        return blob

    def _encode_cpu(self, kv: Tensor, layer_offset: int, total_layers: int | None) -> bytes:
        from cachelayer.compress import cachegen_cpu  # here, so that the CUDA path needs no numba

        qmax = self._check_input(kv, layer_offset, total_layers)
        num_layers, _, num_tokens, channels = kv.shape
        kv = kv.contiguous()
        # bf16 goes to the kernel as its bit patterns (numpy has no bf16); fp16 is widened by torch.
        if kv.dtype == torch.bfloat16:
            values = kv.view(torch.int16).numpy().view(np.uint16)
        else:
            values = kv.float().numpy()
        qmax_array = np.asarray(qmax, dtype=np.int64)
        scales = np.empty((num_layers, 2, num_tokens), dtype=np.float32)
        symbols = np.empty((num_layers * 2, num_tokens, channels), dtype=np.uint8)
        counts = np.empty((num_layers * 2, ALPHABET), dtype=np.int64)
        with cachegen_cpu.threads_for(kv.numel()):
            if not cachegen_cpu.quantize(values, qmax_array, scales, symbols, counts):
                raise CacheGenError("kv holds NaN or infinite values; CacheGen encodes finite values only")
            frequencies = normalized_frequencies(counts)
            layout = _Layout(num_layers, num_tokens, channels, 0)
            states = np.empty(layout.num_lanes, dtype="<u4")
            word_counts = np.empty(layout.num_lanes, dtype="<u2")
            lane_words = np.empty((layout.num_lanes, GROUP_TOKENS), dtype="<u2")
            cachegen_cpu.rans_encode(
                symbols, frequencies, cumulative_frequencies(frequencies), states, word_counts, lane_words
            )
            word_ends = np.cumsum(word_counts, dtype=np.int64)
            words = np.empty(int(word_ends[-1]), dtype="<u2")
            cachegen_cpu.gather_words(lane_words, word_counts, word_ends - word_counts, words)
        header = self._header(
            kv.dtype, num_layers, num_tokens, channels, layer_offset, total_layers, len(words)
        )
        layout = _Layout(num_layers, num_tokens, channels, len(words))
        blob = bytearray(layout.total_size)
        blob[: len(header)] = header
        sections = {
            "qmax": np.asarray(qmax, dtype=np.uint8),
            "scales": scales,
            "frequencies": frequencies.astype("<u2"),
            "states": states,
            "counts": word_counts,
            "words": words,
        }
        for name, array in sections.items():
            start, size = layout.offsets[name]
            blob[start : start + size] = memoryview(array).cast("B")
        _seal(blob)
        return bytes(blob)

    def _check_input(self, kv: Tensor, layer_offset: int, total_layers: int | None) -> list[int]:
        if kv.dim() != 4 or kv.shape[1] != 2:
            raise CacheGenError(
                f"kv must be [layers, 2, tokens, channels], got shape {tuple(kv.shape)} "
                "(MLA latents: pass them with a second plane, or use the naive codec)"
            )
        if kv.dtype not in _DTYPE_CODES:
            raise CacheGenError(f"kv dtype {kv.dtype} is not supported: use bfloat16, float16 or float32")
        if min(kv.shape) == 0:
            raise CacheGenError(f"kv is empty (shape {tuple(kv.shape)}): nothing to encode")
        total = total_layers if total_layers is not None else layer_offset + kv.shape[0]
        if layer_offset < 0 or total < layer_offset + kv.shape[0]:
            raise CacheGenError(
                f"layers {layer_offset}..{layer_offset + kv.shape[0] - 1} do not fit in total_layers={total}"
            )
        return layer_qmax(kv.shape[0], layer_offset, total, self.levels)

    @staticmethod
    def _header(dtype, num_layers, num_tokens, channels, layer_offset, total_layers, total_words) -> bytes:
        total = total_layers if total_layers is not None else layer_offset + num_layers
        return _HEADER.pack(
            MAGIC,
            VERSION,
            _DTYPE_CODES[dtype],
            PROBABILITY_BITS,
            num_layers,
            num_tokens,
            channels,
            layer_offset,
            total,
            GROUP_TOKENS,
            total_words,
            0,  # the checksum, filled in by _seal once the sections are written
        )

    # ---- decoding -------------------------------------------------------------------------------
    def decode(
        self, blob: bytes, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
    ) -> Tensor:
        """Decode a blob to kv [layers, 2, tokens, channels] on `device` (CUDA decodes on the GPU)."""
        device = torch.device(device)
        if device.type == "cuda":
            return self.decode_from_host(blob, device=device, dtype=dtype)
        header, layout = _parse(memoryview(blob))  # header, size and checksum, before any allocation
        return self._decode_cpu(memoryview(blob), header, layout, dtype)

    def inspect(self, blob: bytes | memoryview) -> BlobInfo:
        """The blob's shape and dtype, once its header, length and checksum check out (CacheGenError)."""
        header, _ = _parse(memoryview(blob))
        shape = (header["num_layers"], 2, header["num_tokens"], header["channels"])
        return BlobInfo(shape, header["dtype"])

    def decode_from_host(
        self,
        blob: bytes | bytearray | memoryview | Tensor,
        *,
        device: str | torch.device = "cuda",
        dtype: torch.dtype | None = None,
    ) -> Tensor:
        """Decode a blob held in host memory on a GPU: a pinned uint8 tensor (encode_to_host's)
        goes straight over PCIe; any other buffer is first copied once into pinned memory, since a
        pageable host-to-device copy is both slower and synchronous. The header, sizes and checksum
        are checked on the host first."""
        device = torch.device(device)
        if isinstance(blob, Tensor):
            if blob.dtype != torch.uint8 or blob.dim() != 1 or blob.device.type != "cpu":
                raise CacheGenError(
                    f"a host blob tensor must be 1-D uint8 on the CPU, got {blob.dtype} "
                    f"{tuple(blob.shape)} on {blob.device}"
                )
            parsed = _parse(memoryview(blob.numpy()))
            source = blob if blob.is_pinned() else _pinned_copy(blob.numpy())
        else:
            parsed = _parse(memoryview(blob))
            source = _pinned_copy(np.frombuffer(blob, dtype=np.uint8))
        # torch's caching host allocator keeps a pinned block from reuse until the copies queued on it
        # have run, so `source` may go out of scope before the copy completes.
        on_device = source.to(device, non_blocking=True)
        return self.decode_device(on_device, dtype=dtype, parsed=parsed)

    def decode_device(
        self, blob: Tensor, *, dtype: torch.dtype | None = None, parsed: tuple[dict, _Layout] | None = None
    ) -> Tensor:
        """Decode a blob held in a CUDA uint8 tensor, on that GPU (`parsed`: its header, when the
        caller already read and checked it on the host, which saves a device-to-host round trip).

        Without `parsed`, the header and sizes are checked here but the checksum is not (it would
        need the bytes in host memory): bytes that arrive from outside go through `decode`,
        `decode_from_host` or `inspect`, which check it."""
        from cachelayer.gpu import cachegen_kernels

        if parsed is None:
            head = bytes(blob[: _align(_HEADER.size)].cpu().numpy())
            parsed = _parse(memoryview(head), total_size=blob.numel())
        header, layout = parsed
        num_layers, num_tokens, channels = header["num_layers"], header["num_tokens"], header["channels"]

        def section(name: str, torch_dtype: torch.dtype) -> Tensor:
            start, size = layout.offsets[name]
            return blob[start : start + size].view(torch_dtype)

        frequencies = section("frequencies", torch.int16).cpu().numpy().view(np.uint16).reshape(-1, ALPHABET)
        _check_frequencies(frequencies)
        cumulative, table = symbol_lookup(frequencies.astype(np.int64))
        counts = section("counts", torch.int16).to(torch.int32) & 0xFFFF
        ends = torch.cumsum(counts, 0, dtype=torch.int64)
        if int(ends[-1]) != header["total_words"]:
            raise CacheGenError("corrupt CacheGen blob: word counts do not add up to the words present")
        out_dtype = dtype or header["dtype"]
        out = torch.empty(num_layers, 2, num_tokens, channels, dtype=out_dtype, device=blob.device)
        clean = cachegen_kernels.rans_decode(
            section("states", torch.int32),
            ends - counts,
            ends,
            section("words", torch.int16),
            torch.from_numpy(frequencies.astype(np.int32)).to(blob.device),
            torch.from_numpy(cumulative.astype(np.int32)).to(blob.device),
            torch.from_numpy(table).to(blob.device),
            section("scales", torch.float32),
            section("qmax", torch.uint8).to(torch.int32),
            out,
        )
        if not clean:
            raise CacheGenError(
                "corrupt CacheGen blob: the rANS streams did not decode to their initial state"
            )
        return out

    def _decode_cpu(
        self, blob: memoryview, header: dict, layout: _Layout, dtype: torch.dtype | None
    ) -> Tensor:
        from cachelayer.compress import cachegen_cpu  # here, so that the CUDA path needs no numba

        num_layers, num_tokens, channels = header["num_layers"], header["num_tokens"], header["channels"]

        def section(name: str, numpy_dtype: str) -> np.ndarray:
            start, size = layout.offsets[name]
            return np.frombuffer(blob[start : start + size], dtype=numpy_dtype)

        frequencies = section("frequencies", "<u2").reshape(-1, ALPHABET).astype(np.int64)
        _check_frequencies(frequencies)
        cumulative, table = symbol_lookup(frequencies)
        states, word_counts = section("states", "<u4"), section("counts", "<u2")
        if len(states) != layout.num_lanes or len(word_counts) != layout.num_lanes:
            raise CacheGenError("corrupt CacheGen blob: lane sections do not match the header")
        if int(word_counts.sum(dtype=np.int64)) != header["total_words"]:
            raise CacheGenError("corrupt CacheGen blob: word counts do not add up to the words present")
        out_dtype = dtype or header["dtype"]
        # The kernel writes float32, or bf16 as bit patterns; other dtypes are narrowed by torch
        # from float32, as the value is defined (float32 (symbol - qmax) * scale, then rounded).
        as_bf16 = out_dtype == torch.bfloat16
        shape = (num_layers, 2, num_tokens, channels)
        out = torch.empty(shape, dtype=torch.bfloat16 if as_bf16 else torch.float32)
        target = out.view(torch.int16).numpy().view(np.uint16) if as_bf16 else out.numpy()
        # The kernel reads a word before knowing whether it needs it, so give it one to read: read-only
        # like the blob's sections, so that the kernel has one compiled signature, not two.
        words = section("words", "<u2") if header["total_words"] else np.frombuffer(bytes(2), dtype="<u2")
        with cachegen_cpu.threads_for(out.numel()):
            clean = cachegen_cpu.rans_decode(
                states,
                word_counts,
                words,
                frequencies,
                cumulative,
                table,
                section("qmax", "u1"),
                section("scales", "<f4").reshape(num_layers, 2, num_tokens),
                target,
            )
        if not clean:
            raise CacheGenError(
                "corrupt CacheGen blob: the rANS streams did not decode to their initial state"
            )
        return out.to(out_dtype)


def _pinned_copy(data: np.ndarray) -> Tensor:
    """`data` (uint8) copied into page-locked host memory."""
    pinned = torch.empty(len(data), dtype=torch.uint8, pin_memory=True)
    np.copyto(pinned.numpy(), data)
    return pinned


def _check_frequencies(frequencies: np.ndarray) -> None:
    if (frequencies.sum(axis=1) != PROBABILITY_SCALE).any():
        raise CacheGenError("corrupt CacheGen blob: a frequency table does not sum to 4096")


def _checksum(blob: memoryview | bytearray) -> int:
    view = memoryview(blob)
    return checksum(view[:_CHECKSUM_OFFSET], view[_HEADER.size :])


def _seal(blob: bytearray) -> None:
    _CHECKSUM.pack_into(blob, _CHECKSUM_OFFSET, _checksum(blob))


def sealed(blob: bytes) -> bytes:
    """A blob copied out of the GPU (`encode_to_device`), with its checksum filled in."""
    writable = bytearray(blob)
    _seal(writable)
    return bytes(writable)


def _parse(blob: memoryview, total_size: int | None = None) -> tuple[dict, _Layout]:
    """The header's fields and the section layout, checked against the blob's length and, when the
    whole blob is given (no `total_size`), its checksum. Nothing here allocates by the header's claims."""
    if len(blob) < _MAGIC_AND_VERSION.size:
        raise CacheGenError(f"not a CacheGen blob: {len(blob)} bytes is shorter than its header")
    magic, version = _MAGIC_AND_VERSION.unpack_from(blob)
    if magic != MAGIC:
        raise CacheGenError(f"not a CacheGen blob: magic {magic!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise CacheGenError(
            f"CacheGen blob of version {version}; this build reads version {VERSION} only "
            "(version 1 had no checksum): compress the chunk again"
        )
    if len(blob) < _HEADER.size:
        raise CacheGenError(f"not a CacheGen blob: {len(blob)} bytes is shorter than its header")
    fields = _HEADER.unpack_from(blob)
    _, _, dtype_code, probability_bits, num_layers, num_tokens, channels = fields[:7]
    layer_offset, total_layers, group_tokens, total_words, checksum = fields[7:]
    if probability_bits != PROBABILITY_BITS or group_tokens != GROUP_TOKENS:
        raise CacheGenError(
            f"CacheGen blob with probability bits {probability_bits} and groups of {group_tokens} tokens; "
            f"this build reads {PROBABILITY_BITS} and {GROUP_TOKENS}"
        )
    if dtype_code not in _CODE_DTYPES:
        raise CacheGenError(f"corrupt CacheGen blob: unknown dtype code {dtype_code}")
    if min(num_layers, num_tokens, channels) == 0 or layer_offset + num_layers > total_layers:
        raise CacheGenError(
            f"corrupt CacheGen blob: {num_layers} layers from {layer_offset} of {total_layers}, "
            f"{num_tokens} tokens, {channels} channels"
        )
    layout = _Layout(num_layers, num_tokens, channels, total_words)
    size = total_size if total_size is not None else len(blob)
    if size != layout.total_size:
        raise CacheGenError(
            f"corrupt or truncated CacheGen blob: {size} bytes, but its header describes {layout.total_size}"
        )
    if total_size is None and _checksum(blob) != checksum:
        raise CacheGenError("corrupt CacheGen blob: checksum mismatch")
    header = {
        "dtype": _CODE_DTYPES[dtype_code],
        "num_layers": num_layers,
        "num_tokens": num_tokens,
        "channels": channels,
        "layer_offset": layer_offset,
        "total_layers": total_layers,
        "total_words": total_words,
    }
    return header, layout

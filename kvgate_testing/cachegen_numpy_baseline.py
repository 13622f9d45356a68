"""The CacheGen codec's CPU path as it was before numba (numpy, a loop over steps across lanes).

Kept only as the "before" of benchmarks/cachegen_bench.py (side by side in one run) and as an
independent oracle for tests/test_cachegen.py: the numba path must produce the same blobs and values.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from cachelayer.compress.cachegen import (
    ALPHABET,
    GROUP_TOKENS,
    PROBABILITY_BITS,
    PROBABILITY_SCALE,
    STATE_LOWER_BOUND,
    CacheGenCodec,
    CacheGenError,
    _check_frequencies,
    _Layout,
    _parse,
    cumulative_frequencies,
    normalized_frequencies,
    sealed,
    symbol_lookup,
)


def quantization_scales(kv: Tensor, qmax: Tensor) -> tuple[Tensor, Tensor]:
    """Per-row scale = max|x| / qmax and its reciprocal (1 for all-zero rows), float32 [L, 2, T].

    IEEE divisions, as the CUDA quantize kernel does them (tl.div_rn), so CPU and CUDA agree bit for bit.
    """
    largest = kv.abs().amax(dim=-1).float()
    if not bool(torch.isfinite(largest).all()):
        raise CacheGenError("kv holds NaN or infinite values; CacheGen encodes finite values only")
    scales = largest / qmax.to(largest.device, torch.float32)[:, None, None]
    inverse = 1.0 / torch.where(scales > 0, scales, torch.ones_like(scales))
    return scales, inverse


def lane_group_lengths(num_layers: int, num_tokens: int, channels: int) -> np.ndarray:
    """Tokens coded by each lane (lanes ordered layer, K/V, group, channel): 256 but the last group's."""
    num_groups = -(-num_tokens // GROUP_TOKENS)
    per_group = np.minimum(GROUP_TOKENS, num_tokens - np.arange(num_groups) * GROUP_TOKENS)
    return np.broadcast_to(per_group[None, :, None], (num_layers * 2, num_groups, channels)).reshape(-1)


def encode(codec: CacheGenCodec, kv: Tensor, layer_offset: int = 0, total_layers: int | None = None) -> bytes:
    """The codec's CPU encode before numba: the same blob, bytes for bytes."""
    qmax = codec._check_input(kv, layer_offset, total_layers)
    num_layers, _, num_tokens, channels = kv.shape
    qmax_tensor = torch.tensor(qmax, dtype=torch.int32)
    scales, inverse = quantization_scales(kv, qmax_tensor)
    rounded = torch.round(kv.float() * inverse[..., None])
    symbols = (rounded + qmax_tensor.float()[:, None, None, None]).to(torch.uint8).numpy()
    rows = symbols.reshape(num_layers * 2, -1)
    counts = np.stack([np.bincount(row, minlength=ALPHABET) for row in rows])
    frequencies = normalized_frequencies(counts)
    states, word_counts, words = _rans_encode_numpy(symbols, frequencies, cumulative_frequencies(frequencies))
    header = codec._header(kv.dtype, num_layers, num_tokens, channels, layer_offset, total_layers, len(words))
    layout = _Layout(num_layers, num_tokens, channels, len(words))
    blob = bytearray(layout.total_size)
    blob[: len(header)] = header
    sections = {
        "qmax": np.asarray(qmax, dtype=np.uint8),
        "scales": scales.numpy().astype("<f4"),
        "frequencies": frequencies.astype("<u2"),
        "states": states.astype("<u4"),
        "counts": word_counts.astype("<u2"),
        "words": words.astype("<u2"),
    }
    for name, array in sections.items():
        start, size = layout.offsets[name]
        blob[start : start + size] = array.tobytes()
    return sealed(bytes(blob))


def decode(blob: bytes, dtype: torch.dtype | None = None) -> Tensor:
    """The codec's CPU decode before numba."""
    blob = memoryview(blob)
    header, layout = _parse(blob)
    num_layers, num_tokens, channels = header["num_layers"], header["num_tokens"], header["channels"]

    def section(name: str, numpy_dtype: str) -> np.ndarray:
        start, size = layout.offsets[name]
        return np.frombuffer(blob[start : start + size], dtype=numpy_dtype)

    qmax = section("qmax", "u1").astype(np.int32)
    scales = torch.from_numpy(section("scales", "<f4").reshape(num_layers, 2, num_tokens).copy())
    frequencies = section("frequencies", "<u2").reshape(-1, ALPHABET).astype(np.int64)
    _check_frequencies(frequencies)
    cumulative, table = symbol_lookup(frequencies)
    symbols = _rans_decode_numpy(
        section("states", "<u4"),
        section("counts", "<u2"),
        section("words", "<u2"),
        frequencies,
        cumulative,
        table,
        (num_layers, num_tokens, channels),
    )
    centered = torch.from_numpy(symbols.astype(np.int32) - qmax[:, None, None, None])
    values = centered.float() * scales[..., None]
    return values.to(dtype or header["dtype"])


def _lanes_by_step(symbols: np.ndarray) -> np.ndarray:
    """symbols uint8 [L, 2, T, C] -> [GROUP_TOKENS, lanes] (lane = (layer, K/V, group, channel)), padded."""
    num_layers, _, num_tokens, channels = symbols.shape
    num_groups = -(-num_tokens // GROUP_TOKENS)
    padded = np.zeros((num_layers * 2, num_groups * GROUP_TOKENS, channels), dtype=np.uint8)
    padded[:, :num_tokens] = symbols.reshape(num_layers * 2, num_tokens, channels)
    grouped = padded.reshape(num_layers * 2, num_groups, GROUP_TOKENS, channels)
    return np.ascontiguousarray(grouped.transpose(2, 0, 1, 3)).reshape(GROUP_TOKENS, -1)


def _rans_encode_numpy(
    symbols: np.ndarray, frequencies: np.ndarray, cumulative: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """rANS-encode every lane at once; a loop over steps (last token first), vectorized over lanes.

    The state stays below 2**32 at every step, so uint32 arithmetic is exact (and half the traffic).
    """
    num_layers, _, num_tokens, channels = symbols.shape
    steps = _lanes_by_step(symbols)
    num_lanes = steps.shape[1]
    lengths = lane_group_lengths(num_layers, num_tokens, channels)
    table_row = (np.arange(num_lanes) // (num_lanes // (num_layers * 2))).astype(np.int64) * ALPHABET
    # Padding symbols may have frequency 0; 1 keeps inactive lanes from dividing by zero.
    frequency_flat = np.maximum(frequencies.reshape(-1), 1).astype(np.uint32)
    cumulative_flat = cumulative.reshape(-1).astype(np.uint32)
    state = np.full(num_lanes, STATE_LOWER_BOUND, dtype=np.uint32)
    emitted_words = np.zeros((GROUP_TOKENS, num_lanes), dtype=np.uint16)
    emitted = np.zeros((GROUP_TOKENS, num_lanes), dtype=bool)
    renormalize_shift = np.uint32(32 - PROBABILITY_BITS)
    for step in range(GROUP_TOKENS - 1, -1, -1):
        active = lengths > step
        index = table_row + steps[step]
        frequency = frequency_flat[index]
        # state >= frequency << 20, written so that frequency 4096 cannot overflow 32 bits.
        emit = active & ((state >> renormalize_shift) >= frequency)
        emitted[step] = emit
        emitted_words[step] = state.astype(np.uint16)
        state = np.where(emit, state >> np.uint32(16), state)
        quotient = state // frequency
        remainder = state - quotient * frequency
        coded = (quotient << np.uint32(PROBABILITY_BITS)) + remainder + cumulative_flat[index]
        state = np.where(active, coded, state)
    word_counts = emitted.sum(axis=0).astype(np.uint16)
    words = emitted_words.T[emitted.T]
    return state, word_counts, words


def _rans_decode_numpy(
    states: np.ndarray,
    word_counts: np.ndarray,
    words: np.ndarray,
    frequencies: np.ndarray,
    cumulative: np.ndarray,
    table: np.ndarray,
    shape: tuple[int, int, int],
) -> np.ndarray:
    num_layers, num_tokens, channels = shape
    num_groups = -(-num_tokens // GROUP_TOKENS)
    num_lanes = num_layers * 2 * num_groups * channels
    if len(states) != num_lanes or len(word_counts) != num_lanes:
        raise CacheGenError("corrupt CacheGen blob: lane sections do not match the header")
    lengths = lane_group_lengths(num_layers, num_tokens, channels)
    row = (np.arange(num_lanes) // (num_groups * channels)).astype(np.int64)
    symbol_row = row * PROBABILITY_SCALE
    frequency_row = row * ALPHABET
    table_flat = table.reshape(-1)
    frequency_flat = frequencies.reshape(-1).astype(np.uint32)
    cumulative_flat = cumulative.reshape(-1).astype(np.uint32)
    counts = word_counts.astype(np.int64)
    position = np.cumsum(counts) - counts
    end = position + counts
    if end[-1] != len(words):
        raise CacheGenError("corrupt CacheGen blob: word counts do not add up to the words present")
    padded_words = np.concatenate([words.astype(np.uint32), np.zeros(1, dtype=np.uint32)])
    state = states.astype(np.uint32)
    out = np.zeros((GROUP_TOKENS, num_lanes), dtype=np.uint8)
    slot_mask = np.uint32(PROBABILITY_SCALE - 1)
    for step in range(GROUP_TOKENS):
        active = lengths > step
        slot = state & slot_mask
        symbol = table_flat[symbol_row + slot]
        index = frequency_row + symbol
        decoded = (
            frequency_flat[index] * (state >> np.uint32(PROBABILITY_BITS)) + slot - cumulative_flat[index]
        )
        state = np.where(active, decoded, state)
        need = active & (state < STATE_LOWER_BOUND) & (position < end)
        word = padded_words[np.where(need, position, len(words))]
        state = np.where(need, (state << np.uint32(16)) | word, state)
        position += need
        out[step] = symbol
    if (state != STATE_LOWER_BOUND).any() or (position != end).any():
        raise CacheGenError("corrupt CacheGen blob: the rANS streams did not decode to their initial state")
    grouped = out.reshape(GROUP_TOKENS, num_layers * 2, num_groups, channels).transpose(1, 2, 0, 3)
    tokens = grouped.reshape(num_layers * 2, num_groups * GROUP_TOKENS, channels)[:, :num_tokens]
    return tokens.reshape(num_layers, 2, num_tokens, channels)

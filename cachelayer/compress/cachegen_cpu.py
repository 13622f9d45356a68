"""The CacheGen codec's CPU kernels, compiled by numba: quantization, rANS encode and rANS decode.

They compute exactly what the format in cachegen.py defines (and what the CUDA kernels compute):
float32 arithmetic in IEEE order with no contraction (numba's default, fastmath off), round half to
even, 32-bit rANS states. Work is split across threads by (layer, K/V) plane for quantization and
by (plane, group of 256 tokens) for the rANS passes; inside a task the loop over a step runs across
the task's channels (lanes), which are contiguous in memory.

`cache=True` writes the compiled machine code next to this file (or, where that is read-only, to
numba's per-user cache; NUMBA_CACHE_DIR overrides both), so a process pays the JIT (seconds) only
on the first call on a machine.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import types
from numba.extending import overload

_PROBABILITY_BITS = 12
_SLOT_MASK = (1 << _PROBABILITY_BITS) - 1
_STATE_LOWER_BOUND = 1 << 16
_RENORMALIZE_SHIFT = 32 - _PROBABILITY_BITS
_GROUP_TOKENS = 256
_ALPHABET = 64

_JIT = dict(nogil=True, cache=True)


def _load_row(source, widened, as_float):
    """Copy one row of input into `as_float` (a float32 view of the uint32 buffer `widened`)."""


@overload(_load_row, jit_options={"cache": True})
def _load_row_for(source, widened, as_float):
    if source.dtype == types.uint16:

        def widen_bf16(source, widened, as_float):
            # bf16 is float32's upper half, so shifting the bits in is exact.
            for channel in range(source.shape[0]):
                widened[channel] = np.uint32(source[channel]) << np.uint32(16)

        return widen_bf16

    def copy_float32(source, widened, as_float):
        as_float[:] = source

    return copy_float32


def _store_row(row, row_bits, target):
    """Write one decoded float32 row (`row_bits` views it) into the output row `target`."""


@overload(_store_row, jit_options={"cache": True})
def _store_row_for(row, row_bits, target):
    if target.dtype == types.uint16:

        def narrow_to_bf16(row, row_bits, target):
            for channel in range(row.shape[0]):
                bits = row_bits[channel]
                if row[channel] != row[channel]:
                    target[channel] = 0x7FC0  # NaN (only from a corrupt scale), as torch writes it
                else:  # round half to even, as torch's float32 -> bf16 conversion
                    target[channel] = (bits + np.uint32(0x7FFF) + ((bits >> 16) & 1)) >> 16

        return narrow_to_bf16

    def copy_float32(row, row_bits, target):
        target[:] = row

    return copy_float32


@numba.njit(parallel=True, **_JIT)
def quantize(values, qmax, scales, symbols, counts):
    """values [L, 2, T, C] (float32, or bf16 bits as uint16) -> scales [L, 2, T], symbols [L * 2, T, C].

    scale = max|x| / qmax (IEEE float32 division), symbol = round_half_even(x * (1 / scale)) + qmax,
    counts [L * 2, ALPHABET] the symbol histogram of each plane. Returns False if any value is not
    finite (the outputs are then meaningless).
    """
    num_layers, _, num_tokens, channels = values.shape
    finite = np.ones(num_layers * 2, dtype=np.bool_)
    for plane in numba.prange(num_layers * 2):
        layer, kv = plane // 2, plane % 2
        level = np.int64(qmax[layer])
        level_float = np.float32(level)
        widened = np.empty(channels, dtype=np.uint32)
        as_float = widened.view(np.float32)
        histogram = np.zeros(_ALPHABET, dtype=np.int64)
        for token in range(num_tokens):
            _load_row(values[layer, kv, token], widened, as_float)
            row = as_float
            largest = np.float32(0.0)
            for channel in range(channels):
                magnitude = abs(row[channel])
                if not magnitude < np.inf:  # NaN compares false, inf is not below inf
                    finite[plane] = False
                largest = max(largest, magnitude)
            scale = np.float32(largest / level_float)
            scales[layer, kv, token] = scale
            inverse = np.float32(np.float32(1.0) / scale) if scale > 0 else np.float32(1.0)
            out = symbols[plane, token]
            for channel in range(channels):
                rounded = np.rint(np.float32(row[channel] * inverse))
                symbol = np.int64(rounded) + level
                out[channel] = symbol
                histogram[symbol & (_ALPHABET - 1)] += 1
        counts[plane] = histogram
    return finite.all()


@numba.njit(parallel=True, **_JIT)
def rans_encode(symbols, frequencies, cumulative, states, word_counts, lane_words):
    """rANS-encode every lane; lane (plane, group, channel) codes its group's tokens, last first.

    symbols [planes, T, C] uint8; frequencies/cumulative [planes, ALPHABET]; outputs states and
    word_counts [lanes], lane_words [lanes, GROUP_TOKENS] uint16 with each lane's words at the END
    of its row, in the order the decoder reads them.
    """
    num_planes, num_tokens, channels = symbols.shape
    num_groups = (num_tokens + _GROUP_TOKENS - 1) // _GROUP_TOKENS
    for task in numba.prange(num_planes * num_groups):
        plane, group = task // num_groups, task % num_groups
        first_token = group * _GROUP_TOKENS
        length = min(_GROUP_TOKENS, num_tokens - first_token)
        first_lane = task * channels
        frequency = frequencies[plane].astype(np.int64)
        start = cumulative[plane].astype(np.int64)
        state = np.full(channels, _STATE_LOWER_BOUND, dtype=np.int64)
        emitted = np.zeros(channels, dtype=np.int64)
        for step in range(length - 1, -1, -1):
            row = symbols[plane, first_token + step]
            for channel in range(channels):
                symbol = row[channel]
                symbol_frequency = frequency[symbol]
                x = state[channel]
                if (x >> _RENORMALIZE_SHIFT) >= symbol_frequency:
                    lane_words[first_lane + channel, _GROUP_TOKENS - 1 - emitted[channel]] = x & 0xFFFF
                    emitted[channel] += 1
                    x >>= 16
                quotient = x // symbol_frequency
                state[channel] = (
                    (quotient << _PROBABILITY_BITS) + (x - quotient * symbol_frequency) + start[symbol]
                )
        for channel in range(channels):
            states[first_lane + channel] = state[channel]
            word_counts[first_lane + channel] = emitted[channel]


@numba.njit(parallel=True, **_JIT)
def gather_words(lane_words, word_counts, word_starts, words):
    """Concatenate each lane's words (the tail of its lane_words row) lane after lane into `words`."""
    for lane in numba.prange(lane_words.shape[0]):
        count = np.int64(word_counts[lane])
        words[word_starts[lane] : word_starts[lane] + count] = lane_words[lane, _GROUP_TOKENS - count :]


@numba.njit(parallel=True, **_JIT)
def rans_decode(states, word_counts, words, frequencies, cumulative, table, qmax, scales, out):
    """Decode every lane and dequantize: out[l, kv, t, c] = (symbol - qmax[l]) * scales[l, kv, t].

    out is float32, or uint16 for bf16 bit patterns (float32 rounded half to even, as torch does).
    Returns False unless every lane read exactly its words and ended on the initial state.
    """
    num_layers, _, num_tokens, channels = out.shape
    num_planes = num_layers * 2
    num_groups = (num_tokens + _GROUP_TOKENS - 1) // _GROUP_TOKENS
    ends = np.cumsum(word_counts.astype(np.int64))
    clean = np.ones(num_planes * num_groups, dtype=np.bool_)
    for task in numba.prange(num_planes * num_groups):
        plane, group = task // num_groups, task % num_groups
        layer, kv = plane // 2, plane % 2
        level = np.int64(qmax[layer])
        first_token = group * _GROUP_TOKENS
        length = min(_GROUP_TOKENS, num_tokens - first_token)
        first_lane = task * channels
        frequency = frequencies[plane].astype(np.int64)
        start = cumulative[plane].astype(np.int64)
        slots = table[plane]
        state = states[first_lane : first_lane + channels].astype(np.int64)
        end = ends[first_lane : first_lane + channels].copy()
        position = end - word_counts[first_lane : first_lane + channels].astype(np.int64)
        row = np.empty(channels, dtype=np.float32)
        row_bits = row.view(np.uint32)
        for step in range(length):
            token = first_token + step
            scale = scales[layer, kv, token]
            for channel in range(channels):
                x = state[channel]
                slot = x & _SLOT_MASK
                symbol = np.int64(slots[slot])
                x = frequency[symbol] * (x >> _PROBABILITY_BITS) + slot - start[symbol]
                if x < _STATE_LOWER_BOUND and position[channel] < end[channel]:
                    x = (x << 16) | np.int64(words[position[channel]])
                    position[channel] += 1
                state[channel] = x
                row[channel] = np.float32(np.float32(symbol - level) * scale)
            _store_row(row, row_bits, out[layer, kv, token])
        for channel in range(channels):
            if state[channel] != _STATE_LOWER_BOUND or position[channel] != end[channel]:
                clean[task] = False
    return clean.all()

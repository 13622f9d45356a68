"""The CacheGen codec's CPU kernels, compiled by numba: quantization, rANS encode and rANS decode.

They compute exactly what the format in cachegen.py defines (and what the CUDA kernels compute):
float32 arithmetic in IEEE order with no contraction (numba's default, fastmath off), round half to
even, 32-bit rANS states. Work is split across threads by (layer, K/V) plane for quantization and
by (plane, group of 256 tokens) for the rANS passes; inside a task, blocks of 32 lanes (channels,
contiguous in memory) run through all their steps, the loop over a step running across the block.

`cache=True` writes the compiled machine code next to this file (or, where that is read-only, to
numba's per-user cache; NUMBA_CACHE_DIR overrides both), so a process pays the JIT (seconds) only
on the first call on a machine.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numba
import numpy as np
from numba import types
from numba.extending import overload

from cachelayer.compress.cachegen import ALPHABET as _ALPHABET
from cachelayer.compress.cachegen import GROUP_TOKENS as _GROUP_TOKENS
from cachelayer.compress.cachegen import PROBABILITY_BITS as _PROBABILITY_BITS
from cachelayer.compress.cachegen import STATE_LOWER_BOUND as _STATE_LOWER_BOUND

_SLOT_MASK = (1 << _PROBABILITY_BITS) - 1
_RENORMALIZE_SHIFT = 32 - _PROBABILITY_BITS
_LANE_BLOCK = 32  # lanes coded together; see rans_encode

_JIT = dict(nogil=True, cache=True)

# Below this many values (about a millisecond of work on one core) a chunk runs on the calling
# thread only: a parallel region must wait for every worker to be scheduled, which on a busy machine
# costs more than the work (docs/benchmarks.md, "Figures behind choices in the code").
PARALLEL_MIN_VALUES = 1 << 20


@contextlib.contextmanager
def threads_for(num_values: int) -> Iterator[None]:
    """Run the kernels called inside on one thread for small inputs, on all of numba's otherwise."""
    previous = numba.get_num_threads()
    numba.set_num_threads(previous if num_values >= PARALLEL_MIN_VALUES else 1)
    try:
        yield
    finally:
        numba.set_num_threads(previous)


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
        for channel in range(source.shape[0]):
            as_float[channel] = source[channel]

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
        for channel in range(row.shape[0]):  # a loop: a slice assignment per channel costs more
            target[channel] = row[channel]

    return copy_float32


@numba.njit(**_JIT)
def _quantize_plane(values, level, scales, symbols, counts, widened, as_float, largest_bits, largest_float):
    """One (layer, K/V) plane: values [T, C] -> scales [T], symbols [T, C], counts [ALPHABET]."""
    num_tokens, channels = values.shape
    level_float = np.float32(level)
    finite = True
    # Four interleaved histograms, so that runs of one symbol do not serialize on one counter.
    histogram = np.zeros(4 * _ALPHABET, dtype=np.int64)
    for token in range(num_tokens):
        _load_row(values[token], widened, as_float)
        # max|x| on the bit patterns: for non-negative floats integer order is float order,
        # and an integer max vectorizes where a float max (NaN rules) does not.
        largest = np.uint32(0)
        for channel in range(channels):
            largest = max(largest, widened[channel] & np.uint32(0x7FFFFFFF))
        if largest >= np.uint32(0x7F800000):  # inf or NaN
            finite = False
        largest_bits[0] = largest
        scale = np.float32(largest_float[0] / level_float)
        scales[token] = scale
        inverse = np.float32(np.float32(1.0) / scale) if scale > 0 else np.float32(1.0)
        out = symbols[token]
        for channel in range(channels):
            out[channel] = np.int32(np.rint(np.float32(as_float[channel] * inverse))) + level
        for channel in range(channels):
            histogram[(channel & 3) * _ALPHABET + (out[channel] & (_ALPHABET - 1))] += 1
    for symbol in range(_ALPHABET):
        counts[symbol] = (
            histogram[symbol]
            + histogram[_ALPHABET + symbol]
            + histogram[2 * _ALPHABET + symbol]
            + histogram[3 * _ALPHABET + symbol]
        )
    return finite


@numba.njit(parallel=True, **_JIT)
def quantize(values, qmax, scales, symbols, counts):
    """values [L, 2, T, C] (float32, or bf16 bits as uint16) -> scales [L, 2, T], symbols [L * 2, T, C].

    scale = max|x| / qmax (IEEE float32 division), symbol = round_half_even(x * (1 / scale)) + qmax,
    counts [L * 2, ALPHABET] the symbol histogram of each plane. Returns False if any value is not
    finite (the outputs are then meaningless).
    """
    num_layers, _, _, channels = values.shape
    finite = np.ones(num_layers * 2, dtype=np.bool_)
    for plane in numba.prange(num_layers * 2):
        layer, kv = plane // 2, plane % 2
        widened = np.empty(channels, dtype=np.uint32)
        largest_bits = np.empty(1, dtype=np.uint32)
        finite[plane] = _quantize_plane(
            values[layer, kv],
            np.int32(qmax[layer]),
            scales[layer, kv],
            symbols[plane],
            counts[plane],
            widened,
            widened.view(np.float32),
            largest_bits,
            largest_bits.view(np.float32),
        )
    return finite.all()


@numba.njit(**_JIT)
def _encode_lanes(symbols, frequency, start, reciprocal, states, word_counts, lane_words):
    """Encode lanes side by side: symbols [steps, lanes] (coded last step first) -> outputs [lanes]."""
    length, lanes = symbols.shape
    state = np.full(lanes, _STATE_LOWER_BOUND, dtype=np.int64)
    emitted = np.zeros(lanes, dtype=np.int64)
    for step in range(length - 1, -1, -1):
        row = symbols[step]
        for lane in range(lanes):
            symbol = row[lane]
            symbol_frequency = frequency[symbol]
            x = state[lane]
            # Branch-free renormalization (the branch is data-dependent and mispredicts): the
            # word is written every step, and kept only when `emit` advances the count. At most
            # 255 words a lane: the first step (state 2**16) never emits.
            emit = np.int64((x >> _RENORMALIZE_SHIFT) >= symbol_frequency)
            lane_words[lane, _GROUP_TOKENS - 1 - emitted[lane]] = x & 0xFFFF
            emitted[lane] += emit
            x >>= 16 * emit
            quotient = np.int64(x * reciprocal[symbol])
            remainder = x - quotient * symbol_frequency
            correction = np.int64(remainder >= symbol_frequency)
            quotient += correction
            remainder -= correction * symbol_frequency
            state[lane] = (quotient << _PROBABILITY_BITS) + remainder + start[symbol]
    states[:] = state
    word_counts[:] = emitted


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
        last_token = min(first_token + _GROUP_TOKENS, num_tokens)
        frequency = frequencies[plane].astype(np.int64)
        # x // f through a float64 reciprocal: x < 2**32 and f <= 4096 keep the product within
        # 2**-20 of x / f, so the truncated quotient is exact or, when f divides x, one short;
        # the remainder test corrects that case. (Cheaper than an integer division.)
        reciprocal = 1.0 / np.maximum(frequency, 1).astype(np.float64)
        start = cumulative[plane].astype(np.int64)
        # A block of lanes runs through all its steps before the next block starts, so its
        # states, symbols and words stay in L1 (a whole task's words would not).
        for block_start in range(0, channels, _LANE_BLOCK):
            block_end = min(block_start + _LANE_BLOCK, channels)
            lanes = slice(task * channels + block_start, task * channels + block_end)
            _encode_lanes(
                symbols[plane, first_token:last_token, block_start:block_end],
                frequency,
                start,
                reciprocal,
                states[lanes],
                word_counts[lanes],
                lane_words[lanes],
            )


@numba.njit(parallel=True, **_JIT)
def gather_words(lane_words, word_counts, word_starts, words):
    """Concatenate each lane's words (the tail of its lane_words row) lane after lane into `words`."""
    for lane in numba.prange(lane_words.shape[0]):
        count = np.int64(word_counts[lane])
        first = word_starts[lane]
        source = lane_words[lane]
        for index in range(count):
            words[first + index] = source[_GROUP_TOKENS - count + index]


@numba.njit(**_JIT)
def _decode_lanes(states, position, end, words, frequency, start, slots, level, scales, out, row, row_bits):
    """Decode lanes side by side into out [steps, lanes] (dequantized); False if a lane is corrupt."""
    length, lanes = out.shape
    state = states.astype(np.int64)
    last_word = len(words) - 1
    for step in range(length):
        scale = scales[step]
        for lane in range(lanes):
            x = state[lane]
            slot = x & _SLOT_MASK
            symbol = np.int64(slots[slot])
            x = frequency[symbol] * (x >> _PROBABILITY_BITS) + slot - start[symbol]
            # Branch-free renormalization (see _encode_lanes); an unneeded word is read, then dropped.
            at = position[lane]
            need = np.int64(x < _STATE_LOWER_BOUND) & np.int64(at < end[lane])
            word = np.int64(words[min(at, last_word)]) & -need
            state[lane] = (x << (16 * need)) | word
            position[lane] = at + need
            row[lane] = np.float32(np.float32(symbol - level) * scale)
        _store_row(row[:lanes], row_bits[:lanes], out[step])
    for lane in range(lanes):
        if state[lane] != _STATE_LOWER_BOUND or position[lane] != end[lane]:
            return False
    return True


@numba.njit(parallel=True, **_JIT)
def rans_decode(states, word_counts, words, frequencies, cumulative, table, qmax, scales, out):
    """Decode every lane and dequantize: out[l, kv, t, c] = (symbol - qmax[l]) * scales[l, kv, t].

    out is float32, or uint16 for bf16 bit patterns (float32 rounded half to even, as torch does).
    `words` must hold at least one word. Returns False unless every lane read exactly its words
    and ended on the initial state.
    """
    num_layers, _, num_tokens, channels = out.shape
    num_groups = (num_tokens + _GROUP_TOKENS - 1) // _GROUP_TOKENS
    ends = np.cumsum(word_counts.astype(np.int64))
    clean = np.ones(num_layers * 2 * num_groups, dtype=np.bool_)
    for task in numba.prange(num_layers * 2 * num_groups):
        plane, group = task // num_groups, task % num_groups
        layer, kv = plane // 2, plane % 2
        first_token = group * _GROUP_TOKENS
        last_token = min(first_token + _GROUP_TOKENS, num_tokens)
        frequency = frequencies[plane].astype(np.int64)
        start = cumulative[plane].astype(np.int64)
        row = np.empty(_LANE_BLOCK, dtype=np.float32)
        for block_start in range(0, channels, _LANE_BLOCK):
            block_end = min(block_start + _LANE_BLOCK, channels)
            lanes = slice(task * channels + block_start, task * channels + block_end)
            end = ends[lanes].copy()
            ok = _decode_lanes(
                states[lanes],
                end - word_counts[lanes].astype(np.int64),
                end,
                words,
                frequency,
                start,
                table[plane],
                np.int64(qmax[layer]),
                scales[layer, kv, first_token:last_token],
                out[layer, kv, first_token:last_token, block_start:block_end],
                row,
                row.view(np.uint32),
            )
            if not ok:
                clean[task] = False
    return clean.all()

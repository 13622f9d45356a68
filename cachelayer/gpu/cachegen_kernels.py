"""Triton kernels of the CacheGen codec (cachelayer/compress/cachegen.py holds the format and CPU path).

- quantize: per-row scales, symbols = round(x * (1 / scale)) + qmax, the per-(layer, K/V) symbol
  histogram, and a count of non-finite inputs, in one launch;
- rans_encode: one rANS lane per thread, run twice: once to count each lane's words (so every
  lane knows where its words go), once to write them;
- rans_decode: one lane per thread, dequantizing as it goes.
Every kernel runs with floating-point contraction off, so products round exactly as torch's on CPU.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl
from torch import Tensor

_ALPHABET = 64
_PROBABILITY_BITS = 12
_GROUP_TOKENS = 256
_LANES_PER_PROGRAM = 128
# Adding then subtracting 1.5 * 2**23 rounds a float32 of magnitude < 2**22 to the nearest integer,
# ties to even: torch.round's rule, without a library call.
_ROUNDING_MAGIC = 12582912.0


@triton.jit
def _quantize_kernel(
    kv_ptr,
    qmax_ptr,
    scales_ptr,
    symbols_ptr,
    counts_ptr,
    nonfinite_ptr,
    num_tokens,
    channels,
    BLOCK_TOKENS: tl.constexpr,
    BLOCK_CHANNELS: tl.constexpr,
    ALPHABET: tl.constexpr,
    MAGIC: tl.constexpr,
):
    """Scales (max|x| / qmax, IEEE division as torch's), symbols and histogram of BLOCK_TOKENS rows;
    the second pass over the rows reads them from L2."""
    token_block = tl.program_id(0)
    row = tl.program_id(1)  # (layer, K/V)
    qmax = tl.load(qmax_ptr + row // 2)
    tokens = token_block * BLOCK_TOKENS + tl.arange(0, BLOCK_TOKENS)
    token_valid = tokens < num_tokens
    row_base = (row.to(tl.int64) * num_tokens + tokens) * channels
    largest = tl.zeros([BLOCK_TOKENS], dtype=tl.float32)
    nonfinite = tl.zeros([BLOCK_TOKENS], dtype=tl.int32)
    for start in range(0, channels, BLOCK_CHANNELS):
        columns = start + tl.arange(0, BLOCK_CHANNELS)
        mask = token_valid[:, None] & (columns < channels)[None, :]
        magnitude = tl.abs(
            tl.load(kv_ptr + row_base[:, None] + columns[None, :], mask=mask, other=0.0).to(tl.float32)
        )
        bad = (magnitude != magnitude) | (magnitude == float("inf"))
        nonfinite += tl.sum(bad.to(tl.int32), axis=1)
        largest = tl.maximum(largest, tl.max(magnitude, axis=1))
    scale = tl.div_rn(largest, tl.zeros_like(largest) + qmax.to(tl.float32))
    safe = tl.where(scale > 0, scale, 1.0)
    inverse = tl.div_rn(tl.zeros_like(safe) + 1.0, safe)
    tl.store(scales_ptr + row * num_tokens + tokens, scale, mask=token_valid)

    histogram = tl.zeros([ALPHABET], dtype=tl.int32)
    masked_out = 0
    for start in range(0, channels, BLOCK_CHANNELS):
        columns = start + tl.arange(0, BLOCK_CHANNELS)
        mask = token_valid[:, None] & (columns < channels)[None, :]
        addresses = row_base[:, None] + columns[None, :]
        values = tl.load(kv_ptr + addresses, mask=mask, other=0.0).to(tl.float32)
        scaled = values * inverse[:, None]
        rounded = (scaled + MAGIC) - MAGIC
        symbols = tl.where(mask, rounded.to(tl.int32) + qmax, 0)
        tl.store(symbols_ptr + addresses, symbols.to(tl.uint8), mask=mask)
        histogram += tl.histogram(tl.reshape(symbols, [BLOCK_TOKENS * BLOCK_CHANNELS]), ALPHABET)
        masked_out += tl.sum(tl.sum((~mask).to(tl.int32), axis=1), axis=0)
    bins = tl.arange(0, ALPHABET)
    histogram -= tl.where(bins == 0, masked_out, 0)  # masked elements were counted as symbol 0
    tl.atomic_add(counts_ptr + row * ALPHABET + bins, histogram)
    tl.atomic_add(nonfinite_ptr, tl.sum(nonfinite, axis=0))


@triton.jit
def _rans_encode_kernel(
    symbols_ptr,
    frequency_ptr,
    cumulative_ptr,
    states_ptr,
    counts_ptr,
    offsets_ptr,
    words_ptr,
    num_lanes,
    num_tokens,
    channels,
    num_groups,
    GROUP: tl.constexpr,
    WRITE: tl.constexpr,
    BLOCK: tl.constexpr,
    ALPHABET: tl.constexpr,
    PROBABILITY_BITS: tl.constexpr,
):
    lanes = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = lanes < num_lanes
    channel = lanes % channels
    rest = lanes // channels
    group = rest % num_groups
    row = rest // num_groups
    length = tl.where(valid, tl.minimum(num_tokens - group * GROUP, GROUP), 0)
    base = (row.to(tl.int64) * num_tokens + group * GROUP) * channels + channel
    table = row * ALPHABET
    state = tl.full([BLOCK], 65536, tl.uint32)
    emitted = tl.zeros([BLOCK], dtype=tl.int32)
    if WRITE:
        total = tl.load(counts_ptr + lanes, mask=valid, other=0)
        first_word = tl.load(offsets_ptr + lanes, mask=valid, other=0)
    for reverse_step in range(GROUP):
        step = GROUP - 1 - reverse_step
        active = step < length
        symbol = tl.load(symbols_ptr + base + step * channels, mask=active, other=0).to(tl.int32)
        frequency = tl.load(frequency_ptr + table + symbol, mask=active, other=1).to(tl.uint32)
        cumulative = tl.load(cumulative_ptr + table + symbol, mask=active, other=0).to(tl.uint32)
        # state >= frequency << 20, written so that frequency 4096 cannot overflow 32 bits.
        emit = active & ((state >> (32 - PROBABILITY_BITS)) >= frequency)
        if WRITE:
            position = first_word + (total - 1 - emitted)
            tl.store(words_ptr + position, (state & 0xFFFF).to(tl.int16), mask=emit)
        emitted += emit.to(tl.int32)
        state = tl.where(emit, state >> 16, state)
        quotient = state // frequency
        coded = (quotient << PROBABILITY_BITS) + (state - quotient * frequency) + cumulative
        state = tl.where(active, coded, state)
    if not WRITE:
        tl.store(states_ptr + lanes, state.to(tl.int32, bitcast=True), mask=valid)
        tl.store(counts_ptr + lanes, emitted, mask=valid)


@triton.jit
def _rans_decode_kernel(
    states_ptr,
    offsets_ptr,
    ends_ptr,
    words_ptr,
    frequency_ptr,
    cumulative_ptr,
    table_ptr,
    scales_ptr,
    qmax_ptr,
    out_ptr,
    final_ptr,
    num_lanes,
    num_tokens,
    channels,
    num_groups,
    GROUP: tl.constexpr,
    BLOCK: tl.constexpr,
    ALPHABET: tl.constexpr,
    PROBABILITY_BITS: tl.constexpr,
):
    lanes = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = lanes < num_lanes
    channel = lanes % channels
    rest = lanes // channels
    group = rest % num_groups
    row = rest // num_groups
    length = tl.where(valid, tl.minimum(num_tokens - group * GROUP, GROUP), 0)
    state = tl.load(states_ptr + lanes, mask=valid, other=65536).to(tl.uint32, bitcast=True)
    position = tl.load(offsets_ptr + lanes, mask=valid, other=0)
    end = tl.load(ends_ptr + lanes, mask=valid, other=0)
    qmax = tl.load(qmax_ptr + row // 2, mask=valid, other=0)
    first_token = row.to(tl.int64) * num_tokens + group * GROUP
    out_base = first_token * channels + channel
    symbol_table = row * (1 << PROBABILITY_BITS)
    table = row * ALPHABET
    for step in range(GROUP):
        active = step < length
        slot = state & ((1 << PROBABILITY_BITS) - 1)
        symbol = tl.load(table_ptr + symbol_table + slot.to(tl.int32), mask=active, other=0).to(tl.int32)
        frequency = tl.load(frequency_ptr + table + symbol, mask=active, other=1).to(tl.uint32)
        cumulative = tl.load(cumulative_ptr + table + symbol, mask=active, other=0).to(tl.uint32)
        decoded = frequency * (state >> PROBABILITY_BITS) + slot - cumulative
        state = tl.where(active, decoded, state)
        need = active & (state < 65536) & (position < end)
        word = (tl.load(words_ptr + position, mask=need, other=0).to(tl.int32) & 0xFFFF).to(tl.uint32)
        state = tl.where(need, (state << 16) | word, state)
        position += need.to(tl.int64)
        scale = tl.load(scales_ptr + first_token + step, mask=active, other=0.0)
        value = (symbol - qmax).to(tl.float32) * scale
        tl.store(out_ptr + out_base + step * channels, value.to(out_ptr.dtype.element_ty), mask=active)
    tl.store(final_ptr + lanes, state.to(tl.int32, bitcast=True), mask=valid)
    tl.store(final_ptr + num_lanes + lanes, (position == end).to(tl.int32), mask=valid)


def quantize(kv: Tensor, qmax: Tensor) -> tuple[Tensor, Tensor, np.ndarray, int]:
    """Scales float32 [L, 2, T], symbols uint8 [L, 2, T, C] (on the GPU), symbol counts [L * 2, 64]
    and the number of non-finite inputs (on the host), for a contiguous CUDA kv."""
    num_layers, _, num_tokens, channels = kv.shape
    scales = torch.empty(num_layers, 2, num_tokens, dtype=torch.float32, device=kv.device)
    symbols = torch.empty(kv.shape, dtype=torch.uint8, device=kv.device)
    counts = torch.zeros(num_layers * 2, _ALPHABET, dtype=torch.int32, device=kv.device)
    nonfinite = torch.zeros(1, dtype=torch.int32, device=kv.device)
    block_channels = min(triton.next_power_of_2(channels), 256)
    block_tokens = max(1, 4096 // block_channels)
    grid = (triton.cdiv(num_tokens, block_tokens), num_layers * 2)
    with torch.cuda.device(kv.device):  # Triton launches on the current device
        _quantize_kernel[grid](
            kv,
            qmax,
            scales,
            symbols,
            counts,
            nonfinite,
            num_tokens,
            channels,
            BLOCK_TOKENS=block_tokens,
            BLOCK_CHANNELS=block_channels,
            ALPHABET=_ALPHABET,
            MAGIC=_ROUNDING_MAGIC,
            num_warps=8,
            enable_fp_fusion=False,
        )
    # One read-back for both: the histogram is needed on the host for the frequency tables anyway.
    host = torch.cat([counts.view(-1), nonfinite]).cpu().numpy()
    return scales, symbols, host[:-1].reshape(num_layers * 2, _ALPHABET), int(host[-1])


def rans_encode(symbols: Tensor, frequencies: Tensor, cumulative: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Final states (int32 bits of uint32), words per lane (int16 bits of uint16) and the words."""
    num_layers, _, num_tokens, channels = symbols.shape
    num_groups = triton.cdiv(num_tokens, _GROUP_TOKENS)
    num_lanes = num_layers * 2 * num_groups * channels
    states = torch.empty(num_lanes, dtype=torch.int32, device=symbols.device)
    counts = torch.empty(num_lanes, dtype=torch.int32, device=symbols.device)
    grid = (triton.cdiv(num_lanes, _LANES_PER_PROGRAM),)
    common = dict(
        GROUP=_GROUP_TOKENS, BLOCK=_LANES_PER_PROGRAM, ALPHABET=_ALPHABET, PROBABILITY_BITS=_PROBABILITY_BITS
    )
    arguments = (symbols, frequencies, cumulative, states, counts)
    dimensions = (num_lanes, num_tokens, channels, num_groups)
    with torch.cuda.device(symbols.device):  # Triton launches on the current device
        _rans_encode_kernel[grid](*arguments, counts, counts, *dimensions, WRITE=False, **common)
    offsets = torch.cumsum(counts, 0, dtype=torch.int64) - counts
    total_words = int(offsets[-1] + counts[-1])
    words = torch.empty(total_words, dtype=torch.int16, device=symbols.device)
    if total_words:
        with torch.cuda.device(symbols.device):
            _rans_encode_kernel[grid](*arguments, offsets, words, *dimensions, WRITE=True, **common)
    return states, counts.to(torch.int16), words


def rans_decode(
    states: Tensor,
    offsets: Tensor,
    ends: Tensor,
    words: Tensor,
    frequencies: Tensor,
    cumulative: Tensor,
    table: Tensor,
    scales: Tensor,
    qmax: Tensor,
    out: Tensor,
) -> bool:
    """Decode every lane into `out` [L, 2, T, C]; False if a lane did not end on its initial state
    having read exactly its words (a corrupt blob). `ends[lane]` is one past the lane's last word."""
    num_layers, _, num_tokens, channels = out.shape
    num_groups = triton.cdiv(num_tokens, _GROUP_TOKENS)
    num_lanes = num_layers * 2 * num_groups * channels
    final = torch.empty(2 * num_lanes, dtype=torch.int32, device=out.device)
    grid = (triton.cdiv(num_lanes, _LANES_PER_PROGRAM),)
    with torch.cuda.device(out.device):  # Triton launches on the current device
        _rans_decode_kernel[grid](
            states,
            offsets,
            ends,
            words if words.numel() else torch.zeros(1, dtype=torch.int16, device=out.device),
            frequencies,
            cumulative,
            table,
            scales,
            qmax,
            out,
            final,
            num_lanes,
            num_tokens,
            channels,
            num_groups,
            GROUP=_GROUP_TOKENS,
            BLOCK=_LANES_PER_PROGRAM,
            ALPHABET=_ALPHABET,
            PROBABILITY_BITS=_PROBABILITY_BITS,
            enable_fp_fusion=False,
        )
    return bool(((final[:num_lanes] == 65536) & (final[num_lanes:] == 1)).all())

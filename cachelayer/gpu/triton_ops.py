"""The Triton kernel that moves tokens between every layer of a paged cache and a chunk in one launch.

Layers are reached through a table of their base addresses, stored as element offsets from layer
0's tensor (so the kernel keeps one typed pointer and the compiler can prove 16-byte alignment);
each program copies a tile of TOKENS tokens x COLUMNS elements of one (layer, plane).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from cachelayer.gpu.layouts import LayerSetMemo, PagedGeometry

# Divisibility (in elements) that lets every row start on a 16-byte boundary for 2-byte dtypes.
_ALIGN_ELEMENTS = 16
_layer_tables = LayerSetMemo()


@triton.jit
def _paged_copy_kernel(
    cache_ptr,
    layer_offsets_ptr,
    chunk_ptr,
    slot_mapping_ptr,
    num_tokens,
    width,
    layer_start,
    num_planes,
    block_size,
    plane_stride,
    block_stride,
    position_stride,
    chunk_layer_stride,
    chunk_plane_stride,
    TO_CHUNK: tl.constexpr,
    ALIGNED: tl.constexpr,
    EVEN_COLUMNS: tl.constexpr,
    TOKENS: tl.constexpr,
    COLUMNS: tl.constexpr,
    BLOCKS_PER_PROGRAM: tl.constexpr,
    LAYER_FASTEST: tl.constexpr,
    STREAMING: tl.constexpr,
    FILL_SKIPPED: tl.constexpr,
):
    if LAYER_FASTEST:
        layer_plane = tl.program_id(0)
        token_group = tl.program_id(1)
    else:
        token_group = tl.program_id(0)
        layer_plane = tl.program_id(1)
    column_block = tl.program_id(2)
    layer = layer_start + layer_plane // num_planes
    plane = layer_plane % num_planes
    layer_offset = tl.load(layer_offsets_ptr + layer)
    columns = column_block * COLUMNS + tl.arange(0, COLUMNS)
    columns = tl.max_contiguous(tl.multiple_of(columns, COLUMNS), COLUMNS)

    for block_in_program in range(BLOCKS_PER_PROGRAM):
        tokens = (token_group * BLOCKS_PER_PROGRAM + block_in_program) * TOKENS + tl.arange(0, TOKENS)
        in_range = tokens < num_tokens
        # Slots fit in 32 bits (a cache has fewer than 2**31 slots); 64-bit division costs ~4x more.
        slots = tl.load(slot_mapping_ptr + tokens, mask=in_range, other=-1).to(tl.int32)
        valid = slots >= 0
        slots = tl.where(valid, slots, 0)
        blocks = slots // block_size
        positions = slots - blocks * block_size
        cache_rows = (
            layer_offset
            + plane * plane_stride
            + blocks.to(tl.int64) * block_stride
            + positions.to(tl.int64) * position_stride
        )
        chunk_rows = (
            layer.to(tl.int64) * chunk_layer_stride + plane * chunk_plane_stride + tokens.to(tl.int64) * width
        )
        if ALIGNED:
            cache_rows = tl.multiple_of(cache_rows, 16)
            chunk_rows = tl.multiple_of(chunk_rows, 16)
        # A store fills the rows of skipped tokens with zeros (FILL_SKIPPED), so that the host chunk
        # holds no stale bytes; gathers and scatters leave them alone.
        written = in_range if FILL_SKIPPED else valid
        if EVEN_COLUMNS:
            mask = valid[:, None]
            write_mask = written[:, None]
        else:
            mask = valid[:, None] & (columns < width)[None, :]
            write_mask = written[:, None] & (columns < width)[None, :]
        cache_addresses = cache_ptr + cache_rows[:, None] + columns[None, :]
        chunk_addresses = chunk_ptr + chunk_rows[:, None] + columns[None, :]
        if TO_CHUNK:
            source = cache_addresses
            target = chunk_addresses
        else:
            source = chunk_addresses
            target = cache_addresses
        if STREAMING:  # each byte is touched once: keep it from evicting anything else in L2
            values = tl.load(source, mask=mask, other=0, eviction_policy="evict_first")
            tl.store(target, values, mask=write_mask, cache_modifier=".cs")
        else:
            tl.store(target, tl.load(source, mask=mask, other=0), mask=write_mask)


def _layer_table(kv_caches: Sequence[Tensor]) -> tuple[Tensor, bool]:
    """Element offsets of each layer from layer 0 (on the device), and whether every offset is a
    multiple of 16 elements; remembered per list of layer tensors."""
    known = _layer_tables.get(kv_caches, "offsets")
    if known is not None:
        return known  # type: ignore[return-value]
    addresses = [layer.data_ptr() for layer in kv_caches]
    element_size = kv_caches[0].element_size()
    if any((address - addresses[0]) % element_size for address in addresses):
        raise ValueError("layer base addresses are not a whole number of elements apart")
    offsets = [(address - addresses[0]) // element_size for address in addresses]
    table = torch.tensor(offsets, dtype=torch.int64, device=kv_caches[0].device)
    aligned = all(offset % _ALIGN_ELEMENTS == 0 for offset in offsets)
    _layer_tables.put(kv_caches, "offsets", (table, aligned))
    return table, aligned


@dataclass(frozen=True)
class Tile:
    """Launch shape: TOKENS x COLUMNS elements per step, BLOCKS_PER_PROGRAM steps per program."""

    tokens: int
    columns: int
    num_warps: int = 4
    blocks_per_program: int = 1
    layer_fastest: bool = False
    streaming: bool = False


def default_tile(width: int, *, to_chunk: bool = True) -> Tile:
    """Two 1024-column rows a program (COLUMNS = the row rounded up to a power of two, at most 1024),
    in plain token order: the best of the shapes measured on the H200 for both directions and for
    MLA's 576-wide rows too (benchmarks/results/gpu_transfer.md). `to_chunk` is kept so that the two
    directions can be tuned apart."""
    del to_chunk  # the same shape won both directions
    columns = min(triton.next_power_of_2(width), 1024)
    return Tile(tokens=max(1, 2048 // columns), columns=columns)


def paged_copy(
    kv_caches: Sequence[Tensor],
    geometry: PagedGeometry,
    slot_mapping: Tensor,
    chunk: Tensor,
    *,
    to_chunk: bool,
    layers: tuple[int, int] | None = None,
    tile: Tile | None = None,
    fill_skipped: bool = False,
):
    """Gather (to_chunk) or scatter layers [start, stop) in one launch; chunk is the full-layer chunk.

    Returns Triton's compiled kernel (the benchmark reads its PTX), or None when there was nothing to move.
    """
    start, stop = layers if layers is not None else (0, geometry.num_layers)
    num_tokens = slot_mapping.numel()
    if num_tokens == 0 or stop <= start:
        return None
    if not chunk.is_contiguous():
        raise ValueError("the chunk must be contiguous")
    offsets, layers_aligned = _layer_table(kv_caches)
    if fill_skipped and not to_chunk:
        raise ValueError("fill_skipped applies to gathers only: a scatter must never touch other slots")
    tile = tile or default_tile(geometry.width, to_chunk=to_chunk)
    strides = (
        geometry.plane_stride,
        geometry.block_stride,
        geometry.position_stride,
        geometry.width,
        chunk.stride(0),
        chunk.stride(1),
    )
    aligned = layers_aligned and all(value % _ALIGN_ELEMENTS == 0 for value in strides)
    token_groups = triton.cdiv(num_tokens, tile.tokens * tile.blocks_per_program)
    layer_planes = (stop - start) * geometry.num_planes
    layer_fastest = tile.layer_fastest and token_groups < 65536  # grid axis 1 is limited to 65535
    grid = (
        layer_planes if layer_fastest else token_groups,
        token_groups if layer_fastest else layer_planes,
        triton.cdiv(geometry.width, tile.columns),
    )
    with torch.cuda.device(geometry.device):  # Triton launches on the current device
        return _paged_copy_kernel[grid](
            kv_caches[0],
            offsets,
            chunk,
            slot_mapping,
            num_tokens,
            geometry.width,
            start,
            geometry.num_planes,
            geometry.block_size,
            geometry.plane_stride,
            geometry.block_stride,
            geometry.position_stride,
            chunk.stride(0),
            chunk.stride(1),
            TO_CHUNK=to_chunk,
            ALIGNED=aligned,
            EVEN_COLUMNS=geometry.width % tile.columns == 0,
            TOKENS=tile.tokens,
            COLUMNS=tile.columns,
            BLOCKS_PER_PROGRAM=tile.blocks_per_program,
            LAYER_FASTEST=layer_fastest,
            STREAMING=tile.streaming,
            FILL_SKIPPED=fill_skipped,
            num_warps=tile.num_warps,
        )

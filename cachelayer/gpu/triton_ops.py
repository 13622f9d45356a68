"""The Triton kernel that moves tokens between every layer of a paged cache and a chunk in one launch.

Layers are reached through a table of their base addresses, stored as element offsets from layer
0's tensor (so the kernel keeps one typed pointer and the compiler can prove 16-byte alignment);
each program copies a tile of TOKENS tokens x COLUMNS elements of one (layer, plane).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from cachelayer.gpu.layouts import PagedGeometry

# Divisibility (in elements) that lets every row start on a 16-byte boundary for 2-byte dtypes.
_ALIGN_ELEMENTS = 16
_layer_table_cache: dict[tuple[int, ...], Tensor] = {}


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
):
    token_block = tl.program_id(0)
    layer_plane = tl.program_id(1)
    column_block = tl.program_id(2)
    layer = layer_start + layer_plane // num_planes
    plane = layer_plane % num_planes

    tokens = token_block * TOKENS + tl.arange(0, TOKENS)
    in_range = tokens < num_tokens
    # Slots fit in 32 bits (a cache has fewer than 2**31 slots); 64-bit division would cost ~4x more.
    slots = tl.load(slot_mapping_ptr + tokens, mask=in_range, other=-1).to(tl.int32)
    valid = slots >= 0
    slots = tl.where(valid, slots, 0)
    blocks = slots // block_size
    positions = slots - blocks * block_size

    layer_offset = tl.load(layer_offsets_ptr + layer)
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
    columns = column_block * COLUMNS + tl.arange(0, COLUMNS)
    columns = tl.max_contiguous(tl.multiple_of(columns, COLUMNS), COLUMNS)
    if EVEN_COLUMNS:  # noqa: SIM108 - a statement-level constexpr branch is resolved at compile time
        mask = valid[:, None]
    else:
        mask = valid[:, None] & (columns < width)[None, :]
    cache_addresses = cache_ptr + cache_rows[:, None] + columns[None, :]
    chunk_addresses = chunk_ptr + chunk_rows[:, None] + columns[None, :]
    if TO_CHUNK:
        tl.store(chunk_addresses, tl.load(cache_addresses, mask=mask), mask=mask)
    else:
        tl.store(cache_addresses, tl.load(chunk_addresses, mask=mask), mask=mask)


def _layer_offsets(kv_caches: Sequence[Tensor]) -> Tensor:
    """Element offsets of each layer from layer 0, on the device; cached per set of base addresses."""
    addresses = tuple(layer.data_ptr() for layer in kv_caches)
    table = _layer_table_cache.get(addresses)
    if table is None:
        element_size = kv_caches[0].element_size()
        offsets = [(address - addresses[0]) // element_size for address in addresses]
        if any((address - addresses[0]) % element_size for address in addresses):
            raise ValueError("layer base addresses are not a whole number of elements apart")
        table = torch.tensor(offsets, dtype=torch.int64, device=kv_caches[0].device)
        if len(_layer_table_cache) > 64:
            _layer_table_cache.clear()
        _layer_table_cache[addresses] = table
    return table


def default_tile(width: int) -> tuple[int, int, int]:
    """(TOKENS, COLUMNS, num_warps): about 4K elements per program; COLUMNS divides the row when a
    power of two of at least 64 does (MLA's 576 = 9 x 64), so no lane idles behind a column mask."""
    columns = min(width & -width, 1024)
    if columns < 64:
        columns = min(triton.next_power_of_2(width), 1024)
    tokens = max(1, 4096 // columns)
    return tokens, columns, 4


def paged_copy(
    kv_caches: Sequence[Tensor],
    geometry: PagedGeometry,
    slot_mapping: Tensor,
    chunk: Tensor,
    *,
    to_chunk: bool,
    layers: tuple[int, int] | None = None,
    tile: tuple[int, int, int] | None = None,
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
    offsets = _layer_offsets(kv_caches)
    tokens, columns, num_warps = tile or default_tile(geometry.width)
    strides = (
        geometry.plane_stride,
        geometry.block_stride,
        geometry.position_stride,
        geometry.width,
        chunk.stride(0),
        chunk.stride(1),
    )
    aligned = all(value % _ALIGN_ELEMENTS == 0 for value in strides) and all(
        (layer.data_ptr() - kv_caches[0].data_ptr()) % (_ALIGN_ELEMENTS * layer.element_size()) == 0
        for layer in kv_caches
    )
    grid = (
        triton.cdiv(num_tokens, tokens),
        (stop - start) * geometry.num_planes,
        triton.cdiv(geometry.width, columns),
    )
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
        EVEN_COLUMNS=geometry.width % columns == 0,
        TOKENS=tokens,
        COLUMNS=columns,
        num_warps=num_warps,
    )

"""Plain-torch movers between paged KV layouts and contiguous chunks: the CPU path and the test oracle.

They run on any device (CUDA tensors too, which makes them the baseline the kernels are measured
against), one indexed copy per layer and plane.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from cachelayer.gpu.layouts import PagedGeometry, block_major_view, plane_view


def _valid_tokens(slot_mapping: Tensor) -> tuple[Tensor, Tensor]:
    """Positions in the chunk whose slot is not negative, and those slots."""
    positions = (slot_mapping >= 0).nonzero().squeeze(1)
    return positions, slot_mapping.index_select(0, positions).long()


def gather(
    kv_caches: Sequence[Tensor],
    geometry: PagedGeometry,
    slot_mapping: Tensor,
    out: Tensor,
    *,
    fill_skipped: bool = False,
) -> None:
    if fill_skipped:
        out[:, :, slot_mapping < 0] = 0
    positions, slots = _valid_tokens(slot_mapping)
    blocks, offsets = slots // geometry.block_size, slots % geometry.block_size
    for layer_index, layer in enumerate(kv_caches):
        for plane in range(geometry.num_planes):
            rows = plane_view(layer, geometry.layout, plane)[blocks, offsets]
            out[layer_index, plane].index_copy_(0, positions, rows.reshape(len(positions), geometry.width))


def scatter(
    chunk: Tensor, kv_caches: Sequence[Tensor], geometry: PagedGeometry, slot_mapping: Tensor
) -> None:
    positions, slots = _valid_tokens(slot_mapping)
    blocks, offsets = slots // geometry.block_size, slots % geometry.block_size
    for layer_index, layer in enumerate(kv_caches):
        for plane in range(geometry.num_planes):
            target = plane_view(layer, geometry.layout, plane)
            rows = chunk[layer_index, plane].index_select(0, positions)
            target.index_put_((blocks, offsets), rows.reshape(len(positions), *target.shape[2:]))


def gather_blocks(kv_caches: Sequence[Tensor], layout: str, block_ids: Tensor, out: Tensor) -> None:
    positions, ids = _valid_tokens(block_ids)
    for layer_index, layer in enumerate(kv_caches):
        out[layer_index].index_copy_(0, positions, block_major_view(layer, layout).index_select(0, ids))


def scatter_blocks(chunk: Tensor, kv_caches: Sequence[Tensor], layout: str, block_ids: Tensor) -> None:
    positions, ids = _valid_tokens(block_ids)
    for layer_index, layer in enumerate(kv_caches):
        block_major_view(layer, layout).index_copy_(0, ids, chunk[layer_index].index_select(0, positions))

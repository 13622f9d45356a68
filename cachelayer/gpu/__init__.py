"""Move KV between an engine's paged cache and contiguous chunks: the one interface of cachelayer.gpu.

Layouts, per layer tensor (`LAYOUTS`):
- flash_attn: [2, num_blocks, block_size, num_kv_heads, head_dim]
- flashinfer: [num_blocks, 2, block_size, num_kv_heads, head_dim]
- mla:        [num_blocks, block_size, head_dim]
- cpu_blocks: vLLM's CPU backend, [num_blocks, num_kv_heads, block_size, 2 * head_dim], K stored
  transposed inside a block: only whole blocks move (gather_blocks/scatter_blocks).

A chunk is [num_layers, 2, num_tokens, num_kv_heads * head_dim] (mla: [num_layers, 1, num_tokens,
head_dim]); token t of the chunk lives in slot `slot_mapping[t]` of the cache, and a negative slot
skips that token (its chunk row is left untouched). CUDA tensors go through the Triton kernels
(all layers in one launch); anything else through the plain-torch movers, which are also the oracle.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from cachelayer.gpu import torch_ops
from cachelayer.gpu.layouts import (
    LAYOUTS,
    SLOT_LAYOUTS,
    PagedGeometry,
    block_major_view,
    check_chunk,
    check_layout,
    check_slot_mapping,
    paged_geometry,
)
from cachelayer.gpu.transfer import (
    LayerwiseLoader,
    LayerwiseStorer,
    TransferHandle,
    layer_groups,
    retrieve,
    store,
)

__all__ = [
    "LAYOUTS",
    "SLOT_LAYOUTS",
    "LayerwiseLoader",
    "LayerwiseStorer",
    "TransferHandle",
    "block_chunk_shape",
    "chunk_shape",
    "gather",
    "gather_blocks",
    "layer_groups",
    "retrieve",
    "scatter",
    "scatter_blocks",
    "store",
]


def chunk_shape(kv_caches: Sequence[Tensor], layout: str, num_tokens: int) -> tuple[int, int, int, int]:
    """The shape of the chunk that holds `num_tokens` tokens of these layers."""
    return paged_geometry(kv_caches, layout).chunk_shape(num_tokens)


def gather(
    kv_caches: Sequence[Tensor], layout: str, slot_mapping: Tensor, out: Tensor, *, check_range: bool = True
) -> None:
    """Copy the tokens at `slot_mapping` of every layer into `out` (a chunk on the cache's device).

    `check_range` reads the largest slot back to the host (a stream sync on CUDA) to refuse slots past
    the cache with a clear error; pass False on a hot path whose slots come from the engine itself.
    """
    geometry = _checked_device_copy(kv_caches, layout, slot_mapping, out, "out", check_range)
    if geometry.device.type == "cuda":
        from cachelayer.gpu import triton_ops

        triton_ops.paged_copy(kv_caches, geometry, slot_mapping, out, to_chunk=True)
    else:
        torch_ops.gather(kv_caches, geometry, slot_mapping, out)


def scatter(
    chunk: Tensor, kv_caches: Sequence[Tensor], layout: str, slot_mapping: Tensor, *, check_range: bool = True
) -> None:
    """Copy a chunk into the slots at `slot_mapping` of every layer; negative slots are skipped."""
    geometry = _checked_device_copy(kv_caches, layout, slot_mapping, chunk, "chunk", check_range)
    if geometry.device.type == "cuda":
        from cachelayer.gpu import triton_ops

        triton_ops.paged_copy(kv_caches, geometry, slot_mapping, chunk, to_chunk=False)
    else:
        torch_ops.scatter(chunk, kv_caches, geometry, slot_mapping)


def block_chunk_shape(kv_caches: Sequence[Tensor], layout: str, num_blocks: int) -> tuple[int, ...]:
    """The shape of the chunk that holds `num_blocks` whole blocks: [num_layers, num_blocks, *block]."""
    return (len(kv_caches), num_blocks, *block_major_view(kv_caches[0], layout).shape[1:])


def gather_blocks(kv_caches: Sequence[Tensor], layout: str, block_ids: Tensor, out: Tensor) -> None:
    """Copy whole blocks (any layout) into `out` of `block_chunk_shape`; negative ids are skipped."""
    _check_blocks(kv_caches, layout, block_ids, out, "out")
    torch_ops.gather_blocks(kv_caches, layout, block_ids, out)


def scatter_blocks(chunk: Tensor, kv_caches: Sequence[Tensor], layout: str, block_ids: Tensor) -> None:
    """Copy whole blocks from a chunk of `block_chunk_shape` into the cache; negative ids are skipped."""
    _check_blocks(kv_caches, layout, block_ids, chunk, "chunk")
    torch_ops.scatter_blocks(chunk, kv_caches, layout, block_ids)


def _checked_device_copy(
    kv_caches: Sequence[Tensor],
    layout: str,
    slot_mapping: Tensor,
    chunk: Tensor,
    name: str,
    check_range: bool,
) -> PagedGeometry:
    """The layers' geometry, once `slot_mapping` and `chunk` (called `name`) are checked against it
    for a gather or scatter: the chunk's shape and dtype, and its device (the cache's)."""
    geometry = paged_geometry(kv_caches, layout)
    check_slot_mapping(slot_mapping, geometry, check_range=check_range)
    check_chunk(chunk, geometry, slot_mapping.numel(), name)
    _check_same_device(chunk, geometry.device, name)
    return geometry


def _check_same_device(tensor: Tensor, device, name: str) -> None:
    if tensor.device != device:
        raise ValueError(
            f"{name} is on {tensor.device} but the KV cache is on {device}: gather/scatter stay on one "
            "device; use store/retrieve to move KV between the GPU and pinned host memory"
        )


def _check_blocks(
    kv_caches: Sequence[Tensor], layout: str, block_ids: Tensor, chunk: Tensor, name: str
) -> None:
    check_layout(layout)
    if len(kv_caches) == 0:
        raise ValueError("kv_caches is empty: pass one tensor per layer")
    if block_ids.dim() != 1 or block_ids.dtype.is_floating_point:
        raise ValueError(
            f"block_ids must be a 1-D integer tensor, got {block_ids.dtype} {tuple(block_ids.shape)}"
        )
    first = kv_caches[0]
    for index, layer in enumerate(kv_caches):
        if layer.shape != first.shape or layer.dtype != first.dtype or layer.device != first.device:
            raise ValueError(f"kv_caches[{index}] differs from kv_caches[0] in shape, dtype or device")
    expected = block_chunk_shape(kv_caches, layout, block_ids.numel())
    if tuple(chunk.shape) != expected or chunk.dtype != first.dtype:
        raise ValueError(
            f"{name} is {chunk.dtype} {tuple(chunk.shape)}, expected {first.dtype} {expected} "
            "[num_layers, num_blocks, *block]"
        )
    num_blocks = block_major_view(first, layout).shape[0]
    if block_ids.numel() and int(block_ids.max()) >= num_blocks:
        raise ValueError(
            f"block_ids holds block {int(block_ids.max())}, but the cache has {num_blocks} blocks"
        )
    if block_ids.device != first.device:
        raise ValueError(f"block_ids is on {block_ids.device} but the KV cache is on {first.device}")
    _check_same_device(chunk, first.device, name)

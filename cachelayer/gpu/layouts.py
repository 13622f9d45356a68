"""The paged KV layouts of the engines: their names, validation, and the geometry the movers need.

Every mover (torch fallback or CUDA kernel) addresses a layer's cache through the same
`PagedGeometry`, so a layout is described in one place. A slot is `block * block_size + offset`,
as in vLLM's slot_mapping.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

LAYOUTS = ("flash_attn", "flashinfer", "mla", "cpu_blocks")
# Layouts addressed token by token through slot_mapping; cpu_blocks moves whole blocks only.
SLOT_LAYOUTS = ("flash_attn", "flashinfer", "mla")

# Where the (K, V) plane axis stands in the layouts that keep K and V in separate planes.
_PLANE_AXIS = {"flash_attn": 0, "flashinfer": 1}
_LAYOUT_SHAPES = {
    "flash_attn": "[2, num_blocks, block_size, num_kv_heads, head_dim]",
    "flashinfer": "[num_blocks, 2, block_size, num_kv_heads, head_dim]",
    "mla": "[num_blocks, block_size, head_dim]",
    "cpu_blocks": "[num_blocks, num_kv_heads, block_size, 2 * head_dim]",
}


@dataclass(frozen=True)
class PagedGeometry:
    """How one layer's tensor of a slot layout maps (plane, slot) to a row of `width` elements.

    Element (plane p, slot s, column c) lives at
    `p * plane_stride + (s // block_size) * block_stride + (s % block_size) * position_stride + c`,
    in elements from the layer's first element. All layers share one geometry.
    """

    layout: str
    num_layers: int
    num_planes: int  # 2 (K and V) or 1 (MLA's joint latent)
    num_blocks: int
    block_size: int
    width: int  # num_kv_heads * head_dim (MLA: head_dim)
    plane_stride: int
    block_stride: int
    position_stride: int
    dtype: torch.dtype
    device: torch.device

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    def chunk_shape(self, num_tokens: int) -> tuple[int, int, int, int]:
        """Shape of the contiguous chunk that holds `num_tokens` tokens of every layer."""
        return (self.num_layers, self.num_planes, num_tokens, self.width)


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown KV layout {layout!r}: expected one of {', '.join(LAYOUTS)}")


def plane_view(layer: Tensor, layout: str, plane: int) -> Tensor:
    """The [num_blocks, block_size, width...] view of one plane (K=0, V=1) of a layer's tensor."""
    if layout == "flash_attn":
        return layer[plane]
    if layout == "flashinfer":
        return layer[:, plane]
    if layout == "mla":
        return layer
    raise ValueError(f"layout {layout!r} has no per-token planes: move whole blocks with gather_blocks")


def block_major_view(layer: Tensor, layout: str) -> Tensor:
    """A view of a layer's tensor with the block index first, for moving whole blocks."""
    check_layout(layout)
    return layer.transpose(0, 1) if layout == "flash_attn" else layer


class LayerSetMemo:
    """Values computed once per list of layer tensors, found again by identity (weak references).

    An engine passes the same KV tensors on every call; walking 32+ layers to validate them costs
    more host time than moving a small chunk takes on the GPU. Assumes what vLLM does: a layer
    tensor is never resized or re-pointed in place (its first and last data pointers are rechecked).
    """

    def __init__(self, limit: int = 32):
        self._entries: dict[tuple, tuple[tuple[weakref.ref, ...], tuple[int, int], object]] = {}
        self._limit = limit

    def get(self, kv_caches: Sequence[Tensor], tag: str) -> object | None:
        entry = self._entries.get((tag, tuple(map(id, kv_caches))))
        if entry is None:
            return None
        references, pointers, value = entry
        if pointers != (kv_caches[0].data_ptr(), kv_caches[-1].data_ptr()):
            return None
        if not all(reference() is layer for reference, layer in zip(references, kv_caches, strict=True)):
            return None
        return value

    def put(self, kv_caches: Sequence[Tensor], tag: str, value: object) -> None:
        if len(self._entries) >= self._limit:
            self._entries.clear()
        references = tuple(weakref.ref(layer) for layer in kv_caches)
        pointers = (kv_caches[0].data_ptr(), kv_caches[-1].data_ptr())
        self._entries[(tag, tuple(map(id, kv_caches)))] = (references, pointers, value)


_geometries = LayerSetMemo()


def paged_geometry(kv_caches: Sequence[Tensor], layout: str) -> PagedGeometry:
    """Validate the layers of a slot layout and describe them; raise ValueError saying what is wrong.

    The answer is remembered per list of layer tensors (LayerSetMemo), so repeated calls are cheap.
    """
    if len(kv_caches) > 0:
        known = _geometries.get(kv_caches, layout)
        if known is not None:
            return known  # type: ignore[return-value]
    geometry = _describe(kv_caches, layout)
    _geometries.put(kv_caches, layout, geometry)
    return geometry


def _describe(kv_caches: Sequence[Tensor], layout: str) -> PagedGeometry:
    check_layout(layout)
    if layout not in SLOT_LAYOUTS:
        raise ValueError(
            f"layout {layout!r} stores K transposed inside a block, so tokens cannot be moved one by "
            "one: use gather_blocks/scatter_blocks with block ids"
        )
    if len(kv_caches) == 0:
        raise ValueError("kv_caches is empty: pass one tensor per layer")
    first = kv_caches[0]
    expected_dims = 3 if layout == "mla" else 5
    for index, layer in enumerate(kv_caches):
        if layer.dim() != expected_dims:
            raise ValueError(
                f"kv_caches[{index}] has shape {tuple(layer.shape)}, but layout {layout!r} is "
                f"{_LAYOUT_SHAPES[layout]} per layer"
            )
        if layer.shape != first.shape or layer.stride() != first.stride():
            raise ValueError(
                f"kv_caches[{index}] has shape {tuple(layer.shape)} and strides {layer.stride()}, but "
                f"kv_caches[0] has {tuple(first.shape)} and {first.stride()}: all layers must match"
            )
        if layer.dtype != first.dtype or layer.device != first.device:
            raise ValueError(
                f"kv_caches[{index}] is {layer.dtype} on {layer.device}, but kv_caches[0] is "
                f"{first.dtype} on {first.device}: all layers must match"
            )
    if layout in _PLANE_AXIS:
        # The two layouts differ only in where the (K, V) plane axis stands: take it out, and the
        # rest is [num_blocks, block_size, heads, head_dim] in both.
        plane_axis = _PLANE_AXIS[layout]
        shape, strides = list(first.shape), list(first.stride())
        if shape.pop(plane_axis) != 2:
            raise ValueError(
                f"{layout} layers must have 2 planes (K, V) {('first', 'second')[plane_axis]}, "
                f"got shape {tuple(first.shape)}"
            )
        plane_stride = strides.pop(plane_axis)
        num_blocks, block_size, heads, head_dim = shape
        block_stride, position_stride, head_stride, dim_stride = strides
        num_planes = 2
    else:
        num_blocks, block_size, head_dim = first.shape
        block_stride, position_stride, dim_stride = first.stride()
        heads, head_stride, plane_stride, num_planes = 1, head_dim, 0, 1
    if dim_stride != 1 or (heads > 1 and head_stride != head_dim):
        raise ValueError(
            f"each token's [num_kv_heads, head_dim] must be contiguous in layout {layout!r}; "
            f"got strides {first.stride()}"
        )
    return PagedGeometry(
        layout=layout,
        num_layers=len(kv_caches),
        num_planes=num_planes,
        num_blocks=num_blocks,
        block_size=block_size,
        width=heads * head_dim,
        plane_stride=plane_stride,
        block_stride=block_stride,
        position_stride=position_stride,
        dtype=first.dtype,
        device=first.device,
    )


def check_slot_mapping(slot_mapping: Tensor, geometry: PagedGeometry, *, check_range: bool = True) -> None:
    """Check dtype, device and (when `check_range`) that no slot lies past the cache.

    The range check reads the largest slot back to the host, which synchronizes a CUDA stream; the
    hot path of a connector that built its slot mapping from the engine's own block table may skip it.
    """
    if slot_mapping.dim() != 1 or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"slot_mapping must be a 1-D int32/int64 tensor, got {slot_mapping.dtype} "
            f"of shape {tuple(slot_mapping.shape)}"
        )
    if slot_mapping.device != geometry.device:
        raise ValueError(
            f"slot_mapping is on {slot_mapping.device} but the KV cache is on {geometry.device}: "
            "move it to the cache's device"
        )
    if check_range and slot_mapping.numel():
        largest = int(slot_mapping.max())
        if largest >= geometry.num_slots:
            raise ValueError(
                f"slot_mapping holds slot {largest}, but the cache has only {geometry.num_slots} slots "
                f"({geometry.num_blocks} blocks of {geometry.block_size})"
            )


def check_chunk(chunk: Tensor, geometry: PagedGeometry, num_tokens: int, name: str) -> None:
    expected = geometry.chunk_shape(num_tokens)
    if tuple(chunk.shape) != expected:
        raise ValueError(
            f"{name} has shape {tuple(chunk.shape)}, expected {expected} "
            "[num_layers, planes, num_tokens, width] for this cache and slot_mapping"
        )
    if chunk.dtype != geometry.dtype:
        raise ValueError(f"{name} is {chunk.dtype} but the KV cache is {geometry.dtype}")

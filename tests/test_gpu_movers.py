"""The torch movers of cachelayer.gpu (the CPU path and the kernels' oracle) against a per-token reference."""

from __future__ import annotations

import pytest
import torch

from cachelayer import gpu

NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM = 3, 12, 4, 2, 8


def make_cache(layout: str, dtype=torch.bfloat16, generator=None) -> list[torch.Tensor]:
    shape = {
        "flash_attn": (2, NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM),
        "flashinfer": (NUM_BLOCKS, 2, BLOCK_SIZE, HEADS, HEAD_DIM),
        "mla": (NUM_BLOCKS, BLOCK_SIZE, HEAD_DIM),
        "cpu_blocks": (NUM_BLOCKS, HEADS, BLOCK_SIZE, 2 * HEAD_DIM),
    }[layout]
    return [torch.randn(shape, generator=generator).to(dtype) for _ in range(NUM_LAYERS)]


def token_row(layer: torch.Tensor, layout: str, plane: int, slot: int) -> torch.Tensor:
    """The reference: one token's row, indexed the way the layout is documented."""
    block, offset = divmod(slot, BLOCK_SIZE)
    if layout == "flash_attn":
        return layer[plane, block, offset].reshape(-1)
    if layout == "flashinfer":
        return layer[block, plane, offset].reshape(-1)
    return layer[block, offset].reshape(-1)


def mixed_slot_mapping(generator: torch.Generator) -> torch.Tensor:
    """A partial first block, a full block, scattered blocks out of order, a partial tail, skipped tokens."""
    blocks = torch.randperm(NUM_BLOCKS, generator=generator)[:5].tolist()
    slots = [blocks[0] * BLOCK_SIZE + offset for offset in (2, 3)]
    slots += [blocks[1] * BLOCK_SIZE + offset for offset in range(BLOCK_SIZE)]
    slots += [-1, -1]
    slots += [blocks[2] * BLOCK_SIZE + offset for offset in range(BLOCK_SIZE)]
    slots += [blocks[3] * BLOCK_SIZE + 1, -7]
    slots += [blocks[4] * BLOCK_SIZE + offset for offset in range(3)]
    return torch.tensor(slots, dtype=torch.int64)


POISON = -12345.0


@pytest.mark.parametrize("layout", gpu.SLOT_LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gather_copies_every_valid_token_and_leaves_skipped_rows_untouched(layout, dtype):
    generator = torch.Generator().manual_seed(hash((layout, str(dtype))) % 2**31)
    caches = make_cache(layout, dtype, generator)
    slots = mixed_slot_mapping(generator)
    out = torch.full(gpu.chunk_shape(caches, layout, len(slots)), POISON, dtype=dtype)
    gpu.gather(caches, layout, slots, out)
    planes = 1 if layout == "mla" else 2
    for layer_index, layer in enumerate(caches):
        for plane in range(planes):
            for position, slot in enumerate(slots.tolist()):
                row = out[layer_index, plane, position]
                if slot < 0:
                    assert torch.all(row == POISON)
                else:
                    assert torch.equal(row, token_row(layer, layout, plane, slot))


@pytest.mark.parametrize("layout", gpu.SLOT_LAYOUTS)
def test_scatter_writes_only_the_mapped_slots(layout):
    generator = torch.Generator().manual_seed(7)
    caches = make_cache(layout, generator=generator)
    before = [layer.clone() for layer in caches]
    slots = mixed_slot_mapping(generator)
    chunk = torch.randn(gpu.chunk_shape(caches, layout, len(slots)), generator=generator).bfloat16()
    gpu.scatter(chunk, caches, layout, slots)
    planes = 1 if layout == "mla" else 2
    expected = [layer.clone() for layer in before]
    for layer_index in range(NUM_LAYERS):
        for plane in range(planes):
            for position, slot in enumerate(slots.tolist()):
                if slot >= 0:
                    token_row(expected[layer_index], layout, plane, slot).copy_(
                        chunk[layer_index, plane, position]
                    )
    for layer_index in range(NUM_LAYERS):
        assert torch.equal(caches[layer_index], expected[layer_index])


@pytest.mark.parametrize("layout", gpu.SLOT_LAYOUTS)
def test_scatter_then_gather_round_trips(layout):
    generator = torch.Generator().manual_seed(11)
    caches = make_cache(layout, generator=generator)
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=generator)[:29]
    chunk = torch.randn(gpu.chunk_shape(caches, layout, 29), generator=generator).bfloat16()
    gpu.scatter(chunk, caches, layout, slots)
    back = torch.full_like(chunk, POISON)
    gpu.gather(caches, layout, slots, back)
    assert torch.equal(back, chunk)


@pytest.mark.parametrize("layout", gpu.LAYOUTS)
def test_whole_blocks_round_trip_and_negative_ids_are_skipped(layout):
    generator = torch.Generator().manual_seed(3)
    caches = make_cache(layout, generator=generator)
    block_ids = torch.tensor([5, -1, 0, 9])
    out = torch.full(gpu.block_chunk_shape(caches, layout, 4), POISON, dtype=torch.bfloat16)
    gpu.gather_blocks(caches, layout, block_ids, out)
    for layer_index, layer in enumerate(caches):
        major = layer.transpose(0, 1) if layout == "flash_attn" else layer
        assert torch.equal(out[layer_index, 0], major[5])
        assert torch.all(out[layer_index, 1] == POISON)
        assert torch.equal(out[layer_index, 3], major[9])
    fresh = make_cache(layout, generator=generator)
    untouched = [layer.clone() for layer in fresh]
    gpu.scatter_blocks(out, fresh, layout, block_ids)
    for layer_index, layer in enumerate(fresh):
        major = layer.transpose(0, 1) if layout == "flash_attn" else layer
        original = (
            untouched[layer_index].transpose(0, 1) if layout == "flash_attn" else untouched[layer_index]
        )
        assert torch.equal(major[5], out[layer_index, 0])
        assert torch.equal(major[9], out[layer_index, 3])
        for block in (1, 2, 3, 4, 6, 7, 8, 10, 11):
            assert torch.equal(major[block], original[block])


def test_store_and_retrieve_on_cpu_move_the_chunk_through_host_memory():
    generator = torch.Generator().manual_seed(5)
    caches = make_cache("flash_attn", generator=generator)
    slots = mixed_slot_mapping(generator)
    host = torch.full(gpu.chunk_shape(caches, "flash_attn", len(slots)), POISON, dtype=torch.bfloat16)
    gpu.store(caches, "flash_attn", slots, host, pieces=2).wait()
    expected = torch.full_like(host, POISON)
    gpu.gather(caches, "flash_attn", slots, expected)
    expected[:, :, slots < 0] = 0  # a store zero-fills the rows of skipped tokens
    assert torch.equal(host, expected)
    fresh = make_cache("flash_attn", generator=generator)
    gpu.retrieve(host, fresh, "flash_attn", slots, pieces=3).wait()
    back = torch.full_like(host, POISON)
    gpu.gather(fresh, "flash_attn", slots, back)
    valid = slots >= 0
    assert torch.equal(back[:, :, valid], host[:, :, valid])
    assert torch.all(back[:, :, ~valid] == POISON)


def test_layer_groups_cover_every_layer_once():
    from cachelayer.gpu.transfer import layer_groups

    assert layer_groups(32, None) == [(0, 1), (1, 32)]
    assert layer_groups(32, None, growing=False) == [(0, 31), (31, 32)]
    assert layer_groups(32, "doubling") == [(0, 1), (1, 2), (2, 4), (4, 8), (8, 16), (16, 32)]
    assert layer_groups(5, 3) == [(0, 2), (2, 3), (3, 5)]
    assert layer_groups(1, None) == [(0, 1)]
    with pytest.raises(ValueError, match="pieces"):
        layer_groups(4, 0)


def test_layerwise_storer_and_loader_on_cpu_follow_the_layers():
    generator = torch.Generator().manual_seed(9)
    caches = make_cache("flashinfer", generator=generator)
    slots = mixed_slot_mapping(generator)
    host = torch.full(gpu.chunk_shape(caches, "flashinfer", len(slots)), POISON, dtype=torch.bfloat16)
    storer = gpu.LayerwiseStorer(caches, "flashinfer", slots, host)
    storer.after_layer(0)
    assert torch.all(host[1:] == POISON)
    for layer in range(1, NUM_LAYERS):
        storer.after_layer(layer)
    storer.finish().wait()
    fresh = make_cache("flashinfer", generator=generator)
    loader = gpu.LayerwiseLoader(host, fresh, "flashinfer", slots)
    loader.start()
    loader.wait_for_layer(1)
    check = torch.full_like(host, POISON)
    gpu.gather(fresh, "flashinfer", slots, check)
    valid = slots >= 0
    assert torch.all(host[:, :, ~valid] == 0)  # the store zero-filled the skipped tokens' rows
    assert torch.equal(check[1][:, valid], host[1][:, valid])
    assert not torch.equal(check[0][:, valid], host[0][:, valid])
    loader.finish().wait()
    gpu.gather(fresh, "flashinfer", slots, check)
    assert torch.equal(check[:, :, valid], host[:, :, valid])


def test_bad_input_gets_errors_that_say_what_to_fix():
    caches = make_cache("flash_attn")
    slots = torch.arange(8)
    out = torch.empty(gpu.chunk_shape(caches, "flash_attn", 8), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="unknown KV layout 'paged'"):
        gpu.gather(caches, "paged", slots, out)
    with pytest.raises(ValueError, match="gather_blocks"):
        gpu.gather(make_cache("cpu_blocks"), "cpu_blocks", slots, out)
    with pytest.raises(ValueError, match="slot 999"):
        gpu.gather(caches, "flash_attn", torch.tensor([1, 999]), out[:, :, :2])
    with pytest.raises(ValueError, match="expected"):
        gpu.gather(caches, "flash_attn", slots, out[:, :, :4])
    with pytest.raises(ValueError, match="kv_caches\\[1\\]"):
        gpu.gather([caches[0], caches[1][:, :6]], "flash_attn", slots, out[:2])
    with pytest.raises(ValueError, match="flashinfer"):
        gpu.gather(caches, "flashinfer", slots, out)
    with pytest.raises(ValueError, match="float32"):
        gpu.gather(caches, "flash_attn", slots.float(), out)


def test_validation_is_remembered_per_layer_list_but_redone_for_other_tensors():
    caches = make_cache("flash_attn")
    slots = torch.arange(6)
    out = torch.empty(gpu.chunk_shape(caches, "flash_attn", 6), dtype=torch.bfloat16)
    gpu.gather(caches, "flash_attn", slots, out)
    gpu.gather(caches, "flash_attn", slots, out)  # served from the memo
    swapped = list(caches)
    swapped[1] = caches[1][:, :6].clone()  # a different tensor in the same position
    with pytest.raises(ValueError, match="kv_caches\\[1\\]"):
        gpu.gather(swapped, "flash_attn", slots, out)

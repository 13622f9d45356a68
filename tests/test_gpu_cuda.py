"""The CUDA kernels of cachelayer.gpu against the torch movers, on fresh random data with poisoned outputs.

Runs only where CUDA is present (the lent H200); everywhere else the module is skipped.
"""

from __future__ import annotations

import pytest
import torch

from cachelayer import gpu
from cachelayer.gpu import torch_ops, transfer
from cachelayer.gpu.layouts import paged_geometry

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (runs on the GPU machine)")

POISON = -4242.0


def layer_shape(layout: str, num_blocks: int, block_size: int, heads: int, head_dim: int) -> tuple[int, ...]:
    return {
        "flash_attn": (2, num_blocks, block_size, heads, head_dim),
        "flashinfer": (num_blocks, 2, block_size, heads, head_dim),
        "mla": (num_blocks, block_size, head_dim),
    }[layout]


def make_caches(layout, num_layers, num_blocks, block_size, heads, head_dim, dtype, *, one_storage=False):
    shape = layer_shape(layout, num_blocks, block_size, heads, head_dim)
    if one_storage:
        # vLLM may carve every layer out of one allocation; an odd gap breaks 16-element alignment.
        size = torch.Size(shape).numel()
        storage = torch.randn(num_layers * (size + 3), device="cuda").to(dtype)
        return [storage[i * (size + 3) : i * (size + 3) + size].view(shape) for i in range(num_layers)]
    return [torch.randn(shape, device="cuda").to(dtype) for _ in range(num_layers)]


def mixed_slots(num_blocks: int, block_size: int, num_tokens: int) -> torch.Tensor:
    """Random blocks out of order, starting mid-block, with skipped (negative) tokens sprinkled in."""
    blocks = torch.randperm(num_blocks)[: num_tokens // block_size + 2]
    slots = (blocks[:, None] * block_size + torch.arange(block_size)).reshape(-1)
    slots = slots[block_size // 2 : block_size // 2 + num_tokens].clone()
    slots[torch.rand(num_tokens) < 0.1] = -1
    return slots.cuda()


CASES = [
    # layout, layers, blocks, block_size, heads, head_dim, dtype, tokens
    ("flash_attn", 4, 64, 16, 8, 128, torch.bfloat16, 300),
    ("flash_attn", 3, 40, 32, 2, 64, torch.float16, 257),
    ("flash_attn", 2, 30, 16, 1, 12, torch.float32, 100),
    ("flashinfer", 4, 64, 16, 8, 128, torch.bfloat16, 300),
    ("flashinfer", 2, 50, 8, 4, 80, torch.bfloat16, 129),
    ("mla", 3, 64, 64, 1, 576, torch.bfloat16, 500),
    ("mla", 2, 20, 16, 1, 512, torch.float32, 33),
]


@pytest.mark.parametrize("case", CASES, ids=lambda case: f"{case[0]}-{case[4]}x{case[5]}-{case[6]}")
@pytest.mark.parametrize("one_storage", [False, True])
def test_kernel_gather_and_scatter_match_the_torch_movers(case, one_storage):
    layout, layers, blocks, block_size, heads, head_dim, dtype, tokens = case
    caches = make_caches(layout, layers, blocks, block_size, heads, head_dim, dtype, one_storage=one_storage)
    slots = mixed_slots(blocks, block_size, tokens)
    geometry = paged_geometry(caches, layout)

    out = torch.full(gpu.chunk_shape(caches, layout, tokens), POISON, dtype=dtype, device="cuda")
    gpu.gather(caches, layout, slots, out)
    expected = torch.full_like(out, POISON)
    torch_ops.gather(caches, geometry, slots, expected)
    assert torch.equal(out, expected)
    assert torch.all(out[:, :, slots.cpu() < 0] == POISON)

    chunk = torch.randn(out.shape, device="cuda").to(dtype)
    reference = [layer.clone() for layer in caches]
    torch_ops.scatter(chunk, reference, geometry, slots)
    gpu.scatter(chunk, caches, layout, slots)
    for mine, theirs in zip(caches, reference, strict=True):
        assert torch.equal(mine, theirs)


def test_empty_slot_mapping_moves_nothing():
    caches = make_caches("flash_attn", 2, 8, 16, 2, 64, torch.bfloat16)
    out = torch.empty(gpu.chunk_shape(caches, "flash_attn", 0), dtype=torch.bfloat16, device="cuda")
    gpu.gather(caches, "flash_attn", torch.empty(0, dtype=torch.int64, device="cuda"), out)


@pytest.mark.parametrize("layout", ["flash_attn", "flashinfer", "mla"])
@pytest.mark.parametrize("pieces", [None, "doubling", 1, 3])
def test_store_and_retrieve_through_pinned_memory(layout, pieces):
    head_dim = 576 if layout == "mla" else 128
    caches = make_caches(layout, 8, 64, 16, 4, head_dim, torch.bfloat16)
    slots = mixed_slots(64, 16, 700)
    shape = gpu.chunk_shape(caches, layout, 700)
    host = torch.full(shape, POISON, dtype=torch.bfloat16).pin_memory()
    gpu.store(caches, layout, slots, host, pieces=pieces).wait()
    expected = torch.full(shape, POISON, dtype=torch.bfloat16, device="cuda")
    gpu.gather(caches, layout, slots, expected)
    expected[:, :, slots < 0] = 0  # a store zero-fills the rows of skipped tokens
    assert torch.equal(host, expected.cpu())

    fresh = make_caches(layout, 8, 64, 16, 4, head_dim, torch.bfloat16)
    reference = [layer.clone() for layer in fresh]
    torch_ops.scatter(host.cuda(), reference, paged_geometry(fresh, layout), slots)
    gpu.retrieve(host, fresh, layout, slots, pieces=pieces)
    torch.cuda.synchronize()
    for mine, theirs in zip(fresh, reference, strict=True):
        assert torch.equal(mine, theirs)


def test_layerwise_store_copies_each_layer_as_the_compute_stream_wrote_it():
    """A slow compute stream writes layer i, then after_layer(i), then overwrites it: the host must
    hold what was there at after_layer(i), which needs the copy stream to wait on the right event."""
    layers = 6
    caches = make_caches("flash_attn", layers, 64, 16, 8, 128, torch.bfloat16)
    slots = mixed_slots(64, 16, 600)
    host = torch.full(gpu.chunk_shape(caches, "flash_attn", 600), POISON, dtype=torch.bfloat16).pin_memory()
    written = [
        torch.randn(gpu.chunk_shape(caches[:1], "flash_attn", 600), device="cuda").bfloat16() for _ in caches
    ]
    storer = gpu.LayerwiseStorer(caches, "flash_attn", slots, host)
    for layer in range(layers):
        torch.cuda._sleep(2_000_000)  # a slow "layer": a copy that did not wait would read stale KV
        gpu.scatter(written[layer], caches[layer : layer + 1], "flash_attn", slots, check_range=False)
        storer.after_layer(layer)
        overwrite = torch.zeros_like(written[layer])
        gpu.scatter(overwrite, caches[layer : layer + 1], "flash_attn", slots, check_range=False)
    storer.finish().wait()
    valid = slots.cpu() >= 0
    for layer in range(layers):
        assert torch.equal(host[layer][:, valid], written[layer][0][:, valid].cpu())
        assert torch.all(host[layer][:, ~valid] == 0)


def test_layerwise_load_makes_the_compute_stream_wait_for_each_layer():
    layers = 5
    caches = make_caches("flashinfer", layers, 64, 16, 8, 128, torch.bfloat16)
    slots = mixed_slots(64, 16, 512)
    host = torch.randn(gpu.chunk_shape(caches, "flashinfer", 512)).bfloat16().pin_memory()
    device = caches[0].device
    # Keep the copy stream busy so that a scatter that did not wait would read an unfilled staging chunk.
    with torch.cuda.stream(transfer._side_stream(device, "h2d")):
        torch.cuda._sleep(20_000_000)
    loader = gpu.LayerwiseLoader(host, caches, "flashinfer", slots)
    loader.start()
    seen = []
    for layer in range(layers):
        loader.wait_for_layer(layer)
        out = torch.empty(gpu.chunk_shape(caches[:1], "flashinfer", 512), dtype=torch.bfloat16, device="cuda")
        gpu.gather(caches[layer : layer + 1], "flashinfer", slots, out, check_range=False)
        seen.append(out)
    loader.finish().wait()
    valid = slots.cpu() >= 0
    for layer in range(layers):
        assert torch.equal(seen[layer][0][:, valid].cpu(), host[layer][:, valid])


def test_store_and_retrieve_at_once_use_separate_streams_and_both_land():
    caches = make_caches("flash_attn", 8, 128, 16, 8, 128, torch.bfloat16)
    targets = make_caches("flash_attn", 8, 128, 16, 8, 128, torch.bfloat16)
    slots = mixed_slots(128, 16, 1500)
    shape = gpu.chunk_shape(caches, "flash_attn", 1500)
    stored = torch.full(shape, POISON, dtype=torch.bfloat16).pin_memory()
    incoming = torch.randn(shape).bfloat16().pin_memory()
    reference = [layer.clone() for layer in targets]
    torch_ops.scatter(incoming.cuda(), reference, paged_geometry(targets, "flash_attn"), slots)
    expected = torch.zeros(shape, dtype=torch.bfloat16, device="cuda")
    gpu.gather(caches, "flash_attn", slots, expected)
    store_done = gpu.store(caches, "flash_attn", slots, stored)
    retrieve_done = gpu.retrieve(incoming, targets, "flash_attn", slots)
    store_done.wait()
    retrieve_done.wait()
    assert torch.equal(stored, expected.cpu())
    for mine, theirs in zip(targets, reference, strict=True):
        assert torch.equal(mine, theirs)


def test_unpinned_host_memory_is_refused_with_a_fix():
    caches = make_caches("flash_attn", 2, 8, 16, 2, 64, torch.bfloat16)
    slots = torch.arange(10, device="cuda")
    host = torch.empty(gpu.chunk_shape(caches, "flash_attn", 10), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="pin_memory"):
        gpu.store(caches, "flash_attn", slots, host)

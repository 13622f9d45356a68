"""Helpers for the cache-layer tests: a small KV geometry, engines sized in chunks, random requests,
a leak check, and a chunk filed in the CPU tier without the checks an import makes."""

from __future__ import annotations

from array import array

import torch

from cachelayer import CacheEngine
from cachelayer.storage.tier import ChunkMeta

LAYERS, HEADS, HEAD_DIM, CHUNK = 2, 2, 8, 16
CHUNK_BYTES = LAYERS * 2 * CHUNK * HEADS * HEAD_DIM * 2  # bf16


def make_engine(chunks_in_pool: float, **config) -> CacheEngine:
    """An engine whose CPU pool holds `chunks_in_pool` full chunks."""
    pool_gb = chunks_in_pool * CHUNK_BYTES / 2**30
    return CacheEngine.from_config(
        {"chunk_size": CHUNK, "max_local_cpu_size": pool_gb, **config},
        num_layers=LAYERS,
        num_kv_heads=HEADS,
        head_dim=HEAD_DIM,
        dtype=torch.bfloat16,
    )


def request(seed: int, chunks: int) -> tuple[list[int], torch.Tensor]:
    """Random tokens and matching random KV, `chunks` full chunks long."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 50_000, (chunks * CHUNK,), generator=generator).tolist()
    kv = torch.randn(LAYERS, 2, chunks * CHUNK, HEADS * HEAD_DIM, generator=generator).to(torch.bfloat16)
    return tokens, kv


def assert_no_leak(engine: CacheEngine) -> None:
    """No reference left behind, and exactly one pool allocation per chunk held.

    Waits for the disk writer first: until it is idle it legitimately holds a reference on the
    CPU chunk it is copying (and keeps an evicted chunk's space until that copy ends)."""
    engine.flush()
    entries = engine.cpu.committed_entries()
    assert all(entry.refcount == 0 for entry in entries)
    assert engine.cpu.allocator.num_allocations == len(entries)


def store_blob_as_is(engine, tokens, method, blob):
    """File an encoded chunk in the CPU tier without any check: what an older build, a shared disk
    directory or a bug may have left there."""
    span = engine._spans(tokens, None, None)[0]
    meta = ChunkMeta(span.key, span.parent_key, array("q", tokens[: span.end]), method)
    with engine._lock:
        entry, _ = engine.cpu.reserve(meta, len(blob))
        engine.cpu.view(entry).copy_(torch.frombuffer(bytearray(blob), dtype=torch.uint8))
        engine.cpu.commit(entry)

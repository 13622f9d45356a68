"""compress/decompress through the engine: naive is lossless, cachegen stays within its stated bound."""

import numpy as np
import pytest
import torch

from cachelayer import CacheEngine
from cachelayer.compress import UnknownCodecError, codec_names, get_codec
from cachelayer.compress.cachegen import layer_qmax


def test_registry_names_and_unknown_method():
    assert {"naive", "cachegen"} <= set(codec_names())
    with pytest.raises(UnknownCodecError, match="available: naive, cachegen"):
        get_codec("zstd")


def test_naive_codec_roundtrip_is_exact_for_every_supported_dtype():
    codec = get_codec("naive")
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        kv = torch.randn(3, 2, 5, 8).to(dtype)
        assert torch.equal(codec.decode(codec.encode(kv)), kv)


def test_cachegen_through_the_engine_is_within_its_error_bound_and_smaller():
    layers, heads, head_dim, chunk = 6, 2, 64, 64
    engine = CacheEngine.from_config(
        {"chunk_size": chunk, "max_local_cpu_size": 0.05},
        num_layers=layers,
        num_kv_heads=heads,
        head_dim=head_dim,
        dtype=torch.bfloat16,
    )
    generator = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, 50_000, (3 * chunk,), generator=generator).tolist()
    kv = torch.randn(layers, 2, 3 * chunk, heads * head_dim, generator=generator).to(torch.bfloat16)
    engine.store(tokens, kv)
    raw_bytes = sum(entry.nbytes for entry in engine.cpu.committed_entries())
    assert engine.compress(tokens, "cachegen", "LocalCPUBackend") == 3 * chunk
    compressed_bytes = sum(entry.nbytes for entry in engine.cpu.committed_entries())
    assert compressed_bytes < raw_bytes / 2  # random normal data still compresses >2x with <=63 levels
    hit, decoded = engine.retrieve(tokens)
    assert hit == 3 * chunk
    original = kv.float()
    qmax = torch.tensor(layer_qmax(layers, 0, layers), dtype=torch.float32).view(layers, 1, 1, 1)
    scale = original.abs().amax(dim=3, keepdim=True) / qmax
    # The codec's bound (half a bin) plus the rounding of the bf16 output.
    bound = scale * (0.5 + 2.0**-20) + decoded.float().abs() * 2.0**-8
    assert bool(((decoded.float() - original).abs() <= bound + 1e-6).all())
    assert engine.decompress(tokens, "cachegen", "LocalCPUBackend") == 3 * chunk
    hit, restored = engine.retrieve(tokens)
    assert torch.equal(restored, decoded)  # decompress keeps the decoded values, now stored raw


def test_chunk_checksum_is_the_same_on_one_thread_or_many_and_sees_one_flipped_bit(monkeypatch):
    import xxhash

    from cachelayer.compress import checksum as checksum_module

    size = 3 * checksum_module.SEGMENT_BYTES + 12345
    data = np.random.default_rng(5).integers(0, 256, size, dtype=np.uint8)
    head = b"header bytes"
    segments = [head] + [
        data[start : start + checksum_module.SEGMENT_BYTES]
        for start in range(0, len(data), checksum_module.SEGMENT_BYTES)
    ]
    digests = np.asarray([xxhash.xxh3_64_intdigest(segment) for segment in segments], dtype="<u8")
    expected = xxhash.xxh3_64_intdigest(digests.tobytes())
    assert checksum_module.checksum(head, data) == expected  # 5 segments: the thread pool's path
    monkeypatch.setattr(checksum_module, "_PARALLEL_MIN_SEGMENTS", 10**9)
    assert checksum_module.checksum(head, data) == expected  # one thread
    data[len(data) // 2] ^= 1
    assert checksum_module.checksum(head, data) != expected

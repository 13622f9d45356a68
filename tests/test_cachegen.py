"""The CacheGen codec: error bound, layer-dependent levels, format checks, and CPU <-> CUDA identity."""

from __future__ import annotations

import pytest
import torch

from cachelayer.compress import get_codec
from cachelayer.compress.cachegen import (
    DEFAULT_LEVELS,
    CacheGenCodec,
    CacheGenError,
    error_bound,
    layer_qmax,
)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (runs on the GPU machine)")


def kv_like(
    layers: int, tokens: int, channels: int, dtype=torch.bfloat16, device="cpu", seed=0
) -> torch.Tensor:
    """Random values with per-channel magnitudes that differ, as keys' channels do."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(layers, 2, tokens, channels, generator=generator)
    values *= torch.rand(1, 2, 1, channels, generator=generator) * 4 + 0.05
    return values.to(dtype).to(device)


def expected_scales(kv: torch.Tensor, layer_offset: int = 0, total_layers: int | None = None) -> torch.Tensor:
    total = total_layers or layer_offset + kv.shape[0]
    qmax = torch.tensor(layer_qmax(kv.shape[0], layer_offset, total), dtype=torch.float32)
    return kv.float().abs().amax(-1).cpu() / qmax[:, None, None]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 255, 256, 300])
def test_round_trip_stays_within_the_stated_error_bound(dtype, tokens):
    codec = CacheGenCodec()
    kv = kv_like(3, tokens, 40, dtype, seed=tokens)
    blob = codec.encode(kv)
    restored = codec.decode(blob, dtype=torch.float32)
    assert restored.shape == kv.shape
    bound = error_bound(expected_scales(kv))[..., None]
    assert torch.all((restored - kv.float()).abs() <= bound)
    # Decoding to the input dtype (the default) adds only that dtype's rounding of the value.
    native = codec.decode(blob)
    assert native.dtype == dtype
    assert torch.equal(native, restored.to(dtype))


def test_early_layers_get_finer_bins_than_late_layers():
    codec = CacheGenCodec()
    kv = kv_like(1, 200, 64).expand(9, 2, 200, 64).contiguous()  # the same values in every layer
    restored = codec.decode(codec.encode(kv), dtype=torch.float32)
    errors = (restored - kv.float()).abs().mean(dim=(1, 2, 3))
    assert layer_qmax(9, 0, 9) == [31, 31, 31, 15, 15, 15, 7, 7, 7]
    assert errors[0] < errors[4] < errors[8]
    # A chunk holding the model's last layers is quantized as those layers, not as layer 0.
    tail = codec.encode(kv[:3], layer_offset=6, total_layers=9)
    tail_errors = (codec.decode(tail, dtype=torch.float32) - kv[:3].float()).abs().mean()
    assert torch.isclose(tail_errors, errors[6:].mean(), rtol=1e-4)


def test_entropy_coding_compresses_well_below_the_raw_symbol_width():
    codec = CacheGenCodec()
    kv = kv_like(6, 512, 128)
    blob = codec.encode(kv)
    # Raw symbols would need 6, 5 and 4 bits for the three thirds: 5 on average, a ratio of 3.2.
    assert kv.numel() * 2 / len(blob) > 3.3


def test_encoding_is_deterministic_and_zeros_are_exact():
    codec = CacheGenCodec()
    kv = kv_like(2, 70, 24)
    assert codec.encode(kv) == codec.encode(kv.clone())
    zeros = torch.zeros(2, 2, 10, 8)
    assert torch.equal(codec.decode(codec.encode(zeros)), zeros)


def test_registered_as_cachegen():
    assert isinstance(get_codec("cachegen"), CacheGenCodec)
    assert get_codec("cachegen").levels == DEFAULT_LEVELS


def test_bad_blobs_and_bad_input_get_clear_errors():
    codec = CacheGenCodec()
    blob = codec.encode(kv_like(2, 40, 16))
    with pytest.raises(CacheGenError, match="magic"):
        codec.decode(b"XXXX" + blob[4:])
    with pytest.raises(CacheGenError, match="truncated"):
        codec.decode(blob[:-8])
    with pytest.raises(CacheGenError, match="shorter than its header"):
        codec.decode(blob[:10])
    corrupted = bytearray(blob)
    corrupted[-40:] = bytes(40)  # zero the last words: the streams no longer end where they began
    with pytest.raises(CacheGenError, match="corrupt"):
        codec.decode(bytes(corrupted))
    with pytest.raises(CacheGenError, match="NaN"):
        codec.encode(torch.full((1, 2, 4, 4), float("nan")))
    with pytest.raises(CacheGenError, match="layers, 2, tokens, channels"):
        codec.encode(torch.zeros(2, 3, 4, 4))
    with pytest.raises(CacheGenError, match="total_layers"):
        codec.encode(torch.zeros(2, 2, 4, 4), layer_offset=5, total_layers=6)
    with pytest.raises(CacheGenError, match="int64"):
        codec.encode(torch.zeros(2, 2, 4, 4, dtype=torch.int64))


@cuda
@pytest.mark.parametrize("tokens", [1, 256, 700])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_encoding_is_byte_identical_to_cpu_and_both_decoders_agree(tokens, dtype):
    codec = CacheGenCodec()
    kv = kv_like(5, tokens, 96, dtype, seed=tokens + 1)
    cpu_blob = codec.encode(kv)
    gpu_blob = codec.encode(kv.cuda())
    assert gpu_blob == cpu_blob
    on_cpu = codec.decode(cpu_blob, dtype=torch.float32)
    on_gpu = codec.decode(cpu_blob, device="cuda", dtype=torch.float32)
    assert torch.equal(on_gpu.cpu(), on_cpu)
    assert torch.equal(codec.decode(gpu_blob, device="cuda").cpu(), codec.decode(gpu_blob))
    bound = error_bound(expected_scales(kv))[..., None]
    assert torch.all((on_gpu.cpu() - kv.float()).abs() <= bound)


@cuda
def test_cuda_llama_shaped_chunk_round_trips_and_corruption_is_caught():
    codec = CacheGenCodec()
    kv = kv_like(32, 256, 1024, device="cuda", seed=3)
    blob = codec.encode_to_device(kv, layer_offset=0, total_layers=32)
    restored = codec.decode_device(blob, dtype=torch.float32)
    bound = error_bound(expected_scales(kv)).cuda()[..., None]
    assert torch.all((restored - kv.float()).abs() <= bound)
    assert bytes(blob.cpu().numpy()) == codec.encode(kv.cpu())
    broken = blob.clone()
    broken[-64:] = 0
    with pytest.raises(CacheGenError, match="corrupt"):
        codec.decode_device(broken)

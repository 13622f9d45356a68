"""The CacheGen codec: error bound, layer-dependent levels, format checks, and CPU <-> CUDA identity.

The CPU path is numba-compiled; its contract is byte identity with the numpy implementation it
replaced (and that the CUDA kernels match): tests/data/cachegen_golden.json holds that
implementation's blob and decoded-value hashes for seeded inputs, and
kvgate_testing/cachegen_numpy_baseline.py (the old code) is checked against live on fresh inputs.
"""

from __future__ import annotations

import hashlib
import json
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from cachelayer.compress import cachegen_cpu, get_codec
from cachelayer.compress.cachegen import (
    DEFAULT_LEVELS,
    CacheGenCodec,
    CacheGenError,
    _parse,
    error_bound,
    layer_qmax,
    sealed,
)
from kvgate_testing import cachegen_numpy_baseline

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (runs on the GPU machine)")

GOLDEN = json.loads((Path(__file__).parent / "data" / "cachegen_golden.json").read_text())
GOLDEN_CASES: dict[str, dict] = {
    "bf16_one_token": dict(shape=(3, 1, 40), dtype="bfloat16", seed=1),
    "bf16_partial_group": dict(shape=(3, 255, 40), dtype="bfloat16", seed=2),
    "bf16_one_group": dict(shape=(4, 256, 96), dtype="bfloat16", seed=3),
    "bf16_three_groups": dict(shape=(5, 700, 24), dtype="bfloat16", seed=4),
    "bf16_llama8b_chunk": dict(shape=(32, 256, 1024), dtype="bfloat16", seed=5),
    "bf16_tail_layers": dict(shape=(3, 300, 64), dtype="bfloat16", seed=6, layer_offset=29, total_layers=32),
    "bf16_one_channel": dict(shape=(2, 513, 1), dtype="bfloat16", seed=7),
    "bf16_zero_and_constant_rows": dict(
        shape=(3, 260, 48), dtype="bfloat16", seed=8, kind="zero_and_constant"
    ),
    "bf16_wide_magnitudes": dict(shape=(6, 256, 128), dtype="bfloat16", seed=9, kind="wide_magnitudes"),
    "fp16_two_groups": dict(shape=(3, 300, 40), dtype="float16", seed=10),
    "fp32_two_groups": dict(shape=(3, 300, 40), dtype="float32", seed=11),
    "fp32_wide_magnitudes": dict(shape=(4, 130, 72), dtype="float32", seed=12, kind="wide_magnitudes"),
    "fp32_skewed": dict(shape=(3, 256, 64), dtype="float32", seed=13, kind="skewed"),
}


def golden_input(case: dict) -> torch.Tensor:
    """The seeded input of a golden case (numpy's PCG64 stream, stable across versions and machines)."""
    layers, tokens, channels = case["shape"]
    rng = np.random.default_rng(case["seed"])
    values = rng.standard_normal((layers, 2, tokens, channels), dtype=np.float32)
    values *= rng.random((1, 2, 1, channels), dtype=np.float32) * 4 + 0.05
    kind = case.get("kind", "kv_like")
    if kind == "zero_and_constant":
        values[0, 1] = 0  # a whole (layer, K/V) plane of one symbol: frequency 4096
        values[1, 0, ::3] = 0  # all-zero rows: scale 0
        values[2, :, 1::5] = 2.5  # constant rows: every symbol is 2 * qmax
    elif kind == "wide_magnitudes":
        values *= np.float32(10.0) ** rng.uniform(-30, 30, (layers, 2, tokens, 1)).astype(np.float32)
    elif kind == "skewed":
        values = np.where(rng.random(values.shape) < 0.02, values * 50, values * 0.01).astype(np.float32)
    return torch.from_numpy(values).to(getattr(torch, case["dtype"]))


def version_1_bytes(blob: bytes) -> bytes:
    """The blob as version 1 wrote it (the golden hashes predate version 2): the same sections
    behind a header without the checksum, which was the only change."""
    fields = list(struct.unpack_from("<4sHBBIIIIIIQQ", blob))
    assert fields[1] == 2
    fields[1] = 1
    return struct.pack("<4sHBBIIIIIIQ", *fields[:-1]) + blob[48:]


def sha256(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


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


@pytest.mark.parametrize("name", list(GOLDEN_CASES))
def test_cpu_blobs_and_decoded_values_are_those_of_the_reference_implementation(name):
    case, expected = GOLDEN_CASES[name], GOLDEN[name]
    kv = golden_input(case)
    assert sha256(kv) == expected["input_sha256"], "the seeded input changed, not the codec"
    codec = CacheGenCodec()
    blob = codec.encode(kv, layer_offset=case.get("layer_offset", 0), total_layers=case.get("total_layers"))
    assert len(version_1_bytes(blob)) == expected["blob_bytes"]
    assert hashlib.sha256(version_1_bytes(blob)).hexdigest() == expected["blob_sha256"]
    assert sha256(codec.decode(blob)) == expected["decoded_sha256"]
    assert sha256(codec.decode(blob, dtype=torch.float32)) == expected["decoded_float32_sha256"]


@pytest.mark.parametrize(
    ("layers", "tokens", "channels", "dtype", "seed"),
    [
        (2, 77, 33, torch.bfloat16, 21),
        (3, 520, 16, torch.bfloat16, 22),
        (4, 256, 50, torch.float16, 23),
        (2, 129, 31, torch.float32, 24),
    ],
)
def test_numba_path_matches_the_numpy_implementation_on_fresh_inputs(layers, tokens, channels, dtype, seed):
    codec = CacheGenCodec()
    kv = kv_like(layers, tokens, channels, dtype, seed=seed)
    kv[0, 1, ::7] = 0  # all-zero rows (scale 0) among the others
    blob = codec.encode(kv, layer_offset=1, total_layers=layers + 2)
    assert blob == cachegen_numpy_baseline.encode(codec, kv, 1, layers + 2)
    for out_dtype in (None, torch.float32, torch.bfloat16, torch.float16):
        expected = cachegen_numpy_baseline.decode(blob, out_dtype)
        assert torch.equal(codec.decode(blob, dtype=out_dtype), expected)


def test_threads_encoding_and_decoding_at_once_get_the_same_bytes_and_values():
    codec = CacheGenCodec()
    # 4 x 2 x 256 x 512 values: above PARALLEL_MIN_VALUES, so each call opens parallel regions.
    chunks = [kv_like(4, 256, 512, seed=40 + index) for index in range(4)]
    assert chunks[0].numel() >= cachegen_cpu.PARALLEL_MIN_VALUES
    expected = [codec.encode(chunk) for chunk in chunks]
    with ThreadPoolExecutor(max_workers=4) as pool:
        blobs = list(pool.map(codec.encode, chunks))
        restored = list(pool.map(codec.decode, blobs))
    assert blobs == expected
    for blob, values in zip(expected, restored, strict=True):
        assert torch.equal(values, codec.decode(blob))


def test_infinite_values_are_refused_in_every_input_dtype():
    codec = CacheGenCodec()
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        kv = torch.zeros(2, 2, 300, 8, dtype=dtype)
        kv[1, 0, 299, 7] = float("-inf")
        with pytest.raises(CacheGenError, match="infinite"):
            codec.encode(kv)


def test_a_blob_whose_lanes_disagree_with_its_words_is_refused():
    codec = CacheGenCodec()
    blob = bytearray(codec.encode(kv_like(2, 300, 16)))
    _, layout = _parse(memoryview(bytes(blob)))
    start, _ = layout.offsets["counts"]
    counts = np.frombuffer(blob, dtype="<u2", count=2, offset=start).copy()
    assert counts[0] > 0
    # Move one word from the first lane to the second: the total still adds up, the streams do not.
    counts[0] -= 1
    counts[1] += 1
    blob[start : start + 4] = counts.tobytes()
    # Resealed, so that the checksum passes and the rANS check is the one that refuses it.
    with pytest.raises(CacheGenError, match="did not decode to their initial state"):
        codec.decode(sealed(bytes(blob)))


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
    assert sealed(bytes(blob.cpu().numpy())) == codec.encode(kv.cpu())
    broken = blob.clone()
    broken[-64:] = 0
    with pytest.raises(CacheGenError, match="corrupt"):
        codec.decode_device(broken)


@cuda
@pytest.mark.parametrize("pinned", [True, False])
def test_cuda_host_paths_carry_the_same_blob_through_pinned_memory(pinned):
    codec = CacheGenCodec()
    kv = kv_like(4, 300, 128, torch.bfloat16, device="cuda", seed=11)
    host = codec.encode_to_host(kv)
    assert host.device.type == "cpu" and host.is_pinned() and host.dtype == torch.uint8
    on_device = codec.encode_to_device(kv)
    assert bytes(host.numpy()) == sealed(bytes(on_device.cpu().numpy())) == codec.encode(kv.cpu())
    source = host if pinned else host.clone()  # a pageable tensor goes through a pinned copy
    assert source.is_pinned() == pinned
    decoded = codec.decode_from_host(source, dtype=torch.float32)
    assert decoded.device.type == "cuda"
    assert torch.equal(decoded.cpu(), codec.decode(bytes(host.numpy()), dtype=torch.float32))
    assert torch.equal(codec.decode_from_host(memoryview(host.numpy()), dtype=torch.float32), decoded)
    with pytest.raises(CacheGenError, match="1-D uint8"):
        codec.decode_from_host(host.view(torch.int16))
    corrupted = host.clone().pin_memory()
    corrupted[-3] ^= 0x40
    with pytest.raises(CacheGenError, match="checksum"):
        codec.decode_from_host(corrupted)

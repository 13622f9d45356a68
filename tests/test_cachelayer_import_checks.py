"""Encoded chunks from outside (an import, a stored blob) are checked before they are stored or decoded:
codec header, checksum, shape, dtype and token count against the engine's layout."""

import json
import random
import subprocess

import numpy as np
import pytest
import torch

from cachelayer.compress import codec_names, get_codec
from cachelayer.engine import CacheEngineError
from kvgate_testing.cachelayer import CHUNK, HEAD_DIM, HEADS, LAYERS, make_engine, request, store_blob_as_is
from kvgate_testing.processes import REPO_ROOT, python_command


@pytest.mark.parametrize("method", codec_names())
def test_every_one_of_300_corrupted_blobs_is_refused_and_nothing_is_stored(method):
    """Every codec: bytes flipped anywhere, header or payload. A naive blob's payload is the tensor's
    raw bytes, any of which is a valid value: only its checksum tells a flipped one."""
    codec = get_codec(method)
    tokens, kv = request(1, 4)
    chunk = kv[:, :, :CHUNK].contiguous()
    blob = codec.encode(chunk)
    randomness = random.Random(21)
    decoded = []
    for attempt in range(300):
        corrupted = bytearray(blob)
        for _ in range(randomness.randint(1, 4)):
            corrupted[randomness.randrange(len(blob))] ^= randomness.randint(1, 255)
        try:
            codec.decode(bytes(corrupted))
            decoded.append(attempt)
        except ValueError:
            pass
    assert decoded == [], f"{len(decoded)} of 300 corrupted {method} blobs decoded"

    engine = make_engine(8)
    try:
        for _ in range(30):
            corrupted = bytearray(blob)
            corrupted[randomness.randrange(64, len(blob))] ^= 0x10
            with pytest.raises(CacheEngineError, match="refused"):
                engine.import_chunk(tokens, 0, "LocalCPUBackend", method, bytes(corrupted))
        assert engine.cpu.num_chunks == 0 and engine.lookup(tokens) == 0
        assert engine.import_chunk(tokens, 0, "LocalCPUBackend", method, blob) == CHUNK
    finally:
        engine.close()


@pytest.mark.parametrize(
    ("kind", "shape", "dtype"),
    [
        ("layers", (LAYERS + 1, 2, CHUNK, HEADS * HEAD_DIM), torch.bfloat16),
        ("tokens", (LAYERS, 2, CHUNK // 2, HEADS * HEAD_DIM), torch.bfloat16),
        ("channels", (LAYERS, 2, CHUNK, HEADS * HEAD_DIM * 2), torch.bfloat16),
        ("dtype", (LAYERS, 2, CHUNK, HEADS * HEAD_DIM), torch.float16),
    ],
)
@pytest.mark.parametrize("method", ["cachegen", "naive"])
def test_a_blob_of_the_wrong_shape_or_dtype_is_refused_on_import(method, kind, shape, dtype):
    engine = make_engine(8)
    try:
        tokens, _ = request(2, 1)
        blob = get_codec(method).encode(torch.randn(shape).to(dtype))
        with pytest.raises(CacheEngineError, match="this engine keeps"):
            engine.import_chunk(tokens, 0, "LocalCPUBackend", method, blob)
        assert engine.cpu.num_chunks == 0
    finally:
        engine.close()


def test_a_stored_blob_of_the_wrong_shape_fails_decompress_and_is_a_miss_on_retrieve():
    engine = make_engine(8)
    try:
        tokens, _ = request(3, 1)
        wrong = get_codec("cachegen").encode(torch.randn(LAYERS, 2, CHUNK // 2, HEADS * HEAD_DIM).bfloat16())
        store_blob_as_is(engine, tokens, "cachegen", wrong)
        with pytest.raises(CacheEngineError, match="this engine keeps"):
            engine.decompress(tokens, "cachegen", "LocalCPUBackend")
        assert {entry.meta.fmt for entry in engine.cpu.committed_entries()} == {"cachegen"}
        assert engine.retrieve(tokens) == (0, None)  # a miss, never a crash
        assert engine.cpu.num_chunks == 0  # and the unusable chunk is gone
    finally:
        engine.close()


# A fresh process, so that freed memory of earlier tests cannot hide an allocation; the peak RSS
# (VmHWM, reset through /proc/self/clear_refs) shows whether the claimed shape was ever allocated.
_HUGE_CLAIM_SCRIPT = """
import json
from pathlib import Path

import numpy as np
import torch

from cachelayer.compress.cachegen import CacheGenCodec, _Layout, sealed
from kvgate_testing.cachelayer import CHUNK, make_engine, request

def peak_rss():
    status = Path("/proc/self/status").read_text().splitlines()
    return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))

# A blob whose header claims [2, 2, 2048, 16384] bf16 (256 MiB decoded) in 3.2 MB: lanes that hold
# no words (every symbol of frequency 4096) decode without reading any, so the sizes all agree.
layers, tokens, channels = 2, 2048, 16384
layout = _Layout(layers, tokens, channels, 0)
blob = bytearray(layout.total_size)
blob[:48] = CacheGenCodec._header(torch.bfloat16, layers, tokens, channels, 0, layers, 0)
sections = {
    "qmax": np.full(layers, 31, dtype=np.uint8),
    "frequencies": np.tile(np.array([4096] + [0] * 63, dtype="<u2"), layers * 2),
    "states": np.full(layout.num_lanes, 1 << 16, dtype="<u4"),
}
for name, values in sections.items():
    start, size = layout.offsets[name]
    blob[start : start + size] = values.tobytes()
blob = sealed(bytes(blob))
engine = make_engine(2000)  # room for the 3.2 MB blob, so that only the checks can refuse it
prompt, _ = request(5, 1)
Path("/proc/self/clear_refs").write_text("5")
before = peak_rss()
errors = []
for attempt in (
    lambda: engine.import_chunk(prompt, 0, "LocalCPUBackend", "cachegen", blob),
    lambda: engine.decompress(prompt, "cachegen", "LocalCPUBackend"),
    lambda: engine.retrieve(prompt),
):
    try:
        attempt()
    except ValueError as exc:
        errors.append(str(exc))
print(json.dumps({"blob_bytes": len(blob), "peak_growth": peak_rss() - before, "errors": errors,
                  "stored": engine.cpu.num_chunks}))
engine.close()
"""


def test_a_blob_claiming_a_huge_shape_is_refused_without_allocating_it():
    result = subprocess.run(
        python_command("-c", _HUGE_CLAIM_SCRIPT),
        cwd=REPO_ROOT,
        env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    assert outcome["blob_bytes"] < 4_000_000
    assert "this engine keeps" in outcome["errors"][0]
    assert outcome["stored"] == 0
    assert outcome["peak_growth"] < 64 * 2**20, f"peak RSS grew by {outcome['peak_growth'] / 2**20:.0f} MiB"


def test_old_format_blobs_are_refused_with_a_clear_error():
    blob = bytearray(get_codec("cachegen").encode(torch.randn(LAYERS, 2, CHUNK, HEADS * HEAD_DIM).bfloat16()))
    blob[4:6] = np.uint16(1).tobytes()
    with pytest.raises(ValueError, match="version 1 had no checksum"):
        get_codec("cachegen").decode(bytes(blob))
    naive = bytearray(get_codec("naive").encode(torch.zeros(1, 2, 1, 4)))
    naive[:8] = b"KVNAIVE1"
    with pytest.raises(ValueError, match="older format"):
        get_codec("naive").decode(bytes(naive))

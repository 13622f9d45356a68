"""Gateway overhead, side by side: the same load sent directly to a fast backend, through kvgate, and
through the peer routers (sglang-router round_robin and cache_aware, vllm-router round_robin).

For every target it reports, in one run on this machine:
- latency p50/p99 at concurrency 1, JSON and SSE (time to the last byte; SSE also to the first byte),
  and the latency each router adds over the direct path;
- requests/s at concurrency `--concurrency`;
- the router's CPU time per request: utime+stime of its process tree from /proc over the
  throughput phases, divided by the requests served;
- the same CPU figure measured paired (`--paired-rounds`): every router takes JSON load at the same
  time, so all of them run under the same contention from the rest of this shared machine (the
  sequential phases above see whatever load the machine had at their own moment).

Peers are run from their own virtual environments (scripts/install_peers.sh); a missing peer is
reported and skipped. The load generator is this process: raw asyncio protocols with httptools,
keep-alive connections, bounded by a request count and a time limit per phase, loopback only.

    .venv/bin/python -m benchmarks.gateway_overhead            # writes benchmarks/results/gateway_overhead.*
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httptools
import uvloop
import yaml

from kvgate_testing.backend import BackendProcess
from kvgate_testing.ports import free_port
from kvgate_testing.proc_stats import tree_cpu_seconds
from kvgate_testing.processes import REPO_ROOT, ManagedProcess, python_command, wait_for_http
from kvgate_testing.routers import peer_versions, peer_versions_line

PEERS_DIR = REPO_ROOT / ".cache" / "peers"
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
MODEL = "test-model"
PROMPT_BODY = json.dumps(
    {"model": MODEL, "prompt": "The quick brown fox jumps over the lazy dog. " * 8}
).encode()
STREAM_BODY = json.dumps(
    {"model": MODEL, "prompt": "The quick brown fox jumps over the lazy dog. " * 8, "stream": True}
).encode()
STREAM_CHUNKS = 16


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


def _raw_request(port: int, body: bytes, stream: bool) -> bytes:
    head = (
        f"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n"
    )
    if stream:
        head += f"x-test-chunks: {STREAM_CHUNKS}\r\n"
    return head.encode() + b"\r\n" + body


async def run_load(port: int, stream: bool, requests: int, concurrency: int, time_limit_s: float) -> dict:
    """Closed-loop load: `concurrency` connections, each sending its requests one after another."""
    loop = asyncio.get_running_loop()
    raw = _raw_request(port, STREAM_BODY if stream else PROMPT_BODY, stream)
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
                first_byte, total, status = await connection.request(raw)
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


def start_peer(peer: str, policy: str, backend_url: str) -> tuple[ManagedProcess, int] | None:
    venv = PEERS_DIR / peer
    if not (venv / "bin" / "python").exists():
        return None
    port = free_port()
    common = ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", backend_url, "--policy", policy]
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


# ---------------------------------------------------------------- report


def _number(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


# (header, cell) of the markdown table.
_COLUMNS = [
    ("target", lambda e: e["target"]),
    ("JSON p50", lambda e: _number(e["json_c1"]["latency_p50_ms"], ".3f")),
    ("JSON p99", lambda e: _number(e["json_c1"]["latency_p99_ms"], ".3f")),
    ("JSON added p50", lambda e: _number(e["added_ms"]["json_c1"]["p50"], "+.3f")),
    ("JSON added p99", lambda e: _number(e["added_ms"]["json_c1"]["p99"], "+.3f")),
    ("SSE p50", lambda e: _number(e["sse_c1"]["latency_p50_ms"], ".3f")),
    ("SSE p99", lambda e: _number(e["sse_c1"]["latency_p99_ms"], ".3f")),
    ("SSE added p50", lambda e: _number(e["added_ms"]["sse_c1"]["p50"], "+.3f")),
    ("SSE added p99", lambda e: _number(e["added_ms"]["sse_c1"]["p99"], "+.3f")),
    ("SSE first byte added p50", lambda e: _number(e["added_ms"]["sse_c1"]["first_byte_p50"], "+.3f")),
    ("JSON req/s", lambda e: _number(e["json_load"]["requests_per_s"], ".0f")),
    ("SSE req/s", lambda e: _number(e["sse_load"]["requests_per_s"], ".0f")),
    ("router CPU µs/req (JSON+SSE)", lambda e: _number(e.get("cpu_us_per_request"), ".0f")),
    ("router CPU µs/JSON req", lambda e: _number(e.get("cpu_us_per_json_request"), ".0f")),
    ("backend CPU µs/req", lambda e: _number(e.get("backend_cpu_us_per_request"), ".0f")),
]


def write_report(report: dict, stem: Path) -> None:
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        "# Gateway overhead: direct vs kvgate vs peer routers",
        "",
        f"Command: `{report['command']}`  ",
        f"Machine: {report['machine']}; one fast test backend (kvgate_testing/openai_backend.py) "
        "behind every router; load from one asyncio+httptools client process; "
        f"medians of {report['rounds']} round(s). "
        "The machine was shared with other work (load average at the end: "
        f"{', '.join(f'{x:.1f}' for x in report['load_average_at_end'])}): latencies at concurrency 1 "
        "are dominated by scheduling; compare targets within this run only.",
        *(
            [peer_versions_line(report["peer_versions"], report.get("peer_versions_note"))]
            if "peer_versions" in report
            else []
        ),
        "",
        "Latency at concurrency 1 (ms; added = over direct). Throughput and CPU at concurrency "
        f"{report['concurrency']}. CPU/request = router process tree utime+stime over the load phases "
        f"(JSON and SSE with {STREAM_CHUNKS} chunks), divided by requests served.",
        "",
        "| " + " | ".join(name for name, _ in _COLUMNS) + " |",
        "|" + "---|" * len(_COLUMNS),
    ]
    for entry in report["results"]:
        lines.append("| " + " | ".join(cell(entry) for _, cell in _COLUMNS) + " |")
    paired = report.get("paired_cpu") or {}
    if paired:
        lines += [
            "",
            f"Paired CPU per JSON request (µs): all routers loaded at the same time, concurrency "
            f"{report['concurrency'] // 2} each, {report['paired_rounds']} rounds; the same contention "
            "for every router.",
            "",
            "| router | median | per round |",
            "|---|---|---|",
        ]
        for name, entry in paired.items():
            rounds = ", ".join(f"{value:.0f}" for value in entry["rounds_us"])
            lines.append(f"| {name} | {entry['median_us']:.0f} | {rounds} |")
    if report["skipped"]:
        lines += ["", "Skipped: " + "; ".join(report["skipped"])]
    lines += ["", f"![plot]({stem.name}.png)", ""]
    stem.with_suffix(".md").write_text("\n".join(lines))
    _plot(report, stem.with_suffix(".png"))


def _plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = report["results"]
    names = [entry["target"].replace(" ", "\n", 1) for entry in entries]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    x = range(len(entries))
    width = 0.38
    axes[0].bar(
        [i - width / 2 for i in x], [e["added_ms"]["json_c1"]["p50"] for e in entries], width, label="JSON"
    )
    axes[0].bar(
        [i + width / 2 for i in x], [e["added_ms"]["sse_c1"]["p50"] for e in entries], width, label="SSE"
    )
    axes[0].set_title("added latency p50 over direct (ms, c=1, symlog)")
    axes[0].set_yscale("symlog", linthresh=0.1)
    axes[0].axhline(0, color="black", linewidth=0.5)
    axes[0].legend()
    axes[1].bar(x, [e["json_load"]["requests_per_s"] for e in entries], color="tab:green")
    axes[1].set_title(f"JSON requests/s (c={report['concurrency']})")
    cpu = [e.get("cpu_us_per_json_request") or 0 for e in entries]
    paired = report.get("paired_cpu") or {}
    if paired:
        paired_cpu = [paired.get(e["target"], {}).get("median_us", 0) for e in entries]
        axes[2].bar([i - width / 2 for i in x], cpu, width, color="tab:red", label="sequential")
        axes[2].bar([i + width / 2 for i in x], paired_cpu, width, color="tab:purple", label="paired")
        axes[2].legend()
    else:
        axes[2].bar(x, cpu, color="tab:red")
    axes[2].set_title("router CPU µs per JSON request")
    for axis in axes:
        axis.set_xticks(list(x))
        axis.set_xticklabels(names, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


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
    parser.add_argument("--report-only", action="store_true", help="rewrite .md and .png from the .json")
    parser.add_argument(
        "--output", default=str(RESULTS_DIR / "gateway_overhead"), help="path stem of the results"
    )
    args = parser.parse_args()
    stem = Path(args.output)
    if args.report_only:
        write_report(json.loads(stem.with_suffix(".json").read_text()), stem)
        return
    report = uvloop.run(main_async(args))
    report.update(
        {
            "command": " ".join(["python", "-m", "benchmarks.gateway_overhead", *sys.argv[1:]]),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
            "rounds": args.rounds,
            "paired_rounds": args.paired_rounds,
            "concurrency": args.concurrency,
            "load_average_at_end": os.getloadavg(),
        }
    )
    if not args.skip_peers:
        report["peer_versions"] = peer_versions()
    stem.parent.mkdir(parents=True, exist_ok=True)
    write_report(report, stem)
    print(stem.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()

"""What the endpoint-picker protocol itself costs through Envoy (issue 37's cost goals): `kvgate epp`
against two no-op pickers that answer every request with one fixed pick, all behind the real Envoy
on deploy/envoy/envoy-epp.yaml's modes (request headers answered at once, the body BUFFERED and
answered with the pick, the answer's end from the access log), with kvgate's proxy and Envoy alone
(LEAST_REQUEST) beside them, on the same simulated engine, in one run:

- `cpp_noop`: benchmarks/epp_floor/noop_picker.cc, grpc++'s callback API on raw bytes (built here
  with g++ against Debian's libgrpc++-dev: `apt-get install libgrpc++-dev pkg-config`);
- `python_noop`: benchmarks/epp_floor/noop_picker.py, the same on grpc.aio, raw bytes (Python's gRPC
  transport and nothing else);
- `kvgate_noop`: benchmarks/epp_floor/noop_picker_kvgate.py, the same on kvgate's own gRPC server
  (router/epp/grpc_server.py on uvloop, raw bytes): `kvgate epp`'s transport alone;
- `kvgate_epp`: the real picker (kv_aware), whose pick reads the body, tokenizes and routes.

Two phases: a latency probe (kvgate_testing/epp_runs.probe_routers: one request at a time to each,
rotating, one token out, after 20 rounds not counted: added p50/p99 over Envoy alone) and
closed-loop load (4 clients of 8-token streamed chats per router, rounds alternating: CPU per
request of the picker's process, or of the proxy's; Envoy's own CPU is not counted). The no-op
pickers are references, not bounds: a C++ picker could be cheaper still.

    .venv/bin/python -m benchmarks.epp_floor [--rounds 300] [--load-rounds 4] [--output PATH]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.epp_variants import closed_loop_rounds
from kvgate_testing import epp_runs
from kvgate_testing.envoy import BodyMode, EnvoyProcess, ResponseBodyMode, picker_config
from kvgate_testing.ports import free_port
from kvgate_testing.processes import REPO_ROOT
from kvgate_testing.provenance import run_source
from kvgate_testing.results_files import write_results_files
from kvgate_testing.routers import ENVOY_ALONE_POLICY, RunningRouter, start_router
from kvgate_testing.sim_fleet import EngineFleet
from router.epp import protocol

RESULTS = Path(__file__).parent / "results"
SOURCES = Path(__file__).parent / "epp_floor"
BUILD = REPO_ROOT / ".cache" / "epp_floor"
ROUTERS = ("cpp_noop", "python_noop", "kvgate_noop", "kvgate_epp", "proxy", "envoy_alone")
NOOPS = ("cpp_noop", "python_noop", "kvgate_noop")


def build_cpp_noop() -> Path:
    """The C++ no-op picker, compiled when its binary is missing or older than its source."""
    source, binary = SOURCES / "noop_picker.cc", BUILD / "noop_picker"
    if binary.exists() and binary.stat().st_mtime >= source.stat().st_mtime:
        return binary
    flags = subprocess.run(["pkg-config", "--cflags", "--libs", "grpc++"], capture_output=True, text=True)
    if shutil.which("g++") is None or flags.returncode != 0:
        raise SystemExit(
            "epp_floor: building the C++ no-op picker needs g++ and grpc++ (pkg-config grpc++ found "
            f"nothing: {flags.stderr.strip()!r}); install them: apt-get install g++ libgrpc++-dev pkg-config"
        )
    BUILD.mkdir(parents=True, exist_ok=True)
    command = ["g++", "-O2", "-o", str(binary), str(source), *flags.stdout.split()]
    built = subprocess.run(command, capture_output=True, text=True)
    if built.returncode != 0:
        raise SystemExit(f"epp_floor: {' '.join(command)} failed:\n{built.stderr[-3000:]}")
    return binary


class NoopPicker:
    """A no-op picker process (noop_picker.cc or .py) with its own Envoy in front."""

    def __init__(self, name: str, command: list[str], answers: tuple[Path, Path]) -> None:
        port = free_port()
        self.process = subprocess.Popen(
            [*command, f"127.0.0.1:{port}", *map(str, answers)], stdout=subprocess.PIPE, text=True
        )
        assert self.process.stdout is not None
        if self.process.stdout.readline().strip() != "listening":
            self.process.kill()
            raise RuntimeError(f"{name} did not start")
        envoy_config = picker_config(
            free_port(), free_port(), ("127.0.0.1", port), BodyMode.BUFFERED,
            response_body_mode=ResponseBodyMode.NONE,
        )  # fmt: skip
        try:
            self.envoy = EnvoyProcess(envoy_config).start()
        except BaseException:
            self.process.kill()
            raise
        self.router = RunningRouter(name, self.envoy.url, self.process, self.stop)  # type: ignore[arg-type]

    def stop(self) -> None:
        self.envoy.stop()
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()


def load(routers: dict[str, RunningRouter], rounds: int, seconds: float) -> dict[str, dict[str, float]]:
    """Closed-loop rounds to each router in turn (order alternating); CPU per request and p50."""
    totals = closed_loop_rounds(routers, rounds, clients=4, seconds=seconds, tokens=8)
    return {
        name: {
            "requests": len(total["latencies"]),
            "errors": total["errors"],
            "cpu_ms_per_request": round(1000 * total["cpu_s"] / max(len(total["latencies"]), 1), 3),
            "p50_ms": round(1000 * statistics.median(total["latencies"]), 2),
        }
        for name, total in totals.items()
    }


def measure(rounds: int, load_rounds: int, seconds: float) -> dict[str, Any]:
    binary = build_cpp_noop()
    load_before = os.getloadavg()[0]
    with EngineFleet(count=1, num_gpu_blocks=256, sim_args=["--decode-ms-per-token", "2.0"]) as fleet:
        endpoint = fleet.engines[0].url.removeprefix("http://")
        with tempfile.TemporaryDirectory() as scratch:
            answers = (Path(scratch) / "headers.bin", Path(scratch) / "body.bin")
            answers[0].write_bytes(protocol.request_headers_continue().SerializeToString())
            answers[1].write_bytes(protocol.pick_on_body(endpoint).SerializeToString())
            started: dict[str, RunningRouter] = {}
            try:
                started["cpp_noop"] = NoopPicker("cpp_noop", [str(binary)], answers).router
                python = [sys.executable, str(SOURCES / "noop_picker.py")]
                started["python_noop"] = NoopPicker("python_noop", python, answers).router
                own = [sys.executable, str(SOURCES / "noop_picker_kvgate.py")]
                started["kvgate_noop"] = NoopPicker("kvgate_noop", own, answers).router
                started["kvgate_epp"] = start_router("kv_aware_via_envoy", fleet)
                started["proxy"] = start_router("kv_aware", fleet)
                started["envoy_alone"] = start_router(ENVOY_ALONE_POLICY, fleet)
                latency = epp_runs.probe_routers(started, rounds)
                cpu = load(started, load_rounds, seconds)
            finally:
                for router in started.values():
                    router.stop()
    alone = latency["envoy_alone"]
    proxy_cpu = cpu["proxy"]["cpu_ms_per_request"]
    rows = {
        name: {
            "p50_ms": latency[name]["p50_ms"],
            "p99_ms": latency[name]["p99_ms"],
            "probe_errors": latency[name]["errors"],
            "added_p50_ms": round(latency[name]["p50_ms"] - alone["p50_ms"], 3),
            "added_p99_ms": round(latency[name]["p99_ms"] - alone["p99_ms"], 3),
            **{f"load_{key}": value for key, value in cpu[name].items()},
            "cpu_over_proxy": round(cpu[name]["cpu_ms_per_request"] / proxy_cpu, 3),
        }
        for name in ROUTERS
    }
    return {
        **{
            f"{name}_added_p50_ms": rows[name]["added_p50_ms"]
            for name in ("cpp_noop", "python_noop", "kvgate_noop", "kvgate_epp", "proxy")
        },
        **{
            f"{name}_cpu_over_proxy": rows[name]["cpu_over_proxy"]
            for name in ("cpp_noop", "python_noop", "kvgate_noop", "kvgate_epp")
        },
        "routers": rows,
        "meta": {
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs (shared)",
            "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
            "probe_rounds": rounds,
            "load_rounds": load_rounds,
            "load_seconds": seconds,
            "grpcpp": subprocess.run(
                ["pkg-config", "--modversion", "grpc++"], capture_output=True, text=True
            ).stdout.strip(),
        },
    }


def write_report(results: dict[str, Any], path: Path) -> None:
    meta = results["meta"]
    lines = [
        "# What the endpoint-picker protocol costs through Envoy (`benchmarks/epp_floor.py`)",
        "",
        f"Run {meta['date']} on {meta['machine']}, load average {meta['load_average'][0]} -> "
        f"{meta['load_average'][1]}; grpc++ {meta['grpcpp']}. One simulated engine; every picker behind "
        "its own Envoy 1.40 (--concurrency 1) on deploy/envoy/envoy-epp.yaml's modes. Probe: "
        f"{meta['probe_rounds']} rounds (after 20 not counted), one request to each router per round, "
        "rotating. Load: "
        f"{meta['load_rounds']} rounds of {meta['load_seconds']:g} s per router, 4 closed-loop clients, "
        "8-token streamed chats. CPU: the picker's process (or the proxy's), Envoy's not counted.",
        "",
        "| router | p50 ms | p99 ms | added p50 over Envoy alone | added p99 "
        "| CPU ms/request under load | over the proxy | p50 under load ms | errors |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, row in results["routers"].items():
        cells = [
            name, row["p50_ms"], row["p99_ms"], f"{row['added_p50_ms']:+.3f}", f"{row['added_p99_ms']:+.3f}",
            row["load_cpu_ms_per_request"], row["cpu_over_proxy"], row["load_p50_ms"],
            row["probe_errors"] + row["load_errors"],
        ]  # fmt: skip
        lines.append("| " + " | ".join(str(cell) for cell in cells) + " |")
    lines += [
        "",
        "cpp_noop, python_noop and kvgate_noop answer a fixed pick without reading the body: references "
        "for what the protocol's two round trips through Envoy cost with grpc++, with grpc.aio and with "
        "kvgate's own server (the transport kvgate_epp runs on), not bounds.",
        "",
        "![added latency and CPU](epp_floor.png)",
    ]
    path.write_text("\n".join(lines) + "\n")


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["routers"]
    names = [name for name in ROUTERS if name != "envoy_alone"]
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.bar(names, [rows[name]["added_p50_ms"] for name in names], color="tab:blue")
    left.axhline(1.0, color="grey", linestyle="--", linewidth=1, label="issue 37's goal (1 ms)")
    left.set_ylabel("added p50 over Envoy alone (ms)")
    left.legend()
    right.bar(names, [rows[name]["load_cpu_ms_per_request"] for name in names], color="tab:orange")
    right.axhline(0.6 * rows["proxy"]["load_cpu_ms_per_request"], color="grey", linestyle="--", linewidth=1,
                  label="0.6x the proxy (goal)")  # fmt: skip
    right.set_ylabel("process CPU per request under load (ms)")
    right.legend()
    for axis in (left, right):
        axis.tick_params(axis="x", rotation=20)
    figure.suptitle(f"The endpoint-picker protocol's cost, {results['meta']['date']}")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=300, help="latency probe rounds")
    parser.add_argument("--load-rounds", type=int, default=4, help="closed-loop rounds per router")
    parser.add_argument("--seconds", type=float, default=6.0, help="seconds per closed-loop round")
    parser.add_argument("--output", default=str(RESULTS / "epp_floor"), help="path prefix of the results")
    parser.add_argument("--report-only", action="store_true", help="rewrite the .md and .png from the .json")
    args = parser.parse_args(argv)
    output = Path(args.output)
    if args.report_only:
        results = json.loads(output.with_suffix(".json").read_text())
    else:
        run_source()  # the checkout as the run starts
        results = measure(args.rounds, args.load_rounds, args.seconds)
    write_results_files(results, output, report=write_report, plot=plot, json_too=not args.report_only)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

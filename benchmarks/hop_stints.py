"""Where a router's hop spends its time on a shared core, from the scheduler's own record (issue 41).

real_added_latency says how much a router adds to a cache hit; this says where it goes. One
simulated engine (`kvgate sim`, --engine-ms per request, nothing else) pinned to the last core,
the router and this client on the first, as real_added_latency's split layout. For each router
and shape the client sends the shape straight to the engine and through the router, alternately,
pausing --gap-ms between requests (the engine is then asleep when the router sends one on, and
its wake-up marks the request side's end), while `perf sched record` logs every context switch
and wake-up on the machine for --seconds;
kvgate_testing/sched_stints.py reads the router's stints from that log:

- request side: the request's head waking the router, to the router sending it on;
- response side: the answer waking the router, to the router writing it to the client;
- after the write: to the router switching away (the client, sharing the core, waits for it);
- the router's run time in all, per request.

Beside them, the paired added latency of the requests timed in the same window. A simulated
engine, not a real one: the router's share is the same, and the engine's own time is fixed.
Routers: kvgate's policies, and Envoy as a plain L7 proxy (`envoy`: its own LEAST_REQUEST
balancing, one worker, whose thread is the one timed), the reference real_added_latency holds
kvgate to.

    .venv/bin/python -m benchmarks.hop_stints [--routers least_loaded,kv_aware,envoy]
        [--shapes completion_short_plain,chat_long_stream] [--seconds 3] [--engine-ms 5]

Needs `perf` (Debian: linux-perf) allowed to record scheduler tracepoints (root, or
kernel.perf_event_paranoid <= 1). Writes benchmarks/results/hop_stints.{json,md,png}.
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
import threading
import time
from pathlib import Path

import httpx

from benchmarks.real_added_latency import SHAPES, Shape, pin_tree, timed_request
from kvgate_testing.proc_stats import thread_names
from kvgate_testing.provenance import with_source
from kvgate_testing.routers import ENVOY_ALONE_POLICY, KVGATE_POLICIES, start_router
from kvgate_testing.sched_stints import hop_stints, parse_timehist
from kvgate_testing.sim_fleet import MODEL, EngineFleet

RESULTS = Path(__file__).parent / "results"
STINTS = ("request_side_us", "response_side_us", "after_write_us")
# The reference hop beside kvgate's policies: Envoy as a plain L7 proxy (its own LEAST_REQUEST
# balancing, one worker), as in real_added_latency's head-to-head rounds.
REFERENCES = {"envoy": ENVOY_ALONE_POLICY}


def serving_thread(pid: int) -> int:
    """The thread that moves a router's requests: Envoy's one worker (`wrk:worker_0`), else the
    process's main thread (kvgate's event loop)."""
    workers = [thread for thread, name in thread_names(pid).items() if name.startswith("wrk:")]
    return workers[0] if len(workers) == 1 else pid


class AlternatingClient(threading.Thread):
    """Sends one shape straight and through the router, alternately, until stopped; keeps each
    pair's (end time, direct s, routed s), the order within pairs alternating."""

    def __init__(self, engine_url: str, router_url: str, shape: Shape, gap_s: float) -> None:
        super().__init__(daemon=True)
        self.engine_url, self.router_url, self.shape = engine_url, router_url, shape
        self.gap_s = gap_s
        self.pairs: list[tuple[float, float, float]] = []
        self.error: BaseException | None = None
        self.native_ready = threading.Event()
        self._stop_event = threading.Event()
        self.tid = 0

    def run(self) -> None:
        self.tid = threading.get_native_id()
        self.native_ready.set()
        body = {**self.shape.body(), "model": MODEL}
        try:
            with httpx.Client(timeout=30.0) as client:
                for url in (self.engine_url, self.router_url):
                    timed_request(client, url, self.shape, body)  # cached on the engine, seen once
                turn = 0
                while not self._stop_event.is_set():
                    if turn % 2 == 0:
                        direct = timed_request(client, self.engine_url, self.shape, body)
                        time.sleep(self.gap_s)
                        routed = timed_request(client, self.router_url, self.shape, body)
                    else:
                        routed = timed_request(client, self.router_url, self.shape, body)
                        time.sleep(self.gap_s)
                        direct = timed_request(client, self.engine_url, self.shape, body)
                    time.sleep(self.gap_s)
                    self.pairs.append((time.monotonic(), direct, routed))
                    turn += 1
        except BaseException as exc:  # reported by the main thread
            self.error = exc

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=60)


def record_sched(seconds: float, output: Path) -> str:
    """`perf sched record` for `seconds`, then its `timehist -w` text."""
    subprocess.run(
        ["perf", "sched", "record", "-o", str(output), "--", "sleep", str(seconds)],
        check=True,
        capture_output=True,
        timeout=seconds + 60,
    )
    return subprocess.run(
        ["perf", "sched", "timehist", "-i", str(output), "-w"],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    ).stdout


def measure(
    policy: str, fleet: EngineFleet, engine_pid: int, shapes: list[Shape], args: argparse.Namespace
) -> dict:
    router = start_router(REFERENCES.get(policy, policy), fleet, timeout_s=120.0)
    result: dict = {}
    try:
        pin_tree(router.process.pid, {args.router_core})
        router_tid = serving_thread(router.process.pid)
        for shape in shapes:
            client = AlternatingClient(fleet.engines[0].url, router.url, shape, args.gap_ms / 1000)
            client.start()
            client.native_ready.wait(10)
            os.sched_setaffinity(client.tid, {args.router_core})
            time.sleep(args.warmup_s)
            with tempfile.TemporaryDirectory() as scratch:
                window_start = time.monotonic()
                timehist = record_sched(args.seconds, Path(scratch) / "perf.data")
                window_end = time.monotonic()
            client.stop()
            if client.error is not None:
                raise RuntimeError(f"{policy} {shape.name}: the client failed: {client.error}")
            stints = hop_stints(parse_timehist(timehist), client.tid, router_tid, engine_pid)
            # Pairs that ended inside the window (perf starts a little after window_start).
            window = [(d, r) for end, d, r in client.pairs if window_start <= end <= window_end]
            routed_requests = max(1, len(window))
            result[shape.name] = {
                "stints_us": stints.summary(),
                "router_run_us_per_request": sum(stints.router_run_us) / routed_requests,
                "pairs_in_window": len(window),
                "added_ms_p50": statistics.median((r - d) * 1000 for d, r in window) if window else None,
                "direct_ms_p50": statistics.median(d * 1000 for d, _ in window) if window else None,
            }
    finally:
        router.stop()
    return result


def write_report(results: dict, stem: str) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{stem}.json").write_text(json.dumps(with_source(results), indent=2) + "\n")
    source = results["source"]
    lines = [
        "# Where a router's hop spends its time on a shared core",
        "",
        f"`{results['command']}` at {str(source.get('commit'))[:12]}"
        f"{' (dirty)' if source.get('dirty') else ''}, {results['date']}.",
        "",
        results["layout_note"],
        "Stints from `perf sched record` (kvgate_testing/sched_stints.py): median µs (p25-p75).",
        "",
        "| router | shape | request side | response side | after the write | router run per request "
        "| added ms (p50) | direct ms | pairs |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for policy, shapes in results["routers"].items():
        for shape, entry in shapes.items():
            cells = []
            for name in STINTS:
                stint = entry["stints_us"][name]
                cells.append(
                    "n/a"
                    if stint is None
                    else f"{stint['median']:.0f} ({stint['p25']:.0f}-{stint['p75']:.0f})"
                )
            added = entry["added_ms_p50"]
            direct = entry["direct_ms_p50"]
            lines.append(
                f"| {policy} | {shape} | " + " | ".join(cells)
                + f" | {entry['router_run_us_per_request']:.0f} | "
                + ("n/a" if added is None else f"{added:+.2f}")
                + " | " + ("n/a" if direct is None else f"{direct:.1f}")
                + f" | {entry['pairs_in_window']} |"
            )  # fmt: skip
    lines += [
        "",
        "A streamed answer is two response-side cycles (its head, then its chunks), each counted.",
        "",
    ]
    (RESULTS / f"{stem}.md").write_text("\n".join(lines))
    write_plot(results, RESULTS / f"{stem}.png")


def write_plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, values = [], {name: [] for name in STINTS}
    for policy, shapes in results["routers"].items():
        for shape, entry in shapes.items():
            labels.append(f"{policy}\n{shape.replace('_', ' ', 1).replace('_', chr(10))}")
            for name in STINTS:
                stint = entry["stints_us"][name]
                values[name].append(0.0 if stint is None else stint["median"])
    figure, axis = plt.subplots(figsize=(max(6, 1.8 * len(labels)), 4.5))
    bottom = [0.0] * len(labels)
    for name in STINTS:
        axis.bar(labels, values[name], bottom=bottom, label=name.removesuffix("_us").replace("_", " "))
        bottom = [b + v for b, v in zip(bottom, values[name], strict=True)]
    axis.set_ylabel("µs on the router's core (median stint)")
    axis.set_title("A router's stints per request, from perf sched")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--routers",
        default="least_loaded,kv_aware,envoy",
        help=f"kvgate policies, and the reference hops {', '.join(REFERENCES)}",
    )
    parser.add_argument("--shapes", default="completion_short_plain,chat_long_stream")
    parser.add_argument("--seconds", type=float, default=3.0, help="perf sched record time per shape")
    parser.add_argument("--warmup-s", type=float, default=3.0, help="requests before the recording starts")
    parser.add_argument(
        "--engine-ms", type=float, default=5.0, help="the simulated engine's time per request"
    )
    parser.add_argument(
        "--gap-ms",
        type=float,
        default=2.0,
        help="the client's pause between requests: the engine is asleep when the next one comes, so"
        " the router's sending it on shows as the engine's wake-up",
    )
    parser.add_argument("--stem", default="hop_stints")
    args = parser.parse_args(argv)
    if shutil.which("perf") is None:
        parser.error("needs perf: apt-get install linux-perf (Debian)")
    routers = [name for name in args.routers.split(",") if name]
    unknown = [
        name for name in routers if name.partition("@")[0] not in KVGATE_POLICIES and name not in REFERENCES
    ]
    if unknown:
        parser.error(
            f"unknown router {', '.join(unknown)}; kvgate policies: {', '.join(KVGATE_POLICIES)}; "
            f"references: {', '.join(REFERENCES)}"
        )
    by_name = {shape.name: shape for shape in SHAPES}
    shapes = [by_name.get(name) for name in args.shapes.split(",") if name]
    if None in shapes or not shapes:
        parser.error(f"--shapes takes names among {', '.join(by_name)}")
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        parser.error("needs 2 cores (the engine on one, the router and the client on the other)")
    args.router_core = allowed[0]
    sim_args = [
        "--prefill-us-per-token", "0", "--prefill-overhead-ms", str(args.engine_ms),
        "--decode-ms-per-token", "0",
    ]  # fmt: skip
    fleet = EngineFleet(1, 512, sim_args=sim_args)
    fleet.start()
    try:
        engine_pid = fleet.engine_pid(0)
        pin_tree(engine_pid, {allowed[-1]})
        os.sched_setaffinity(0, {args.router_core})
        measured = {}
        for policy in routers:
            print(f"{policy} ...", file=sys.stderr, flush=True)
            measured[policy] = measure(policy, fleet, engine_pid, shapes, args)  # type: ignore[arg-type]
    finally:
        fleet.stop()
    results = with_source(
        {
            "command": "python -m benchmarks.hop_stints " + " ".join(argv or sys.argv[1:]),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "machine": platform.platform(),
            "layout_note": (
                f"One simulated engine ({args.engine_ms:g} ms per request) pinned to core {allowed[-1]}; "
                f"the router and the client to core {args.router_core}."
            ),
            "routers": measured,
        }
    )
    write_report(results, args.stem)
    print(f"wrote {RESULTS / args.stem}.{{json,md,png}}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

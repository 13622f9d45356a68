"""Discovery under churn: pods join and leave behind the fake Kubernetes API while traffic flows.

`kvgate serve` with `discovery:` watches kvgate_testing/fake_kube_api.py (a real HTTP server on
loopback speaking list + chunked watch). `--pods` pods, each one EndpointSlice naming one of
`--engines` simulated engines (`kvgate sim`; several pods share an engine, each pod its own backend
and KV-event subscription), join over `--duration-s`: each appears not ready, turns ready a second
later, lives a while, turns terminating, and vanishes two seconds after. Meanwhile `--clients`
closed-loop clients send chat requests through the gateway, and an observer polls GET /backends.

Measured, per pod: ready -> routable (from the API change to the first /backends poll that shows
it accepting) and terminating -> drained (to the first poll that shows it draining); both are
bounded below by nothing and above by the poll interval, which the report states. Per request: the
backend that answered (x-kvgate-backend) and its status. `requests_to_terminating` counts requests
sent after their pod was marked terminating in the API and answered by it; `failed_requests` every
answer other than 200, or none.

    .venv/bin/python -m benchmarks.discovery_churn                       # 50 pods, 120 s
    .venv/bin/python -m benchmarks.discovery_churn --pods 10 --duration-s 20 --output /tmp/churn

Writes <output>.json (p99_ready_to_routable_s, p99_terminating_to_drained_s, requests_to_terminating,
failed_requests, ...), .md and .png. Loopback only; it stops what it starts.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from kvgate_testing.fake_kube_api import FakeKubeAPI, endpoint_slice
from kvgate_testing.gateway import start_gateway
from kvgate_testing.processes import exit_on_sigterm
from kvgate_testing.provenance import run_source, with_source
from kvgate_testing.sim_fleet import EVENTS_TOPIC, MODEL, Engine, EngineFleet

NAMESPACE = "llm"
TOKEN = "churn-benchmark-token"
SERVICE = "vllm"
POLL_INTERVAL_S = 0.02


def _log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _slice(pod: str, engine: Engine, ready: bool, terminating: bool = False) -> dict:
    def port(endpoint: str) -> int:
        return urlsplit(endpoint).port or 0

    return endpoint_slice(
        f"{SERVICE}-{pod}",
        SERVICE,
        {pod: {"address": "127.0.0.1", "ready": ready, "terminating": terminating}},
        port(engine.url),
        {"kv-events": port(engine.events_endpoint), "kv-replay": port(engine.replay_endpoint)},
    )


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class Observer(threading.Thread):
    """Polls /backends; the first time each pod was seen accepting, and seen draining."""

    def __init__(self, url: str, stop: threading.Event):
        super().__init__(daemon=True)
        self.url, self.stop = url, stop
        self.accepting_at: dict[str, float] = {}
        self.draining_at: dict[str, float] = {}
        self.polls = 0

    def run(self) -> None:
        with httpx.Client(timeout=10) as client:
            while not self.stop.is_set():
                now = time.monotonic()
                for backend in client.get(f"{self.url}/backends").json()["backends"]:
                    if backend["state"] == "healthy":
                        self.accepting_at.setdefault(backend["name"], now)
                    elif backend["state"] == "draining":
                        self.draining_at.setdefault(backend["name"], now)
                self.polls += 1
                time.sleep(POLL_INTERVAL_S)


def _client(url: str, stop: threading.Event, records: list[tuple[float, str | None, int]], seed: int) -> None:
    rng = random.Random(seed)
    with httpx.Client(timeout=30) as client:
        while not stop.is_set():
            body = {
                "model": MODEL,
                "messages": [
                    {"role": "user", "content": f"Question {rng.randrange(10**9)} about lighthouses?"}
                ],
                "max_tokens": 2,
            }
            sent = time.monotonic()
            try:
                answer = client.post(f"{url}/v1/chat/completions", json=body)
                records.append((sent, answer.headers.get("x-kvgate-backend"), answer.status_code))
            except httpx.HTTPError:
                records.append((sent, None, 0))


def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    api = FakeKubeAPI(NAMESPACE, TOKEN).start()
    fleet = EngineFleet(args.engines, num_gpu_blocks=1024, sim_args=["--prefill-us-per-token", "10"])
    token_file = Path(tempfile.mkstemp(prefix="kvgate-churn-token-")[1])
    token_file.write_text(TOKEN)
    try:
        fleet.start()
        # Schedule: pod i turns ready at i * spacing; lives 30-60 % of the run; the first `--initial`
        # pods are ready before the gateway starts, so that traffic has somewhere to go from the start.
        spacing = args.duration_s * 0.6 / args.pods
        pods = []
        for i in range(args.pods):
            ready_at = 0.0 if i < args.initial else 1.0 + i * spacing
            life = args.duration_s * rng.uniform(0.3, 0.6)
            if i < args.initial:
                life = args.duration_s * rng.uniform(0.5, 0.9)
            pods.append(
                {"name": f"pod-{i:03d}", "engine": fleet.engines[i % args.engines], "ready_at": ready_at,
                 "terminating_at": min(ready_at + life, args.duration_s - 3.0)}
            )  # fmt: skip
        for pod in pods[: args.initial]:
            api.apply(_slice(pod["name"], pod["engine"], ready=True))
        config = {
            "models": [{"name": MODEL}],
            "policy": {"name": "least_loaded"},
            "discovery": {
                "kubernetes": {
                    "namespace": NAMESPACE,
                    "label_selector": f"kubernetes.io/service-name={SERVICE}",
                    "api_server": api.url,
                    "token_file": str(token_file),
                },
                "ports": {"http": "http", "kv_events": "kv-events", "replay": "kv-replay"},
                "kv_events": {"topic": EVENTS_TOPIC},
            },
        }
        with start_gateway(config, timeout_s=120) as gateway:
            stop = threading.Event()
            observer = Observer(gateway.url, stop)
            observer.start()
            deadline = time.monotonic() + 30
            while len(observer.accepting_at) < args.initial and time.monotonic() < deadline:
                time.sleep(0.05)
            records: list[tuple[float, str | None, int]] = []
            traffic_stop = threading.Event()
            clients = [
                threading.Thread(target=_client, args=(gateway.url, traffic_stop, records, seed), daemon=True)
                for seed in range(args.clients)
            ]
            for thread in clients:
                thread.start()
            # The API changes, in time order: (at, pod, what).
            changes = []
            for pod in pods:
                if pod["ready_at"] > 0:
                    changes.append((pod["ready_at"] - 1.0, pod, "appears"))
                    changes.append((pod["ready_at"], pod, "ready"))
                changes.append((pod["terminating_at"], pod, "terminating"))
                changes.append((pod["terminating_at"] + 2.0, pod, "vanishes"))
            changes.sort(key=lambda change: change[0])
            start = time.monotonic()
            applied: dict[tuple[str, str], float] = {}
            for pod in pods[: args.initial]:
                applied[(pod["name"], "ready")] = observer.accepting_at.get(pod["name"], start)
            _log(f"churn: {len(changes)} API changes over {args.duration_s:.0f} s, {args.clients} clients")
            # Traffic stops before the last pod standing turns terminating: a set with no pod in it
            # fails every request (503), which says nothing about discovery.
            last_pod = max(pods, key=lambda pod: pod["terminating_at"])
            for at, pod, what in changes:
                time.sleep(max(0.0, start + at - time.monotonic()))
                if pod is last_pod and what == "terminating":
                    traffic_stop.set()
                    for thread in clients:
                        thread.join(timeout=35)
                if what == "vanishes":
                    api.delete(f"{SERVICE}-{pod['name']}")
                else:
                    api.apply(
                        _slice(
                            pod["name"],
                            pod["engine"],
                            ready=what == "ready",
                            terminating=what == "terminating",
                        )
                    )
                applied[(pod["name"], what)] = time.monotonic()
            time.sleep(2.0)
            stop.set()
            observer.join(timeout=10)
            bug_lines = [line for line in gateway.process.output().splitlines() if "Traceback" in line]
        wall_s = time.monotonic() - start
    finally:
        fleet.stop()
        api.stop()
        token_file.unlink(missing_ok=True)

    ready_to_routable = []
    terminating_to_drained = []
    per_pod = {}
    for pod in pods:
        name = pod["name"]
        entry: dict[str, Any] = {}
        if pod["ready_at"] > 0 and name in observer.accepting_at:
            entry["ready_to_routable_s"] = observer.accepting_at[name] - applied[(name, "ready")]
            ready_to_routable.append(entry["ready_to_routable_s"])
        if name in observer.draining_at and (name, "terminating") in applied:
            entry["terminating_to_drained_s"] = observer.draining_at[name] - applied[(name, "terminating")]
            terminating_to_drained.append(entry["terminating_to_drained_s"])
        entry["never_routable"] = name not in observer.accepting_at
        per_pod[name] = entry
    terminating_at = {name: at for (name, what), at in applied.items() if what == "terminating"}
    to_terminating = [
        (sent, backend)
        for sent, backend, _ in records
        if backend in terminating_at and sent > terminating_at[backend]
    ]
    failed = [(sent - start, status) for sent, _, status in records if status != 200]
    failed_by_status: dict[str, int] = {}
    for _, status in failed:
        failed_by_status[str(status)] = failed_by_status.get(str(status), 0) + 1
    answered_by = {}
    for _, backend, status in records:
        if status == 200 and backend is not None:
            answered_by[backend] = answered_by.get(backend, 0) + 1
    return {
        "p99_ready_to_routable_s": _percentile(ready_to_routable, 0.99),
        "p50_ready_to_routable_s": _percentile(ready_to_routable, 0.5),
        "p99_terminating_to_drained_s": _percentile(terminating_to_drained, 0.99),
        "p50_terminating_to_drained_s": _percentile(terminating_to_drained, 0.5),
        "requests_to_terminating": len(to_terminating),
        # How long after its pod's API change each of those was sent: the watch's propagation
        # window (the gateway cannot know before the event reaches it).
        "requests_to_terminating_sent_after_s": sorted(
            sent - terminating_at[backend] for sent, backend in to_terminating
        ),
        "failed_requests": len(failed),
        "requests": len(records),
        "failed_by_status": failed_by_status,
        # When the first and last failure were sent, seconds from the start of the churn.
        "failed_between_s": [failed[0][0], failed[-1][0]] if failed else None,
        "pods": args.pods,
        "pods_never_routable": sum(1 for entry in per_pod.values() if entry["never_routable"]),
        "pods_routed_to": len(answered_by),
        "gateway_tracebacks": len(bug_lines),
        "meta": {
            "engines": args.engines,
            "clients": args.clients,
            "duration_s": args.duration_s,
            "initial_pods": args.initial,
            "poll_interval_s": POLL_INTERVAL_S,
            "observer_polls": observer.polls,
            "wall_s": wall_s,
            "seed": args.seed,
            "mean_ready_to_routable_s": statistics.fmean(ready_to_routable) if ready_to_routable else None,
        },
        "per_pod": per_pod,
    }


def write_markdown(results: dict[str, Any], path: Path) -> None:
    meta = results["meta"]

    def ms(value: float | None) -> str:
        return "n/a" if value is None else f"{value * 1000:.0f} ms"

    after = results["requests_to_terminating_sent_after_s"]
    sent_after = f" (sent {', '.join(ms(value) for value in after)} after the change)" if after else ""
    lines = [
        "# Discovery under churn (benchmarks/discovery_churn.py)",
        "",
        f"{results['pods']} pods ({meta['initial_pods']} ready at start) over {meta['duration_s']:.0f} s "
        f"behind the fake Kubernetes API, {meta['engines']} simulated engines, {meta['clients']} closed-loop "
        f"clients through `kvgate serve` (least_loaded). Commit {results['source'].get('commit')}"
        f"{' (dirty)' if results['source'].get('dirty') else ''}.",
        "",
        "| measure | value |",
        "| --- | --- |",
        f"| ready -> routable, p50 / p99 | {ms(results['p50_ready_to_routable_s'])} / "
        f"{ms(results['p99_ready_to_routable_s'])} |",
        f"| terminating -> drained, p50 / p99 | {ms(results['p50_terminating_to_drained_s'])} / "
        f"{ms(results['p99_terminating_to_drained_s'])} |",
        f"| requests sent after their pod was marked terminating, answered by it | "
        f"{results['requests_to_terminating']}{sent_after} |",
        f"| failed requests | {results['failed_requests']} of {results['requests']} |",
        f"| pods never seen routable | {results['pods_never_routable']} |",
        f"| pods that answered requests | {results['pods_routed_to']} |",
        "",
        f"Times are from the API change to the first GET /backends poll showing it (polled every "
        f"{meta['poll_interval_s'] * 1000:.0f} ms, {meta['observer_polls']} polls): each includes up to one "
        "poll interval and the poll's own time.",
    ]
    path.write_text("\n".join(lines) + "\n")


def write_plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 4))
    pods = results["per_pod"]
    for key, label in (
        ("ready_to_routable_s", "ready -> routable"),
        ("terminating_to_drained_s", "terminating -> drained"),
    ):
        values = [entry[key] * 1000 for entry in pods.values() if key in entry]
        axis.plot(sorted(values), [i / max(1, len(values) - 1) for i in range(len(values))], label=label)
    axis.set_xlabel("ms (from the API change to the /backends poll that shows it)")
    axis.set_ylabel("fraction of pods")
    axis.set_title(f"Discovery under churn: {results['pods']} pods, {results['requests']} requests")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pods", type=int, default=50)
    parser.add_argument("--initial", type=int, default=4, help="pods ready before the gateway starts")
    parser.add_argument("--engines", type=int, default=8)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--duration-s", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="benchmarks/results/discovery")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    run_source()  # the source as the run starts, not as it ends
    results = with_source(run(args))
    output = Path(args.output)
    output.with_suffix(".json").write_text(json.dumps(with_source(results), indent=2) + "\n")
    write_markdown(results, output.with_suffix(".md"))
    write_plot(results, output.with_suffix(".png"))
    _log(
        f"wrote {output}.json, .md and .png: p99 ready->routable {results['p99_ready_to_routable_s']}, "
        f"to terminating {results['requests_to_terminating']}, failed {results['failed_requests']}"
    )


if __name__ == "__main__":
    main()

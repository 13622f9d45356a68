"""What an idle gateway costs: CPU per second with no requests, for source trees side by side.

An idle gateway still runs its event loop's timers, health checks and, with kv_aware, one KV-event
subscriber thread per engine. On a machine shared with engines (the real-engine tier pins them to
the cores the gateway also uses) that CPU comes out of theirs, and a gateway in front of many
engines pays it per engine.

In one run: simulated engines (`kvgate sim`, KV events on), then for each round and each tree
(`--gateway LABEL=DIR`, as in benchmarks/kv_aware_latency.py), a gateway started on them with
kv_aware (subscribed to every engine's KV events), synced, left alone for `--settle-s`, then its
process CPU (utime + stime, all threads, /proc) over `--seconds` of wall time; the last tree is
also run under `--reference-policy` (no subscribers). Trees alternate within each round.

    .venv/bin/python -m benchmarks.idle_cpu --gateway before=/tmp/kvgate-before --gateway after=. --engines 8
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from kvgate_testing.proc_stats import tree_cpu_seconds
from kvgate_testing.provenance import with_source
from kvgate_testing.source_trees import parse_gateway_trees, start_tree_gateway, tree_revision

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"


def measure(gateways: list[tuple[str, Path, str]], args: argparse.Namespace) -> dict:
    from kvgate_testing.sim_fleet import EngineFleet

    fleet = EngineFleet(args.engines, 512)
    fleet.start()
    samples: dict[str, list[float]] = {label: [] for label, _, _ in gateways}
    try:
        for _ in range(args.rounds):
            for label, tree, policy in gateways:
                process, _ = start_tree_gateway(tree, fleet, "kvgate-idle-", policy)
                try:
                    time.sleep(args.settle_s)
                    used, started = tree_cpu_seconds(process.pid), time.monotonic()
                    time.sleep(args.seconds)
                    elapsed = time.monotonic() - started
                    samples[label].append((tree_cpu_seconds(process.pid) - used) * 1000.0 / elapsed)
                finally:
                    process.stop()
    finally:
        fleet.stop()
    return {
        label: {"cpu_ms_per_s": round(statistics.median(values), 3), "rounds": [round(v, 3) for v in values]}
        for label, values in samples.items()
    }


def write_markdown(results: dict, path: Path) -> None:
    lines = [
        "# Idle gateway CPU",
        "",
        f"Command: `{results['command']}` ({results['machine']}; load average at the end "
        f"{results['load_average_end']}).",
        f"{results['engines']} simulated engines, no requests; each gateway synced, left "
        f"{results['settle_s']} s, then its process CPU over {results['seconds']} s, "
        f"{results['rounds']} rounds alternating the trees.",
        "",
        "| gateway | tree | policy | CPU ms per second, median | rounds |",
        "|---|---|---|---|---|",
    ]
    for label, measured in results["gateways"].items():
        tree = results["trees"][label]
        lines.append(
            f"| {label} | {tree['revision']} | {tree['policy']} | {measured['cpu_ms_per_s']} | "
            f"{', '.join(str(v) for v in measured['rounds'])} |"
        )
    lines += ["", *results.get("notes", [])]
    path.write_text("\n".join(lines) + "\n")


def write_plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(results["gateways"])
    values = [results["gateways"][label]["cpu_ms_per_s"] for label in labels]
    figure, axes = plt.subplots(figsize=(6, 3.5))
    axes.bar(labels, values, color="#4c72b0")
    axes.set_ylabel("CPU ms per second, idle")
    axes.set_title(f"Idle gateway CPU, {results['engines']} simulated engines")
    for position, value in enumerate(values):
        axes.annotate(f"{value:.1f}", (position, value), ha="center", va="bottom")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--gateway", action="append", default=[], metavar="LABEL=DIR", help="a source tree to run"
    )
    parser.add_argument("--engines", type=int, default=8)
    parser.add_argument(
        "--seconds", type=float, default=20.0, help="measured idle time per gateway and round"
    )
    parser.add_argument("--settle-s", type=float, default=3.0, help="idle time before the measurement")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reference-policy", default="least_loaded", help="'' for none")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--name", default="idle_cpu")
    parser.add_argument("--note", action="append", default=[], help="a line for the report's notes")
    args = parser.parse_args(argv)
    try:
        trees = parse_gateway_trees(args.gateway, default=("kvgate", REPO_ROOT))
    except ValueError as exc:
        parser.error(str(exc))
    gateways = [(label, tree, "kv_aware") for label, tree in trees]
    if args.reference_policy:
        label, tree, _ = gateways[-1]
        gateways.append((f"{label}, {args.reference_policy}", tree, args.reference_policy))
    results = {
        "command": "python -m benchmarks.idle_cpu " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs (shared)",
        "engines": args.engines,
        "seconds": args.seconds,
        "settle_s": args.settle_s,
        "rounds": args.rounds,
        "trees": {
            label: {"revision": tree_revision(tree), "policy": policy} for label, tree, policy in gateways
        },
        "gateways": measure(gateways, args),
        "load_average_end": " ".join(f"{v:.2f}" for v in os.getloadavg()),
        "notes": args.note,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(with_source(results), indent=2) + "\n")
    write_markdown(results, args.out / f"{args.name}.md")
    write_plot(results, args.out / f"{args.name}.png")
    for label, measured in results["gateways"].items():
        print(f"{label}: {measured['cpu_ms_per_s']} ms/s idle ({measured['rounds']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

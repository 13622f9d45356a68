"""Side-by-side report of routing-benchmark runs before and after a gateway change (kv_aware's CPU).

Reads pairs of `benchmarks.routing_bench` result files (each run with `--profile kv_aware`) and
writes, per workload and pair: kv_aware's and least_loaded's router CPU per request, TTFT p50/p90,
hit ratio, and the share of kv_aware's GIL-holding profile samples in the KV-event subscriber
threads (`kv-events-*`), as JSON, a markdown table and a bar plot.

    python -m benchmarks.replay_ab_report --pair BEFORE.json AFTER.json [--pair ...] \
        --label "..." --output benchmarks/results/replay_catchup
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvgate_testing.provenance import with_source

POLICIES = ("least_loaded", "kv_aware")
SUBSCRIBER_THREAD = "kv-events-engine-N"
# PromptTokenizer.tokens_for as profiles name it: router/tokenize/prompt.py, or router/tokenize.py in
# results recorded before the tokenizer became a package.
TOKENIZE = ("prompt.py:PromptTokenizer.tokens_for", "tokenize.py:PromptTokenizer.tokens_for")
FORWARD = "forward.py:ProxyEndpoint.serve"


def _subscriber_share(measured: dict[str, Any]) -> float | None:
    threads = dict(measured.get("profile", {}).get("threads", []))
    return threads.get(SUBSCRIBER_THREAD, 0.0) if threads else None


def _on_stack_share(measured: dict[str, Any], function: str | tuple[str, ...]) -> float | None:
    """The share of samples with `function` (file:qualified name, or any of several names it had)
    anywhere on the stack."""
    profile = measured.get("profile")
    if not profile:
        return None
    totals = dict(profile.get("total", []))
    names = (function,) if isinstance(function, str) else function
    return sum(totals.get(name, 0.0) for name in names)


def summarize(pairs: list[tuple[Path, Path]]) -> dict[str, Any]:
    runs = []
    for before_path, after_path in pairs:
        sides = {
            name: json.loads(path.read_text())
            for name, path in (("before", before_path), ("after", after_path))
        }
        for workload in sides["before"]["workloads"]:
            row: dict[str, Any] = {
                "workload": workload,
                "engines": sides["before"]["meta"]["engines"],
                "files": {"before": str(before_path), "after": str(after_path)},
            }
            for side, results in sides.items():
                policies = results["workloads"][workload]["policies"]
                row[side] = {
                    policy: {
                        "router_cpu_ms_per_request": policies[policy]["router_cpu_ms_per_request"],
                        "ttft_p50": policies[policy]["ttft_p50"],
                        "ttft_p90": policies[policy]["ttft_p90"],
                        "hit_ratio": policies[policy]["hit_ratio"],
                    }
                    for policy in POLICIES
                    if policy in policies and "failed" not in policies[policy]
                }
                kv_aware = policies.get("kv_aware", {})
                row[side]["kv_aware_subscriber_thread_share"] = _subscriber_share(kv_aware)
                row[side]["kv_aware_tokenize_share"] = _on_stack_share(kv_aware, TOKENIZE)
                row[side]["kv_aware_forward_share"] = _on_stack_share(kv_aware, FORWARD)
                row[side]["command"] = results["meta"]["command"]
                row[side]["date"] = results["meta"]["date"]
            runs.append(row)
    return {"runs": runs}


def write_markdown(summary: dict[str, Any], label: str, path: Path, notes: str = "") -> None:
    lines = [
        f"# {label}",
        "",
        "Per pair of routing-benchmark runs (same command, same machine, back to back): router CPU",
        "ms per request (the gateway process, all threads, from readiness to the end of the replay),",
        "TTFT p90 in ms, and shares of kv_aware's py-spy samples (GIL holder): in the KV-event",
        "subscriber threads, and (after) with tokenization (`PromptTokenizer.tokens_for`) or",
        "forwarding (`ProxyEndpoint.serve`) on the stack.",
        "",
        "Commands (`before` and `after` differ only in the code they ran):",
        *(f"- `{command}`" for command in sorted({row["before"]["command"] for row in summary["runs"]})),
        "",
        "| engines | workload | least_loaded CPU | kv_aware CPU before | kv_aware CPU after | "
        "least_loaded p90 before / after | kv_aware p90 before / after | kv_aware hit before / after | "
        "subscriber threads before / after | tokenize after | forward after |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in summary["runs"]:
        before, after = row["before"], row["after"]
        least = [side["least_loaded"] for side in (before, after)]
        kv = [side["kv_aware"] for side in (before, after)]
        shares = [side["kv_aware_subscriber_thread_share"] for side in (before, after)]
        lines.append(
            f"| {row['engines']} | {row['workload']} | "
            f"{least[0]['router_cpu_ms_per_request']:.1f} / {least[1]['router_cpu_ms_per_request']:.1f} | "
            f"{kv[0]['router_cpu_ms_per_request']:.1f} | {kv[1]['router_cpu_ms_per_request']:.1f} | "
            f"{least[0]['ttft_p90']:.0f} / {least[1]['ttft_p90']:.0f} | "
            f"{kv[0]['ttft_p90']:.0f} / {kv[1]['ttft_p90']:.0f} | "
            f"{kv[0]['hit_ratio']:.3f} / {kv[1]['hit_ratio']:.3f} | "
            f"{shares[0]:.0%} / {shares[1]:.0%} | {after['kv_aware_tokenize_share']:.0%} | "
            f"{after['kv_aware_forward_share']:.0%} |"
        )
    if notes:
        lines += ["", notes.strip()]
    path.write_text("\n".join(lines) + "\n")


def write_plot(summary: dict[str, Any], label: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary["runs"]
    names = [f"{row['workload']}\n{row['engines']} engines #{index}" for index, row in enumerate(rows, 1)]
    series = {
        "least_loaded (before)": [row["before"]["least_loaded"]["router_cpu_ms_per_request"] for row in rows],
        "kv_aware before": [row["before"]["kv_aware"]["router_cpu_ms_per_request"] for row in rows],
        "kv_aware after": [row["after"]["kv_aware"]["router_cpu_ms_per_request"] for row in rows],
    }
    figure, axis = plt.subplots(figsize=(max(6, 1.6 * len(rows)), 4))
    width = 0.8 / len(series)
    for offset, (name, values) in enumerate(series.items()):
        axis.bar([i + offset * width for i in range(len(rows))], values, width, label=name)
    axis.set_xticks([i + width for i in range(len(rows))], names, fontsize=7)
    axis.set_ylabel("router CPU ms / request")
    axis.set_title(label, fontsize=9)
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", nargs=2, action="append", required=True, metavar=("BEFORE", "AFTER"))
    parser.add_argument("--label", default="kv_aware gateway CPU before and after")
    parser.add_argument("--output", required=True, help="path prefix of the .json, .md and .png")
    parser.add_argument("--notes", help="a markdown file appended to the report (what changed, caveats)")
    args = parser.parse_args(argv)
    summary = summarize([(Path(before), Path(after)) for before, after in args.pair])
    summary["label"] = args.label
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.with_suffix(".json").write_text(json.dumps(with_source(summary), indent=1) + "\n")
    notes = Path(args.notes).read_text() if args.notes else ""
    write_markdown(summary, args.label, output.with_suffix(".md"), notes)
    write_plot(summary, args.label, output.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

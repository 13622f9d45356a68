"""The replicas benchmark's report: averages per replica count, its goals checked against the
measurements, and the results written as markdown and a plot (`python -m benchmarks.replicas_bench`)."""

from __future__ import annotations

from pathlib import Path

from kvgate_testing.routing_report import TARGET_MAX_OVER_MEAN

REPLICA_COUNTS = (1, 2, 4)
# Goals of the issue: hit ratio within 2% of one replica's, load max/mean at most TARGET_MAX_OVER_MEAN.
TARGET_HIT_RATIO_LOSS = 0.02


def averages_by_replicas(results: dict, setup_key: str) -> dict[str, dict[str, float]]:
    """Per replica count, the mean over workloads of hit ratio, load max/mean and TTFT p90."""
    out: dict[str, dict[str, float]] = {"hit_ratio": {}, "max_over_mean_load": {}, "ttft_p90": {}}
    for count in REPLICA_COUNTS:
        label = "1" if count == 1 else f"{count}_{setup_key}"
        runs = [w["setups"].get(label) for w in results["workloads"].values()]
        runs = [run for run in runs if run and "failed" not in run]
        if not runs:
            continue
        for key in out:
            out[key][str(count)] = round(sum(run[key] for run in runs) / len(runs), 4)
    return out


def write_markdown(results: dict, path: Path) -> None:
    meta = results["meta"]
    lines = [
        "# Gateway replicas: one view through the cluster sync",
        "",
        f"{meta['engines']} simulated engines ({meta['num_gpu_blocks']} blocks of {meta['block_size']} "
        f"tokens each), kv_aware replicas; the client sends requests to the replicas in turn. "
        f"{meta['date']}, {meta['machine']}, load average {meta['load_average_start']} at the start, "
        f"{meta['load_average_end']} at the end (the machine is shared: TTFTs move with it). "
        f"Wall time {meta['wall_s']:.0f} s.",
        "",
        f"Command: `{meta['command']}`",
        "",
        "| workload | setup | hit ratio | load max/mean | TTFT p50 (ms) | TTFT p90 (ms) | errors |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, entry in results["workloads"].items():
        for setup, run in entry["setups"].items():
            if "failed" in run:
                lines.append(f"| {name} | {setup} | failed: {run['failed'][:80]} | | | | |")
                continue
            lines.append(
                f"| {name} | {setup} | {run['hit_ratio']:.3f} | {run['max_over_mean_load']:.2f} | "
                f"{run['ttft_p50']:.0f} | {run['ttft_p90']:.0f} | {run['errors']} |"
            )
    lines += ["", "Averages over the workloads (replicas -> value):", ""]
    for key in (
        "hit_ratio_by_replicas",
        "max_over_mean_load_by_replicas",
        "ttft_p90_by_replicas",
        "hit_ratio_by_replicas_sync_off",
        "max_over_mean_load_by_replicas_sync_off",
        "ttft_p90_by_replicas_sync_off",
    ):
        lines.append(f"- `{key}`: {results[key]}")
    lines += ["", "Goals:", ""]
    for check in results["targets"]:
        lines.append(f"- {'met' if check['met'] else 'NOT met'}: {check['what']} ({check['value']})")
    path.write_text("\n".join(lines) + "\n")


def check_targets(results: dict) -> list[dict]:
    checks = []
    one = results["hit_ratio_by_replicas"].get("1")
    for count in ("2", "4"):
        synced = results["hit_ratio_by_replicas"].get(count)
        if one and synced is not None:
            loss = (one - synced) / one
            checks.append(
                {
                    "what": f"{count} synced replicas: hit ratio within 2% of one replica's",
                    "value": f"{synced:.4f} against {one:.4f}, {100 * loss:+.1f}% lost",
                    "met": loss <= TARGET_HIT_RATIO_LOSS,
                }
            )
    for name, entry in results["workloads"].items():
        for setup, run in entry["setups"].items():
            if "sync_off" in setup or "failed" in run:
                continue
            checks.append(
                {
                    "what": f"{name}, {setup}: load max/mean <= {TARGET_MAX_OVER_MEAN}",
                    "value": run["max_over_mean_load"],
                    "met": run["max_over_mean_load"] <= TARGET_MAX_OVER_MEAN,
                }
            )
    return checks


def write_plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("hit_ratio", "hit ratio"),
        ("max_over_mean_load", "load max/mean"),
        ("ttft_p90", "TTFT p90 (ms)"),
    ]
    figure, axes = plt.subplots(1, len(panels), figsize=(15, 4.5), constrained_layout=True)
    counts = [str(c) for c in REPLICA_COUNTS]
    for axis, (key, label) in zip(axes, panels, strict=True):
        for suffix, style in (("", "o-"), ("_sync_off", "x--")):
            values = results[f"{key}_by_replicas{suffix}"]
            xs = [c for c in counts if c in values]
            axis.plot(
                [int(c) for c in xs],
                [values[c] for c in xs],
                style,
                label=f"sync {'off' if suffix else 'on'}",
            )
        if key == "max_over_mean_load":
            axis.axhline(TARGET_MAX_OVER_MEAN, color="gray", linestyle=":", linewidth=1)
        axis.set_xticks([int(c) for c in counts])
        axis.set_xlabel("replicas")
        axis.set_title(f"{label} (mean of the workloads)")
        axis.grid(alpha=0.3)
        axis.legend()
    figure.savefig(path, dpi=110)
    plt.close(figure)

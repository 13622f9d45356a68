"""The routing benchmark's report: its targets checked against the measurements (never tuned), and
the results written as markdown and a plot (`python -m benchmarks.routing_bench` writes them)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from kvgate_testing.provenance import run_source
from kvgate_testing.replay import p90_difference_interval
from kvgate_testing.routers import BASELINE_POLICIES, PEER_POLICIES, SHARED_TIER_POLICY, peer_versions_line

# The targets of issue 4, checked (never tuned) in the report, against the reference placement
# (kvgate_testing/reference_placement.py): a greedy placement that sees the caches, not a bound.
TARGET_REFERENCE_FRACTION = 0.95
# Issue 25's goal under cache pressure, where the reference's greedy placement is far from optimal.
TARGET_REFERENCE_FRACTION_BY_WORKLOAD = {"cache_pressure": 0.90}
TARGET_MAX_OVER_MEAN = 1.3
# A run whose client sent its requests this late (p99, ms) against the open-loop schedule had the
# machine starved of CPU: its TTFTs measure the machine more than the router; the report marks it.
STARVED_SEND_LAG_MS = 100.0


def check_targets(results: dict, ttft_runs: dict[str, dict[str, list]] | None = None) -> list[dict]:
    """One line per target and workload: the measured numbers and kv_aware's verdict on it.

    `ttft_runs[workload][policy]` (one array of TTFTs, ms, per run) adds a 95% bootstrap interval
    to every p90 comparison (`p90_difference_interval`). With it, "TTFT p90 below every peer" is
    `met` only when the interval of kv_aware's p90 minus each peer's lies below zero, `not met` when
    one lies above, and `within noise` when kv_aware is ahead of none of them for certain and behind
    none; without it the point estimates decide. The no-reuse control's "no worse than least_loaded
    within 5%" reads the interval of kv_aware's p90 minus least_loaded's the same way against 5% of
    least_loaded's p90. `met` is True for a verdict of met alone."""
    checks = []
    for name, entry in results["workloads"].items():
        policies = entry["policies"]
        policies = {p: m for p, m in policies.items() if "failed" not in m}
        kv = policies.get("kv_aware")
        if kv is None:
            continue
        samples = (ttft_runs or {}).get(name, {})
        if entry["has_reuse"]:
            reference = entry["reference_hit_ratio"]
            fraction = kv["hit_ratio"] / reference if reference else 0.0
            target_fraction = TARGET_REFERENCE_FRACTION_BY_WORKLOAD.get(name, TARGET_REFERENCE_FRACTION)
            checks.append(_check(name, f"hit ratio >= {target_fraction:.0%} of reference",
                                 f"{kv['hit_ratio']:.3f} / {reference:.3f} = {fraction:.1%}",
                                 fraction >= target_fraction))  # fmt: skip
            for baseline in BASELINE_POLICIES:
                if baseline in policies:
                    theirs = policies[baseline]["hit_ratio"]
                    checks.append(_check(name, f"hit ratio above {baseline}",
                                         f"{kv['hit_ratio']:.3f} vs {theirs:.3f}",
                                         kv["hit_ratio"] > theirs))  # fmt: skip
            peers = {p: policies[p]["ttft_p90"] for p in PEER_POLICIES if p in policies}
            if peers:
                best_peer = min(peers, key=peers.get)
                measured = f"{kv['ttft_p90']:.1f} ms vs best peer {best_peer} {peers[best_peer]:.1f} ms"
                floor = entry.get("floor", {})
                if "ttft_p90" in floor:  # where the p90 comes from; a reference, not part of the verdict
                    measured += f" (floor {floor['ttft_p90']:.1f} ms)"
                intervals = {peer: _kv_aware_interval(samples, peer) for peer in peers}
                if all(bounds is not None for bounds in intervals.values()):
                    measured += "; kv_aware minus peer, 95% interval: " + ", ".join(
                        f"{peer} {low:+.1f}..{high:+.1f}" for peer, (low, high) in intervals.items()
                    )
                    if all(high < 0 for _, high in intervals.values()):
                        verdict = "met"
                    elif any(low > 0 for low, _ in intervals.values()):
                        verdict = "not met"
                    else:
                        verdict = "within noise"
                    checks.append(_check(name, "TTFT p90 below every peer", measured, verdict=verdict))
                else:
                    checks.append(_check(name, "TTFT p90 below every peer", measured,
                                         kv["ttft_p90"] < peers[best_peer]))  # fmt: skip
            checks.append(_check(name, f"max/mean load <= {TARGET_MAX_OVER_MEAN}",
                                 f"{kv['max_over_mean_load']:.2f}",
                                 kv["max_over_mean_load"] <= TARGET_MAX_OVER_MEAN))  # fmt: skip
        elif "least_loaded" in policies:
            least = policies["least_loaded"]
            measured = f"{kv['ttft_p90']:.1f} ms vs {least['ttft_p90']:.1f} ms"
            # Within 5%: policies placing unique prompts alike (round_robin, least_loaded, session)
            # differ by up to ~5% in one run; a smaller gap is noise, not a worse policy.
            margin = least["ttft_p90"] * 0.05
            target = "no worse than least_loaded (TTFT p90, within 5%)"
            bounds = _kv_aware_interval(samples, "least_loaded")
            if bounds is None:
                checks.append(_check(name, target, measured, kv["ttft_p90"] <= least["ttft_p90"] + margin))
                continue
            low, high = bounds
            measured += f"; kv_aware minus least_loaded, 95% interval: {low:+.1f}..{high:+.1f}"
            # As for the peers: met when the whole interval lies under the margin, not met when it
            # lies above it, within noise otherwise.
            verdict = "met" if high <= margin else "not met" if low > margin else "within noise"
            checks.append(_check(name, target, measured, verdict=verdict))
    return checks


def _kv_aware_interval(
    samples: dict[str, list], peer: str, ours: str = "kv_aware"
) -> tuple[float, float] | None:
    """The 95% interval of `ours`'s p90 minus `peer`'s (ms), or None without both's TTFTs."""
    if ours in samples and peer in samples:
        return p90_difference_interval(samples[ours], samples[peer])
    return None


def shared_tier_checks(results: dict, ttft_runs: dict[str, dict[str, list]] | None = None) -> list[dict]:
    """With a shared tier: kv_aware told of it against every other policy of the run (kv_aware not
    told, least_loaded, the peers), on TTFT p90 (with the 95% interval of the difference, read as in
    `check_targets`) and on max/mean load."""
    checks = []
    for name, entry in results["workloads"].items():
        policies = {p: m for p, m in entry["policies"].items() if "failed" not in m}
        ours = policies.get(SHARED_TIER_POLICY)
        if ours is None:
            continue
        samples = (ttft_runs or {}).get(name, {})
        others = [p for p in policies if p != SHARED_TIER_POLICY]
        for other in others:
            measured = f"{ours['ttft_p90']:.1f} ms vs {policies[other]['ttft_p90']:.1f} ms"
            bounds = _kv_aware_interval(samples, other, ours=SHARED_TIER_POLICY)
            target = f"TTFT p90 below {other}"
            if bounds is None:
                checks.append(_check(name, target, measured, ours["ttft_p90"] < policies[other]["ttft_p90"]))
                continue
            low, high = bounds
            measured += f"; difference, 95% interval: {low:+.1f}..{high:+.1f}"
            verdict = "met" if high < 0 else "not met" if low > 0 else "within noise"
            checks.append(_check(name, target, measured, verdict=verdict))
        checks.append(_check(name, f"max/mean load <= {TARGET_MAX_OVER_MEAN}",
                             f"{ours['max_over_mean_load']:.2f}",
                             ours["max_over_mean_load"] <= TARGET_MAX_OVER_MEAN))  # fmt: skip
    return checks


def _check(
    workload: str, target: str, measured: str, met: bool | None = None, verdict: str | None = None
) -> dict:
    verdict = verdict or ("met" if met else "not met")
    return {
        "workload": workload, "target": target, "measured": measured,
        "met": verdict == "met", "verdict": verdict,
    }  # fmt: skip


def engine_cores_remark(meta: dict) -> str:
    if "engine_cores" not in meta:  # simulated engines, or a run before pinning
        return ""
    cores = meta["engine_cores"]
    if not cores:  # runs before engines shared cores left them unpinned
        return ", engines not pinned (fewer cores than engines)"
    listed = ", ".join(map(str, cores))
    if len(set(cores)) < len(cores):
        shared = len(set(cores))
        return f", each engine's processes pinned to one core, {shared} cores shared evenly ({listed})"
    return f", each engine's processes pinned to a core of their own ({listed})"


def _load_remark(meta: dict) -> str:
    loads = [meta.get(key) for key in ("load_average_start", "load_average_end")]
    if any(isinstance(load, (int, float)) and load > (os.cpu_count() or 1) for load in loads):
        return (
            " (above the CPU count: other work on the machine competed with the engines, the routers"
            " and the client)"
        )
    return ""


# What the offline figures beside each workload are; the same words in every report and in the docs.
MODEL_NOTE = (
    "Offline figures, all under one model (requests served one at a time in arrival order, each engine "
    "a vLLM block pool of the run's blocks): reference = kvgate_testing/reference_placement.py, a greedy "
    "longest-cached-prefix placement that sees the caches but not the future, under a 1.3 max/mean load "
    "cap, LRU eviction; not a bound (a policy can beat it). Foresight reference = the same rule with "
    "Belady eviction (kvgate_testing/foresight.py); achievable in the model, not an optimum. Upper bound "
    "= the smaller of Belady on the engines' pooled blocks and an unbounded shared cache: no placement "
    "or eviction beats it in the model; live runs are outside it (concurrent requests), so it is a "
    "yardstick, not a guarantee."
)


def _source_text(source: dict | None) -> str:
    """ " at <commit> (clean tree)" from a results file's `source` (kvgate_testing/provenance.py)."""
    if not source:
        return ""
    if source.get("commit"):
        state = {True: "work tree dirty", False: "clean tree"}.get(source.get("dirty"), "tree state unknown")
        return f" at {source['commit'][:10]} ({state})"
    if source.get("committed_at"):
        return f" (committed at {source['committed_at'][:10]})"
    return ""


def _foresight_text(entry: dict) -> str:
    if "upper_bound_hit_ratio" not in entry:  # results from before the foresight figures
        return ""
    return (
        f", foresight reference {entry['foresight_hit_ratio']:.3f}, upper bound "
        f"{entry['upper_bound_hit_ratio']:.3f} ({entry['upper_bound']['binding']})"
    )


def write_markdown(results: dict, path: Path) -> None:
    meta = results["meta"]
    lines = [
        f"# Routing benchmark: {meta['engines']} {meta.get('engine_kind', 'simulated')} engines",
        "",
        f"Run {meta['date']}{_source_text(results.get('source'))} with `{meta['command']}` "
        f"({meta['wall_s']:.0f} s wall); workloads at scale {meta['scale']}, rate scale "
        f"{meta['rate_scale']}.",
        f"Engines: {meta.get('engine_description', '`kvgate sim`')}, {meta['num_gpu_blocks']} KV blocks of "
        f"{meta['block_size']} tokens each"
        + engine_cores_remark(meta)
        + (f", timing flags `{' '.join(meta['sim_args']) or 'defaults'}`" if meta["sim_args"] else "")
        + f"; caches emptied before every run; client concurrency limit {meta['concurrency']}.",
        f"Machine: {meta['machine']}; load average (1 min) {meta.get('load_average_start', '-')} at the "
        f"start, {meta.get('load_average_end', '-')} at the end" + _load_remark(meta) + ".",
        "Hit ratio = sum cached_tokens / sum prompt_tokens from the responses' usage; TTFT in ms to the "
        "first content chunk; throughput in completed requests/s; load = max/mean requests per engine "
        "(engines' vllm:request_success_total). " + MODEL_NOTE,
        f"(starved): the client itself sent requests more than {STARVED_SEND_LAG_MS:.0f} ms late (p99) "
        "during that run: the shared machine was out of CPU, so its TTFTs say more about the machine "
        "than about the router; hit ratios and loads are still routing decisions.",
        "",
    ]
    if "peer_versions" in meta:
        lines[-1:-1] = [peer_versions_line(meta["peer_versions"], meta.get("peer_versions_note"))]
    for name, entry in results["workloads"].items():
        summary = entry["workload"]
        lines += [
            f"## {name}",
            "",
            f"{entry['description']}: {summary['requests']} requests, {summary['mean_prompt_tokens']:.0f} "
            f"prompt tokens on average, arriving over {summary['arrival_span_s']:.0f} s "
            f"({summary['requests'] / max(summary['arrival_span_s'], 1e-9):.1f} req/s); reference hit "
            f"ratio **{entry['reference_hit_ratio']:.3f}**" + _foresight_text(entry) + ", unbounded shared "
            f"cache {summary['unbounded_cache_hit_ratio']:.3f}.",
            "",
            *_own_run_lines(entry),
            "| policy | hit ratio | missed reuse | of reference | of upper bound | TTFT p50 | TTFT p90 "
            "| TTFT p99 | req/s | max/mean load | router CPU ms/req | errors |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        reference = entry["reference_hit_ratio"]
        bound = entry.get("upper_bound_hit_ratio")
        for policy, measured in entry["policies"].items():
            if "failed" in measured:
                lines.append(f"| {policy} | failed: {measured['failed'][:80]} | | | | | | | | | | |")
                continue
            of_reference = f"{measured['hit_ratio'] / reference:.0%}" if reference else "-"
            of_bound = f"{measured['hit_ratio'] / bound:.0%}" if bound else "-"
            starved = " (starved)" if measured.get("send_lag_p99_ms", 0.0) > STARVED_SEND_LAG_MS else ""
            lines.append(
                f"| {policy}{starved} | {measured['hit_ratio']:.3f} | {missed_reuse_cell(measured)} | "
                f"{of_reference} | {of_bound} | "
                f"{measured['ttft_p50']:.1f} | {measured['ttft_p90']:.1f} | {measured['ttft_p99']:.1f} | "
                f"{measured['throughput']:.2f} | "
                f"{measured['max_over_mean_load']:.2f} | {measured.get('router_cpu_ms_per_request', '-')} | "
                f"{measured['errors']} |"
            )
        lines.append("")
        lines += _missed_reuse_lines(entry)
        lines += _floor_lines(entry)
        repeated = {policy: m["repeats"] for policy, m in entry["policies"].items() if "repeats" in m}
        if repeated:
            lines += [
                f"Over {len(next(iter(repeated.values())))} interleaved runs per policy: hit ratio, TTFT and "
                "loads above pool every request of every run; each run's TTFT p90 (ms) and hit ratio:",
                "",
            ]
            for policy, each in repeated.items():
                runs_text = ", ".join(f"{run['ttft_p90']:.0f} ({run['hit_ratio']:.3f})" for run in each)
                lines.append(f"- {policy}: {runs_text}")
            lines.append("")
        for policy, measured in entry["policies"].items():
            decisions = measured.get("router_decisions")
            if decisions:
                counts = ", ".join(f"`{name}` {count}" for name, count in sorted(decisions.items()))
                runs = len(measured.get("repeats", [])) or 1
                over = f"its {runs} runs" if runs > 1 else "this replay"
                lines += [f"{policy}'s own routing counters over {over}: {counts}", ""]
        for policy, measured in entry["policies"].items():
            profile = measured.get("profile")
            if profile and profile["samples"]:
                threads = ", ".join(f"`{name}` {share:.0%}" for name, share in profile["threads"][:6])
                own = ", ".join(f"`{name}` {share:.0%}" for name, share in profile["own"][:10])
                total = ", ".join(f"`{name}` {share:.0%}" for name, share in profile["total"][:10])
                lines += [
                    f"Profile of the {policy} gateway during this replay "
                    f"(py-spy at 100 Hz, {profile['samples']} samples of the thread holding the GIL):",
                    f"- own time: {own}",
                    f"- on the stack, kvgate's functions: {total}",
                    f"- by thread: {threads}",
                    "",
                ]
    if "shared_tier" in meta:
        lines += [
            "## With the shared tier",
            "",
            f"The engines share one simulated KV tier ({meta['shared_tier']}). Hit ratio counts the prompt "
            "tokens loaded from it (usage's cached_tokens, as vLLM reports a KV connector's hits); the "
            "GPU hit ratio (engines' vllm:prefix_cache_hits) does not. The reference, the foresight "
            "reference and the upper bound know "
            "the engines' GPU caches only.",
            "",
            "| policy | hit ratio | missed reuse | GPU hit ratio | TTFT p50 | TTFT p90 | max/mean load "
            "| requests per engine |",
            "|---|---:|---:|---:|---:|---:|---:|---|",
        ]
        for entry in results["workloads"].values():
            for policy, measured in entry["policies"].items():
                if "failed" in measured:
                    continue
                lines.append(
                    f"| {policy} | {measured['hit_ratio']:.3f} | {missed_reuse_cell(measured)} | "
                    f"{measured.get('engine_hit_ratio', 0):.3f} | "
                    f"{measured['ttft_p50']:.1f} | {measured['ttft_p90']:.1f} | "
                    f"{measured['max_over_mean_load']:.2f} | {measured.get('requests_per_engine', '-')} |"
                )
        lines.append("")
    checks = results.get("targets", [])
    if checks:
        who = f"{SHARED_TIER_POLICY} against the others" if "shared_tier" in meta else "kv_aware"
        lines += [f"## Targets ({who})", "", "| workload | target | measured | met |", "|---|---|---|---|"]
        for check in checks:
            verdict = check.get("verdict", "met" if check["met"] else "not met")
            mark = {"met": "yes", "not met": "**no**"}.get(verdict, verdict)
            lines.append(f"| {check['workload']} | {check['target']} | {check['measured']} | {mark} |")
        lines.append("")
    path.write_text("\n".join(lines))


def missed_reuse_cell(measured: dict) -> str:
    """A run's missed reuse as a share of its prompt tokens: "n/a" where the router counts none (the
    peers, the policies that see no cache), "-" for results from before it was measured."""
    if "missed_reuse_ratio" not in measured:
        return "-"
    ratio = measured["missed_reuse_ratio"]
    return "n/a" if ratio is None else f"{ratio:.3f}"


def _missed_reuse_lines(entry: dict) -> list[str]:
    measured_by = {
        policy: m["missed_reuse_tokens"]
        for policy, m in entry["policies"].items()
        if m.get("missed_reuse_tokens") is not None
    }
    if not measured_by:
        return []
    lines = [
        "Missed reuse = prompt tokens the fleet held cached (any engine, any tier the router credits) "
        "that the chosen engine computed anyway, over the prompt tokens, from the router's own "
        '`kvgate_missed_reuse_tokens_total` (docs/gateway.md, "Missed reuse"); n/a: the router has no '
        "such count (the peers; round_robin, least_loaded and session see no cache). Tokens by reason:",
        "",
    ]
    for policy, tokens in measured_by.items():
        listed = ", ".join(f"`{reason}` {count}" for reason, count in tokens.items()) or "none"
        lines.append(f"- {policy}: {listed}")
    return [*lines, ""]


def _own_run_lines(entry: dict) -> list[str]:
    run = entry.get("run")
    if not run:
        return []
    return [
        f"Measured in a run of its own ({run['date']}, `{run['command']}`, {run['wall_s']:.0f} s wall, "
        f"load average {run.get('load_average_start', '-')} at the start, {run.get('load_average_end', '-')} "
        "at the end) and merged into this file (`--merge-into`): compare its rows with each other.",
        "",
    ]


def merge_into(results: dict, prefix: Path) -> None:
    """Add this run's workloads to the results at `prefix` (.json, rewriting its .md and .png), each
    carrying this run's date, command and load (`run`); the engines must match."""
    target_path = prefix.with_suffix(".json")
    target = json.loads(target_path.read_text())
    fleet_keys = ("engines", "engine_kind", "num_gpu_blocks", "block_size", "sim_args")
    mismatched = [k for k in fleet_keys if target["meta"].get(k) != results["meta"].get(k)]
    if mismatched:
        raise ValueError(f"--merge-into {prefix}: its {', '.join(mismatched)} differ from this run's")
    run = {
        k: results["meta"][k] for k in ("date", "command", "wall_s", "load_average_start", "load_average_end")
    }
    run["source"] = run_source()  # the merged workloads' commit; the file's own `source` is its first run's
    for name, entry in results["workloads"].items():
        target["workloads"][name] = {**entry, "run": run}
    target["targets"] = [c for c in target.get("targets", []) if c["workload"] not in results["workloads"]]
    target["targets"] += [c for c in results.get("targets", []) if c["workload"] in results["workloads"]]
    target_path.write_text(json.dumps(target, indent=1) + "\n")
    write_markdown(target, prefix.with_suffix(".md"))
    write_plot(target, prefix.with_suffix(".png"))


def _floor_lines(entry: dict) -> list[str]:
    floor = entry.get("floor")
    if not floor:
        return []
    if "failed" in floor or floor["errors"]:
        reason = floor.get("failed") or "; ".join(floor["first_errors"])
        return [f"Floor: not measured ({reason[:200]}).", ""]
    return [
        f"Floor (`run_floor`: the reference's placement, each request alone on its engine, none waiting for "
        f"another): hit ratio {floor['hit_ratio']:.3f}, TTFT p50 {floor['ttft_p50']:.1f}, p90 "
        f"{floor['ttft_p90']:.1f}, p99 {floor['ttft_p99']:.1f} ms. A policy's TTFT above it is queueing "
        "behind other requests and prefixes it did not find cached.",
        "",
    ]


def write_plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = list(results["workloads"])
    policies = list(dict.fromkeys(p for entry in results["workloads"].values() for p in entry["policies"]))
    panels = [("hit_ratio", "hit ratio (cached / prompt tokens)"), ("ttft_p90", "TTFT p90 (ms, log scale)"),
              ("max_over_mean_load", "max / mean requests per engine")]  # fmt: skip
    figure, axes = plt.subplots(len(panels), 1, figsize=(14, 11), constrained_layout=True)
    width = 0.8 / max(1, len(policies))
    x = np.arange(len(names))
    colors = plt.get_cmap("tab10")
    for axis, (key, label) in zip(axes, panels, strict=True):
        for i, policy in enumerate(policies):
            values = [results["workloads"][n]["policies"].get(policy, {}).get(key, np.nan) for n in names]
            axis.bar(x + (i - (len(policies) - 1) / 2) * width, values, width, label=policy, color=colors(i))
        if key == "hit_ratio":
            reference = [results["workloads"][n]["reference_hit_ratio"] for n in names]
            axis.hlines(
                reference, x - 0.42, x + 0.42, colors="black", linewidth=2, zorder=3, label="reference"
            )
            bounds = [results["workloads"][n].get("upper_bound_hit_ratio", np.nan) for n in names]
            axis.hlines(bounds, x - 0.42, x + 0.42, colors="black", linestyles=":", linewidth=2, zorder=3,
                        label="upper bound (offline model)")  # fmt: skip
            axis.set_ylim(0, 1)
        if key == "ttft_p90":
            axis.set_yscale("log")  # a starved run can be 50x the others
            floors = [results["workloads"][n].get("floor", {}).get("ttft_p90", np.nan) for n in names]
            axis.hlines(
                floors,
                x - 0.42,
                x + 0.42,
                colors="black",
                linestyles="--",
                linewidth=2,
                zorder=3,
                label="floor",
            )
        if key == "max_over_mean_load":
            axis.axhline(TARGET_MAX_OVER_MEAN, color="gray", linestyle="--", linewidth=1)
        axis.set_xticks(x, names)
        axis.set_ylabel(label)
        axis.grid(axis="y", alpha=0.3)
    meta = results["meta"]
    axes[0].set_title(
        f"Routing quality: {meta['engines']} {meta.get('engine_kind', 'simulated')} engines, "
        f"{meta['num_gpu_blocks']} blocks of {meta['block_size']} tokens each"
    )
    legend: dict[str, Any] = {}  # label -> handle, over every panel: the floor is drawn on the p90 one
    for axis in axes:
        for handle, label in zip(*axis.get_legend_handles_labels(), strict=True):
            legend.setdefault(label, handle)
    figure.legend(list(legend.values()), list(legend), loc="outside right upper", fontsize=9)
    figure.savefig(path, dpi=110)
    plt.close(figure)

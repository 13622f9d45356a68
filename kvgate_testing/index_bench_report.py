"""The prefix-index benchmark's report (`python -m benchmarks.index_bench`): its results dict
written as the short markdown report and the plot committed beside the JSON. The benchmark
measures; this says what it measured, and writes no number of its own."""

from __future__ import annotations

from pathlib import Path

import numpy as np

# The ingest rows in the report's order: results["ingest"] key -> what its events are.
INGEST_LABELS = {
    "prefill_events": "prefill BlockStored",
    "prefill_events_batched": "prefill BlockStored",
    "decode_events": "decode BlockStored",
    "decode_events_batched": "decode BlockStored",
    "decode_events_drained": "decode BlockStored, a drained burst: 16 steps of 32 requests",
    "lone_events_drained": "decode BlockStored, a drained burst: 512 messages of one request",
    "removal_events": "BlockRemoved",
    "removal_events_lone": "BlockRemoved, one evicted block alone in its batch",
    "evicting_decode_steps": "decode steps on a full cache: 32 one-block BlockRemoved + 32 BlockStored",
    "wire_prefill_events": "wire: decode + prefill BlockStored",
    "wire_decode_events_batched": "wire: decode + decode BlockStored",
    "wire_decode_events_lone": "wire: decode + decode BlockStored, alone in its batch",
}


def markdown_report(results: dict, lone_calls_per_timing: int) -> str:
    """The short markdown report committed beside the JSON (`lone_calls_per_timing`: how many lone
    one-event calls the benchmark timed together, which the report states)."""
    ingest = results["ingest"]
    lookup = results["lookup"]
    memory = results["memory"]
    own = results["ingest_own_process"]
    rounds = len(own["after"]["prefill_events"]["rounds"])
    target = results["targets"]["block_events_per_s"]
    lines = [
        "# Prefix index benchmark",
        "",
        f"Command: `{results['command']}` (load average at the end: "
        f"{' '.join(results['machine']['load_average'])} on a 2-core machine shared with other work).",
        f"Index: {memory['after']['engine_blocks']:,} cached 16-token blocks on "
        f"{results['setup']['backends']} backends.",
        f"Side by side in one run: `before` = {results['implementations']['before']}; "
        f"`after` = {results['implementations']['after']}; `after, pure Python` = "
        f"{results['implementations']['after_python']}. Each batch is applied to every index in "
        "turn, so the ratios hold even when the machine's load drifts.",
        "",
        f"Path that applied `after`'s one-block events: **{results['after_ingest_path']}**.",
        "",
        "## Ingest, each index alone in its own process (blocks applied per CPU second, one core)",
        "",
        "A gateway holds one index: here each implementation builds the same index and applies the same "
        "events in a child process of its own, nothing else's dicts in the caches; "
        f"{rounds} rounds, the order of the implementations rotated each round. Median of the rounds, "
        "every round in brackets. The target is read here. The index's million-key dicts are grown "
        "past their next resize before the rows (`grow_past_next_resize`): rebuilding 1.4M keys takes "
        "about 0.1 s, a whole row's time, and would land on whichever row crosses the threshold.",
        "",
        "| events | blocks/event | events/batch | before | after | after, pure Python | after/before "
        "| target 500k blocks/s (after) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, label in INGEST_LABELS.items():
        shape = ingest[name]
        cells = {side: own[side][name]["median"] for side in ("before", "after", "after_python")}
        rounds_of = {
            side: ", ".join(f"{rate / 1000:,.0f}k" for rate in own[side][name]["rounds"]) for side in cells
        }
        met = "met" if cells["after"] >= target else "not met"
        lines.append(
            f"| {label} | {shape['blocks_per_event']} | {shape['events_per_batch']} | "
            + " | ".join(f"{cells[side]:,.0f} ({rounds_of[side]})" for side in cells)
            + f" | {cells['after'] / cells['before']:.2f} | {met} |"
        )
    lines += [
        "",
        "## Ingest side by side (ratios; blocks applied per CPU second, one core)",
        "",
        "Each batch is applied to every index in turn in one process: the ratios hold when the machine's "
        "load drifts, but every apply follows the other indexes' work over their own million-block dicts "
        "and finds the caches cold, so the absolute rates are lower than one index's.",
        "",
        "| events | blocks/event | events/batch | before blocks/s | after blocks/s | after/before "
        "| after, pure Python blocks/s | after/pure Python | after events/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, label in INGEST_LABELS.items():
        entry = ingest[name]
        lines.append(
            f"| {label} | {entry['blocks_per_event']} | {entry['events_per_batch']} | "
            f"{entry['before']['blocks_per_s']:,.0f} | {entry['after']['blocks_per_s']:,.0f} | "
            f"{entry['speedup']:.2f} | {entry['after_python']['blocks_per_s']:,.0f} | "
            f"{entry['after_over_python']:.2f} | {entry['after']['events_per_s']:,.0f} |"
        )
    lines += [
        "",
        "Rows `wire:` start from the msgpack payloads (vLLM >= 0.24 encoding: array batch, map events), "
        "one message per call as the subscriber hands them over: `before` and `after, pure Python` decode "
        "them (msgspec) and apply the events; `after` scans each payload in C and applies its events "
        "undecoded (`IndexWriter.wire_ingest`, as the gateway's subscribers do), decoding only a payload "
        "the scan leaves. The cyclic GC is paused while each side works, as `apply` pauses it: otherwise "
        "collections caused by both sides land on one. The other rows apply already-decoded events. "
        "Decode steps: each step's batch holds one new 16-token block per running request, its parent "
        "the request's block of the step before. Lone events (one per `apply` call, as the subscriber "
        f"makes the call when one message waits) are timed {lone_calls_per_timing} calls at a time on "
        "each index in turn: a timer pair per call costs 0.4 us here. The rows are short (0.1-0.5 s of "
        "CPU), so one dict resize (~0.1 s at 1.4M keys) moves a row.",
        "",
        "## Lookup (all 16 backends, per prompt)",
        "",
        "| prompt | before median (wall) | after median (wall) | after p99 (wall) | after median (CPU) "
        "| per-backend Python walk median (wall) | target (8k) |",
        "|---|---|---|---|---|---|---|",
    ]
    for length, entry in lookup.items():
        goal = f"< {results['targets']['lookup_8k_us']:.0f} us" if length == "8192" else ""
        if goal:
            wall_met = entry["after"]["median_us"] < results["targets"]["lookup_8k_us"]
            cpu_met = entry["after"]["cpu_median_us"] < results["targets"]["lookup_8k_us"]
            goal += f": wall {'met' if wall_met else 'not met'}, CPU {'met' if cpu_met else 'not met'}"
        lines.append(
            f"| {_label(length)} | {entry['before']['median_us']:.0f} us | "
            f"{entry['after']['median_us']:.0f} us | "
            f"{entry['after']['p99_us']:.0f} us | {entry['after']['cpu_median_us']:.0f} us | "
            f"{entry['naive_per_backend_walk']['median_us']:.0f} us | {goal} |"
        )
    lines += [
        "",
        "Side by side, each lookup follows one over the other index's keys, which leaves the "
        "caches cold. `after` timed again on its own (the gateway holds one index):",
        "",
    ]
    for length, entry in lookup.items():
        if "after_alone" in entry:
            alone = entry["after_alone"]
            lines.append(
                f"- {_label(length)}: median {alone['median_us']:.0f} us, p90 {alone['p90_us']:.0f} us, "
                f"p99 {alone['p99_us']:.0f} us (side by side: median {entry['after']['median_us']:.0f} us)"
            )
    floor = results["lone_block_messages"]
    lines += [
        "",
        "## One-block events alone in their batch, from a real ZMQ PUB -> SUB (loopback TCP)",
        "",
        "The receiving thread's CPU time per message, messages queued before it drains them: what "
        "ZMQ and msgpack cost before the index does anything is the floor for this shape. Median of "
        "the rounds (the stages in turn, each round), every round in brackets.",
        "",
        "| work per message | CPU us per message | messages (= blocks) per s |",
        "|---|---|---|",
    ]
    for stage, label in (
        ("recv", "receive the 3 frames (`receive_frames`, as the subscriber does)"),
        ("recv_decode", "+ seq and msgpack decode (`decode_batch`)"),
        ("recv_decode_apply", "+ `IndexWriter.apply` (after), one call per message"),
        ("recv_decode_apply_gc_paused", "the same with the cyclic GC paused during the drain"),
        ("recv_scan_apply", "receive, seq, the payload scanned and applied undecoded (`wire_ingest`)"),
        (
            "subscriber",
            "the real `EventSubscriber` thread (as the gateway wires it: payloads scanned, "
            "one apply per drained run)",
        ),
    ):
        entry = floor[stage]
        spread = ", ".join(f"{value:.1f}" for value in entry["rounds_us"])
        median, rate = entry["us_per_message"], entry["messages_per_s"]
        lines.append(f"| {label} | {median:.1f} ({spread}) | {rate:,.0f} |")
    lines += [
        "",
        "## Memory per cached block (process RSS growth, each implementation alone in a child process; "
        "engine-hash map, node tuples and prefix-key map together)",
        "",
    ]
    for name, entry in memory.items():
        lines.append(
            f"- {name}: {entry['bytes_per_block']:.0f} bytes per block "
            f"({entry['rss_growth_bytes'] / 2**20:.0f} MiB for {entry['engine_blocks']:,} blocks)"
        )
    lines += ["", f"Anchor: {results['anchor']}.", "", "![index benchmark](index_bench.png)", ""]
    return "\n".join(lines)


def _label(name: str) -> str:
    length, _, rest = name.partition("-")
    label = f"{int(length) // 1024}k tokens"
    if rest == "from-list":
        return f"{label}, a Python list"
    if rest == "with-keys":
        return f"{label}, a list, keys passed (before: computes them)"
    if rest == "kv-aware":
        return f"{label}, a list, keys + lookup (kv_aware's two calls)"
    return f"{label}, 1k cached" if rest else label


_PLOT_LOOKUP_LABELS = {
    "8192-from-list": "8k\nlist",
    "8192-with-keys": "8k list\nkeys given",
    "8192-kv-aware": "8k list\nkeys+lookup",
    "8192-new-after-1k": "8k\n1k cached",
}


def plot(results: dict, path: Path) -> None:
    """The lookup latencies and the own-process ingest rates, each against its target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5))
    lengths = list(results["lookup"])
    x = np.arange(len(lengths))
    for offset, name, label in (
        (-0.27, "before", "index before"),
        (0.0, "after", "index after"),
        (0.27, "naive_per_backend_walk", "per-backend Python walk"),
    ):
        left.bar(x + offset, [results["lookup"][n][name]["median_us"] for n in lengths], 0.27, label=label)
    targets = results["targets"]
    lookup_target, events_target = targets["lookup_8k_us"], targets["block_events_per_s"]
    left.axhline(lookup_target, color="red", linestyle="--", label=f"target for 8k: {lookup_target:.0f} us")
    ticks = [_PLOT_LOOKUP_LABELS.get(n, _label(n).replace(", ", "\n")) for n in lengths]
    left.set_xticks(x, ticks, fontsize=7)
    left.set_yscale("log")
    left.set_ylabel("median lookup latency (us, log)")
    left.set_title("Lookup, 16 backends, 1M cached blocks")
    left.legend(fontsize=8)
    kinds = list(INGEST_LABELS)
    labels = ["prefill\n64/event", "prefill\n8/batch", "decode\n1/batch", "decode\n32/batch",
              "drained\n16 x 32", "drained\n512 lone", "removal\n64/event", "removal\n1 lone",
              "evicting\ndecode 32", "wire\nprefill", "wire\n32/batch", "wire\n1 lone"]  # fmt: skip
    x = np.arange(len(kinds))
    for offset, name, label in (
        (-0.27, "before", "before"),
        (0.0, "after_python", "after, pure Python"),
        (0.27, "after", f"after ({results['after_ingest_path']})"),
    ):
        medians = [results["ingest_own_process"][name][k]["median"] for k in kinds]
        right.bar(x + offset, medians, 0.27, label=label)
    right.axhline(
        events_target,
        color="red",
        linestyle="--",
        label=f"target: {events_target / 1000:.0f}k block events/s",
    )
    right.set_xticks(x, labels, fontsize=7)
    right.set_ylabel("blocks applied per CPU second")
    right.set_title("Ingest (one core, process CPU time, each index in its own process, median)")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)

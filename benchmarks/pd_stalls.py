"""Which decisions stalled which streams, from benchmarks/pd_real.py's per-request records.

Each record of a streamed request has its start, TTFT and inter-token gaps (client clock), the
engine that answered and the gateway's decision for it (joined by `x-request-id`). A gap is
stalled by what the decode engine admitted during it: another request's first token arriving from
the same engine within the gap (its prefill, or a split's KV load, ran in that step). The report
counts, per configuration, the gaps over a threshold (the run's always-split ITL p99, so the
configurations are counted against one line) by what landed during them, and how many streams were
decoding when each long prompt's first token arrived (each of them took that stall once), and the
median gap that held exactly one landing, by what landed (what one such step cost the streams).
"""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Any

# A first token arrives slightly after the step that computed it ends: the window past a gap's end.
LANDING_SLACK_S = 0.03


def _cause(record: dict[str, Any]) -> str:
    option = (record.get("decision") or {}).get("option", "?")
    return f"{'long' if record['kind'] == 'long_prompt' else 'decode'} {option}"


def stalls(records: list[dict[str, Any]], threshold_s: float) -> dict[str, Any]:
    ok = [r for r in records if r["ok"]]
    landings = [(r["start_s"] + r["ttft_s"], r) for r in ok]
    spans = [
        (r["start_s"] + r["ttft_s"], r["start_s"] + r["ttft_s"] + sum(r["gaps_s"]), r)
        for r in ok
        if r["kind"] == "decode"
    ]
    over: Counter[str] = Counter()
    # Every gap that held one landing and no other, by what landed: what one such step costs.
    gaps_holding_one: dict[str, list[float]] = {}
    gaps = 0
    for start, _, stream in spans:
        at = start
        for gap in stream["gaps_s"]:
            gaps += 1
            landed_within = [
                _cause(other)
                for landed, other in landings
                if other is not stream
                and other.get("backend") == stream.get("backend")
                and at <= landed <= at + gap + LANDING_SLACK_S
            ]
            if len(landed_within) == 1:
                gaps_holding_one.setdefault(landed_within[0], []).append(gap)
            if gap > threshold_s:
                over[" + ".join(sorted(set(landed_within))) or "nothing landed"] += 1
            at += gap
    decoding_at_long = [
        sum(begin <= landed <= end and s.get("backend") == r.get("backend") for begin, end, s in spans)
        for landed, r in landings
        if r["kind"] == "long_prompt"
    ]
    return {
        "threshold_ms": round(threshold_s * 1000, 1),
        "gaps": gaps,
        "gaps_over": sum(over.values()),
        "gaps_over_by_what_landed": dict(over.most_common()),
        "gap_ms_p50_holding_one_landing": {
            cause: round(statistics.median(values) * 1000, 1)
            for cause, values in sorted(gaps_holding_one.items())
        },
        "streams_decoding_when_a_long_prompt_landed": round(sum(decoding_at_long) / len(decoding_at_long), 2)
        if decoding_at_long
        else None,
    }


def attribute(runs: dict[str, dict[str, Any]], reference: str = "always_split") -> dict[str, Any]:
    """stalls() of every run against the reference run's ITL p99."""
    threshold_ms = runs[reference]["itl_ms"]["p99"]
    if threshold_ms is None:
        return {}
    return {name: stalls(run["requests"], threshold_ms / 1000) for name, run in runs.items()}

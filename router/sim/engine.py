"""The simulated engine's scheduler and timing model: admission, prefill, decode, all by sleeping.

Timing model (every knob a `kvgate sim` flag):
- A request waits (FCFS) until fewer than `max_num_seqs` run and the block pool can reserve its
  prompt and its `max_tokens`.
- Prefill costs `prefill_overhead_ms` plus `prefill_us_per_token` per prompt token not served
  from the cache. Prefills run one after another (the accelerator is busy), and a prompt that hits
  blocks another request is still computing waits until they are ready.
- Each further output token costs `decode_ms_per_token` plus `decode_batch_slope_ms` for every
  other running sequence, so decode slows as the batch grows.
TTFT is therefore queueing + prefill of the uncached tokens: it reflects cache hits.

All waiting is asyncio sleeping, never CPU work, so many simulated engines share two cores.
Output tokens are drawn from a seeded RNG (the prompt and the request's seed decide them), so the
same request gives the same text.
"""

from __future__ import annotations

import asyncio
import random
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np
import xxhash

from router.sim.blocks import BlockPool
from router.sim.events import KVEventPublisher


@dataclass(slots=True)
class TimingModel:
    prefill_us_per_token: float = 50.0
    prefill_overhead_ms: float = 2.0
    decode_ms_per_token: float = 5.0
    decode_batch_slope_ms: float = 0.05

    def prefill_seconds(self, uncached_tokens: int) -> float:
        return (self.prefill_overhead_ms + uncached_tokens * self.prefill_us_per_token / 1000.0) / 1000.0

    def decode_seconds(self, running: int) -> float:
        return (self.decode_ms_per_token + self.decode_batch_slope_ms * max(running - 1, 0)) / 1000.0


@dataclass(slots=True)
class EngineCounters:
    """Totals since start, exported on /metrics under vLLM's names."""

    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of which served from it
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished_requests: int = 0


@dataclass(slots=True)
class GenerationRequest:
    request_id: str
    prompt: np.ndarray  # uint32 token ids
    max_tokens: int
    lora_name: str | None = None
    cache_salt: str | None = None
    seed: int | None = None
    # Filled at admission: prompt tokens served from the prefix cache.
    cached_tokens: int = 0


class InsufficientCapacity(ValueError):
    """The request can never fit this engine (context length or block pool)."""


class SimulatedEngine:
    def __init__(
        self,
        block_pool: BlockPool,
        timing: TimingModel,
        output_vocabulary: np.ndarray,
        max_num_seqs: int = 256,
        publisher: KVEventPublisher | None = None,
    ):
        if len(output_vocabulary) == 0:
            raise ValueError("the output vocabulary is empty")
        self.pool = block_pool
        self.timing = timing
        self.max_num_seqs = max_num_seqs
        self.publisher = publisher
        self.counters = EngineCounters()
        self._output_vocabulary = [int(token) for token in output_vocabulary]
        self._waiting: deque[tuple[GenerationRequest, asyncio.Future[float]]] = deque()
        self._running = 0
        self._prefill_free_at = 0.0

    @property
    def num_running(self) -> int:
        return self._running

    @property
    def num_waiting(self) -> int:
        return sum(1 for _, future in self._waiting if not future.done())

    def check_fits(self, request: GenerationRequest) -> None:
        needed = self.pool.blocks_needed(len(request.prompt) + request.max_tokens)
        if needed > self.pool.num_blocks:
            raise InsufficientCapacity(
                f"the prompt ({len(request.prompt)} tokens) plus max_tokens ({request.max_tokens}) needs "
                f"{needed} KV blocks of {self.pool.block_size} tokens, but this simulated engine has "
                f"{self.pool.num_blocks}; lower max_tokens or raise --num-gpu-blocks-override"
            )

    async def generate(self, request: GenerationRequest) -> AsyncIterator[int]:
        """Yield the output token ids, each at the simulated time it is produced."""
        self.check_fits(request)
        loop = asyncio.get_running_loop()
        first_token_at = await self._admit(request)
        try:
            outputs = self._output_tokens(request)
            await asyncio.sleep(max(first_token_at - loop.time(), 0.0))
            for index, token in enumerate(outputs):
                if index:
                    await asyncio.sleep(self.timing.decode_seconds(self._running))
                self._publish(self.pool.append_token(request.request_id, token, loop.time()))
                self.counters.generation_tokens += 1
                yield token
            self.counters.finished_requests += 1
        finally:
            self.pool.free(request.request_id)
            self._running -= 1
            self._schedule()

    def reset_prefix_cache(self) -> bool:
        events = self.pool.reset()
        if events is None:
            return False
        self._publish(events)
        return True

    # ---- internals ----

    async def _admit(self, request: GenerationRequest) -> float:
        """Wait for a slot and blocks; return the loop time at which the first token is ready."""
        future: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        self._waiting.append((request, future))
        self._schedule()
        try:
            return await future
        except asyncio.CancelledError:
            # Admitted just before the cancel: give the slot and the blocks back.
            if future.done() and not future.cancelled():
                self.pool.free(request.request_id)
                self._running -= 1
                self._schedule()
            raise

    def _schedule(self) -> None:
        loop = asyncio.get_running_loop()
        while self._waiting and self._running < self.max_num_seqs:
            request, future = self._waiting[0]
            if future.done():  # cancelled while waiting
                self._waiting.popleft()
                continue
            now = loop.time()
            admitted = self.pool.allocate(
                request.request_id,
                request.prompt,
                request.max_tokens,
                now,
                request.lora_name,
                request.cache_salt,
            )
            if admitted is None:
                return  # FCFS: the head waits for blocks, and so does everyone behind it
            self._waiting.popleft()
            sequence, events = admitted
            self._publish(events)
            uncached = len(request.prompt) - sequence.cached_tokens
            start = max(now, self._prefill_free_at, sequence.cached_ready_at)
            first_token_at = start + self.timing.prefill_seconds(uncached)
            self._prefill_free_at = first_token_at
            self.pool.mark_prompt_ready(sequence, first_token_at)
            request.cached_tokens = sequence.cached_tokens
            self.counters.prefix_cache_queries += len(request.prompt)
            self.counters.prefix_cache_hits += sequence.cached_tokens
            self.counters.prompt_tokens += len(request.prompt)
            self._running += 1
            future.set_result(first_token_at)

    def _output_tokens(self, request: GenerationRequest) -> list[int]:
        digest = xxhash.xxh3_64_intdigest(request.prompt.tobytes(), seed=request.seed or 0)
        return random.Random(digest).choices(self._output_vocabulary, k=request.max_tokens)

    def _publish(self, events: list) -> None:
        if self.publisher is not None and events:
            self.publisher.publish(events)

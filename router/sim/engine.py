"""The simulated engine's scheduler and timing model: admission, prefill, decode, all by sleeping.

Timing model (every knob a `kvgate sim` flag):
- A request waits (FCFS) until fewer than `max_num_seqs` run and the block pool can reserve its
  prompt and its `max_tokens`.
- Prefill costs `prefill_overhead_ms` plus `prefill_us_per_token` per prompt token not served
  from the cache. Prefills run one after another (the accelerator is busy), and a prompt that hits
  blocks another request is still computing waits until they are ready.
- Each further output token costs `decode_ms_per_token` plus `decode_batch_slope_ms` for every
  other running sequence, so decode slows as the batch grows. With `prefill_blocks_decode`, it
  also waits for the prefills being computed (one accelerator, no chunked prefill): a long prompt
  arriving stalls every stream decoding on that engine.
- With a shared tier (`--shared-tier`, router/sim/shared_store.py), the prompt blocks the GPU pool
  misses but the shared store holds are loaded at `shared_load_us_per_token` each instead of
  recomputed, on the same prefill timeline; once the prompt is computed, the full blocks it computed
  are written to the store (and announced with medium "shared"), each write taking
  `shared_store_us_per_token` per token written before it lands.
- Roles (`--kv-role`, as vLLM's kv_producer / kv_consumer): a `prefill` engine writes the prompt's
  blocks to the shared store before its first token leaves (its answer is sent only once the store
  holds them: a decode engine asked next finds them); a `decode` engine only loads from the store
  and never writes; `both` (the default) loads, and writes in the background after the first token,
  or before it for a prefill leg (`kv_transfer_params: {"do_remote_decode": true}`, vLLM's field).
- With `watch_shared_removals` (`--shared-tier-removals`), the blocks the store loses (evicted,
  expired, deleted) are announced removed in the shared medium, and a restarted store as a clear
  of that medium (`AllBlocksCleared(medium="shared")`); without it the engine never hears of a loss.
TTFT is therefore queueing + prefill of the uncached tokens (+ loads): it reflects cache hits.

All waiting is asyncio sleeping, never CPU work, so many simulated engines share two cores.
Output tokens are drawn from a seeded RNG (the prompt and the request's seed decide them), so the
same request gives the same text.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np
import xxhash

from kvwire import AllBlocksCleared, BlockRemoved, BlockStored, EventPublisher, KVEvent
from router.errors import KvgateError
from router.sim.blocks import BlockPool, chained_block_hashes
from router.sim.shared_store import MEDIUM_SHARED, SharedBlockStore

# What an engine does with the shared tier (`--kv-role`), as vLLM's kv_role names it.
KV_ROLE_BOTH = "both"
KV_ROLE_PREFILL = "prefill"
KV_ROLE_DECODE = "decode"
KV_ROLES = (KV_ROLE_BOTH, KV_ROLE_PREFILL, KV_ROLE_DECODE)


@dataclass(slots=True)
class TimingModel:
    prefill_us_per_token: float = 50.0
    prefill_overhead_ms: float = 2.0
    decode_ms_per_token: float = 5.0
    decode_batch_slope_ms: float = 0.05
    # Loading one token's KV from the shared tier: between a GPU hit (free) and a recompute.
    shared_load_us_per_token: float = 10.0
    # Writing one token's KV into the shared tier (the bytes a real store moves; the simulated one
    # holds only block hashes): spent before the write lands, off the prefill timeline.
    shared_store_us_per_token: float = 0.0
    # True: a decode step waits for the prefills in progress, as on one accelerator that runs a
    # whole prefill in a step (no chunked prefill); what prefill/decode disaggregation removes.
    prefill_blocks_decode: bool = False

    def prefill_seconds(self, uncached_tokens: int, loaded_tokens: int = 0) -> float:
        computed_ms = uncached_tokens * self.prefill_us_per_token / 1000.0
        loaded_ms = loaded_tokens * self.shared_load_us_per_token / 1000.0
        return (self.prefill_overhead_ms + computed_ms + loaded_ms) / 1000.0

    def decode_seconds(self, running: int) -> float:
        return (self.decode_ms_per_token + self.decode_batch_slope_ms * max(running - 1, 0)) / 1000.0


@dataclass(slots=True)
class EngineCounters:
    """Totals since start, exported on /metrics under vLLM's names."""

    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of which served from it
    external_prefix_cache_hits: int = 0  # of which loaded from the shared tier instead
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
    # A prefill leg (`kv_transfer_params.do_remote_decode`): a decode elsewhere loads the prompt from
    # the shared tier next, so even a `both` engine stores it before answering.
    hand_over: bool = False
    # Filled at admission: prompt tokens served from the prefix cache (GPU hits and shared loads),
    # and of those the ones loaded from the shared tier.
    cached_tokens: int = 0
    shared_loaded_tokens: int = 0
    # The simulated time the shared loads took (seconds), as a connector reports its load time.
    shared_load_seconds: float = 0.0
    # A prefill engine's hand-over: prompt tokens the store holds once its answer leaves (None: the
    # engine is no prefill engine), and the (real, wall-clock) seconds its write took.
    stored_tokens: int | None = None
    store_seconds: float = 0.0
    # With a shared tier: the prompt's full-block hashes, and how many leading ones the store holds.
    block_hashes: list[int] | None = None
    shared_prefix_blocks: int = 0


class InsufficientCapacity(KvgateError, ValueError):
    """The request can never fit this engine (context length or block pool)."""


class SimulatedEngine:
    def __init__(
        self,
        block_pool: BlockPool,
        timing: TimingModel,
        output_vocabulary: np.ndarray,
        max_num_seqs: int = 256,
        publisher: EventPublisher | None = None,
        shared_store: SharedBlockStore | None = None,
        kv_role: str = KV_ROLE_BOTH,
        watch_shared_removals: bool = False,
        unannounced_prefix_cache_reset: bool = False,
    ):
        if len(output_vocabulary) == 0:
            raise ValueError("the output vocabulary is empty")
        if kv_role not in KV_ROLES:
            raise ValueError(f"kv_role {kv_role!r} must be one of {', '.join(KV_ROLES)}")
        if kv_role != KV_ROLE_BOTH and shared_store is None:
            raise ValueError(f"a {kv_role} engine hands KV over through a shared tier; give it one")
        if watch_shared_removals and shared_store is None:
            raise ValueError("watching the shared tier's removals needs a shared tier; give it one")
        self.watch_shared_removals = watch_shared_removals
        # A test fault: reset_prefix_cache publishes no AllBlocksCleared, so a router's index keeps
        # crediting the lost blocks (a stale index) and the usage reports fewer cached tokens.
        self.unannounced_prefix_cache_reset = unannounced_prefix_cache_reset
        self._removal_watch: asyncio.Task | None = None
        self.kv_role = kv_role
        self.pool = block_pool
        self.timing = timing
        self.max_num_seqs = max_num_seqs
        self.publisher = publisher
        self.shared_store = shared_store
        # Blocks this engine wrote to the shared store and announced in the shared medium.
        self._announced_shared: set[int] = set()
        self._shared_writes: set[asyncio.Task] = set()
        self.counters = EngineCounters()
        # Seconds spent loading from the shared tier, all requests together (exported on /metrics).
        self.shared_load_seconds = 0.0
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
        if self.shared_store is not None:
            await self._look_up_shared(request)
        first_token_at = await self._admit(request)
        try:
            outputs = self._output_tokens(request)
            await asyncio.sleep(max(first_token_at - loop.time(), 0.0))
            if self.kv_role == KV_ROLE_PREFILL or (
                request.hand_over and self.kv_role == KV_ROLE_BOTH and self.shared_store is not None
            ):
                # The first token leaves only once the store holds the prompt (the hand-over).
                await self._store_computed(request)
            elif self.kv_role == KV_ROLE_BOTH and self.shared_store is not None:
                self._write_shared(request)
            for index, token in enumerate(outputs):
                if index:
                    await asyncio.sleep(self._decode_wait(loop.time()))
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
        self._announced_shared.clear()  # AllBlocksCleared withdraws this engine's shared blocks too
        if not self.unannounced_prefix_cache_reset:
            self._publish(events)
        return True

    def start(self) -> None:
        """Start the background work that runs for the engine's life (inside its event loop): the
        shared tier's removal watch, when asked for."""
        if self.watch_shared_removals and self._removal_watch is None:
            assert self.shared_store is not None
            self._removal_watch = asyncio.get_running_loop().create_task(
                self.shared_store.watch_removals(self)
            )

    # The shared store's removal listener (router/sim/shared_store.py: RemovalListener).

    def announced(self) -> set[int]:
        return set(self._announced_shared)

    def removed(self, block_hashes: list[int]) -> None:
        """Retract the blocks of `block_hashes` this engine announced in the shared medium."""
        gone = [h for h in block_hashes if h in self._announced_shared]
        if gone:
            self._announced_shared.difference_update(gone)
            self._publish([BlockRemoved(block_hashes=gone, medium=MEDIUM_SHARED)])

    def store_restarted(self) -> None:
        """The shared store lost everything: clear the shared medium (the GPU pool keeps its blocks)."""
        self._announced_shared.clear()
        self._publish([AllBlocksCleared(medium=MEDIUM_SHARED)])

    async def close(self) -> None:
        if self._removal_watch is not None:
            self._removal_watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._removal_watch
        for task in list(self._shared_writes):
            task.cancel()
        if self.shared_store is not None:
            await self.shared_store.close()

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
            loaded = self._shared_tokens_to_load(request, sequence.cached_tokens)
            uncached = len(request.prompt) - sequence.cached_tokens - loaded
            start = max(now, self._prefill_free_at, sequence.cached_ready_at)
            first_token_at = start + self.timing.prefill_seconds(uncached, loaded)
            self._prefill_free_at = first_token_at
            self.pool.mark_prompt_ready(sequence, first_token_at)
            request.cached_tokens = sequence.cached_tokens + loaded
            request.shared_loaded_tokens = loaded
            request.shared_load_seconds = loaded * self.timing.shared_load_us_per_token / 1e6
            self.shared_load_seconds += request.shared_load_seconds
            self.counters.prefix_cache_queries += len(request.prompt)
            self.counters.prefix_cache_hits += sequence.cached_tokens
            self.counters.external_prefix_cache_hits += loaded
            self.counters.prompt_tokens += len(request.prompt)
            self._running += 1
            future.set_result(first_token_at)

    def _decode_wait(self, now: float) -> float:
        """Seconds until the next output token: a decode step, after the prefills being computed
        when `prefill_blocks_decode` (they run back to back until `_prefill_free_at`)."""
        wait = self.timing.decode_seconds(self._running)
        if self.timing.prefill_blocks_decode:
            wait += max(0.0, self._prefill_free_at - now)
        return wait

    def _shared_tokens_to_load(self, request: GenerationRequest, gpu_hit_tokens: int) -> int:
        """Prompt tokens past the GPU hit that the shared store holds (the last token is always
        computed, as for a GPU hit)."""
        size = self.pool.block_size
        loadable_blocks = min(request.shared_prefix_blocks, (len(request.prompt) - 1) // size)
        return max(loadable_blocks * size - gpu_hit_tokens, 0)

    async def _look_up_shared(self, request: GenerationRequest) -> None:
        assert self.shared_store is not None
        extra_keys = tuple(key for key in (request.lora_name, request.cache_salt) if key) or None
        request.block_hashes = chained_block_hashes(request.prompt, self.pool.block_size, extra_keys)
        request.shared_prefix_blocks = await self.shared_store.longest_prefix(request.block_hashes)

    async def _store_computed(self, request: GenerationRequest) -> None:
        """Write the prompt's blocks the store lacks to it now (a prefill engine's hand-over: its own
        GPU hits too, which the store may have lost); a store that cannot be reached skips the write
        (the decode engine then recomputes)."""
        hashes = request.block_hashes or []
        held = request.shared_prefix_blocks
        if held < len(hashes):
            started = asyncio.get_running_loop().time()
            if await self._store_shared(request, hashes, held):
                held = len(hashes)
            request.store_seconds = asyncio.get_running_loop().time() - started
        request.stored_tokens = held * self.pool.block_size

    def _write_shared(self, request: GenerationRequest) -> None:
        """Write the prompt's full blocks this engine computed (past its GPU hit and its loads) to
        the shared store in the background (the token stream never waits for it), then announce
        them, as the cache layer announces the chunks it writes to its shared tiers."""
        hashes = request.block_hashes
        if not hashes:
            return
        first_computed = request.cached_tokens // self.pool.block_size
        if all(h in self._announced_shared for h in hashes[first_computed:]):
            return
        task = asyncio.get_running_loop().create_task(self._store_shared(request, hashes, first_computed))
        self._shared_writes.add(task)
        task.add_done_callback(self._shared_writes.discard)

    async def _store_shared(self, request: GenerationRequest, hashes: list[int], first_computed: int) -> bool:
        """Write hashes[first_computed:] and announce them; False when the store took none."""
        assert self.shared_store is not None
        written = hashes[first_computed:]
        if self.timing.shared_store_us_per_token:
            tokens = len(written) * self.pool.block_size
            await asyncio.sleep(tokens * self.timing.shared_store_us_per_token / 1e6)
        if not await self.shared_store.written(written):
            return False
        events: list[KVEvent] = []
        size = self.pool.block_size
        start: int | None = None
        for index in range(first_computed, len(hashes) + 1):
            new = index < len(hashes) and hashes[index] not in self._announced_shared
            if new and start is None:
                start = index
            elif not new and start is not None:
                events.append(self._shared_stored(request, hashes, start, index, size))
                start = None
        self._announced_shared.update(hashes[first_computed:])
        self._publish(events)
        return True

    @staticmethod
    def _shared_stored(
        request: GenerationRequest, hashes: list[int], start: int, end: int, size: int
    ) -> BlockStored:
        extra = [key for key in (request.lora_name, request.cache_salt) if key]
        extra_keys = None
        if start == 0 and extra:
            extra_keys = [extra] + [None] * (end - start - 1)
        return BlockStored(
            block_hashes=hashes[start:end],
            parent_block_hash=hashes[start - 1] if start else None,
            token_ids=request.prompt[start * size : end * size].tolist(),
            block_size=size,
            medium=MEDIUM_SHARED,
            lora_name=request.lora_name,
            extra_keys=extra_keys,
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        )

    def _output_tokens(self, request: GenerationRequest) -> list[int]:
        digest = xxhash.xxh3_64_intdigest(request.prompt.tobytes(), seed=request.seed or 0)
        return random.Random(digest).choices(self._output_vocabulary, k=request.max_tokens)

    def _publish(self, events: list) -> None:
        if self.publisher is not None and events:
            self.publisher.publish(events)

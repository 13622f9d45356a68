"""Scheduler-side planning of the vLLM connector, free of vLLM imports: what to load, what to save.

Rules (the invariants docs/vllm.md names):
- A hit is the longest stored prefix in whole blocks, and never covers the prompt's last token:
  vLLM must compute at least one token to produce logits, so the lookup asks for the prompt's
  whole blocks before its last token, `(len(prompt) - 1) // block_size * block_size`. The store
  answers in chunks: whole ones, and a shorter tail chunk only where a handoff stored that very
  prefix (below), so a plain prompt's hit still ends on a chunk boundary.
- A load writes only blocks past the engine's own prefix-cache hit (`first_block`), and only
  whole blocks (the chunk size is a multiple of the block size).
- A prompt is saved once, at the step where its last prompt token is computed, as its whole
  chunks (the store skips chunks it already holds). Generated tokens are not saved. A handoff's
  prompt is saved up to the prefix its decode engine will look up, tail chunk included: that
  engine then computes at most one block of the prompt instead of up to a chunk (with 256-token
  chunks, ~128 tokens on average, in the step its decoding requests wait on). A prompt of whole
  chunks is the exception: it is saved as its whole chunks (a longer prompt reuses the last).
- Requests whose KV depends on more than tokens and salt (LoRA adapters, multimodal inputs,
  prompt embeddings) are neither looked up nor saved: never a wrong tensor.
- A consumer engine (`saves=False`, vLLM's `kv_consumer`) loads and never saves. A handoff
  request (a producer's prompt whose decode runs on another engine) is saved as a `handoff`:
  the worker stores it before the step that computed it returns (see docs/vllm.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class LoadSpec:
    """Load tokens[:len(token_ids)] of a request into block_ids, starting at block first_block."""

    request_id: str
    token_ids: list[int]
    block_ids: list[int]
    first_block: int
    cache_salt: str | None


@dataclass(slots=True)
class SaveSpec:
    """Save token_ids (a prompt prefix: whole chunks, or a handoff's whole blocks) from block_ids."""

    request_id: str
    token_ids: list[int]
    block_ids: list[int]
    cache_salt: str | None
    # Stored before the step returns (the request's first token waits for it), not in the background.
    handoff: bool = False


@dataclass(slots=True)
class StepPlan:
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


@dataclass(slots=True)
class _RequestState:
    request_id: str
    prompt_token_ids: list[int]
    cache_salt: str | None
    cacheable: bool
    block_ids: list[int] = field(default_factory=list)
    # Tokens the connector loads for this request (a prompt prefix), 0 when none.
    loaded_tokens: int = 0
    pending_load: LoadSpec | None = None
    saved: bool = False
    handoff: bool = False
    # Tokens the connector loads past the engine's own prefix-cache hit.
    external_tokens: int = 0
    # A load of this request failed (some blocks recomputed): it is not looked up again.
    load_failed: bool = False


class SchedulerPlanner:
    """Tracks every request the scheduler has handed the connector and plans each step's transfers."""

    def __init__(self, *, chunk_size: int, block_size: int, saves: bool = True) -> None:
        if chunk_size % block_size:
            raise ValueError(
                f"the cache layer's chunk_size {chunk_size} must be a multiple of vLLM's block size "
                f"{block_size}: loads and saves move whole blocks (set chunk_size in the "
                "CACHELAYER_CONFIG_FILE, or --block-size on vLLM)"
            )
        self.chunk_size = chunk_size
        self.block_size = block_size
        self.saves = saves
        self._requests: dict[str, _RequestState] = {}
        # request id -> (tokens the engine computed itself, tokens the store holds), from the lookup.
        self._lookups: dict[str, tuple[int, int]] = {}

    def lookup_limit(self, num_prompt_tokens: int) -> int:
        """How many leading prompt tokens a hit may cover: whole blocks, never the last token. It
        is also what a handoff saves, so that its decode engine's lookup asks for the same prefix
        (a tail chunk's key covers exactly its tokens)."""
        return max(0, (num_prompt_tokens - 1) // self.block_size * self.block_size)

    def matched_tokens(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        num_computed_tokens: int,
        *,
        cacheable: bool,
        held_tokens: Callable[[Sequence[int]], int],
    ) -> int:
        """Tokens the connector can load beyond the engine's own `num_computed_tokens`.

        `held_tokens(prefix)` asks the store how many leading tokens of `prefix` it holds.
        """
        limit = self.lookup_limit(len(prompt_token_ids))
        if not cacheable or limit <= num_computed_tokens or self.load_failed(request_id):
            self._lookups.pop(request_id, None)
            return 0
        held = min(held_tokens(prompt_token_ids[:limit]), limit)
        held -= held % self.block_size
        self._lookups[request_id] = (num_computed_tokens, held)
        return max(0, held - num_computed_tokens)

    def allocated(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        cache_salt: str | None,
        block_ids: Sequence[int],
        num_external_tokens: int,
        *,
        cacheable: bool,
        handoff: bool = False,
    ) -> None:
        """The scheduler allocated blocks for the request (update_state_after_alloc). `handoff`:
        its prompt is saved before the step that computes it returns."""
        state = self._requests.get(request_id)
        if state is None:
            state = _RequestState(request_id, list(prompt_token_ids), cache_salt, cacheable, handoff=handoff)
            self._requests[request_id] = state
        state.block_ids = list(block_ids)
        local_tokens, _ = self._lookups.pop(request_id, (0, 0))
        if num_external_tokens > 0:
            end = local_tokens + num_external_tokens
            state.loaded_tokens = end
            state.external_tokens = num_external_tokens
            state.pending_load = LoadSpec(
                request_id=request_id,
                token_ids=state.prompt_token_ids[:end],
                block_ids=state.block_ids[: end // self.block_size],
                first_block=local_tokens // self.block_size,
                cache_salt=cache_salt,
            )

    def scheduled(
        self,
        request_id: str,
        *,
        num_computed_tokens: int,
        num_scheduled_tokens: int,
        block_ids: Sequence[int] | None = None,
        new_block_ids: Sequence[int] | None = None,
        plan: StepPlan,
    ) -> None:
        """The request runs this step: `block_ids` replaces its blocks (new or resumed requests),
        `new_block_ids` extends them. Adds its load and, once its prompt is computed, its save."""
        state = self._requests.get(request_id)
        if state is None:
            return
        if block_ids is not None:
            state.block_ids = list(block_ids)
        if new_block_ids:
            state.block_ids.extend(new_block_ids)
        if state.pending_load is not None:
            plan.loads.append(state.pending_load)
            state.pending_load = None
        if state.saved or not state.cacheable or not self.saves:
            return
        prompt_length = len(state.prompt_token_ids)
        if num_computed_tokens + num_scheduled_tokens < prompt_length:
            return
        state.saved = True
        whole_chunks = prompt_length // self.chunk_size * self.chunk_size
        # A handoff: what the decode engine will ask for. That is short of the whole chunks only
        # for a prompt of whole chunks, whose last one is worth more whole (a longer prompt reuses
        # it) than as a tail one block short: such a decode engine computes that chunk, as before.
        end = max(whole_chunks, self.lookup_limit(prompt_length)) if state.handoff else whole_chunks
        if end <= state.loaded_tokens:
            return  # everything saveable came from the store
        plan.saves.append(
            SaveSpec(
                request_id=request_id,
                token_ids=state.prompt_token_ids[:end],
                block_ids=state.block_ids[: end // self.block_size],
                cache_salt=state.cache_salt,
                handoff=state.handoff,
            )
        )

    def take_pending_loads(self, plan: StepPlan) -> None:
        """Add every allocated request's load to `plan`, scheduled this step or not: an
        asynchronous load runs while its request waits off the batch (vLLM's
        WAITING_FOR_REMOTE_KVS), so the request is not among the step's scheduled ones."""
        for state in self._requests.values():
            if state.pending_load is not None:
                plan.loads.append(state.pending_load)
                state.pending_load = None

    def load_result(self, request_id: str, loaded_tokens: int) -> None:
        """The workers loaded `loaded_tokens` of the request past the engine's own hit. Fewer
        than planned: the rest is recomputed, and the request is not looked up again (vLLM asks
        again for a request whose load failed entirely; a store that still claims the prefix
        would fail it again)."""
        state = self._requests.get(request_id)
        if state is None or loaded_tokens >= state.external_tokens:
            return
        state.load_failed = True
        state.loaded_tokens -= state.external_tokens - loaded_tokens

    def load_failed(self, request_id: str) -> bool:
        state = self._requests.get(request_id)
        return state is not None and state.load_failed

    def external_tokens(self, request_id: str) -> int:
        """Tokens the connector was planned to load for the request (0: none, or untracked)."""
        state = self._requests.get(request_id)
        return state.external_tokens if state is not None else 0

    def loaded_tokens(self, request_id: str) -> int:
        """The prompt prefix the request has once its load landed (its own hit and the load)."""
        state = self._requests.get(request_id)
        return state.loaded_tokens if state is not None else 0

    def tracks(self, request_id: str) -> bool:
        return request_id in self._requests

    def finished(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
        self._lookups.pop(request_id, None)

    @property
    def num_tracked(self) -> int:
        return len(self._requests)

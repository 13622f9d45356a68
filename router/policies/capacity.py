"""Each engine's KV capacity and how long a prefix survives there, as kv_aware's placement sees them.

When the fleet holds fewer prefixes than the traffic reuses, where a request goes decides what gets
evicted. An engine's prefix cache is full once warm and evicts the least recently used unreferenced
block for every new block it stores (vLLM's free-block queue). A block used now is therefore
evicted once the blocks ahead of it in that order are gone: each new block stored takes one, and each
cache hit on an older block moves that block behind it. So its survival time lies between

    capacity / (prompt tokens touched per second)   (every touch was of an older block: the earliest)
    capacity / (new tokens stored per second)        (no hit moved an older block: the latest)

This module keeps, per backend:
- its capacity in tokens: the configured one where the operator gave it, else, once the engine has
  evicted (a BlockRemoved since its cache was last cleared: an engine removes cached blocks only to
  make room), the high-water mark of the tokens its KV events show it holding (the prefix index's
  count, stored minus removed); unknown (0) while it never had to evict, and reset when the engine
  clears its cache (AllBlocksCleared);
- the prompt tokens routed to it, decayed with a 30 s half-life: what it touches per second;
and, for all backends, a sample of the router keys of the prompts routed lately (`seen_before`).

kv_aware lets a prediction lapse after the earliest survival (a prompt just routed is surely still
there only that long); sends a cold prompt whose prefix was routed before (reused, and evicted since)
where its earliest survival is longest; and spreads new cold prompts by the latest, per token of
capacity: the prompt tokens it placed on each engine to compute lately (its `placements`) over the
engine's capacity (docs/index.md, "Cache pressure").
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from router.recent_keys import RecentKeys

# Tokens touched decay with this half-life: the window of kv_aware's placed prefill tokens.
RATE_HALF_LIFE_S = 30.0
# The index's counters (whether an engine evicted, or cleared its cache) are read under the lock its
# event ingest holds, at most this often per backend.
CHECK_INTERVAL_S = 1.0
# Prefixes seen: every SEEN_KEY_STRIDE-th router key of each routed prompt (64 tokens apart), the
# last MAX_SEEN_KEYS / 2 to MAX_SEEN_KEYS of them (a few thousand prompts), to bound memory.
SEEN_KEY_STRIDE = 4
MAX_SEEN_KEYS = 65_536


@dataclass(slots=True)
class _BackendModel:
    high_water: int = 0  # most tokens the index said this backend held since its cache was cleared
    full: bool = False  # it evicted since then, so the high-water mark is its capacity
    cleared_events: int = 0  # the index's AllBlocksCleared count when the model was last reset
    removed_events: int = 0  # the index's BlockRemoved count then
    checked_at: float = -math.inf  # when the index's counters were last read
    touched: float = 0.0  # prompt tokens routed here, decayed
    at: float = 0.0  # when `touched` was last decayed


class CapacityModel:
    """Per-backend capacity (configured, or the high-water mark of held tokens once it evicts) and
    the rate at which it touches tokens: how long a prefix surely survives on each backend."""

    def __init__(
        self,
        kv_index: Any,
        configured_tokens: dict[str, int] | None = None,
        half_life_s: float = RATE_HALF_LIFE_S,
        max_seen_keys: int = MAX_SEEN_KEYS,
        check_interval_s: float = CHECK_INTERVAL_S,
    ) -> None:
        self.kv_index = kv_index
        self.check_interval_s = check_interval_s
        self._seen = RecentKeys(max_seen_keys)
        self.configured_tokens = dict(configured_tokens or {})
        self._rate = math.log(2) / half_life_s
        self._backends: dict[str, _BackendModel] = {}

    def _model(self, backend: str) -> _BackendModel:
        model = self._backends.get(backend)
        if model is None:
            model = self._backends[backend] = _BackendModel()
        return model

    def held_tokens(self, backend: str) -> int:
        return 0 if self.kv_index is None else int(self.kv_index.held_tokens(backend))

    def capacity_tokens(self, backend: str) -> int:
        """The configured capacity, else, once the backend has evicted, the most tokens its events
        showed it holding since its cache was last cleared; 0 while unknown (it never filled)."""
        configured = self.configured_tokens.get(backend)
        if configured is not None:
            return configured
        model = self._model(backend)
        held = self.held_tokens(backend)
        index = self.kv_index
        # The index's counters are a locked read (the event ingest holds that lock): taken at most
        # every check_interval_s per backend, and once the backend is known full only when it
        # suddenly holds far less (a cleared cache; evictions alone keep it near the mark).
        now = time.monotonic()
        due = now - model.checked_at >= self.check_interval_s
        if index is not None and due and (not model.full or held < model.high_water // 2):
            model.checked_at = now
            stats = index.stats(backend)
            if stats is not None and stats.cleared_events != model.cleared_events:
                # The engine emptied its cache (restart, reset): what it held before says nothing now.
                model.cleared_events = stats.cleared_events
                model.removed_events = stats.removed_events
                model.high_water = 0
                model.full = False
            elif stats is not None and stats.removed_events > model.removed_events:
                model.full = True
        model.high_water = max(model.high_water, held)
        return model.high_water if model.full else 0

    @property
    def rate(self) -> float:
        """The decay rate (per second) of the tokens-touched sums."""
        return self._rate

    def _decayed(self, model: _BackendModel, now: float) -> float:
        return math.exp(-self._rate * max(0.0, now - model.at))

    def touched_per_s(self, backend: str, now: float) -> float:
        """Prompt tokens routed to the backend per second lately: a steady flow of x a second
        keeps the decayed sum at x / rate."""
        model = self._model(backend)
        return model.touched * self._decayed(model, now) * self._rate

    def on_routed(self, backend: str, prompt_tokens: int, now: float, keys: list[int] | None = None) -> None:
        """A prompt of `prompt_tokens` (router keys `keys`) went to `backend`: every one of its
        blocks, cached there or not, is now among the most recently used."""
        model = self._model(backend)
        model.touched = model.touched * self._decayed(model, now) + prompt_tokens
        model.at = now
        if keys:
            self._seen.add(keys[SEEN_KEY_STRIDE - 1 :: SEEN_KEY_STRIDE])

    def seen_before(self, keys: list[int]) -> bool:
        """Whether a prefix of at least SEEN_KEY_STRIDE router blocks of this prompt was routed
        lately (to any backend)."""
        stride = SEEN_KEY_STRIDE
        return len(keys) >= stride and keys[stride - 1] in self._seen

    def earliest_survival_s(self, backend: str, now: float) -> float:
        """How long a block used now surely stays on the backend: its capacity over the tokens it
        touches per second; inf while its capacity is unknown (it never had to evict) or idle."""
        capacity = self.capacity_tokens(backend)
        rate = self.touched_per_s(backend, now)
        if capacity <= 0 or rate <= 0:
            return math.inf
        return capacity / rate

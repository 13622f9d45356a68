"""Each engine's KV capacity and how long a prefix survives there, as kv_aware's placement sees them.

When the fleet holds fewer prefixes than the traffic reuses, where a new prefix goes decides what it
evicts. An engine's prefix cache is full once warm, and it evicts least recently used blocks first
(vLLM's free-block queue). Under LRU a block stays cached until the engine has touched its whole
capacity's worth of other blocks since the block's last use: blocks it computes and stores, and
blocks it serves from cache, which become the most recently used again. So a block used now on
engine E survives about

    survival(E) = capacity(E) / (prompt tokens E touches per second)

and the blocks a new prompt evicts on E are the ones E last touched about survival(E) ago. The
engine with the longest survival is both where a new prefix lasts longest and where it displaces
the stalest blocks. An engine serving many cache hits on a few hot prefixes has a short survival
even when it computes little: a cold prompt sent there pushes out what its hits will need next.

This module keeps, per backend:
- its capacity in tokens: the configured one where the operator gave it, else, once the engine has
  evicted (a BlockRemoved since its cache was last cleared: an engine removes cached blocks only to
  make room), the high-water mark of the tokens its KV events show it holding (the prefix index's
  count, stored minus removed); unknown (0) while it never had to evict, and reset when the engine
  clears its cache (AllBlocksCleared);
- the prompt tokens routed to it, decayed (what it touches per second).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

# Tokens touched decay with this half-life: the same window as kv_aware's placed prefill tokens.
TOUCHED_HALF_LIFE_S = 30.0


@dataclass(slots=True)
class _BackendModel:
    high_water: int = 0  # most tokens the index said this backend held since its cache was cleared
    full: bool = False  # it evicted since then, so the high-water mark is its capacity
    cleared_events: int = 0  # the index's AllBlocksCleared count when the model was last reset
    removed_events: int = 0  # the index's BlockRemoved count then
    touched: float = 0.0  # prompt tokens routed here, decayed
    touched_at: float = 0.0


class CapacityModel:
    """Per-backend capacity (configured, or the high-water mark of held tokens once it evicts) and
    the rate at which it touches tokens: how long a prefix survives on each backend."""

    def __init__(
        self,
        kv_index: Any,
        configured_tokens: dict[str, int] | None = None,
        half_life_s: float = TOUCHED_HALF_LIFE_S,
    ) -> None:
        self.kv_index = kv_index
        self.configured_tokens = dict(configured_tokens or {})
        self._rate = math.log(2) / half_life_s
        self._backends: dict[str, _BackendModel] = {}

    def _model(self, backend: str) -> _BackendModel:
        model = self._backends.get(backend)
        if model is None:
            model = self._backends[backend] = _BackendModel()
        return model

    def forget(self, backend: str) -> None:
        self._backends.pop(backend, None)

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
        # The index's counters (a locked read) only until the backend is known full, or when it
        # suddenly holds far less (a cleared cache; evictions alone keep it near the mark).
        if index is not None and (not model.full or held < model.high_water // 2):
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

    def touched_tokens(self, backend: str, now: float) -> float:
        """Prompt tokens routed to the backend lately (decayed with the model's half-life)."""
        model = self._model(backend)
        return model.touched * math.exp(-self._rate * max(0.0, now - model.touched_at))

    def touched_per_s(self, backend: str, now: float) -> float:
        """Prompt tokens routed to the backend per second lately: a steady flow of x a second
        keeps the decayed sum at x / rate."""
        return self.touched_tokens(backend, now) * self._rate

    def on_routed(self, backend: str, prompt_tokens: int, now: float) -> None:
        """A prompt of `prompt_tokens` went to `backend`: every one of its blocks, cached or not, is
        now the most recently used there."""
        model = self._model(backend)
        model.touched = self.touched_tokens(backend, now) + prompt_tokens
        model.touched_at = now

    def survival_s(self, backend: str, now: float) -> float:
        """How long a block used now stays on the backend: its capacity over the tokens it touches
        per second; inf while its capacity is unknown (it never had to evict) or nothing is sent."""
        capacity = self.capacity_tokens(backend)
        rate = self.touched_per_s(backend, now)
        if capacity <= 0 or rate <= 0:
            return math.inf
        return capacity / rate

"""What knowing the future is worth to a workload's hit ratio, under the reference's offline engine model.

The model (kvgate_testing/reference_placement.py): requests served one at a time in arrival order, each
engine a vLLM block pool of `num_gpu_blocks` blocks (`EngineBlockCache`), a request's hit its longest
cached prefix of full blocks, less the last prompt token. Two numbers beside the reference:

- `foresight_placement`, a **foresight reference**: the reference's greedy rule and load cap, with each
  engine evicting the unreferenced block its own future requests need last (Belady's rule,
  `BeladyBlockCache`). Placements are first chosen with every engine evicting by the whole workload's
  future, then each is replayed with every engine evicting by its own future requests; the best of those
  and of the reference's placements replayed so is kept. It is achievable under the model (a lower bound
  on the best placement's hit ratio), not an optimum: placement under a load cap is a hard search, and
  Belady's rule is optimal for single pages, not for prefixes of blocks reserved a request at a time.

- `upper_bound`, an **upper bound** under the model, for any placement (load cap or not) and any
  eviction: the smaller of (a) the unbounded shared cache's hit ratio (`Workload.summary`) and (b) the
  hits of Belady's MIN on one pool of engines x num_gpu_blocks blocks over the sequence of every prompt's
  full blocks (`belady_hits`). Why (b) bounds: while request i runs on engine e, the union of all engines'
  caches holds at most engines x num_gpu_blocks blocks including all of request i's, and request i's hit
  blocks were in the union before it; so the union's contents are those of one demand-paged cache of
  that size on that sequence, whose hits MIN maximizes, and a request's hit tokens never exceed its
  present blocks x block_size. It does not bound a live run outside the model: concurrent requests
  reorder admissions and share blocks in flight.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

from kvgate_testing.reference_placement import (
    SLACKS,
    EngineBlockCache,
    PlacementResult,
    greedy_placement,
    request_block_keys,
)
from kvgate_testing.workloads import Workload, block_keys, cacheable_hit_tokens

# Next-use ranks of an unreferenced slot's content, above any request position: Belady's rule takes
# an empty slot first, then one whose content no later request uses, then the one used last.
_EMPTY = 1 << 62
_NEVER = 1 << 61


class BeladyBlockCache(EngineBlockCache):
    """An engine's block pool that reuses the unreferenced slot whose content is needed last.

    `uses[key]`: the sorted workload positions of the requests that would read `key` (in their usable
    prefix) on this engine; `serve`'s `request_tag` must be the request's workload position."""

    def __init__(self, num_blocks: int, block_size: int, uses: Mapping[object, list[int]]):
        super().__init__(num_blocks, block_size)
        self._uses = uses
        self._now = -1
        self._free_content: dict[int, object | None] = dict.fromkeys(range(num_blocks))
        self._epoch = [0] * num_blocks  # a slot's heap entries are valid for its current epoch only
        self._heap: list[tuple[int, int, int, int]] = [(-_EMPTY, slot, slot, 0) for slot in range(num_blocks)]
        self._released = num_blocks  # ties (e.g. two contents never used again): the slot freed first

    def serve(self, prompt_keys: list[bytes], prompt_tokens: int, max_tokens: int, request_tag: int) -> int:
        self._now = request_tag
        return super().serve(prompt_keys, prompt_tokens, max_tokens, request_tag)

    def next_use(self, content: object | None) -> int:
        if content is None:
            return _EMPTY
        positions = self._uses.get(content)
        if not positions:
            return _NEVER
        after = bisect.bisect_right(positions, self._now)
        return positions[after] if after < len(positions) else _NEVER

    def _claim(self, slot: int) -> None:
        del self._free_content[slot]
        self._epoch[slot] += 1

    def _take(self) -> tuple[int, object | None]:
        while True:
            _, _, slot, epoch = heapq.heappop(self._heap)
            if epoch == self._epoch[slot] and slot in self._free_content:
                self._epoch[slot] += 1
                return slot, self._free_content.pop(slot)

    def _release(self, slot: int, content: object | None) -> None:
        self._free_content[slot] = content
        self._epoch[slot] += 1
        heapq.heappush(self._heap, (-self.next_use(content), self._released, slot, self._epoch[slot]))
        self._released += 1


def belady_hits(accesses: Sequence[Hashable], capacity: int) -> int:
    """Hits of Belady's MIN (on a miss with the cache full, evict the item used again last) on one cache
    of `capacity` items: the most hits any demand-paged cache of that size gets on this sequence."""
    if capacity < 1:
        return 0
    following = [math.inf] * len(accesses)  # position of each access's item's next access
    last_seen: dict[Hashable, int] = {}
    for position in range(len(accesses) - 1, -1, -1):
        item = accesses[position]
        following[position] = last_seen.get(item, math.inf)
        last_seen[item] = position
    next_use_of: dict[Hashable, float] = {}  # what the cache holds -> when it is next read
    farthest: list[tuple[float, int, Hashable]] = []  # (-next use, position, item), stale entries skipped
    hits = 0
    for position, item in enumerate(accesses):
        if item in next_use_of:
            hits += 1
        elif len(next_use_of) >= capacity:
            while True:
                negative_use, _, victim = heapq.heappop(farthest)
                if next_use_of.get(victim) == -negative_use:
                    del next_use_of[victim]
                    break
        next_use_of[item] = following[position]
        heapq.heappush(farthest, (-following[position], position, item))
    return hits


@dataclass(slots=True)
class UpperBound:
    hit_ratio: float  # the smaller of the two below
    pooled_belady_hit_ratio: float
    unbounded_hit_ratio: float
    pooled_blocks: int

    @property
    def binding(self) -> str:
        if self.pooled_belady_hit_ratio < self.unbounded_hit_ratio:
            return "pooled Belady"
        return "unbounded cache"


def upper_bound(workload: Workload, engines: int, num_gpu_blocks: int, block_size: int = 16) -> UpperBound:
    """The upper bound of the module docstring: min(unbounded shared cache, Belady on the pooled blocks)."""
    accesses: list[bytes] = []
    seen: set[bytes] = set()
    unbounded_tokens = 0  # as Workload.summary counts them, unrounded
    for request in workload.requests:
        keys = block_keys(request.prompt_token_ids, block_size)
        matched = 0
        while matched < len(keys) and keys[matched] in seen:
            matched += 1
        unbounded_tokens += cacheable_hit_tokens(matched, request.prompt_tokens, block_size)
        seen.update(keys)
        accesses += keys
    prompt_tokens = max(1, sum(request.prompt_tokens for request in workload.requests))
    pooled = engines * num_gpu_blocks
    belady = belady_hits(accesses, pooled) * block_size / prompt_tokens
    unbounded = unbounded_tokens / prompt_tokens
    return UpperBound(min(belady, unbounded), belady, unbounded, pooled)


def foresight_placement(
    workload: Workload,
    engines: int,
    num_gpu_blocks: int,
    block_size: int = 16,
    max_over_mean: float = 1.3,
) -> PlacementResult:
    """The foresight reference of the module docstring; keeps the reference's load cap."""
    keys = request_block_keys(workload, block_size)
    usable = [
        request_keys[: (request.prompt_tokens - 1) // block_size]
        for request, request_keys in zip(workload.requests, keys, strict=True)
    ]
    everyone = _uses(usable, range(len(usable)))
    placements = []
    for slack in SLACKS:
        # Eviction by the whole workload's future while placing; with LRU, the reference's own placements.
        placements.append(greedy_placement(
            workload, keys, [BeladyBlockCache(num_gpu_blocks, block_size, everyone) for _ in range(engines)],
            max_over_mean, slack,
        ).engine_of_request)  # fmt: skip
        placements.append(greedy_placement(
            workload, keys, [EngineBlockCache(num_gpu_blocks, block_size) for _ in range(engines)],
            max_over_mean, slack,
        ).engine_of_request)  # fmt: skip
    results = []
    for slack, engine_of_request in zip([s for s in SLACKS for _ in (0, 1)], placements, strict=True):
        results.append(_replay_with_own_futures(workload, keys, usable, engine_of_request, engines,
                                                num_gpu_blocks, block_size, slack))  # fmt: skip
    return max(results, key=lambda result: result.hit_ratio)


def _uses(usable: list[list[bytes]], positions: Sequence[int] | range) -> dict[object, list[int]]:
    uses: dict[object, list[int]] = {}
    for position in positions:  # ascending, so every list comes out sorted
        for key in usable[position]:
            uses.setdefault(key, []).append(position)
    return uses


def _replay_with_own_futures(
    workload: Workload,
    keys: list[list[bytes]],
    usable: list[list[bytes]],
    engine_of_request: list[int],
    engines: int,
    num_gpu_blocks: int,
    block_size: int,
    slack: int | None,
) -> PlacementResult:
    """A fixed placement served with each engine evicting by the requests this placement sends it."""
    caches = [
        BeladyBlockCache(
            num_gpu_blocks, block_size,
            _uses(usable, [i for i, placed in enumerate(engine_of_request) if placed == engine]),
        )
        for engine in range(engines)
    ]  # fmt: skip
    cached = 0
    assigned = [0] * engines
    for position, (request, engine) in enumerate(zip(workload.requests, engine_of_request, strict=True)):
        cached += caches[engine].serve(keys[position], request.prompt_tokens, request.max_tokens, position)
        assigned[engine] += 1
    prompt_tokens = sum(request.prompt_tokens for request in workload.requests)
    return PlacementResult(
        cached / max(1, prompt_tokens), cached, prompt_tokens, assigned, slack, list(engine_of_request)
    )

"""The reference hit ratio of a workload: a greedy placement that sees every engine's cache, offline.

What it is: a greedy, longest-cached-prefix placement under a load cap, simulated offline. Requests are
taken in arrival order, one at a time. Each engine is modelled as a vLLM block pool of the benchmark's
capacity and block size (`EngineBlockCache`): only full blocks are cached, a prompt always computes its
last token, a request reserves blocks for its prompt and its `max_tokens` up front, unreferenced blocks
are reused least recently freed first (evicting what they held), and a finished request frees its blocks
tail first. A request goes to the engine holding its longest cached prefix among the engines under a
load cap (ties: fewest requests so far, then lowest index). The cap: never more than `max_over_mean` x
the whole run's mean requests per engine (so the run's max/mean load stays within `max_over_mean`), and,
with a slack s, never more than `max_over_mean` x the running mean + s. The reference is the best of
these placements over a few slacks.

What it is not: an upper bound, nor an optimum. It sees the caches but not the future (a cold prompt
goes to the least-loaded engine, whatever that evicts), its eviction is LRU, and it never sees two
requests in flight at once, so a prefix computed by a still-running request counts as cached. A policy
can beat it (kv_aware did on document_qa). kvgate_testing/foresight.py computes what knowing the future
adds and an upper bound under the same engine model.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

from kvgate_testing.workloads import Workload, block_keys, cacheable_hit_tokens


@dataclass(slots=True)
class PlacementResult:
    hit_ratio: float
    cached_tokens: int
    prompt_tokens: int
    requests_per_engine: list[int]
    slack: int | None  # the running-cap slack of the placement that won
    engine_of_request: list[int]  # where the placement sent each request, in workload order

    @property
    def max_over_mean_load(self) -> float:
        mean = sum(self.requests_per_engine) / len(self.requests_per_engine)
        return max(self.requests_per_engine) / mean if mean else 0.0


class EngineBlockCache:
    """One engine's block pool, reduced to what decides cache hits: which block content each slot holds
    and the order in which unreferenced slots get reused."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Unreferenced slots, next to be reused first; the value is the content key a slot holds.
        self._free: OrderedDict[int, object | None] = OrderedDict((slot, None) for slot in range(num_blocks))
        self._slot_of: dict[object, int] = {}

    def longest_cached_prefix(self, keys: list[bytes]) -> int:
        for matched, key in enumerate(keys):
            if key not in self._slot_of:
                return matched
        return len(keys)

    def serve(self, prompt_keys: list[bytes], prompt_tokens: int, max_tokens: int, request_tag: int) -> int:
        """Run one request to completion; return its cached prompt tokens."""
        size = self.block_size
        hit_blocks = self.longest_cached_prefix(prompt_keys[: (prompt_tokens - 1) // size])
        total_blocks = -(-(prompt_tokens + max_tokens) // size)
        if total_blocks > self.num_blocks:
            raise ValueError(
                f"a request of {prompt_tokens}+{max_tokens} tokens needs {total_blocks} blocks, more than "
                f"the {self.num_blocks} an engine has; raise --num-gpu-blocks"
            )
        slots = [self._slot_of[key] for key in prompt_keys[:hit_blocks]]
        for slot in slots:
            self._claim(slot)  # referenced while the request runs
        for _ in range(total_blocks - hit_blocks):
            slot, evicted = self._take()
            if evicted is not None:
                del self._slot_of[evicted]
            slots.append(slot)
        # Full blocks get cached: the prompt's, then those the generated tokens fill (unique content).
        full_blocks = (prompt_tokens + max_tokens) // size
        contents: list[object | None] = [None] * total_blocks
        for index in range(hit_blocks, full_blocks):
            key = prompt_keys[index] if index < len(prompt_keys) else (request_tag, index)
            if key not in self._slot_of:  # a duplicate of a cached block stays uncached, as in vLLM
                self._slot_of[key] = slots[index]
                contents[index] = key
        for index in range(hit_blocks):
            contents[index] = prompt_keys[index]
        for index in reversed(range(total_blocks)):
            self._release(slots[index], contents[index])
        return cacheable_hit_tokens(hit_blocks, prompt_tokens, size)

    # The eviction order: least recently freed first. A subclass changes it through these three.
    def _claim(self, slot: int) -> None:
        """An unreferenced slot becomes referenced (a hit)."""
        del self._free[slot]

    def _take(self) -> tuple[int, object | None]:
        """The unreferenced slot to reuse next, and the content it held (evicted)."""
        return self._free.popitem(last=False)

    def _release(self, slot: int, content: object | None) -> None:
        """A finished request's slot becomes unreferenced, holding `content` (None: nothing cached)."""
        self._free[slot] = content


# Running-cap slacks tried, in requests: 0 spreads cold prompts evenly as they come, None lets an engine
# run ahead up to the whole-run cap. Which wins depends on the workload (a short prefix shared by every
# prompt draws cold prompts together when the cap is loose), so the reference keeps the best.
SLACKS: tuple[int | None, ...] = (0, 1, 2, 4, None)


def request_block_keys(workload: Workload, block_size: int) -> list[list[bytes]]:
    """Every request's prompt as its chain of block keys, in the workload's order: what the
    placements (this one, kvgate_testing/foresight.py's) look up and store."""
    return [block_keys(request.prompt_token_ids, block_size) for request in workload.requests]


def reference_placement(
    workload: Workload,
    engines: int,
    num_gpu_blocks: int,
    block_size: int = 16,
    max_over_mean: float = 1.3,
) -> PlacementResult:
    """The best of the greedy placements over `SLACKS`; every one keeps max/mean load <= max_over_mean."""
    keys = request_block_keys(workload, block_size)
    results = []
    for slack in SLACKS:
        caches = [EngineBlockCache(num_gpu_blocks, block_size) for _ in range(engines)]
        results.append(greedy_placement(workload, keys, caches, max_over_mean, slack))
    return max(results, key=lambda result: result.hit_ratio)


def greedy_placement(
    workload: Workload,
    keys_of_request: list[list[bytes]],
    caches: list[EngineBlockCache],
    max_over_mean: float,
    slack: int | None,
) -> PlacementResult:
    """The greedy longest-cached-prefix placement under the load cap, over these engines' caches (one
    per engine, empty at the start; `serve` is told each request's position in the workload as its
    tag, which `BeladyBlockCache` reads as the time)."""
    engines = len(caches)
    block_size = caches[0].block_size
    assigned = [0] * engines
    cached_total = 0
    prompt_total = 0
    engine_of_request: list[int] = []
    total = len(workload.requests)
    # The whole-run cap bounds the measured quantity itself: total requests per engine.
    total_cap = max(math.ceil(total / engines), math.floor(max_over_mean * total / engines))
    for routed, request in enumerate(workload.requests):
        keys = keys_of_request[routed]
        usable = keys[: (request.prompt_tokens - 1) // block_size]
        cap = total_cap
        if slack is not None:
            cap = min(cap, math.floor(max_over_mean * (routed + 1) / engines) + slack)
        eligible = [e for e in range(engines) if assigned[e] < cap]
        if not eligible:
            fewest = min(assigned)
            eligible = [e for e in range(engines) if assigned[e] == fewest]
        best = max(eligible, key=lambda e: (caches[e].longest_cached_prefix(usable), -assigned[e], -e))
        cached_total += caches[best].serve(keys, request.prompt_tokens, request.max_tokens, routed)
        assigned[best] += 1
        engine_of_request.append(best)
        prompt_total += request.prompt_tokens
    return PlacementResult(
        cached_total / max(1, prompt_total), cached_total, prompt_total, assigned, slack, engine_of_request
    )

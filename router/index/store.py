"""The prefix index: which leading tokens of a prompt each backend holds, per storage tier.

The data structure, its rules and its lookups; events reach it through the index's writer
(`ingest.IndexWriter`, built beside it by `service.py`), which this module knows nothing of
(see docs/index.md).
- The router never reproduces an engine's block hash: prefixes are named by router keys
  (`keys.py`). `holders[key]` is a bitmask of the (backend, tier) *slots* holding that prefix. A
  lookup maps the prompt's keys through the dict (one C-level pass), then finds, per slot, the
  leading run of set bits with vectorized numpy: no per-token Python loop.
- Per backend, an engine-hash -> node map remembers which router keys each engine block
  completed, so a removal can unset exactly those bits. A block whose parent is unknown cannot
  be placed (its position is unknown) and is counted, not guessed.
- Engine blocks need not align with router blocks (cache-layer chunks, tail chunks, overlapping
  chunk tokens): a node keeps the tokens after its last router-block boundary (`tail`), children
  continue from there, and lookups extend a match by comparing those few tail tokens.

The index's invariants (holder masks and their extra references, tails, chains, stats) are kept
by the `*_locked` methods of `PrefixIndex`: the public API its writer (`ingest.IndexWriter`: the
compiled writer where it is built, `python_writer.PythonWriter` for the rest) changes the state
through, under the writer lock. Lookups take no
lock: they only read dict values and copy-on-write structures, which the GIL keeps consistent.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import operator
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np

from kvwire import BlockStored, cache_salt_of, tier_of
from router.index.keys import (
    DEFAULT_NAMESPACE,
    LOOKUP_SPAN_BLOCKS,
    ROUTER_BLOCK_TOKENS,
    Namespace,
    namespace_seed,
    prefix_keys,
    token_array,
)

TIER_ORDER = ("gpu", "cpu", "disk")
# How many tokens of each chain's first event are kept to show the prefix on the debug page.
PREVIEW_TOKENS = 96
# Engine blocks one backend (one DP rank) may hold in the index when its engine's capacity is not
# known: 4M tokens of 16-token blocks, more than an engine's GPU and CPU tiers hold in practice.
DEFAULT_MAX_BLOCKS = 1 << 18
# Distinct mask values kept shared (`PrefixIndex.shared_masks`); past this many the table starts
# over (it is a cache).
SHARED_MASKS_LIMIT = 1 << 16


def tier_rank(tier: str) -> int:
    return TIER_ORDER.index(tier) if tier in TIER_ORDER else len(TIER_ORDER)


@dataclass(slots=True)
class Chain:
    """The first event of a chain of blocks (parent None) on one backend: for the debug page."""

    preview: tuple[int, ...]
    namespace: Namespace
    longest: int = 0
    nodes: int = 0


# One engine block as the router placed it. A plain tuple, not an object: millions of them are
# created at event rate, and tuples of ints are cheap to build and ignored by the cyclic GC.
#   (end, tokens, boundary_key, tail, keys, chain_id, slots)
# end: tokens of the prefix up to and including this block; tokens: tokens the block covers;
# boundary_key: key of the prefix ending at the last router-block boundary <= end; tail: the tokens
# between that boundary and `end` (shorter than a router block); keys: the router keys this block
# completed (it owns them for removal); chain_id: its Chain in IndexedBackend.chains; slots: bitmask
# of the (backend, tier) slots that hold it.
# `keys` is a bare int when the block completed exactly one router block (the usual 16-token
# block): one object fewer to allocate and track per block.
Node = tuple
NODE_FIELDS = ("end", "tokens", "boundary_key", "tail", "keys", "chain_id", "slots")
(NODE_END, NODE_TOKENS, NODE_BOUNDARY_KEY, NODE_TAIL, NODE_KEYS, NODE_CHAIN, NODE_SLOTS) = range(
    len(NODE_FIELDS)
)


def owned_keys(keys: int | tuple[int, ...]) -> tuple[int, ...]:
    """A node's `keys` field as a tuple."""
    return (keys,) if keys.__class__ is int else keys  # type: ignore[return-value]


@dataclass
class BackendIndexStats:
    blocks: dict[str, int] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)
    stored_events: int = 0
    removed_events: int = 0
    cleared_events: int = 0
    # Blocks that could not be placed: parent unknown (stored before we subscribed) or no token_ids.
    unplaced_blocks: int = 0
    # BlockRemoved for blocks the index never placed.
    unknown_removals: int = 0
    # Blocks the index dropped itself, oldest first, to keep the backend within `max_blocks`.
    evicted_blocks: int = 0


class IndexedBackend:
    __slots__ = (
        "chain_ids",
        "chains",
        "compiled_writer",
        "max_blocks",
        "medium_slots",
        "name",
        "next_chain_id",
        "nodes",
        "stats",
        "tier_slots",
        "visible",
    )

    def __init__(self, name: str, *, visible: bool = True, max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
        self.name = name
        # The most engine blocks (`nodes`) it may hold; past it the oldest go
        # (`PrefixIndex.evict_over_capacity_locked`).
        self.max_blocks = max_blocks
        # The compiled writer for this backend (made at its first event when built). It
        # keeps `nodes`, `medium_slots`, `chains`, `stats` and the stats' dicts: never rebind them.
        self.compiled_writer: Any = None
        # False while a snapshot is built into it: its slots stay out of the readers' layout.
        self.visible = visible
        self.nodes: dict[Any, Node] = {}
        self.tier_slots: dict[str, int] = {}
        # An event's `medium` as spelled on the wire (None, "GPU", "cpu", ...) -> (its tier's slot,
        # that slot's bit, the tier): one probe per event instead of a tier_of call and a slot probe.
        self.medium_slots: dict[str | None, tuple[int, int, str]] = {}
        self.chains: dict[int, Chain] = {}
        # (namespace, preview tokens) -> chain id, so one prompt stored twice shares its chain.
        self.chain_ids: dict[tuple[Namespace, tuple[int, ...]], int] = {}
        self.next_chain_id = 0
        self.stats = BackendIndexStats()


@dataclass(slots=True)
class BackendMatch:
    """How many leading tokens of a prompt one backend holds."""

    # Per tier, the contiguous prefix held in that tier alone.
    by_tier: dict[str, int]
    # Tiers in preference order (gpu, cpu, disk, others) with the prefix held in that tier or a
    # faster one: e.g. [("gpu", 64), ("cpu", 256)] means 64 tokens on GPU, 192 more loadable from CPU.
    cumulative: list[tuple[str, int]]

    @property
    def tokens(self) -> int:
        return self.cumulative[-1][1] if self.cumulative else 0

    def best_tier(self) -> str | None:
        """The fastest tier holding the longest prefix (what an LMCache lookup reports)."""
        best = self.tokens
        if best == 0:
            return None
        return min((tier for tier, held in self.by_tier.items() if held == best), key=tier_rank, default=None)


# A lookup whose layout changed while it ran runs again, at most this many times in all.
_LOOKUP_ATTEMPTS = 4


def _held_masks(holders: dict[int, int], keys: Sequence[int] | np.ndarray) -> tuple[list[int], np.ndarray]:
    """The leading `keys` up to where the cached part ends (as Python ints), and the masks of those
    held before the first hole (OverflowError past 64 slots).

    Where the cached part ends is found by bisection as if the held blocks came first (a handful of
    probes); a hole before that point shows as the KeyError of the one C call that fetches the masks.
    """
    size = len(keys)
    held = size
    if size and int(keys[-1]) not in holders:
        held = bisect.bisect_left(range(size), True, key=lambda block: int(keys[block]) not in holders)
    chunk = keys[:held] if held < size else keys
    chunk = chunk.tolist() if isinstance(chunk, np.ndarray) else chunk
    try:
        return chunk, np.fromiter(_masks_of(holders, chunk), np.uint64, held)
    except KeyError as absent:  # a hole: no run goes past it
        held = list(chunk).index(absent.args[0])
        return chunk, np.fromiter(_masks_of(holders, chunk[:held]), np.uint64, held)


def _masks_of(holders: dict[int, int], keys: list[int]) -> tuple[int, ...]:
    """The masks of `keys`, all held (KeyError names the first that is not). One C call fetches
    them all (cheaper than `dict.get` key by key), and numpy reads a tuple faster than a map."""
    if len(keys) > 1:
        return operator.itemgetter(*keys)(holders)
    return (holders[keys[0]],) if keys else ()


# The compiled `held_runs` (router/index/_ingest.pyx) once router/index/ingest.py has loaded and
# checked it; None: the lookups probe through `_held_masks` and numpy.
_compiled_held_runs: Callable[[dict[int, int], list[int]], tuple[dict[int, int], list[int]]] | None = None


def use_compiled_held_runs(
    function: Callable[[dict[int, int], list[int]], tuple[dict[int, int], list[int]]] | None,
) -> None:
    """Set (or clear, with None) the compiled probe-and-runs of a lookup given its keys."""
    global _compiled_held_runs
    _compiled_held_runs = function


def _record_lost_bits(runs: dict[int, int], bits: int, position: int) -> None:
    while bits:
        bit = bits & -bits
        bits ^= bit
        runs[bit] = position


class PrefixIndex:
    """Per backend and tier, the cached token prefixes announced by KV events."""

    # Backends whose prefixes get no credit, and why: a bare index credits every backend (the
    # gateway's KVIndexService fills its own from the contract check, router/contract.py).
    uncredited: Mapping[str, str] = MappingProxyType({})

    def __init__(self, *, lock: Any = None) -> None:
        """`lock`: the writer lock (`ingest.writer_lock`: the compiled writer takes it in C);
        a `threading.Lock` by default. Events reach the index through an `ingest.IndexWriter`
        made over it with the same lock."""
        # Python code takes the lock with `with`; the index's writer holds it while it applies.
        self._lock: Any = threading.Lock() if lock is None else lock
        # ---- the state writers change (under the lock), through the `*_locked` methods below ----
        self.holders: dict[int, int] = {}
        # One int object per distinct mask value, shared by every key holding it: a million keys
        # point at a few dozen objects (less memory per key, and lookups read masks that stay in
        # cache). `shared_masks.setdefault(mask, mask)` returns the shared object.
        self.shared_masks: dict[int, int] = {}
        self._share = self.shared_masks.setdefault
        # (key, slot) -> references beyond the first (the same prefix stored twice in one tier,
        # e.g. by two KV-cache groups); the bit is unset only when the last reference goes.
        self.extra_refs: dict[tuple[int, int], int] = {}
        # boundary key -> {tail tokens: slot mask}; replaced, never mutated, so readers need no lock.
        self._tails: dict[int, dict[tuple[int, ...], int]] = {}
        self._tail_refs: dict[tuple[int, tuple[int, ...], int], int] = {}
        self._backends: dict[str, IndexedBackend] = {}
        self._free_slots: list[int] = []
        self._next_slot = 0
        # backend -> [(tier, slot)] snapshot for readers; replaced on change.
        self._layout: dict[str, tuple[tuple[str, int], ...]] = {}
        # LoRA adapter names engines announced blocks under: a request whose model is one of them
        # is looked up in that adapter's namespace (vLLM serves an adapter under its own name).
        self.lora_names: set[str] = set()

    @property
    def lock(self) -> Any:
        """The writer lock (what the index's writer holds while it applies events)."""
        return self._lock

    @property
    def indexed_backends(self) -> dict[str, IndexedBackend]:
        """Backend name -> its state (the writer adds backends at their first event, under the lock)."""
        return self._backends

    # ---- backends ----

    def add_backend(self, name: str, max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
        """Make room for a backend (or DP rank) that holds at most `max_blocks` engine blocks."""
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be at least 1, got {max_blocks}")
        with self._lock:
            backend = self._backends.setdefault(name, IndexedBackend(name, max_blocks=max_blocks))
            backend.max_blocks = max_blocks
            if backend.compiled_writer is not None:
                backend.compiled_writer.max_nodes = max_blocks
            self.evict_over_capacity_locked(backend)

    def remove_backend(self, name: str) -> None:
        with self._lock:
            backend = self._backends.pop(name, None)
            if backend is None:
                return
            self.clear_locked(backend)
            for slot in backend.tier_slots.values():
                self._free_slots.append(slot)
            self._layout = {k: v for k, v in self._layout.items() if k != name}

    def clear_backend(self, name: str) -> None:
        """Forget everything a backend holds (engine restarted, or AllBlocksCleared)."""
        with self._lock:
            backend = self._backends.get(name)
            if backend is not None:
                self.clear_locked(backend)

    def snapshot_backend_locked(self, name: str) -> IndexedBackend:
        """A hidden backend for `name` that a writer builds a snapshot into (`IndexWriter.
        replace_backend`): absent from the readers' layout until `install_snapshot_locked`."""
        old = self._backends.get(name)
        max_blocks = DEFAULT_MAX_BLOCKS if old is None else old.max_blocks
        return IndexedBackend(name, visible=False, max_blocks=max_blocks)

    def install_snapshot_locked(self, name: str, fresh: IndexedBackend) -> None:
        """Replace everything `name` holds by the snapshot built into `fresh`, atomically for
        lookups: one assignment of the layout switches readers from the old slots to the new
        ones, and the old slots are torn down and freed. Counters carry over; blocks and tokens
        are the snapshot's."""
        old = self._backends.get(name)
        fresh.visible = True
        self._backends[name] = fresh
        layout = {k: v for k, v in self._layout.items() if k != name}
        if fresh.tier_slots:
            layout[name] = tuple(sorted(fresh.tier_slots.items(), key=lambda item: tier_rank(item[0])))
        self._layout = layout
        if old is None:
            return
        self.sync_stats_locked(old)
        stats, previous = fresh.stats, old.stats
        stats.stored_events += previous.stored_events
        stats.removed_events += previous.removed_events
        stats.cleared_events += previous.cleared_events
        stats.unplaced_blocks += previous.unplaced_blocks
        stats.unknown_removals += previous.unknown_removals
        stats.evicted_blocks += previous.evicted_blocks
        self.clear_locked(old)
        self._free_slots.extend(old.tier_slots.values())

    def backends(self) -> list[str]:
        return list(self._backends)

    def evict_over_capacity(self, backend_name: str) -> None:
        """Bring a backend back within its `max_blocks` (the compiled entry calls it when a batch
        it applied took the backend past them)."""
        with self._lock:
            backend = self._backends.get(backend_name)
            if backend is not None:
                self.evict_over_capacity_locked(backend)

    def evict_over_capacity_locked(self, backend: IndexedBackend) -> None:
        """Past `max_blocks`, drop the backend's oldest blocks (first stored), down to 1/32 under
        the cap so the next evictions come in batches, not one per event.

        The index keeps the newest blocks an engine announced, as the engine's own LRU keeps the
        recently used ones; refusing new blocks instead would freeze the index on what the engine
        most likely evicted long ago. A block is dropped as a BlockRemoved for it in every tier
        would drop it (holder bits, shared prefixes' references, tails, chains and stats stay
        consistent); a child whose parent went is kept but unreachable by lookups, which stop at
        the missing parent, and goes in its turn as it gets old."""
        nodes = backend.nodes
        excess = len(nodes) - backend.max_blocks
        if excess <= 0:
            return
        self.sync_stats_locked(backend)
        victims = list(itertools.islice(nodes, excess + backend.max_blocks // 32))
        tier_of_slot = [(tier, slot, 1 << slot) for tier, slot in backend.tier_slots.items()]
        stats = backend.stats
        for node_key in victims:
            node = nodes[node_key]
            for tier, slot, bit in tier_of_slot:
                if node[NODE_SLOTS] & bit:
                    node = self.unregister_locked(node, slot, bit)
                    stats.blocks[tier] -= 1
                    stats.tokens[tier] -= node[NODE_TOKENS]
            self.forget_node_locked(backend, node_key, node)
        stats.evicted_blocks += len(victims)

    # ---- the invariants: what writers change the state through, holding the lock ----

    def medium_slot_locked(self, backend: IndexedBackend, medium: str | None) -> tuple[int, int, str]:
        """(slot, bit, tier) of an event's medium on a backend, remembered per spelling (a slot
        lives as long as its backend); the bit is the shared mask object."""
        tier = tier_of(medium)
        slot = self.slot_locked(backend, tier)
        slot_bit_tier = backend.medium_slots[medium] = (slot, self._share(1 << slot, 1 << slot), tier)
        return slot_bit_tier

    def held_medium_slot_locked(
        self, backend: IndexedBackend, medium: str | None
    ) -> tuple[int, int, str] | None:
        """`medium_slot_locked` for a removal: None (and no slot made) when the backend holds
        nothing in the medium's tier."""
        slot_bit_tier = backend.medium_slots.get(medium)
        if slot_bit_tier is None and tier_of(medium) in backend.tier_slots:
            slot_bit_tier = self.medium_slot_locked(backend, medium)
        return slot_bit_tier

    def root_chain_locked(self, backend: IndexedBackend, event: BlockStored, covered: int) -> tuple[int, int]:
        """The chain a BlockStored without a parent starts (made if new: its namespace and the
        preview of its first `covered` tokens name it) and the key of its namespace's empty prefix."""
        preview = tuple(event.token_ids[: min(covered, PREVIEW_TOKENS)])
        return self.chain_for_locked(backend, Namespace(event.lora_name, cache_salt_of(event)), preview)

    def chain_for_locked(
        self, backend: IndexedBackend, namespace: Namespace, preview: tuple[int, ...]
    ) -> tuple[int, int]:
        """The chain of a root in `namespace` whose first tokens are `preview` (made if new) and
        the key of its namespace's empty prefix."""
        if namespace.lora_name is not None:
            self.lora_names.add(namespace.lora_name)
        chain_id = backend.chain_ids.get((namespace, preview))
        if chain_id is None:
            chain_id = backend.chain_ids[(namespace, preview)] = backend.next_chain_id
            backend.next_chain_id += 1
            backend.chains[chain_id] = Chain(preview, namespace)
        return chain_id, namespace_seed(namespace)

    def slot_locked(self, backend: IndexedBackend, tier: str) -> int:
        slot = backend.tier_slots.get(tier)
        if slot is None:
            if self._free_slots:
                slot = self._free_slots.pop()
            else:
                slot = self._next_slot
                self._next_slot += 1
            backend.tier_slots[tier] = slot
            backend.stats.blocks.setdefault(tier, 0)
            backend.stats.tokens.setdefault(tier, 0)
            if not backend.visible:
                return slot
            layout = dict(self._layout)
            by_speed = sorted(backend.tier_slots.items(), key=lambda item: tier_rank(item[0]))
            layout[backend.name] = tuple(by_speed)
            self._layout = layout
        return slot

    def register_locked(self, node: Node, slot: int, bit: int) -> Node:
        """Mark the node's prefixes as held in `slot`; returns the node with the slot added."""
        holders = self.holders
        for key in owned_keys(node[NODE_KEYS]):
            mask = holders.get(key, 0)
            if mask & bit:
                ref = (key, slot)
                self.extra_refs[ref] = self.extra_refs.get(ref, 0) + 1
            else:
                holders[key] = self._share(mask | bit, mask | bit)
        boundary, tail = node[NODE_BOUNDARY_KEY], node[NODE_TAIL]
        if tail:
            tails = self._tails.get(boundary, {})
            mask = tails.get(tail, 0)
            if mask & bit:
                ref3 = (boundary, tail, slot)
                self._tail_refs[ref3] = self._tail_refs.get(ref3, 0) + 1
            else:
                updated = dict(tails)
                updated[tail] = mask | bit
                self._tails[boundary] = updated
        return (*node[:NODE_SLOTS], node[NODE_SLOTS] | bit)

    def unregister_locked(self, node: Node, slot: int, bit: int) -> Node:
        """Unmark the node's prefixes in `slot`; returns the node without the slot."""
        holders = self.holders
        for key in owned_keys(node[NODE_KEYS]):
            ref = (key, slot)
            extra = self.extra_refs.get(ref)
            if extra:
                if extra == 1:
                    del self.extra_refs[ref]
                else:
                    self.extra_refs[ref] = extra - 1
                continue
            mask = holders.get(key, 0) & ~bit
            if mask:
                holders[key] = self._share(mask, mask)
            else:
                holders.pop(key, None)
        boundary, tail = node[NODE_BOUNDARY_KEY], node[NODE_TAIL]
        if tail:
            self._unregister_tail_locked(boundary, tail, slot, bit)
        return (*node[:NODE_SLOTS], node[NODE_SLOTS] & ~bit)

    def _unregister_tail_locked(self, boundary: int, tail: tuple[int, ...], slot: int, bit: int) -> None:
        ref = (boundary, tail, slot)
        extra = self._tail_refs.get(ref)
        if extra:
            if extra == 1:
                del self._tail_refs[ref]
            else:
                self._tail_refs[ref] = extra - 1
            return
        tails = self._tails.get(boundary)
        if tails is None:
            return
        updated = dict(tails)
        mask = updated.get(tail, 0) & ~bit
        if mask:
            updated[tail] = mask
        else:
            updated.pop(tail, None)
        if updated:
            self._tails[boundary] = updated
        else:
            del self._tails[boundary]

    @staticmethod
    def forget_node_locked(backend: IndexedBackend, node_key: Any, node: Node) -> None:
        """Drop a node no slot holds any more, and its chain with the chain's last node."""
        del backend.nodes[node_key]
        chain = backend.chains.get(node[NODE_CHAIN])
        if chain is not None:
            chain.nodes -= 1
            if chain.nodes <= 0:
                del backend.chains[node[NODE_CHAIN]]
                backend.chain_ids.pop((chain.namespace, chain.preview), None)

    @staticmethod
    def sync_stats_locked(backend: IndexedBackend) -> None:
        """The compiled entry leaves a lone event's stats pending in the backend's writer: add
        them before the stats are read or zeroed (adding commutes with every other update)."""
        if backend.compiled_writer is not None:
            backend.compiled_writer.flush_stats()

    def clear_locked(self, backend: IndexedBackend) -> None:
        self.sync_stats_locked(backend)
        for node in backend.nodes.values():
            for slot in backend.tier_slots.values():
                bit = 1 << slot
                if node[NODE_SLOTS] & bit:
                    node = self.unregister_locked(node, slot, bit)
        backend.nodes.clear()
        backend.chains.clear()
        backend.chain_ids.clear()
        for tier in backend.stats.blocks:
            backend.stats.blocks[tier] = 0
            backend.stats.tokens[tier] = 0

    # ---- queries ----

    def longest_cached_prefix(
        self,
        tokens: np.ndarray | Sequence[int],
        namespace: Namespace = DEFAULT_NAMESPACE,
        backends: list[str] | None = None,
        *,
        keys: Sequence[int] | np.ndarray | None = None,
    ) -> dict[str, BackendMatch]:
        """For each backend (all when None), the leading tokens of `tokens` it holds, per tier.

        `keys`: the prompt's router keys when the caller has them already, exactly what
        `prompt_prefix_keys(tokens, namespace)` returns (a list of ints, or the same as a uint64
        array): the lookup then neither converts the prompt nor computes its keys (the prompt is
        only read past the matched blocks when some engine block ends off a router-block boundary).
        Keys computed for another namespace or another prompt give wrong answers; a count that is
        not one per full router block of `tokens` raises ValueError.

        A snapshot swaps a backend's slots by replacing the layout, then tears the old slots down;
        a lookup that saw the layout change under it may have read a half-torn-down backend, so it
        runs again on the new layout (the check is one identity test; retries are bounded).
        """
        seed = namespace_seed(namespace)
        if keys is None:
            prompt: np.ndarray | Sequence[int] = token_array(tokens)
            key_list = None
        else:
            if len(keys) != len(tokens) // ROUTER_BLOCK_TOKENS:
                raise ValueError(
                    f"keys: {len(keys)} given for a prompt of {len(tokens)} tokens, which has "
                    f"{len(tokens) // ROUTER_BLOCK_TOKENS} full {ROUTER_BLOCK_TOKENS}-token blocks; pass "
                    "prompt_prefix_keys(tokens, namespace) of this prompt, or no keys"
                )
            prompt = tokens
            key_list = keys.tolist() if isinstance(keys, np.ndarray) else keys
        for _ in range(_LOOKUP_ATTEMPTS):
            layout = self._layout
            result = self._lookup_in_layout(prompt, seed, layout, backends, key_list)
            if self._layout is layout:
                break
        return result

    def _lookup_in_layout(
        self,
        array: np.ndarray | Sequence[int],
        seed: int,
        layout: dict[str, tuple[tuple[str, int], ...]],
        backends: list[str] | None,
        given_keys: Sequence[int] | None = None,
    ) -> dict[str, BackendMatch]:
        order = list(layout) if backends is None else backends
        if not any(map(layout.__contains__, order)):
            return {name: BackendMatch({}, []) for name in order}
        if given_keys is None:
            slot_runs, masks, keys = self._slot_runs(array, seed)  # type: ignore[arg-type]
        else:
            slot_runs, masks, keys = self._slot_runs_of_keys(given_keys)
        tails = self._tails
        result = {}
        for name in order:
            tiers = layout.get(name)
            if tiers is None:
                result[name] = BackendMatch({}, [])
                continue
            if len(tiers) == 1 and not tails:  # the usual backend: one tier, whole router blocks
                tier, slot = tiers[0]
                held = slot_runs.get(1 << slot, 0) * ROUTER_BLOCK_TOKENS
                result[name] = BackendMatch({tier: held}, [(tier, held)])
                continue
            match = result[name] = BackendMatch({}, [])
            union = 0
            for tier, slot in tiers:
                bit = 1 << slot
                blocks = slot_runs.get(bit, 0)
                held = blocks * ROUTER_BLOCK_TOKENS
                if tails:
                    held += self._tail_extension(array, keys, seed, blocks, bit)
                match.by_tier[tier] = held
                if union:
                    # Held in this tier or a faster one: "any of these bits" (multi-tier backends only).
                    union |= bit
                    blocks = self._union_run(masks, union)
                    held = blocks * ROUTER_BLOCK_TOKENS
                    if tails:
                        held += self._tail_extension(array, keys, seed, blocks, union)
                    held = max(held, match.cumulative[-1][1])
                else:
                    union = bit
                match.cumulative.append((tier, held))
        return result

    def _slot_runs_of_keys(self, keys: Sequence[int]) -> tuple[dict[int, int], Any, Sequence[int]]:
        """`_slot_runs` for keys the caller computed: the same probes, no tokens read; through the
        compiled `held_runs` where it is built (the masks then a list: `_union_run` takes both)."""
        holders = self.holders
        try:
            if _compiled_held_runs is not None and type(keys) is list:
                runs, held = _compiled_held_runs(holders, keys)
                return runs, held, keys
            _, masks = _held_masks(holders, keys)
        except OverflowError:  # more than 64 slots: the same with Python ints
            wide = list(map(holders.get, keys, itertools.repeat(0, len(keys))))
            runs, wide_masks = self._slot_runs_wide(wide)
            return runs, wide_masks, keys
        return self._runs_of_masks(masks), masks, keys

    def _slot_runs(self, array: np.ndarray, seed: int) -> tuple[dict[int, int], Any, list[int]]:
        """Per slot bit, how many leading blocks it holds; the masks of the blocks held by anyone;
        the keys computed (at least up to the first block nobody holds).

        Keys are computed with numpy a span (32k tokens) at a time. The first block nobody holds is
        found by bisection (about ten probes), and only the blocks before it are probed, in one C
        call: a prompt whose cached part is short (a shared system prompt, then new text) costs
        little, and a long cached prompt pays one dict probe per block and nothing per token.
        The running AND of the masks holds the slots that hold every block so far; it only loses
        bits, at most once per slot, so the run lengths are read off its few change points.
        """
        holders = self.holders
        total = len(array) // ROUTER_BLOCK_TOKENS
        keys: list[int] = []
        parts = []
        try:
            for span_start in range(0, total, LOOKUP_SPAN_BLOCKS):
                span_end = min(total, span_start + LOOKUP_SPAN_BLOCKS)
                span_keys = prefix_keys(
                    array[span_start * ROUTER_BLOCK_TOKENS : span_end * ROUTER_BLOCK_TOKENS],
                    keys[-1] if keys else seed,
                    span_start,
                )
                chunk, masks = _held_masks(holders, span_keys)
                keys += chunk
                parts.append(masks)
                if len(masks) < len(span_keys):
                    break
        except OverflowError:  # more than 64 slots: the same with Python ints
            keys = prefix_keys(array, seed).tolist()
            runs, wide_masks = self._slot_runs_wide(
                list(map(holders.get, keys, itertools.repeat(0, len(keys))))
            )
            return runs, wide_masks, keys
        masks: Any = np.concatenate(parts) if len(parts) > 1 else parts[0] if parts else None
        if masks is None:
            return {}, np.empty(0, np.uint64), keys
        return self._runs_of_masks(masks), masks, keys

    @staticmethod
    def _runs_of_masks(masks: np.ndarray) -> dict[int, int]:
        """Per slot bit, how many leading masks hold it (every bit of the first mask gets an entry)."""
        runs: dict[int, int] = {}
        if not len(masks):
            return runs
        running_and = np.bitwise_and.accumulate(masks)
        previous = int(running_and[0])
        last = int(running_and[-1])
        if last != previous:  # some slot's run ends inside the prompt: find where each bit went
            changes = np.flatnonzero(running_and[1:] != running_and[:-1]) + 1
            for position, current in zip(changes.tolist(), running_and[changes].tolist(), strict=True):
                _record_lost_bits(runs, previous & ~current, position)
                previous = current
        _record_lost_bits(runs, last, len(masks))
        return runs

    @staticmethod
    def _slot_runs_wide(masks: list[int]) -> tuple[dict[int, int], list[int]]:
        with contextlib.suppress(ValueError):
            del masks[masks.index(0) :]
        runs: dict[int, int] = {}
        running_and = list(itertools.accumulate(masks, operator.and_))
        if not running_and:
            return runs, masks
        bits = running_and[0]
        while bits:
            bit = bits & -bits
            bits ^= bit
            if running_and[-1] & bit:
                runs[bit] = len(running_and)
            else:
                runs[bit] = bisect.bisect_left(running_and, True, key=lambda value, b=bit: not value & b)
        return runs, masks

    @staticmethod
    def _union_run(masks: Any, union: int) -> int:
        """Leading blocks held in any slot of `union`."""
        if isinstance(masks, np.ndarray) and union < 2**64:
            held = (masks & np.uint64(union)) != 0
            return len(held) if held.all() else int(np.argmin(held))
        either = [int(mask) & union for mask in masks]
        return either.index(0) if 0 in either else len(either)

    def _tail_extension(
        self, array: np.ndarray | Sequence[int], keys: Sequence[int], seed: int, blocks: int, mask: int
    ) -> int:
        boundary = keys[blocks - 1] if blocks > 0 else seed
        tails = self._tails.get(boundary)
        if not tails:
            return 0
        offset = blocks * ROUTER_BLOCK_TOKENS
        piece = array[offset : offset + ROUTER_BLOCK_TOKENS]
        rest = piece.tolist() if isinstance(piece, np.ndarray) else list(map(int, piece))
        best = 0
        for tail, holders in tails.items():
            if holders & mask and best < len(tail) <= len(rest) and tuple(rest[: len(tail)]) == tail:
                best = len(tail)
        return best

    # ---- introspection ----

    def stats(self, name: str) -> BackendIndexStats | None:
        backend = self._backends.get(name)
        if backend is None:
            return None
        with self._lock:
            self.sync_stats_locked(backend)
            stats = backend.stats
            return BackendIndexStats(
                blocks=dict(stats.blocks),
                tokens=dict(stats.tokens),
                stored_events=stats.stored_events,
                removed_events=stats.removed_events,
                cleared_events=stats.cleared_events,
                unplaced_blocks=stats.unplaced_blocks,
                unknown_removals=stats.unknown_removals,
                evicted_blocks=stats.evicted_blocks,
            )

    def namespace_for(self, model: str, cache_salt: str | None) -> Namespace:
        """The namespace of a request: its model names a LoRA adapter when engines announced one."""
        return Namespace(model if model in self.lora_names else None, cache_salt)

    def held_tokens(self, name: str) -> int:
        """Tokens a backend holds over all tiers (a lock-free, possibly slightly stale read)."""
        backend = self._backends.get(name)
        if backend is None:
            return 0
        writer = backend.compiled_writer
        pending = 0 if writer is None else writer.pending_tokens()
        return sum(list(backend.stats.tokens.values())) + pending

    def top_prefixes(self, limit: int = 20) -> list[dict[str, Any]]:
        """The longest cached chains, merged across backends: preview tokens, length, holders (the
        longest prefix each holds, `backends`, and the engine blocks of the chain there, `blocks`)."""
        merged: dict[tuple[Namespace, tuple[int, ...]], dict[str, Any]] = {}
        with self._lock:
            for backend in self._backends.values():
                for chain in backend.chains.values():
                    namespace, preview = chain.namespace, chain.preview
                    entry = merged.setdefault(
                        (namespace, preview),
                        {
                            "preview_tokens": list(preview),
                            "namespace": namespace,
                            "tokens": 0,
                            "backends": {},
                            "blocks": {},
                        },
                    )
                    entry["backends"][backend.name] = chain.longest
                    # Engine blocks of the chain on this backend: its branches too, not just the longest.
                    entry["blocks"][backend.name] = chain.nodes
                    entry["tokens"] = max(entry["tokens"], chain.longest)
        ranked = sorted(merged.values(), key=lambda entry: (-entry["tokens"], entry["preview_tokens"]))
        return ranked[:limit]

    def size(self) -> dict[str, int]:
        """Totals for metrics: router prefix keys and engine blocks placed."""
        return {
            "router_keys": len(self.holders),
            "engine_blocks": sum(len(backend.nodes) for backend in list(self._backends.values())),
        }

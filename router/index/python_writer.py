"""The index's writer rules in Python: KV events applied to a `PrefixIndex` (store.py) through
its public state and `*_locked` methods, under its writer lock.

`PythonWriter` applies every event where the compiled writer is not built, and every event the
compiled writer does not take where it is (`ingest.IndexWriter` hands those over). It is also
the pure-Python reference of the index's rules: `kvgate_testing.index_oracle` runs this same
code, alone, as the oracle the compiled writer is checked against (tests/test_index_differential.py).

Paths, all building the same index state: a decode step's batch column by column
(`store_decode_step_locked`), a lone one-block event (`store_one_block_locked`), and the general
path (`apply_general_locked`: consecutive stores in one numpy pass, anything else event by
event), which takes every shape.
"""

from __future__ import annotations

import array
import functools
import gc
import itertools
import operator
import struct
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from kvwire import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, tier_of
from router.index.keys import (
    NUMPY_MIN_BLOCKS,
    ROUTER_BLOCK_TOKENS,
    UINT64_MASK,
    block_value,
    extend_tokens,
    prefix_keys,
    router_block_values,
    small_prefix_keys,
    stream_keys,
)
from router.index.store import (
    NODE_BOUNDARY_KEY,
    NODE_CHAIN,
    NODE_END,
    NODE_KEYS,
    NODE_SLOTS,
    NODE_TAIL,
    NODE_TOKENS,
    SHARED_MASKS_LIMIT,
    IndexedBackend,
    Node,
    PrefixIndex,
    owned_keys,
)

_BLOCK_TOKENS_EACH = itertools.repeat(ROUTER_BLOCK_TOKENS)
_NO_TAIL = itertools.repeat(())
_node_end = operator.itemgetter(NODE_END)
_node_boundary = operator.itemgetter(NODE_BOUNDARY_KEY)
_node_tail = operator.itemgetter(NODE_TAIL)
_node_chain = operator.itemgetter(NODE_CHAIN)
_first_item = operator.itemgetter(0)
# A decode step's events are read as field tuples (`msgspec.structs.astuple`: one C call per
# event, cheaper than reading the fields one by one) and transposed into columns.
_STORED_FIELDS = BlockStored.__struct_fields__
(
    _COLUMN_HASHES,
    _COLUMN_PARENT_HASH,
    _COLUMN_TOKEN_IDS,
    _COLUMN_BLOCK_SIZE,
    _COLUMN_MEDIUM,
    _COLUMN_GROUP,
) = map(
    _STORED_FIELDS.index,
    ("block_hashes", "parent_block_hash", "token_ids", "block_size", "medium", "group_idx"),
)
# A list of at least this many events that is not one decode step is applied run by run
# (`PythonWriter.apply_in_runs_locked`); shorter lists go the general way whole.
_RUN_SPLIT_MIN_EVENTS = 16

# A BlockStored checked for the batched path, waiting for its batch's numpy pass (a tuple: one
# is built per event at event rate):
#   (node_keys, token_ids, count, block_size, parent_end, boundary_key, chain_id, slot)
PendingStore = tuple
(
    _PENDING_NODE_KEYS,
    _PENDING_TOKEN_IDS,
    _PENDING_COUNT,
    _PENDING_BLOCK_SIZE,
    _PENDING_PARENT_END,
    _PENDING_BOUNDARY_KEY,
    _PENDING_CHAIN_ID,
    _PENDING_SLOT,
) = range(8)


def snapshot_order(events: list[KVEvent]) -> list[KVEvent]:
    """A snapshot's events with every BlockStored after the one holding its parent block.

    A snapshot lists blocks per tier; a block held in one tier may have its parent only in another
    tier listed later. Placing a block needs its parent placed, so stored blocks are sorted by
    chain depth across tiers (stable: the publisher's order is kept among equals). Other events
    (the leading AllBlocksCleared) stay first.
    """
    stored = [event for event in events if isinstance(event, BlockStored) and event.block_hashes]
    if len(stored) < 2:
        return events
    producer: dict[Any, BlockStored] = {}
    for event in stored:
        for block_hash in event.block_hashes:
            producer.setdefault(block_hash, event)
    depth: dict[int, int] = {}
    for event in stored:
        chain: list[BlockStored] = []
        current: BlockStored | None = event
        while current is not None and id(current) not in depth and len(chain) <= len(stored):
            chain.append(current)
            parent = current.parent_block_hash
            current = producer.get(parent) if parent is not None else None
        level = depth[id(current)] if current is not None and id(current) in depth else 0
        for member in reversed(chain):
            level += 1
            depth.setdefault(id(member), level)
    others = [event for event in events if not (isinstance(event, BlockStored) and event.block_hashes)]
    return others + sorted(stored, key=lambda event: depth[id(event)])


class paused_gc:
    """The cyclic GC paused while a batch is applied: a batch allocates thousands of small tuples
    of ints, which hold no cycles; left on, the collector would run every few hundred of them and
    sweep the whole index (millions of entries) now and then. Writers hold the index's lock, so
    pauses do not nest."""

    __slots__ = ("collecting",)

    def __enter__(self) -> None:
        self.collecting = gc.isenabled()
        gc.disable()

    def __exit__(self, *exc: object) -> None:
        if self.collecting:
            gc.enable()


class PythonWriter:
    """Applies KV events to one index in Python (module docstring)."""

    def __init__(self, index: PrefixIndex) -> None:
        self.index = index
        self.lock = index.lock
        self.backends = index.indexed_backends
        # The index's dicts (never rebound), read without an attribute lookup on the index.
        self.holders = index.holders
        self.shared_masks = index.shared_masks
        self.share = index.shared_masks.setdefault
        self.extra_refs = index.extra_refs

    def backend_to_write_locked(self, backend_name: str) -> IndexedBackend:
        """The backend events for `backend_name` go to (made at its first event); the shared
        mask objects dropped first when there are too many of them."""
        backend = self.backends.get(backend_name)
        if backend is None:
            backend = self.backends[backend_name] = IndexedBackend(backend_name)
        if len(self.shared_masks) > SHARED_MASKS_LIMIT:
            self.shared_masks.clear()
        return backend

    def apply(self, backend_name: str, events: list[KVEvent]) -> None:
        """Apply the events of one batch, in order."""
        with self.lock:
            backend = self.backend_to_write_locked(backend_name)
            try:
                self.apply_batch_locked(backend, events)
            finally:
                if len(backend.nodes) > backend.max_blocks:
                    self.index.evict_over_capacity_locked(backend)

    def apply_snapshot_locked(self, backend: IndexedBackend, events: list[KVEvent]) -> None:
        """A snapshot's events (`IndexWriter.replace_backend`), parents first."""
        self.apply_general_locked(backend, snapshot_order(events))

    def apply_batch_locked(self, backend: IndexedBackend, events: list[KVEvent]) -> None:
        """One batch: a lone one-block event of the decode shape in plain Python, a decode step
        column by column, anything else run by run. A lone event gets no GC pause: the pause
        would cost more than it saves."""
        if len(events) == 1 and self.store_one_block_locked(backend, events[0]):
            return
        with paused_gc():
            if len(events) == 1 or not self.store_decode_step_locked(backend, events):
                self.apply_in_runs_locked(backend, events)

    def store_one_block_locked(self, backend: IndexedBackend, event: KVEvent) -> bool:
        """`store_decode_step_locked` for a batch of one event, in plain Python (an engine step
        that filled one block publishes it alone; per-batch passes would cost more than the event)."""
        if not isinstance(event, BlockStored) or event.block_size != ROUTER_BLOCK_TOKENS or event.group_idx:
            return False
        hashes, token_ids = event.block_hashes, event.token_ids
        if len(hashes) != 1 or len(token_ids) != ROUTER_BLOCK_TOKENS:
            return False
        nodes = backend.nodes
        parent = nodes.get(event.parent_block_hash)
        block_hash = hashes[0]
        if parent is None or parent[NODE_TAIL] or block_hash in nodes:
            return False
        parent_end, _, boundary, _, _, chain_id, _ = parent
        try:
            key = (boundary + block_value(token_ids, parent_end // ROUTER_BLOCK_TOKENS)) & UINT64_MASK
        except (struct.error, TypeError):  # token ids that are not uint32: the general path counts them
            return False
        slot_bit_tier = backend.medium_slots.get(event.medium)
        if slot_bit_tier is None:
            slot_bit_tier = self.index.medium_slot_locked(backend, event.medium)
        _, bit, tier = slot_bit_tier
        holders = self.holders
        mask = holders.get(key, 0)
        if mask & bit:
            return False
        end = parent_end + ROUTER_BLOCK_TOKENS
        nodes[block_hash] = (end, ROUTER_BLOCK_TOKENS, key, (), key, chain_id, bit)
        holders[key] = self.share(mask | bit, mask | bit) if mask else bit
        chain = backend.chains[chain_id]
        chain.nodes += 1
        if end > chain.longest:
            chain.longest = end
        stats = backend.stats
        stats.stored_events += 1
        stats.blocks[tier] += 1
        stats.tokens[tier] += ROUTER_BLOCK_TOKENS
        return True

    def store_decode_step_locked(self, backend: IndexedBackend, events: list[KVEvent]) -> bool:
        """A decode step's batch, applied column by column; False (nothing changed) for any other.

        The shape: only BlockStored, each of one 16-token block of one medium, KV-cache group 0,
        whose parent was placed before the batch and ends on a router-block boundary, new to the
        backend, and completing a prefix no slot of the tier holds yet. That is what an engine
        publishes during decode: one block per running request that filled one. Every check and
        every insert is a C-level pass over the batch (`map`, `zip`, `dict.update`), and the keys
        are one numpy pass (plain ints below `NUMPY_MIN_BLOCKS`), so a step costs a few Python
        calls, not a few per event. It builds exactly what the general path builds
        (tests/test_index_ingest.py).
        Several steps in one list (the subscriber hands over a drained burst of messages in one
        call) are taken too: a parent may then be an earlier event of the list; positions and
        keys follow those parents in two short Python passes (`_chained_ends_locked`).
        """
        if (
            not events
            or not all(map(isinstance, events, itertools.repeat(BlockStored)))
            or len(events[0].block_hashes) != 1  # (a prefill: leave at once)
        ):
            return False
        columns = list(zip(*map(msgspec.structs.astuple, events), strict=True))
        hashes, parent_hashes = columns[_COLUMN_HASHES], columns[_COLUMN_PARENT_HASH]
        token_ids, block_sizes = columns[_COLUMN_TOKEN_IDS], columns[_COLUMN_BLOCK_SIZE]
        media, groups = columns[_COLUMN_MEDIUM], columns[_COLUMN_GROUP]
        if (
            set(block_sizes) != {ROUTER_BLOCK_TOKENS}
            or set(map(len, hashes)) != {1}
            or set(map(len, token_ids)) != {ROUTER_BLOCK_TOKENS}
            or any(groups)
            or len(set(media)) != 1
        ):
            return False
        nodes = backend.nodes
        parents = list(map(nodes.get, parent_hashes))
        count = len(parents)
        block_hashes = list(map(_first_item, hashes))
        if not nodes.keys().isdisjoint(block_hashes) or len(set(block_hashes)) != count:
            return False
        placed = all(parents)
        if placed:
            if any(map(_node_tail, parents)):
                return False
            parent_ends = list(map(_node_end, parents))
            ends = list(map(operator.add, parent_ends, _BLOCK_TOKENS_EACH))
            chain_ids = list(map(_node_chain, parents))
        else:
            chained = self._chained_ends_locked(parents, parent_hashes, block_hashes)
            if chained is None:
                return False
            ends, chain_ids, earlier = chained
            parent_ends = list(map(operator.sub, ends, _BLOCK_TOKENS_EACH))
        stream = array.array("I")
        try:
            # `fromlist` per event (consumed in C by `any`: it returns None) is twice as fast as
            # building the array from one chained list; it leaves the array as it was on failure.
            any(map(stream.fromlist, token_ids))
        except (OverflowError, TypeError):  # token ids that are not uint32: the general path counts them
            return False
        positions = map(operator.floordiv, parent_ends, _BLOCK_TOKENS_EACH)
        if count < NUMPY_MIN_BLOCKS:  # two events: plain ints beat numpy's per-call cost
            offsets = range(0, len(stream), ROUTER_BLOCK_TOKENS)
            block_values = [
                block_value(stream[offset : offset + ROUTER_BLOCK_TOKENS], position)
                for offset, position in zip(offsets, positions, strict=False)
            ]
            if placed:
                bases = map(_node_boundary, parents)
                keys = [(base + value) & UINT64_MASK for base, value in zip(bases, block_values, strict=True)]
        else:
            values = router_block_values(
                np.frombuffer(stream, dtype=np.uint32), np.fromiter(positions, np.uint64, count)
            )
            if placed:
                values += np.fromiter(map(_node_boundary, parents), np.uint64, count)
                keys = values.tolist()
            else:
                block_values = values.tolist()
        if not placed:  # a key continues from its parent's: placed before, or earlier in the list
            keys = []
            for parent, position, value in zip(parents, earlier, block_values, strict=True):
                base = parent[NODE_BOUNDARY_KEY] if parent is not None else keys[position]
                keys.append((base + value) & UINT64_MASK)
        medium = media[0]
        slot_bit_tier = backend.medium_slots.get(medium)
        if slot_bit_tier is None:
            slot_bit_tier = self.index.medium_slot_locked(backend, medium)
        _, bit, tier = slot_bit_tier
        share = self.share
        holders = self.holders
        # Prefixes new to every slot (the usual: decoded tokens are the request's own) need no masks.
        held = 0
        if not holders.keys().isdisjoint(keys):
            masks = list(map(holders.get, keys, itertools.repeat(0, count)))
            held = functools.reduce(operator.or_, masks, 0)
        # A prefix this tier already holds (or two events of the step completing one prefix):
        # the general path keeps the reference counts.
        if held & bit or (count > 1 and len(set(keys)) != count):
            return False
        new_nodes = zip(
            ends, _BLOCK_TOKENS_EACH, keys, _NO_TAIL, keys, chain_ids, itertools.repeat(bit), strict=False
        )
        nodes.update(zip(block_hashes, new_nodes, strict=True))
        if held:
            updated = list(map(operator.or_, masks, itertools.repeat(bit)))
            holders.update(zip(keys, map(share, updated, updated), strict=True))
        else:
            holders.update(zip(keys, itertools.repeat(bit), strict=False))
        chains = backend.chains
        for chain_id, end in zip(chain_ids, ends, strict=True):
            chain = chains[chain_id]
            chain.nodes += 1
            if end > chain.longest:
                chain.longest = end
        stats = backend.stats
        stats.stored_events += count
        stats.blocks[tier] += count
        stats.tokens[tier] += count * ROUTER_BLOCK_TOKENS
        return True

    def apply_in_runs_locked(self, backend: IndexedBackend, events: list[KVEvent]) -> None:
        """Events in order. In a long list (a drained burst of messages, a replay), each run of
        one-block BlockStored events with a parent (decode steps) is tried on the decode-step path
        and the events between the runs (prefills, removals, clears) go the general way."""
        if len(events) < _RUN_SPLIT_MIN_EVENTS:
            self.apply_general_locked(backend, events)
            return
        decode_like = [
            isinstance(event, BlockStored)
            and len(event.block_hashes) == 1
            and event.parent_block_hash is not None
            for event in events
        ]
        start = 0
        for is_decode, run in itertools.groupby(decode_like):
            end = start + sum(1 for _ in run)
            part = events[start:end]
            start = end
            if is_decode and (
                self.store_one_block_locked(backend, part[0])
                if len(part) == 1
                else self.store_decode_step_locked(backend, part)
            ):
                continue
            self.apply_general_locked(backend, part)

    @staticmethod
    def _chained_ends_locked(
        parents: list[Node | None], parent_hashes: Sequence[Any], block_hashes: list[Any]
    ) -> tuple[list[int], list[int], list[int]] | None:
        """For one-block events some of whose parents are earlier events of the same list: each
        event's end, chain and the list position of its parent (-1 when placed before); None when
        a parent is neither placed (without a tail) nor earlier in the list."""
        position_of = dict(zip(block_hashes, range(len(block_hashes)), strict=True))
        earlier = list(map(position_of.get, parent_hashes, itertools.repeat(-1)))
        ends: list[int] = []
        chain_ids: list[int] = []
        for index, (parent, position) in enumerate(zip(parents, earlier, strict=True)):
            if parent is not None:
                if parent[NODE_TAIL]:
                    return None
                ends.append(parent[NODE_END] + ROUTER_BLOCK_TOKENS)
                chain_ids.append(parent[NODE_CHAIN])
            elif 0 <= position < index:
                ends.append(ends[position] + ROUTER_BLOCK_TOKENS)
                chain_ids.append(chain_ids[position])
            else:  # unknown parent (or None: a chain's first block), or a child listed before its parent
                return None
        return ends, chain_ids, earlier

    def apply_general_locked(self, backend: IndexedBackend, events: list[KVEvent]) -> None:
        # Consecutive BlockStored events of whole router blocks whose parents are already placed
        # (the common case: one event per request per engine step) are hashed together in one
        # numpy pass and inserted with whole-batch dict updates; anything else is applied one by
        # one, in order.
        pending: list[PendingStore] = []
        pending_hashes: set[Any] = set()
        prepare = self._prepare_store_locked
        for event in events:
            if isinstance(event, BlockStored):
                prepared = prepare(backend, event, pending_hashes)
                if prepared is None and pending and self._depends_on(event, pending_hashes):
                    self._flush_stores_locked(backend, pending, pending_hashes)
                    prepared = prepare(backend, event, pending_hashes)
                if prepared is not None:
                    pending.append(prepared)
                    node_keys = prepared[_PENDING_NODE_KEYS]
                    if len(node_keys) == 1:
                        pending_hashes.add(node_keys[0])
                    else:
                        pending_hashes.update(node_keys)
                    continue
                self._flush_stores_locked(backend, pending, pending_hashes)
                self.store_locked(backend, event)
                continue
            self._flush_stores_locked(backend, pending, pending_hashes)
            if isinstance(event, BlockRemoved):
                self.remove_locked(backend, event)
            elif isinstance(event, AllBlocksCleared):
                backend.stats.cleared_events += 1
                if event.medium:  # one medium cleared (a restarted shared store): the rest stays
                    self.clear_medium_locked(backend, event.medium)
                else:
                    self.index.clear_locked(backend)
        self._flush_stores_locked(backend, pending, pending_hashes)

    @staticmethod
    def _depends_on(event: BlockStored, pending_hashes: set[Any]) -> bool:
        group = event.group_idx or 0
        parent = event.parent_block_hash
        keys = event.block_hashes if group == 0 else [(group, h) for h in event.block_hashes]
        parent_key = parent if group == 0 else (group, parent)
        return parent_key in pending_hashes or any(map(pending_hashes.__contains__, keys))

    def _prepare_store_locked(
        self, backend: IndexedBackend, event: BlockStored, pending_hashes: set[Any]
    ) -> PendingStore | None:
        """A BlockStored the batched path can take, or None (then it goes the general way)."""
        node_keys = event.block_hashes
        count = len(node_keys)
        block_size = event.block_size or 0
        token_ids = event.token_ids
        if (
            count == 0
            or block_size <= 0
            or block_size % ROUTER_BLOCK_TOKENS
            or len(token_ids) < count * block_size
        ):
            return None
        group = event.group_idx
        if group:
            node_keys = [(group, h) for h in node_keys]
        nodes = backend.nodes
        if count == 1:
            if node_keys[0] in nodes or node_keys[0] in pending_hashes:
                return None
        elif not nodes.keys().isdisjoint(node_keys) or (
            pending_hashes and not pending_hashes.isdisjoint(node_keys)
        ):
            return None
        parent_hash = event.parent_block_hash
        if parent_hash is None:
            chain_id, boundary_key = self.index.root_chain_locked(backend, event, count * block_size)
            parent_end = 0
        else:
            parent = nodes.get((group, parent_hash) if group else parent_hash)
            if parent is None or parent[NODE_TAIL]:
                return None
            parent_end, boundary_key = parent[NODE_END], parent[NODE_BOUNDARY_KEY]
            chain_id = parent[NODE_CHAIN]
        slot_bit_tier = backend.medium_slots.get(event.medium)
        if slot_bit_tier is None:
            slot_bit_tier = self.index.medium_slot_locked(backend, event.medium)
        slot = slot_bit_tier[0]
        return (node_keys, token_ids, count, block_size, parent_end, boundary_key, chain_id, slot)

    def _flush_stores_locked(
        self, backend: IndexedBackend, pending: list[PendingStore], hashes: set[Any]
    ) -> None:
        if not pending:
            return
        stream = array.array("I")
        valid = []
        for store in pending:
            token_ids, covered = store[_PENDING_TOKEN_IDS], store[_PENDING_COUNT] * store[_PENDING_BLOCK_SIZE]
            before = len(stream)
            try:
                extend_tokens(stream, token_ids if len(token_ids) == covered else token_ids[:covered])
            except (OverflowError, TypeError):  # token ids that are not uint32: nothing to index
                del stream[before:]
                backend.stats.stored_events += 1
                backend.stats.unplaced_blocks += store[_PENDING_COUNT]
                continue
            valid.append(store)
        pending[:] = valid
        if not pending:
            hashes.clear()
            return
        blocks_per_event = [
            store[_PENDING_COUNT] * (store[_PENDING_BLOCK_SIZE] // ROUTER_BLOCK_TOKENS) for store in pending
        ]
        total = len(stream) // ROUTER_BLOCK_TOKENS
        if total < NUMPY_MIN_BLOCKS:  # one or two blocks: Python ints beat numpy's call overhead
            all_keys = []
            offset = 0
            for store, length in zip(pending, blocks_per_event, strict=True):
                end = offset + length * ROUTER_BLOCK_TOKENS
                all_keys += small_prefix_keys(
                    stream[offset:end],
                    store[_PENDING_BOUNDARY_KEY],
                    store[_PENDING_PARENT_END] // ROUTER_BLOCK_TOKENS,
                )
                offset = end
        elif len(pending) == 1:  # one event (a prefill): one running sum from its parent's key
            store = pending[0]
            all_keys = prefix_keys(
                np.frombuffer(stream, dtype=np.uint32),
                store[_PENDING_BOUNDARY_KEY],
                store[_PENDING_PARENT_END] // ROUTER_BLOCK_TOKENS,
            ).tolist()
        elif total == len(pending):  # one router block per event (decode steps): no running sums
            positions = (
                np.fromiter((store[_PENDING_PARENT_END] for store in pending), np.int64, len(pending))
                // ROUTER_BLOCK_TOKENS
            )
            values = router_block_values(np.frombuffer(stream, dtype=np.uint32), positions)
            bases = np.asarray([store[_PENDING_BOUNDARY_KEY] for store in pending], dtype=np.uint64)
            all_keys = (values + bases).tolist()
        else:
            lengths = np.asarray(blocks_per_event, dtype=np.int64)
            starts = np.cumsum(lengths) - lengths
            firsts = np.fromiter((store[_PENDING_PARENT_END] for store in pending), np.int64, len(pending))
            shifts = firsts // ROUTER_BLOCK_TOKENS - starts
            positions = np.arange(total, dtype=np.int64) + np.repeat(shifts, lengths)
            values = router_block_values(np.frombuffer(stream, dtype=np.uint32), positions)
            sums = np.cumsum(values, dtype=np.uint64)
            # key = boundary_key + (sums[i] - sums[start - 1]): one subtraction per event, wrapping.
            before = np.concatenate([np.zeros(1, dtype=np.uint64), sums[:-1]])[starts]
            bases = np.asarray([store[_PENDING_BOUNDARY_KEY] for store in pending], dtype=np.uint64) - before
            all_keys = (sums + np.repeat(bases, lengths)).tolist()

        if not self._flush_uniform_locked(backend, pending, all_keys):
            self._flush_general_locked(backend, pending, blocks_per_event, all_keys)
        pending.clear()
        hashes.clear()

    def _flush_uniform_locked(
        self, backend: IndexedBackend, pending: list[PendingStore], all_keys: list[int]
    ) -> bool:
        """The common shape (16-token blocks, one tier, prefixes new to it) in whole-batch passes."""
        slot = pending[0][_PENDING_SLOT]
        for store in pending:
            if store[_PENDING_BLOCK_SIZE] != ROUTER_BLOCK_TOKENS or store[_PENDING_SLOT] != slot:
                return False
        holders = self.holders
        masks = list(map(holders.get, all_keys, itertools.repeat(0, len(all_keys))))
        share = self.share
        bit = share(1 << slot, 1 << slot)
        held = functools.reduce(operator.or_, masks, 0)
        if held & bit:
            return False  # a prefix held twice: the general path keeps the reference counts
        # Two events of one batch completing the same prefix (e.g. two KV-cache groups): the same.
        # (Keys within one event are running sums over distinct positions: they never repeat.)
        if len(pending) > 1 and len(set(all_keys)) != len(all_keys):
            return False
        nodes = backend.nodes
        chains = backend.chains
        if len(all_keys) == len(pending):  # one block per event
            for store, key in zip(pending, all_keys, strict=True):
                end = store[_PENDING_PARENT_END] + ROUTER_BLOCK_TOKENS
                chain_id = store[_PENDING_CHAIN_ID]
                nodes[store[_PENDING_NODE_KEYS][0]] = (end, ROUTER_BLOCK_TOKENS, key, (), key, chain_id, bit)
                chain = chains[chain_id]
                chain.nodes += 1
                if end > chain.longest:
                    chain.longest = end
        else:
            offset = 0
            for store in pending:
                count, parent_end = store[_PENDING_COUNT], store[_PENDING_PARENT_END]
                chain_id = store[_PENDING_CHAIN_ID]
                keys = all_keys[offset : offset + count]
                offset += count
                end = parent_end + ROUTER_BLOCK_TOKENS * count
                # The node tuples are built by zip in C: (end, tokens, boundary, tail, keys, chain, slots).
                block_ends = range(parent_end + ROUTER_BLOCK_TOKENS, end + 1, ROUTER_BLOCK_TOKENS)
                node_values = zip(
                    block_ends,
                    _BLOCK_TOKENS_EACH,
                    keys,
                    _NO_TAIL,
                    keys,
                    itertools.repeat(chain_id),
                    itertools.repeat(bit),
                )
                nodes.update(zip(store[_PENDING_NODE_KEYS], node_values, strict=True))
                chain = chains[chain_id]
                chain.nodes += count
                if end > chain.longest:
                    chain.longest = end
        if held:
            updated = list(map(operator.or_, masks, itertools.repeat(bit)))
            holders.update(zip(all_keys, map(share, updated, updated), strict=True))
        else:  # prefixes new to every slot (the usual): all share the slot's bit
            holders.update(zip(all_keys, itertools.repeat(bit), strict=False))
        tier = next(tier for tier, tier_slot in backend.tier_slots.items() if tier_slot == slot)
        stats = backend.stats
        stats.stored_events += len(pending)
        stats.blocks[tier] += len(all_keys)
        stats.tokens[tier] += len(all_keys) * ROUTER_BLOCK_TOKENS
        return True

    def _flush_general_locked(
        self,
        backend: IndexedBackend,
        pending: list[PendingStore],
        blocks_per_event: list[int],
        all_keys: list[int],
    ) -> None:
        """Any block size that is a multiple of the router block, any tier, prefixes held before."""
        holders = self.holders
        nodes = backend.nodes
        stats = backend.stats
        slot_tiers = {slot: tier for tier, slot in backend.tier_slots.items()}
        offset = 0
        for store, length in zip(pending, blocks_per_event, strict=True):
            node_keys, _, count, block_size, parent_end, _, chain_id, slot = store
            keys = all_keys[offset : offset + length]
            offset += length
            bit = self.share(1 << slot, 1 << slot)
            per_block = block_size // ROUTER_BLOCK_TOKENS
            if per_block == 1:
                owned_keys: list[Any] = keys
                boundaries = keys
            else:
                owned_keys = [tuple(keys[i : i + per_block]) for i in range(0, length, per_block)]
                boundaries = keys[per_block - 1 :: per_block]
            ends = range(parent_end + block_size, parent_end + block_size * count + 1, block_size)
            nodes.update(
                zip(
                    node_keys,
                    [
                        (end, block_size, boundary, (), owned, chain_id, bit)
                        for end, boundary, owned in zip(ends, boundaries, owned_keys, strict=True)
                    ],
                    strict=True,
                )
            )
            masks = list(map(holders.get, keys, itertools.repeat(0, length)))
            if functools.reduce(operator.or_, masks, 0) & bit:
                extra_refs = self.extra_refs
                for key in keys:
                    mask = holders.get(key, 0)
                    if mask & bit:
                        extra_refs[(key, slot)] = extra_refs.get((key, slot), 0) + 1
                    else:
                        holders[key] = self.share(mask | bit, mask | bit)
            else:
                updated = [mask | bit for mask in masks]
                holders.update(zip(keys, map(self.share, updated, updated), strict=True))
            chain = backend.chains[chain_id]
            chain.nodes += count
            chain.longest = max(chain.longest, ends[-1])
            tier = slot_tiers[slot]
            stats.stored_events += 1
            stats.blocks[tier] += count
            stats.tokens[tier] += count * block_size

    def store_locked(self, backend: IndexedBackend, event: BlockStored) -> None:
        stats = backend.stats
        stats.stored_events += 1
        hashes = event.block_hashes
        count = len(hashes)
        if count == 0:
            return
        tier = tier_of(event.medium)
        slot = self.index.slot_locked(backend, tier)
        bit = self.share(1 << slot, 1 << slot)
        group = event.group_idx or 0
        nodes = backend.nodes
        # Engine hashes are only unique within a KV-cache group; group 0 (the usual) keys by hash alone.
        node_keys = hashes if group == 0 else [(group, block_hash) for block_hash in hashes]
        added_blocks = added_tokens = 0

        # Blocks already placed (the same block announced again in another tier) only gain the tier.
        first_new = 0
        while first_new < count and node_keys[first_new] in nodes:
            node = nodes[node_keys[first_new]]
            if not node[NODE_SLOTS] & bit:
                nodes[node_keys[first_new]] = self.index.register_locked(node, slot, bit)
                added_blocks += 1
                added_tokens += node[NODE_TOKENS]
            first_new += 1

        token_ids = event.token_ids
        block_size = event.block_size or (len(token_ids) // count if token_ids else 0)
        # Cache-layer chunks carry one extra token (the next chunk's first): cover at most
        # count * block_size tokens. A short tail chunk covers fewer.
        covered = min(len(token_ids), count * block_size)
        skip = min(first_new * block_size, covered)
        if first_new < count and skip >= covered:
            stats.unplaced_blocks += count - first_new
            first_new = count
        parent: Node | None = None
        if first_new == count:
            pass
        elif first_new > 0:
            parent = nodes[node_keys[first_new - 1]]
        elif event.parent_block_hash is not None:
            parent = nodes.get(event.parent_block_hash if group == 0 else (group, event.parent_block_hash))
            if parent is None:  # stored before we subscribed, or lost: its position is unknown
                stats.unplaced_blocks += count
                first_new = count
        if first_new < count:
            try:
                added = self._place_locked(
                    backend, event, node_keys, first_new, parent, block_size, covered, skip, bit
                )
            except (OverflowError, TypeError):  # token ids that are not uint32: nothing to index
                stats.unplaced_blocks += count - first_new
                added = (0, 0)
            added_blocks += added[0]
            added_tokens += added[1]
        if added_blocks:
            stats.blocks[tier] += added_blocks
            stats.tokens[tier] += added_tokens

    def _place_locked(
        self,
        backend: IndexedBackend,
        event: BlockStored,
        node_keys: Sequence[Any],
        first_new: int,
        parent: Node | None,
        block_size: int,
        covered: int,
        skip: int,
        bit: int,
    ) -> tuple[int, int]:
        """Create nodes for blocks first_new.. of a BlockStored whose parent position is known."""
        token_ids = event.token_ids
        nodes = backend.nodes
        if parent is None:
            chain_id, boundary_key = self.index.root_chain_locked(backend, event, covered)
            parent_end, parent_tail = 0, ()
            chain = backend.chains[chain_id]
        else:
            parent_end, _, boundary_key, parent_tail, _, chain_id, _ = parent
            chain = backend.chains[chain_id]
        # `stream` starts at the last router-block boundary before this block's first token.
        stream = array.array("I", parent_tail)
        extend_tokens(stream, token_ids[skip:covered] if skip else token_ids[:covered])
        aligned_start = parent_end - len(parent_tail)
        keys = stream_keys(stream, boundary_key, aligned_start // ROUTER_BLOCK_TOKENS)

        slot = bit.bit_length() - 1
        holders = self.holders
        extra_refs = self.extra_refs
        start = parent_end - skip  # position of token_ids[0]
        previous_full = 0
        previous_end = parent_end
        added_blocks = added_tokens = 0
        for index in range(first_new, len(node_keys)):
            end = start + min((index + 1) * block_size, covered)
            if end <= previous_end:
                break
            full = (end - aligned_start) // ROUTER_BLOCK_TOKENS
            tail_start = full * ROUTER_BLOCK_TOKENS
            tail = tuple(stream[tail_start : end - aligned_start]) if end - aligned_start > tail_start else ()
            owned = tuple(keys[previous_full:full])
            node_key = node_keys[index]
            node = nodes.get(node_key)
            if node is None:
                boundary = keys[full - 1] if full else boundary_key
                node = (end, end - previous_end, boundary, tail, owned, chain_id, 0)
                chain.nodes += 1
                if end > chain.longest:
                    chain.longest = end
            if not node[NODE_SLOTS] & bit:
                if tail:
                    node = self.index.register_locked(node, slot, bit)
                else:  # inlined fast path: whole router blocks only
                    for key in owned_keys(node[NODE_KEYS]):
                        mask = holders.get(key, 0)
                        if mask & bit:
                            extra_refs[(key, slot)] = extra_refs.get((key, slot), 0) + 1
                        else:
                            holders[key] = self.share(mask | bit, mask | bit)
                    node = (*node[:NODE_SLOTS], node[NODE_SLOTS] | bit)
                added_blocks += 1
                added_tokens += node[NODE_TOKENS]
            nodes[node_key] = node
            previous_full, previous_end = full, end
        return added_blocks, added_tokens

    def clear_medium_locked(self, backend: IndexedBackend, medium: str) -> None:
        """Forget every block the backend holds in `medium`'s tier (its other tiers keep theirs)."""
        slot = backend.tier_slots.get(tier_of(medium))
        if slot is None:
            return
        bit = 1 << slot
        held = [node_key for node_key, node in backend.nodes.items() if node[NODE_SLOTS] & bit]
        by_group: dict[int, list[Any]] = {}
        for node_key in held:
            group, block_hash = node_key if isinstance(node_key, tuple) else (0, node_key)
            by_group.setdefault(group, []).append(block_hash)
        for group, hashes in by_group.items():
            self.remove_locked(backend, BlockRemoved(hashes, medium=medium, group_idx=group or None))
            backend.stats.removed_events -= 1  # a clear, counted as one (cleared_events)

    def remove_locked(self, backend: IndexedBackend, event: BlockRemoved) -> None:
        stats = backend.stats
        stats.removed_events += 1
        tier = tier_of(event.medium)
        slot = backend.tier_slots.get(tier)
        group = event.group_idx or 0
        nodes = backend.nodes
        for block_hash in event.block_hashes:
            node_key = block_hash if group == 0 else (group, block_hash)
            node = nodes.get(node_key)
            if node is None or slot is None or not node[NODE_SLOTS] & (1 << slot):
                stats.unknown_removals += 1
                continue
            node = self.index.unregister_locked(node, slot, 1 << slot)
            stats.blocks[tier] -= 1
            stats.tokens[tier] -= node[NODE_TOKENS]
            if node[NODE_SLOTS]:
                nodes[node_key] = node
            else:
                self.index.forget_node_locked(backend, node_key, node)

"""The prefix index: which leading tokens of a prompt each backend holds, per storage tier.

Design (see docs/index.md):
- The router never reproduces an engine's block hash. It cuts token streams into *router blocks*
  of `ROUTER_BLOCK_TOKENS` tokens and names the prefix ending at router block k by its own key:
  `key_k = namespace_seed + sum_{j<=k} mix(content_j, position_j)` (uint64, wrapping). A sum of
  mixed per-block values can be computed for a whole prompt with numpy in one go, and continued
  from a parent's key when an engine announces a child block.
- `_holders[key]` is a bitmask of (backend, tier) *slots* holding that prefix. A lookup maps the
  prompt's keys through the dict (one C-level pass), then finds, per slot, the leading run of set
  bits with vectorized numpy: no per-token Python loop.
- Per backend, an engine-hash -> `_Node` map remembers which router keys each engine block
  completed, so BlockRemoved can unset exactly those bits. A block whose parent is unknown cannot
  be placed (its position is unknown) and is counted, not guessed.
- Engine blocks need not align with router blocks (cache-layer chunks, tail chunks, overlapping
  chunk tokens): a node keeps the tokens after its last router-block boundary (`tail`), children
  continue from there, and lookups extend a match by comparing those few tail tokens.

Writers (one subscriber thread per backend) serialise on a lock; lookups take no lock: they only
read dict values and copy-on-write structures, which the GIL keeps consistent.
"""

from __future__ import annotations

import array
import bisect
import contextlib
import functools
import gc
import itertools
import logging
import operator
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgspec
import numpy as np
import xxhash

from router.compiled import load_compiled, rebuild_hint
from router.index.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    cache_salt_of,
    decode_batch,
    tier_of,
)

logger = logging.getLogger(__name__)

ROUTER_BLOCK_TOKENS = 16
# Namespace of a prompt's cache entries: (lora_name, cache_salt). The model is implied by the
# backend (one engine serves one base model); salted prompts never match unsalted entries.
Namespace = tuple[str | None, str | None]
DEFAULT_NAMESPACE: Namespace = (None, None)
TIER_ORDER = ("gpu", "cpu", "disk")
# How many tokens of each chain's first event are kept to show the prefix on the debug page.
PREVIEW_TOKENS = 96
# Engine blocks one backend (one DP rank) may hold in the index when its engine's capacity is not
# known: 4M tokens of 16-token blocks, more than an engine's GPU and CPU tiers hold in practice.
DEFAULT_MAX_BLOCKS = 1 << 18

_rng = np.random.default_rng(0x6B76676174)
# A router block's 16 uint32 tokens are read as 8 little-endian uint64 words (two tokens each) and
# combined with odd 64-bit weights (fixed seed: keys are stable across runs and processes).
_WORDS_PER_BLOCK = ROUTER_BLOCK_TOKENS // 2
_TOKEN_DTYPE = np.dtype("<u4")
_WORD_WEIGHTS = _rng.integers(0, 2**63, size=_WORDS_PER_BLOCK, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
_POSITION_WEIGHT = np.uint64(0x9E3779B97F4A7C15)
_MIX_1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX_2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def namespace_seed(namespace: Namespace) -> int:
    """The key of the empty prefix in a namespace."""
    lora_name, cache_salt = namespace
    if lora_name is None and cache_salt is None:
        return 0x2545F4914F6CDD1D
    return xxhash.xxh3_64_intdigest(repr((lora_name, cache_salt)).encode())


_WORD = (1 << 64) - 1
_POSITION_WEIGHT_PY = int(_POSITION_WEIGHT)
_MIX_1_PY, _MIX_2_PY = int(_MIX_1), int(_MIX_2)
# Below this many router blocks, plain Python ints beat numpy's per-call overhead.
_NUMPY_MIN_BLOCKS = 3
# A lookup computes a prompt's keys this many router blocks (32k tokens) at a time; it probes them
# in smaller, growing chunks and stops at the first block nobody holds.
_LOOKUP_SPAN_BLOCKS = 2048
# position * _POSITION_WEIGHT for the positions of a prompt's first span: a lookup slices it.
_POSITION_TERMS = np.arange(_LOOKUP_SPAN_BLOCKS, dtype=np.uint64) * _POSITION_WEIGHT


def router_block_values(tokens: np.ndarray, first_block: int | np.ndarray) -> np.ndarray:
    """Mixed value of each full router block of `tokens` (uint32, length a multiple of the block size).

    `first_block` is the position of the first block, or an array with every block's position.
    """
    # uint64 array arithmetic wraps silently, which is the modular arithmetic wanted here.
    if tokens.dtype != _TOKEN_DTYPE or not tokens.flags.c_contiguous:  # (numpy's cost is per call)
        tokens = np.ascontiguousarray(tokens, dtype=_TOKEN_DTYPE)
    words = tokens.view("<u8").reshape(-1, _WORDS_PER_BLOCK)
    x = words @ _WORD_WEIGHTS
    if isinstance(first_block, np.ndarray):
        if first_block.dtype != np.uint64:
            first_block = first_block.astype(np.uint64)
        x ^= first_block * _POSITION_WEIGHT
    elif first_block + len(x) <= len(_POSITION_TERMS):
        x ^= _POSITION_TERMS[first_block : first_block + len(x)]
    else:
        x ^= np.arange(first_block, first_block + len(x), dtype=np.uint64) * _POSITION_WEIGHT
    # splitmix64 finaliser: makes the per-block value a nonlinear function of content and position.
    # (One scratch array for the shifts: numpy's cost here is per call and per allocation.)
    shifted = np.empty_like(x)
    x ^= np.right_shift(x, _S30, out=shifted)
    x *= _MIX_1
    x ^= np.right_shift(x, _S27, out=shifted)
    x *= _MIX_2
    x ^= np.right_shift(x, _S31, out=shifted)
    return x


# One block's 16 tokens packed and read back as its 8 words in two C calls (struct.error for token
# ids that are not uint32); 8 products of words by their weights cost half of 16 per token.
_PACK_BLOCK = struct.Struct(f"<{ROUTER_BLOCK_TOKENS}I").pack
_UNPACK_WORDS = struct.Struct(f"<{_WORDS_PER_BLOCK}Q").unpack
_W0, _W1, _W2, _W3, _W4, _W5, _W6, _W7 = _WORD_WEIGHTS.tolist()


def _python_block_value(block_tokens: Sequence[int], position: int) -> int:
    """`router_block_values` of one block, with Python ints (cheaper than numpy for a block or two).

    Raises struct.error when a token id is not a uint32."""
    w0, w1, w2, w3, w4, w5, w6, w7 = _UNPACK_WORDS(_PACK_BLOCK(*block_tokens))
    # (xor and mask commute: the sum is masked once, with the position term)
    x = (
        w0 * _W0 + w1 * _W1 + w2 * _W2 + w3 * _W3 + w4 * _W4 + w5 * _W5 + w6 * _W6 + w7 * _W7
        ^ position * _POSITION_WEIGHT_PY
    ) & _WORD
    x ^= x >> 30
    x = (x * _MIX_1_PY) & _WORD
    x ^= x >> 27
    x = (x * _MIX_2_PY) & _WORD
    return x ^ (x >> 31)


def _python_prefix_keys(tokens: Sequence[int], seed: int, first_block: int) -> list[int]:
    """The same keys as `prefix_keys`, computed with Python ints (faster for one or two blocks)."""
    keys = []
    total = seed
    for block in range(len(tokens) // ROUTER_BLOCK_TOKENS):
        offset = block * ROUTER_BLOCK_TOKENS
        total = (
            total + _python_block_value(tokens[offset : offset + ROUTER_BLOCK_TOKENS], first_block + block)
        ) & _WORD
        keys.append(total)
    return keys


def prefix_keys(tokens: np.ndarray, seed: int, first_block: int = 0) -> np.ndarray:
    """Keys of the prefixes ending at each full router block of `tokens`, continuing from `seed`."""
    usable = len(tokens) - len(tokens) % ROUTER_BLOCK_TOKENS
    if usable == 0:
        return np.empty(0, dtype=np.uint64)
    keys = np.add.accumulate(router_block_values(tokens[:usable], first_block))
    keys += np.uint64(seed)
    return keys


def _stream_keys(tokens: array.array, seed: int, first_block: int) -> list[int]:
    """Keys of a uint32 token stream (an `array.array("I")`, read in place)."""
    if len(tokens) < _NUMPY_MIN_BLOCKS * ROUTER_BLOCK_TOKENS:
        return _python_prefix_keys(tokens, seed, first_block)
    return prefix_keys(np.frombuffer(tokens, dtype=np.uint32), seed, first_block).tolist()


def _extend_tokens(stream: array.array, tokens: Sequence[int]) -> None:
    """Append token ids to a uint32 `array.array` (OverflowError or TypeError for ids that are
    not uint32). `fromlist` takes a list about 1.5x faster than `extend` or the array constructor
    (8k tokens, side by side on the loaded machine: 253-280 vs 415 us) and leaves the array
    unchanged on failure."""
    if tokens.__class__ is list:
        stream.fromlist(tokens)  # type: ignore[arg-type]
    else:
        stream.extend(tokens)


def token_array(tokens: np.ndarray | Sequence[int]) -> np.ndarray:
    """A prompt's tokens as a uint32 array. A list goes through `array.array` (`_extend_tokens`),
    5x faster than `np.asarray` for Python ints. Token ids outside uint32 raise OverflowError."""
    if isinstance(tokens, np.ndarray):
        return tokens.astype(np.uint32, copy=False)
    stream = array.array("I")
    _extend_tokens(stream, tokens)
    return np.frombuffer(stream, dtype=np.uint32)


def prompt_prefix_keys(tokens: np.ndarray | list[int], namespace: Namespace = DEFAULT_NAMESPACE) -> list[int]:
    """The router keys of every full router block of a prompt, as Python ints (shared with policies)."""
    return prefix_keys(token_array(tokens), namespace_seed(namespace)).tolist()


def tier_rank(tier: str) -> int:
    return TIER_ORDER.index(tier) if tier in TIER_ORDER else len(TIER_ORDER)


@dataclass(slots=True)
class _Chain:
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
# completed (it owns them for removal); chain_id: its _Chain in _Backend.chains; slots: bitmask of
# the (backend, tier) slots that hold it.
# `keys` is a bare int when the block completed exactly one router block (the usual 16-token
# block): one object fewer to allocate and track per block.
_Node = tuple
_NODE_FIELDS = ("end", "tokens", "boundary_key", "tail", "keys", "chain_id", "slots")
_END, _TOKENS, _BOUNDARY, _TAIL, _KEYS, _CHAIN, _SLOTS = range(len(_NODE_FIELDS))


_SIXTEEN = itertools.repeat(ROUTER_BLOCK_TOKENS)
_NO_TAIL = itertools.repeat(())
_node_end = operator.itemgetter(_END)
_node_boundary = operator.itemgetter(_BOUNDARY)
_node_tail = operator.itemgetter(_TAIL)
_node_chain = operator.itemgetter(_CHAIN)
_first_item = operator.itemgetter(0)
# A decode step's events are read as field tuples (`msgspec.structs.astuple`: one C call per
# event, cheaper than reading the fields one by one) and transposed into columns.
_STORED_FIELDS = BlockStored.__struct_fields__
_HASHES, _PARENT_HASH, _TOKEN_IDS, _BLOCK_SIZE, _MEDIUM, _GROUP = map(
    _STORED_FIELDS.index,
    ("block_hashes", "parent_block_hash", "token_ids", "block_size", "medium", "group_idx"),
)
# A list of at least this many events that is not one decode step is applied run by run
# (`PrefixIndex._apply_in_runs_locked`); shorter lists go the general way whole.
_RUN_SPLIT_MIN_EVENTS = 16
# Distinct mask values kept shared (below); past this many the table starts over (it is a cache).
_SHARED_MASKS_LIMIT = 1 << 16


def _owned(keys: int | tuple[int, ...]) -> tuple[int, ...]:
    return (keys,) if keys.__class__ is int else keys  # type: ignore[return-value]


# What this module uses of the compiled ingest module: a build that lacks one is stale.
_COMPILED_INGEST_NAMES = (
    "configure", "block_value", "BackendWriter", "next_compiled_candidate", "OneEventFront", "WriterLock",
    "scan_batch", "WireBatch",
)  # fmt: skip
_INGEST_SOURCE = "router/index/_ingest.pyx"
_REBUILD_HINT = rebuild_hint(_INGEST_SOURCE)


def _load_compiled_ingest() -> Any:
    """The compiled ingest module (`router/index/_ingest.pyx`), configured with this module's key
    constants and checked against `_python_block_value`; None when it is not built, or built from
    another version of this module (then the pure-Python paths apply every event, as fast as they
    can; a stale build is named in a warning)."""
    _ingest = load_compiled("router.index._ingest", _INGEST_SOURCE, _COMPILED_INGEST_NAMES, logger)
    if _ingest is None:
        return None
    try:
        _ingest.configure(
            _WORD_WEIGHTS.tolist(), _POSITION_WEIGHT_PY, _MIX_1_PY, _MIX_2_PY, ROUTER_BLOCK_TOKENS,
            _NODE_FIELDS, BlockStored, _Chain,
            block_removed_class=BlockRemoved, preview_tokens=PREVIEW_TOKENS, capacity_field="max_blocks",
        )  # fmt: skip
    except (ValueError, TypeError) as mismatch:  # built from another version of the index: stale
        logger.warning("compiled ingest does not match the index (%s): not used; %s", mismatch, _REBUILD_HINT)
        return None
    # A build whose key math differs would file blocks under keys no lookup computes: refuse it.
    check = np.random.default_rng(7)
    for position in (0, 1, 37, 2**20 + 3):
        block = check.integers(0, 2**32, size=ROUTER_BLOCK_TOKENS).tolist()
        if _ingest.block_value(block, position) != _python_block_value(block, position):
            logger.warning("compiled ingest computes other keys than the index: not used; %s", _REBUILD_HINT)
            return None
    return _ingest


# The compiled path for decode steps, prefills alone in their batch and removals of plain blocks
# (None when not built): its writer class, where it resumes after the general path took other
# events, and `PrefixIndex.apply`'s compiled entry with the lock it takes; `INGEST_PATH` says
# which path applies those events by default.
_compiled_ingest = _load_compiled_ingest()
_CompiledWriter = getattr(_compiled_ingest, "BackendWriter", None)
_next_compiled_candidate = getattr(_compiled_ingest, "next_compiled_candidate", None)
INGEST_PATH = "compiled" if _compiled_ingest is not None else "python"


# A BlockStored checked for the batched path, waiting for its batch's numpy pass (a tuple: one
# is built per event at event rate):
#   (node_keys, token_ids, count, block_size, parent_end, boundary_key, chain_id, slot)
_PendingStore = tuple
(
    _P_NODE_KEYS,
    _P_TOKEN_IDS,
    _P_COUNT,
    _P_BLOCK_SIZE,
    _P_PARENT_END,
    _P_BOUNDARY_KEY,
    _P_CHAIN_ID,
    _P_SLOT,
) = range(8)


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


class _Backend:
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
        # The most engine blocks (`nodes`) it may hold; past it the oldest go (`_evict_locked`).
        self.max_blocks = max_blocks
        # The compiled path's writer for this backend (made at its first event when built). It
        # keeps `nodes`, `medium_slots`, `chains`, `stats` and the stats' dicts: never rebind them.
        self.compiled_writer: Any = None
        # False while a snapshot is built into it: its slots stay out of the readers' layout.
        self.visible = visible
        self.nodes: dict[Any, _Node] = {}
        self.tier_slots: dict[str, int] = {}
        # An event's `medium` as spelled on the wire (None, "GPU", "cpu", ...) -> (its tier's slot,
        # that slot's bit, the tier): one probe per event instead of a tier_of call and a slot probe.
        self.medium_slots: dict[str | None, tuple[int, int, str]] = {}
        self.chains: dict[int, _Chain] = {}
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


def _record_lost_bits(runs: dict[int, int], bits: int, position: int) -> None:
    while bits:
        bit = bits & -bits
        bits ^= bit
        runs[bit] = position


class WireIngest(NamedTuple):
    """Payloads straight to one backend of the index (`PrefixIndex.wire_ingest`)."""

    # A payload scanned (a `WireBatch`: its length and event counts by kind: stored, removed,
    # cleared), or None: decode it (`decode_batch`) and `apply` its events.
    scan: Any
    # Apply a list of scanned batches, in order.
    apply: Any


class PrefixIndex:
    """Per backend and tier, the cached token prefixes announced by KV events."""

    def __init__(self, *, compiled_ingest: bool = True) -> None:
        """`compiled_ingest=False` applies every event in pure Python even when the compiled
        one-block path is built (the reference it is tested and benchmarked against)."""
        compiled = _compiled_ingest if compiled_ingest and _CompiledWriter is not None else None
        # The compiled entry takes the writer lock in C (`WriterLock`); Python code takes either
        # lock with `with self._lock:`.
        self._lock: Any = compiled.WriterLock() if compiled is not None else threading.Lock()
        self._compiled_writer = _CompiledWriter if compiled is not None else None
        # "compiled" when one-block events of the decode shape take the compiled path, else "python".
        self.ingest_path = "compiled" if compiled is not None else "python"
        self._holders: dict[int, int] = {}
        # One int object per distinct mask value, shared by every key holding it: a million keys
        # point at a few dozen objects (about 30 bytes a key less, and lookups read masks that
        # stay in cache). `_share(mask, mask)` returns the shared object.
        self._shared_masks: dict[int, int] = {}
        self._share = self._shared_masks.setdefault
        # (key, slot) -> references beyond the first (the same prefix stored twice in one tier,
        # e.g. by two KV-cache groups); the bit is unset only when the last reference goes.
        self._extra_refs: dict[tuple[int, int], int] = {}
        # boundary key -> {tail tokens: slot mask}; replaced, never mutated, so readers need no lock.
        self._tails: dict[int, dict[tuple[int, ...], int]] = {}
        self._tail_refs: dict[tuple[int, tuple[int, ...], int], int] = {}
        self._backends: dict[str, _Backend] = {}
        self._free_slots: list[int] = []
        self._next_slot = 0
        # backend -> [(tier, slot)] snapshot for readers; replaced on change.
        self._layout: dict[str, tuple[tuple[str, int], ...]] = {}
        # LoRA adapter names engines announced blocks under: a request whose model is one of them
        # is looked up in that adapter's namespace (vLLM serves an adapter under its own name).
        self.lora_names: set[str] = set()
        self._front: Any = None
        if compiled is not None:
            # A batch of one decode-shape event (an engine step that filled one block) is applied
            # by the compiled entry without a Python frame (about half a lone event's cost was the
            # call, the lock and the checks of `apply`); it hands every other batch to `apply`.
            self._front = compiled.OneEventFront(
                self._backends, self._shared_masks, self._lock, self._apply_python, _SHARED_MASKS_LIMIT,
                general_wire=self._apply_wire_python, over_capacity=self.evict_over_capacity,
            )
            self.apply = self._front.apply  # type: ignore[method-assign]
            self.apply_wire = self._front.apply_wire  # type: ignore[method-assign]

    # ---- backends ----

    def add_backend(self, name: str, max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
        """Make room for a backend (or DP rank) that holds at most `max_blocks` engine blocks."""
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be at least 1, got {max_blocks}")
        with self._lock:
            backend = self._backends.setdefault(name, _Backend(name, max_blocks=max_blocks))
            backend.max_blocks = max_blocks
            if backend.compiled_writer is not None:
                backend.compiled_writer.max_nodes = max_blocks
            self._evict_over_capacity_locked(backend)

    def remove_backend(self, name: str) -> None:
        with self._lock:
            backend = self._backends.pop(name, None)
            if backend is None:
                return
            self._clear_locked(backend)
            for slot in backend.tier_slots.values():
                self._free_slots.append(slot)
            self._layout = {k: v for k, v in self._layout.items() if k != name}

    def clear_backend(self, name: str) -> None:
        """Forget everything a backend holds (engine restarted, or AllBlocksCleared)."""
        with self._lock:
            backend = self._backends.get(name)
            if backend is not None:
                self._clear_locked(backend)

    def replace_backend(self, name: str, events: list[KVEvent]) -> None:
        """Replace everything a backend holds by a snapshot's events, atomically for lookups.

        The snapshot is built into a hidden backend with slots of its own (absent from the
        readers' layout, so no lookup sees it half-built); one assignment of the layout then
        switches readers from the old slots to the new ones, and the old slots are torn down and
        freed. Counters carry over; blocks and tokens are the snapshot's.
        """
        with self._lock:
            old = self._backends.get(name)
            max_blocks = DEFAULT_MAX_BLOCKS if old is None else old.max_blocks
            fresh = _Backend(name, visible=False, max_blocks=max_blocks)
            collecting = gc.isenabled()
            gc.disable()
            try:
                self._apply_locked(fresh, snapshot_order(events))
                self._evict_over_capacity_locked(fresh)
            finally:
                if collecting:
                    gc.enable()
            fresh.visible = True
            self._backends[name] = fresh
            layout = {k: v for k, v in self._layout.items() if k != name}
            if fresh.tier_slots:
                layout[name] = tuple(sorted(fresh.tier_slots.items(), key=lambda item: tier_rank(item[0])))
            self._layout = layout
            if old is None:
                return
            self._sync_stats_locked(old)
            stats, previous = fresh.stats, old.stats
            stats.stored_events += previous.stored_events
            stats.removed_events += previous.removed_events
            stats.cleared_events += previous.cleared_events
            stats.unplaced_blocks += previous.unplaced_blocks
            stats.unknown_removals += previous.unknown_removals
            stats.evicted_blocks += previous.evicted_blocks
            self._clear_locked(old)
            self._free_slots.extend(old.tier_slots.values())

    def backends(self) -> list[str]:
        return list(self._backends)

    # ---- events ----

    def apply(self, backend_name: str, events: list[KVEvent]) -> None:
        """Apply the events of one batch, in order. (With the compiled path built, an instance's
        `apply` is its `OneEventFront`'s, which takes lone decode-shape events and calls
        `_apply_python` for the rest.)"""
        self._apply_python(backend_name, events)

    def _backend_to_write_locked(self, backend_name: str) -> _Backend:
        """The backend events for `backend_name` go to, and its compiled writer where the
        extension is built (both made at its first event); the shared mask objects dropped first
        when there are too many of them."""
        backend = self._backends.get(backend_name)
        if backend is None:
            backend = self._backends[backend_name] = _Backend(backend_name)
        if backend.compiled_writer is None and self._compiled_writer is not None:
            backend.compiled_writer = self._compiled_writer(self, backend)
        if len(self._shared_masks) > _SHARED_MASKS_LIMIT:
            self._shared_masks.clear()
        return backend

    def _apply_python(self, backend_name: str, events: list[KVEvent]) -> None:
        with self._lock:
            backend = self._backend_to_write_locked(backend_name)
            try:
                self._apply_python_locked(backend, events)
            finally:
                if len(backend.nodes) > backend.max_blocks:
                    self._evict_over_capacity_locked(backend)

    def _apply_python_locked(self, backend: _Backend, events: list[KVEvent]) -> None:
        # One-block events of the decode shape (each engine step that fills a block publishes
        # one per request), removals (one per evicted block from vLLM) and a prefill alone in
        # its batch go the compiled path when it is built (`apply_one`, `_apply_compiled_locked`),
        # else the pure-Python paths below. A lone event the compiled path takes gets no GC
        # pause, which would cost more than it saves.
        writer = backend.compiled_writer
        if writer is not None:
            if events.__class__ is not list:  # (the compiled path reads a list)
                events = list(events)
            if len(events) == 1 and writer.apply_one(events[0]):
                return
        elif len(events) == 1 and self._store_one_block_locked(backend, events[0]):
            return
        # The cyclic GC is paused while a batch is applied: a batch allocates thousands of
        # small tuples of ints, which hold no cycles; left on, the collector would run every few
        # hundred of them and sweep the whole index (millions of entries) now and then, about a
        # quarter of the ingest time. Callers hold the lock, so pauses do not nest.
        collecting = gc.isenabled()
        gc.disable()
        try:
            if writer is not None:
                if len(events) == 1:  # (refused above)
                    self._apply_locked(backend, events)
                else:
                    self._apply_compiled_locked(backend, writer, events)
            elif len(events) == 1 or not self._store_decode_step_locked(backend, events):
                self._apply_in_runs_locked(backend, events)
        finally:
            if collecting:
                gc.enable()

    def _apply_compiled_locked(self, backend: _Backend, writer: Any, events: list[KVEvent]) -> None:
        """Events in order: the compiled path applies each run of events it takes in a batch
        (one-block stores of the decode shape, removals of plain blocks) and stops at the first
        other event; the general path takes that one and the events up to the next one-block
        event with a parent or removal (prefills among them, in one numpy pass); the compiled
        path goes on from there, and so on."""
        count = len(events)
        position = 0
        while position < count:
            position = writer.store(events, position)
            if position < count:
                resume = _next_compiled_candidate(events, position + 1)
                self._apply_locked(backend, events[position:resume])
                position = resume

    def apply_wire(self, backend_name: str, batches: list[Any]) -> None:
        """Apply batches as `scan_batch` of the compiled module scanned them (`wire_ingest`), in
        order. The compiled writer reads each batch's events from its payload while they have
        its shapes, and the rest of a batch is decoded and applied as `apply` applies events:
        a decode step's token ids never become Python objects. (An instance's `apply_wire` is its
        `OneEventFront`'s, which calls `_apply_wire_python` from the first event it refuses.)"""
        self._apply_wire_python(backend_name, batches, 0)

    def _apply_wire_python(self, backend_name: str, batches: list[Any], start: int) -> None:
        """`apply_wire`, the first batch from its event at `start`."""
        with self._lock:
            backend = self._backend_to_write_locked(backend_name)
            writer = backend.compiled_writer
            collecting = gc.isenabled()
            gc.disable()
            try:
                for number, batch in enumerate(batches):
                    position = writer.store_wire(batch, start if number == 0 else 0)
                    if position < len(batch):
                        decoded = decode_batch(batch.payload)
                        if decoded.skipped_events or len(decoded.events) != len(batch):
                            # The scan accepts only what the decoder decodes one for one: never here.
                            raise RuntimeError("the decoder and the scan disagree on a payload's events")
                        self._apply_compiled_locked(backend, writer, decoded.events[position:])
            finally:
                if len(backend.nodes) > backend.max_blocks:
                    self._evict_over_capacity_locked(backend)
                if collecting:
                    gc.enable()

    def evict_over_capacity(self, backend_name: str) -> None:
        """Bring a backend back within its `max_blocks` (the compiled entry calls it when a batch
        it applied took the backend past them)."""
        with self._lock:
            backend = self._backends.get(backend_name)
            if backend is not None:
                self._evict_over_capacity_locked(backend)

    def _evict_over_capacity_locked(self, backend: _Backend) -> None:
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
        self._sync_stats_locked(backend)
        victims = list(itertools.islice(nodes, excess + backend.max_blocks // 32))
        tier_of_slot = [(tier, slot, 1 << slot) for tier, slot in backend.tier_slots.items()]
        stats = backend.stats
        for node_key in victims:
            node = nodes[node_key]
            for tier, slot, bit in tier_of_slot:
                if node[_SLOTS] & bit:
                    node = self._unregister_locked(node, slot, bit)
                    stats.blocks[tier] -= 1
                    stats.tokens[tier] -= node[_TOKENS]
            self._forget_node_locked(backend, node_key, node)
        stats.evicted_blocks += len(victims)

    def wire_ingest(self, backend_name: str) -> WireIngest | None:
        """What a subscriber uses to hand `backend_name` payloads without decoding them, or None
        when this index has no compiled path (the subscriber decodes every payload)."""
        if self._compiled_writer is None:
            return None
        # (a partial of the compiled entry: no Python frame per drained run of messages)
        return WireIngest(_compiled_ingest.scan_batch, functools.partial(self.apply_wire, backend_name))

    def _store_one_block_locked(self, backend: _Backend, event: KVEvent) -> bool:
        """`_store_decode_step_locked` for a batch of one event, in plain Python (an engine step
        that filled one block publishes it alone; per-batch passes would cost more than the event)."""
        if not isinstance(event, BlockStored) or event.block_size != ROUTER_BLOCK_TOKENS or event.group_idx:
            return False
        hashes, token_ids = event.block_hashes, event.token_ids
        if len(hashes) != 1 or len(token_ids) != ROUTER_BLOCK_TOKENS:
            return False
        nodes = backend.nodes
        parent = nodes.get(event.parent_block_hash)
        block_hash = hashes[0]
        if parent is None or parent[_TAIL] or block_hash in nodes:
            return False
        parent_end, _, boundary, _, _, chain_id, _ = parent
        try:
            key = (boundary + _python_block_value(token_ids, parent_end // ROUTER_BLOCK_TOKENS)) & _WORD
        except (struct.error, TypeError):  # token ids that are not uint32: the general path counts them
            return False
        slot_bit_tier = backend.medium_slots.get(event.medium)
        if slot_bit_tier is None:
            slot_bit_tier = self._medium_slot_locked(backend, event.medium)
        _, bit, tier = slot_bit_tier
        holders = self._holders
        mask = holders.get(key, 0)
        if mask & bit:
            return False
        end = parent_end + ROUTER_BLOCK_TOKENS
        nodes[block_hash] = (end, ROUTER_BLOCK_TOKENS, key, (), key, chain_id, bit)
        holders[key] = self._share(mask | bit, mask | bit) if mask else bit
        chain = backend.chains[chain_id]
        chain.nodes += 1
        if end > chain.longest:
            chain.longest = end
        stats = backend.stats
        stats.stored_events += 1
        stats.blocks[tier] += 1
        stats.tokens[tier] += ROUTER_BLOCK_TOKENS
        return True

    def _medium_slot_locked(self, backend: _Backend, medium: str | None) -> tuple[int, int, str]:
        """(slot, bit, tier) of an event's medium on a backend, remembered per spelling (a slot
        lives as long as its backend); the bit is the shared mask object."""
        tier = tier_of(medium)
        slot = self._slot_locked(backend, tier)
        slot_bit_tier = backend.medium_slots[medium] = (slot, self._share(1 << slot, 1 << slot), tier)
        return slot_bit_tier

    def _held_medium_slot_locked(self, backend: _Backend, medium: str | None) -> tuple[int, int, str] | None:
        """`_medium_slot_locked` for a removal: None (and no slot made) when the backend holds
        nothing in the medium's tier."""
        slot_bit_tier = backend.medium_slots.get(medium)
        if slot_bit_tier is None and tier_of(medium) in backend.tier_slots:
            slot_bit_tier = self._medium_slot_locked(backend, medium)
        return slot_bit_tier

    def _store_decode_step_locked(self, backend: _Backend, events: list[KVEvent]) -> bool:
        """A decode step's batch, applied column by column; False (nothing changed) for any other.

        The shape: only BlockStored, each of one 16-token block of one medium, KV-cache group 0,
        whose parent was placed before the batch and ends on a router-block boundary, new to the
        backend, and completing a prefix no slot of the tier holds yet. That is what an engine
        publishes during decode: one block per running request that filled one. Every check and
        every insert is a C-level pass over the batch (`map`, `zip`, `dict.update`), and the keys
        are one numpy pass (plain ints below `_NUMPY_MIN_BLOCKS`), so a step costs a few Python
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
        hashes, parent_hashes, token_ids = columns[_HASHES], columns[_PARENT_HASH], columns[_TOKEN_IDS]
        block_sizes, media, groups = columns[_BLOCK_SIZE], columns[_MEDIUM], columns[_GROUP]
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
            ends = list(map(operator.add, parent_ends, _SIXTEEN))
            chain_ids = list(map(_node_chain, parents))
        else:
            chained = self._chained_ends_locked(parents, parent_hashes, block_hashes)
            if chained is None:
                return False
            ends, chain_ids, earlier = chained
            parent_ends = list(map(operator.sub, ends, _SIXTEEN))
        stream = array.array("I")
        try:
            # `fromlist` per event (consumed in C by `any`: it returns None) is twice as fast as
            # building the array from one chained list; it leaves the array as it was on failure.
            any(map(stream.fromlist, token_ids))
        except (OverflowError, TypeError):  # token ids that are not uint32: the general path counts them
            return False
        positions = map(operator.floordiv, parent_ends, _SIXTEEN)
        if count < _NUMPY_MIN_BLOCKS:  # two events: plain ints beat numpy's per-call cost
            offsets = range(0, len(stream), ROUTER_BLOCK_TOKENS)
            block_values = [
                _python_block_value(stream[offset : offset + ROUTER_BLOCK_TOKENS], position)
                for offset, position in zip(offsets, positions, strict=False)
            ]
            if placed:
                bases = map(_node_boundary, parents)
                keys = [(base + value) & _WORD for base, value in zip(bases, block_values, strict=True)]
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
                keys.append(((parent[_BOUNDARY] if parent is not None else keys[position]) + value) & _WORD)
        medium = media[0]
        slot_bit_tier = backend.medium_slots.get(medium)
        if slot_bit_tier is None:
            slot_bit_tier = self._medium_slot_locked(backend, medium)
        _, bit, tier = slot_bit_tier
        share = self._share
        holders = self._holders
        # Prefixes new to every slot (the usual: decoded tokens are the request's own) need no masks.
        held = 0
        if not holders.keys().isdisjoint(keys):
            masks = list(map(holders.get, keys, itertools.repeat(0, count)))
            held = functools.reduce(operator.or_, masks, 0)
        # A prefix this tier already holds (or two events of the step completing one prefix):
        # the general path keeps the reference counts.
        if held & bit or (count > 1 and len(set(keys)) != count):
            return False
        new_nodes = zip(ends, _SIXTEEN, keys, _NO_TAIL, keys, chain_ids, itertools.repeat(bit), strict=False)
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

    def _apply_in_runs_locked(self, backend: _Backend, events: list[KVEvent]) -> None:
        """Events in order. In a long list (a drained burst of messages, a replay), each run of
        one-block BlockStored events with a parent (decode steps) is tried on the decode-step path
        and the events between the runs (prefills, removals, clears) go the general way."""
        if len(events) < _RUN_SPLIT_MIN_EVENTS:
            self._apply_locked(backend, events)
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
                self._store_one_block_locked(backend, part[0])
                if len(part) == 1
                else self._store_decode_step_locked(backend, part)
            ):
                continue
            self._apply_locked(backend, part)

    @staticmethod
    def _chained_ends_locked(
        parents: list[_Node | None], parent_hashes: Sequence[Any], block_hashes: list[Any]
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
                if parent[_TAIL]:
                    return None
                ends.append(parent[_END] + ROUTER_BLOCK_TOKENS)
                chain_ids.append(parent[_CHAIN])
            elif 0 <= position < index:
                ends.append(ends[position] + ROUTER_BLOCK_TOKENS)
                chain_ids.append(chain_ids[position])
            else:  # unknown parent (or None: a chain's first block), or a child listed before its parent
                return None
        return ends, chain_ids, earlier

    def _apply_locked(self, backend: _Backend, events: list[KVEvent]) -> None:
        # Consecutive BlockStored events of whole router blocks whose parents are already placed
        # (the common case: one event per request per engine step) are hashed together in one
        # numpy pass and inserted with whole-batch dict updates; anything else is applied one by
        # one, in order.
        pending: list[_PendingStore] = []
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
                    node_keys = prepared[_P_NODE_KEYS]
                    if len(node_keys) == 1:
                        pending_hashes.add(node_keys[0])
                    else:
                        pending_hashes.update(node_keys)
                    continue
                self._flush_stores_locked(backend, pending, pending_hashes)
                self._store_locked(backend, event)
                continue
            self._flush_stores_locked(backend, pending, pending_hashes)
            if isinstance(event, BlockRemoved):
                self._remove_locked(backend, event)
            elif isinstance(event, AllBlocksCleared):
                backend.stats.cleared_events += 1
                self._clear_locked(backend)
        self._flush_stores_locked(backend, pending, pending_hashes)

    @staticmethod
    def _depends_on(event: BlockStored, pending_hashes: set[Any]) -> bool:
        group = event.group_idx or 0
        parent = event.parent_block_hash
        keys = event.block_hashes if group == 0 else [(group, h) for h in event.block_hashes]
        parent_key = parent if group == 0 else (group, parent)
        return parent_key in pending_hashes or any(map(pending_hashes.__contains__, keys))

    def _prepare_store_locked(
        self, backend: _Backend, event: BlockStored, pending_hashes: set[Any]
    ) -> _PendingStore | None:
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
            chain_id, boundary_key = self._root_chain_locked(backend, event, count * block_size)
            parent_end = 0
        else:
            parent = nodes.get((group, parent_hash) if group else parent_hash)
            if parent is None or parent[_TAIL]:
                return None
            parent_end, boundary_key, chain_id = parent[_END], parent[_BOUNDARY], parent[_CHAIN]
        slot_bit_tier = backend.medium_slots.get(event.medium)
        if slot_bit_tier is None:
            slot_bit_tier = self._medium_slot_locked(backend, event.medium)
        slot = slot_bit_tier[0]
        return (node_keys, token_ids, count, block_size, parent_end, boundary_key, chain_id, slot)

    def _root_chain_locked(self, backend: _Backend, event: BlockStored, covered: int) -> tuple[int, int]:
        """The chain a BlockStored without a parent starts (made if new: its namespace and the
        preview of its first `covered` tokens name it) and the key of its namespace's empty prefix."""
        preview = tuple(event.token_ids[: min(covered, PREVIEW_TOKENS)])
        return self._chain_for_locked(backend, (event.lora_name, cache_salt_of(event)), preview)

    def _chain_for_locked(
        self, backend: _Backend, namespace: Namespace, preview: tuple[int, ...]
    ) -> tuple[int, int]:
        """The chain of a root in `namespace` whose first tokens are `preview` (made if new) and
        the key of its namespace's empty prefix."""
        if namespace[0] is not None:
            self.lora_names.add(namespace[0])
        chain_id = backend.chain_ids.get((namespace, preview))
        if chain_id is None:
            chain_id = backend.chain_ids[(namespace, preview)] = backend.next_chain_id
            backend.next_chain_id += 1
            backend.chains[chain_id] = _Chain(preview, namespace)
        return chain_id, namespace_seed(namespace)

    def _flush_stores_locked(self, backend: _Backend, pending: list[_PendingStore], hashes: set[Any]) -> None:
        if not pending:
            return
        stream = array.array("I")
        valid = []
        for store in pending:
            token_ids, covered = store[_P_TOKEN_IDS], store[_P_COUNT] * store[_P_BLOCK_SIZE]
            before = len(stream)
            try:
                _extend_tokens(stream, token_ids if len(token_ids) == covered else token_ids[:covered])
            except (OverflowError, TypeError):  # token ids that are not uint32: nothing to index
                del stream[before:]
                backend.stats.stored_events += 1
                backend.stats.unplaced_blocks += store[_P_COUNT]
                continue
            valid.append(store)
        pending[:] = valid
        if not pending:
            hashes.clear()
            return
        blocks_per_event = [
            store[_P_COUNT] * (store[_P_BLOCK_SIZE] // ROUTER_BLOCK_TOKENS) for store in pending
        ]
        total = len(stream) // ROUTER_BLOCK_TOKENS
        if total < _NUMPY_MIN_BLOCKS:  # one or two blocks: Python ints beat numpy's call overhead
            all_keys = []
            offset = 0
            for store, length in zip(pending, blocks_per_event, strict=True):
                end = offset + length * ROUTER_BLOCK_TOKENS
                all_keys += _python_prefix_keys(
                    stream[offset:end], store[_P_BOUNDARY_KEY], store[_P_PARENT_END] // ROUTER_BLOCK_TOKENS
                )
                offset = end
        elif len(pending) == 1:  # one event (a prefill): one running sum from its parent's key
            store = pending[0]
            all_keys = prefix_keys(
                np.frombuffer(stream, dtype=np.uint32),
                store[_P_BOUNDARY_KEY],
                store[_P_PARENT_END] // ROUTER_BLOCK_TOKENS,
            ).tolist()
        elif total == len(pending):  # one router block per event (decode steps): no running sums
            positions = (
                np.fromiter((store[_P_PARENT_END] for store in pending), np.int64, len(pending))
                // ROUTER_BLOCK_TOKENS
            )
            values = router_block_values(np.frombuffer(stream, dtype=np.uint32), positions)
            bases = np.asarray([store[_P_BOUNDARY_KEY] for store in pending], dtype=np.uint64)
            all_keys = (values + bases).tolist()
        else:
            lengths = np.asarray(blocks_per_event, dtype=np.int64)
            starts = np.cumsum(lengths) - lengths
            firsts = np.fromiter((store[_P_PARENT_END] for store in pending), np.int64, len(pending))
            shifts = firsts // ROUTER_BLOCK_TOKENS - starts
            positions = np.arange(total, dtype=np.int64) + np.repeat(shifts, lengths)
            values = router_block_values(np.frombuffer(stream, dtype=np.uint32), positions)
            sums = np.cumsum(values, dtype=np.uint64)
            # key = boundary_key + (sums[i] - sums[start - 1]): one subtraction per event, wrapping.
            before = np.concatenate([np.zeros(1, dtype=np.uint64), sums[:-1]])[starts]
            bases = np.asarray([store[_P_BOUNDARY_KEY] for store in pending], dtype=np.uint64) - before
            all_keys = (sums + np.repeat(bases, lengths)).tolist()

        if not self._flush_uniform_locked(backend, pending, all_keys):
            self._flush_general_locked(backend, pending, blocks_per_event, all_keys)
        pending.clear()
        hashes.clear()

    def _flush_uniform_locked(
        self, backend: _Backend, pending: list[_PendingStore], all_keys: list[int]
    ) -> bool:
        """The common shape (16-token blocks, one tier, prefixes new to it) in whole-batch passes."""
        slot = pending[0][_P_SLOT]
        for store in pending:
            if store[_P_BLOCK_SIZE] != ROUTER_BLOCK_TOKENS or store[_P_SLOT] != slot:
                return False
        holders = self._holders
        masks = list(map(holders.get, all_keys, itertools.repeat(0, len(all_keys))))
        share = self._share
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
                end = store[_P_PARENT_END] + ROUTER_BLOCK_TOKENS
                chain_id = store[_P_CHAIN_ID]
                nodes[store[_P_NODE_KEYS][0]] = (end, ROUTER_BLOCK_TOKENS, key, (), key, chain_id, bit)
                chain = chains[chain_id]
                chain.nodes += 1
                if end > chain.longest:
                    chain.longest = end
        else:
            offset = 0
            for store in pending:
                count, parent_end, chain_id = store[_P_COUNT], store[_P_PARENT_END], store[_P_CHAIN_ID]
                keys = all_keys[offset : offset + count]
                offset += count
                end = parent_end + ROUTER_BLOCK_TOKENS * count
                # The node tuples are built by zip in C: (end, tokens, boundary, tail, keys, chain, slots).
                block_ends = range(parent_end + ROUTER_BLOCK_TOKENS, end + 1, ROUTER_BLOCK_TOKENS)
                node_values = zip(
                    block_ends,
                    _SIXTEEN,
                    keys,
                    _NO_TAIL,
                    keys,
                    itertools.repeat(chain_id),
                    itertools.repeat(bit),
                )
                nodes.update(zip(store[_P_NODE_KEYS], node_values, strict=True))
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
        backend: _Backend,
        pending: list[_PendingStore],
        blocks_per_event: list[int],
        all_keys: list[int],
    ) -> None:
        """Any block size that is a multiple of the router block, any tier, prefixes held before."""
        holders = self._holders
        nodes = backend.nodes
        stats = backend.stats
        slot_tiers = {slot: tier for tier, slot in backend.tier_slots.items()}
        offset = 0
        for store, length in zip(pending, blocks_per_event, strict=True):
            node_keys, _, count, block_size, parent_end, _, chain_id, slot = store
            keys = all_keys[offset : offset + length]
            offset += length
            bit = self._share(1 << slot, 1 << slot)
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
                extra_refs = self._extra_refs
                for key in keys:
                    mask = holders.get(key, 0)
                    if mask & bit:
                        extra_refs[(key, slot)] = extra_refs.get((key, slot), 0) + 1
                    else:
                        holders[key] = self._share(mask | bit, mask | bit)
            else:
                updated = [mask | bit for mask in masks]
                holders.update(zip(keys, map(self._share, updated, updated), strict=True))
            chain = backend.chains[chain_id]
            chain.nodes += count
            chain.longest = max(chain.longest, ends[-1])
            tier = slot_tiers[slot]
            stats.stored_events += 1
            stats.blocks[tier] += count
            stats.tokens[tier] += count * block_size

    def _slot_locked(self, backend: _Backend, tier: str) -> int:
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

    def _store_locked(self, backend: _Backend, event: BlockStored) -> None:
        stats = backend.stats
        stats.stored_events += 1
        hashes = event.block_hashes
        count = len(hashes)
        if count == 0:
            return
        tier = tier_of(event.medium)
        slot = self._slot_locked(backend, tier)
        bit = self._share(1 << slot, 1 << slot)
        group = event.group_idx or 0
        nodes = backend.nodes
        # Engine hashes are only unique within a KV-cache group; group 0 (the usual) keys by hash alone.
        node_keys = hashes if group == 0 else [(group, block_hash) for block_hash in hashes]
        added_blocks = added_tokens = 0

        # Blocks already placed (the same block announced again in another tier) only gain the tier.
        first_new = 0
        while first_new < count and node_keys[first_new] in nodes:
            node = nodes[node_keys[first_new]]
            if not node[_SLOTS] & bit:
                nodes[node_keys[first_new]] = self._register_locked(node, slot, bit)
                added_blocks += 1
                added_tokens += node[_TOKENS]
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
        parent: _Node | None = None
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
        backend: _Backend,
        event: BlockStored,
        node_keys: Sequence[Any],
        first_new: int,
        parent: _Node | None,
        block_size: int,
        covered: int,
        skip: int,
        bit: int,
    ) -> tuple[int, int]:
        """Create nodes for blocks first_new.. of a BlockStored whose parent position is known."""
        token_ids = event.token_ids
        nodes = backend.nodes
        if parent is None:
            chain_id, boundary_key = self._root_chain_locked(backend, event, covered)
            parent_end, parent_tail = 0, ()
            chain = backend.chains[chain_id]
        else:
            parent_end, _, boundary_key, parent_tail, _, chain_id, _ = parent
            chain = backend.chains[chain_id]
        # `stream` starts at the last router-block boundary before this block's first token.
        stream = array.array("I", parent_tail)
        _extend_tokens(stream, token_ids[skip:covered] if skip else token_ids[:covered])
        aligned_start = parent_end - len(parent_tail)
        keys = _stream_keys(stream, boundary_key, aligned_start // ROUTER_BLOCK_TOKENS)

        slot = bit.bit_length() - 1
        holders = self._holders
        extra_refs = self._extra_refs
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
            if not node[_SLOTS] & bit:
                if tail:
                    node = self._register_locked(node, slot, bit)
                else:  # inlined fast path: whole router blocks only
                    for key in _owned(node[_KEYS]):
                        mask = holders.get(key, 0)
                        if mask & bit:
                            extra_refs[(key, slot)] = extra_refs.get((key, slot), 0) + 1
                        else:
                            holders[key] = self._share(mask | bit, mask | bit)
                    node = (*node[:_SLOTS], node[_SLOTS] | bit)
                added_blocks += 1
                added_tokens += node[_TOKENS]
            nodes[node_key] = node
            previous_full, previous_end = full, end
        return added_blocks, added_tokens

    def _register_locked(self, node: _Node, slot: int, bit: int) -> _Node:
        """Mark the node's prefixes as held in `slot`; returns the node with the slot added."""
        holders = self._holders
        for key in _owned(node[_KEYS]):
            mask = holders.get(key, 0)
            if mask & bit:
                ref = (key, slot)
                self._extra_refs[ref] = self._extra_refs.get(ref, 0) + 1
            else:
                holders[key] = self._share(mask | bit, mask | bit)
        boundary, tail = node[_BOUNDARY], node[_TAIL]
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
        return (*node[:_SLOTS], node[_SLOTS] | bit)

    def _unregister_locked(self, node: _Node, slot: int, bit: int) -> _Node:
        """Unmark the node's prefixes in `slot`; returns the node without the slot."""
        holders = self._holders
        for key in _owned(node[_KEYS]):
            ref = (key, slot)
            extra = self._extra_refs.get(ref)
            if extra:
                if extra == 1:
                    del self._extra_refs[ref]
                else:
                    self._extra_refs[ref] = extra - 1
                continue
            mask = holders.get(key, 0) & ~bit
            if mask:
                holders[key] = self._share(mask, mask)
            else:
                holders.pop(key, None)
        boundary, tail = node[_BOUNDARY], node[_TAIL]
        if tail:
            self._unregister_tail_locked(boundary, tail, slot, bit)
        return (*node[:_SLOTS], node[_SLOTS] & ~bit)

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

    def _remove_locked(self, backend: _Backend, event: BlockRemoved) -> None:
        stats = backend.stats
        stats.removed_events += 1
        tier = tier_of(event.medium)
        slot = backend.tier_slots.get(tier)
        group = event.group_idx or 0
        nodes = backend.nodes
        for block_hash in event.block_hashes:
            node_key = block_hash if group == 0 else (group, block_hash)
            node = nodes.get(node_key)
            if node is None or slot is None or not node[_SLOTS] & (1 << slot):
                stats.unknown_removals += 1
                continue
            node = self._unregister_locked(node, slot, 1 << slot)
            stats.blocks[tier] -= 1
            stats.tokens[tier] -= node[_TOKENS]
            if node[_SLOTS]:
                nodes[node_key] = node
            else:
                self._forget_node_locked(backend, node_key, node)

    @staticmethod
    def _forget_node_locked(backend: _Backend, node_key: Any, node: _Node) -> None:
        """Drop a node no slot holds any more, and its chain with the chain's last node."""
        del backend.nodes[node_key]
        chain = backend.chains.get(node[_CHAIN])
        if chain is not None:
            chain.nodes -= 1
            if chain.nodes <= 0:
                del backend.chains[node[_CHAIN]]
                backend.chain_ids.pop((chain.namespace, chain.preview), None)

    @staticmethod
    def _sync_stats_locked(backend: _Backend) -> None:
        """The compiled entry leaves a lone event's stats pending in the backend's writer: add
        them before the stats are read or zeroed (adding commutes with every other update)."""
        if backend.compiled_writer is not None:
            backend.compiled_writer.flush_stats()

    def _clear_locked(self, backend: _Backend) -> None:
        self._sync_stats_locked(backend)
        for node in backend.nodes.values():
            for slot in backend.tier_slots.values():
                bit = 1 << slot
                if node[_SLOTS] & bit:
                    node = self._unregister_locked(node, slot, bit)
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
        """`_slot_runs` for keys the caller computed: the same probes, no tokens read."""
        holders = self._holders
        try:
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
        holders = self._holders
        total = len(array) // ROUTER_BLOCK_TOKENS
        keys: list[int] = []
        parts = []
        try:
            for span_start in range(0, total, _LOOKUP_SPAN_BLOCKS):
                span_end = min(total, span_start + _LOOKUP_SPAN_BLOCKS)
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
            self._sync_stats_locked(backend)
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
        return (model if model in self.lora_names else None, cache_salt)

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
            "router_keys": len(self._holders),
            "engine_blocks": sum(len(backend.nodes) for backend in list(self._backends.values())),
        }

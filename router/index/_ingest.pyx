# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Compiled ingest of the KV events engines publish most: BlockStored of 16-token blocks (one
block per request and decode step; a prefill's blocks in one event) and BlockRemoved (one per
evicted block from vLLM), into the prefix index's own Python dicts.

`BackendWriter(index, backend).store(events, start)` applies `events[start:]` in order while
each is of a shape described below and returns the position of the first one it did not apply
(the caller hands that one and the events after it to the pure-Python paths of
`router/index/python_writer.py`'s `PythonWriter`, the reference). Shapes are checked per event against
the index as it stands after the events before it; an event outside them changes nothing.

The decode shape: a BlockStored of one 16-token block (`block_size` 16, `token_ids` a list of 16
uint32 ints), KV-cache group 0, its parent placed on the backend and ending on a router-block
boundary (no tail), its hash new to the backend, and the prefix it completes not yet held by the
event's tier. For it, this builds exactly what `PythonWriter.store_one_block_locked` builds: the
node tuple `(end, 16, key, (), key, chain_id, bit)` in `backend.nodes`, the holder mask in
`index.holders` (the tier's shared bit for a prefix nobody held, else the shared object of
`mask | bit` from `index.shared_masks`), the chain's `nodes` and `longest`, and the backend's
stats. The router key is the parent's boundary key plus the block's mixed value, in C uint64
arithmetic: `block_mix` of router/index/_keys.pxd, the C statement of `keys.mix`, with the
constants of router/index/keys.py handed over once by `configure`.

The prefill shape, alone in its batch (`BackendWriter.apply_one`, `CompiledEntry`; in a batch of
several, the Python path's one numpy pass over all of them is as fast): a BlockStored of any
number of 16-token blocks (at least 16 per block of uint32 token ids), group 0, a root (the index
makes or finds its chain: `PrefixIndex.root_chain_locked`) or the child of a placed block without a tail,
its hashes distinct and new to the backend, and no prefix it completes held by its tier. It gets
what `PythonWriter._flush_uniform_locked` gives one such event: a node per block as above, the keys
running sums from the parent's boundary key (or the namespace's seed).

A BlockRemoved (KV-cache group 0, a medium the backend has stored under) is applied here as
`PythonWriter.remove_locked` applies it when each of its blocks is unknown to the tier (counted
as an unknown removal) or a plain node: no tail, and no second reference to any prefix it owns
(`index.extra_refs`). Each prefix loses the tier's bit in `index.holders` (the key goes with
the last bit), the node loses it too (the node goes with its last slot, and its chain with its
last node), and the stats follow. An event with any other block is left whole to the Python path.

The same shapes are taken from msgpack payloads without decoding them: the wire protocol's
compiled frame reader (`kvwire/_frames.pyx`: `scan_batch`, `WireBatch`, its readers cimported
from `kvwire/_frames.pxd`) checks a payload and notes where each event's fields lie, and
`BackendWriter.store_wire` reads hashes and token ids from the bytes through those readers.

Callers hold the index's writer lock; lookups read the same dicts without it (each insert is one
dict store, as in the Python paths).
"""

from cpython.object cimport PyObject
from cpython.pythread cimport (
    NOWAIT_LOCK, WAIT_LOCK, PyThread_acquire_lock, PyThread_allocate_lock, PyThread_free_lock,
    PyThread_release_lock, PyThread_type_lock,
)
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cpython.ref cimport Py_INCREF, Py_XDECREF
from libc.stdint cimport int64_t, uint32_t, uint64_t

from kvwire._frames cimport (
    KIND_REMOVED, KIND_STORED, EventView, WireBatch, hash_object, text_object, token_words_at,
)
from router.index._keys cimport FINALISER_STEP_COUNT, KeyMath, block_mix, token_word

import types

cdef extern from "Python.h":
    PyObject* PyDict_GetItemWithError(object mapping, object key) except? NULL
    PyObject* PyDict_SetDefault(object mapping, object key, object value) except NULL
    int PyDict_Contains(object mapping, object key) except -1
    Py_ssize_t PyList_GET_SIZE(object items)
    Py_ssize_t PyDict_GET_SIZE(object mapping)
    PyObject* PyList_GET_ITEM(object items, Py_ssize_t position)
    Py_ssize_t PyTuple_GET_SIZE(object items)
    PyObject* PyTuple_GET_ITEM(object items, Py_ssize_t position)
    bint PyLong_Check(PyObject* value)
    bint PyLong_CheckExact(PyObject* value)
    bint PyList_CheckExact(PyObject* value)
    bint PyTuple_CheckExact(PyObject* value)
    long long PyLong_AsLongLongAndOverflow(PyObject* value, int* overflow)
    unsigned long long PyLong_AsUnsignedLongLong(object value) except? <unsigned long long>-1
    void PyObject_GC_UnTrack(void* value)
    object PyLong_FromUnsignedLongLong(unsigned long long value)
    ctypedef struct PyMemberDef:
        Py_ssize_t offset
    ctypedef struct PyMemberDescrObject:
        PyMemberDef* d_member

# Router-block size and the node layout this module writes (`configure` checks the index agrees).
cdef enum:
    BLOCK_TOKENS = 16
    WORDS = 8
NODE_LAYOUT = ("end", "tokens", "boundary_key", "tail", "keys", "chain_id", "slots")
cdef object _BLOCK_TOKENS_OBJECT = BLOCK_TOKENS
cdef tuple _NO_TAIL = ()
# The `end` of a node (tokens from the prompt's start through its block) as one shared int object
# per value, for prompts up to 2**18 tokens: no allocation per event, 32 bytes less per node.
cdef enum:
    SHARED_ENDS = 1 << 14
cdef list _shared_ends = [position * BLOCK_TOKENS for position in range(SHARED_ENDS)]

# The index's key constants (`configure`): nothing is stored before they are set.
cdef KeyMath _key_math
cdef bint _configured = False
# Tokens of a root's start that name its chain (the index's PREVIEW_TOKENS).
cdef Py_ssize_t _preview_tokens = 0
# The backend attribute with the most blocks it may hold (`IndexedBackend.max_blocks`).
cdef str _capacity_field = None
# The index's `Namespace` (a root read from a payload names its chain by one).
cdef object _namespace_class = tuple

# Events, chains and their fields are read and written at their slot offsets (msgspec Structs and
# slotted dataclasses keep each field in a fixed slot, exposed by a member descriptor): one load
# instead of an attribute lookup. Only the classes `configure` checked are read this way; any
# other event class is left to the Python paths.
cdef object _event_class = None, _event_subclass = None
cdef Py_ssize_t _block_hashes_at, _parent_hash_at, _token_ids_at, _block_size_at, _medium_at, _group_at
cdef object _chain_class = None
cdef Py_ssize_t _chain_nodes_at, _chain_longest_at
cdef object _removed_class = None, _removed_subclass = None
cdef Py_ssize_t _removed_hashes_at, _removed_medium_at, _removed_group_at


cdef Py_ssize_t _slot_offset(cls, str name) except -1:
    """The offset of a slotted field of `cls` (its member descriptor's), checked on an instance."""
    descriptor = None
    for klass in cls.__mro__:
        if name in klass.__dict__:
            descriptor = klass.__dict__[name]
            break
    if type(descriptor) is not types.MemberDescriptorType:
        raise ValueError(f"{cls.__name__}.{name} is not a slot")
    return (<PyMemberDescrObject*>descriptor).d_member.offset


cdef inline PyObject* _field(object instance, Py_ssize_t offset) noexcept:
    """A slot's value (borrowed; NULL when unset)."""
    return (<PyObject**>((<char*><PyObject*>instance) + offset))[0]


cdef inline void _set_field(object instance, Py_ssize_t offset, object value) noexcept:
    cdef PyObject** slot = <PyObject**>((<char*><PyObject*>instance) + offset)
    cdef PyObject* old = slot[0]
    Py_INCREF(value)
    slot[0] = <PyObject*>value
    Py_XDECREF(old)


def _same_slots_subclass(cls, names):
    """The wire decoder's array-encoded subclass of `cls` (one at most), when it keeps `cls`'s
    slots for `names`; else `cls` itself."""
    for subclass in cls.__subclasses__():
        if all(_slot_offset(subclass, name) == _slot_offset(cls, name) for name in names):
            return subclass
    return cls


_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "medium", "group_idx")
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


def configure(word_weights, uint64_t position_weight, finaliser_steps,
              int block_tokens, tuple node_layout, block_stored_class, chain_class,
              block_removed_class=None, *, Py_ssize_t preview_tokens, str capacity_field,
              namespace_class):
    """Hand over the index's key constants (keys.py: `WORD_WEIGHT_INTS`, `POSITION_WEIGHT_INT`,
    `FINALISER_STEPS`), the BlockStored class, the index's chain class
    (`Chain`), the BlockRemoved class (None: removals stay with the Python path), the tokens
    that name a root's chain (`PREVIEW_TOKENS`) and the backend attribute holding its most
    blocks (`IndexedBackend.max_blocks`) and the index's `Namespace` class; ValueError for a
    mismatch (another block size, node layout or field layout)."""
    global _configured, _event_class, _event_subclass, _chain_class
    global _preview_tokens, _capacity_field, _namespace_class
    global _block_hashes_at, _parent_hash_at, _token_ids_at, _block_size_at, _medium_at, _group_at
    global _chain_nodes_at, _chain_longest_at
    global _removed_class, _removed_subclass, _removed_hashes_at, _removed_medium_at, _removed_group_at
    weights = tuple(word_weights)
    steps = tuple(finaliser_steps)
    if block_tokens != BLOCK_TOKENS or len(weights) != WORDS:
        raise ValueError(f"compiled for {BLOCK_TOKENS}-token router blocks of {WORDS} words, "
                         f"not {block_tokens} tokens and {len(weights)} weights")
    if len(steps) != FINALISER_STEP_COUNT or not all(0 < steps[index] < 64 for index in (0, 2, 4)):
        raise ValueError(f"compiled for a finaliser of {FINALISER_STEP_COUNT} steps (shift, multiplier, "
                         f"shift, multiplier, shift; shifts below 64), not {steps}")
    if node_layout != NODE_LAYOUT:
        raise ValueError(f"compiled for node tuples {NODE_LAYOUT}, the index has {node_layout}")
    removed_offsets = None
    if block_removed_class is not None:
        removed_offsets = [_slot_offset(block_removed_class, name) for name in _REMOVED_FIELDS]
    _configured = False
    for position in range(WORDS):
        _key_math.word_weights[position] = weights[position]
    _key_math.position_weight = position_weight
    for position in range(FINALISER_STEP_COUNT):
        _key_math.finaliser[position] = steps[position]
    _preview_tokens = preview_tokens
    _capacity_field = capacity_field
    _namespace_class = namespace_class
    _block_hashes_at = _slot_offset(block_stored_class, "block_hashes")
    _parent_hash_at = _slot_offset(block_stored_class, "parent_block_hash")
    _token_ids_at = _slot_offset(block_stored_class, "token_ids")
    _block_size_at = _slot_offset(block_stored_class, "block_size")
    _medium_at = _slot_offset(block_stored_class, "medium")
    _group_at = _slot_offset(block_stored_class, "group_idx")
    _event_class = block_stored_class
    _event_subclass = _same_slots_subclass(block_stored_class, _STORED_FIELDS)
    _chain_nodes_at = _slot_offset(chain_class, "nodes")
    _chain_longest_at = _slot_offset(chain_class, "longest")
    _chain_class = chain_class
    _removed_class = _removed_subclass = None
    if removed_offsets is not None:
        _removed_hashes_at, _removed_medium_at, _removed_group_at = removed_offsets
        _removed_subclass = _same_slots_subclass(block_removed_class, _REMOVED_FIELDS)
        _removed_class = block_removed_class
    _configured = True


cdef inline bint _token_word(PyObject* low_item, PyObject* high_item, uint64_t* word) noexcept:
    """Two token ids as one little-endian word; False unless both are ints in uint32 range."""
    cdef int overflow = 0
    cdef long long low, high
    if not PyLong_Check(low_item) or not PyLong_Check(high_item):
        return False
    low = PyLong_AsLongLongAndOverflow(low_item, &overflow)
    if overflow or low < 0 or low > 0xFFFFFFFF:
        return False
    high = PyLong_AsLongLongAndOverflow(high_item, &overflow)
    if overflow or high < 0 or high > 0xFFFFFFFF:
        return False
    word[0] = token_word(<uint64_t>low, <uint64_t>high)
    return True


cdef inline bint _block_value(object token_ids, uint64_t position, uint64_t* value) noexcept:
    """The mixed value of one router block at `position`; False unless `token_ids` is a list of
    16 uint32 ints. Arithmetic wraps modulo 2**64, as the index's key math does."""
    if not PyList_CheckExact(<PyObject*>token_ids) or PyList_GET_SIZE(token_ids) != BLOCK_TOKENS:
        return False
    return _block_value_at(token_ids, 0, position, value)


cdef inline bint _list_words(object token_ids, Py_ssize_t first, uint64_t* words) noexcept:
    """The 8 little-endian words of the 16 tokens from `first` of a list that holds them (the
    caller checks its length); False unless they are uint32 ints."""
    cdef Py_ssize_t index
    for index in range(WORDS):
        if not _token_word(PyList_GET_ITEM(token_ids, first + 2 * index),
                           PyList_GET_ITEM(token_ids, first + 2 * index + 1), &words[index]):
            return False
    return True


cdef inline bint _block_value_at(object token_ids, Py_ssize_t first, uint64_t position, uint64_t* value) noexcept:
    """`_block_value` of the 16 tokens from `first` of a list that holds them (the caller checks
    its length); False unless they are uint32 ints."""
    cdef uint64_t words[WORDS]
    if not _list_words(token_ids, first, words):
        return False
    value[0] = block_mix(&_key_math, words, position)
    return True


def block_value(token_ids, uint64_t position):
    """The mixed value of one 16-token block (for checks against `keys.block_value`);
    ValueError unless `token_ids` is a list of 16 uint32 ints."""
    cdef uint64_t value = 0
    if not _configured:
        raise RuntimeError("configure() first")
    if not _block_value(token_ids, position, &value):
        raise ValueError("token_ids must be a list of 16 ints in uint32 range")
    return value


def prompt_keys(const uint32_t[::1] tokens, uint64_t seed, uint64_t first_block=0):
    """`keys.prefix_keys(tokens, seed, first_block).tolist()`: the key of the prefix ending at each
    full router block of `tokens` (uint32, C-contiguous), in one pass without numpy's per-call cost
    (a prompt's keys were a twentieth of kv_aware's CPU per request through numpy)."""
    cdef Py_ssize_t blocks = tokens.shape[0] // BLOCK_TOKENS, block, index, first
    cdef uint64_t words[WORDS]
    cdef uint64_t total = seed
    cdef list keys = []
    if not _configured:
        raise RuntimeError("configure() first")
    for block in range(blocks):
        first = block * BLOCK_TOKENS
        for index in range(WORDS):
            words[index] = token_word(tokens[first + 2 * index], tokens[first + 2 * index + 1])
        total += block_mix(&_key_math, words, first_block + block)
        keys.append(PyLong_FromUnsignedLongLong(total))
    return keys


cdef inline bint _of_sixteen_token_blocks(object event) except -1:
    """Whether `event` is a BlockStored of the configured classes, of 16-token blocks, in KV-cache
    group 0 (`group_idx` None or 0)."""
    cdef PyObject* field
    cdef int overflow = 0
    if type(event) is not _event_class and type(event) is not _event_subclass:
        return False
    field = _field(event, _block_size_at)
    if (field is NULL or not PyLong_CheckExact(field)
            or PyLong_AsLongLongAndOverflow(field, &overflow) != BLOCK_TOKENS or overflow):
        return False
    field = _field(event, _group_at)
    return field is not NULL and (<object>field is None or not <object>field)


cdef inline bint _one_block_with_parent(object event) noexcept:
    """Whether a BlockStored names one block and a parent: the outline of the decode shape."""
    cdef PyObject* hashes = _field(event, _block_hashes_at)
    cdef PyObject* parent = _field(event, _parent_hash_at)
    return (hashes is not NULL and PyList_CheckExact(hashes) and PyList_GET_SIZE(<object>hashes) == 1
            and parent is not NULL and <object>parent is not None)


cdef inline bint _index_chain(object chain) noexcept:
    """Whether `chain` is one of the index's `Chain`s, its counters set."""
    return (type(chain) is _chain_class and _field(chain, _chain_nodes_at) is not NULL
            and _field(chain, _chain_longest_at) is not NULL)


cdef inline object _end_object(long long end_tokens):
    """A node's `end`: the shared int object where it is a router-block boundary of a prompt up
    to 2**18 tokens, else a new int."""
    if end_tokens % BLOCK_TOKENS == 0 and end_tokens // BLOCK_TOKENS < SHARED_ENDS:
        return <object>PyList_GET_ITEM(_shared_ends, end_tokens // BLOCK_TOKENS)
    return end_tokens



cdef class BackendWriter:
    """Applies one-block events of the decode shape to one backend of one index. It keeps the
    index's and the backend's dicts (which are never rebound: `IndexedBackend` says so) so that a call
    costs no attribute lookups; `index.medium_slot_locked` makes a new medium's slot."""

    cdef object index, backend, stats
    cdef dict nodes, holders, shared_masks, extra_refs, medium_slots, chains, stats_blocks, stats_tokens
    # Changes to the stats not yet added to the backend's (`_flush_stats`): blocks and tokens of
    # `pending_tier` (negative for removals), events stored and removed.
    cdef object pending_tier
    cdef Py_ssize_t pending_blocks, pending_token_count, pending_events, pending_removed_events
    # The backend's `max_blocks` (the index sets it again when it changes): `CompiledEntry` asks
    # the index to evict when an event it applied took `nodes` past it.
    cdef public Py_ssize_t max_nodes

    def __init__(self, index, backend):
        if not _configured:
            raise RuntimeError("configure() first")
        self.index = index
        self.backend = backend
        self.nodes = backend.nodes
        self.holders = index.holders
        self.shared_masks = index.shared_masks
        self.extra_refs = index.extra_refs
        self.medium_slots = backend.medium_slots
        self.chains = backend.chains
        self.stats = backend.stats
        self.stats_blocks = backend.stats.blocks
        self.stats_tokens = backend.stats.tokens
        self.max_nodes = getattr(backend, _capacity_field)

    def store(self, list events, Py_ssize_t start):
        """Apply `events[start:]` in order while each is a one-block BlockStored of the decode
        shape or a BlockRemoved of plain blocks (module docstring); return the position of the
        first event not applied (`len(events)` when all were). Prefills are left to the Python
        path here: in a batch of several, its one numpy pass over all their blocks is as fast
        (`apply_one` takes a prefill alone). The caller holds the index's lock."""
        cdef Py_ssize_t position = start
        cdef Py_ssize_t count = PyList_GET_SIZE(events)
        try:
            while position < count and self._apply_in_run(<object>PyList_GET_ITEM(events, position)):
                position += 1
        finally:
            self._flush_stats()
        return position

    def apply_one(self, event):
        """Apply an event that is alone in its batch if it has a shape of this module (a prefill
        too); whether it did. The caller holds the index's lock."""
        try:
            return self._apply_one(event)
        finally:
            self._flush_stats()

    def store_wire(self, WireBatch batch, Py_ssize_t start=0):
        """Apply a scanned batch's events from `start` in order while each has a shape of this
        module, read from the payload (a prefill only when alone in its batch, as `apply_one`
        takes it); return the position of the first event not applied (`len(batch)` when all
        were): the caller hands that one and the events after it, decoded, to the Python paths.
        Stats stay pending (`flush_stats`). The caller holds the index's lock."""
        return self._store_wire(batch, start)

    cdef Py_ssize_t _store_wire(self, WireBatch batch, Py_ssize_t start) except -1:
        cdef const unsigned char* data = <const unsigned char*>PyBytes_AS_STRING(batch.payload)
        cdef Py_ssize_t position = start
        if batch.count == 1 and start == 0:
            return 1 if self._apply_one_view(data, &batch.views[0]) else 0
        while position < batch.count and self._apply_view_in_run(data, &batch.views[position]):
            position += 1
        return position

    def flush_stats(self):
        """Add the pending stats to the backend's (the caller holds the index's lock): the index
        does so before it reads or zeroes them (`PrefixIndex.sync_stats_locked`)."""
        self._flush_stats()

    def pending_tokens(self):
        """Tokens stored minus tokens removed, not yet added to the backend's stats (a lock-free
        read may be off by a flush in progress, as any lock-free read of the stats may)."""
        return self.pending_token_count

    cdef _flush_stats(self):
        if self.pending_blocks or self.pending_token_count:
            self.stats_blocks[self.pending_tier] += self.pending_blocks
            self.stats_tokens[self.pending_tier] += self.pending_token_count
            self.pending_blocks = 0
            self.pending_token_count = 0
        if self.pending_events:
            self.stats.stored_events += self.pending_events
            self.pending_events = 0
        if self.pending_removed_events:
            self.stats.removed_events += self.pending_removed_events
            self.pending_removed_events = 0

    cdef inline void _count_in(self, object tier, Py_ssize_t blocks, Py_ssize_t tokens):
        if tier is not self.pending_tier:
            self._flush_stats()
            self.pending_tier = tier
        self.pending_blocks += blocks
        self.pending_token_count += tokens

    cdef inline bint _apply_one(self, object event) except -1:
        """An event alone in its batch applied here (True), or nothing changed (False: the Python
        path takes it)."""
        cls = type(event)
        if cls is _event_class or cls is _event_subclass:
            if _one_block_with_parent(event):
                return self._store_one(event)
            return self._store_many(event)
        if cls is _removed_class or cls is _removed_subclass:
            return self._remove_one(event)
        return False

    cdef inline bint _apply_in_run(self, object event) except -1:
        """An event of a batch of several applied here (decode steps, evictions), or nothing
        changed."""
        cls = type(event)
        if cls is _event_class or cls is _event_subclass:
            return self._store_one(event)
        if cls is _removed_class or cls is _removed_subclass:
            return self._remove_one(event)
        return False

    cdef object _placed_parent(self, object parent_hash, long long* end, uint64_t* boundary):
        """The node a child may continue (placed on this backend, a 7-tuple without a tail: its
        end on a router-block boundary), its end and boundary key written out; None for any other."""
        cdef PyObject* found = PyDict_GetItemWithError(self.nodes, parent_hash)
        cdef PyObject* tail
        cdef int overflow = 0
        if found is NULL or not PyTuple_CheckExact(found) or PyTuple_GET_SIZE(<object>found) != 7:
            return None
        parent = <object>found
        tail = PyTuple_GET_ITEM(parent, 3)
        if not PyTuple_CheckExact(tail) or PyTuple_GET_SIZE(<object>tail) != 0:
            return None
        if not PyLong_Check(PyTuple_GET_ITEM(parent, 0)) or not PyLong_Check(PyTuple_GET_ITEM(parent, 2)):
            return None
        end[0] = PyLong_AsLongLongAndOverflow(PyTuple_GET_ITEM(parent, 0), &overflow)
        if overflow or end[0] < 0 or end[0] % BLOCK_TOKENS:
            return None
        boundary[0] = PyLong_AsUnsignedLongLong(<object>PyTuple_GET_ITEM(parent, 2))
        return parent

    cdef tuple _slot_bit_tier(self, object medium):
        """(slot, bit, tier) of a medium spelling on this backend (`index.medium_slot_locked`
        makes a new medium's slot)."""
        cdef PyObject* found = PyDict_GetItemWithError(self.medium_slots, medium)
        if found is NULL:
            return self.index.medium_slot_locked(self.backend, medium)
        return <tuple>found

    cdef bint _store_one(self, object event) except -1:
        """One event of the decode shape applied; False (nothing changed) for any other event."""
        cdef PyObject* hashes
        cdef PyObject* token_ids
        cdef PyObject* parent_hash
        cdef PyObject* medium
        cdef uint64_t words[WORDS]
        if not _of_sixteen_token_blocks(event):
            return False
        hashes = _field(event, _block_hashes_at)
        if hashes is NULL or not PyList_CheckExact(hashes) or PyList_GET_SIZE(<object>hashes) != 1:
            return False
        token_ids = _field(event, _token_ids_at)
        if token_ids is NULL or not PyList_CheckExact(token_ids) or PyList_GET_SIZE(<object>token_ids) != BLOCK_TOKENS:
            return False
        parent_hash = _field(event, _parent_hash_at)
        medium = _field(event, _medium_at)
        if parent_hash is NULL or medium is NULL or not _list_words(<object>token_ids, 0, words):
            return False
        return self._store_block(<object>PyList_GET_ITEM(<object>hashes, 0), <object>parent_hash, words,
                                 <object>medium)

    cdef bint _store_block(self, object block_hash, object parent_hash, const uint64_t* words,
                           object medium) except -1:
        """One 16-token block (its 8 token words) stored under `block_hash` as the child of
        `parent_hash` (the decode shape: module docstring); False (nothing changed) when the index
        as it stands puts it outside the shape."""
        cdef PyObject* found
        cdef long long parent_end = 0
        cdef uint64_t boundary = 0, value
        parent = self._placed_parent(parent_hash, &parent_end, &boundary)
        if parent is None:
            return False
        nodes = self.nodes
        if PyDict_Contains(nodes, block_hash):
            return False
        value = block_mix(&_key_math, words, <uint64_t>(parent_end // BLOCK_TOKENS))
        chain_id = <object>PyTuple_GET_ITEM(parent, 5)
        slot_bit_tier = self._slot_bit_tier(medium)
        bit = slot_bit_tier[1]
        tier = slot_bit_tier[2]
        chain = self.chains.get(chain_id)
        if not _index_chain(chain):
            return False
        key = boundary + value  # (uint64_t: wraps, as `& UINT64_MASK` does in Python)
        holders = self.holders
        found = PyDict_GetItemWithError(holders, key)
        if found is not NULL and <object>found:
            mask = <object>found
            if mask & bit:  # the tier holds this prefix already: the general path counts references
                return False
            updated = mask | bit
            mask = <object>PyDict_SetDefault(self.shared_masks, updated, updated)
        else:
            mask = bit
        end = _end_object(parent_end + BLOCK_TOKENS)
        node = (end, _BLOCK_TOKENS_OBJECT, key, _NO_TAIL, key, chain_id, bit)
        # A tuple of ints and an empty tuple is never part of a cycle: the collector need not track
        # it (it would untrack it at its next pass anyway).
        PyObject_GC_UnTrack(<void*>node)
        nodes[block_hash] = node
        holders[key] = mask
        _set_field(chain, _chain_nodes_at, <object>_field(chain, _chain_nodes_at) + 1)
        if end > <object>_field(chain, _chain_longest_at):
            _set_field(chain, _chain_longest_at, end)
        self._count_in(tier, 1, BLOCK_TOKENS)
        self.pending_events += 1
        return True

    cdef bint _store_many(self, object event) except -1:
        """A BlockStored of whole 16-token blocks (KV-cache group 0), a root or the child of a
        placed block without a tail, its hashes new to the backend and distinct, every prefix it
        completes new to its tier: applied as `PythonWriter._flush_uniform_locked` applies one
        event (a prefill). False (nothing changed but a root's chain, which the Python path makes
        too) for any other."""
        cdef PyObject* field
        cdef PyObject* medium
        cdef PyObject* parent_hash
        cdef Py_ssize_t count, position
        cdef uint64_t* words
        if not _of_sixteen_token_blocks(event):
            return False
        field = _field(event, _block_hashes_at)
        if field is NULL or not PyList_CheckExact(field) or PyList_GET_SIZE(<object>field) == 0:
            return False
        hashes = <object>field
        count = PyList_GET_SIZE(hashes)
        field = _field(event, _token_ids_at)
        if field is NULL or not PyList_CheckExact(field) or PyList_GET_SIZE(<object>field) < count * BLOCK_TOKENS:
            return False
        token_ids = <object>field
        medium = _field(event, _medium_at)
        parent_hash = _field(event, _parent_hash_at)
        if medium is NULL or parent_hash is NULL:
            return False
        words = <uint64_t*>PyMem_Malloc(count * WORDS * sizeof(uint64_t))
        if words is NULL:
            raise MemoryError()
        try:
            for position in range(count):
                if not _list_words(token_ids, position * BLOCK_TOKENS, words + position * WORDS):
                    return False
            return self._store_blocks(hashes, <object>parent_hash, words, count, <object>medium, event)
        finally:
            PyMem_Free(words)

    cdef bint _store_blocks(self, list hashes, object parent_hash, const uint64_t* words, Py_ssize_t count,
                            object medium, object root) except -1:
        """`count` 16-token blocks (8 token words each) stored under `hashes`, a root when
        `parent_hash` is None (its chain from `root`: the event, or `(namespace, preview)`) or the
        child of a placed block without a tail (the prefill shape: module docstring); False
        (nothing changed but a root's chain, which the Python path makes too) when the index as
        it stands puts them outside the shape."""
        cdef PyObject* found
        cdef Py_ssize_t position
        cdef long long parent_end = 0, first_block
        cdef uint64_t running = 0
        nodes = self.nodes
        for position in range(count):
            if PyDict_Contains(nodes, <object>PyList_GET_ITEM(hashes, position)):
                return False
        if count > 1 and len(set(hashes)) != count:
            return False
        if parent_hash is None:
            if type(root) is tuple:
                chain_id, seed = self.index.chain_for_locked(self.backend, root[0], root[1])
            else:
                chain_id, seed = self.index.root_chain_locked(self.backend, root, count * BLOCK_TOKENS)
            parent_end = 0
            running = PyLong_AsUnsignedLongLong(seed)
        else:
            parent = self._placed_parent(parent_hash, &parent_end, &running)
            if parent is None:
                return False
            chain_id = <object>PyTuple_GET_ITEM(parent, 5)
        chain = self.chains.get(chain_id)
        if not _index_chain(chain):
            return False
        slot_bit_tier = self._slot_bit_tier(medium)
        bit = slot_bit_tier[1]
        tier = slot_bit_tier[2]
        # Keys (running sums from the parent's boundary key) and what the tier's holders say of them.
        keys = [None] * count
        masks = [None] * count
        holders = self.holders
        held = False
        first_block = parent_end // BLOCK_TOKENS
        for position in range(count):
            running += block_mix(&_key_math, words + position * WORDS, <uint64_t>(first_block + position))
            key = running
            found = PyDict_GetItemWithError(holders, key)
            mask = <object>found if found is not NULL else None
            if mask is not None and mask:
                if mask & bit:  # the tier holds this prefix already: the general path counts references
                    return False
                held = True
            keys[position] = key
            masks[position] = mask
        shared_masks = self.shared_masks
        for position in range(count):
            key = <object>PyList_GET_ITEM(keys, position)
            end = _end_object(parent_end + (position + 1) * BLOCK_TOKENS)
            node = (end, _BLOCK_TOKENS_OBJECT, key, _NO_TAIL, key, chain_id, bit)
            PyObject_GC_UnTrack(<void*>node)
            nodes[<object>PyList_GET_ITEM(hashes, position)] = node
            mask = <object>PyList_GET_ITEM(masks, position)
            if held and mask is not None and mask:
                updated = mask | bit
                holders[key] = <object>PyDict_SetDefault(shared_masks, updated, updated)
            else:
                holders[key] = bit
        _set_field(chain, _chain_nodes_at, <object>_field(chain, _chain_nodes_at) + count)
        if end > <object>_field(chain, _chain_longest_at):
            _set_field(chain, _chain_longest_at, end)
        self._count_in(tier, count, count * BLOCK_TOKENS)
        self.pending_events += 1
        return True

    cdef bint _remove_one(self, object event) except -1:
        """A BlockRemoved of plain blocks applied (module docstring); False (nothing changed) for
        any other event."""
        cdef PyObject* field
        cdef PyObject* medium
        if type(event) is not _removed_class and type(event) is not _removed_subclass:
            return False
        field = _field(event, _removed_group_at)
        if field is NULL or (<object>field is not None and <object>field):
            return False
        field = _field(event, _removed_hashes_at)
        medium = _field(event, _removed_medium_at)
        if field is NULL or not PyList_CheckExact(field) or medium is NULL:
            return False
        return self._remove_blocks(<object>field, <object>medium)

    cdef bint _remove_blocks(self, list hashes, object medium) except -1:
        """The blocks named by `hashes` removed from the tier `medium` names (KV-cache group 0)
        when each is unknown to the tier or a plain node (module docstring); False (nothing
        changed) otherwise."""
        cdef PyObject* found
        cdef Py_ssize_t position, count, unknown = 0
        cdef long long tokens
        cdef int overflow = 0
        found = PyDict_GetItemWithError(self.medium_slots, medium)
        if found is NULL:  # a spelling not seen yet: the index resolves it
            slot_bit_tier = self.index.held_medium_slot_locked(self.backend, medium)
            if slot_bit_tier is None:  # nothing held in that tier: the Python path counts it
                return False
        else:
            slot_bit_tier = <object>found
        slot, bit, tier = slot_bit_tier[0], slot_bit_tier[1], slot_bit_tier[2]
        nodes = self.nodes
        count = PyList_GET_SIZE(hashes)
        # Every block is checked before anything changes: one outside the shape leaves the whole
        # event to the Python path.
        for position in range(count):
            found = PyDict_GetItemWithError(nodes, <object>PyList_GET_ITEM(hashes, position))
            if found is NULL:
                continue
            if not self._plain_node_in(<object>found, slot, bit):
                return False
        holders, shared_masks, chains = self.holders, self.shared_masks, self.chains
        for position in range(count):
            block_hash = <object>PyList_GET_ITEM(hashes, position)
            found = PyDict_GetItemWithError(nodes, block_hash)
            if found is NULL:
                unknown += 1
                continue
            node = <object>found
            slots = <object>PyTuple_GET_ITEM(node, 6)
            if not (slots is bit or slots & bit):
                unknown += 1
                continue
            keys = <object>PyTuple_GET_ITEM(node, 4)
            if PyLong_CheckExact(<PyObject*>keys):
                self._release_key(holders, shared_masks, keys, bit)
            else:
                for key in <tuple>keys:
                    self._release_key(holders, shared_masks, key, bit)
            tokens = PyLong_AsLongLongAndOverflow(PyTuple_GET_ITEM(node, 1), &overflow)
            self._count_in(tier, -1, -<Py_ssize_t>tokens)
            if slots is bit:
                remaining = 0
            else:
                remaining = slots ^ bit
            if remaining:
                nodes[block_hash] = node[:6] + (remaining,)
                continue
            del nodes[block_hash]
            chain_id = <object>PyTuple_GET_ITEM(node, 5)
            found = PyDict_GetItemWithError(chains, chain_id)
            if found is NULL:
                continue
            chain = <object>found
            left = <object>_field(chain, _chain_nodes_at) - 1
            _set_field(chain, _chain_nodes_at, left)
            if left <= 0:
                del chains[chain_id]
                self.backend.chain_ids.pop((chain.namespace, chain.preview), None)
        self.pending_removed_events += 1
        if unknown:
            self.stats.unknown_removals += unknown
        return True

    cdef bint _apply_one_view(self, const unsigned char* data, const EventView* view) except -1:
        """`_apply_one` of a scanned event."""
        if view.kind == KIND_STORED:
            if view.hash_count == 1 and view.parent_at >= 0:
                return self._store_one_view(data, view)
            return self._store_many_view(data, view)
        if view.kind == KIND_REMOVED:
            return self._remove_view(data, view)
        return False

    cdef bint _apply_view_in_run(self, const unsigned char* data, const EventView* view) except -1:
        """`_apply_in_run` of a scanned event."""
        if view.kind == KIND_STORED:
            return self._store_one_view(data, view)
        if view.kind == KIND_REMOVED:
            return self._remove_view(data, view)
        return False

    cdef bint _store_one_view(self, const unsigned char* data, const EventView* view) except -1:
        """`_store_one` of a scanned BlockStored: its token ids read from the payload."""
        cdef uint64_t words[WORDS]
        cdef Py_ssize_t at = view.tokens_at
        if (not view.sixteen or not view.group_zero or view.hash_count != 1 or view.parent_at < 0
                or view.token_count != BLOCK_TOKENS or not token_words_at(data, &at, 1, words)):
            return False
        at = view.hashes_at
        block_hash = hash_object(data, &at)
        at = view.parent_at
        parent_hash = hash_object(data, &at)
        return self._store_block(block_hash, parent_hash, words, text_object(data, view.medium_at))

    cdef bint _store_many_view(self, const unsigned char* data, const EventView* view) except -1:
        """`_store_many` of a scanned BlockStored."""
        cdef Py_ssize_t count = view.hash_count, at, position
        cdef uint64_t* words
        if not view.sixteen or not view.group_zero or count == 0 or view.token_count < count * BLOCK_TOKENS:
            return False
        words = <uint64_t*>PyMem_Malloc(count * WORDS * sizeof(uint64_t))
        if words is NULL:
            raise MemoryError()
        try:
            at = view.tokens_at
            if not token_words_at(data, &at, count, words):
                return False
            hashes = [None] * count
            at = view.hashes_at
            for position in range(count):
                hashes[position] = hash_object(data, &at)
            if view.parent_at >= 0:
                at = view.parent_at
                return self._store_blocks(hashes, hash_object(data, &at), words, count,
                                          text_object(data, view.medium_at), None)
            # A root: its chain is named by the namespace (its LoRA name, and no cache_salt: the
            # scan took extra keys only when all nil) and the first tokens it covers, as
            # `PrefixIndex.root_chain_locked` names it.
            preview = [None] * min(count * BLOCK_TOKENS, _preview_tokens)
            for position in range(len(preview)):
                preview[position] = (words[position // 2] >> (32 * (position % 2))) & 0xFFFFFFFF
            namespace = _namespace_class(text_object(data, view.lora_name_at), None)
            return self._store_blocks(hashes, None, words, count, text_object(data, view.medium_at),
                                      (namespace, tuple(preview)))
        finally:
            PyMem_Free(words)

    cdef bint _remove_view(self, const unsigned char* data, const EventView* view) except -1:
        """`_remove_one` of a scanned BlockRemoved."""
        cdef Py_ssize_t at = view.hashes_at, position
        if not view.group_zero:
            return False
        hashes = [None] * view.hash_count
        for position in range(view.hash_count):
            hashes[position] = hash_object(data, &at)
        return self._remove_blocks(hashes, text_object(data, view.medium_at))

    cdef bint _plain_node_in(self, object node, object slot, object bit) except -1:
        """Whether a node this module may remove from a slot: a 7-tuple with no tail whose keys
        are ints, its chain an index chain, and no extra reference to any of its keys in the slot
        (a node not in the slot is counted as unknown, as the Python path does)."""
        cdef PyObject* found
        if not PyTuple_CheckExact(<PyObject*>node) or PyTuple_GET_SIZE(node) != 7:
            return False
        slots = <object>PyTuple_GET_ITEM(node, 6)
        if not PyLong_CheckExact(<PyObject*>slots):
            return False
        if not (slots is bit or slots & bit):
            return True
        tail = <object>PyTuple_GET_ITEM(node, 3)
        if not PyTuple_CheckExact(<PyObject*>tail) or PyTuple_GET_SIZE(tail) != 0:
            return False
        if not PyLong_Check(PyTuple_GET_ITEM(node, 1)):
            return False
        keys = <object>PyTuple_GET_ITEM(node, 4)
        if PyLong_CheckExact(<PyObject*>keys):
            keys = (keys,)
        elif not PyTuple_CheckExact(<PyObject*>keys):
            return False
        for key in <tuple>keys:
            if not PyLong_CheckExact(<PyObject*>key):
                return False
            if PyDict_GET_SIZE(self.extra_refs) and PyDict_Contains(self.extra_refs, (key, slot)):
                return False
        found = PyDict_GetItemWithError(self.chains, <object>PyTuple_GET_ITEM(node, 5))
        return found is NULL or _index_chain(<object>found)

    cdef inline int _release_key(self, dict holders, dict shared_masks, object key, object bit) except -1:
        """The tier's bit off a prefix's holder mask (`PrefixIndex.unregister_locked` without
        extra references): the key goes with its last bit; a mask left is the shared object."""
        cdef PyObject* found = PyDict_GetItemWithError(holders, key)
        if found is NULL:
            return 0
        mask = <object>found
        if mask is bit:
            del holders[key]
            return 0
        remaining = mask & ~bit
        if remaining:
            holders[key] = <object>PyDict_SetDefault(shared_masks, remaining, remaining)
        else:
            del holders[key]
        return 0


def next_compiled_candidate(list events, Py_ssize_t start):
    """The position of the first event at or after `start` that `BackendWriter.store` may apply (a
    BlockStored of one block with a parent, or a BlockRemoved), or `len(events)`: where the
    compiled path resumes after the general path took the events before it."""
    cdef Py_ssize_t position = start
    cdef Py_ssize_t count = PyList_GET_SIZE(events)
    while position < count:
        event = <object>PyList_GET_ITEM(events, position)
        cls = type(event)
        if cls is _removed_class or cls is _removed_subclass:
            return position
        if (cls is _event_class or cls is _event_subclass) and _one_block_with_parent(event):
            return position
        position += 1
    return count


# The entry and the writer lock (router/index/_ingest_entry.pxi).
include "_ingest_entry.pxi"
# A lookup's probes and runs (router/index/_lookup.pxi).
include "_lookup.pxi"

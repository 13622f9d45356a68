# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Compiled ingest of one-block BlockStored events (what engines publish while decoding) into the
prefix index's own Python dicts.

`BackendWriter(index, backend).store(events, start)` applies `events[start:]` in order while
each is of the decode shape and returns the position of the first one it did not apply (the
caller hands that one and the events after it to the pure-Python paths of
`router/index/prefix_index.py`, which stay the reference). The shape, checked per event against
the index as it stands after the events before it: a BlockStored of one 16-token block
(`block_size` 16, `token_ids` a list of 16 uint32 ints), KV-cache group 0, its parent placed on the
backend and ending on a router-block boundary (no tail), its hash new to the backend, and the
prefix it completes not yet held by the event's tier. An event outside the shape changes nothing.

For such an event it builds exactly what `PrefixIndex._store_one_block_locked` builds: the node
tuple `(end, 16, key, (), key, chain_id, bit)` in `backend.nodes`, the holder mask in
`index._holders` (the tier's shared bit for a prefix nobody held, else the shared object of
`mask | bit` from `index._shared_masks`), the chain's `nodes` and `longest`, and the backend's
stats. The router key is the parent's boundary key plus the block's mixed value, in C uint64
arithmetic: the same math as `_python_block_value` (8 little-endian words of two tokens times
the word weights, xor position times the position weight, splitmix64 finaliser), with the
constants handed over once by `configure`.

Callers hold the index's writer lock; lookups read the same dicts without it (each insert is one
dict store, as in the Python paths).
"""

from cpython.object cimport PyObject
from cpython.pythread cimport (
    NOWAIT_LOCK, WAIT_LOCK, PyThread_acquire_lock, PyThread_allocate_lock, PyThread_free_lock,
    PyThread_release_lock, PyThread_type_lock,
)
from cpython.ref cimport Py_INCREF, Py_XDECREF
from libc.stdint cimport uint64_t

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

# The index's constants (`configure`): nothing is stored before they are set.
cdef uint64_t _word_weights[8]
cdef uint64_t _position_weight = 0, _mix_1 = 0, _mix_2 = 0
cdef bint _configured = False

# Events, chains and their fields are read and written at their slot offsets (msgspec Structs and
# slotted dataclasses keep each field in a fixed slot, exposed by a member descriptor): one load
# instead of an attribute lookup. Only the classes `configure` checked are read this way; any
# other event class is left to the Python paths.
cdef object _event_class = None, _event_subclass = None
cdef Py_ssize_t _block_hashes_at, _parent_hash_at, _token_ids_at, _block_size_at, _medium_at, _group_at
cdef object _chain_class = None
cdef Py_ssize_t _chain_nodes_at, _chain_longest_at


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


def configure(word_weights, uint64_t position_weight, uint64_t mix_1, uint64_t mix_2,
              int block_tokens, tuple node_layout, block_stored_class, chain_class):
    """Hand over the index's key constants, the BlockStored class and the index's chain class
    (`_Chain`); ValueError for a mismatch (another block size, node layout or field layout)."""
    global _position_weight, _mix_1, _mix_2, _configured, _event_class, _event_subclass, _chain_class
    global _block_hashes_at, _parent_hash_at, _token_ids_at, _block_size_at, _medium_at, _group_at
    global _chain_nodes_at, _chain_longest_at
    weights = tuple(word_weights)
    if block_tokens != BLOCK_TOKENS or len(weights) != WORDS:
        raise ValueError(f"compiled for {BLOCK_TOKENS}-token router blocks of {WORDS} words, "
                         f"not {block_tokens} tokens and {len(weights)} weights")
    if node_layout != NODE_LAYOUT:
        raise ValueError(f"compiled for node tuples {NODE_LAYOUT}, the index has {node_layout}")
    _configured = False
    for position in range(WORDS):
        _word_weights[position] = weights[position]
    _position_weight, _mix_1, _mix_2 = position_weight, mix_1, mix_2
    _block_hashes_at = _slot_offset(block_stored_class, "block_hashes")
    _parent_hash_at = _slot_offset(block_stored_class, "parent_block_hash")
    _token_ids_at = _slot_offset(block_stored_class, "token_ids")
    _block_size_at = _slot_offset(block_stored_class, "block_size")
    _medium_at = _slot_offset(block_stored_class, "medium")
    _group_at = _slot_offset(block_stored_class, "group_idx")
    # The wire decoder's array-encoded subclass (one at most) inherits the same slots.
    subclasses = [cls for cls in block_stored_class.__subclasses__()
                  if all(_slot_offset(cls, name) == _slot_offset(block_stored_class, name)
                         for name in ("block_hashes", "parent_block_hash", "token_ids", "block_size",
                                      "medium", "group_idx"))]
    _event_class = block_stored_class
    _event_subclass = subclasses[0] if subclasses else block_stored_class
    _chain_nodes_at = _slot_offset(chain_class, "nodes")
    _chain_longest_at = _slot_offset(chain_class, "longest")
    _chain_class = chain_class
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
    word[0] = <uint64_t>low | (<uint64_t>high << 32)
    return True


cdef inline bint _block_value(object token_ids, uint64_t position, uint64_t* value) noexcept:
    """The mixed value of one router block at `position`; False unless `token_ids` is a list of
    16 uint32 ints. Arithmetic wraps modulo 2**64, as the index's key math does."""
    cdef uint64_t total = 0, word = 0
    cdef Py_ssize_t index
    if not PyList_CheckExact(<PyObject*>token_ids) or PyList_GET_SIZE(token_ids) != BLOCK_TOKENS:
        return False
    for index in range(WORDS):
        if not _token_word(PyList_GET_ITEM(token_ids, 2 * index), PyList_GET_ITEM(token_ids, 2 * index + 1),
                           &word):
            return False
        total += word * _word_weights[index]
    total ^= position * _position_weight
    total ^= total >> 30
    total *= _mix_1
    total ^= total >> 27
    total *= _mix_2
    total ^= total >> 31
    value[0] = total
    return True


def block_value(token_ids, uint64_t position):
    """The mixed value of one 16-token block (for checks against `_python_block_value`);
    ValueError unless `token_ids` is a list of 16 uint32 ints."""
    cdef uint64_t value = 0
    if not _configured:
        raise RuntimeError("configure() first")
    if not _block_value(token_ids, position, &value):
        raise ValueError("token_ids must be a list of 16 ints in uint32 range")
    return value


cdef class BackendWriter:
    """Applies one-block events of the decode shape to one backend of one index. It keeps the
    index's and the backend's dicts (which are never rebound: `_Backend` says so) so that a call
    costs no attribute lookups; `index._medium_slot_locked` makes a new medium's slot."""

    cdef object index, backend, stats
    cdef dict nodes, holders, shared_masks, medium_slots, chains, stats_blocks, stats_tokens
    # Stats of the events stored by the current call, added to the backend's once per call.
    cdef object pending_tier
    cdef Py_ssize_t pending_blocks, pending_events

    def __init__(self, index, backend):
        if not _configured:
            raise RuntimeError("configure() first")
        self.index = index
        self.backend = backend
        self.nodes = backend.nodes
        self.holders = index._holders
        self.shared_masks = index._shared_masks
        self.medium_slots = backend.medium_slots
        self.chains = backend.chains
        self.stats = backend.stats
        self.stats_blocks = backend.stats.blocks
        self.stats_tokens = backend.stats.tokens

    def store(self, list events, Py_ssize_t start):
        """Apply `events[start:]` in order while each is of the decode shape (module docstring);
        return the position of the first event not applied (`len(events)` when all were). The
        caller holds the index's lock."""
        cdef Py_ssize_t position = start
        cdef Py_ssize_t count = PyList_GET_SIZE(events)
        try:
            while position < count and self._store_one(<object>PyList_GET_ITEM(events, position)):
                position += 1
        finally:
            self._flush_stats()
        return position

    def flush_stats(self):
        """Add the pending stats to the backend's (the caller holds the index's lock): the index
        does so before it reads or zeroes them (`PrefixIndex._sync_stats_locked`)."""
        self._flush_stats()

    def pending_tokens(self):
        """Tokens stored but not yet added to the backend's stats (a lock-free read may be off by
        a flush in progress, as any lock-free read of the stats may)."""
        return self.pending_blocks * BLOCK_TOKENS

    cdef _flush_stats(self):
        if self.pending_blocks:
            self.stats_blocks[self.pending_tier] += self.pending_blocks
            self.stats_tokens[self.pending_tier] += self.pending_blocks * BLOCK_TOKENS
            self.pending_blocks = 0
        if self.pending_events:
            self.stats.stored_events += self.pending_events
            self.pending_events = 0

    cdef bint _store_one(self, object event) except -1:
        """One event of the decode shape applied; False (nothing changed) for any other event."""
        cdef PyObject* found
        cdef PyObject* hashes
        cdef PyObject* token_ids
        cdef PyObject* field
        cdef long long parent_end
        cdef uint64_t boundary, value = 0
        cdef int overflow = 0
        if type(event) is not _event_class and type(event) is not _event_subclass:
            return False
        field = _field(event, _block_size_at)
        if field is NULL or not PyLong_CheckExact(field) or PyLong_AsLongLongAndOverflow(field, &overflow) != BLOCK_TOKENS:
            return False
        field = _field(event, _group_at)
        if field is NULL or (<object>field is not None and <object>field):
            return False
        hashes = _field(event, _block_hashes_at)
        if hashes is NULL or not PyList_CheckExact(hashes) or PyList_GET_SIZE(<object>hashes) != 1:
            return False
        token_ids = _field(event, _token_ids_at)
        if token_ids is NULL or not PyList_CheckExact(token_ids) or PyList_GET_SIZE(<object>token_ids) != BLOCK_TOKENS:
            return False
        field = _field(event, _parent_hash_at)
        if field is NULL:
            return False
        nodes = self.nodes
        found = PyDict_GetItemWithError(nodes, <object>field)
        if found is NULL or not PyTuple_CheckExact(found) or PyTuple_GET_SIZE(<object>found) != 7:
            return False
        parent = <object>found
        field = PyTuple_GET_ITEM(parent, 3)  # the parent's tail: a child continues from a boundary
        if not PyTuple_CheckExact(field) or PyTuple_GET_SIZE(<object>field) != 0:
            return False
        block_hash = <object>PyList_GET_ITEM(<object>hashes, 0)
        if PyDict_Contains(nodes, block_hash):
            return False
        if not PyLong_Check(PyTuple_GET_ITEM(parent, 0)) or not PyLong_Check(PyTuple_GET_ITEM(parent, 2)):
            return False
        parent_end = PyLong_AsLongLongAndOverflow(PyTuple_GET_ITEM(parent, 0), &overflow)
        if overflow or parent_end < 0:
            return False
        boundary = PyLong_AsUnsignedLongLong(<object>PyTuple_GET_ITEM(parent, 2))
        if not _block_value(<object>token_ids, <uint64_t>(parent_end // BLOCK_TOKENS), &value):
            return False
        chain_id = <object>PyTuple_GET_ITEM(parent, 5)
        field = _field(event, _medium_at)
        if field is NULL:
            return False
        found = PyDict_GetItemWithError(self.medium_slots, <object>field)
        if found is NULL:
            slot_bit_tier = self.index._medium_slot_locked(self.backend, <object>field)
        else:
            slot_bit_tier = <object>found
        bit = slot_bit_tier[1]
        tier = slot_bit_tier[2]
        chain = self.chains[chain_id]
        if (type(chain) is not _chain_class or _field(chain, _chain_nodes_at) is NULL
                or _field(chain, _chain_longest_at) is NULL):
            return False
        key = boundary + value  # (uint64_t: wraps, as `& _WORD` does in Python)
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
        if parent_end % BLOCK_TOKENS == 0 and parent_end // BLOCK_TOKENS + 1 < SHARED_ENDS:
            end = <object>PyList_GET_ITEM(_shared_ends, parent_end // BLOCK_TOKENS + 1)
        else:
            end = parent_end + BLOCK_TOKENS
        node = (end, _BLOCK_TOKENS_OBJECT, key, _NO_TAIL, key, chain_id, bit)
        # A tuple of ints and an empty tuple is never part of a cycle: the collector need not track
        # it (it would untrack it at its next pass anyway).
        PyObject_GC_UnTrack(<void*>node)
        nodes[block_hash] = node
        holders[key] = mask
        _set_field(chain, _chain_nodes_at, <object>_field(chain, _chain_nodes_at) + 1)
        if end > <object>_field(chain, _chain_longest_at):
            _set_field(chain, _chain_longest_at, end)
        if tier is not self.pending_tier:
            self._flush_stats()
            self.pending_tier = tier
        self.pending_blocks += 1
        self.pending_events += 1
        return True


def next_one_block_candidate(list events, Py_ssize_t start):
    """The position of the first event at or after `start` that may be of the decode shape (a
    BlockStored of one block with a parent), or `len(events)`: where the compiled path resumes
    after the general path took the events before it."""
    cdef Py_ssize_t position = start
    cdef Py_ssize_t count = PyList_GET_SIZE(events)
    cdef PyObject* hashes
    cdef PyObject* parent
    while position < count:
        event = <object>PyList_GET_ITEM(events, position)
        if type(event) is _event_class or type(event) is _event_subclass:
            hashes = _field(event, _block_hashes_at)
            parent = _field(event, _parent_hash_at)
            if (hashes is not NULL and PyList_CheckExact(hashes) and PyList_GET_SIZE(<object>hashes) == 1
                    and parent is not NULL and <object>parent is not None):
                return position
        position += 1
    return count


cdef class WriterLock:
    """The index's writer lock: `with lock:` in Python (as a `threading.Lock`), taken in C by
    `OneEventFront` without a Python call. Waiting for it releases the GIL, as `threading.Lock`
    does, so the thread that holds it can finish."""

    cdef PyThread_type_lock handle
    cdef bint held

    def __cinit__(self):
        self.handle = PyThread_allocate_lock()
        if self.handle is NULL:
            raise MemoryError("cannot allocate a lock")

    def __dealloc__(self):
        if self.handle is not NULL:
            PyThread_free_lock(self.handle)

    cdef inline void take(self) noexcept:
        if not PyThread_acquire_lock(self.handle, NOWAIT_LOCK):
            with nogil:
                PyThread_acquire_lock(self.handle, WAIT_LOCK)
        self.held = True

    cdef inline void give(self) noexcept:
        self.held = False
        PyThread_release_lock(self.handle)

    def acquire(self, bint blocking=True):
        """Take the lock (True), or False at once when `blocking` is false and it is held."""
        if not blocking:
            if not PyThread_acquire_lock(self.handle, NOWAIT_LOCK):
                return False
            self.held = True
            return True
        self.take()
        return True

    def release(self):
        if not self.held:
            raise RuntimeError("release of an unheld index lock")
        self.give()

    def locked(self):
        return self.held

    def __enter__(self):
        self.take()
        return True

    def __exit__(self, exc_type, exc_value, traceback):
        self.give()
        return False


cdef class OneEventFront:
    """`PrefixIndex.apply` when the compiled path is built: a batch of one event of the decode
    shape (what an engine step that filled one block publishes) is applied here, in C, under the
    index's `WriterLock`, through the backend's `BackendWriter`; every other call, and that one
    when the event is refused, goes to `general(backend_name, events)` (the index's Python
    `apply`), which decides everything else exactly as before. The backend is looked up under the
    lock: a replaced or cleared backend is never written through a stale writer."""

    cdef dict backends, shared_masks
    cdef WriterLock lock
    cdef object general
    cdef Py_ssize_t shared_masks_limit
    # Events this entry applied itself (the rest went to `general`).
    cdef readonly Py_ssize_t applied

    def __init__(self, dict backends, dict shared_masks, WriterLock lock, general, Py_ssize_t shared_masks_limit):
        self.backends = backends
        self.shared_masks = shared_masks
        self.lock = lock
        self.general = general
        self.shared_masks_limit = shared_masks_limit

    def apply(self, backend_name, events):
        """Apply the events of one batch, in order (`PrefixIndex.apply`)."""
        cdef PyObject* found
        cdef bint stored = False
        if type(events) is list and PyList_GET_SIZE(events) == 1:
            self.lock.take()
            try:
                found = PyDict_GetItemWithError(self.backends, backend_name)
                if found is not NULL and PyDict_GET_SIZE(self.shared_masks) <= self.shared_masks_limit:
                    writer = (<object>found).compiled_writer
                    if isinstance(writer, BackendWriter):
                        # The event's stats stay pending in the writer (`flush_stats`): adding them
                        # to the backend's dicts would cost about a tenth of the event.
                        stored = (<BackendWriter>writer)._store_one(<object>PyList_GET_ITEM(events, 0))
            finally:
                self.lock.give()
            if stored:
                self.applied += 1
                return
        self.general(backend_name, events)

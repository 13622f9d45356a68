# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The compiled reader of KV event frames: an `EventBatch` payload (msgpack, as engines publish
it) checked and mapped in place, so a consumer can read its events without decoding them.

`scan_batch(payload)` returns a `WireBatch` (the events' kinds and where each field lies) or None
for any payload it does not read exactly as the decoder (`kvwire/decode.py`) would; the decoder
takes those. Compiled consumers cimport the batch and the readers (`kvwire/_frames.pxd`); the
router's index writer (`router/index/_ingest.pyx`) is one. An optional extension
(pyproject's ext-modules): without it `kvwire.scan_batch` is None and every payload is decoded.
"""

cimport cython
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.stdint cimport int64_t, uint32_t, uint64_t
from libc.string cimport memcmp, memcpy

# ---- msgpack payloads read in place ----
#
# An EventBatch as engines publish it is scanned here without building event objects: the
# events' fields are checked against the types the wire decoder (`kvwire/decode.py`)
# declares, and where each value lies is kept. The writer then reads hashes and token ids from
# the payload itself: a decode step's 16 token ids never become Python ints. The scan is at
# least as strict as the decoder: whatever it accepts, the decoder decodes to the same events,
# one for one, so the Python path can take over at any event. Anything else (an unknown event
# type, a value of another type, a duplicate key, extra keys other than nil: a cache_salt or
# multimodal keys) makes the scan give up, and the payload goes to the decoder.


cdef inline Py_ssize_t _header(const unsigned char* data, Py_ssize_t end, Py_ssize_t* at,
                               unsigned char fixed, unsigned char wide16) noexcept:
    """The element count of the array (fixed 0x90, wide16 0xdc) or map (0x80, 0xde) at `at`,
    moved past its header; -1 for any other value."""
    cdef Py_ssize_t position = at[0]
    cdef unsigned char first
    if position >= end:
        return -1
    first = data[position]
    if first & 0xF0 == fixed:
        at[0] = position + 1
        return first & 0x0F
    if first == wide16 and end - position >= 3:
        at[0] = position + 3
        return <Py_ssize_t>big_endian(data + position + 1, 2)
    if first == wide16 + 1 and end - position >= 5:
        at[0] = position + 5
        return <Py_ssize_t>big_endian(data + position + 1, 4)
    return -1






cdef inline bint _nil_at(const unsigned char* data, Py_ssize_t end, Py_ssize_t* at) noexcept:
    if at[0] < end and data[at[0]] == 0xC0:
        at[0] += 1
        return True
    return False


cdef bint _skip(const unsigned char* data, Py_ssize_t end, Py_ssize_t* at, int depth) noexcept:
    """`at` moved past one value of any type (False for a malformed or truncated one, or one
    nested deeper than SKIP_DEPTH)."""
    cdef Py_ssize_t position = at[0], count, index, start = 0, size
    cdef unsigned char first
    cdef uint64_t value = 0
    if position >= end or depth > SKIP_DEPTH:
        return False
    first = data[position]
    if int_at(data, end, at, &value):
        return True
    if first == 0xC0 or first == 0xC2 or first == 0xC3:
        at[0] = position + 1
        return True
    if first == 0xCA or first == 0xCB:
        size = 5 if first == 0xCA else 9
        if end - position < size:
            return False
        at[0] = position + size
        return True
    if bytes_at(data, end, at, True, &start) >= 0 or bytes_at(data, end, at, False, &start) >= 0:
        return True
    if 0xD4 <= first <= 0xD8:  # fixext: type byte and 1-16 bytes
        size = 2 + (1 << (first - 0xD4))
        if end - position < size:
            return False
        at[0] = position + size
        return True
    if 0xC7 <= first <= 0xC9:  # ext 8/16/32: length, type byte, data
        size = 1 << (first - 0xC7)
        if end - position < 2 + size:
            return False
        count = <Py_ssize_t>big_endian(data + position + 1, size)
        if end - position - 2 - size < count:
            return False
        at[0] = position + 2 + size + count
        return True
    count = _header(data, end, at, 0x90, 0xDC)
    if count < 0:
        count = _header(data, end, at, 0x80, 0xDE)
        if count < 0:
            return False
        count *= 2
    for index in range(count):
        if not _skip(data, end, at, depth + 1):
            return False
    return True


cdef inline bint _float_at(const unsigned char* data, Py_ssize_t end, Py_ssize_t* at, double* value) noexcept:
    """A float field's value (a float or an int, as the decoder accepts)."""
    cdef Py_ssize_t position = at[0]
    cdef uint64_t bits = 0
    cdef int kind
    cdef float single
    cdef double double_value
    cdef uint32_t single_bits
    cdef int size
    if position < end and (data[position] == 0xCB or data[position] == 0xCA):  # float64, float32
        size = 8 if data[position] == 0xCB else 4
        if end - position < 1 + size:
            return False
        bits = big_endian(data + position + 1, size)
        if size == 8:
            memcpy(&double_value, &bits, 8)
            value[0] = double_value
        else:
            single_bits = <uint32_t>bits
            memcpy(&single, &single_bits, 4)
            value[0] = single
        at[0] = position + 1 + size
        return True
    kind = int_at(data, end, at, &bits)
    if kind == 1:
        value[0] = <double>bits
    elif kind == 2:
        value[0] = <double>(<int64_t>bits)
    return kind != 0


cdef inline bint _utf8_at(const unsigned char* data, Py_ssize_t start, Py_ssize_t length) noexcept:
    """Whether a str's bytes are valid UTF-8 (the decoder refuses a str field that is not)."""
    cdef Py_ssize_t index
    for index in range(length):
        if data[start + index] >= 0x80:
            try:
                PyUnicode_DecodeUTF8(<const char*>data + start, length, NULL)
            except UnicodeDecodeError:
                return False
            return True
    return True


cdef bint _optional_int(const unsigned char* data, Py_ssize_t end, Py_ssize_t at, uint64_t* value,
                        int* kind) noexcept:
    """A field of type `int | None` at `at` (-1: absent): kind 0 for nil or absent, else the
    int's kind (`int_at`) and value; False for another type."""
    kind[0] = 0
    if at < 0 or _nil_at(data, end, &at):
        return True
    kind[0] = int_at(data, end, &at, value)
    return kind[0] != 0


cdef bint _optional_text(const unsigned char* data, Py_ssize_t end, Py_ssize_t at, bint* present) noexcept:
    """A field of type `str | None` at `at` (-1: absent), its bytes valid UTF-8."""
    cdef Py_ssize_t start = 0, length
    present[0] = False
    if at < 0 or _nil_at(data, end, &at):
        return True
    length = bytes_at(data, end, &at, True, &start)
    if length < 0 or not _utf8_at(data, start, length):
        return False
    present[0] = True
    return True


cdef inline bint _hash_at(const unsigned char* data, Py_ssize_t end, Py_ssize_t* at) noexcept:
    """`at` moved past an engine block hash (an int or bytes)."""
    cdef uint64_t value = 0
    cdef Py_ssize_t start = 0
    return int_at(data, end, at, &value) != 0 or bytes_at(data, end, at, False, &start) >= 0


cdef Py_ssize_t _list_at(const unsigned char* data, Py_ssize_t end, Py_ssize_t* at, bint hashes,
                         Py_ssize_t* first) noexcept:
    """The length of the `list[int | bytes]` (`hashes`) or `list[int]` at `at`, moved past it, its
    first element's offset in `first`; -1 for another type. (One tight pass: a prefill's list
    holds thousands of token ids.)"""
    cdef Py_ssize_t count = _header(data, end, at, 0x90, 0xDC), index, position, start = 0
    cdef unsigned char first_byte
    if count < 0:
        return -1
    position = at[0]
    first[0] = position
    for index in range(count):
        if position >= end:
            return -1
        first_byte = data[position]
        if first_byte < 0x80 or first_byte >= 0xE0:  # fixints
            position += 1
        elif 0xCC <= first_byte <= 0xD3:  # uint8..uint64, int8..int64
            position += 1 + (1 << ((first_byte - 0xCC) & 3))
            if position > end:
                return -1
        elif hashes and 0xC4 <= first_byte <= 0xC6:
            at[0] = position
            if bytes_at(data, end, at, False, &start) < 0:
                return -1
            position = at[0]
        else:
            return -1
    at[0] = position
    return count


cdef int _event_kind(const unsigned char* data, Py_ssize_t start, Py_ssize_t length) noexcept:
    if length == 11 and memcmp(data + start, b"BlockStored", 11) == 0:
        return KIND_STORED
    if length == 12 and memcmp(data + start, b"BlockRemoved", 12) == 0:
        return KIND_REMOVED
    if length == 16 and memcmp(data + start, b"AllBlocksCleared", 16) == 0:
        return KIND_CLEARED
    return 0


cdef inline bint _is_key(const unsigned char* data, Py_ssize_t start, Py_ssize_t length,
                         const char* name, Py_ssize_t name_length) noexcept:
    return length == name_length and memcmp(data + start, name, length) == 0


cdef int _field_of_key(const unsigned char* data, Py_ssize_t start, Py_ssize_t length) noexcept:
    """The field a map key names, or -1 for a key the decoder ignores (C strings compared by
    length first: no Python object touched per key)."""
    if _is_key(data, start, length, b"type", 4):
        return F_TYPE
    if _is_key(data, start, length, b"block_hashes", 12):
        return F_BLOCK_HASHES
    if _is_key(data, start, length, b"parent_block_hash", 17):
        return F_PARENT
    if _is_key(data, start, length, b"token_ids", 9):
        return F_TOKEN_IDS
    if _is_key(data, start, length, b"block_size", 10):
        return F_BLOCK_SIZE
    if _is_key(data, start, length, b"lora_id", 7):
        return F_LORA_ID
    if _is_key(data, start, length, b"medium", 6):
        return F_MEDIUM
    if _is_key(data, start, length, b"lora_name", 9):
        return F_LORA_NAME
    if _is_key(data, start, length, b"extra_keys", 10):
        return F_EXTRA_KEYS
    if _is_key(data, start, length, b"group_idx", 9):
        return F_GROUP
    if _is_key(data, start, length, b"kv_cache_spec_kind", 18):
        return F_SPEC_KIND
    if _is_key(data, start, length, b"kv_cache_spec_sliding_window", 28):
        return F_SPEC_WINDOW
    return -1


cdef inline bint _field_value(const unsigned char* data, Py_ssize_t end, Py_ssize_t* at, int field,
                              EventView* view) noexcept:
    """`at` moved past a field's value: the two lists are checked and placed on the way (into
    `view`), any other value skipped (checked after, by kind)."""
    if field == F_BLOCK_HASHES:
        view.hash_count = _list_at(data, end, at, True, &view.hashes_at)
        return view.hash_count >= 0
    if field == F_TOKEN_IDS:
        view.token_count = _list_at(data, end, at, False, &view.tokens_at)
        return view.token_count >= 0
    return _skip(data, end, at, 1)


cdef bint _scan_event(const unsigned char* data, Py_ssize_t end, Py_ssize_t* at, EventView* view) noexcept:
    """One event (array- or map-encoded) scanned into `view`, `at` moved past it; False when the
    decoder might decode it otherwise than the writer would read it."""
    cdef Py_ssize_t values[FIELD_COUNT]
    cdef Py_ssize_t count, index, start = 0, length
    cdef int field, kind = 0, int_kind = 0
    cdef uint64_t value = 0
    cdef bint present = False
    for field in range(FIELD_COUNT):
        values[field] = -1
    view.hash_count = -1
    view.token_count = 0
    view.tokens_at = 0
    count = _header(data, end, at, 0x90, 0xDC)
    if count == 0:
        return False
    if count > 0:  # array-encoded: the tag, then the fields in the class's order
        length = bytes_at(data, end, at, True, &start)
        if length < 0:
            return False
        kind = _event_kind(data, start, length)
        for index in range(1, count):
            field = -1
            if kind == KIND_STORED and index - 1 < F_TYPE:
                field = index - 1
            elif kind == KIND_REMOVED and index - 1 < 3:  # block_hashes, medium, group_idx
                field = F_BLOCK_HASHES if index == 1 else (F_MEDIUM if index == 2 else F_GROUP)
            elif kind == KIND_CLEARED and index == 1:  # medium (kvgate's one-medium clear)
                field = F_MEDIUM
            if field >= 0:
                values[field] = at[0]
            if not _field_value(data, end, at, field, view):
                return False
    else:
        count = _header(data, end, at, 0x80, 0xDE)
        if count < 0:
            return False
        for index in range(count):
            length = bytes_at(data, end, at, True, &start)
            if length < 0:
                return False
            field = _field_of_key(data, start, length)
            if field >= 0:
                if values[field] >= 0:  # a duplicate key: the decoder keeps the last one
                    return False
                values[field] = at[0]
            if not _field_value(data, end, at, field, view):
                return False
        if values[F_TYPE] < 0:
            return False
        index = values[F_TYPE]
        length = bytes_at(data, end, &index, True, &start)
        if length < 0:
            return False
        kind = _event_kind(data, start, length)
    view.kind = kind
    if kind == KIND_CLEARED:
        # A clear of one medium is read by the decoder (the writer's clear empties every medium).
        if not _optional_text(data, end, values[F_MEDIUM], &present):
            return False
        return not present
    if kind == 0 or view.hash_count < 0:
        return False
    if not _optional_text(data, end, values[F_MEDIUM], &present):
        return False
    view.medium_at = values[F_MEDIUM] if present else -1
    if not _optional_int(data, end, values[F_GROUP], &value, &int_kind):
        return False
    view.group_zero = int_kind == 0 or (int_kind == 1 and value == 0)
    if kind == KIND_REMOVED:
        return True
    index = values[F_PARENT]
    view.parent_at = -1
    if index >= 0 and not _nil_at(data, end, &index):
        view.parent_at = index
        if not _hash_at(data, end, &index):
            return False
    if not _optional_int(data, end, values[F_BLOCK_SIZE], &value, &int_kind):
        return False
    view.sixteen = int_kind == 1 and value == SIXTEEN_TOKENS
    if (not _optional_int(data, end, values[F_LORA_ID], &value, &int_kind)
            or not _optional_int(data, end, values[F_SPEC_WINDOW], &value, &int_kind)):
        return False
    if not _optional_text(data, end, values[F_SPEC_KIND], &present):
        return False
    if not _optional_text(data, end, values[F_LORA_NAME], &present):
        return False
    view.lora_name_at = values[F_LORA_NAME] if present else -1
    # extra_keys: nil, or one nil per block (keys of multimodal inputs or a cache_salt name a
    # namespace the Python path works out).
    index = values[F_EXTRA_KEYS]
    if index >= 0 and not _nil_at(data, end, &index):
        count = _header(data, end, &index, 0x90, 0xDC)
        if count < 0:
            return False
        for field in range(count):
            if not _nil_at(data, end, &index):
                return False
    return True


@cython.no_gc
cdef class WireBatch:
    """A msgpack EventBatch scanned by `scan_batch`: its events, where their fields lie in the
    payload, and their number by kind (what the subscriber counts). Untracked by the cyclic GC:
    it holds bytes and an int, never part of a cycle."""

    # (its fields: kvwire/_frames.pxd)

    def __dealloc__(self):
        if self.views is not &self.single:
            PyMem_Free(self.views)

    def __len__(self):
        return self.count


cdef bint _scan_events(const unsigned char* data, Py_ssize_t end, Py_ssize_t* at, WireBatch batch) except -1:
    """The batch's events (the array at `at`, moved past it) scanned into `batch`; False when
    one is not read exactly as the decoder would."""
    cdef Py_ssize_t count = _header(data, end, at, 0x90, 0xDC), index
    cdef int kind
    # (an event takes 2 bytes at least: a count past that is a malformed header, never an allocation)
    if count < 0 or count > (end - at[0]) // 2 or batch.views is not NULL:
        return False
    if count <= 1:
        batch.views = &batch.single
    else:
        batch.views = <EventView*>PyMem_Malloc(count * sizeof(EventView))
        if batch.views is NULL:
            raise MemoryError()
    for index in range(count):
        if not _scan_event(data, end, at, &batch.views[index]):
            return False
        kind = batch.views[index].kind
        if kind == KIND_STORED:
            batch.stored += 1
        elif kind == KIND_REMOVED:
            batch.removed += 1
        else:
            batch.cleared += 1
        batch.count = index + 1
    return True


cdef inline bint _rank_at(const unsigned char* data, Py_ssize_t end, Py_ssize_t at, WireBatch batch) except -1:
    """A rank field (`int | None`, at `at`; -1: absent) checked, and kept unless the batch has one."""
    cdef uint64_t value = 0
    cdef int kind = 0
    if not _optional_int(data, end, at, &value, &kind):
        return False
    if batch.data_parallel_rank is None and kind == 1:
        batch.data_parallel_rank = value
    elif batch.data_parallel_rank is None and kind == 2:
        batch.data_parallel_rank = <int64_t>value
    return True


def scan_batch(bytes payload):
    """The payload scanned (a `WireBatch`) when it is an EventBatch (array- or map-encoded) whose
    every event the scan reads exactly as the decoder would (module section above); None for
    any other payload, which goes to the decoder (`kvwire.decode_batch`)."""
    cdef const unsigned char* data = <const unsigned char*>PyBytes_AS_STRING(payload)
    cdef Py_ssize_t end = PyBytes_GET_SIZE(payload), at = 0, count, index, length, start = 0
    cdef Py_ssize_t rank_at = -1, attn_rank_at = -1
    cdef bint has_ts = False
    cdef WireBatch batch = WireBatch.__new__(WireBatch)
    batch.payload = payload
    batch.data_parallel_rank = None
    count = _header(data, end, &at, 0x90, 0xDC)
    if count >= 2:  # [ts, events, data_parallel_rank]
        if not _float_at(data, end, &at, &batch.ts) or not _scan_events(data, end, &at, batch):
            return None
        has_ts = True
        if count >= 3:
            rank_at = at
        for index in range(2, count):
            if not _skip(data, end, &at, 0):
                return None
    elif count < 0:
        count = _header(data, end, &at, 0x80, 0xDE)
        if count < 0:
            return None
        for index in range(count):
            length = bytes_at(data, end, &at, True, &start)
            if length < 0:
                return None
            if _is_key(data, start, length, b"ts", 2):
                if has_ts or not _float_at(data, end, &at, &batch.ts):
                    return None
                has_ts = True
                continue
            if _is_key(data, start, length, b"events", 6):
                if not _scan_events(data, end, &at, batch):  # (False for a second "events")
                    return None
                continue
            if _is_key(data, start, length, b"data_parallel_rank", 18):
                if rank_at >= 0:
                    return None
                rank_at = at
            elif _is_key(data, start, length, b"attn_dp_rank", 12):
                if attn_rank_at >= 0:
                    return None
                attn_rank_at = at
            if not _skip(data, end, &at, 0):
                return None
    if at != end or not has_ts or batch.views is NULL:
        return None
    if not _rank_at(data, end, rank_at, batch) or not _rank_at(data, end, attn_rank_at, batch):
        return None
    return batch

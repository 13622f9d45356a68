# cython: language_level=3
"""The compiled reader of KV event frames (`kvwire/_frames.pyx`): what other compiled modules
cimport to read a scanned payload in place (the router's index writer, `router/index/_ingest.pyx`).

A `WireBatch` is a payload `scan_batch` checked; each `EventView` says where one event's fields
lie in it. The readers below take a value at an offset the scan recorded: the scan already
checked its type and bounds, so they read without checking again.
"""

from libc.stdint cimport int64_t, uint32_t, uint64_t

cdef extern from "Python.h":
    object PyLong_FromUnsignedLongLong(unsigned long long value)
    object PyLong_FromLongLong(long long value)
    object PyBytes_FromStringAndSize(const char* data, Py_ssize_t size)
    object PyUnicode_DecodeUTF8(const char* data, Py_ssize_t size, const char* errors)
    const Py_ssize_t PY_SSIZE_T_MAX

cdef enum:
    # Fields of an event, in the order array-encoded BlockStored events hold them.
    F_BLOCK_HASHES, F_PARENT, F_TOKEN_IDS, F_BLOCK_SIZE, F_LORA_ID, F_MEDIUM, F_LORA_NAME,
    F_EXTRA_KEYS, F_GROUP, F_SPEC_KIND, F_SPEC_WINDOW, F_TYPE, FIELD_COUNT
    # Event kinds.
    KIND_STORED = 1
    KIND_REMOVED = 2
    KIND_CLEARED = 3
    # Nesting the scan follows inside values it skips.
    SKIP_DEPTH = 32
    # 64-bit words per 16-token block (two uint32 token ids each), as `token_words_at` fills them.
    WORDS_PER_BLOCK = 8
    # The block size `EventView.sixteen` marks (the router block: consumers take it in place).
    SIXTEEN_TOKENS = 16


cdef struct EventView:
    int kind
    # Where the elements of `block_hashes` and `token_ids` start, and how many there are.
    Py_ssize_t hashes_at, hash_count, tokens_at, token_count
    # Where the parent hash, the medium and the LoRA name lie (-1: nil or absent).
    Py_ssize_t parent_at, medium_at, lora_name_at
    # block_size is the int 16; group_idx is nil, absent or 0.
    bint sixteen, group_zero


cdef class WireBatch:
    cdef readonly bytes payload
    cdef readonly double ts
    cdef readonly object data_parallel_rank
    cdef readonly Py_ssize_t stored, removed, cleared
    cdef EventView* views
    cdef Py_ssize_t count
    # A batch of one event (the usual message) keeps its view here: no allocation.
    cdef EventView single


cdef inline uint64_t big_endian(const unsigned char* at, int size) noexcept:
    cdef uint64_t value = 0
    cdef int index
    for index in range(size):
        value = (value << 8) | at[index]
    return value


cdef inline int int_at(const unsigned char* data, Py_ssize_t end, Py_ssize_t* at, uint64_t* value) noexcept:
    """The int at `at` (moved past it): 1 with its value when it is 0 or more, 2 with its two's
    complement when negative, 0 (nothing moved) when the value there is not an int."""
    cdef Py_ssize_t position = at[0]
    cdef unsigned char first
    cdef int size
    cdef int64_t signed_value
    if position >= end:
        return 0
    first = data[position]
    if first < 0x80:
        at[0] = position + 1
        value[0] = first
        return 1
    if first >= 0xE0:
        at[0] = position + 1
        value[0] = <uint64_t>(<int64_t>(<signed char>first))
        return 2
    if first < 0xCC or first > 0xD3:
        return 0
    # uint8/16/32/64 (0xCC-0xCF), int8/16/32/64 (0xD0-0xD3): 1, 2, 4 or 8 big-endian bytes
    size = 1 << ((first - 0xCC) & 3)
    if end - position < 1 + size:
        return 0
    at[0] = position + 1 + size
    value[0] = big_endian(data + position + 1, size)
    if first <= 0xCF:
        return 1
    signed_value = <int64_t>(value[0] << (64 - 8 * size)) >> (64 - 8 * size)  # sign-extended
    value[0] = <uint64_t>signed_value
    return 1 if signed_value >= 0 else 2


cdef inline Py_ssize_t bytes_at(const unsigned char* data, Py_ssize_t end, Py_ssize_t* at,
                                 bint text, Py_ssize_t* start) noexcept:
    """The length of the str (`text`) or bin at `at`, its first byte's offset in `start`, `at`
    moved past it; -1 (nothing moved) when the value there is not one."""
    cdef Py_ssize_t position = at[0], length, size
    cdef unsigned char first
    if position >= end:
        return -1
    first = data[position]
    if text and 0xA0 <= first <= 0xBF:
        size, length = 1, first & 0x1F
    elif (text and 0xD9 <= first <= 0xDB) or (not text and 0xC4 <= first <= 0xC6):
        size = 1 << (first - (0xD9 if text else 0xC4))
        if end - position < 1 + size:
            return -1
        size, length = 1 + size, <Py_ssize_t>big_endian(data + position + 1, size)
    else:
        return -1
    if end - position - size < length:
        return -1
    start[0] = position + size
    at[0] = position + size + length
    return length


cdef inline object hash_object(const unsigned char* data, Py_ssize_t* at):
    """The engine hash at `at` (scanned: an int or bytes) as the decoder gives it, `at` moved
    past it."""
    cdef uint64_t value = 0
    cdef Py_ssize_t start = 0, length
    cdef int kind = int_at(data, PY_SSIZE_T_MAX, at, &value)
    if kind == 1:
        return PyLong_FromUnsignedLongLong(value)
    if kind == 2:
        return PyLong_FromLongLong(<int64_t>value)
    length = bytes_at(data, PY_SSIZE_T_MAX, at, False, &start)
    return PyBytes_FromStringAndSize(<const char*>data + start, length)


cdef inline bint token_at(const unsigned char* data, Py_ssize_t* at, uint64_t* value) noexcept:
    """A scanned token id (an int), `at` moved past it; False unless it is in uint32 range. The
    encodings of token ids (fixint, uint8/16/32) are read here, any other the general way."""
    cdef const unsigned char* here = data + at[0]
    cdef unsigned char first = here[0]
    if first < 0x80:
        value[0] = first
        at[0] += 1
        return True
    if first == 0xCE:
        value[0] = (<uint64_t>here[1] << 24) | (<uint64_t>here[2] << 16) | (<uint64_t>here[3] << 8) | here[4]
        at[0] += 5
        return True
    if first == 0xCD:
        value[0] = (<uint64_t>here[1] << 8) | here[2]
        at[0] += 3
        return True
    if first == 0xCC:
        value[0] = here[1]
        at[0] += 2
        return True
    return int_at(data, PY_SSIZE_T_MAX, at, value) == 1 and value[0] <= 0xFFFFFFFF


cdef inline bint token_words_at(const unsigned char* data, Py_ssize_t* at, Py_ssize_t blocks, uint64_t* words) noexcept:
    """8 words per 16-token block from scanned token ids at `at`; False unless each is uint32."""
    cdef Py_ssize_t index
    cdef uint64_t low = 0, high = 0
    for index in range(blocks * WORDS_PER_BLOCK):
        if not token_at(data, at, &low) or not token_at(data, at, &high):
            return False
        words[index] = low | (high << 32)
    return True


cdef inline object text_object(const unsigned char* data, Py_ssize_t at):
    """A scanned `str | None` field as the decoder gives it (`at` -1: None)."""
    cdef Py_ssize_t start = 0, length
    if at < 0:
        return None
    length = bytes_at(data, PY_SSIZE_T_MAX, &at, True, &start)
    return PyUnicode_DecodeUTF8(<const char*>data + start, length, NULL)

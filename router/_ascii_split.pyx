# cython: language_level=3, boundscheck=False, wraparound=False
"""The Qwen2 pre-tokenizer's split (Qwen2, 2.5 and 3 tokenizers) of pure-ASCII text, in C.

`router/ascii_encoder.py` splits ASCII text with the tokenizer's regex translated for Python's `re`;
on fresh text (every prompt of the no-reuse control, a new user message) that split and the
per-pretoken dict lookups were most of the gateway's request path. This module scans the same
pretokens with the regex's alternatives written out for ASCII, in order (leftmost alternative
first, greedy quantifiers backtracked by hand), and looks each one up in `PretokenTable`, a C hash
table over the pretoken's bytes holding its ids:

    (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*
    |\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+

with `\\p{L}` = [A-Za-z], `\\p{N}` = [0-9], `\\s` = [\\t\\n\\v\\f\\r ] (Unicode White_Space within
ASCII). `AsciiEncoder` uses it only for a tokenizer whose split regex is exactly `QWEN2_PATTERN`,
and its load-time comparison with the Rust tokenizer covers it like the `re` split.
Callers pass ASCII text only (`str.isascii()`).
"""

from cpython cimport array
from libc.stdint cimport uint32_t, uint64_t
from libc.stdlib cimport calloc, free, malloc, realloc
from libc.string cimport memcmp, memcpy, memset

import array as _array

cdef extern from "Python.h":
    const unsigned char* PyUnicode_1BYTE_DATA(object text)
    bint PyUnicode_IS_ASCII(object text)
    object PyUnicode_Substring(object text, Py_ssize_t start, Py_ssize_t end)

QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)


cdef inline bint _letter(unsigned char c) noexcept:
    c |= 32
    return 97 <= c <= 122


cdef inline bint _digit(unsigned char c) noexcept:
    return 48 <= c <= 57


cdef inline bint _space(unsigned char c) noexcept:
    return c == 32 or 9 <= c <= 13


cdef inline bint _newline(unsigned char c) noexcept:
    return c == 10 or c == 13


cdef inline bint _other(unsigned char c) noexcept:
    """[^\\s\\p{L}\\p{N}]: punctuation, symbols and control characters."""
    return not (_space(c) or _letter(c) or _digit(c))


cdef Py_ssize_t _pretoken_end(const unsigned char* s, Py_ssize_t i, Py_ssize_t n) noexcept:
    """Where the pretoken starting at `i` ends (the regex's match at `i`; every ASCII character
    starts one, so the split covers the text)."""
    cdef unsigned char c = s[i], second, third
    cdef Py_ssize_t j, last_newline
    # (?i:'s|'t|'re|'ve|'m|'ll|'d)
    if c == 39 and i + 1 < n:
        second = s[i + 1] | 32
        if second == 115 or second == 116 or second == 109 or second == 100:  # s t m d
            return i + 2
        if i + 2 < n:
            third = s[i + 2] | 32
            if (second == 114 and third == 101) or (second == 118 and third == 101) or (
                second == 108 and third == 108
            ):  # re ve ll
                return i + 3
    # [^\r\n\p{L}\p{N}]?\p{L}+
    if _letter(c) or (not _newline(c) and not _digit(c) and i + 1 < n and _letter(s[i + 1])):
        j = i + 1
        while j < n and _letter(s[j]):
            j += 1
        return j
    # \p{N}
    if _digit(c):
        return i + 1
    # ' ?[^\s\p{L}\p{N}]+[\r\n]*': the space only when a symbol follows it
    j = i + 1 if c == 32 else i
    if j < n and _other(s[j]):
        j += 1
        while j < n and _other(s[j]):
            j += 1
        while j < n and _newline(s[j]):
            j += 1
        return j
    # c is whitespace. \s*[\r\n]+: through the run's last newline.
    j = i
    last_newline = -1
    while j < n and _space(s[j]):
        if _newline(s[j]):
            last_newline = j
        j += 1
    if last_newline >= 0:
        return last_newline + 1
    # \s+(?!\S): the run, less its last character when a non-space follows; \s+: the run.
    if j < n and j - i >= 2:
        return j - 1
    return j


def split(str text):
    """The pretokens of `text` (ASCII), in order."""
    if not PyUnicode_IS_ASCII(text):
        raise ValueError("split takes ASCII text only")
    cdef const unsigned char* s = PyUnicode_1BYTE_DATA(text)
    cdef Py_ssize_t n = len(text), i = 0, end
    words = []
    while i < n:
        end = _pretoken_end(s, i, n)
        words.append(PyUnicode_Substring(text, i, end))
        i = end
    return words


cdef array.array _UINT32_ARRAY = _array.array("I")
# Bounds of what the table stores (offsets are 32-bit): past them a pretoken is not cached.
cdef Py_ssize_t _MAX_ARENA = 0xFFFFFFFF


cdef inline uint64_t _fnv1a(const unsigned char* data, Py_ssize_t size) noexcept:
    cdef uint64_t value = 14695981039346656037ULL
    cdef Py_ssize_t index
    for index in range(size):
        value ^= data[index]
        value *= 1099511628211ULL
    return value if value else 1  # 0 marks an empty slot


cdef class PretokenTable:
    """ASCII pretoken -> its token ids, for `encode`: the split above with every pretoken looked up
    in an open-addressing table over the pretoken's bytes (no str made per pretoken, no dict
    hashing it) and the ids copied into one uint32 array. `AsciiEncoder` fills it with `add`
    (ids from the tokenizer's own BPE model) for the pretokens `missing` names."""

    cdef uint64_t* _hashes  # per slot, 0 when empty
    cdef uint32_t* _key_at  # per slot: offset of the pretoken's bytes in _keys
    cdef uint32_t* _key_size
    cdef uint32_t* _ids_at  # per slot: offset of its ids in _ids
    cdef uint32_t* _ids_count
    cdef Py_ssize_t _mask, _count
    cdef unsigned char* _keys
    cdef Py_ssize_t _keys_used, _keys_capacity
    cdef uint32_t* _ids
    cdef Py_ssize_t _ids_used, _ids_capacity

    def __cinit__(self):
        self._keys_capacity = 1 << 16
        self._ids_capacity = 1 << 14
        self._keys = <unsigned char*>malloc(self._keys_capacity)
        self._ids = <uint32_t*>malloc(self._ids_capacity * sizeof(uint32_t))
        if self._keys == NULL or self._ids == NULL or not self._allocate(4096):
            raise MemoryError()

    def __dealloc__(self):
        self._free_slots()
        free(self._keys)
        free(self._ids)

    cdef void _free_slots(self) noexcept:
        free(self._hashes)
        free(self._key_at)
        free(self._key_size)
        free(self._ids_at)
        free(self._ids_count)
        self._hashes = NULL

    cdef bint _allocate(self, Py_ssize_t slots) noexcept:
        self._hashes = <uint64_t*>calloc(slots, sizeof(uint64_t))
        self._key_at = <uint32_t*>malloc(slots * sizeof(uint32_t))
        self._key_size = <uint32_t*>malloc(slots * sizeof(uint32_t))
        self._ids_at = <uint32_t*>malloc(slots * sizeof(uint32_t))
        self._ids_count = <uint32_t*>malloc(slots * sizeof(uint32_t))
        self._mask = slots - 1
        if (self._hashes == NULL or self._key_at == NULL or self._key_size == NULL
                or self._ids_at == NULL or self._ids_count == NULL):
            self._free_slots()
            return False
        return True

    cdef Py_ssize_t _find(self, const unsigned char* data, Py_ssize_t size, uint64_t value) noexcept:
        """The slot holding the pretoken, or -1-(the empty slot where it would go)."""
        cdef Py_ssize_t slot = <Py_ssize_t>(value & <uint64_t>self._mask)
        while True:
            if self._hashes[slot] == 0:
                return -1 - slot
            if (self._hashes[slot] == value and self._key_size[slot] == size
                    and memcmp(self._keys + self._key_at[slot], data, size) == 0):
                return slot
            slot = (slot + 1) & self._mask

    cdef int _grow(self) except -1:
        cdef uint64_t* hashes = self._hashes
        cdef uint32_t* key_at = self._key_at
        cdef uint32_t* key_size = self._key_size
        cdef uint32_t* ids_at = self._ids_at
        cdef uint32_t* ids_count = self._ids_count
        cdef Py_ssize_t old_slots = self._mask + 1, old, slot
        if not self._allocate(old_slots * 2):
            self._hashes, self._key_at, self._key_size = hashes, key_at, key_size
            self._ids_at, self._ids_count, self._mask = ids_at, ids_count, old_slots - 1
            raise MemoryError()
        for old in range(old_slots):
            if hashes[old] == 0:
                continue
            slot = <Py_ssize_t>(hashes[old] & <uint64_t>self._mask)
            while self._hashes[slot] != 0:
                slot = (slot + 1) & self._mask
            self._hashes[slot] = hashes[old]
            self._key_at[slot], self._key_size[slot] = key_at[old], key_size[old]
            self._ids_at[slot], self._ids_count[slot] = ids_at[old], ids_count[old]
        free(hashes)
        free(key_at)
        free(key_size)
        free(ids_at)
        free(ids_count)
        return 0

    def __len__(self):
        return self._count

    @property
    def stored_bytes(self):
        """Bytes of pretokens and ids stored (what `clear` gives back for reuse)."""
        return self._keys_used + self._ids_used * sizeof(uint32_t)

    def clear(self):
        memset(self._hashes, 0, (self._mask + 1) * sizeof(uint64_t))
        self._count = self._keys_used = self._ids_used = 0

    def __contains__(self, str word):
        cdef const unsigned char* data = _ascii_data(word)
        cdef Py_ssize_t size = len(word)
        return self._find(data, size, _fnv1a(data, size)) >= 0

    def add(self, str word, ids):
        """Store `word`'s ids (uint32 ints); False when it is too large to store (not cached)."""
        cdef const unsigned char* data = _ascii_data(word)
        cdef Py_ssize_t size = len(word), count = len(ids), slot, index
        cdef uint64_t value = _fnv1a(data, size)
        if self._find(data, size, value) >= 0:
            return True
        if self._keys_used + size > _MAX_ARENA or self._ids_used + count > _MAX_ARENA:
            return False
        if (self._count + 1) * 2 > self._mask + 1:
            self._grow()
        self._keys = <unsigned char*>_room(self._keys, &self._keys_capacity, self._keys_used + size, 1)
        self._ids = <uint32_t*>_room(self._ids, &self._ids_capacity, self._ids_used + count, sizeof(uint32_t))
        for index in range(count):  # checked before anything is stored: OverflowError leaves no trace
            self._ids[self._ids_used + index] = <uint32_t>ids[index]
        memcpy(self._keys + self._keys_used, data, size)
        slot = -1 - self._find(data, size, value)
        self._hashes[slot] = value
        self._key_at[slot], self._key_size[slot] = <uint32_t>self._keys_used, <uint32_t>size
        self._ids_at[slot], self._ids_count[slot] = <uint32_t>self._ids_used, <uint32_t>count
        self._keys_used += size
        self._ids_used += count
        self._count += 1
        return True

    def missing(self, str text):
        """The pretokens of `text` (ASCII) not in the table, in order (repeats included)."""
        cdef const unsigned char* s = _ascii_data(text)
        cdef Py_ssize_t n = len(text), i = 0, end
        words = []
        while i < n:
            end = _pretoken_end(s, i, n)
            if self._find(s + i, end - i, _fnv1a(s + i, end - i)) < 0:
                words.append(PyUnicode_Substring(text, i, end))
            i = end
        return words

    def encode(self, str text):
        """The ids of `text` (ASCII) as a uint32 `array.array` when every pretoken is in the table,
        else None."""
        cdef const unsigned char* s = _ascii_data(text)
        cdef Py_ssize_t n = len(text), i = 0, end, slot
        # Grown in place as ids are appended (amortised), no scratch copy.
        cdef array.array out = array.clone(_UINT32_ARRAY, 0, zero=False)
        while i < n:
            end = _pretoken_end(s, i, n)
            slot = self._find(s + i, end - i, _fnv1a(s + i, end - i))
            if slot < 0:
                return None
            array.extend_buffer(out, <char*>(self._ids + self._ids_at[slot]), self._ids_count[slot])
            i = end
        return out


cdef void* _room(void* buffer, Py_ssize_t* capacity, Py_ssize_t needed, size_t item) except NULL:
    """`buffer` (`capacity` items of `item` bytes) grown to hold `needed` items, at least doubled."""
    cdef Py_ssize_t grown_capacity
    cdef void* grown
    if needed <= capacity[0]:
        return buffer
    grown_capacity = max(capacity[0] * 2, needed)
    grown = realloc(buffer, grown_capacity * item)
    if grown == NULL:
        raise MemoryError()
    capacity[0] = grown_capacity
    return grown


cdef inline const unsigned char* _ascii_data(str text) except NULL:
    if not PyUnicode_IS_ASCII(text):
        raise ValueError("PretokenTable takes ASCII text only")
    return PyUnicode_1BYTE_DATA(text)

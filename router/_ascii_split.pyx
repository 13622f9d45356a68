# cython: language_level=3, boundscheck=False, wraparound=False
"""The Qwen2 pre-tokenizer's split (Qwen2, 2.5 and 3 tokenizers) of pure-ASCII text, in C.

`router/ascii_encoder.py` splits ASCII text with the tokenizer's regex translated for Python's `re`;
on fresh text (every prompt of the no-reuse control, a new user message) that split and the
per-pretoken dict lookups were most of the gateway's request path. This module scans the same
pretokens with the regex's alternatives written out for ASCII, in order (leftmost alternative
first, greedy quantifiers backtracked by hand), and looks each one up in the encoder's cache:

    (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*
    |\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+

with `\\p{L}` = [A-Za-z], `\\p{N}` = [0-9], `\\s` = [\\t\\n\\v\\f\\r ] (Unicode White_Space within
ASCII). `AsciiEncoder` uses it only for a tokenizer whose split regex is exactly `QWEN2_PATTERN`,
and its load-time comparison with the Rust tokenizer covers it like the `re` split.
Callers pass ASCII text only (`str.isascii()`).
"""

from cpython.object cimport PyObject

cdef extern from "Python.h":
    PyObject* PyDict_GetItemWithError(object mapping, object key) except? NULL
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


def encode_cached(str text, dict cache):
    """The ids of `text` (ASCII) when `cache` holds every pretoken's ids (a list each), else None."""
    if not PyUnicode_IS_ASCII(text):
        raise ValueError("encode_cached takes ASCII text only")
    cdef const unsigned char* s = PyUnicode_1BYTE_DATA(text)
    cdef Py_ssize_t n = len(text), i = 0, end
    cdef PyObject* found
    ids = []
    while i < n:
        end = _pretoken_end(s, i, n)
        found = PyDict_GetItemWithError(cache, PyUnicode_Substring(text, i, end))
        if found is NULL:
            return None
        ids.extend(<list><object>found)
        i = end
    return ids

# cython: language_level=3
"""The router-key math in C: what the compiled index module (router/index/_ingest.pyx: its writer
and `prompt_keys`) cimports to compute a router block's mixed value. router/index/keys.py states
the same math in Python (`mix`) and holds its constants: the compiled module copies them into a
`KeyMath` once (`configure`) and checks at load that both statements agree
(`ingest.load_compiled_ingest`; tests/test_index_differential.py compares them again).

Inline functions only (compiled into each module that cimports them): no call across modules.
"""

from libc.stdint cimport uint64_t

cdef enum:
    # 64-bit words per router block (two uint32 token ids each).
    KEY_WORDS = 8
    # Steps of the splitmix64 finaliser: shift, multiplier, shift, multiplier, shift.
    FINALISER_STEP_COUNT = 5


cdef struct KeyMath:
    # keys.WORD_WEIGHT_INTS, keys.POSITION_WEIGHT_INT, keys.FINALISER_STEPS.
    uint64_t word_weights[KEY_WORDS]
    uint64_t position_weight
    uint64_t finaliser[FINALISER_STEP_COUNT]


cdef inline uint64_t token_word(uint64_t low, uint64_t high) noexcept nogil:
    """Two token ids (each below 2**32) as one little-endian word."""
    return low | (high << 32)


cdef inline uint64_t block_mix(const KeyMath* math, const uint64_t* words, uint64_t position) noexcept nogil:
    """The mixed value of one router block from its 8 token words at `position` (`keys.mix`):
    the words times the word weights, summed, xor the position times the position weight, through
    the splitmix64 finaliser. Arithmetic wraps modulo 2**64, as the Python statement's does."""
    cdef uint64_t total = 0
    cdef int index
    for index in range(KEY_WORDS):
        total += words[index] * math.word_weights[index]
    total ^= position * math.position_weight
    total ^= total >> math.finaliser[0]
    total *= math.finaliser[1]
    total ^= total >> math.finaliser[2]
    total *= math.finaliser[3]
    total ^= total >> math.finaliser[4]
    return total

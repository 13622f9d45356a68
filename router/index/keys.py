"""Router keys: how the router names a prompt's prefixes, independently of any engine's block hash.

A token stream is cut into *router blocks* of `ROUTER_BLOCK_TOKENS` tokens; the prefix ending at
router block k is named by `key_k = namespace_seed + sum_{j<=k} mix(content_j, position_j)`
(uint64, wrapping). A sum of mixed per-block values is computed for a whole prompt with numpy in
one go, and continued from a parent's key when an engine announces a child block. The policies
import this module only; the index (`store.py`) and its writers (`ingest.py`) file blocks under
the same keys.
"""

from __future__ import annotations

import array
import struct
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import xxhash

ROUTER_BLOCK_TOKENS = 16


class Namespace(NamedTuple):
    """What separates cache entries of one base model: a LoRA adapter and a cache salt. The model
    itself is implied by the backend (one engine serves one base model). Salted prompts never
    match unsalted entries, nor an adapter's entries the base model's."""

    lora_name: str | None = None
    cache_salt: str | None = None


DEFAULT_NAMESPACE = Namespace()


def namespace_seed(namespace: Namespace | tuple[str | None, str | None]) -> int:
    """The key of the empty prefix in a namespace."""
    lora_name, cache_salt = namespace
    if lora_name is None and cache_salt is None:
        return 0x2545F4914F6CDD1D
    return xxhash.xxh3_64_intdigest(repr((lora_name, cache_salt)).encode())


_rng = np.random.default_rng(0x6B76676174)
# A router block's 16 uint32 tokens are read as 8 little-endian uint64 words (two tokens each) and
# combined with odd 64-bit weights (fixed seed: keys are stable across runs and processes).
WORDS_PER_BLOCK = ROUTER_BLOCK_TOKENS // 2
_TOKEN_DTYPE = np.dtype("<u4")
WORD_WEIGHTS = _rng.integers(0, 2**63, size=WORDS_PER_BLOCK, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
POSITION_WEIGHT = np.uint64(0x9E3779B97F4A7C15)
# The splitmix64 finaliser, in the order `mix` applies its steps: x ^= x >> shift, x *= multiplier,
# x ^= x >> shift, x *= multiplier, x ^= x >> shift.
FINALISER_STEPS: tuple[int, int, int, int, int] = (30, 0xBF58476D1CE4E5B9, 27, 0x94D049BB133111EB, 31)
# (numpy scalars for numpy arrays: a Python int operand is converted at every operation)
_FINALISER_STEPS_NUMPY = tuple(np.uint64(step) for step in FINALISER_STEPS)

UINT64_MASK = (1 << 64) - 1
# The weights as Python ints (the one-block path; the compiled module is configured with these).
WORD_WEIGHT_INTS: tuple[int, ...] = tuple(WORD_WEIGHTS.tolist())
POSITION_WEIGHT_INT = int(POSITION_WEIGHT)
# Below this many router blocks, plain Python ints beat numpy's per-call overhead.
NUMPY_MIN_BLOCKS = 3
# A lookup computes a prompt's keys this many router blocks (32k tokens) at a time.
LOOKUP_SPAN_BLOCKS = 2048
# position * POSITION_WEIGHT for the positions of a prompt's first span: `router_block_values` slices it.
_POSITION_TERMS = np.arange(LOOKUP_SPAN_BLOCKS, dtype=np.uint64) * POSITION_WEIGHT


def mix(word_sums: Any, position_terms: Any, steps: tuple[Any, ...], wrap: bool) -> Any:
    """A router block's mixed value: the key math, stated once for Python (the compiled module's
    statement is `block_mix` in router/index/_keys.pxd). `word_sums`: the block's 8 words times
    WORD_WEIGHTS, summed; `position_terms`: its position times POSITION_WEIGHT; their xor goes
    through the splitmix64 finaliser (`steps`: FINALISER_STEPS), which makes the value a nonlinear
    function of content and position.

    The same code serves Python ints (`wrap`: each step reduced modulo 2**64) and numpy uint64
    arrays of many blocks (`wrap` false: their arithmetic wraps by itself; changed in place)."""
    shift_1, multiplier_1, shift_2, multiplier_2, shift_3 = steps
    x = word_sums
    x ^= position_terms
    if wrap:  # (xor and mask commute: the sum is masked once, with the position term)
        x &= UINT64_MASK
    x ^= x >> shift_1
    x *= multiplier_1
    if wrap:
        x &= UINT64_MASK
    x ^= x >> shift_2
    x *= multiplier_2
    if wrap:
        x &= UINT64_MASK
    x ^= x >> shift_3
    return x


def router_block_values(tokens: np.ndarray, first_block: int | np.ndarray) -> np.ndarray:
    """`mix` of each full router block of `tokens` (uint32, length a multiple of the block size),
    with numpy: one pass for any number of blocks.

    `first_block` is the position of the first block, or an array with every block's position.
    """
    if tokens.dtype != _TOKEN_DTYPE or not tokens.flags.c_contiguous:  # (numpy's cost is per call)
        tokens = np.ascontiguousarray(tokens, dtype=_TOKEN_DTYPE)
    words = tokens.view("<u8").reshape(-1, WORDS_PER_BLOCK)
    if isinstance(first_block, np.ndarray):
        if first_block.dtype != np.uint64:
            first_block = first_block.astype(np.uint64)
        position_terms = first_block * POSITION_WEIGHT
    elif first_block + len(words) <= len(_POSITION_TERMS):
        position_terms = _POSITION_TERMS[first_block : first_block + len(words)]
    else:
        position_terms = np.arange(first_block, first_block + len(words), dtype=np.uint64) * POSITION_WEIGHT
    return mix(words @ WORD_WEIGHTS, position_terms, _FINALISER_STEPS_NUMPY, False)


# One block's 16 tokens packed and read back as its 8 words in two C calls (struct.error for token
# ids that are not uint32); 8 products of words by their weights cost half of 16 per token.
_PACK_BLOCK = struct.Struct(f"<{ROUTER_BLOCK_TOKENS}I").pack
_UNPACK_WORDS = struct.Struct(f"<{WORDS_PER_BLOCK}Q").unpack
# (unrolled below: one name per weight is cheaper to read than an index into a tuple)
(
    _WORD_WEIGHT_0, _WORD_WEIGHT_1, _WORD_WEIGHT_2, _WORD_WEIGHT_3,
    _WORD_WEIGHT_4, _WORD_WEIGHT_5, _WORD_WEIGHT_6, _WORD_WEIGHT_7,
) = WORD_WEIGHT_INTS  # fmt: skip


def block_value(block_tokens: Sequence[int], position: int) -> int:
    """`mix` of one block with Python ints (cheaper than numpy for a block or two): the same value
    as `router_block_values`. Raises struct.error when a token id is not a uint32."""
    w0, w1, w2, w3, w4, w5, w6, w7 = _UNPACK_WORDS(_PACK_BLOCK(*block_tokens))
    word_sum = (
        w0 * _WORD_WEIGHT_0 + w1 * _WORD_WEIGHT_1 + w2 * _WORD_WEIGHT_2 + w3 * _WORD_WEIGHT_3
        + w4 * _WORD_WEIGHT_4 + w5 * _WORD_WEIGHT_5 + w6 * _WORD_WEIGHT_6 + w7 * _WORD_WEIGHT_7
    )  # fmt: skip
    return mix(word_sum, position * POSITION_WEIGHT_INT, FINALISER_STEPS, True)  # type: ignore[no-any-return]


def small_prefix_keys(tokens: Sequence[int], seed: int, first_block: int) -> list[int]:
    """The same keys as `prefix_keys`, computed with Python ints (faster for one or two blocks)."""
    keys = []
    total = seed
    for block in range(len(tokens) // ROUTER_BLOCK_TOKENS):
        offset = block * ROUTER_BLOCK_TOKENS
        total = (
            total + block_value(tokens[offset : offset + ROUTER_BLOCK_TOKENS], first_block + block)
        ) & UINT64_MASK
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


def stream_keys(tokens: array.array, seed: int, first_block: int) -> list[int]:
    """Keys of a uint32 token stream (an `array.array("I")`, read in place)."""
    if len(tokens) < NUMPY_MIN_BLOCKS * ROUTER_BLOCK_TOKENS:
        return small_prefix_keys(tokens, seed, first_block)
    return prefix_keys(np.frombuffer(tokens, dtype=np.uint32), seed, first_block).tolist()


def extend_tokens(stream: array.array, tokens: Sequence[int]) -> None:
    """Append token ids to a uint32 `array.array` (OverflowError or TypeError for ids that are
    not uint32). `fromlist` takes a list faster than `extend` or the array constructor, and
    leaves the array unchanged on failure."""
    if tokens.__class__ is list:
        stream.fromlist(tokens)  # type: ignore[arg-type]
    else:
        stream.extend(tokens)


def token_array(tokens: np.ndarray | Sequence[int]) -> np.ndarray:
    """A prompt's tokens as a uint32 array. A list goes through `array.array` (`extend_tokens`),
    much faster than `np.asarray` for Python ints. Token ids outside uint32 raise OverflowError."""
    if isinstance(tokens, np.ndarray):
        return tokens.astype(np.uint32, copy=False)
    stream = array.array("I")
    extend_tokens(stream, tokens)
    return np.frombuffer(stream, dtype=np.uint32)


# The compiled loop behind prompt_prefix_keys (`prompt_keys` of router/index/_ingest.pyx), once
# router/index/ingest.py has loaded it and checked it computes these keys; numpy's otherwise.
_compiled_prompt_keys: Callable[[np.ndarray, int], list[int]] | None = None


def use_compiled_prompt_keys(function: Callable[[np.ndarray, int], list[int]] | None) -> None:
    """Compute prompt_prefix_keys with `function(tokens, seed)` (None: with numpy)."""
    global _compiled_prompt_keys
    _compiled_prompt_keys = function


def prompt_prefix_keys(tokens: np.ndarray | list[int], namespace: Namespace = DEFAULT_NAMESPACE) -> list[int]:
    """The router keys of every full router block of a prompt, as Python ints (shared with policies)."""
    array = token_array(tokens)
    if _compiled_prompt_keys is not None:
        return _compiled_prompt_keys(np.ascontiguousarray(array), namespace_seed(namespace))
    return prefix_keys(array, namespace_seed(namespace)).tolist()

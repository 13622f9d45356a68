"""What earlier requests left for later ones to reuse: the piece cache, the cut memory and the
prompt memory, each a bounded LRU shared by the event loop and the tokenizer thread.

- PieceCache: a piece of rendered text (in practice a message, cut after its added token) -> its
  tokens, so a follow-up turn encodes only its new messages;
- CutMemory: where a long text was cut into segments, and each segment's tokens, so a new question
  after the same document cuts and looks up only what follows the shared part;
- PromptMemory: earlier prompts up to their last added token, with their tokens, so a chat's next
  turn takes everything it repeats at once.

Each is bounded by what it is sized in (tokens or characters) and by the memory its entries hold.
"""

from __future__ import annotations

import math
import sys
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

# Characters of long texts whose segmentation is remembered (CutMemory): 8 Mi (~450 documents of
# 18k characters); the memory holds their text (1-4 bytes a character) and tokens (~1 per 4 chars).
CUT_MEMORY_CHARS = 8 << 20
# Characters of earlier prompts (up to their last added token) whose tokens are remembered
# (PromptMemory): a chat's next turn repeats its previous prompt up to there.
PROMPT_MEMORY_CHARS = 16 << 20
# Characters before a prompt's boundary that key it in PromptMemory (with the boundary's offset).
_PROMPT_KEY_CHARS = 64
# Memory the piece cache and the prompt memory may hold, entries' overhead included (entry_bytes):
# their token and character bounds assume pieces and prompts of hundreds of characters (~40 MB at
# those bounds), but a client sending many distinct short ones (a word and an added token) paid
# ~280 bytes of Python objects an entry against a bound that counted 2 tokens or ~12 characters,
# over 1 GB a model before either bound evicted anything.
PIECE_CACHE_BYTES = 96 << 20
PROMPT_MEMORY_BYTES = 64 << 20
# What an entry holds beyond its text and its ids' data: a numpy array's header (112 bytes) and an
# OrderedDict entry (~100, measured with tracemalloc on 3.11).
_ENTRY_OVERHEAD_BYTES = 212
# A prompt memory entry's key (a tuple, an int and up to _PROMPT_KEY_CHARS characters) and its
# value's tuple, beyond entry_bytes.
PROMPT_ENTRY_KEY_BYTES = 200


def entry_bytes(text: str, ids: np.ndarray) -> int:
    """Memory an LRU entry text -> ids holds: the str, the ids' data and the entry's objects. The
    caches keep arrays that own their data, or views of a base little larger (a prompt's tokens
    without its open tail): a view counts its own bytes, not the base it keeps alive."""
    return sys.getsizeof(text) + ids.nbytes + _ENTRY_OVERHEAD_BYTES


class _BoundedLRU:
    """An LRU map bounded by two totals over its entries: a size (tokens or characters, what the
    cache is sized in) and the memory they hold. Subclasses say what an entry weighs (`_weigh`, the
    same answer for an entry whenever asked) and what they look up; one lock, the tokenizer thread
    and the event loop share it."""

    def __init__(self, max_size: int, max_bytes: float) -> None:
        self.max_size = max_size
        self.max_bytes = max_bytes
        self._entries: OrderedDict[Any, Any] = OrderedDict()
        self.size = 0
        self.bytes = 0
        self._lock = threading.Lock()

    def _weigh(self, key: Any, value: Any) -> tuple[int, int]:
        raise NotImplementedError

    def _get(self, key: Any) -> Any:
        """The value under `key` (now the most recently used), or None."""
        with self._lock:
            value = self._entries.get(key)
            if value is not None:
                self._entries.move_to_end(key)
            return value

    def _put(self, key: Any, value: Any) -> None:
        """Store (or replace) an entry, evicting the least recently used past either bound; an entry
        over a bound by itself is not stored."""
        size, nbytes = self._weigh(key, value)
        if size > self.max_size or nbytes > self.max_bytes:
            return
        with self._lock:
            replaced = self._entries.pop(key, None)
            if replaced is not None:
                replaced_size, replaced_bytes = self._weigh(key, replaced)
                self.size -= replaced_size
                self.bytes -= replaced_bytes
            self._entries[key] = value
            self.size += size
            self.bytes += nbytes
            while self.size > self.max_size or self.bytes > self.max_bytes:
                evicted_size, evicted_bytes = self._weigh(*self._entries.popitem(last=False))
                self.size -= evicted_size
                self.bytes -= evicted_bytes

    def __len__(self) -> int:
        return len(self._entries)


class PieceCache(_BoundedLRU):
    """Text piece -> token ids, bounded by the tokens cached and by the memory its entries hold."""

    def __init__(self, max_tokens: int, max_bytes: int = PIECE_CACHE_BYTES) -> None:
        super().__init__(max_tokens, max_bytes)
        self.hits = 0
        self.misses = 0

    def _weigh(self, key: str, value: np.ndarray) -> tuple[int, int]:
        return len(value), entry_bytes(key, value)

    def get(self, text: str) -> np.ndarray | None:
        ids = self._get(text)
        if ids is None:
            self.misses += 1
        else:
            self.hits += 1
        return ids

    def peek(self, text: str) -> bool:
        """Whether `text` is cached (no hit or miss counted, LRU order unchanged)."""
        return text in self._entries

    def put(self, text: str, ids: np.ndarray) -> None:
        self._put(text, ids)


class SegmentedText:
    """A long piece's text before its added token, where it was cut, and each segment's tokens."""

    __slots__ = ("body", "ends", "ids")

    def __init__(self, body: str, ends: list[int], ids: list[np.ndarray]) -> None:
        self.body = body  # the text the segments concatenate to
        self.ends = ends  # each segment's end offset in body (the last one is len(body))
        self.ids = ids  # each segment's tokens


class CutMemory(_BoundedLRU):
    """The last segmentation of each long text, by its first segment's worth of characters, so a
    piece that repeats a long beginning (a new question after the same document) cuts and looks
    up only what follows the shared part. Bounded by the characters of the texts it holds (their
    tokens take about a byte a character more: no second bound)."""

    def __init__(self, max_chars: int) -> None:
        super().__init__(max_chars, math.inf)

    def _weigh(self, key: tuple[int, str], value: SegmentedText) -> tuple[int, int]:
        return len(value.body), 0

    def get(self, segment_chars: int, body: str) -> SegmentedText | None:
        return self._get((segment_chars, body[:segment_chars]))

    def put(self, segment_chars: int, segmented: SegmentedText) -> None:
        self._put((segment_chars, segmented.body[:segment_chars]), segmented)


class PromptMemory(_BoundedLRU):
    """Earlier prompts cut at their last added token, with their tokens, so a chat's next turn (the
    same conversation plus new messages) takes the tokens of everything it repeats at once and
    encodes only what follows. Bounded by the characters of the prompts it holds and by the memory
    its entries hold (max_bytes).

    A prompt is found by its boundaries: for each offset right after an added token, (offset, the
    _PROMPT_KEY_CHARS characters before it) is looked up, latest offset first, and a hit counts
    only if the new text starts with the whole remembered prompt."""

    def __init__(self, max_chars: int, max_bytes: int = PROMPT_MEMORY_BYTES) -> None:
        super().__init__(max_chars, max_bytes)
        self.hits = 0

    def _weigh(self, key: tuple[int, str], value: tuple[str, np.ndarray]) -> tuple[int, int]:
        prompt, ids = value
        return len(prompt), entry_bytes(prompt, ids) + PROMPT_ENTRY_KEY_BYTES

    def longest_prefix(self, text: str, boundaries: list[int]) -> tuple[int, np.ndarray] | None:
        """(end, tokens) of the longest remembered prompt `text` starts with, ending at one of
        `boundaries` (ascending offsets right after added tokens), or None."""
        with self._lock:
            for end in reversed(boundaries):
                key = (end, text[max(0, end - _PROMPT_KEY_CHARS) : end])
                found = self._entries.get(key)
                if found is not None and text.startswith(found[0]):
                    self._entries.move_to_end(key)
                    self.hits += 1
                    return end, found[1]
        return None

    def put(self, prompt: str, ids: np.ndarray) -> None:
        if prompt:
            self._put((len(prompt), prompt[-_PROMPT_KEY_CHARS:]), (prompt, ids))

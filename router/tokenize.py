"""Prompt tokens exactly as the engine will see them, cached per message, long ones off the event loop.

Chat requests are rendered with the model's chat template the way vLLM's /v1/chat/completions
renders them (add_generation_prompt unless the request says otherwise or continues the final
message; tools; chat_template_kwargs; text parts of list contents joined by newlines) and the text
is encoded without adding special tokens. Completions are encoded with the tokenizer's special
tokens (vLLM's default for /v1/completions; `add_special_tokens` in the body overrides); token-id
prompts pass through. `tokenize: engine` asks a backend's POST /tokenize instead.

Caching: the rendered text is cut right after every added token (`<|im_start|>`, `<|im_end|>`,
...). The tokenizer extracts added tokens before running BPE, so the pieces between them encode
independently and the concatenation of the pieces' tokens equals the whole text's tokens. Each
piece (in practice: each message) is cached, so a follow-up turn encodes only its new messages.
Every tokenizer is checked for that property when loaded; where it does not hold, the cache is off.

Long pieces (a document and its question in one message) are also cached by segments, so a new
question after the same document encodes only the last segment. A piece is cut, about every
SEGMENT_CHARS characters, before a space that follows an ASCII letter or digit and precedes an ASCII
letter (" word"), and only where the tokenizer's own pre-tokenizer, run on the text around the cut,
starts a pretoken there. BPE runs per pretoken and NFC normalisation never joins across an ASCII
character, so the segments' tokens concatenate to the piece's tokens. This too is checked against
whole-text encoding when the tokenizer is loaded; where it does not hold, segments are off.

Encoding: a piece that is all ASCII goes through router/ascii_encoder.py (the same split regex on
Python's `re`, the tokenizer's own BPE model; ~6x cheaper than the Rust tokenizer's regex engine),
any other through the tokenizer. Where the work runs: see OFF_LOOP_MIN_CHARS below and
docs/request-path.md.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import functools
import gc
import itertools
import logging
import math
import os
import re
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from router.ascii_encoder import AsciiEncoder
from router.chat_render import FastChatRenderer
from router.errors import KvgateError, log_unexpected
from router.index.keys import Namespace
from router.recent_keys import RecentKeys
from router.template_sandbox import TemplateSandbox, TemplateSandboxError

if TYPE_CHECKING:
    from router.backends import BackendState
    from router.config import Config
    from router.policies.base import RouteRequest

logger = logging.getLogger("kvgate.tokenize")

# Where tokenization leaves the event loop (docs/request-path.md has the costs behind these lines).
# The hop to the tokenizer thread costs the request time; it pays only where the loop would
# otherwise stall for longer, for other requests. Text the Rust tokenizer encodes releases the GIL
# there, so the loop runs meanwhile: moved from OFF_LOOP_MIN_CHARS uncached characters. The ASCII
# fast path (Python) holds the GIL, so a thread frees the loop only at the interpreter's switch
# interval: moved only past the far larger OFF_LOOP_MIN_ASCII_CHARS.
# The chat template is rendered on the loop (jinja holds the GIL too), unless the chat has at least
# OFF_LOOP_MIN_MESSAGES messages; prompts under OFF_LOOP_MIN_CHARS of content stay on the loop whole.
OFF_LOOP_MIN_CHARS = 2048
OFF_LOOP_MIN_ASCII_CHARS = 65536
OFF_LOOP_MIN_MESSAGES = 128
# Whatever the request holds, the whole of its tokenization (template included) runs in the thread
# when the body has this many bytes besides its plain text (tools, content parts, token ids), or
# this many bytes in all: that work is Python's, in proportion to the input, and a client sets it.
OFF_LOOP_MIN_STRUCTURE_BYTES = 65536
OFF_LOOP_MIN_BODY_BYTES = 1 << 20
OFF_LOOP_MIN_TOKEN_IDS = 16384
# A prompt longer than this is routed without tokens (by load): no engine takes it whole, and the
# policy's work on its blocks is the event loop's. A body over ROUTING_MAX_BODY_BYTES is not even
# tokenized: its prompt would be about that long or longer, and the work (seconds, in the thread
# but under the GIL) would slow the loop for nothing.
ROUTING_MAX_TOKENS = 1 << 20
ROUTING_MAX_BODY_BYTES = 8 << 20
# A request waits this long for work in the thread, then is routed without tokens.
OFF_LOOP_TIMEOUT_S = 5.0
# Token ids converted per step (the conversion holds the GIL; see _as_tokens).
_TOKEN_ID_CHUNK = 65536
# Longest text a client's template may render: this many characters per body byte, plus a floor.
RENDERED_MAX_CHARS_PER_BODY_BYTE = 4
RENDERED_MIN_CHARS = 1 << 20
# Pieces at least this long are encoded and cached by segments of about SEGMENT_CHARS characters
# (an ASCII one from the second piece that begins like it: PromptTokenizer.long_pieces).
SEGMENTED_MIN_CHARS = 2048
SEGMENT_CHARS = 512
# Beginnings of long ASCII pieces seen once that are remembered (hashes, in two generations).
LONG_PIECE_SIGHTINGS = 65_536
# Characters of long texts whose segmentation is remembered (_CutMemory): 8 Mi (~450 documents of
# 18k characters); the memory holds their text (1-4 bytes a character) and tokens (~1 per 4 chars).
CUT_MEMORY_CHARS = 8 << 20
# Characters of earlier prompts (up to their last added token) whose tokens are remembered
# (_PromptMemory): a chat's next turn repeats its previous prompt up to there.
PROMPT_MEMORY_CHARS = 16 << 20
# Characters before a prompt's boundary that key it in _PromptMemory (with the boundary's offset).
_PROMPT_KEY_CHARS = 64
# Memory the piece cache and the prompt memory may hold, entries' overhead included (_entry_bytes):
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
# value's tuple, beyond _entry_bytes.
_PROMPT_ENTRY_KEY_BYTES = 200
# A candidate cut: before a space between an ASCII letter or digit and an ASCII letter.
_CUT_CANDIDATE = re.compile(r"(?<=[A-Za-z0-9]) (?=[A-Za-z])")
# Characters each side of a cut that the pre-tokenizer sees to confirm it.
_CUT_CONTEXT_CHARS = 16


class TokenizeError(KvgateError, ValueError):
    """The request cannot be tokenized (bad messages, a template error, an unusable prompt)."""


def _entry_bytes(text: str, ids: np.ndarray) -> int:
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


class _PieceCache(_BoundedLRU):
    """Text piece -> token ids, bounded by the tokens cached and by the memory its entries hold."""

    def __init__(self, max_tokens: int, max_bytes: int = PIECE_CACHE_BYTES) -> None:
        super().__init__(max_tokens, max_bytes)
        self.hits = 0
        self.misses = 0

    def _weigh(self, key: str, value: np.ndarray) -> tuple[int, int]:
        return len(value), _entry_bytes(key, value)

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


class _SegmentedText:
    """A long piece's text before its added token, where it was cut, and each segment's tokens."""

    __slots__ = ("body", "ends", "ids")

    def __init__(self, body: str, ends: list[int], ids: list[np.ndarray]) -> None:
        self.body = body  # the text the segments concatenate to
        self.ends = ends  # each segment's end offset in body (the last one is len(body))
        self.ids = ids  # each segment's tokens


class _CutMemory(_BoundedLRU):
    """The last segmentation of each long text, by its first segment's worth of characters, so a
    piece that repeats a long beginning (a new question after the same document) cuts and looks
    up only what follows the shared part. Bounded by the characters of the texts it holds (their
    tokens take about a byte a character more: no second bound)."""

    def __init__(self, max_chars: int) -> None:
        super().__init__(max_chars, math.inf)

    def _weigh(self, key: tuple[int, str], value: _SegmentedText) -> tuple[int, int]:
        return len(value.body), 0

    def get(self, segment_chars: int, body: str) -> _SegmentedText | None:
        return self._get((segment_chars, body[:segment_chars]))

    def put(self, segment_chars: int, segmented: _SegmentedText) -> None:
        self._put((segment_chars, segmented.body[:segment_chars]), segmented)


class _PromptMemory(_BoundedLRU):
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
        return len(prompt), _entry_bytes(prompt, ids) + _PROMPT_ENTRY_KEY_BYTES

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


def _added_tokens_pattern(added: list[str]) -> re.Pattern[str] | None:
    """A regex finding the added tokens, longest first where several match at one place (as the
    tokenizer extracts them). Their common beginning ("<" for most models) is written once before
    the alternatives: `re` then scans for that literal instead of trying every alternative at every
    character (a chat prompt's boundaries 12 -> 8 µs). The matches are the same: at any offset the
    alternatives are tried in the same order, each after the same beginning."""
    if not added:
        return None
    ordered = sorted(added, key=len, reverse=True)
    common = os.path.commonprefix(ordered)  # noqa: RUF071 (characters, not path components)
    alternatives = "|".join(re.escape(token[len(common) :]) for token in ordered)
    return re.compile(f"{re.escape(common)}(?:{alternatives})")


class PromptTokenizer:
    """One model's tokenizer, rendering and encoding requests the way vLLM does."""

    def __init__(
        self, tokenizer_dir: str, *, cache_tokens: int = 4_000_000, cut_memory_chars: int = CUT_MEMORY_CHARS
    ) -> None:
        from transformers import AutoTokenizer  # heavy: imported only when a model needs it

        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        self.source = tokenizer_dir
        self.cache = _PieceCache(cache_tokens)
        self.cuts = _CutMemory(cut_memory_chars)
        self.prompts = _PromptMemory(PROMPT_MEMORY_CHARS)
        # Long ASCII pieces seen once, by a hash of their first SEGMENT_CHARS characters: only a piece
        # that begins like one seen before (a document asked about again, a new question in the same
        # message) is worth cutting into segments for the cut memory; a piece seen once (a system
        # prompt, a unique retrieved context) is encoded whole, at the ASCII encoder's few ns a
        # character instead of a cut search and a cache entry per segment (a collision only cuts a
        # piece early).
        self.long_pieces = RecentKeys(LONG_PIECE_SIGHTINGS)
        self._last_split: tuple[str, list[str], np.ndarray | None] | None = None
        self._added_pattern = _added_tokens_pattern(list(self.tokenizer.added_tokens_encoder))
        self.piecewise = self._added_pattern is not None and self._piecewise_encoding_is_exact()
        if not self.piecewise:
            logger.info(
                "tokenizer %s: per-message cache off (pieces do not encode independently)", tokenizer_dir
            )
        # The Rust tokenizer under a fast transformers tokenizer: its pre-tokenizer confirms cuts,
        # its encode gives character offsets (checked against self.tokenizer.encode below).
        self._pre_tokenizer_owner: Any = getattr(self.tokenizer, "backend_tokenizer", None)
        self._pre_tokenizer = getattr(self._pre_tokenizer_owner, "pre_tokenizer", None)
        self._added_ids: dict[str, int] = dict(self.tokenizer.added_tokens_encoder)
        # Pieces that are all ASCII skip the Rust regex engine (router/ascii_encoder.py); the
        # segment check below runs through it too, against the tokenizer's own encode.
        self._ascii: AsciiEncoder | None = None
        if self.piecewise and self._pre_tokenizer_owner is not None:
            self._ascii = AsciiEncoder.for_tokenizer(self._pre_tokenizer_owner)
        self.segmented = (
            self.piecewise and self._pre_tokenizer is not None and self._segmented_encoding_is_exact()
        )
        self.template_reads_sped_up = _speed_up_template_reads(self.tokenizer)
        # Plain chats rendered without apply_chat_template's per-call work (router/chat_render.py).
        self.fast_render = FastChatRenderer(self.tokenizer)
        # A loaded tokenizer is ~200k Python objects (vocabulary, merges) that live as long as the
        # process: out of the cyclic collector's reach, a full collection no longer walks them all
        # (hundreds of ms each, some every thousand requests). Collected first, so no garbage is kept.
        gc.collect()
        gc.freeze()
        if self.piecewise and not self.segmented:
            logger.info("tokenizer %s: segment cache for long messages off (checks failed)", tokenizer_dir)

    # ---- public ----

    def tokens_for(self, body: dict[str, Any]) -> np.ndarray:
        """The prompt tokens of a chat (`messages`) or completion (`prompt`) request body."""
        prompt = self.prompt_text(body)
        if isinstance(prompt, np.ndarray):
            return prompt
        text, add_special_tokens = prompt
        return self.encode_text(text, add_special_tokens=add_special_tokens)

    def prompt_text(self, body: dict[str, Any]) -> tuple[str, bool] | np.ndarray:
        """What to encode for a request body, and whether special tokens are added; a prompt given
        as token ids comes back as its tokens."""
        if "messages" in body:
            return self.render_chat(body), bool(body.get("add_special_tokens"))
        if "prompt" not in body:
            raise TokenizeError("the body has neither `messages` nor `prompt`")
        prompt = body["prompt"]
        add_special = body.get("add_special_tokens", True)
        if isinstance(prompt, list) and prompt:
            first = prompt[0]
            if isinstance(first, int):
                return _as_tokens(prompt)
            # A batch of prompts: route by the first (the engine caches each).
            if isinstance(first, list):
                return _as_tokens(first)
            prompt = first
        if not isinstance(prompt, str):
            raise TokenizeError("`prompt` must be a string, a list of token ids, or a list of those")
        return prompt, bool(add_special)

    def uncached_chars(self, text: str, *, add_special_tokens: bool) -> tuple[int, int]:
        """Characters encode_text(text) would encode, not finding them cached: (through the
        tokenizer, through the ASCII fast path). Reads the cache without counting hits or misses.

        A long piece that is not cached whole counts from the end of the segments remembered for
        a text that began like it (self.cuts: a new question after the same document), else whole,
        though its leading segments may be cached: finding out would cut it into segments twice."""
        if add_special_tokens or not self.piecewise:
            cached = not add_special_tokens and self.cache.peek(text)
            return (0 if cached else len(text)), 0
        slow = fast = 0
        pieces, _ = self._pieces_after_remembered_prompt(text)
        for piece in pieces:
            if self.cache.peek(piece):
                continue
            if self.segmented and len(piece) >= SEGMENTED_MIN_CHARS:
                known_ends, _ = self._remembered_segments(self._split_added(piece)[0], SEGMENT_CHARS)
                if known_ends:
                    piece = piece[known_ends[-1] :]
            if self._ascii is not None and piece.isascii():
                fast += len(piece)
            else:
                slow += len(piece)
        return slow, fast

    def encodes_on_fast_path(self, text: str, add_special_tokens: bool) -> bool:
        """Whether encode_text takes every uncached character of `text` through the ASCII encoder
        (a check of the text's ASCII flag, without looking it up in the caches)."""
        return self._ascii is not None and not add_special_tokens and self.piecewise and text.isascii()

    def render_chat(self, body: dict[str, Any]) -> str:
        fast = self._render_plain_chat(body)
        return fast if fast is not None else render_chat(self.tokenizer, body)

    def _render_plain_chat(self, body: dict[str, Any]) -> str | None:
        """The model's template applied by the fast renderer, or None where the request is not a
        plain chat it renders exactly (tools, a continued message, the request's own template...)."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or body.get("tools"):
            return None
        if body.get("continue_final_message") or body.get("chat_template") is not None:
            return None
        variables = body.get("chat_template_kwargs") or {}
        if not isinstance(variables, dict) or "chat_template" in variables:
            return None
        add_generation_prompt = body.get("add_generation_prompt")
        try:
            flattened = [_flatten_content(message) for message in messages]
        except TokenizeError:
            return None
        return self.fast_render.render(
            flattened, True if add_generation_prompt is None else bool(add_generation_prompt), variables
        )

    def encode_text(self, text: str, *, add_special_tokens: bool) -> np.ndarray:
        if add_special_tokens or not self.piecewise:
            cached = self.cache.get(text) if not add_special_tokens else None
            if cached is not None:
                return cached
            ids = np.asarray(
                self.tokenizer.encode(text, add_special_tokens=add_special_tokens), dtype=np.uint32
            )
            if not add_special_tokens:
                self.cache.put(text, ids)
            return ids
        pieces, remembered = self._pieces_after_remembered_prompt(text)
        parts = [] if remembered is None else [remembered]
        for piece in pieces:
            ids = self.cache.get(piece)
            if ids is None:
                if self.segmented and len(piece) >= SEGMENTED_MIN_CHARS and self._worth_segments(piece):
                    ids = self._encode_by_segments(piece)
                else:
                    ids = self._encode_plain(piece)
                self.cache.put(piece, ids)
            parts.append(ids)
        ids = np.concatenate(parts) if parts else np.empty(0, dtype=np.uint32)
        # Remembered up to its last added token: the next turn's prompt repeats it to there.
        open_tail = pieces[-1] if pieces and self._added_pattern.search(pieces[-1]) is None else ""
        if pieces and len(pieces) > (1 if open_tail else 0):
            tail_tokens = len(parts[-1]) if open_tail else 0
            self.prompts.put(text[: len(text) - len(open_tail)], ids[: len(ids) - tail_tokens])
        return ids

    def _pieces_after_remembered_prompt(self, text: str) -> tuple[list[str], np.ndarray | None]:
        """The pieces of `text` after the longest remembered prompt it starts with, and that
        prompt's tokens (None when there is none: all of text's pieces). The last answer is kept:
        a request asks for the same text twice (uncached_chars, then encode_text)."""
        last = self._last_split
        if last is not None and last[0] is text:
            return last[1], last[2]
        assert self._added_pattern is not None
        # Offsets right after each added token; the pieces before a remembered prompt's end are
        # never cut out of the text.
        boundaries = [match.end() for match in self._added_pattern.finditer(text)]
        found = self.prompts.longest_prefix(text, boundaries)
        start, ids = found if found is not None else (0, None)
        pieces = []
        for end in boundaries:
            if end > start:
                pieces.append(text[start:end])
                start = end
        if start < len(text):
            pieces.append(text[start:])
        self._last_split = (text, pieces, ids)
        return pieces, ids

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=False)

    # ---- pieces and segments ----

    def _encode_plain(self, piece: str) -> np.ndarray:
        """A piece's tokens (text, then at most one added token at its end), without the cache."""
        if self._ascii is not None and piece.isascii():
            ids = self._ascii_ids(piece)
            if ids is not None:
                return ids
        return self._encode_with_tokenizer(piece)

    def _encode_with_tokenizer(self, text: str) -> np.ndarray:
        return np.asarray(self.tokenizer.encode(text, add_special_tokens=False), dtype=np.uint32)

    def _ascii_ids(self, piece: str) -> np.ndarray | None:
        """An ASCII piece's tokens through the ASCII encoder, or None where it cannot tell."""
        assert self._ascii is not None and self._added_pattern is not None
        body, added_id = piece, None
        special = self._added_pattern.search(piece)
        if special is not None:
            if special.end() != len(piece):
                return None  # pieces end at their one added token; anything else goes the long way
            body, added_id = piece[: special.start()], self._added_ids[special.group()]
        ids = self._ascii.encode(body) if body else array.array("I")
        if ids is None:
            return None
        if added_id is not None:
            ids.append(added_id)
        # A copy that owns its data: a view would keep the array.array and two buffer objects alive
        # with it, all three tracked by the GC (75k of them behind 25k cached pieces, and a full
        # collection walking them took tens of ms).
        return np.array(ids, dtype=np.uint32)

    def _encode_by_segments(self, piece: str, segment_chars: int = SEGMENT_CHARS) -> np.ndarray:
        """A piece's tokens: its leading segments remembered or cached, the rest encoded in one call.

        Where the piece begins like a long text cut before (self.cuts), the segments that text
        shares with it whole, and the context after their last cut, are taken as they were: cuts
        depend only on the text up to _CUT_CONTEXT_CHARS past them. The text from the first
        uncached segment on is encoded at once (one call costs less than one per segment) and its
        tokens are split where each segment's first character's token starts (every token lies
        inside one segment: cuts are pretoken boundaries), then cached.
        """
        body, added = self._split_added(piece)
        known_ends, known_ids = self._remembered_segments(body, segment_chars)
        start = known_ends[-1] if known_ends else 0
        segments = self._cut(body, start, segment_chars)
        if added:
            segments.append(added)
        parts: list[np.ndarray] = []
        for segment in segments:
            ids = self.cache.get(segment)
            if ids is None:
                break
            parts.append(ids)
        rest = segments[len(parts) :]
        if rest and self._ascii is not None and all(segment.isascii() for segment in rest):
            # Segments are pretoken boundaries: each encodes on its own to its share of the tokens.
            for segment in rest:
                segment_ids = self._encode_plain(segment)
                self.cache.put(segment, segment_ids)
                parts.append(segment_ids)
        elif rest:
            # encode_batch releases the GIL (encode does not): the event loop runs meanwhile.
            encoding = self._pre_tokenizer_owner.encode_batch(["".join(rest)], add_special_tokens=False)[0]
            ids = np.asarray(encoding.ids, dtype=np.uint32)
            # Each later segment starts with the token holding its first character.
            boundaries = itertools.accumulate(len(segment) for segment in rest[:-1])
            splits = [encoding.char_to_token(boundary) for boundary in boundaries]
            for segment, segment_view in zip(rest, np.split(ids, splits), strict=True):
                # A copy: a view would keep all of `ids` alive once its neighbours were evicted.
                segment_ids = segment_view.copy()
                self.cache.put(segment, segment_ids)
                parts.append(segment_ids)
        body_segments = len(segments) - (1 if added else 0)
        ends = list(
            itertools.accumulate((len(segment) for segment in segments[:body_segments]), initial=start)
        )
        self.cuts.put(
            segment_chars, _SegmentedText(body, known_ends + ends[1:], known_ids + parts[:body_segments])
        )
        everything = known_ids + parts
        return np.concatenate(everything) if everything else np.empty(0, dtype=np.uint32)

    def _worth_segments(self, piece: str) -> bool:
        """Whether a long piece is encoded by segments: one for the tokenizer (its segments encode
        off the GIL), or an ASCII one that begins like a long piece seen before (sighted lately, or
        cut before: the cut memory is asked last, as `_encode_by_segments` asks it again)."""
        if self._ascii is None or not piece.isascii():
            return True
        if self.long_pieces.seen_before(hash(piece[:SEGMENT_CHARS])):
            return True
        return self.cuts.get(SEGMENT_CHARS, piece) is not None

    def _remembered_segments(self, body: str, segment_chars: int) -> tuple[list[int], list[np.ndarray]]:
        """The segments of `body` known from the last text cut that began like it: their end
        offsets and tokens, up to the last cut whose context (_CUT_CONTEXT_CHARS past it) `body`
        repeats; ([], []) where none."""
        remembered = self.cuts.get(segment_chars, body)
        if remembered is None:
            return [], []
        old = remembered.body
        # The cuts (every segment end but the last, which is the old text's end) that `body`
        # repeats with their context; shared beginnings are prefixes, so the count is searched.
        low, high = 0, len(remembered.ends) - 1
        while low < high:
            middle = (low + high + 1) // 2
            reach = remembered.ends[middle - 1] + _CUT_CONTEXT_CHARS
            if reach <= len(body) and body.startswith(old[:reach]):
                low = middle
            else:
                high = middle - 1
        return remembered.ends[:low], remembered.ids[:low]

    def _split_added(self, piece: str) -> tuple[str, str]:
        """`piece` as (its text, the added token that ends it or "")."""
        assert self._added_pattern is not None
        special = self._added_pattern.search(piece)
        if special is None:
            return piece, ""
        return piece[: special.start()], piece[special.start() :]

    def _segments(self, piece: str, segment_chars: int) -> list[str]:
        """`piece` cut into segments that encode independently (they concatenate back to `piece`).

        The added token ending a piece (pieces hold at most that one) is a segment of its own: the
        tokenizer extracts it first. Cuts depend only on the text before them and a little after,
        so two pieces that share a long beginning share all its segments but the last.
        """
        body, added = self._split_added(piece)
        segments = self._cut(body, 0, segment_chars)
        if added:
            segments.append(added)
        return segments

    def _cut(self, body: str, start: int, segment_chars: int) -> list[str]:
        """`body[start:]` cut into segments, `start` being a cut (or 0); no empty segment."""
        segments = []
        search_from = start + segment_chars
        while search_from < len(body):
            candidate = _CUT_CANDIDATE.search(body, search_from)
            if candidate is None:
                break
            cut = candidate.start()
            if self._starts_pretoken(body, cut):
                segments.append(body[start:cut])
                start = cut
                search_from = cut + segment_chars
            else:
                search_from = cut + 1
        segments.append(body[start:])
        return [segment for segment in segments if segment]

    def _starts_pretoken(self, text: str, cut: int) -> bool:
        """Whether the tokenizer's pre-tokenizer starts a pretoken at `cut`, judged on the text around it."""
        window_start = max(0, cut - _CUT_CONTEXT_CHARS)
        window = text[window_start : cut + _CUT_CONTEXT_CHARS]
        offset = cut - window_start
        if self._ascii is not None and window.isascii():
            return offset in self._ascii.pretoken_starts(window)  # ~10x cheaper than the Rust call
        return any(start == offset for _, (start, _) in self._pre_tokenizer.pre_tokenize_str(window))

    def _pieces(self, text: str) -> list[str]:
        """`text` cut right after every added token (the pieces concatenate back to `text`)."""
        assert self._added_pattern is not None
        pieces = []
        start = 0
        for match in self._added_pattern.finditer(text):
            pieces.append(text[start : match.end()])
            start = match.end()
        if start < len(text):
            pieces.append(text[start:])
        return pieces

    def _segmented_encoding_is_exact(self) -> bool:
        """Long texts encoded by (small) segments equal their whole encoding, on varied samples."""
        words = [
            "Cache", "router", "engine's", "prefix", "token", "ünïcödé", "中文", "e\u0301t\u00e9", "x2",
            "3.14", "(see", "table)", "it's", "WE'LL", "  spaced", "tab\tbed", "line\n", "para\n\n",
            "--", "naïve", "😀", "a", "I", "\r\nCRLF", "   ", "end.",
        ]  # fmt: skip
        rng = np.random.default_rng(0)
        specials = list(self.tokenizer.added_tokens_encoder)
        saved_cache, saved_cuts = self.cache, self.cuts
        try:
            for length in (300, 900, 1500):
                text = " ".join(rng.choice(words, size=length).tolist())
                for piece in (text, text + specials[0], "\n" + text + "  "):
                    whole = self._encode_with_tokenizer(piece)
                    segments = self._segments(piece, 64)
                    parts = np.concatenate([self._encode_with_tokenizer(segment) for segment in segments])
                    if "".join(segments) != piece or not np.array_equal(parts, whole):
                        return False
                    # The offsets path: cold, then with the first half of the segments cached.
                    self.cache, self.cuts = _PieceCache(1_000_000), _CutMemory(1 << 20)
                    if not np.array_equal(self._encode_by_segments(piece, 64), whole):
                        return False
                    # With the first half of the segments cached, then with them remembered only.
                    self.cache, self.cuts = _PieceCache(1_000_000), _CutMemory(1 << 20)
                    self._encode_by_segments("".join(segments[: len(segments) // 2]), 64)
                    if not np.array_equal(self._encode_by_segments(piece, 64), whole):
                        return False
                    self.cache = _PieceCache(1_000_000)
                    if not np.array_equal(self._encode_by_segments(piece, 64), whole):
                        return False
        finally:
            self.cache, self.cuts = saved_cache, saved_cuts
        return True

    def _piecewise_encoding_is_exact(self) -> bool:
        assert self._added_pattern is not None
        specials = list(self.tokenizer.added_tokens_encoder)[:4]
        samples = [
            "".join(f"{special} Hello,  world!\n\n  indented\tx{special}\nnext " for special in specials),
            f"plain start {specials[0]}ünïcödé 中文 text  {specials[-1]}   trailing spaces   ",
        ]
        with contextlib.suppress(Exception):  # no chat template: the other samples still decide
            samples.append(
                self.tokenizer.apply_chat_template(
                    [
                        {"role": "system", "content": "You are terse."},
                        {"role": "user", "content": " Hi there\n"},
                        {"role": "assistant", "content": "Hello! How can I help?"},
                        {"role": "user", "content": "Sum 2+2."},
                    ],
                    add_generation_prompt=True,
                    tokenize=False,
                )
            )
        for sample in samples:
            whole = self.tokenizer.encode(sample, add_special_tokens=False)
            pieces: list[int] = []
            for piece in self._pieces(sample):
                pieces.extend(self.tokenizer.encode(piece, add_special_tokens=False))
            if pieces != whole:
                return False
        return True


# What the jinja2 sandbox does on each attribute a template reads, in the jinja2 versions whose
# code was read for this (3.1): SandboxedEnvironment.getattr tries getattr(obj, name), falls back
# to obj[name], and asks is_safe_attribute of what getattr found; is_safe_attribute ignores the
# value and decides by the name and isinstance tests on the object, so by (type of obj, name).
_FAST_READS_JINJA_SERIES = "3.1."
# Distinct (type, attribute name) pairs remembered per template; a template reads a few dozen.
ATTRIBUTE_CHECKS_MAX = 4096
# Names getattr finds on a plain dict (its methods and object's); any other name it does not.
_DICT_ATTRIBUTES = frozenset(dir(dict))


class _MemoizedAttributeCheck:
    """A jinja2 sandbox's is_safe_attribute, remembered per (type of the object, attribute name).

    The sandbox asks on every attribute a template reads (`content.split`, `loop.index0`...), and
    answering costs a chain of isinstance tests each time. The answer is the sandbox's own,
    computed once per pair, never a different one."""

    def __init__(self, check: Callable[[Any, str, Any], bool]) -> None:
        self._check = check
        self._answers: dict[tuple[type, str], bool] = {}

    def __call__(self, obj: Any, attr: str, value: Any) -> bool:
        key = (type(obj), attr)
        answer = self._answers.get(key)
        if answer is None:
            answer = self._check(obj, attr, value)
            if len(self._answers) < ATTRIBUTE_CHECKS_MAX:
                self._answers[key] = answer
        return answer


class _SandboxGetattr:
    """A jinja2 sandbox's getattr, answering `message.role` on a plain dict without the failed
    attribute lookup (an exception) the sandbox goes through first.

    On an object of exactly type dict, getattr finds only the names in dir(dict), so for any other
    name the sandbox's answer is obj[name], or undefined where the key is missing: the same here.
    Everything else goes to the sandbox's own getattr."""

    def __init__(self, environment: Any) -> None:
        self._sandbox_getattr = environment.getattr
        self._undefined = environment.undefined

    def __call__(self, obj: Any, attribute: Any) -> Any:
        if type(obj) is dict and type(attribute) is str and attribute not in _DICT_ATTRIBUTES:
            try:
                return obj[attribute]
            except KeyError:
                return self._undefined(obj=obj, name=attribute)
        return self._sandbox_getattr(obj, attribute)


def _speed_up_sandbox_reads(environment: Any) -> bool:
    """Install the two shortcuts above on one jinja2 sandbox, where it is the one they were written
    for (same answers: tests/test_tokenize_template_memo.py)."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if not jinja2.__version__.startswith(_FAST_READS_JINJA_SERIES):
        return False
    if type(environment) is not ImmutableSandboxedEnvironment:
        return False
    if "is_safe_attribute" in vars(environment) or "getattr" in vars(environment):
        return False  # installed already (the environment is shared by every tokenizer using it)
    environment.is_safe_attribute = _MemoizedAttributeCheck(environment.is_safe_attribute)
    environment.getattr = _SandboxGetattr(environment)
    return True


def _speed_up_template_reads(tokenizer: Any) -> bool:
    """Speed up attribute reads in the sandbox transformers compiles the tokenizer's own chat
    templates into (a request's own template is rendered in the template sandbox's process,
    untouched). Whether the tokenizer's templates render with the shortcuts."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:
        return False
    templates = getattr(tokenizer, "chat_template", None)
    if isinstance(templates, str):
        templates = [templates]
    elif isinstance(templates, dict):
        templates = [t for t in templates.values() if isinstance(t, str)]
    else:
        return False
    sped_up = False
    for template in templates:
        try:
            environment = _compile_jinja_template(template).environment
        except Exception:  # a template jinja cannot compile fails its requests as before
            continue
        _speed_up_sandbox_reads(environment)
        sped_up = sped_up or isinstance(vars(environment).get("getattr"), _SandboxGetattr)
    return sped_up


def render_chat(tokenizer: Any, body: dict[str, Any]) -> str:
    """A chat request's prompt text: the tokenizer's chat template (or the request's own, which the
    gateway passes here only from its template sandbox) applied as vLLM applies it.

    transformers renders every template in jinja2's ImmutableSandboxedEnvironment: a template cannot
    reach Python internals nor change its inputs; what it costs is bounded by its caller."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise TokenizeError("`messages` must be a non-empty list")
    continue_final = bool(body.get("continue_final_message", False))
    add_generation_prompt = body.get("add_generation_prompt")
    if add_generation_prompt is None:
        add_generation_prompt = not continue_final
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise TokenizeError("`chat_template_kwargs` must be an object")
    template = request_chat_template(body)
    if template is not None:
        # vLLM merges chat_template_kwargs over its chat_template argument: the same here.
        kwargs = {**kwargs, "chat_template": template}
    try:
        return tokenizer.apply_chat_template(
            [_flatten_content(message) for message in messages],
            tools=body.get("tools") or None,
            add_generation_prompt=bool(add_generation_prompt),
            continue_final_message=continue_final,
            tokenize=False,
            **kwargs,
        )
    except Exception as exc:  # jinja errors, template exceptions: the request's fault
        reason = str(exc) or type(exc).__name__
        raise TokenizeError(f"the chat template cannot render these messages: {reason}") from None


def request_chat_template(body: dict[str, Any]) -> str | None:
    """The chat template a request brings itself (inside `chat_template_kwargs`, else top-level), if any."""
    kwargs = body.get("chat_template_kwargs")
    template = kwargs.get("chat_template") if isinstance(kwargs, dict) else None
    if template is None:
        template = body.get("chat_template")
    if template is not None and not isinstance(template, str):
        raise TokenizeError("`chat_template` must be a string")
    return template


# Content parts vLLM reads as text: chat's own, and the Responses API's (which chat accepts too).
_TEXT_PART_TYPES = frozenset(("text", "input_text", "output_text"))


def _flatten_content(message: Any) -> Any:
    """vLLM's "string" content format: a list of text parts becomes their texts joined by newlines."""
    if not isinstance(message, dict):
        raise TokenizeError("every message must be an object")
    content = message.get("content")
    if isinstance(content, list):
        texts = [
            part.get("text", "")
            for part in content
            if isinstance(part, dict) and part.get("type") in _TEXT_PART_TYPES
        ]
        return {**message, "content": "\n".join(texts)}
    return message


def _as_tokens(ids: list[Any]) -> np.ndarray:
    # By chunks: the conversion holds the GIL, so a long list in the tokenizer thread must let the
    # event loop in between.
    chunks = []
    for start in range(0, len(ids), _TOKEN_ID_CHUNK):
        chunk = ids[start : start + _TOKEN_ID_CHUNK]
        if not all(isinstance(token, int) and 0 <= token < 2**32 for token in chunk):
            raise TokenizeError("token-id prompts must hold non-negative integers")
        chunks.append(np.asarray(chunk, dtype=np.uint32))
    if len(chunks) == 1:
        return chunks[0]
    return np.concatenate(chunks) if chunks else np.empty(0, dtype=np.uint32)


def _text_size(body: dict[str, Any]) -> int:
    """Characters of the prompt's plain text: string contents of the messages, or a string prompt."""
    messages = body.get("messages")
    if isinstance(messages, list):
        return sum(
            len(content)
            for message in messages
            if isinstance(message, dict) and isinstance(content := message.get("content"), str)
        )
    prompt = body.get("prompt")
    return len(prompt) if isinstance(prompt, str) else 0


class RequestTokenizer:
    """The gateway's pre-route step: fills RouteRequest.tokens and .namespace for token-aware policies."""

    def __init__(self, config: Config, backends: dict[str, BackendState] | None = None) -> None:
        self._config = config
        self._backends = backends if backends is not None else {}
        self._tokenizers: dict[str, PromptTokenizer] = {}
        self._load_lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvgate-tokenize")
        self._http: Any = None
        self._sandboxes: dict[str, TemplateSandbox] = {}
        self.failures = 0

    def tokenizer(self, model: str) -> PromptTokenizer | None:
        """The local tokenizer of a configured model (loaded once), or None when it has none."""
        found = self._tokenizers.get(model)
        if found is not None:
            return found
        spec = self._config.model(model)
        if spec is None or spec.tokenizer is None or spec.tokenize != "local":
            return None
        with self._load_lock:
            if model not in self._tokenizers:
                self._tokenizers[model] = PromptTokenizer(spec.tokenizer)
        return self._tokenizers[model]

    def start_sandboxes(self) -> None:
        """Start the template sandbox of every model that accepts client templates (in the background)."""
        for model in self._config.models:
            if model.trust_request_chat_template and self.tokenizer(model.name) is not None:
                self._sandbox(model.name).start()

    async def prepare(self, request: RouteRequest) -> None:
        """Fill `request.tokens` (None when the prompt cannot be tokenized) and `request.namespace`."""
        body = request.body
        salt = body.get("cache_salt")
        request.namespace = Namespace(cache_salt=salt if isinstance(salt, str) and salt else None)
        try:
            tokens = await self.tokens_for(request.model, body, body_size=request.body_size)
            if tokens is not None and len(tokens) > ROUTING_MAX_TOKENS:
                # Longer than engines take; routing it by its blocks would cost the loop in proportion.
                raise TokenizeError(f"the prompt has {len(tokens)} tokens, over {ROUTING_MAX_TOKENS}")
            request.tokens = tokens
        except TokenizeError as exc:
            self.failures += 1
            logger.debug("request %s: no tokens for routing: %s", request.request_id, exc)
            request.tokens = None
        except Exception as exc:  # a broken tokenizer must not fail the request: it is routed by load
            self.failures += 1
            log_unexpected(
                logger, exc, "request %s: tokenizer failed; routing by load", request.request_id,
                level=logging.WARNING,
            )  # fmt: skip
            request.tokens = None

    async def tokens_for(self, model: str, body: dict[str, Any], *, body_size: int = 0) -> np.ndarray | None:
        """The prompt tokens of a request for `model`; `body_size` (its bytes as received, 0 when
        unknown) decides with the text's length whether the work leaves the event loop."""
        spec = self._config.model(model)
        if spec is not None and spec.tokenize == "engine":
            return await self._engine_tokens(model, body)
        tokenizer = self.tokenizer(model)
        if tokenizer is None:
            return None
        if body_size > ROUTING_MAX_BODY_BYTES:
            raise TokenizeError(f"the body has {body_size} bytes, over {ROUTING_MAX_BODY_BYTES}")
        if "messages" in body and request_chat_template(body) is not None:
            return await self._tokens_with_request_template(model, tokenizer, body, body_size)
        text_chars = _text_size(body)
        # What the body holds besides plain text (tools, content parts, token ids, many messages)
        # costs Python work in proportion to its size, and the chat template renders all of it.
        structure_bytes = body_size - text_chars
        if text_chars < OFF_LOOP_MIN_CHARS and structure_bytes < OFF_LOOP_MIN_STRUCTURE_BYTES:
            return tokenizer.tokens_for(body)  # most requests: nothing long enough to move
        messages = body.get("messages")
        if (
            structure_bytes >= OFF_LOOP_MIN_STRUCTURE_BYTES
            or body_size >= OFF_LOOP_MIN_BODY_BYTES
            or (isinstance(messages, list) and len(messages) >= OFF_LOOP_MIN_MESSAGES)
        ):
            return await self._off_loop(tokenizer.tokens_for, body)
        prompt = tokenizer.prompt_text(body)
        if isinstance(prompt, np.ndarray):
            return prompt
        text, add_special_tokens = prompt
        return await self._encode(tokenizer, text, add_special_tokens)

    async def _encode(self, tokenizer: PromptTokenizer, text: str, add_special_tokens: bool) -> np.ndarray:
        """`text`'s tokens, encoded on the loop when little of it is uncached, else in the thread."""
        if tokenizer.encodes_on_fast_path(text, add_special_tokens) and len(text) < OFF_LOOP_MIN_ASCII_CHARS:
            # All of it through the ASCII encoder, and short enough whatever the caches hold.
            return tokenizer.encode_text(text, add_special_tokens=add_special_tokens)
        slow, fast = tokenizer.uncached_chars(text, add_special_tokens=add_special_tokens)
        if slow < OFF_LOOP_MIN_CHARS and fast < OFF_LOOP_MIN_ASCII_CHARS:
            return tokenizer.encode_text(text, add_special_tokens=add_special_tokens)
        encode = functools.partial(tokenizer.encode_text, text, add_special_tokens=add_special_tokens)
        return await self._off_loop(encode)

    async def _off_loop(self, work: Callable[..., np.ndarray], *args: Any) -> np.ndarray:
        """`work(*args)` in the tokenizer thread. A request waits for it at most OFF_LOOP_TIMEOUT_S,
        then is routed without tokens; work still queued for it then never starts."""
        future = asyncio.get_running_loop().run_in_executor(self._executor, work, *args)
        try:
            return await asyncio.wait_for(future, OFF_LOOP_TIMEOUT_S)
        except TimeoutError:
            raise TokenizeError(
                f"tokenizing took over {OFF_LOOP_TIMEOUT_S:g} s; routed without tokens"
            ) from None

    async def _tokens_with_request_template(
        self, model: str, tokenizer: PromptTokenizer, body: dict[str, Any], body_size: int
    ) -> np.ndarray:
        """Tokens of a chat request that brings its own template: rendered in the model's sandbox."""
        spec = self._config.model(model)
        if spec is None or not spec.trust_request_chat_template:
            # The forwarder refuses these requests; this keeps any other caller from rendering one.
            raise TokenizeError(f"the model `{model}` does not accept a request's own chat template")
        max_chars = RENDERED_MAX_CHARS_PER_BODY_BYTE * max(body_size, 0) + RENDERED_MIN_CHARS
        try:
            text = await self._sandbox(model).render(body, max_chars)
        except TemplateSandboxError as exc:
            raise TokenizeError(str(exc)) from None
        return await self._encode(tokenizer, text, bool(body.get("add_special_tokens")))

    def _sandbox(self, model: str) -> TemplateSandbox:
        sandbox = self._sandboxes.get(model)
        if sandbox is None:
            spec = self._config.model(model)
            assert spec is not None and spec.tokenizer is not None
            sandbox = self._sandboxes[model] = TemplateSandbox(spec.tokenizer)
        return sandbox

    async def _engine_tokens(self, model: str, body: dict[str, Any]) -> np.ndarray | None:
        """Ask a backend serving the model for its own tokens (POST /tokenize)."""
        import httpx

        backend = next(
            (b for b in self._backends.values() if b.serves(model) and b.accepting),
            None,
        )
        if backend is None:
            return None
        spec = self._config.model(model)
        served = (spec.served_name if spec is not None else None) or model
        request: dict[str, Any] = {"model": served}
        if "messages" in body:
            for key in ("messages", "tools", "chat_template", "chat_template_kwargs", "add_generation_prompt",
                        "continue_final_message", "add_special_tokens"):  # fmt: skip
                if key in body:
                    request[key] = body[key]
        elif "prompt" in body:
            prompt = body["prompt"]
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
                if len(prompt) < OFF_LOOP_MIN_TOKEN_IDS:
                    return _as_tokens(prompt)
                return await self._off_loop(_as_tokens, prompt)
            request["prompt"] = prompt[0] if isinstance(prompt, list) and prompt else prompt
            if "add_special_tokens" in body:
                request["add_special_tokens"] = body["add_special_tokens"]
        else:
            raise TokenizeError("the body has neither `messages` nor `prompt`")
        if self._http is None:
            self._http = httpx.AsyncClient(timeout=10.0)
        try:
            response = await self._http.post(f"{backend.url}/tokenize", json=request)
            response.raise_for_status()
            return _as_tokens(response.json()["tokens"])
        except (httpx.HTTPError, KeyError, ValueError, TypeError) as exc:
            raise TokenizeError(f"backend {backend.name} /tokenize failed: {exc}") from None

    async def close(self) -> None:
        for sandbox in self._sandboxes.values():
            await sandbox.close()
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self._http is not None:
            await self._http.aclose()
            self._http = None

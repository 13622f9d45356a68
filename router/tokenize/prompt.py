"""One model's tokenizer: a request body's prompt tokens exactly as the engine will see them,
encoding only what the caches do not hold.

Chat requests are rendered with the model's chat template (router/tokenize/render.py) and the text
is encoded without adding special tokens. Completions are encoded with the tokenizer's special
tokens (vLLM's default for /v1/completions; `add_special_tokens` in the body overrides); token-id
prompts pass through (router/tokenize/messages.py).

Pieces: the rendered text is cut right after every added token (`<|im_start|>`, `<|im_end|>`,
...). The tokenizer extracts added tokens before running BPE, so the pieces between them encode
independently and the concatenation of the pieces' tokens equals the whole text's tokens. Each
piece (in practice: each message) is cached (router/tokenize/caches.py), so a follow-up turn
encodes only its new messages. Every tokenizer is checked for that property when loaded; where it
does not hold, the cache is off.

Segments: long pieces (a document and its question in one message) are also cached by segments, so
a new question after the same document encodes only the last segment. A piece is cut, about every
SEGMENT_CHARS characters, before a space that follows an ASCII letter or digit and precedes an ASCII
letter (" word"), and only where the tokenizer's own pre-tokenizer, run on the text around the cut,
starts a pretoken there. BPE runs per pretoken and NFC normalisation never joins across an ASCII
character, so the segments' tokens concatenate to the piece's tokens. This too is checked against
whole-text encoding when the tokenizer is loaded; where it does not hold, segments are off.

Encoding: a piece that is all ASCII goes through router/tokenize/ascii.py (the same split regex on
Python's `re`, the tokenizer's own BPE model; ~6x cheaper than the Rust tokenizer's regex engine),
any other through the tokenizer.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import os
import re
from typing import Any

import numpy as np

from router.recent_keys import RecentKeys
from router.tokenize.ascii import AsciiEncoder
from router.tokenize.caches import (
    CUT_MEMORY_CHARS,
    PROMPT_MEMORY_CHARS,
    CutMemory,
    PieceCache,
    PromptMemory,
    SegmentedText,
)
from router.tokenize.messages import TokenizeError, completion_prompt
from router.tokenize.render import FastChatRenderer, render_chat, render_plain_chat, speed_up_template_reads

logger = logging.getLogger("kvgate.tokenize")

# Pieces at least this long are encoded and cached by segments of about SEGMENT_CHARS characters
# (an ASCII one from the second piece that begins like it: PromptTokenizer.long_pieces).
SEGMENTED_MIN_CHARS = 2048
SEGMENT_CHARS = 512
# Beginnings of long ASCII pieces seen once that are remembered (hashes, in two generations).
LONG_PIECE_SIGHTINGS = 65_536
# A candidate cut: before a space between an ASCII letter or digit and an ASCII letter.
_CUT_CANDIDATE = re.compile(r"(?<=[A-Za-z0-9]) (?=[A-Za-z])")
# Characters each side of a cut that the pre-tokenizer sees to confirm it.
_CUT_CONTEXT_CHARS = 16


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
        self.cache = PieceCache(cache_tokens)
        self.cuts = CutMemory(cut_memory_chars)
        self.prompts = PromptMemory(PROMPT_MEMORY_CHARS)
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
        # What adding special tokens puts around a text's tokens (a BOS before it for Llama-style
        # tokenizers, nothing for Qwen's), when it is the same for every text: a completion's
        # prompt (special tokens added, vLLM's default) then goes through the caches and the ASCII
        # encoder like a chat's, instead of the whole text through the tokenizer on every request.
        self._special_affixes = self._constant_special_affixes() if self.piecewise else None
        if not self.piecewise:
            logger.info(
                "tokenizer %s: per-message cache off (pieces do not encode independently)", tokenizer_dir
            )
        # The Rust tokenizer under a fast transformers tokenizer: its pre-tokenizer confirms cuts,
        # its encode gives character offsets (checked against self.tokenizer.encode below).
        self._pre_tokenizer_owner: Any = getattr(self.tokenizer, "backend_tokenizer", None)
        self._pre_tokenizer = getattr(self._pre_tokenizer_owner, "pre_tokenizer", None)
        self._added_ids: dict[str, int] = dict(self.tokenizer.added_tokens_encoder)
        # Pieces that are all ASCII skip the Rust regex engine (router/tokenize/ascii.py); the
        # segment check below runs through it too, against the tokenizer's own encode.
        self._ascii: AsciiEncoder | None = None
        if self.piecewise and self._pre_tokenizer_owner is not None:
            self._ascii = AsciiEncoder.for_tokenizer(self._pre_tokenizer_owner)
        self.segmented = (
            self.piecewise and self._pre_tokenizer is not None and self._segmented_encoding_is_exact()
        )
        self.template_reads_sped_up = speed_up_template_reads(self.tokenizer)
        # Plain chats rendered without apply_chat_template's per-call work (router/tokenize/render.py).
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
        return completion_prompt(body)

    def uncached_chars(self, text: str, *, add_special_tokens: bool) -> tuple[int, int]:
        """Characters encode_text(text) would encode, not finding them cached: (through the
        tokenizer, through the ASCII fast path). Reads the cache without counting hits or misses.

        A long piece that is not cached whole counts from the end of the segments remembered for
        a text that began like it (self.cuts: a new question after the same document), else whole,
        though its leading segments may be cached: finding out would cut it into segments twice."""
        if add_special_tokens and self._special_affixes is not None:
            add_special_tokens = False  # encode_text adds the affixes around the cached encoding
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
        adds_unknown_affixes = add_special_tokens and self._special_affixes is None
        return self._ascii is not None and not adds_unknown_affixes and self.piecewise and text.isascii()

    def render_chat(self, body: dict[str, Any]) -> str:
        fast = render_plain_chat(self.fast_render, body)
        return fast if fast is not None else render_chat(self.tokenizer, body)

    def encode_text(self, text: str, *, add_special_tokens: bool) -> np.ndarray:
        if add_special_tokens and self._special_affixes is not None:
            before, after = self._special_affixes
            ids = self.encode_text(text, add_special_tokens=False)
            return np.concatenate((before, ids, after)) if len(before) or len(after) else ids
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
            assert self._added_pattern is not None
            ids = self._ascii.encode_piece(piece, self._added_pattern, self._added_ids)
            if ids is not None:
                return ids
        return self._encode_with_tokenizer(piece)

    def _encode_with_tokenizer(self, text: str) -> np.ndarray:
        return np.asarray(self.tokenizer.encode(text, add_special_tokens=False), dtype=np.uint32)

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
            segment_chars, SegmentedText(body, known_ends + ends[1:], known_ids + parts[:body_segments])
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
                    self.cache, self.cuts = PieceCache(1_000_000), CutMemory(1 << 20)
                    if not np.array_equal(self._encode_by_segments(piece, 64), whole):
                        return False
                    # With the first half of the segments cached, then with them remembered only.
                    self.cache, self.cuts = PieceCache(1_000_000), CutMemory(1 << 20)
                    self._encode_by_segments("".join(segments[: len(segments) // 2]), 64)
                    if not np.array_equal(self._encode_by_segments(piece, 64), whole):
                        return False
                    self.cache = PieceCache(1_000_000)
                    if not np.array_equal(self._encode_by_segments(piece, 64), whole):
                        return False
        finally:
            self.cache, self.cuts = saved_cache, saved_cuts
        return True

    def _constant_special_affixes(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The tokens that adding special tokens puts before and after a text's own tokens, when
        they are the same on every sample (None otherwise: such texts are encoded whole)."""
        samples = [
            "Hello, world!", " leading space", "ünïcödé 中文 text  ", "a", "line\n\nnext",
            *(f"{special} after an added token" for special in list(self.tokenizer.added_tokens_encoder)[:2]),
        ]  # fmt: skip
        affixes: tuple[list[int], list[int]] | None = None
        for sample in samples:
            plain = self.tokenizer.encode(sample, add_special_tokens=False)
            added = self.tokenizer.encode(sample, add_special_tokens=True)
            found = None
            for start in range(len(added) - len(plain) + 1):
                if added[start : start + len(plain)] == plain:
                    found = (added[:start], added[start + len(plain) :])
                    break
            if found is None or (affixes is not None and found != affixes):
                return None
            affixes = found
        if affixes is None or self.tokenizer.encode("", add_special_tokens=True) != affixes[0] + affixes[1]:
            return None
        return np.asarray(affixes[0], dtype=np.uint32), np.asarray(affixes[1], dtype=np.uint32)

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

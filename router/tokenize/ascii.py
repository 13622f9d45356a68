"""Pure-ASCII text encoded by a byte-level BPE tokenizer, without the tokenizer's regex engine.

Profiling the kv_aware gateway showed most of its per-request time in the Rust tokenizer's
pre-tokenizer: its split regex (`\\p{L}`, `\\p{N}`, `\\s` classes) runs on Oniguruma at about
0.6 us per character, against under 0.1 us for Python's `re` on the same pattern restricted to
ASCII. For text that is all ASCII (`str.isascii()`), every Unicode class of the pattern has an
exact ASCII equivalent (`\\p{L}` = `[A-Za-z]`, `\\p{N}` = `[0-9]`, `\\s` = the six White_Space
characters `\\t \\n \\v \\f \\r` and space), NFC/NFKC normalisation is the identity, and byte-level
mapping is a fixed table; both engines are backtracking with the same leftmost-first semantics.
So `AsciiEncoder.encode` splits with the translated pattern, maps each pretoken through the
byte-level table and runs the tokenizer's own BPE model on it (`model.tokenize`), caching the
ids per pretoken (words repeat); `pretoken_starts` answers where the pre-tokenizer would start
pretokens (router/tokenize/prompt.py confirms segment cuts with it); `encode_piece` encodes one
piece of a prompt (its text, then the added token that ends it). For the Qwen2-family regex the split
and the cache lookups run in C instead (router/_ascii_split.pyx), when that extension is built.

It is built only for the pipeline it reproduces (`AsciiEncoder.for_tokenizer` returns None
otherwise): normaliser none or a Unicode normal form; pre-tokenizer Split(regex, Isolated) then
ByteLevel without its own regex, or ByteLevel with GPT-2's regex; a BPE model without dropout;
added tokens that strip nothing. It is then checked against the Rust tokenizer (ids and pretoken
starts) on every ASCII character in several contexts and on random mixes of words, contractions,
digits, punctuation and whitespace runs; any difference leaves it off. At run time a split that
does not cover the whole text (a gap the pattern does not match) falls back to the caller's
encoder.
"""

from __future__ import annotations

import array
import logging
import re
from collections.abc import Mapping
from itertools import chain
from typing import Any

import msgspec
import numpy as np

from router.compiled import load_compiled

logger = logging.getLogger("kvgate.tokenize")

# GPT-2's pre-tokenizer regex: what ByteLevel(use_regex=True) splits with.
_GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# Unicode White_Space within ASCII (Oniguruma's \s); Python's str \s would add \x1c-\x1f.
_SPACE = r"\t\n\x0b\x0c\r "
_IN_CLASS = {r"\p{L}": "A-Za-z", r"\p{N}": "0-9", r"\s": _SPACE}
_OUTSIDE_CLASS = {r"\p{L}": "[A-Za-z]", r"\p{N}": "[0-9]", r"\s": f"[{_SPACE}]", r"\S": f"[^{_SPACE}]"}
# Escapes that mean the same in both engines whatever the character set.
_LITERAL_ESCAPES = {r"\r", r"\n", r"\t", r"\f", r"\v"}
_ESCAPE = re.compile(r"\\p\{[A-Za-z]+\}|\\[A-Za-z]|\\.", re.DOTALL)
_UNICODE_NORMAL_FORMS = {"NFC", "NFD", "NFKC", "NFKD"}
# Distinct pretokens whose ids are kept; past this the cache starts over (natural text reuses a
# few thousand words, so this is reached only by unusual input).
MAX_CACHED_PRETOKENS = 200_000
# And at most this many bytes of them (a pretoken is as long as a run of symbols or spaces, up to
# a whole body): distinct long pretokens must not grow the table without bound.
MAX_CACHED_PRETOKEN_BYTES = 64 << 20


class _Model(msgspec.Struct):
    type: str
    dropout: float | None = None


class _AddedToken(msgspec.Struct):
    content: str
    lstrip: bool = False
    rstrip: bool = False
    single_word: bool = False


class _Pipeline(msgspec.Struct):
    """The parts of tokenizer.json this encoder reproduces (the vocabulary is skipped)."""

    normalizer: dict[str, Any] | None = None
    pre_tokenizer: dict[str, Any] | None = None
    model: _Model | None = None
    added_tokens: list[_AddedToken] = []


def ascii_pattern(pattern: str) -> str | None:
    """`pattern` (Oniguruma, Unicode classes) as a Python `re` pattern exact on ASCII text, or None
    when it uses an escape this translation does not know."""
    out: list[str] = []
    in_class = False
    position = 0
    while position < len(pattern):
        char = pattern[position]
        if char == "\\":
            match = _ESCAPE.match(pattern, position)
            assert match is not None
            escape = match.group()
            position = match.end()
            table = _IN_CLASS if in_class else _OUTSIDE_CLASS
            if escape in table:
                out.append(table[escape])
            elif escape in _LITERAL_ESCAPES or not escape[1].isalnum():
                out.append(escape)
            else:
                return None  # \d, \w, \b, \p{Lu}, \P{...}, \x..: not needed by the known patterns
            continue
        if char == "[" and not in_class:
            in_class = True
            out.append(char)
            if pattern.startswith("^", position + 1):
                out.append("^")
                position += 1
            position += 1
            continue
        if char == "]" and in_class:
            in_class = False
        elif char == "[" and in_class:
            return None  # nested classes or POSIX brackets: not translated
        out.append(char)
        position += 1
    return "".join(out)


class AsciiEncoder:
    """Token ids of pure-ASCII text, equal to the Rust tokenizer's `encode(text, add_special_tokens=False)`
    (build it with `for_tokenizer`; the caller checks `text.isascii()`)."""

    def __init__(self, backend: Any, pattern: str, source_pattern: str | None = None) -> None:
        compiled = re.compile(pattern, re.ASCII)
        self._split = compiled.findall
        self._matches = compiled.finditer
        # The split in C for the regex it writes out (router/_ascii_split.pyx), when built.
        self._compiled_split = _compiled_split_for(source_pattern)
        self._model = backend.model
        byte_level = _byte_level_table(backend)
        self._byte_level = str.maketrans(byte_level)
        self._pretokens: dict[str, list[int]] = {}
        # What the dict holds, counted as the table counts it: characters plus 4 bytes an id.
        self._pretoken_bytes = 0
        # With the compiled split, pretokens' ids live in its C table (lookups without a str per
        # pretoken); the dict above serves the `re` split.
        self._table = self._compiled_split.PretokenTable() if self._compiled_split is not None else None

    @classmethod
    def for_tokenizer(cls, backend: Any) -> AsciiEncoder | None:
        """An encoder for this `tokenizers.Tokenizer`, or None when its pipeline is not one this
        module reproduces or the load-time comparison finds a difference."""
        try:
            pipeline = msgspec.json.decode(backend.to_str(), type=_Pipeline)
        except (msgspec.DecodeError, AttributeError) as exc:
            logger.info("ascii fast path off: tokenizer description unreadable (%s)", exc)
            return None
        reason = _unsupported(pipeline)
        pattern = None if reason else ascii_pattern(_split_pattern(pipeline.pre_tokenizer))
        if reason is None and pattern is None:
            reason = "its split regex uses escapes the ASCII translation does not know"
        if reason is not None:
            logger.info("ascii fast path off: %s", reason)
            return None
        encoder = cls(backend, pattern, _split_pattern(pipeline.pre_tokenizer))
        mismatch = encoder.first_mismatch(backend)
        if mismatch is not None:
            logger.warning("ascii fast path off: it encodes %r differently from the tokenizer", mismatch)
            return None
        return encoder

    def encode(self, text: str) -> array.array | None:
        """The ids of `text` (ASCII) as a uint32 `array.array`, or None when the split does not
        cover it (then use the tokenizer)."""
        table = self._table
        if table is not None:
            ids = table.encode(text)
            if ids is not None:
                return ids
            if len(table) >= MAX_CACHED_PRETOKENS or table.stored_bytes >= MAX_CACHED_PRETOKEN_BYTES:
                table.clear()
            stored = True
            for word in table.missing(text):
                stored = table.add(word, self._bpe(word)) and stored
            if stored:
                ids = table.encode(text)
                if ids is not None:
                    return ids
            words = self._compiled_split.split(text)  # a pretoken too large to store: the dict's way
        else:
            words = self._split(text)
            if sum(map(len, words)) != len(text):
                return None
        cache = self._pretokens
        # C-level passes (map, chain) for the usual case where every pretoken is cached.
        found = list(map(cache.get, words))
        if None in found:
            for position, ids in enumerate(found):
                if ids is None:
                    word = words[position]
                    ids = cache.get(word)
                    if ids is None:
                        ids = self._remember(word, self._bpe(word))
                    found[position] = ids
        return array.array("I", chain.from_iterable(found))

    def encode_piece(
        self, piece: str, added_pattern: re.Pattern[str], added_ids: Mapping[str, int]
    ) -> np.ndarray | None:
        """An ASCII piece's tokens (its text, then at most the one added token that ends it, found
        by `added_pattern` and numbered by `added_ids`), or None where this encoder cannot tell."""
        body, added_id = piece, None
        special = added_pattern.search(piece)
        if special is not None:
            if special.end() != len(piece):
                return None  # pieces end at their one added token; anything else goes the long way
            body, added_id = piece[: special.start()], added_ids[special.group()]
        ids = self.encode(body) if body else array.array("I")
        if ids is None:
            return None
        if added_id is not None:
            ids.append(added_id)
        # A copy that owns its data: a view would keep the array.array and two buffer objects alive
        # with it, all three tracked by the GC (75k of them behind 25k cached pieces, and a full
        # collection walking them took tens of ms).
        return np.array(ids, dtype=np.uint32)

    def _remember(self, word: str, ids: list[int]) -> list[int]:
        """Cache a pretoken's ids in the dict, which starts over past MAX_CACHED_PRETOKENS entries or
        MAX_CACHED_PRETOKEN_BYTES (as the C table): distinct long pretokens (runs of symbols or
        spaces, up to a whole body) must not grow it without bound."""
        cache = self._pretokens
        if len(cache) >= MAX_CACHED_PRETOKENS or self._pretoken_bytes >= MAX_CACHED_PRETOKEN_BYTES:
            cache.clear()
            self._pretoken_bytes = 0
        cache[word] = ids
        self._pretoken_bytes += len(word) + 4 * len(ids)
        return ids

    def _bpe(self, word: str) -> list[int]:
        """One pretoken's ids from the tokenizer's own BPE model."""
        return [token.id for token in self._model.tokenize(word.translate(self._byte_level))]

    def pretoken_starts(self, text: str) -> set[int]:
        """Where the tokenizer's pre-tokenizer starts a pretoken in `text` (ASCII): every match of
        the split regex, and every gap between matches (Isolated keeps gaps as pretokens)."""
        starts = {0} if text else set()
        for match in self._matches(text):
            start, end = match.span()
            if end > start:
                starts.add(start)
                if end < len(text):
                    starts.add(end)
        return starts

    def first_mismatch(self, backend: Any) -> str | None:
        """A sample text this encoder and the tokenizer split or encode differently, or None."""
        pre_tokenizer = backend.pre_tokenizer
        for text in _samples():
            expected = backend.encode(text, add_special_tokens=False).ids
            ids = self.encode(text)
            if ids is None or ids.tolist() != expected:
                return text
            expected_starts = {start for _, (start, _) in pre_tokenizer.pre_tokenize_str(text)}
            if self.pretoken_starts(text) != expected_starts:
                return text
        return None


def _unsupported(pipeline: _Pipeline) -> str | None:
    normalizer = pipeline.normalizer
    if normalizer is not None:
        forms = normalizer.get("normalizers", []) if normalizer.get("type") == "Sequence" else [normalizer]
        if not all(isinstance(form, dict) and form.get("type") in _UNICODE_NORMAL_FORMS for form in forms):
            return f"normalizer {normalizer.get('type')!r} changes ASCII text"
    if pipeline.model is None or pipeline.model.type != "BPE" or pipeline.model.dropout:
        return "the model is not a BPE without dropout"
    if any(token.lstrip or token.rstrip or token.single_word for token in pipeline.added_tokens):
        return "an added token strips whitespace or matches single words only"
    if _split_pattern(pipeline.pre_tokenizer) is None:
        return "the pre-tokenizer is not Split(regex, Isolated) + ByteLevel, nor ByteLevel with its regex"
    return None


def _compiled_split_for(source_pattern: str | None) -> Any:
    """router/_ascii_split when it is built (whole: a stale build lacks a name) and `source_pattern`
    is the regex it writes out; None otherwise (the `re` split runs)."""
    names = ("QWEN2_PATTERN", "split", "PretokenTable")
    compiled = load_compiled("router._ascii_split", "router/_ascii_split.pyx", names, logger)
    return compiled if compiled is not None and source_pattern == compiled.QWEN2_PATTERN else None


def _split_pattern(pre_tokenizer: dict[str, Any] | None) -> str | None:
    """The regex the pre-tokenizer splits with, when it is a shape this module reproduces."""
    if pre_tokenizer is None:
        return None
    kind = pre_tokenizer.get("type")
    if kind == "ByteLevel":
        if pre_tokenizer.get("use_regex", True) and not pre_tokenizer.get("add_prefix_space"):
            return _GPT2_PATTERN
        return None
    if kind != "Sequence":
        return None
    steps = pre_tokenizer.get("pretokenizers", [])
    if len(steps) != 2:
        return None
    split, byte_level = steps
    if (
        split.get("type") != "Split"
        or split.get("behavior") != "Isolated"
        or split.get("invert")
        or not isinstance(split.get("pattern"), dict)
        or "Regex" not in split["pattern"]
    ):
        return None
    if (
        byte_level.get("type") != "ByteLevel"
        or byte_level.get("use_regex")
        or byte_level.get("add_prefix_space")
    ):
        return None
    return split["pattern"]["Regex"]


def _byte_level_table(backend: Any) -> dict[str, str]:
    """ASCII character -> its byte-level character, read from the tokenizers library itself."""
    from tokenizers.pre_tokenizers import ByteLevel

    byte_level = ByteLevel(add_prefix_space=False, use_regex=False)
    return {chr(code): byte_level.pre_tokenize_str(chr(code))[0][0] for code in range(128)}


def _samples() -> list[str]:
    """Texts that exercise every ASCII character and the pattern's alternatives in context."""
    characters = [chr(code) for code in range(128)]
    samples = [
        "".join(characters),
        "".join(reversed(characters)),
        *(f"a{c}b {c}{c}x 9{c}9 {c} {c}\n{c}" for c in characters),
        "It's we'LL they'Re I'M you'd it'S don't 'sx ''s '' 1234567 x2 3.14 -- ... ?! ()[]{}",
        "  leading\tand trailing   \n\n\r\n  mixed \x0b\x0c spaces  ",
    ]
    words = [
        "the", "Cache", "ROUTER", "x", "2", "10", "3.14", "'s", "'t", "'re", "'ve", "'m", "'ll", "'d",
        "'S", "'LL", " ", "  ", "\t", "\n", "\n\n", "\r\n", " \n ", "(see", "table)", "--", "!", "?!",
        "a_b", "@home", "#1", "$5", "100%", "<tag>", "{json}", "\\", "\x00", "\x1c", "\x7f", "~",
    ]  # fmt: skip
    rng = np.random.default_rng(0)
    for _ in range(400):
        picks = rng.choice(len(words), size=int(rng.integers(1, 40)))
        samples.append("".join(words[pick] for pick in picks))
    return samples

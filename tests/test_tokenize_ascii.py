"""The ASCII fast path (router/tokenize/ascii.py): equal to the tokenizer's own encode on ASCII text
(the real Qwen3 tokenizer, and the Llama-3-style test tokenizer, whose split regex groups digits by
three and is not the compiled Qwen2-family split), used by PromptTokenizer for ASCII pieces only,
and refused for pipelines it does not reproduce."""

from __future__ import annotations

import numpy as np
import pytest
from tokenizers import Tokenizer, normalizers, pre_tokenizers

from kvgate_testing.tokenizers import PARITY_TOKENIZERS, tokenizer_dir
from router.config import builtin_tokenizer_dir
from router.tokenize import PromptTokenizer
from router.tokenize.ascii import AsciiEncoder, ascii_pattern

QWEN3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)


@pytest.fixture(scope="module")
def qwen3() -> PromptTokenizer:
    return PromptTokenizer(builtin_tokenizer_dir("qwen3"))


@pytest.fixture(scope="module")
def backend(qwen3: PromptTokenizer) -> Tokenizer:
    return qwen3.tokenizer.backend_tokenizer


@pytest.fixture(scope="module", params=PARITY_TOKENIZERS)
def tokenizer(request: pytest.FixtureRequest) -> PromptTokenizer:
    """Each parity tokenizer in turn (Qwen3, then the Llama-3-style BOS one)."""
    return PromptTokenizer(tokenizer_dir(request.param))


@pytest.fixture(scope="module")
def any_backend(tokenizer: PromptTokenizer) -> Tokenizer:
    return tokenizer.tokenizer.backend_tokenizer


def random_ascii(rng: np.random.Generator, length: int) -> str:
    """ASCII text weighted towards what prose and code look like, every character possible."""
    alphabet = [chr(code) for code in range(128)]
    weights = np.ones(128)
    for common in "etaoinshrdlu ETAOIN .,'\n0123456789":
        weights[ord(common)] += 30
    weights /= weights.sum()
    return "".join(rng.choice(alphabet, size=length, p=weights).tolist())


@pytest.mark.parametrize("seed", range(8))
def test_ascii_encoder_equals_the_tokenizer_on_random_ascii(any_backend: Tokenizer, seed: int) -> None:
    backend = any_backend
    encoder = AsciiEncoder.for_tokenizer(backend)
    assert encoder is not None
    rng = np.random.default_rng(seed)
    for _ in range(40):
        text = random_ascii(rng, int(rng.integers(1, 600)))
        assert encoder.encode(text).tolist() == backend.encode(text, add_special_tokens=False).ids, repr(text)


def test_ascii_encoder_equals_the_tokenizer_on_code_and_prose(any_backend: Tokenizer) -> None:
    backend = any_backend
    encoder = AsciiEncoder.for_tokenizer(backend)
    assert encoder is not None
    texts = [
        "def f(x):\n    return x**2  # it's squared\n\n\nclass A:\n\tpass\r\n",
        "They'll say we'VE done it; I'M sure you'd agree. 1234 + 5678 = 6912!!! ...",
        "digits 1 12 123 1234 12345 1234567890 3.14159 0x7f 2026-12-02",
        '{"key": [1, 2.5e-3, null], "nested": {"a": "b"}}   \n   ',
        "   leading spaces\n\n\n   trailing spaces   ",
        "\x00\x01\x1b[31mred\x1b[0m\x7f",
    ]
    for text in texts:
        assert encoder.encode(text).tolist() == backend.encode(text, add_special_tokens=False).ids, repr(text)


def test_prompt_tokenizer_uses_the_fast_path_for_ascii_pieces_only(qwen3: PromptTokenizer) -> None:
    assert qwen3._ascii is not None
    calls: list[str] = []
    original = qwen3.tokenizer.encode

    def counting_encode(text: str, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(text)
        return original(text, **kwargs)

    qwen3.tokenizer.encode = counting_encode  # type: ignore[method-assign]
    try:
        ascii_piece = "user\nThe quick brown fox can't jump 42 times.<|im_end|>"
        assert qwen3._encode_plain(ascii_piece).tolist() == original(ascii_piece, add_special_tokens=False)
        assert calls == []
        unicode_piece = "user\nnaïve café 中文<|im_end|>"
        assert qwen3._encode_plain(unicode_piece).tolist() == original(
            unicode_piece, add_special_tokens=False
        )
        assert calls == [unicode_piece]
    finally:
        del qwen3.tokenizer.encode


def test_chat_of_ascii_and_unicode_messages_equals_whole_prompt_encoding(tokenizer: PromptTokenizer) -> None:
    rng = np.random.default_rng(5)
    messages = [
        {"role": "system", "content": random_ascii(rng, 3000)},  # long: encoded by segments
        {"role": "user", "content": "Résumé of the document, please: " + random_ascii(rng, 200)},
        {"role": "assistant", "content": random_ascii(rng, 400)},
        {"role": "user", "content": random_ascii(rng, 100)},
    ]
    text = tokenizer.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    expected = tokenizer.tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.tokens_for({"messages": messages}).tolist() == expected
    assert tokenizer.tokens_for({"messages": messages}).tolist() == expected  # from the cache


def test_a_split_that_leaves_a_gap_falls_back(backend: Tokenizer) -> None:
    encoder = AsciiEncoder(backend, "[a-z]+")  # does not match spaces: the split cannot be trusted
    assert encoder.encode("ab cd") is None
    assert encoder.encode("abcd").tolist() == backend.encode("abcd", add_special_tokens=False).ids


def test_pattern_translation_maps_unicode_classes_to_their_ascii_members() -> None:
    translated = ascii_pattern(QWEN3_SPLIT)
    assert translated is not None
    assert r"\p" not in translated and r"\s" not in translated and r"\S" not in translated
    assert "[^\\r\\nA-Za-z0-9]?[A-Za-z]+" in translated
    for unknown in (r"\d+", r"\w+", r"\p{Lu}", r"\P{L}", r"\bx", r"[[:alpha:]]"):
        assert ascii_pattern(unknown) is None, unknown


def test_pipelines_it_does_not_reproduce_get_no_encoder(backend: Tokenizer) -> None:
    lowercased = Tokenizer.from_str(backend.to_str())
    lowercased.normalizer = normalizers.Lowercase()
    assert AsciiEncoder.for_tokenizer(lowercased) is None
    whitespace_split = Tokenizer.from_str(backend.to_str())
    whitespace_split.pre_tokenizer = pre_tokenizers.Whitespace()
    assert AsciiEncoder.for_tokenizer(whitespace_split) is None


@pytest.mark.parametrize("seed", range(4))
def test_pretoken_starts_equal_the_pre_tokenizers_on_random_ascii(any_backend: Tokenizer, seed: int) -> None:
    backend = any_backend
    encoder = AsciiEncoder.for_tokenizer(backend)
    assert encoder is not None
    rng = np.random.default_rng(100 + seed)
    for _ in range(60):
        text = random_ascii(rng, int(rng.integers(1, 80)))
        expected = {start for _, (start, _) in backend.pre_tokenizer.pre_tokenize_str(text)}
        assert encoder.pretoken_starts(text) == expected, repr(text)


def test_segment_cuts_confirmed_by_the_fast_path_equal_the_pre_tokenizers(qwen3: PromptTokenizer) -> None:
    rng = np.random.default_rng(9)
    words = ["the", "cache", "Router", "x2", "it's", "(see", "table).", "--", "\n", "\t", "  ", "42"]
    piece = " ".join(rng.choice(words, size=3000).tolist()) + "<|im_end|>"
    without_fast_path = PromptTokenizer.__new__(PromptTokenizer)
    without_fast_path.__dict__.update(qwen3.__dict__, _ascii=None)
    for segment_chars in (64, 512):
        segments = qwen3._segments(piece, segment_chars)
        assert len(segments) > 3
        assert segments == without_fast_path._segments(piece, segment_chars)


def test_the_qwen3_encoder_splits_in_c_exactly_as_the_translated_regex(backend: Tokenizer) -> None:
    import re

    from router import _ascii_split

    encoder = AsciiEncoder.for_tokenizer(backend)
    assert encoder is not None and encoder._compiled_split is _ascii_split
    split_by_re = re.compile(ascii_pattern(QWEN3_SPLIT), re.ASCII).findall
    rng = np.random.default_rng(17)
    tricky = ["'s", "'S", "'re", "'LL", "'ve", "'x", "'", " ", "  ", "\t", "\x0b", "\x0c", "\r\n", "\n\n",
              " \n ", "word", "W", "42", ",", "...", "-", "\x00", "\x1f", "\x7f", " ,", "\t!"]  # fmt: skip
    for trial in range(4000):
        if trial % 2:
            text = random_ascii(rng, int(rng.integers(1, 80)))
        else:
            text = "".join(rng.choice(tricky, size=int(rng.integers(1, 12))).tolist())
        assert _ascii_split.split(text) == split_by_re(text), repr(text)
    # Every pretoken in the table: the ids in one pass; one missing: None (the encoder fills it).
    text = "It's 42 words,\n  and   more.\n"
    expected = backend.encode(text, add_special_tokens=False).ids
    assert encoder.encode(text).tolist() == expected
    table = encoder._table
    assert table.encode(text).tolist() == expected
    assert table.encode(text + " zebra") is None
    assert table.missing(text + " zebra zebra") == [" zebra", " zebra"]


def test_the_pretoken_table_stores_what_it_is_given_and_refuses_what_it_cannot_hold() -> None:
    from router import _ascii_split

    table = _ascii_split.PretokenTable()
    # 20k one-pretoken words (letters): grows the slots and both arenas many times
    words = ["".join(chr(97 + i // 26**k % 26) for k in range(4)) for i in range(20_000)]
    for i, word in enumerate(words):
        assert table.add(word, [i, i + 1, 2**32 - 1])
    assert len(table) == 20_000 and words[-1] in table and "zzzzz" not in table
    assert table.encode(words[7]).tolist() == [7, 8, 2**32 - 1]
    assert table.add(words[7], [0])  # already there: kept as it was
    assert table.encode(words[7]).tolist() == [7, 8, 2**32 - 1]
    assert table.encode(words[3] + words[5]) is None  # one pretoken, not in the table
    assert table.add(" " + words[5], [9])
    assert table.encode(words[3] + " " + words[5]).tolist() == [3, 4, 2**32 - 1, 9]
    assert table.encode("") is not None and len(table.encode("")) == 0
    long_run = "-" * 100_000  # one pretoken, stored like any other
    assert table.add(long_run, list(range(50_000)))
    assert table.encode(long_run).tolist() == list(range(50_000))
    for bad in ([-1], [2**32], ["x"]):
        with pytest.raises((OverflowError, TypeError)):
            table.add("bad", bad)
    assert "bad" not in table
    with pytest.raises(ValueError):
        table.encode("naïve")
    table.clear()
    assert len(table) == 0 and table.encode(words[7]) is None


def test_a_stale_compiled_split_is_refused_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import sys
    import types

    import router
    from router.tokenize import ascii as ascii_encoder

    stale = types.ModuleType("router._ascii_split")
    stale.QWEN2_PATTERN = QWEN3_SPLIT  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "router._ascii_split", stale)
    monkeypatch.setattr(router, "_ascii_split", stale, raising=False)
    with caplog.at_level("WARNING", logger="kvgate.tokenize"):
        assert ascii_encoder._compiled_split_for(QWEN3_SPLIT) is None
    assert "stale build" in caplog.text
    assert ascii_encoder._compiled_split_for(r"\s+") is None


@pytest.mark.parametrize("path", ["C table", "dict"])
def test_long_distinct_pretokens_do_not_grow_the_table_past_its_byte_bound(
    backend: Tokenizer, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    from router.tokenize import ascii as ascii_encoder

    monkeypatch.setattr(ascii_encoder, "MAX_CACHED_PRETOKEN_BYTES", 20_000)
    if path == "dict":  # no compiled module: the re split and the dict cache, under the same bound
        monkeypatch.setattr(ascii_encoder, "_compiled_split_for", lambda pattern: None)
    encoder = AsciiEncoder.for_tokenizer(backend)
    assert encoder is not None
    if path == "dict":
        assert encoder._table is None
        for length in range(5_000, 5_040):
            text = "word " + "-" * length
            assert encoder.encode(text).tolist() == backend.encode(text, add_special_tokens=False).ids
            assert encoder._pretoken_bytes < 20_000 + 2 * length  # started over once past the bound
            assert sum(len(word) for word in encoder._pretokens) < 20_000 + 2 * length
        return
    assert encoder._table is not None
    for length in range(5_000, 5_040):  # each one pretoken of its own (a run of symbols)
        text = "word " + "-" * length
        assert encoder.encode(text).tolist() == backend.encode(text, add_special_tokens=False).ids
        assert encoder._table.stored_bytes < 20_000 + 2 * length  # cleared once past the bound

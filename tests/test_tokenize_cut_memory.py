"""Remembered segmentations of long texts: exact, bounded, and never reused past a change."""

from __future__ import annotations

import numpy as np
import pytest

from kvgate_testing.tokenizers import config, encode_threads
from router.config import builtin_tokenizer_dir
from router.recent_keys import RecentKeys
from router.tokenize import PromptTokenizer, RequestTokenizer
from router.tokenize.caches import CutMemory, SegmentedText
from router.tokenize.prompt import LONG_PIECE_SIGHTINGS, SEGMENT_CHARS

WORDS = [
    "Cache", "router", "engine's", "prefix", "token", "ünïcödé", "中文", "x2", "3.14", "(see", "table)",
    "it's", "  spaced", "line\n", "para\n\n", "naïve", "😀", "a", "I", "end.", "--", "WE'LL",
]  # fmt: skip


@pytest.fixture(scope="module")
def qwen3() -> PromptTokenizer:
    return PromptTokenizer(builtin_tokenizer_dir("qwen3"))


def fresh(qwen3: PromptTokenizer, cut_memory_chars: int = 1 << 24) -> PromptTokenizer:
    """The loaded tokenizer with an empty piece cache and an empty cut memory of its own."""
    tokenizer = PromptTokenizer.__new__(PromptTokenizer)
    tokenizer.__dict__.update(qwen3.__dict__)
    tokenizer.cache = type(qwen3.cache)(4_000_000)
    tokenizer.cuts = CutMemory(cut_memory_chars)
    tokenizer.long_pieces = RecentKeys(LONG_PIECE_SIGHTINGS)
    return tokenizer


def prose(rng: np.random.Generator, words: int, ascii_only: bool = False) -> str:
    vocabulary = [word for word in WORDS if word.isascii()] if ascii_only else WORDS
    return " ".join(rng.choice(vocabulary, size=words).tolist())


def chat_tokens(tokenizer: PromptTokenizer, content: str) -> tuple[list[int], list[int]]:
    """(tokens through the gateway's path, tokens of the whole rendered text encoded at once)."""
    body = {"messages": [{"role": "user", "content": content}]}
    text = tokenizer.render_chat(body)
    return tokenizer.tokens_for(body).tolist(), tokenizer.tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("seed", range(8))
def test_documents_with_new_questions_and_edits_tokenize_as_whole_texts(
    qwen3: PromptTokenizer, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    tokenizer = fresh(qwen3)
    document = prose(rng, int(rng.integers(700, 2500)), ascii_only=seed % 2 == 0)
    for round_ in range(6):
        question = prose(rng, int(rng.integers(3, 40)))
        if round_ in (2, 4):
            # An edit anywhere (also inside the first segment, or right at a cut's context).
            at = int(rng.integers(0, len(document)))
            document = document[:at] + rng.choice(["X", " ", "中", "\n", "é"]) + document[at + 1 :]
        if round_ == 5:
            document = document[: int(rng.integers(SEGMENT_CHARS, len(document)))]  # cut short
        through_path, whole = chat_tokens(tokenizer, f"{document}\n\nQuestion: {question}")
        assert through_path == whole, (seed, round_)


def test_a_new_question_cuts_only_past_the_remembered_document(qwen3: PromptTokenizer) -> None:
    tokenizer = fresh(qwen3)
    checked: list[int] = []
    starts_pretoken = tokenizer._starts_pretoken

    def counting(text: str, cut: int) -> bool:
        checked.append(cut)
        return starts_pretoken(text, cut)

    tokenizer._starts_pretoken = counting  # type: ignore[method-assign]
    document = prose(np.random.default_rng(3), 3000, ascii_only=True)
    through_path, whole = chat_tokens(tokenizer, f"{document}\n\nQuestion: what is first?")
    assert through_path == whole
    # Seen once: encoded whole, no cut looked for, nothing remembered.
    assert checked == [] and len(tokenizer.cuts) == 0
    through_path, whole = chat_tokens(tokenizer, f"{document}\n\nQuestion: and what is next?")
    assert through_path == whole
    first = len(checked)  # seen again: cut into segments, the cuts remembered
    checked.clear()
    through_path, whole = chat_tokens(tokenizer, f"{document}\n\nQuestion: and what comes last?")
    assert through_path == whole
    assert first > 20
    # Only cuts past the last remembered one are looked for again (the question's tail here is
    # shorter than a segment: none at all).
    assert all(cut > len(document) - 2 * SEGMENT_CHARS for cut in checked)
    assert len(checked) < first / 4


def test_a_changed_beginning_is_not_reused_past_the_change(qwen3: PromptTokenizer) -> None:
    """Same first segment (the memory's key), a change further on: cuts after it are found anew."""
    tokenizer = fresh(qwen3)
    rng = np.random.default_rng(11)
    document = prose(rng, 2500, ascii_only=True)
    chat_tokens(tokenizer, f"{document}\n\nQuestion: one?")
    # Shift everything after a point by one word: the old cuts past it fall inside other words.
    at = document.index(" ", 3 * SEGMENT_CHARS)
    changed = document[:at] + " inserted" + document[at:]
    through_path, whole = chat_tokens(tokenizer, f"{changed}\n\nQuestion: one?")
    assert through_path == whole
    # And a change right before a remembered cut (inside its context) is not taken as shared.
    remembered = next(reversed(tokenizer.cuts._entries.values()))  # the changed document's
    assert changed in remembered.body
    offset = remembered.body.index(changed)  # the piece begins with the role ("user\n")
    cut = remembered.ends[3] - offset
    nudged = changed[: cut - 3] + "Q" + changed[cut - 2 :]
    through_path, whole = chat_tokens(tokenizer, f"{nudged}\n\nQuestion: two?")
    assert through_path == whole


def test_the_cut_memory_is_bounded_by_characters_and_evicts_the_oldest() -> None:
    memory = CutMemory(max_chars=10_000)
    bodies = [f"{index:04d}" + "x" * 2996 for index in range(5)]  # distinct first segments
    for body in bodies:
        memory.put(SEGMENT_CHARS, SegmentedText(body, [len(body)], [np.zeros(1, dtype=np.uint32)]))
    assert len(memory) == 3 and memory.size <= 10_000
    assert memory.get(SEGMENT_CHARS, bodies[0]) is None and memory.get(SEGMENT_CHARS, bodies[1]) is None
    assert memory.get(SEGMENT_CHARS, bodies[2]) is not None  # now the most recent
    memory.put(SEGMENT_CHARS, SegmentedText(bodies[0], [3000], [np.zeros(1, dtype=np.uint32)]))
    assert memory.get(SEGMENT_CHARS, bodies[3]) is None  # the least recently used went
    assert memory.get(SEGMENT_CHARS, bodies[2]) is not None
    memory.put(SEGMENT_CHARS, SegmentedText("y" * 20_000, [20_000], [np.zeros(1, dtype=np.uint32)]))
    assert memory.get(SEGMENT_CHARS, "y" * 20_000) is None  # over the bound alone: not kept


def test_a_tokenizer_with_a_small_cut_memory_stays_within_it(qwen3: PromptTokenizer) -> None:
    tokenizer = fresh(qwen3, cut_memory_chars=40_000)
    rng = np.random.default_rng(2)
    for _ in range(12):
        through_path, whole = chat_tokens(tokenizer, prose(rng, 1500) + "\n\nQuestion: why?")
        assert through_path == whole
    assert 0 < tokenizer.cuts.size <= 40_000 and len(tokenizer.cuts) < 12


def test_a_new_question_after_a_long_non_ascii_document_is_encoded_on_the_loop() -> None:
    # The document goes through the Rust tokenizer in the thread once; a new question after it
    # leaves only its last segment to encode: too little for the thread hop to pay.
    document = "un long document sur les caches, déjà lu, puis relu. " * 120
    bodies = [
        {"model": "qwen", "messages": [{"role": "user", "content": f"{document}\n\nQuestion: {question}"}]}
        for question in ("Quoi?", "Et ensuite, pourquoi?")
    ]
    assert encode_threads(RequestTokenizer(config()), bodies) == [True, False]

"""The piece cache and the prompt memory (router/tokenize/caches.py) are bounded by the memory their
entries hold, not only by tokens and characters: a client sending many distinct short chats (a word
and the template's added tokens, a few tokens and characters each) must not grow them by hundreds
of bytes of Python objects an entry up to their token and character bounds (over 1 GB a model)."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from router.config import builtin_tokenizer_dir
from router.tokenize import PromptTokenizer
from router.tokenize.caches import PROMPT_ENTRY_KEY_BYTES, CutMemory, PieceCache, PromptMemory, entry_bytes

BOUND = 1 << 20  # 1 MiB for each, in these tests


@pytest.fixture(scope="module")
def qwen3() -> PromptTokenizer:
    return PromptTokenizer(builtin_tokenizer_dir("qwen3"))


def with_small_memories(qwen3: PromptTokenizer) -> PromptTokenizer:
    """The loaded tokenizer with its default token and character bounds and 1 MiB memory bounds."""
    tokenizer = PromptTokenizer.__new__(PromptTokenizer)
    tokenizer.__dict__.update(qwen3.__dict__)
    tokenizer.cache = PieceCache(4_000_000, max_bytes=BOUND)
    tokenizer.cuts = CutMemory(1 << 24)
    tokenizer.prompts = PromptMemory(16 << 20, max_bytes=BOUND)
    return tokenizer


def short_chat(i: int) -> dict:
    return {"messages": [{"role": "user", "content": f"w{i}"}]}


def test_many_short_chats_stay_within_the_memory_bounds(qwen3: PromptTokenizer) -> None:
    tokenizer = with_small_memories(qwen3)
    chats = 12_000
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(chats):
            tokenizer.tokens_for(short_chat(i))
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    cache, prompts = tokenizer.cache, tokenizer.prompts
    # Far under their token and character bounds, both were full by memory and evicted.
    assert cache.size < 100_000 and prompts.size < 1_000_000
    assert 0 < cache.bytes <= BOUND and 0 < prompts.bytes <= BOUND
    assert len(prompts) < chats and len(cache._entries) < chats
    # The count is the memory: what the process holds grew by about the two bounds, not more.
    assert grown < 3 * BOUND
    # What each holds is accounted exactly, so evictions keep the count true.
    assert cache.bytes == sum(entry_bytes(text, ids) for text, ids in cache._entries.items())
    assert prompts.bytes == sum(
        entry_bytes(prompt, ids) + PROMPT_ENTRY_KEY_BYTES for prompt, ids in prompts._entries.values()
    )


def test_the_latest_entries_are_kept_and_still_exact(qwen3: PromptTokenizer) -> None:
    tokenizer = with_small_memories(qwen3)
    for i in range(8_000):
        tokenizer.tokens_for(short_chat(i))
    latest = short_chat(7_999)
    text = tokenizer.render_chat(latest)
    boundaries = [match.end() for match in tokenizer._added_pattern.finditer(text)]
    assert tokenizer.prompts.longest_prefix(text, boundaries) is not None
    assert tokenizer.prompts.longest_prefix(tokenizer.render_chat(short_chat(0)), boundaries) is None
    # A next turn of the latest chat is taken from memory and encodes as the whole text does.
    next_turn = [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "and?"}]
    follow_up = {"messages": [*latest["messages"], *next_turn]}
    hits = tokenizer.prompts.hits
    ids = tokenizer.tokens_for(follow_up)
    whole = tokenizer.tokenizer.encode(tokenizer.render_chat(follow_up), add_special_tokens=False)
    assert ids.tolist() == whole and tokenizer.prompts.hits == hits + 1


def test_an_entry_larger_than_the_bound_is_not_kept() -> None:
    cache = PieceCache(1_000_000, max_bytes=4096)
    cache.put("small", np.arange(3, dtype=np.uint32))
    cache.put("x" * 8000, np.arange(10, dtype=np.uint32))
    assert cache.get("small") is not None and cache.get("x" * 8000) is None
    prompts = PromptMemory(1 << 20, max_bytes=4096)
    prompts.put("y" * 8000, np.arange(10, dtype=np.uint32))
    assert len(prompts) == 0 and prompts.bytes == 0


def test_cached_segments_own_their_tokens(qwen3: PromptTokenizer) -> None:
    """A long piece's segments are cached as arrays of their own, not views of the piece's tokens:
    a view would keep all of them alive after its neighbours were evicted, uncounted."""
    tokenizer = with_small_memories(qwen3)
    words = ["routing", "cache", "engine", "prefix", "token", "block", "event", "replica"]
    document = " ".join(words[(i * 7) % len(words)] + str(i % 13) for i in range(1500))
    ids = tokenizer._encode_by_segments("ü" + document, 512)  # not ASCII: one Rust encode, then split
    assert ids.tolist() == tokenizer.tokenizer.encode("ü" + document, add_special_tokens=False)
    segments = tokenizer._segments("ü" + document, 512)
    assert len(segments) > 4
    for segment in segments:
        cached = tokenizer.cache.get(segment)
        assert cached is not None and cached.base is None, segment[:40]
    assert tokenizer.cache.bytes == sum(
        entry_bytes(text, ids) for text, ids in tokenizer.cache._entries.items()
    )

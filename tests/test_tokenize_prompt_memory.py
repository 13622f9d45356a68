"""The prompt memory (router/tokenize/caches.py, PromptMemory): a chat's next turn takes the tokens of
the earlier prompt it repeats (up to that prompt's last added token) and encodes only the rest.
Every probe compares with the whole rendered text encoded at once, token for token (growing chats on
Qwen3's template and on the Llama-3-style test tokenizer's, which writes a BOS first)."""

from __future__ import annotations

import numpy as np
import pytest

from kvgate_testing.tokenizers import PARITY_TOKENIZERS, tokenizer_dir
from router.config import builtin_tokenizer_dir
from router.tokenize import PromptTokenizer
from router.tokenize.caches import CutMemory, PieceCache, PromptMemory

WORDS = [
    "Cache", "router", "engine's", "prefix", "token", "ünïcödé", "中文", "e\u0301t\u00e9", "x2", "3.14",
    "it's", "WE'LL", "  spaced", "tab\tbed", "line\n", "para\n\n", "--", "😀", "a", "I", "   ", "end.",
    "<think>", "</think>", "<|im_end|>", "<|im_start|>", "<|endoftext|>", "<|eot_id|>", "<|begin_of_text|>",
]  # fmt: skip


@pytest.fixture(scope="module")
def qwen3() -> PromptTokenizer:
    return PromptTokenizer(builtin_tokenizer_dir("qwen3"))


def fresh(qwen3: PromptTokenizer, prompt_memory_chars: int = 1 << 24) -> PromptTokenizer:
    """The loaded tokenizer with empty caches and an empty prompt memory of its own."""
    tokenizer = PromptTokenizer.__new__(PromptTokenizer)
    tokenizer.__dict__.update(qwen3.__dict__)
    tokenizer.cache = PieceCache(4_000_000)
    tokenizer.cuts = CutMemory(1 << 24)
    tokenizer.prompts = PromptMemory(prompt_memory_chars)
    return tokenizer


def text_of(rng: np.random.Generator, words: int) -> str:
    return " ".join(rng.choice(WORDS, size=words).tolist())


def whole(tokenizer: PromptTokenizer, body: dict) -> list[int]:
    text = tokenizer.render_chat(body)
    return tokenizer.tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module", params=PARITY_TOKENIZERS)
def parity_tokenizer(request: pytest.FixtureRequest) -> PromptTokenizer:
    """Each parity tokenizer in turn (Qwen3, then the Llama-3-style BOS one)."""
    return PromptTokenizer(tokenizer_dir(request.param))


@pytest.mark.parametrize("seed", range(4))
def test_each_turn_of_growing_chats_equals_whole_encoding(
    parity_tokenizer: PromptTokenizer, seed: int
) -> None:
    tokenizer = fresh(parity_tokenizer)
    rng = np.random.default_rng(seed)
    chats = [[{"role": "system", "content": text_of(rng, 20)}] for _ in range(3)]
    for turn in range(5):
        for messages in chats:  # interleaved, as sessions arrive
            long = turn == 2 and rng.random() < 0.7  # a message long enough to be cut into segments
            messages.append({"role": "user", "content": text_of(rng, 700 if long else 25)})
            if rng.random() < 0.2:
                messages.append({"role": "tool", "content": text_of(rng, 10)})
            body = {"messages": list(messages), "add_generation_prompt": bool(turn % 3)}
            assert tokenizer.tokens_for(body).tolist() == whole(tokenizer, body)
            reasoning = f"<think>\n{text_of(rng, 8)}\n</think>\n\n" * (turn % 2)
            messages.append({"role": "assistant", "content": reasoning + text_of(rng, 30)})
    assert tokenizer.prompts.hits >= 3 * 4  # every later turn found its previous prompt


def test_a_follow_up_encodes_only_its_new_messages_even_with_the_piece_cache_emptied(
    qwen3: PromptTokenizer,
) -> None:
    tokenizer = fresh(qwen3)
    rng = np.random.default_rng(7)
    messages = [
        {"role": "system", "content": text_of(rng, 50)},
        {"role": "user", "content": text_of(rng, 80)},
    ]
    tokenizer.tokens_for({"messages": messages})
    tokenizer.cache = PieceCache(4_000_000)  # only the prompt memory knows the history now
    follow_up = {
        "messages": [*messages, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more?"}]
    }
    text = tokenizer.render_chat(follow_up)
    new_part = "assistant\nok<|im_end|>\n<|im_start|>user\nmore?<|im_end|>\n<|im_start|>assistant\n"
    assert text.endswith(new_part)
    slow, fast = tokenizer.uncached_chars(text, add_special_tokens=False)
    assert slow + fast == len(new_part)
    assert tokenizer.tokens_for(follow_up).tolist() == whole(tokenizer, follow_up)
    assert tokenizer.cache.misses == 4  # the new pieces only, not one per earlier message


@pytest.mark.parametrize("where", ["system", "first-user", "near-boundary", "last-char", "role"])
def test_an_edited_history_is_not_taken_for_the_remembered_one(qwen3: PromptTokenizer, where: str) -> None:
    tokenizer = fresh(qwen3)
    rng = np.random.default_rng(11)
    messages = [
        {"role": "system", "content": text_of(rng, 60)},
        {"role": "user", "content": text_of(rng, 200)},
        {"role": "assistant", "content": text_of(rng, 40)},
        {"role": "user", "content": text_of(rng, 30)},
    ]
    tokenizer.tokens_for({"messages": messages})
    edited = [dict(message) for message in messages]
    if where == "system":
        edited[0]["content"] = "X" + edited[0]["content"][1:]
    elif where == "first-user":  # far before the key's characters: same key, different text
        content = edited[1]["content"]
        edited[1]["content"] = content[:10] + "Z" + content[11:]
    elif where == "near-boundary":
        content = edited[3]["content"]
        edited[3]["content"] = content[:-3] + "Q" + content[-2:]
    elif where == "last-char":
        edited[3]["content"] = edited[3]["content"] + "!"
    else:
        edited[2]["role"] = "user"
    body = {
        "messages": [*edited, {"role": "assistant", "content": "fine"}, {"role": "user", "content": "next"}]
    }
    assert tokenizer.tokens_for(body).tolist() == whole(tokenizer, body)


def test_the_memory_is_bounded_by_characters_and_forgets_the_oldest(qwen3: PromptTokenizer) -> None:
    tokenizer = fresh(qwen3, prompt_memory_chars=6000)
    rng = np.random.default_rng(3)
    bodies = [{"messages": [{"role": "user", "content": text_of(rng, 150)}]} for _ in range(12)]
    for body in bodies:
        tokenizer.tokens_for(body)
    memory = tokenizer.prompts
    assert memory.size <= 6000 and 0 < len(memory) < 12
    assert sum(len(prompt) for prompt, _ in memory._entries.values()) == memory.size
    kept = [prompt for prompt, _ in memory._entries.values()]
    assert tokenizer.render_chat(bodies[-1]).startswith(kept[-1])
    assert not any(tokenizer.render_chat(bodies[0]).startswith(prompt) for prompt in kept)

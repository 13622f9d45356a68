"""Tokenization parity with vLLM (the real Qwen3 tokenizer and chat template, which add no BOS token,
and a Llama-3-style tokenizer whose template writes one and whose encode adds one), the per-message
cache, completions' special-token rule, and bad input (`tokenize: engine`: tests/test_tokenize_engine.py)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from kvgate_testing.tokenizers import (
    PARITY_TOKENIZERS,
    completion_tokens,
    config,
    encode_threads,
    tokenizer_dir,
    whole_prompt_tokens,
)
from router.config import builtin_tokenizer_dir
from router.policies.base import RouteRequest
from router.tokenize import PromptTokenizer, RequestTokenizer, TokenizeError
from router.tokenize.caches import PieceCache

QWEN3_EXAMPLE = (
    "Qwen3 is the latest generation of large language models in Qwen series, offering a comprehensive "
    "suite of dense and mixture-of-experts"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


@pytest.fixture(scope="module")
def qwen3() -> PromptTokenizer:
    return PromptTokenizer(builtin_tokenizer_dir("qwen3"))


@pytest.fixture(scope="module", params=PARITY_TOKENIZERS)
def tokenizer(request: pytest.FixtureRequest) -> PromptTokenizer:
    """Each parity tokenizer in turn: Qwen3 (no BOS), then the Llama-3-style one (BOS)."""
    return PromptTokenizer(tokenizer_dir(request.param))


def conversation(turns: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    words = ["cache", "prefix", "  spaced", "token\n", "ünï", "中文", "\t", "end.", "KV", "<tag>", "  "]
    messages = [{"role": "system", "content": "You are a helpful assistant. " * 3}]
    for turn in range(turns):
        messages.append(
            {"role": "user", "content": "".join(rng.choice(words, size=30)) + f" question {turn}?"}
        )
        messages.append({"role": "assistant", "content": "".join(rng.choice(words, size=20))})
    messages.append({"role": "user", "content": "and finally?"})
    return messages


def test_the_documented_qwen3_example(qwen3: PromptTokenizer) -> None:
    tokens = qwen3.tokens_for({"messages": [{"role": "user", "content": QWEN3_EXAMPLE}]})
    assert tokens[:12].tolist() == [151644, 872, 198, 48, 16948, 18, 374, 279, 5535, 9471, 315, 3460]
    assert tokens.dtype == np.uint32


def test_pieces_encode_independently(tokenizer: PromptTokenizer) -> None:
    # So that the parity tests below run through the piece cache and the ASCII fast path.
    assert tokenizer.piecewise and tokenizer._ascii is not None


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"tools": TOOLS},
        {"chat_template_kwargs": {"enable_thinking": False}},
        {"add_generation_prompt": False},
        {"continue_final_message": True, "add_generation_prompt": False},
        {"add_special_tokens": True},
    ],
    ids=[
        "default",
        "tools",
        "template-kwargs",
        "no-generation-prompt",
        "continue-final",
        "add-special-tokens",
    ],
)
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_chat_tokens_equal_whole_prompt_tokenization(
    tokenizer: PromptTokenizer, extra: dict, seed: int
) -> None:
    body = {"messages": conversation(3, seed), **extra}
    if extra.get("continue_final_message"):
        body["messages"] = [*body["messages"], {"role": "assistant", "content": "Partial answ"}]
    assert tokenizer.tokens_for(body).tolist() == whole_prompt_tokens(tokenizer, body)


def test_list_content_parts_are_joined_like_vllm(tokenizer: PromptTokenizer) -> None:
    parts = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
        ]
    }
    joined = {"messages": [{"role": "user", "content": "a\nb"}]}
    assert tokenizer.tokens_for(parts).tolist() == tokenizer.tokens_for(joined).tolist()
    assert tokenizer.tokens_for(joined).tolist() == whole_prompt_tokens(tokenizer, joined)


# The pieces a follow-up turn ("ok", "more?") encodes: the text is cut right after each added token,
# and Llama 3's role headers ("user<|end_header_id|>") are cached from the first turn.
FOLLOW_UP_PIECES = {
    "qwen3": ["assistant\nok<|im_end|>", "user\nmore?<|im_end|>"],
    "bos": ["\n\nok<|eot_id|>", "\n\nmore?<|eot_id|>"],
}


@pytest.mark.parametrize("name", PARITY_TOKENIZERS)
def test_a_follow_up_turn_encodes_only_its_new_pieces(name: str) -> None:
    tokenizer = PromptTokenizer(tokenizer_dir(name))
    encoded: list[str] = []
    original = tokenizer._encode_plain  # every uncached piece goes through it (ASCII fast path or not)

    def counting_encode(text: str) -> np.ndarray:
        encoded.append(text)
        return original(text)

    tokenizer._encode_plain = counting_encode  # type: ignore[method-assign]
    history = conversation(4, seed=9)
    tokenizer.tokens_for({"messages": history})
    first_turn_chars = sum(map(len, encoded))
    encoded.clear()
    follow_up = {
        "messages": [*history, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more?"}]
    }
    tokens = tokenizer.tokens_for(follow_up)
    # Only the new messages were encoded again.
    assert encoded == FOLLOW_UP_PIECES[name]
    assert first_turn_chars > 1000
    assert tokens.tolist() == whole_prompt_tokens(tokenizer, follow_up)
    assert tokenizer.cache.hits > 0


PROSE_WORDS = [
    "Cache", "router", "engine's", "prefix", "token", "ünïcödé", "中文", "e\u0301t\u00e9", "x2", "3.14",
    "(see", "table)", "it's", "WE'LL", "  spaced", "tab\tbed", "line\n", "para\n\n", "--", "naïve",
    "😀", "a", "I", "\r\nCRLF", "   ", "end.", "the", "of", "and", "document", "section", "42",
]  # fmt: skip


def random_prose(rng: np.random.Generator, words: int) -> str:
    return " ".join(rng.choice(PROSE_WORDS, size=words).tolist())


def test_long_messages_are_cached_by_segments(tokenizer: PromptTokenizer) -> None:
    assert tokenizer.segmented


@pytest.mark.parametrize("seed", range(6))
def test_segment_encoding_equals_whole_encoding_on_random_text(tokenizer: PromptTokenizer, seed: int) -> None:
    rng = np.random.default_rng(seed)
    text = random_prose(rng, int(rng.integers(400, 3000)))
    end_of_turn = tokenizer.tokenizer.eos_token  # <|im_end|>, <|eot_id|>
    for piece in (text, text + end_of_turn, "\n" + text + " \n "):
        for segment_chars in (16, 100, 512):
            segments = tokenizer._segments(piece, segment_chars)
            assert "".join(segments) == piece
            assert len(segments) > 1
            ids = np.concatenate([tokenizer._encode_plain(segment) for segment in segments])
            whole = tokenizer.tokenizer.encode(piece, add_special_tokens=False)
            assert ids.tolist() == whole
            # Through the cache: cold (one encode split by offsets), then warm, then after a prefix.
            fresh = PromptTokenizer.__new__(PromptTokenizer)
            fresh.__dict__.update(tokenizer.__dict__, cache=PieceCache(1_000_000))
            assert fresh._encode_by_segments(piece, segment_chars).tolist() == whole
            assert fresh._encode_by_segments(piece, segment_chars).tolist() == whole
            fresh.cache = PieceCache(1_000_000)
            fresh._encode_by_segments(piece[: len(piece) // 2], segment_chars)
            assert fresh._encode_by_segments(piece, segment_chars).tolist() == whole


class CountingEncoder:
    """Records the texts a tokenizer object is asked to encode, and delegates everything."""

    def __init__(self, inner: object, encoded: list[str]) -> None:
        self._inner = inner
        self._encoded = encoded

    def encode(self, text: str, *args, **kwargs):  # type: ignore[no-untyped-def]
        self._encoded.append(text)
        return self._inner.encode(text, *args, **kwargs)  # type: ignore[attr-defined]

    def encode_batch(self, texts: list[str], *args, **kwargs):  # type: ignore[no-untyped-def]
        self._encoded.extend(texts)
        return self._inner.encode_batch(texts, *args, **kwargs)  # type: ignore[attr-defined]

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self._inner, name)


@pytest.mark.parametrize("name", PARITY_TOKENIZERS)
def test_a_new_question_after_the_same_document_encodes_only_the_last_segment(name: str) -> None:
    tokenizer = PromptTokenizer(tokenizer_dir(name))
    encoded: list[str] = []
    tokenizer.tokenizer = CountingEncoder(tokenizer.tokenizer, encoded)  # type: ignore[assignment]
    tokenizer._pre_tokenizer_owner = CountingEncoder(tokenizer._pre_tokenizer_owner, encoded)
    document = random_prose(np.random.default_rng(5), 2500)
    encoded_per_request = []
    for question in ("What does the first section say?", "Which table holds the results?"):
        body = {"messages": [{"role": "user", "content": f"{document}\n\nQuestion: {question}"}]}
        encoded.clear()
        tokens = tokenizer.tokens_for(body)
        encoded_per_request.append(list(encoded))
        assert tokens.tolist() == whole_prompt_tokens(tokenizer, body)
    first, second = encoded_per_request
    assert sum(map(len, first)) > len(document)
    # The second request encoded its question's segment (and the short generation prompt), not the
    # document again.
    assert sum(map(len, second)) < 2 * 512 + 100
    assert any("Which table" in text for text in second)


def test_completions_follow_the_engine_special_token_rule(tokenizer: PromptTokenizer) -> None:
    text = "Explain the significance of KV cache in language models."
    expected = completion_tokens(tokenizer, {"prompt": text})
    assert tokenizer.tokens_for({"prompt": text}).tolist() == expected
    unspecial = {"prompt": text, "add_special_tokens": False}
    assert tokenizer.tokens_for(unspecial).tolist() == completion_tokens(tokenizer, unspecial)
    # A prompt that was encoded once without special tokens is not answered from the piece cache
    # when they are asked for again (a BOS tokenizer's answers differ by the BOS).
    assert tokenizer.tokens_for({"prompt": text}).tolist() == expected
    assert tokenizer.tokens_for({"prompt": [5, 6, 7]}).tolist() == [5, 6, 7]
    assert tokenizer.tokens_for({"prompt": [[8, 9], [10]]}).tolist() == [8, 9]
    assert tokenizer.tokens_for({"prompt": [text, "other"]}).tolist() == expected


@pytest.mark.parametrize(
    "body",
    [
        {"messages": "not a list"},
        {"messages": []},
        {"messages": ["not an object"]},
        {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": "bad"},
        {"prompt": 5},
        {"prompt": [-1, 2]},
        {"neither": True},
    ],
)
def test_bad_bodies_raise_a_clear_tokenize_error(qwen3: PromptTokenizer, body: dict) -> None:
    with pytest.raises(TokenizeError):
        qwen3.tokens_for(body)


@pytest.mark.parametrize("name", PARITY_TOKENIZERS)
def test_prepare_fills_tokens_and_namespace(name: str) -> None:
    tokenizer = RequestTokenizer(config(tokenizer=name))
    body = {"model": "qwen", "messages": [{"role": "user", "content": "hello"}], "cache_salt": "s"}
    request = RouteRequest(request_id="r1", model="qwen", body=body)
    asyncio.run(tokenizer.prepare(request))
    assert request.tokens is not None and request.tokens.tolist() == whole_prompt_tokens(
        tokenizer.tokenizer("qwen"),
        body,  # type: ignore[arg-type]
    )
    assert request.namespace == (None, "s")


def test_long_text_for_the_rust_tokenizer_is_encoded_off_the_loop() -> None:
    # Non-ASCII text goes through the Rust tokenizer, which releases the GIL in its thread.
    text = "un long document sur les caches, déjà lu. " * 100
    body = {"model": "qwen", "messages": [{"role": "user", "content": text}]}
    assert encode_threads(RequestTokenizer(config()), [body]) == [True]


def test_long_ascii_text_stays_on_the_loop_until_the_ascii_line() -> None:
    # The ASCII fast path holds the GIL: a thread would gain the loop nothing below the line.
    long_text = "a long document about caches. " * 400
    huge_text = "a huge document about caches. " * 2300  # over OFF_LOOP_MIN_ASCII_CHARS
    bodies = [
        {"model": "qwen", "messages": [{"role": "user", "content": long_text}]},
        {"model": "qwen", "messages": [{"role": "user", "content": huge_text}]},
    ]
    assert encode_threads(RequestTokenizer(config()), bodies) == [False, True]


def test_a_follow_up_with_a_long_cached_history_is_encoded_on_the_loop() -> None:
    history = [{"role": "user", "content": "un long document sur les caches, déjà lu. " * 100}]
    first = {"model": "qwen", "messages": history}
    follow_up = {
        "model": "qwen",
        "messages": [*history, {"role": "assistant", "content": "Oui."}, {"role": "user", "content": "Et?"}],
    }
    # Only the two new messages are uncached: short enough to skip the thread hop.
    assert encode_threads(RequestTokenizer(config()), [first, follow_up]) == [True, False]


def test_prepare_leaves_tokens_empty_on_a_bad_body() -> None:
    tokenizer = RequestTokenizer(config())
    request = RouteRequest(request_id="r2", model="qwen", body={"messages": 7})
    asyncio.run(tokenizer.prepare(request))
    assert request.tokens is None and tokenizer.failures == 1

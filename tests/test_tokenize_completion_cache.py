"""A completion's prompt (special tokens added, vLLM's default) goes through the caches like a
chat's: the affixes the tokenizer adds are learnt once, the text between them is cached by pieces.
Before, every completion was encoded whole by the tokenizer, off the event loop once it was long
(benchmarks/real_added_latency.py: +3.9 ms of kv_aware on a repeated 1000-token completion)."""

from __future__ import annotations

import numpy as np
import pytest

from kvgate_testing.real_fleet import filler_text
from kvgate_testing.tokenizers import BOS_TOKENIZER_DIR
from router.config import builtin_tokenizer_dir
from router.tokenize import PromptTokenizer

TOKENIZERS = {"qwen3": builtin_tokenizer_dir("qwen3"), "bos": str(BOS_TOKENIZER_DIR)}


@pytest.fixture(scope="module", params=sorted(TOKENIZERS))
def tokenizer(request) -> PromptTokenizer:
    return PromptTokenizer(TOKENIZERS[request.param])


def test_added_special_tokens_equal_the_tokenizers_own_on_varied_texts(tokenizer: PromptTokenizer) -> None:
    rng = np.random.default_rng(7)
    words = ["Cache", "ünïcödé", "中文", " x", "\n", "<|im_start|>", "<|begin_of_text|>", "the", "  ", "3.14"]
    for _ in range(150):
        text = "".join(rng.choice(words, size=int(rng.integers(0, 50))).tolist())
        expected = tokenizer.tokenizer.encode(text, add_special_tokens=True)
        assert tokenizer.encode_text(text, add_special_tokens=True).tolist() == expected, text


def test_a_repeated_completion_is_not_encoded_by_the_tokenizer_again(
    tokenizer: PromptTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    body = {"prompt": "A long completion: " + filler_text(1000)}
    first = tokenizer.tokens_for(body).tolist()
    assert first == tokenizer.tokenizer.encode(body["prompt"], add_special_tokens=True)
    calls = []
    encode = tokenizer.tokenizer.encode
    monkeypatch.setattr(tokenizer.tokenizer, "encode", lambda *a, **k: calls.append(a) or encode(*a, **k))
    assert tokenizer.tokens_for(body).tolist() == first
    assert calls == []
    # Nothing left to encode: the request path keeps it on the event loop.
    assert tokenizer.uncached_chars(body["prompt"], add_special_tokens=True) == (0, 0)


def test_affixes_that_depend_on_the_text_turn_the_shortcut_off(tokenizer: PromptTokenizer) -> None:
    class LengthDependentSuffix:
        """A post-processor that adds a token only after texts longer than 10 characters."""

        def __init__(self, inner):
            self.inner = inner

        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            ids = self.inner.encode(text, add_special_tokens=False)
            return [*ids, 1] if add_special_tokens and len(text) > 10 else ids

        def __getattr__(self, name: str):
            return getattr(self.inner, name)

    real = tokenizer.tokenizer
    tokenizer.tokenizer = LengthDependentSuffix(real)
    try:
        assert tokenizer._constant_special_affixes() is None
    finally:
        tokenizer.tokenizer = real

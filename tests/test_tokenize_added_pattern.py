"""The added-token regex (router/tokenize/prompt.py _added_tokens_pattern) writes the tokens' common
beginning once; it must find exactly what the plain alternation, longest token first, finds."""

from __future__ import annotations

import random
import re

import pytest

from router.config import builtin_tokenizer_dir
from router.tokenize.prompt import _added_tokens_pattern

TOKEN_SETS = [
    ["<a>", "<ab>", "<a", "<"],  # tokens that are prefixes of others, one equal to the common beginning
    ["<|im_start|>", "<|im_end|>", "<think>", "</think>"],
    ["[INST]", "[/INST]", "<s>", "</s>"],  # no common beginning
    ["ab", "abc", "a"],
    ["x"],
]


@pytest.mark.parametrize("added", TOKEN_SETS, ids=lambda added: "|".join(added))
def test_matches_are_those_of_the_plain_alternation(added: list[str]) -> None:
    plain = re.compile("|".join(re.escape(token) for token in sorted(added, key=len, reverse=True)))
    pattern = _added_tokens_pattern(added)
    assert pattern is not None
    rng = random.Random(0)
    alphabet = [*sorted(set("".join(added))), " ", "\n"]
    for _ in range(5000):
        length = rng.randrange(30)
        text = "".join(rng.choice(added if rng.random() < 0.4 else alphabet) for _ in range(length))
        assert [m.span() for m in pattern.finditer(text)] == [m.span() for m in plain.finditer(text)], text


def test_the_common_beginning_is_written_once() -> None:
    from transformers import AutoTokenizer

    added = list(AutoTokenizer.from_pretrained(builtin_tokenizer_dir("qwen3")).added_tokens_encoder)
    pattern = _added_tokens_pattern(added)
    assert pattern is not None and pattern.pattern.startswith("<(?:")
    assert _added_tokens_pattern([]) is None

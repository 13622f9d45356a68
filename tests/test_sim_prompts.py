"""The simulated engine tokenizes exactly as vLLM would, with the real Qwen3 tokenizer, and caches."""

from __future__ import annotations

import random

import pytest

from router.sim.prompts import PromptError, PromptTokenizer, resolve_tokenizer_dir


@pytest.fixture(scope="module")
def prompts() -> PromptTokenizer:
    return PromptTokenizer(resolve_tokenizer_dir("builtin:qwen3"))


def _whole(prompts: PromptTokenizer, messages: list[dict], **kwargs) -> list[int]:
    text = prompts.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, **kwargs
    )
    return prompts.tokenizer.encode(text, add_special_tokens=False)


def test_piecewise_chat_encoding_equals_encoding_the_whole_text(prompts):
    assert prompts._added_token_pattern is not None, "Qwen3 must take the fast piecewise path"
    rng = random.Random(3)
    pieces = [
        "cache",
        "naïve",
        "東京",
        " ",
        "\n",
        "<think>",
        "</think>",
        "x",
        "  ",
        "🙂",
        "<|im_end|>",
        "a1",
        "!!",
    ]
    roles = ["system", "user", "assistant", "user"]
    for _ in range(100):
        messages = [
            {"role": role, "content": "".join(rng.choice(pieces) for _ in range(rng.randint(0, 30)))}
            for role in roles[: rng.randint(1, 4)]
        ]
        assert prompts.chat_prompt(messages).tolist() == _whole(prompts, messages)


def test_the_light_tokenizer_matches_autotokenizer_as_vllm_loads_it(prompts):
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(resolve_tokenizer_dir("builtin:qwen3"))
    texts = [
        "Hello world",
        "  leading spaces\n\ttabs",
        "naïve café 東京 🙂",
        "<|im_start|>user\nhi<|im_end|>",
        "",
    ]
    for text in texts:
        assert prompts.completion_prompt(text).tolist() == reference(text)["input_ids"]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is a KV cache?"},
        {"role": "assistant", "content": "A store of attention keys and values."},
        {"role": "user", "content": "And prefix caching?"},
    ]
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    for kwargs in ({}, {"chat_template_kwargs": {"enable_thinking": False}}, {"tools": tools}):
        template_kwargs = kwargs.get("chat_template_kwargs", {})
        text = reference.apply_chat_template(
            messages, tools=kwargs.get("tools"), tokenize=False, add_generation_prompt=True, **template_kwargs
        )
        assert prompts.chat_prompt(messages, **kwargs).tolist() == reference.encode(
            text, add_special_tokens=False
        )


def test_chat_template_kwargs_and_text_parts_render_like_vllm(prompts):
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}
    ]
    flattened = [{"role": "user", "content": "one\ntwo"}]
    assert prompts.chat_prompt(messages).tolist() == _whole(prompts, flattened)
    no_thinking = prompts.chat_prompt(flattened, chat_template_kwargs={"enable_thinking": False}).tolist()
    assert no_thinking == _whole(prompts, flattened, enable_thinking=False)
    assert no_thinking != prompts.chat_prompt(flattened).tolist()


def test_completion_prompts_text_token_ids_and_batches_of_one(prompts):
    assert prompts.completion_prompt("Hello world").tolist() == prompts.tokenizer("Hello world")["input_ids"]
    assert prompts.completion_prompt([1, 2, 3]).tolist() == [1, 2, 3]
    assert (
        prompts.completion_prompt(["Hello world"]).tolist()
        == prompts.completion_prompt("Hello world").tolist()
    )
    with pytest.raises(PromptError, match="token ids must lie in"):
        prompts.completion_prompt([1, 10**9])
    with pytest.raises(PromptError, match="batch of exactly one"):
        prompts.completion_prompt(["a", "b"])


def test_bad_messages_say_what_is_wrong(prompts):
    with pytest.raises(PromptError, match="non-empty list"):
        prompts.chat_prompt([])
    with pytest.raises(PromptError, match=r"messages\[1\] must be an object with a `role`"):
        prompts.chat_prompt([{"role": "user", "content": "a"}, {"content": "b"}])
    with pytest.raises(PromptError, match="only text parts"):
        prompts.chat_prompt([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


def test_results_are_cached_and_read_only(prompts):
    messages = [{"role": "user", "content": "cache me"}]
    first = prompts.chat_prompt(messages)
    assert prompts.chat_prompt(messages) is first
    assert not first.flags.writeable


def test_output_tokens_decode_alone_as_their_text(prompts):
    vocabulary = prompts.output_vocabulary[:50].tolist()
    text = "".join(prompts.output_text(t) for t in vocabulary)
    assert prompts.tokenizer.decode(vocabulary) == text
    assert prompts.tokenizer.encode(text, add_special_tokens=False) == vocabulary

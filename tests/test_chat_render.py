"""The fast chat-template path (router/tokenize/render.py): the same text and tokens as transformers'
apply_chat_template on plain chats, by either engine; a diverging engine refused when the tokenizer
loads; everything that is not a plain chat rendered the general way. The parity runs on Qwen3's
template and on the Llama-3-style test tokenizer's, which starts with {{ bos_token }}."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from kvgate_testing.tokenizers import PARITY_TOKENIZERS, tokenizer_dir
from kvgate_testing.workloads import ChatSessionsParams, chat_sessions
from router.config import builtin_tokenizer_dir
from router.tokenize import PromptTokenizer, TokenizeError, render_chat
from router.tokenize.render import FastChatRenderer, render_plain_chat

WORDS = [
    "cache", "prefix", "  spaced", "token\n", "ünï", "中文", "\t", "end.", "KV", "<tag>", "  ", "😀",
    "<think>", "</think>", "\n\n", "{{ x }}", "{% if %}", "<|im_end|>", "<|im_start|>", "'quote'", '"dq"',
    "<|begin_of_text|>", "<|eot_id|>", "{{ bos_token }}",
]  # fmt: skip


@pytest.fixture(scope="module")
def qwen3() -> PromptTokenizer:
    return PromptTokenizer(builtin_tokenizer_dir("qwen3"))


def varied_bodies(count: int, seed: int) -> list[dict]:
    """Plain chats of every shape the fast path takes: roles (system, user, assistant, tool), names,
    reasoning markup, empty and non-ASCII contents, content parts, template variables, with and
    without the generation prompt."""
    rng = np.random.default_rng(seed)

    def text(size: int) -> str:
        return "".join(rng.choice(WORDS, size=size).tolist()) if size else ""

    bodies = []
    for number in range(count):
        messages: list[dict] = []
        if rng.random() < 0.6:
            messages.append({"role": "system", "content": text(int(rng.integers(0, 30)))})
        for turn in range(int(rng.integers(1, 6))):
            user: dict = {"role": "user", "content": text(int(rng.integers(0, 40)))}
            if rng.random() < 0.1:
                user["name"] = f"user{turn}"
            if rng.random() < 0.1:
                user["content"] = [{"type": "text", "text": text(5)}, {"type": "text", "text": text(3)}]
            messages.append(user)
            reply = text(int(rng.integers(0, 40)))
            if rng.random() < 0.4:
                reply = f"<think>\n{text(10)}\n</think>\n\n{reply}"
            messages.append({"role": "assistant", "content": reply})
            if rng.random() < 0.2:
                messages.append({"role": "tool", "content": text(8)})
        if rng.random() < 0.8:
            messages.append({"role": "user", "content": text(int(rng.integers(1, 20)))})
        body: dict = {"messages": messages}
        if number % 4 == 1:
            body["add_generation_prompt"] = False
        if number % 3 == 2:
            body["chat_template_kwargs"] = {"enable_thinking": bool(rng.random() < 0.5)}
        bodies.append(body)
    return bodies


def workload_bodies() -> list[dict]:
    workload = chat_sessions(ChatSessionsParams(users=8, turns=4, seed=3))
    return [{"messages": request.messages} for request in workload.requests]


def transformers_text(tokenizer: PromptTokenizer, body: dict) -> str:
    """What vLLM renders: apply_chat_template with the request's fields (content parts joined)."""
    messages = [
        {**m, "content": "\n".join(p["text"] for p in m["content"])} if isinstance(m["content"], list) else m
        for m in body["messages"]
    ]
    return tokenizer.tokenizer.apply_chat_template(
        messages,
        add_generation_prompt=body.get("add_generation_prompt", True),
        tokenize=False,
        **body.get("chat_template_kwargs", {}),
    )


@pytest.fixture(scope="module", params=PARITY_TOKENIZERS)
def tokenizer(request: pytest.FixtureRequest) -> PromptTokenizer:
    """Each parity tokenizer in turn (Qwen3, then the Llama-3-style BOS one)."""
    return PromptTokenizer(tokenizer_dir(request.param))


@pytest.mark.parametrize("engine", ["minijinja", "jinja2"])
def test_each_engine_renders_plain_chats_as_transformers_token_for_token(
    tokenizer: PromptTokenizer, engine: str
) -> None:
    renderer = FastChatRenderer(tokenizer.tokenizer, engines=(engine,))
    assert renderer.engine == engine
    tokenizer.fast_render, saved = renderer, tokenizer.fast_render
    try:
        for body in [*varied_bodies(120, seed=5), *workload_bodies()]:
            expected = transformers_text(tokenizer, body)
            # The fast path itself answered (not the general path behind it) ...
            assert render_plain_chat(tokenizer.fast_render, body) == expected
            # ... and the tokens the gateway routes by are the engine's.
            assert tokenizer.tokens_for(body).tolist() == tokenizer.tokenizer.encode(
                expected, add_special_tokens=False
            )
    finally:
        tokenizer.fast_render = saved


def test_the_gateway_uses_minijinja_for_the_qwen3_template(qwen3: PromptTokenizer) -> None:
    assert qwen3.fast_render.engine == "minijinja"


def test_an_engine_that_renders_a_probe_differently_is_not_used(
    qwen3: PromptTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = FastChatRenderer._minijinja

    def off_by_a_newline(self: FastChatRenderer, template: str):  # type: ignore[no-untyped-def]
        render = original(self, template)
        return lambda **variables: render(**variables) + "\n"

    monkeypatch.setattr(FastChatRenderer, "_minijinja", off_by_a_newline)
    assert FastChatRenderer(qwen3.tokenizer).engine == "jinja2"
    assert FastChatRenderer(qwen3.tokenizer, engines=("minijinja",)).engine == "off"


@pytest.mark.parametrize(
    "body",
    [
        {"messages": [{"role": "user", "content": "hi"}],
         "tools": [{"type": "function", "function": {"name": "f"}}]},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Par"}],
         "continue_final_message": True, "add_generation_prompt": False},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok",
                                                          "reasoning_content": "because"}]},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None,
                      "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}]},
        {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"messages": []}},
        {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"flags": [1]}},
        {"messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ messages[0].content }}"},
    ],
    ids=["tools", "continue-final", "reasoning-field", "tool-calls", "reserved-variable", "list-variable",
         "request-template"],
)  # fmt: skip
def test_requests_that_are_not_plain_chats_take_the_general_path(qwen3: PromptTokenizer, body: dict) -> None:
    assert render_plain_chat(qwen3.fast_render, body) is None


def test_a_template_that_raises_is_redone_the_general_way(qwen3: PromptTokenizer) -> None:
    tokenizer = copy.copy(qwen3.tokenizer)
    tokenizer.chat_template = (
        "{% if messages[0].role != 'system' %}"
        "{{ raise_exception('a system message comes first') }}{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    )
    renderer = FastChatRenderer(tokenizer)
    assert renderer.engine == "minijinja"
    with_system = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert (
        renderer.render(with_system, True, {})
        == "<|im_start|>system\ns<|im_end|>\n<|im_start|>user\nu<|im_end|>\n"
    )
    assert renderer.render(with_system[1:], True, {}) is None
    with pytest.raises(TokenizeError, match="a system message comes first"):
        render_chat(tokenizer, {"messages": with_system[1:]})

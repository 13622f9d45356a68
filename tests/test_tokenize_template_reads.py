"""Faster attribute reads in the chat template's sandbox: the sandbox's answers, the same text."""

from __future__ import annotations

import json

import jinja2
import numpy as np
import pytest
from jinja2.runtime import Undefined
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError
from transformers.utils.chat_template_utils import _compile_jinja_template

import router.tokenize.render as render_module
from router.config import builtin_tokenizer_dir
from router.tokenize import PromptTokenizer
from router.tokenize.render import _MemoizedAttributeCheck, _SandboxGetattr, _speed_up_sandbox_reads


@pytest.fixture(scope="module")
def qwen3() -> PromptTokenizer:
    return PromptTokenizer(builtin_tokenizer_dir("qwen3"))


def sped_up_environment() -> ImmutableSandboxedEnvironment:
    environment = ImmutableSandboxedEnvironment()
    assert _speed_up_sandbox_reads(environment)
    assert not _speed_up_sandbox_reads(environment)  # once
    return environment


class DictSubclass(dict):
    role = "from the class"


def same_read(left, right) -> bool:
    if isinstance(left, Undefined) or isinstance(right, Undefined):
        return type(left) is type(right) and left._undefined_name == right._undefined_name
    return left == right


def test_dict_reads_give_the_sandbox_answer() -> None:
    sandbox = ImmutableSandboxedEnvironment()
    reads = _SandboxGetattr(ImmutableSandboxedEnvironment())
    message = {"role": "user", "content": "hi", "items": "shadowed by the method", 3: "three"}
    cases = [
        (message, "role"), (message, "missing"), (message, "items"), (message, "get"), (message, "clear"),
        (message, "__class__"), (message, "_private"), (DictSubclass(role="key"), "role"),
        (DictSubclass(), "content"), ([1, 2], "append"), ("text", "split"), ("text", "nothing"),
    ]  # fmt: skip
    for obj, attribute in cases:
        assert same_read(reads(obj, attribute), sandbox.getattr(obj, attribute)), (obj, attribute)


def test_memoized_check_gives_the_sandbox_answer_and_asks_once_per_pair() -> None:
    sandbox = ImmutableSandboxedEnvironment()
    asked: list[tuple[type, str]] = []

    def counting(obj, attr, value):
        asked.append((type(obj), attr))
        return sandbox.is_safe_attribute(obj, attr, value)

    memo = _MemoizedAttributeCheck(counting)

    def function() -> None: ...

    cases = [
        ("text", "split"), ("text", "startswith"), ("text", "__class__"), ("text", "_private"),
        ({"a": 1}, "get"), ({"a": 1}, "clear"), ({"a": 1}, "update"), ({"a": 1}, "items"),
        ([1], "append"), ([1], "index"), ({1}, "add"), (function, "__globals__"), (str, "mro"),
    ]  # fmt: skip
    for _ in range(3):
        for obj, attr in cases:
            value = getattr(obj, attr, None)
            assert memo(obj, attr, value) == sandbox.is_safe_attribute(obj, attr, value), (obj, attr)
    assert len(asked) == len(cases)  # each pair asked once, answered from memory afterwards


@pytest.mark.parametrize(
    "template",
    [
        "{{ x.append(1) }}",
        "{% set _ = x.clear() %}",
        "{{ 'a'.__class__.__mro__ }}",
        "{{ f.__globals__.keys() }}",
    ],
)
def test_unsafe_reads_are_refused_every_time_with_the_shortcuts(template: str) -> None:
    environment = sped_up_environment()
    compiled = environment.from_string(template)
    for _ in range(3):
        with pytest.raises(SecurityError):
            compiled.render(x=[1, 2], f=same_read)


def test_memo_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(render_module, "ATTRIBUTE_CHECKS_MAX", 8)
    memo = _MemoizedAttributeCheck(ImmutableSandboxedEnvironment().is_safe_attribute)
    for index in range(50):
        assert memo("text", f"name{index}", None) is True
        assert memo([], "append", None) is False
    assert len(memo._answers) == 8


def random_conversation(rng: np.random.Generator) -> dict:
    words = ["cache", "  spaced", "line\n", "ünïcödé", "中文", "😀", "\t", "end.", "<tag>", "{{ x }}", "'q'"]

    def text(count: int) -> str:
        return "".join(rng.choice(words, size=count))

    messages: list[dict] = []
    if rng.random() < 0.6:
        messages.append({"role": "system", "content": text(12)})
    for turn in range(int(rng.integers(1, 5))):
        messages.append({"role": "user", "content": text(20) + f" {turn}?"})
        if rng.random() < 0.4:
            call = {"name": "lookup", "arguments": {"query": text(3), "n": int(rng.integers(9))}}
            tool_calls = [{"type": "function", "function": call}]
            messages.append({"role": "assistant", "content": "", "tool_calls": tool_calls})
            messages.append({"role": "tool", "content": json.dumps({"result": text(6)}, ensure_ascii=False)})
        assistant: dict = {"role": "assistant", "content": text(15)}
        if rng.random() < 0.3:
            assistant["reasoning_content"] = text(8)
        messages.append(assistant)
    messages.append({"role": "user", "content": text(10)})
    body: dict = {"messages": messages}
    if rng.random() < 0.4:
        body["tools"] = [
            {"type": "function", "function": {"name": "lookup", "description": text(4), "parameters": {
                "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}},
        ]  # fmt: skip
    if rng.random() < 0.3:
        body["chat_template_kwargs"] = {"enable_thinking": bool(rng.random() < 0.5)}
    return body


def test_qwen3_renders_and_tokenizes_identically_with_and_without_the_shortcuts(
    qwen3: PromptTokenizer,
) -> None:
    assert jinja2.__version__.startswith(render_module._FAST_READS_JINJA_SERIES)
    assert qwen3.template_reads_sped_up
    environment = _compile_jinja_template(qwen3.tokenizer.chat_template).environment
    memo, reads = vars(environment)["is_safe_attribute"], vars(environment)["getattr"]
    assert isinstance(memo, _MemoizedAttributeCheck) and isinstance(reads, _SandboxGetattr)
    rng = np.random.default_rng(25)
    bodies = [random_conversation(rng) for _ in range(60)]
    with_shortcuts = [qwen3.render_chat(body) for body in bodies]
    assert memo._answers  # the renders went through the shortcuts
    del environment.is_safe_attribute, environment.getattr  # the sandbox's own, on every read
    try:
        without_shortcuts = [qwen3.render_chat(body) for body in bodies]
    finally:
        environment.is_safe_attribute, environment.getattr = memo, reads
    assert with_shortcuts == without_shortcuts
    for body, text in zip(bodies, without_shortcuts, strict=True):
        whole = qwen3.tokenizer.encode(text, add_special_tokens=False)
        assert qwen3.tokens_for(body).tolist() == whole

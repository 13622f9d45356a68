"""router/api_formats.py: Responses and Anthropic Messages bodies read as the chat vLLM renders for
them, the gateway's tokens for them equal to the simulated engine's, and hostile bodies refused with
ApiFormatError (never another exception, which would be a 500 on the gateway's request path)."""

from __future__ import annotations

import json
import random

import pytest
from transformers import AutoTokenizer

from router.api_formats import ApiFormatError, messages_as_chat, responses_as_chat
from router.config import builtin_tokenizer_dir
from router.sim.prompts import PromptTokenizer as SimTokenizer
from router.tokenize import PromptTokenizer as GatewayTokenizer

PARAMETERS = {"type": "object", "properties": {"word": {"type": "string"}}}
TOOL = {"type": "function", "name": "lookup", "description": "Look a word up.", "parameters": PARAMETERS}
ANTHROPIC_TOOL = {"name": "lookup", "description": "Look a word up.", "input_schema": TOOL["parameters"]}


def test_responses_input_items_read_as_vllm_reads_them():
    body = {
        "instructions": "Be terse.",
        "input": [
            {
                "role": "user",
                "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}],
            },
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "hm"}],
            },
            {"type": "function_call", "call_id": "call_1", "name": "lookup", "arguments": '{"word": "x"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "found"},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "It is x."}],
            },
            {"type": "message", "role": "developer", "content": "Now in French."},
        ],
        "tools": [TOOL, {"type": "web_search"}],
        "reasoning": {"effort": "low"},
    }
    chat = responses_as_chat(body)
    call = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": '{"word": "x"}'}}
    assert chat["messages"] == [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        # The function call joins the assistant message its reasoning opened.
        {"role": "assistant", "reasoning": "hm", "tool_calls": [call], "content": ""},
        {"role": "tool", "content": "found", "tool_call_id": "call_1"},
        {"role": "assistant", "content": "It is x."},
        {"role": "developer", "content": "Now in French."},
    ]
    assert chat["add_generation_prompt"] is True and chat["continue_final_message"] is False
    assert chat["tools"] == [{"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}]
    assert chat["chat_template_kwargs"] == {"reasoning_effort": "low"}
    assert responses_as_chat({"input": "hello"})["messages"] == [{"role": "user", "content": "hello"}]


def test_a_final_incomplete_assistant_item_is_continued():
    partial = {"type": "message", "role": "assistant", "status": "incomplete", "content": "1, 2,"}
    body = {"input": [{"role": "user", "content": "Count"}, partial]}
    chat = responses_as_chat(body)
    assert chat["continue_final_message"] is True and chat["add_generation_prompt"] is False


def test_anthropic_blocks_read_as_vllm_reads_them():
    body = {
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: abc123"},
            {"type": "text", "text": "Be terse."},
        ],
        "messages": [
            {"role": "system", "content": " Always."},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hm", "signature": "s"},
                    {"type": "text", "text": "Looking."},
                    {"type": "tool_use", "id": "tu_1", "name": "lookup", "input": {"word": "x"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "tu_1",
                        "content": [{"type": "text", "text": "found"}],
                    },
                ],
            },
        ],
        "tools": [ANTHROPIC_TOOL],
    }
    chat = messages_as_chat(body)
    call = {
        "id": "tu_1",
        "type": "function",
        "function": {"name": "lookup", "arguments": json.dumps({"word": "x"})},
    }
    assert chat["messages"] == [
        # The billing header (a per-request hash) dropped, system messages moved into the system text.
        {"role": "system", "content": "Be terse. Always."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "reasoning": "hm", "tool_calls": [call], "content": "Looking."},
        # A user message of tool results only becomes the tool messages, and no user message.
        {"role": "tool", "tool_call_id": "tu_1", "content": "found"},
    ]
    function = {"name": "lookup", "description": "Look a word up.", "parameters": TOOL["parameters"]}
    assert chat["tools"] == [{"type": "function", "function": function}]


@pytest.fixture(scope="module")
def tokenizers():
    directory = builtin_tokenizer_dir("qwen3")
    return GatewayTokenizer(directory), SimTokenizer(directory), AutoTokenizer.from_pretrained(directory)


LOOKUP_CALL = {"type": "function_call", "call_id": "c", "name": "lookup", "arguments": "{}"}
TOOL_USE = {"type": "tool_use", "id": "t", "name": "lookup", "input": {}}
TOOL_RESULT = {"type": "tool_result", "tool_use_id": "t", "content": "ok"}
PARITY_CASES = {
    "responses text": (responses_as_chat, {"instructions": "Be terse.", "input": "What is a token?"}),
    "responses tools": (
        responses_as_chat,
        {
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
                LOOKUP_CALL,
                {"type": "function_call_output", "call_id": "c", "output": "none"},
            ],
            "tools": [TOOL],
        },
    ),
    "messages turns": (
        messages_as_chat,
        {
            "system": "Be terse.",
            "messages": [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"},
                {"role": "user", "content": "Again"},
            ],
        },
    ),
    "messages tools": (
        messages_as_chat,
        {
            "messages": [
                {"role": "user", "content": "Look up x"},
                {"role": "assistant", "content": [TOOL_USE]},
                {"role": "user", "content": [TOOL_RESULT]},
            ],
            "tools": [ANTHROPIC_TOOL],
        },
    ),
}


@pytest.mark.parametrize(("read", "body"), PARITY_CASES.values(), ids=PARITY_CASES.keys())
def test_the_gateway_tokenizes_them_as_the_engine_does(tokenizers, read, body):
    gateway, sim, reference = tokenizers
    chat = read(body)
    engine_tokens = sim.chat_prompt(
        chat["messages"],
        add_generation_prompt=chat.get("add_generation_prompt", True),
        continue_final_message=chat.get("continue_final_message", False),
        tools=chat.get("tools"),
        chat_template_kwargs=chat.get("chat_template_kwargs"),
    )
    assert gateway.tokens_for(chat).tolist() == engine_tokens.tolist()
    # transformers on the messages with text parts joined by newlines (vLLM's string content format).
    flat = [
        {**m, "content": "\n".join(part["text"] for part in m["content"])}
        if isinstance(m["content"], list)
        else m
        for m in chat["messages"]
    ]
    text = reference.apply_chat_template(
        flat, tools=chat.get("tools"), tokenize=False, add_generation_prompt=True
    )
    assert engine_tokens.tolist() == reference.encode(text, add_special_tokens=False)


VALID_RESPONSES = {
    "instructions": "Be terse.",
    "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "a"}]},
        LOOKUP_CALL,
        {"type": "function_call_output", "call_id": "c", "output": "ok"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "s"}]},
    ],
    "tools": [TOOL],
}
VALID_MESSAGES = {
    "system": [{"type": "text", "text": "Be terse."}],
    "messages": [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "a"},
                {"type": "image", "source": {"type": "url", "url": "u"}},
            ],
        },
        {"role": "assistant", "content": [TOOL_USE]},
        {"role": "user", "content": [TOOL_RESULT]},
    ],
    "tools": [ANTHROPIC_TOOL],
}
HOSTILE_VALUES = [None, 0, -1, 3.5, True, "", "x", [], [None], [1, 2], {}, {"type": None}, {"text": 5}]


def _mutants(value, rng: random.Random, count: int):
    """`count` copies of `value`, each with one nested value replaced by a hostile one."""
    paths: list[tuple] = []

    def walk(node, path):
        paths.append(path)
        if isinstance(node, dict):
            for key, child in node.items():
                walk(child, (*path, key))
        elif isinstance(node, list):
            for index, child in enumerate(node):
                walk(child, (*path, index))

    walk(value, ())
    for _ in range(count):
        mutant = json.loads(json.dumps(value))
        path = rng.choice(paths[1:])
        parent = mutant
        for step in path[:-1]:
            parent = parent[step]
        parent[path[-1]] = rng.choice(HOSTILE_VALUES)
        yield mutant


@pytest.mark.parametrize(
    ("read", "body"), [(responses_as_chat, VALID_RESPONSES), (messages_as_chat, VALID_MESSAGES)]
)
def test_hostile_bodies_are_read_or_refused_with_api_format_error(tokenizers, read, body):
    gateway, sim, _ = tokenizers
    rng = random.Random(35)
    read(body)  # the unmutated body reads
    refused = 0
    for mutant in _mutants(body, rng, 400):
        try:
            chat = read(mutant)
        except ApiFormatError as exc:
            refused += 1
            assert exc.param and str(exc)
            continue
        # What reads must be something the gateway's tokenizer and the simulated engine's take or
        # refuse cleanly (TokenizeError, PromptError: the request's fault, never a 500).
        try:
            gateway.tokens_for(chat)
        except Exception as exc:
            assert type(exc).__name__ == "TokenizeError", (mutant, exc)
        try:
            sim.chat_prompt(
                chat["messages"],
                tools=chat.get("tools"),
                chat_template_kwargs=chat.get("chat_template_kwargs"),
            )
        except Exception as exc:
            assert type(exc).__name__ == "PromptError", (mutant, exc)
    assert refused > 0

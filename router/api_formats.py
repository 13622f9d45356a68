"""The Responses API (/v1/responses) and Anthropic Messages API (/v1/messages) request bodies read as
the chat request vLLM renders for them, for the gateway's router and the simulated engine alike.

vLLM serves both by turning the request into chat messages and applying the model's chat template,
as for /v1/chat/completions; what it renders is what the engine caches, so it is what the gateway
routes by. The readings here follow vLLM's (vllm/entrypoints/openai/responses/utils.py,
construct_input_messages; vllm/entrypoints/anthropic/serving.py, _convert_anthropic_to_openai_request):

- Responses: `instructions` is a first system message; `input` a string (one user message) or a list
  of items: messages ({role, content}; content a string or parts, `input_text`/`output_text` parts
  read as text), `function_call` (an assistant tool call, merged into the assistant message before
  it), `function_call_output` (a tool message), `reasoning` (the assistant's reasoning). A final
  message or reasoning item whose status is `in_progress` or `incomplete` is continued instead of
  answered. `tools` of type function become chat tools; `reasoning.effort` is a template variable.
- Messages: `system` (a string or text blocks, with any `role: "system"` messages moved into it) is
  a first system message, its texts joined; each message's blocks become chat content: text (one
  text block: a plain string), images, `thinking` (reasoning), `tool_use` (tool calls, arguments as
  JSON), `tool_result` in a user message (a tool message before it). `tools` become chat tools.

A message left without content (tool calls or reasoning only) gets an empty text, as vLLM's string
content format renders it. A body that does not have the API's shape raises ApiFormatError, naming
the field; the gateway then routes it by load (the engine answers the 400), the simulated engine
answers the 400 itself.
"""

from __future__ import annotations

import json
from typing import Any

from router.errors import KvgateError

# The roles each API's messages may carry (the Responses API's EasyInputMessage; Anthropic's
# MessageParam, plus the system messages vLLM moves into `system`).
RESPONSES_ROLES = frozenset(("user", "assistant", "system", "developer"))
ANTHROPIC_ROLES = frozenset(("user", "assistant", "system"))
# Responses content parts that vLLM reads as text (its parser maps them to plain text parts).
_RESPONSES_TEXT_PARTS = frozenset(("input_text", "output_text", "text"))
# Claude Code's attribution header: a per-request hash in the system prompt, which vLLM drops so the
# prompt stays cacheable.
_BILLING_HEADER = "x-anthropic-billing-header"
_ANTHROPIC_BLOCK_TYPES = frozenset(
    ("text", "image", "tool_use", "tool_result", "tool_reference", "thinking", "redacted_thinking")
)


class ApiFormatError(KvgateError, ValueError):
    """A request body without the API's shape; `param` is the field's location, dotted as vLLM's
    error `param` writes it (`messages.0.role`)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


# ---- Responses API ----


def responses_as_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The chat request (`messages`, `add_generation_prompt`, `continue_final_message`, `tools`,
    `chat_template_kwargs`, `cache_salt`) vLLM renders for a /v1/responses body."""
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise ApiFormatError("`instructions` must be a string", "instructions")
    if instructions:
        messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    continue_final = False
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
    elif isinstance(items, list) and items:
        for index, item in enumerate(items):
            _add_responses_item(item, index, messages)
        last = items[-1]
        continue_final = last.get("type", "message") in ("message", "reasoning") and last.get("status") in (
            "in_progress",
            "incomplete",
        )
    else:
        raise ApiFormatError("`input` must be a string or a non-empty list of input items", "input")
    chat: dict[str, Any] = {
        "messages": _with_contents(messages),
        "add_generation_prompt": not continue_final,
        "continue_final_message": continue_final,
    }
    tools = _responses_tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    variables = _template_variables(body)
    reasoning = body.get("reasoning")
    effort = reasoning.get("effort") if isinstance(reasoning, dict) else None
    if effort is not None:
        variables["reasoning_effort"] = effort
    if variables:
        chat["chat_template_kwargs"] = variables
    if "cache_salt" in body:
        chat["cache_salt"] = body["cache_salt"]
    return chat


def _add_responses_item(item: Any, index: int, messages: list[dict[str, Any]]) -> None:
    where, at = f"input[{index}]", f"input.{index}"
    if not isinstance(item, dict):
        raise ApiFormatError(f"`{where}` must be an object (a message or an item)", at)
    kind = item.get("type", "message")
    previous = messages[-1] if messages and messages[-1].get("role") == "assistant" else None
    if kind == "message":
        role = item.get("role")
        if not _one_of(role, RESPONSES_ROLES):
            roles = ", ".join(sorted(RESPONSES_ROLES))
            raise ApiFormatError(f"`{where}.role` must be one of {roles}, got {role!r}", f"{at}.role")
        content = item.get("content")
        if not isinstance(content, str | list):
            raise ApiFormatError(f"`{where}.content` must be a string or a list of parts", f"{at}.content")
        if isinstance(content, list):
            for number, part in enumerate(content):
                if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                    raise ApiFormatError(
                        f"`{where}.content[{number}]` must be a part object with a `type`",
                        f"{at}.content.{number}",
                    )
                if part["type"] in _RESPONSES_TEXT_PARTS and not isinstance(part.get("text"), str):
                    raise ApiFormatError(
                        f"`{where}.content[{number}].text` must be a string", f"{at}.content.{number}.text"
                    )
        if role == "assistant":
            # vLLM keeps an assistant item's first part only, as plain text.
            if isinstance(content, list):
                first = content[0] if content else {}
                content = first.get("text") if isinstance(first.get("text"), str) else ""
            if previous is not None and previous.get("content") is None:
                previous["content"] = content
                return
            messages.append({"role": "assistant", "content": content})
            return
        messages.append({"role": role, "content": _responses_content(content)})
    elif kind == "function_call":
        name, arguments = item.get("name"), item.get("arguments")
        if not isinstance(name, str) or not isinstance(arguments, str):
            raise ApiFormatError(f"`{where}` (a function_call) needs `name` and `arguments` strings", at)
        call = {
            "id": item.get("call_id"),
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }
        if previous is not None:
            previous.setdefault("tool_calls", []).append(call)
            return
        messages.append({"role": "assistant", "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item.get("output")
        if not isinstance(output, str | list):
            raise ApiFormatError(f"`{where}.output` must be a string or a list of parts", f"{at}.output")
        messages.append({"role": "tool", "content": output, "tool_call_id": item.get("call_id")})
    elif kind == "reasoning":
        text = ""
        for field in ("content", "summary"):
            parts = item.get(field)
            if isinstance(parts, list) and parts and isinstance(parts[0], dict):
                text = parts[0].get("text", "")
                break
        if not isinstance(text, str):
            raise ApiFormatError(f"`{where}` (a reasoning item) must hold text strings", at)
        if previous is not None and previous.get("reasoning") is None:
            previous["reasoning"] = text
            return
        messages.append({"role": "assistant", "reasoning": text})
    else:
        raise ApiFormatError(f"`{where}.type` {kind!r} is not an input item vLLM renders", f"{at}.type")


def _responses_content(content: str | list) -> str | list:
    """Text parts of Responses input (`input_text`) as the chat's text parts; others kept as given."""
    if isinstance(content, str):
        return content
    return [
        {"type": "text", "text": part.get("text", "")} if part.get("type") in _RESPONSES_TEXT_PARTS else part
        for part in content
    ]


def _responses_tools(tools: Any) -> list[dict[str, Any]]:
    """Responses function tools ({type, name, description, parameters}) as chat tools."""
    if not isinstance(tools, list):
        return []
    functions = [tool for tool in tools if isinstance(tool, dict) and tool.get("type") == "function"]
    for tool in functions:
        if not isinstance(tool.get("name"), str):
            raise ApiFormatError("every function tool needs a `name` string", "tools")
    return [
        {"type": "function", "function": {key: value for key, value in tool.items() if key != "type"}}
        for tool in functions
    ]


# ---- Anthropic Messages API ----


def messages_as_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The chat request (`messages`, `tools`, `chat_template_kwargs`, `cache_salt`) vLLM renders for
    a /v1/messages body."""
    items = body.get("messages")
    if not isinstance(items, list):
        raise ApiFormatError("`messages` must be a list of {role, content} messages", "messages")
    for index, message in enumerate(items):
        where, at = f"messages[{index}]", f"messages.{index}"
        if not isinstance(message, dict):
            raise ApiFormatError(f"`{where}` must be an object with `role` and `content`", at)
        role = message.get("role")
        if not _one_of(role, ANTHROPIC_ROLES):
            roles = ", ".join(sorted(ANTHROPIC_ROLES - {"system"}))
            raise ApiFormatError(f"`{where}.role` must be one of {roles}, got {role!r}", f"{at}.role")
        content = message.get("content")
        if isinstance(content, list):
            for number, block in enumerate(content):
                if not isinstance(block, dict) or not _one_of(block.get("type"), _ANTHROPIC_BLOCK_TYPES):
                    raise ApiFormatError(
                        f"`{where}.content[{number}]` must be a content block of a known `type`",
                        f"{at}.content.{number}",
                    )
                wrong = _wrong_block_field(block)
                if wrong is not None:
                    raise ApiFormatError(
                        f"`{where}.content[{number}].{wrong}` has the wrong type for a {block['type']} block",
                        f"{at}.content.{number}.{wrong}",
                    )
        elif not isinstance(content, str):
            raise ApiFormatError(f"`{where}.content` must be a string or a list of blocks", f"{at}.content")
    messages: list[dict[str, Any]] = []
    system = _anthropic_system(body.get("system"), items)
    if system:
        messages.append({"role": "system", "content": system})
    for message in items:
        if message["role"] == "system":
            continue
        converted: dict[str, Any] = {"role": message["role"]}
        content = message["content"]
        if isinstance(content, str):
            converted["content"] = content
        else:
            _convert_blocks(content, converted, messages)
        if message["role"] != "user" or "content" in converted:
            messages.append(converted)
    chat: dict[str, Any] = {"messages": _with_contents(messages)}
    tools = body.get("tools")
    if tools is not None and (
        not isinstance(tools, list)
        or not all(isinstance(tool, dict) and isinstance(tool.get("name"), str) for tool in tools)
    ):
        raise ApiFormatError("`tools` must be a list of tools, each with a `name` string", "tools")
    if tools:
        chat["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": tool.get("name"),
                    "description": tool.get("description"),
                    "parameters": tool.get("input_schema"),
                },
            }
            for tool in tools
        ]
    variables = _template_variables(body)
    if variables:
        chat["chat_template_kwargs"] = variables
    if "cache_salt" in body:  # vLLM's Anthropic request takes it as its chat request does
        chat["cache_salt"] = body["cache_salt"]
    return chat


# The block fields the conversion reads, and the types vLLM's AnthropicContentBlock gives them.
_BLOCK_FIELD_TYPES: dict[str, type | tuple[type, ...]] = {
    "text": str,
    "thinking": str,
    "name": str,
    "id": str,
    "tool_use_id": str,
    "input": dict,
    "source": dict,
    "content": (str, list),
}


def _wrong_block_field(block: dict[str, Any]) -> str | None:
    """The first field of `block` (when present and not null) whose type vLLM's schema refuses."""
    for name, kinds in _BLOCK_FIELD_TYPES.items():
        value = block.get(name)
        if value is not None and not isinstance(value, kinds):
            return name
    return None


def _anthropic_system(system: Any, items: list[dict[str, Any]]) -> str:
    """The system prompt: top-level `system` (a string or text blocks) and `role: "system"` messages."""
    parts: list[str] = []
    sources: list[Any] = [system] + [m.get("content") for m in items if m.get("role") == "system"]
    for source in sources:
        if isinstance(source, str):
            parts.append(source)
        elif isinstance(source, list):
            for block in source:
                text = block.get("text") if isinstance(block, dict) and block.get("type") == "text" else None
                if isinstance(text, str) and text and not text.startswith(_BILLING_HEADER):
                    parts.append(text)
        elif source is not None:
            raise ApiFormatError("`system` must be a string or a list of text blocks", "system")
    return "".join(parts)


def _convert_blocks(blocks: list[dict[str, Any]], converted: dict[str, Any], messages: list[dict]) -> None:
    parts: list[dict[str, Any]] = []
    tool_calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for block in blocks:
        kind = block["type"]
        if kind == "text" and block.get("text"):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image" and isinstance(block.get("source"), dict):
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block["source"])}})
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            reasoning.append(block["thinking"])
        elif kind == "tool_use":
            arguments = json.dumps(block.get("input") or {})
            function = {"name": block.get("name") or "", "arguments": arguments}
            tool_calls.append({"id": block.get("id"), "type": "function", "function": function})
        elif kind == "tool_result":
            if converted["role"] == "user":
                messages.append(_tool_message(block))
            else:
                result = block.get("content")
                parts.append({"type": "text", "text": f"Tool result: {result if result else ''}"})
    if reasoning:
        converted["reasoning"] = "".join(reasoning)
    if tool_calls:
        converted["tool_calls"] = tool_calls
    if parts:
        single_text = len(parts) == 1 and parts[0]["type"] == "text"
        converted["content"] = parts[0]["text"] if single_text else parts


def _tool_message(block: dict[str, Any]) -> dict[str, Any]:
    content = block.get("content")
    if isinstance(content, list):
        content = "\n".join(
            item.get("text", "") for item in content if isinstance(item, dict) and item.get("type") == "text"
        )
    return {"role": "tool", "tool_call_id": block.get("tool_use_id") or "", "content": content or ""}


def _image_url(source: dict[str, Any]) -> str:
    if source.get("type") == "url":
        return str(source.get("url", ""))
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"


def _with_contents(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every message with a `content`: vLLM's string content format renders a message that has none
    (an assistant turn of tool calls or reasoning only) with an empty text, and templates read it."""
    for message in messages:
        if message.get("content") is None:
            message["content"] = ""
    return messages


def _one_of(value: Any, allowed: frozenset[str]) -> bool:
    # A set lookup of an unhashable JSON value (a list, an object) would raise TypeError.
    return isinstance(value, str) and value in allowed


def _template_variables(body: dict[str, Any]) -> dict[str, Any]:
    variables = body.get("chat_template_kwargs")
    if variables is None:
        return {}
    if not isinstance(variables, dict):
        raise ApiFormatError("`chat_template_kwargs` must be an object", "chat_template_kwargs")
    return dict(variables)

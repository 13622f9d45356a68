"""What a request body asks to be tokenized: its messages, its prompt, or its token ids, read the way
vLLM reads them.

A chat's list contents become their text parts joined by newlines (vLLM's "string" content format),
a completion's prompt is a string, a list of token ids or a batch of those (routed by the first),
and a chat may bring its own template (`chat_template_kwargs.chat_template` or `chat_template`).
Whatever the body holds that cannot be read so raises TokenizeError: the request is then routed
without tokens.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from router.errors import KvgateError

# Token ids converted per step (the conversion holds the GIL; see as_tokens).
_TOKEN_ID_CHUNK = 65536


class TokenizeError(KvgateError, ValueError):
    """The request cannot be tokenized (bad messages, a template error, an unusable prompt)."""


def request_chat_template(body: dict[str, Any]) -> str | None:
    """The chat template a request brings itself (inside `chat_template_kwargs`, else top-level), if any."""
    kwargs = body.get("chat_template_kwargs")
    template = kwargs.get("chat_template") if isinstance(kwargs, dict) else None
    if template is None:
        template = body.get("chat_template")
    if template is not None and not isinstance(template, str):
        raise TokenizeError("`chat_template` must be a string")
    return template


# Content parts vLLM reads as text: chat's own, and the Responses API's (which chat accepts too).
_TEXT_PART_TYPES = frozenset(("text", "input_text", "output_text"))


def flatten_content(message: Any) -> Any:
    """vLLM's "string" content format: a list of text parts becomes their texts joined by newlines."""
    if not isinstance(message, dict):
        raise TokenizeError("every message must be an object")
    content = message.get("content")
    if isinstance(content, list):
        texts = [
            part.get("text", "")
            for part in content
            if isinstance(part, dict) and part.get("type") in _TEXT_PART_TYPES
        ]
        return {**message, "content": "\n".join(texts)}
    return message


def as_tokens(ids: list[Any]) -> np.ndarray:
    """A token-id prompt as uint32 tokens; ids that are not non-negative 32-bit integers raise."""
    # By chunks: the conversion holds the GIL, so a long list in the tokenizer thread must let the
    # event loop in between.
    chunks = []
    for start in range(0, len(ids), _TOKEN_ID_CHUNK):
        chunk = ids[start : start + _TOKEN_ID_CHUNK]
        if not all(isinstance(token, int) and 0 <= token < 2**32 for token in chunk):
            raise TokenizeError("token-id prompts must hold non-negative integers")
        chunks.append(np.asarray(chunk, dtype=np.uint32))
    if len(chunks) == 1:
        return chunks[0]
    return np.concatenate(chunks) if chunks else np.empty(0, dtype=np.uint32)


def text_size(body: dict[str, Any]) -> int:
    """Characters of the prompt's plain text: string contents of the messages, or a string prompt."""
    messages = body.get("messages")
    if isinstance(messages, list):
        return sum(
            len(content)
            for message in messages
            if isinstance(message, dict) and isinstance(content := message.get("content"), str)
        )
    prompt = body.get("prompt")
    return len(prompt) if isinstance(prompt, str) else 0


def completion_prompt(body: dict[str, Any]) -> tuple[str, bool] | np.ndarray:
    """A completion's prompt: its text and whether special tokens are added (vLLM's default for
    /v1/completions: yes, unless `add_special_tokens` says otherwise), or its tokens where it is
    given as token ids."""
    prompt = body["prompt"]
    add_special = body.get("add_special_tokens", True)
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, int):
            return as_tokens(prompt)
        # A batch of prompts: route by the first (the engine caches each).
        if isinstance(first, list):
            return as_tokens(first)
        prompt = first
    if not isinstance(prompt, str):
        raise TokenizeError("`prompt` must be a string, a list of token ids, or a list of those")
    return prompt, bool(add_special)

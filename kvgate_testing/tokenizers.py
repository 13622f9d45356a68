"""The gateway's tokenizers under test: the tokens vLLM computes for a chat, a one-model config on
the built-in Qwen3 tokenizer, and on which thread a request's text was encoded."""

from __future__ import annotations

import asyncio
import threading

import numpy as np

from router.config import parse_config
from router.policies.base import RouteRequest
from router.tokenize import PromptTokenizer, RequestTokenizer


def whole_prompt_tokens(tokenizer: PromptTokenizer, body: dict) -> list[int]:
    """What vLLM computes: the template rendered to text, the text encoded without special tokens."""
    text = tokenizer.tokenizer.apply_chat_template(
        body["messages"],
        tools=body.get("tools"),
        add_generation_prompt=body.get(
            "add_generation_prompt", not body.get("continue_final_message", False)
        ),
        continue_final_message=body.get("continue_final_message", False),
        tokenize=False,
        **body.get("chat_template_kwargs", {}),
    )
    return tokenizer.tokenizer.encode(text, add_special_tokens=False)


def config(tokenize: str = "local"):
    """A gateway config: one model, "qwen", on the built-in Qwen3 tokenizer, tokenizing `tokenize`."""
    return parse_config(
        {
            "models": [{"name": "qwen", "tokenizer": "builtin:qwen3", "tokenize": tokenize}],
            "backends": [{"name": "b1", "url": "http://127.0.0.1:9"}],
        }
    )


def encode_threads(tokenizer: RequestTokenizer, bodies: list[dict]) -> list[bool]:
    """Per body, prepared one after another: whether its text was encoded off the event loop."""
    prompt_tokenizer = tokenizer.tokenizer("qwen")
    assert prompt_tokenizer is not None
    original = prompt_tokenizer.encode_text
    off_loop: list[bool] = []

    def recording(text: str, *, add_special_tokens: bool) -> np.ndarray:
        off_loop.append(threading.get_ident() != loop_thread)
        return original(text, add_special_tokens=add_special_tokens)

    prompt_tokenizer.encode_text = recording  # type: ignore[method-assign]
    loop_thread = threading.get_ident()

    async def run() -> None:
        for body in bodies:
            request = RouteRequest(request_id="r1", model="qwen", body=body)
            await tokenizer.prepare(request)
            assert request.tokens is not None
            assert request.tokens.tolist() == whole_prompt_tokens(prompt_tokenizer, body)
        await tokenizer.close()

    asyncio.run(run())
    return off_loop

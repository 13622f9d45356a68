"""The gateway's tokenizers under test: the tokenizers the parity tests run on (Qwen3's, which adds
no BOS token, and a small Llama-3-style one that does), the tokens vLLM computes for a chat and a
completion, a one-model config, and on which thread a request's text was encoded."""

from __future__ import annotations

import asyncio
import threading

import numpy as np

from kvgate_testing.processes import REPO_ROOT
from router.config import builtin_tokenizer_dir, parse_config
from router.policies.base import RouteRequest
from router.tokenize import PromptTokenizer, RequestTokenizer

# Built by scripts/build_bos_tokenizer.py: byte-level BPE, Llama 3's split regex and special tokens,
# a post-processor that adds <|begin_of_text|>, a chat template that starts with {{ bos_token }}.
BOS_TOKENIZER_DIR = REPO_ROOT / "tests" / "data" / "bos_tokenizer"
# The parity tests' tokenizers, by the name their test ids carry.
PARITY_TOKENIZERS = ("qwen3", "bos")


def tokenizer_dir(name: str) -> str:
    """The directory of a parity tokenizer: "qwen3" (built in) or "bos" (tests/data)."""
    return str(BOS_TOKENIZER_DIR) if name == "bos" else builtin_tokenizer_dir(name)


def whole_prompt_tokens(tokenizer: PromptTokenizer, body: dict) -> list[int]:
    """What vLLM computes for /v1/chat/completions: the template rendered to text, the text encoded
    without special tokens (the template writes any BOS itself), unless the body's
    `add_special_tokens` asks for them on top (vLLM's ChatCompletionRequest, default false)."""
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
    return tokenizer.tokenizer.encode(text, add_special_tokens=bool(body.get("add_special_tokens", False)))


def completion_tokens(tokenizer: PromptTokenizer, body: dict) -> list[int]:
    """What vLLM computes for /v1/completions: the prompt encoded with the tokenizer's special tokens
    (a BOS where the tokenizer adds one) unless the body's `add_special_tokens` says otherwise."""
    return tokenizer.tokenizer.encode(body["prompt"], add_special_tokens=body.get("add_special_tokens", True))


def config(tokenize: str = "local", tokenizer: str = "qwen3"):
    """A gateway config: one model, "qwen", on parity tokenizer `tokenizer` (the built-in Qwen3 one
    by default), tokenizing `tokenize`."""
    source = "builtin:qwen3" if tokenizer == "qwen3" else tokenizer_dir(tokenizer)
    return parse_config(
        {
            "models": [{"name": "qwen", "tokenizer": source, "tokenize": tokenize}],
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

"""Prompt tokens exactly as the engine will see them, cached per message, long ones off the event loop.

One file per concept:
- messages.py: what a request body asks to be tokenized (messages, prompt, token ids) and
  TokenizeError, raised where it cannot be;
- render.py: a chat's prompt text, the chat template rendered as vLLM renders it (and the fast
  renderer for plain chats);
- caches.py: the piece cache, the cut memory and the prompt memory, what earlier requests leave
  for later ones;
- ascii.py: pure-ASCII text encoded without the Rust tokenizer's regex engine (the ASCII fast path;
  its split in C is router/_ascii_split.pyx);
- prompt.py: PromptTokenizer, one model's tokenizer, encoding a prompt by pieces and segments;
- engine.py: the tokens asked of an engine's POST /tokenize (`tokenize: engine`);
- request.py: RequestTokenizer, the gateway's pre-route step, and where its work runs.

The rest of the gateway imports the names below from `router.tokenize`.
"""

from router.tokenize.messages import TokenizeError, request_chat_template
from router.tokenize.prompt import PromptTokenizer
from router.tokenize.render import render_chat
from router.tokenize.request import (
    OFF_LOOP_MIN_ASCII_CHARS,
    OFF_LOOP_MIN_CHARS,
    OFF_LOOP_TIMEOUT_S,
    ROUTING_MAX_BODY_BYTES,
    ROUTING_MAX_TOKENS,
    RequestTokenizer,
)

__all__ = [
    "OFF_LOOP_MIN_ASCII_CHARS",
    "OFF_LOOP_MIN_CHARS",
    "OFF_LOOP_TIMEOUT_S",
    "ROUTING_MAX_BODY_BYTES",
    "ROUTING_MAX_TOKENS",
    "PromptTokenizer",
    "RequestTokenizer",
    "TokenizeError",
    "render_chat",
    "request_chat_template",
]

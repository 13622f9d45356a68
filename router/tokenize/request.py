"""The gateway's pre-route step: each request's prompt tokens for the policies that route by them,
from the model's tokenizer in this process or from an engine, without stalling the event loop.

`RequestTokenizer.prepare` fills RouteRequest.tokens (None when the prompt cannot be tokenized: the
request is then routed by load) and .namespace. A model with `tokenize: local` is tokenized by its
PromptTokenizer (router/tokenize/prompt.py), a request's own chat template rendered in the model's
template sandbox (router/template_sandbox.py); `tokenize: engine` asks a backend's POST /tokenize
(router/tokenize/engine.py). Where the work runs (on the loop or in the tokenizer thread): see
OFF_LOOP_MIN_CHARS below and docs/request-path.md.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from router.errors import log_unexpected
from router.index.keys import Namespace
from router.template_sandbox import TemplateSandbox, TemplateSandboxError
from router.tokenize.engine import EngineTokenizer
from router.tokenize.messages import TokenizeError, request_chat_template, text_size
from router.tokenize.prompt import PromptTokenizer

if TYPE_CHECKING:
    from router.backends import BackendState
    from router.config import Config
    from router.route_request import RouteRequest
    from router.upstream import UpstreamPool

logger = logging.getLogger("kvgate.tokenize")

# Where tokenization leaves the event loop (docs/request-path.md, "Where tokenization runs"; the costs
# behind these lines: docs/benchmarks.md, "kv_aware's request path, cut by cut").
# The hop to the tokenizer thread costs the request time; it pays only where the loop would
# otherwise stall for longer, for other requests. Text the Rust tokenizer encodes releases the GIL
# there, so the loop runs meanwhile: moved from OFF_LOOP_MIN_CHARS uncached characters. The ASCII
# fast path (Python) holds the GIL, so a thread frees the loop only at the interpreter's switch
# interval: moved only past the far larger OFF_LOOP_MIN_ASCII_CHARS.
# The chat template is rendered on the loop (jinja holds the GIL too), unless the chat has at least
# OFF_LOOP_MIN_MESSAGES messages; prompts under OFF_LOOP_MIN_CHARS of content stay on the loop whole.
OFF_LOOP_MIN_CHARS = 2048
OFF_LOOP_MIN_ASCII_CHARS = 65536
OFF_LOOP_MIN_MESSAGES = 128
# Whatever the request holds, the whole of its tokenization (template included) runs in the thread
# when the body has this many bytes besides its plain text (tools, content parts, token ids), or
# this many bytes in all: that work is Python's, in proportion to the input, and a client sets it.
OFF_LOOP_MIN_STRUCTURE_BYTES = 65536
OFF_LOOP_MIN_BODY_BYTES = 1 << 20
# A prompt longer than this is routed without tokens (by load): no engine takes it whole, and the
# policy's work on its blocks is the event loop's. A body over ROUTING_MAX_BODY_BYTES is not even
# tokenized: its prompt would be about that long or longer, and the work (seconds, in the thread
# but under the GIL) would slow the loop for nothing.
ROUTING_MAX_TOKENS = 1 << 20
ROUTING_MAX_BODY_BYTES = 8 << 20
# A request waits this long for work in the thread, then is routed without tokens.
OFF_LOOP_TIMEOUT_S = 5.0
# Longest text a client's template may render: this many characters per body byte, plus a floor.
RENDERED_MAX_CHARS_PER_BODY_BYTE = 4
RENDERED_MIN_CHARS = 1 << 20


class RequestTokenizer:
    """The gateway's pre-route step: fills RouteRequest.tokens and .namespace for token-aware policies."""

    def __init__(
        self,
        config: Config,
        backends: dict[str, BackendState] | None = None,
        pool: UpstreamPool | None = None,
    ) -> None:
        self._config = config
        self._backends = backends if backends is not None else {}
        self._tokenizers: dict[str, PromptTokenizer] = {}
        self._load_lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvgate-tokenize")
        # `tokenize: engine` calls go through the gateway's upstream pool (`pool`).
        self._engine = EngineTokenizer(config, self._backends, pool)
        self._sandboxes: dict[str, TemplateSandbox] = {}
        self.failures = 0

    def tokenizer(self, model: str) -> PromptTokenizer | None:
        """The local tokenizer of a configured model (loaded once), or None when it has none."""
        found = self._tokenizers.get(model)
        if found is not None:
            return found
        spec = self._config.model(model)
        if spec is None or spec.tokenizer is None or spec.tokenize != "local":
            return None
        with self._load_lock:
            if model not in self._tokenizers:
                self._tokenizers[model] = PromptTokenizer(spec.tokenizer)
        return self._tokenizers[model]

    def start_sandboxes(self) -> None:
        """Start the template sandbox of every model that accepts client templates (in the background)."""
        for model in self._config.models:
            if model.trust_request_chat_template and self.tokenizer(model.name) is not None:
                self._sandbox(model.name).start()

    async def prepare(self, request: RouteRequest) -> None:
        """Fill `request.tokens` (None when the prompt cannot be tokenized) and `request.namespace`."""
        body = request.body
        salt = body.get("cache_salt")
        request.namespace = Namespace(cache_salt=salt if isinstance(salt, str) and salt else None)
        try:
            tokens = await self.tokens_for(request.model, body, body_size=request.body_size)
            if tokens is not None and len(tokens) > ROUTING_MAX_TOKENS:
                # Longer than engines take; routing it by its blocks would cost the loop in proportion.
                raise TokenizeError(f"the prompt has {len(tokens)} tokens, over {ROUTING_MAX_TOKENS}")
            request.tokens = tokens
        except TokenizeError as exc:
            self.failures += 1
            logger.debug("request %s: no tokens for routing: %s", request.request_id, exc)
            request.tokens = None
        except Exception as exc:  # a broken tokenizer must not fail the request: it is routed by load
            self.failures += 1
            log_unexpected(
                logger, exc, "request %s: tokenizer failed; routing by load", request.request_id,
                level=logging.WARNING,
            )  # fmt: skip
            request.tokens = None

    async def tokens_for(self, model: str, body: dict[str, Any], *, body_size: int = 0) -> np.ndarray | None:
        """The prompt tokens of a request for `model`; `body_size` (its bytes as received, 0 when
        unknown) decides with the text's length whether the work leaves the event loop."""
        spec = self._config.model(model)
        if spec is not None and spec.tokenize == "engine":
            return await self._engine.tokens_for(model, body, self._off_loop)
        tokenizer = self.tokenizer(model)
        if tokenizer is None:
            return None
        if body_size > ROUTING_MAX_BODY_BYTES:
            raise TokenizeError(f"the body has {body_size} bytes, over {ROUTING_MAX_BODY_BYTES}")
        if "messages" in body and request_chat_template(body) is not None:
            return await self._tokens_with_request_template(model, tokenizer, body, body_size)
        text_chars = text_size(body)
        # What the body holds besides plain text (tools, content parts, token ids, many messages)
        # costs Python work in proportion to its size, and the chat template renders all of it.
        structure_bytes = body_size - text_chars
        if text_chars < OFF_LOOP_MIN_CHARS and structure_bytes < OFF_LOOP_MIN_STRUCTURE_BYTES:
            return tokenizer.tokens_for(body)  # most requests: nothing long enough to move
        messages = body.get("messages")
        if (
            structure_bytes >= OFF_LOOP_MIN_STRUCTURE_BYTES
            or body_size >= OFF_LOOP_MIN_BODY_BYTES
            or (isinstance(messages, list) and len(messages) >= OFF_LOOP_MIN_MESSAGES)
        ):
            return await self._off_loop(tokenizer.tokens_for, body)
        prompt = tokenizer.prompt_text(body)
        if isinstance(prompt, np.ndarray):
            return prompt
        text, add_special_tokens = prompt
        return await self._encode(tokenizer, text, add_special_tokens)

    async def _encode(self, tokenizer: PromptTokenizer, text: str, add_special_tokens: bool) -> np.ndarray:
        """`text`'s tokens, encoded on the loop when little of it is uncached, else in the thread."""
        if tokenizer.encodes_on_fast_path(text, add_special_tokens) and len(text) < OFF_LOOP_MIN_ASCII_CHARS:
            # All of it through the ASCII encoder, and short enough whatever the caches hold.
            return tokenizer.encode_text(text, add_special_tokens=add_special_tokens)
        slow, fast = tokenizer.uncached_chars(text, add_special_tokens=add_special_tokens)
        if slow < OFF_LOOP_MIN_CHARS and fast < OFF_LOOP_MIN_ASCII_CHARS:
            return tokenizer.encode_text(text, add_special_tokens=add_special_tokens)
        encode = functools.partial(tokenizer.encode_text, text, add_special_tokens=add_special_tokens)
        return await self._off_loop(encode)

    async def _off_loop(self, work: Callable[..., np.ndarray], *args: Any) -> np.ndarray:
        """`work(*args)` in the tokenizer thread. A request waits for it at most OFF_LOOP_TIMEOUT_S,
        then is routed without tokens; work still queued for it then never starts."""
        future = asyncio.get_running_loop().run_in_executor(self._executor, work, *args)
        try:
            return await asyncio.wait_for(future, OFF_LOOP_TIMEOUT_S)
        except TimeoutError:
            raise TokenizeError(
                f"tokenizing took over {OFF_LOOP_TIMEOUT_S:g} s; routed without tokens"
            ) from None

    async def _tokens_with_request_template(
        self, model: str, tokenizer: PromptTokenizer, body: dict[str, Any], body_size: int
    ) -> np.ndarray:
        """Tokens of a chat request that brings its own template: rendered in the model's sandbox."""
        spec = self._config.model(model)
        if spec is None or not spec.trust_request_chat_template:
            # The forwarder refuses these requests; this keeps any other caller from rendering one.
            raise TokenizeError(f"the model `{model}` does not accept a request's own chat template")
        max_chars = RENDERED_MAX_CHARS_PER_BODY_BYTE * max(body_size, 0) + RENDERED_MIN_CHARS
        try:
            text = await self._sandbox(model).render(body, max_chars)
        except TemplateSandboxError as exc:
            raise TokenizeError(str(exc)) from None
        return await self._encode(tokenizer, text, bool(body.get("add_special_tokens")))

    def _sandbox(self, model: str) -> TemplateSandbox:
        sandbox = self._sandboxes.get(model)
        if sandbox is None:
            spec = self._config.model(model)
            assert spec is not None and spec.tokenizer is not None
            sandbox = self._sandboxes[model] = TemplateSandbox(spec.tokenizer)
        return sandbox

    async def close(self) -> None:
        for sandbox in self._sandboxes.values():
            await sandbox.close()
        self._executor.shutdown(wait=False, cancel_futures=True)
        await self._engine.close()

"""A prompt's tokens asked of an engine (`tokenize: engine`): vLLM's POST /tokenize on a backend
that serves the model, given the request's messages (and what the template reads) or its prompt.

The call goes through the gateway's one upstream pool (router/upstream.py), as every other call to
an engine does: the same keep-alive connections, the same per-backend connection limit.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from router.tokenize.messages import TokenizeError, as_tokens
from router.upstream import UpstreamError, UpstreamPool

if TYPE_CHECKING:
    from router.backends import BackendState
    from router.config import Config

# A token-id prompt this long is converted in the tokenizer thread (the conversion holds the GIL).
OFF_LOOP_MIN_TOKEN_IDS = 16384
# The whole /tokenize call, connection to last byte; the request is then routed without tokens.
ENGINE_TOKENIZE_TIMEOUT_S = 10.0
# The most a /tokenize answer may hold: its token list for a prompt of the most tokens the gateway
# routes by (router/tokenize/request.py ROUTING_MAX_TOKENS, 1 Mi) at up to 8 bytes a token id, and
# twice that for what else vLLM sends. A longer answer is not read on: it would be refused anyway.
MAX_ENGINE_TOKENIZE_BYTES = 16 << 20
_JSON_HEADERS = [(b"content-type", b"application/json")]

# Runs work in the tokenizer thread, bounded in time (RequestTokenizer._off_loop).
OffLoop = Callable[..., Awaitable[np.ndarray]]


class EngineTokenizer:
    """Asks the backends serving a model for its prompts' tokens, through `pool` (the gateway's;
    without one, a pool of its own sized by `config.limits`, closed by close())."""

    def __init__(
        self, config: Config, backends: dict[str, BackendState], pool: UpstreamPool | None = None
    ) -> None:
        self._config = config
        self._backends = backends
        self._pool = pool
        self._owns_pool = False

    async def tokens_for(self, model: str, body: dict[str, Any], off_loop: OffLoop) -> np.ndarray | None:
        """Ask a backend serving the model for its own tokens (POST /tokenize); a long token-id
        prompt is converted through `off_loop` (the tokenizer thread); None when no backend serves it."""
        backend = next(
            (b for b in self._backends.values() if b.serves(model) and b.accepting),
            None,
        )
        if backend is None:
            return None
        spec = self._config.model(model)
        served = (spec.served_name if spec is not None else None) or model
        request: dict[str, Any] = {"model": served}
        if "messages" in body:
            for key in ("messages", "tools", "chat_template", "chat_template_kwargs", "add_generation_prompt",
                        "continue_final_message", "add_special_tokens"):  # fmt: skip
                if key in body:
                    request[key] = body[key]
        elif "prompt" in body:
            prompt = body["prompt"]
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
                if len(prompt) < OFF_LOOP_MIN_TOKEN_IDS:
                    return as_tokens(prompt)
                return await off_loop(as_tokens, prompt)
            request["prompt"] = prompt[0] if isinstance(prompt, list) and prompt else prompt
            if "add_special_tokens" in body:
                request["add_special_tokens"] = body["add_special_tokens"]
        else:
            raise TokenizeError("the body has neither `messages` nor `prompt`")
        try:
            async with asyncio.timeout(ENGINE_TOKENIZE_TIMEOUT_S):
                status, answer = await self._post(backend, request)
        except TimeoutError:
            raise TokenizeError(
                f"backend {backend.name} /tokenize failed: no answer within {ENGINE_TOKENIZE_TIMEOUT_S:g} s"
            ) from None
        except UpstreamError as exc:
            raise TokenizeError(f"backend {backend.name} /tokenize failed: {exc}") from None
        if not 200 <= status < 300:
            raise TokenizeError(f"backend {backend.name} /tokenize failed: it answered HTTP {status}")
        try:
            return as_tokens(json.loads(answer)["tokens"])
        except (KeyError, ValueError, TypeError) as exc:
            raise TokenizeError(f"backend {backend.name} /tokenize failed: {exc}") from None

    async def _post(self, backend: BackendState, request: dict[str, Any]) -> tuple[int, bytes]:
        """POST /tokenize to `backend`: its status and whole body (at most MAX_ENGINE_TOKENIZE_BYTES)."""
        if self._pool is None:
            limits = self._config.limits
            self._pool = UpstreamPool(limits.connect_timeout_s, limits.max_connections)
            self._owns_pool = True
        body = json.dumps(request, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
        response = await self._pool.request(
            backend.origin, b"POST", b"/tokenize", _JSON_HEADERS, body, ENGINE_TOKENIZE_TIMEOUT_S
        )
        try:
            pieces: list[bytes] = []
            size = 0
            async for piece in response.pieces(ENGINE_TOKENIZE_TIMEOUT_S):
                size += len(piece)
                if size > MAX_ENGINE_TOKENIZE_BYTES:
                    raise TokenizeError(
                        f"backend {backend.name} /tokenize failed: its answer is over "
                        f"{MAX_ENGINE_TOKENIZE_BYTES} bytes"
                    )
                pieces.append(piece)
        finally:
            response.close()  # read to the end: the connection goes back to the pool; else dropped
        return response.status, b"".join(pieces)

    async def close(self) -> None:
        """Close the pool this tokenizer made for itself (the gateway closes its own)."""
        if self._owns_pool and self._pool is not None:
            self._pool.close()
            self._pool = None
            self._owns_pool = False

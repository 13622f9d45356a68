"""A prompt's tokens asked of an engine (`tokenize: engine`): vLLM's POST /tokenize on a backend
that serves the model, given the request's messages (and what the template reads) or its prompt."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from router.tokenize.messages import TokenizeError, as_tokens

if TYPE_CHECKING:
    from router.backends import BackendState
    from router.config import Config

# A token-id prompt this long is converted in the tokenizer thread (the conversion holds the GIL).
OFF_LOOP_MIN_TOKEN_IDS = 16384

# Runs work in the tokenizer thread, bounded in time (RequestTokenizer._off_loop).
OffLoop = Callable[..., Awaitable[np.ndarray]]


class EngineTokenizer:
    """Asks the backends serving a model for its prompts' tokens."""

    def __init__(self, config: Config, backends: dict[str, BackendState]) -> None:
        self._config = config
        self._backends = backends
        self._http: Any = None

    async def tokens_for(self, model: str, body: dict[str, Any], off_loop: OffLoop) -> np.ndarray | None:
        """Ask a backend serving the model for its own tokens (POST /tokenize); a long token-id
        prompt is converted through `off_loop` (the tokenizer thread); None when no backend serves it."""
        import httpx

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
        if self._http is None:
            self._http = httpx.AsyncClient(timeout=10.0)
        try:
            response = await self._http.post(f"{backend.url}/tokenize", json=request)
            response.raise_for_status()
            return as_tokens(response.json()["tokens"])
        except (httpx.HTTPError, KeyError, ValueError, TypeError) as exc:
            raise TokenizeError(f"backend {backend.name} /tokenize failed: {exc}") from None

    async def close(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None

"""What a front face (the proxy, the endpoint picker) hands the tokenizer and the policies for one
request: the parsed body, its session key, and the prompt tokens and cache namespace the tokenizer
fills in. The vocabulary the tokenizer and the policies share, below both (docs/README.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from router.index.keys import DEFAULT_NAMESPACE, Namespace

if TYPE_CHECKING:
    import numpy as np


@dataclass(slots=True)
class RouteRequest:
    request_id: str
    model: str
    # The parsed JSON body (the bytes forwarded are the original ones, unless the gateway changed
    # the body: a tenant's cache_salt, a served model name).
    body: dict
    # Session key from `x-session-id` or the OpenAI `user` field, if any.
    session_key: str | None = None
    # Prompt tokens as the engine will see them (uint32 array); only filled when the policy
    # asks for them through `needs_tokens`.
    tokens: np.ndarray | None = None
    # Cache namespace (LoRA adapter, cache salt) as the request names it: salted prompts never match
    # unsalted entries. kv_aware looks an unnamed adapter up by `model` (`PrefixIndex.namespace_for`).
    namespace: Namespace = DEFAULT_NAMESPACE
    # Bytes of the request body as received: how much parsing it further may cost (the tokenizer
    # moves large bodies off the event loop).
    body_size: int = 0
    # Leading prompt tokens a request preparer (router/extensions.py) knows the backends hold: the
    # in-flight prefill accounting counts the rest when the policy's Choice has no prefill_tokens.
    known_cached_tokens: int = 0
    # The tenant its API key speaks for (auth.tenants), None without one; its name leads the
    # request's cache_salt (router/request_routing.py salt_for_tenant).
    tenant: str | None = None

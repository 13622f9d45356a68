"""POST /lookup: which backend holds how much of a prompt, as the KV index's events say.

LMCache-controller compatible: `{"tokens": [...], "cache_salt"?, "lora_name"?}` ->
`{"event_id", "layout_info": {backend: [medium, matched_tokens]}, "stale_holders"}`, from
event-confirmed entries only (kv_aware's predictions are not in the index). Its errors keep the
controller's `{"detail": ...}` body, not the gateway's OpenAI error shape, for LMCache's clients.
Needs the admin token when one is configured.

Stale holders: a backend that is down, or whose event stream is disconnected, may no longer hold
what it announced (and its removals do not arrive). /lookup and /debug/prefix-map leave it out of
the holders and list it apart, with the reason, under `stale_holders`; kv_aware does not count a
disconnected stream's entries either (KVIndexService.longest_cached_prefix) and never routes to a
down backend.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from router.admin import require_admin, require_json
from router.errors import decode_json_body
from router.index.keys import Namespace

if TYPE_CHECKING:
    from router.backends import BackendState
    from router.index.service import KVIndexService

_LOOKUP_MEDIUM = {"gpu": "GPU", "cpu": "CPU", "disk": "DISK"}


class _LookupBody(msgspec.Struct):
    tokens: list[int]
    cache_salt: str | None = None
    lora_name: str | None = None


_lookup_decoder = msgspec.json.Decoder(_LookupBody)


def stale_holders(index: KVIndexService, backends: Mapping[str, BackendState]) -> dict[str, str]:
    """Backends with KV events whose index entries are not to be trusted now, and why."""
    stale = index.disconnected_streams()
    for name, reason in index.uncredited.items():
        stale[name] = f"{stale[name]}; {reason}" if name in stale else reason
    for name in index.backends():
        backend = backends.get(name)
        if backend is not None and not backend.healthy:
            down = f"backend down: {backend.down_reason}"
            stale[name] = f"{down}; {stale[name]}" if name in stale else down
    return stale


class LookupEndpoint:
    """POST /lookup over the gateway's KV index."""

    def __init__(
        self, index: KVIndexService, backends: Mapping[str, BackendState], admin_token: str | None
    ) -> None:
        self.index = index
        self.backends = backends
        self.admin_token = admin_token

    def routes(self) -> list[BaseRoute]:
        return [Route("/lookup", self.endpoint, methods=["POST"])]

    async def endpoint(self, request: Request) -> Response:
        if (denied := require_admin(self.admin_token, request) or require_json(request)) is not None:
            return denied
        raw = await request.body()
        try:
            body = decode_json_body(_lookup_decoder, raw)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            return JSONResponse(
                {"detail": f'invalid lookup body: {exc}; expected {{"tokens": [int, ...]}}'}, status_code=400
            )
        if any(token < 0 or token >= 2**32 for token in body.tokens):
            return JSONResponse({"detail": "tokens must be integers in 0..2^32-1"}, status_code=400)
        namespace = Namespace(body.lora_name, body.cache_salt)
        matches = self.index.longest_cached_prefix(body.tokens, namespace, disconnected=True)
        stale = stale_holders(self.index, self.backends)
        layout: dict[str, list[Any]] = {}
        stale_holders_found: dict[str, dict[str, Any]] = {}
        for name, match in matches.items():
            tier = match.best_tier()
            if tier is None:
                continue
            medium = _LOOKUP_MEDIUM.get(tier, tier.upper())
            if name in stale:
                stale_holders_found[name] = {"medium": medium, "tokens": match.tokens, "reason": stale[name]}
            else:
                layout[name] = [medium, match.tokens]
        return JSONResponse(
            {
                "event_id": f"Lookup{uuid.uuid4().hex}",
                "layout_info": layout,
                "stale_holders": stale_holders_found,
            }
        )

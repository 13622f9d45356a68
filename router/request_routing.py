"""What every front face does to route one request, whatever carries it: the proxy
(router/forward.py) and the endpoint picker (router/epp/) both parse a body into the RouteRequest the
policy reads (`parse_route_request`, which sets a tenant's cache_salt), re-encode the body the engine
gets where it must differ from the client's (`engine_body`: a tenant's salt, the engine's model name),
take the candidates (`route_candidates`), and count a routed request's load on its backend
(`prefill_tokens_of`, `release_backend`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

from router.errors import SCHEMA_ERROR_TYPE, GatewayError, decode_json_body
from router.policies.base import Choice, RouteRequest
from router.tenants import SALTED_PATHS, salt_for_tenant

if TYPE_CHECKING:
    from router.backends import BackendRegistry, BackendState
    from router.forward import ForwardContext, ForwardedRoute

_decoder = msgspec.json.Decoder()
_encoder = msgspec.json.Encoder()


def parse_route_request(
    context: ForwardContext,
    route: ForwardedRoute,
    body: bytes,
    request_id: bytes,
    session_value: bytes | None,
    tenant: str | None = None,
) -> tuple[RouteRequest, dict[str, Any], bool]:
    """(the request as the policy reads it, the whole parsed body, whether the policy routes it).

    A request with nothing to route by goes to the least-loaded backend and the policy never sees it.
    A `tenant`'s request on a salted path gets its cache_salt in the parsed body (the caller
    forwards the body re-encoded): the routing view, the tokenizer's namespace and the engine's
    block hashes then all separate tenants.
    """
    if not body:
        raise GatewayError(400, "empty request body; send a JSON object", "body", SCHEMA_ERROR_TYPE)
    try:
        data = decode_json_body(_decoder, body)
    except msgspec.DecodeError as exc:
        raise GatewayError(400, f"request body is not valid JSON: {exc}", "body", SCHEMA_ERROR_TYPE) from None
    if not isinstance(data, dict):
        raise GatewayError(
            400,
            f"request body must be a JSON object, got {type(data).__name__}",
            "body",
            SCHEMA_ERROR_TYPE,
        )
    model = data.get("model")
    if model is None and route.model_optional and len(context.config.models) == 1:
        model = context.config.models[0].name
    if not isinstance(model, str) or not model:
        raise GatewayError(
            400,
            "missing `model`: name one of the models listed by GET /v1/models",
            "body.model",
            SCHEMA_ERROR_TYPE,
        )
    if not any(field in data for field in route.required):
        fields = " or ".join(f"`{field}`" for field in route.required)
        raise GatewayError(
            400, f"missing {fields} for {route.path}", f"body.{route.required[0]}", SCHEMA_ERROR_TYPE
        )
    if tenant is not None and route.path in SALTED_PATHS:
        client_salt = data.get("cache_salt")
        if client_salt is not None and not (isinstance(client_salt, str) and client_salt):
            message = "`cache_salt` must be a non-empty string"
            raise GatewayError(400, message, "cache_salt", SCHEMA_ERROR_TYPE)
        data["cache_salt"] = salt_for_tenant(tenant, client_salt)
    if model not in context.model_names:
        known = ", ".join(m.name for m in context.config.models)
        raise GatewayError(404, f"the model `{model}` does not exist; configured models: {known}", "model")
    view = None if route.routing_view is None else route.routing_view(data)
    if (
        # Where the gateway renders the messages itself (a routed path, /v1/responses and
        # /v1/messages by their chat); /tokenize leaves the rendering to the engine, which has
        # its own --trust-request-chat-template.
        view is not None
        and "messages" in view
        and model not in context.request_template_models
        and carries_chat_template(view)
    ):
        raise GatewayError(
            400,
            "the request carries its own chat template (`chat_template`, or `chat_template` in "
            "`chat_template_kwargs`), which this gateway refuses: a template is code that would run "
            "on the gateway and the engines. Leave it out to use the model's own template; an "
            f"operator who trusts every client can set `trust_request_chat_template: true` on the "
            f"model `{model}` in the gateway configuration (and --trust-request-chat-template on vLLM)",
            "chat_template",
        )
    if session_value is not None:
        session_key = session_value.decode("latin-1")
    else:
        user = data.get("user")
        session_key = user if isinstance(user, str) and user else None
    route_request = RouteRequest(request_id.decode("latin-1"), model, view or {}, session_key)
    route_request.body_size = len(body)
    route_request.tenant = tenant
    return route_request, data, view is not None


def engine_body(
    route: ForwardedRoute, data: dict[str, Any], tenant: str | None, served_name: str | None
) -> bytes | None:
    """The body the engine gets in place of the client's, encoded once: `data` as parse_route_request
    left it (a tenant's cache_salt in it, so that vLLM's block hashes separate tenants too), with
    `model` set to `served_name` (models[].served_name: the engines know the model by that name).
    None where neither applies (no tenant or a path without a salt, and no served name): the
    client's bytes go on unchanged, and cost no encode."""
    salted = tenant is not None and route.path in SALTED_PATHS
    if served_name is None and not salted:
        return None
    return encode_body(data if served_name is None else {**data, "model": served_name})


def encode_body(data: dict[str, Any]) -> bytes:
    """A parsed request body encoded again for the engine (a salt added, a model renamed)."""
    try:
        return _encoder.encode(data)
    except RecursionError:
        raise GatewayError(400, "request body is JSON nested too deeply to forward") from None


def route_candidates(backends: BackendRegistry, model: str, tried: list[BackendState]) -> list[BackendState]:
    """The healthy candidates not tried yet; when there are none, the marked-down backend that failed
    longest ago (panic routing: one that is back answers instead of a 503)."""
    candidates = backends.candidates(model, exclude=tried)
    if candidates:
        return candidates
    return backends.panic_candidates(model, exclude=tried)[:1]


def carries_chat_template(data: dict) -> bool:
    """Whether a request body brings a chat template of its own (as vLLM reads it: a top-level
    `chat_template`, or one inside `chat_template_kwargs`)."""
    if data.get("chat_template") is not None:
        return True
    kwargs = data.get("chat_template_kwargs")
    return isinstance(kwargs, dict) and kwargs.get("chat_template") is not None


def prefill_tokens_of(route_request: RouteRequest, choice: Choice) -> int:
    """Prompt tokens the backend still has to prefill: the policy's figure, else the prompt's tokens
    less those a request preparer knows are cached."""
    prefill_tokens = choice.prefill_tokens
    if prefill_tokens is not None:
        return prefill_tokens
    tokens = route_request.tokens
    return 0 if tokens is None else max(0, len(tokens) - route_request.known_cached_tokens)


def release_backend(backend: BackendState, prefill_tokens: int) -> None:
    backend.in_flight -= 1
    backend.in_flight_prefill_tokens -= prefill_tokens

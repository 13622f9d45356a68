"""Forwarding of the POST paths engines serve (FORWARDED_ROUTES): validate, route, pass the bytes through.

The generation paths (/v1/completions, /v1/chat/completions, and the Responses and Anthropic Messages
APIs vLLM also serves, /v1/responses and /v1/messages, routed by the chat vLLM renders for them)
carry the load; the others are
vLLM's and SGLang's pooling and tokenizer paths (/v1/embeddings, rerank, score, /tokenize,
/detokenize). Each `ForwardedRoute` says which fields a request must carry and what prompt, if
any, the policy routes it by.

`ProxyEndpoint.serve` does the work for a request whose body has been read, writing through a
`Responder`: router/http_server.py's direct path calls it, and the endpoint itself is a raw ASGI app
for requests that come through uvicorn's ASGI path. The body is parsed once (to route) and
forwarded as the same bytes; the answer streams back piece by piece as the backend sends it. A
connect failure, or a 502/503 before any byte reached the client, is retried on another backend;
nothing is retried after the first byte.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import partial
from random import getrandbits
from time import perf_counter
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from router.access_log import AccessEntry
from router.api_formats import ApiFormatError, messages_as_chat, responses_as_chat
from router.auth import UNAUTHORIZED_HEADERS, UNAUTHORIZED_MESSAGE
from router.config import SessionPolicy
from router.disaggregation import SPLIT_PATHS, USAGE_TAIL_BYTES, DecodeLeg
from router.errors import (
    GatewayError,
    KvgateError,
    error_body,
    gateway_error_body,
    log_unexpected,
    send_error,
    status_error_type,
)
from router.policies.base import Choice, Policy, RouteRequest
from router.policies.least_loaded import LeastLoaded
from router.request_routing import (
    engine_body,
    parse_route_request,
    prefill_tokens_of,
    release_backend,
    route_candidates,
)
from router.upstream import UpstreamError, UpstreamResponse, UpstreamTimeout

if TYPE_CHECKING:
    from router.access_log import AccessLogWriter
    from router.auth import ClientKeys
    from router.backends import BackendRegistry, BackendState
    from router.cluster import ClusterSync
    from router.config import Config
    from router.disaggregation import Disaggregation
    from router.metrics import GatewayMetrics
    from router.policies.base import Policy
    from router.upstream import UpstreamPool

log = logging.getLogger("kvgate.forward")

# Never forwarded in either direction (RFC 9110 section 7.6.1), plus what the upstream client
# writes itself (host, content-length) and what the gateway sets (x-request-id on responses).
_HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"host",
        b"content-length",
        b"expect",
    }
)
# A response keeps its content-length: the body passes through with exactly that many bytes.
_RESPONSE_DROPPED = (_HOP_BY_HOP - {b"content-length"}) | {b"x-request-id", b"x-kvgate-backend"}
_RETRYABLE_STATUSES = (502, 503)
# Requests still running after this long start watching for a client disconnect (see _DisconnectWatch).
DISCONNECT_WATCH_DELAY_S = 0.05
_decoder = msgspec.json.Decoder()
_encoder = msgspec.json.Encoder()


class _ClientGone(KvgateError):
    """The client disconnected before its request body had arrived."""


def body_too_large(limit: int, length: int | None = None) -> GatewayError:
    """The 413 for a request body over `limits.max_body_bytes` (declared or counted as it arrived)."""
    if length is not None:
        return GatewayError(413, f"request body of {length} bytes is over the limit of {limit} bytes")
    return GatewayError(413, f"request body is over the limit of {limit} bytes")


class Responder(Protocol):
    """Where ProxyEndpoint writes its answer: the ASGI `send` (_AsgiResponder) or router/http_server.py.

    `client_gone` turns true when the client disconnected; the server then cancels the request's task.
    """

    client_gone: bool

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None: ...

    async def body(self, piece: bytes, more: bool) -> None: ...


def _whole_body(body: dict[str, Any]) -> dict[str, Any]:
    return body


def _input_prompt(body: dict[str, Any]) -> dict[str, Any] | None:
    """/v1/embeddings: `input` (text, texts, token ids) read as a completion prompt; chat-style
    embedding requests (`messages`, vLLM) as a chat."""
    if "messages" in body:
        return body
    view = {"prompt": body.get("input")}
    for field in ("add_special_tokens", "cache_salt"):  # the salt: the request's index namespace
        if field in body:
            view[field] = body[field]
    return view


def _as_chat(
    read: Callable[[dict[str, Any]], dict[str, Any]],
) -> Callable[[dict[str, Any]], dict[str, Any] | None]:
    """/v1/responses and /v1/messages: routed by the chat vLLM renders for them (router/api_formats.py);
    a body without the API's shape goes by load, and the engine answers its 400."""

    def view(body: dict[str, Any]) -> dict[str, Any] | None:
        try:
            return read(body)
        except ApiFormatError:
            return None

    return view


def _openai_stream_error(status: int, message: str) -> bytes:
    """OpenAI's and vLLM's in-stream error, `data: {"error": {...}}` (the openai client raises on it)."""
    return b"data: " + error_body(status, message) + b"\n\n"


def _anthropic_stream_error(status: int, message: str) -> bytes:
    """The Messages API's in-stream error, an `error` event (the anthropic client raises on it)."""
    error = {"type": "error", "error": {"type": status_error_type(status), "message": message}}
    return b"event: error\ndata: " + _encoder.encode(error) + b"\n\n"


def _first_text(*fields: str) -> Callable[[dict[str, Any]], dict[str, Any] | None]:
    """Rerank and score: the engine pairs the query (or text_1) with each document, so what every
    pair of one request shares, and what a cache can hold, is the leading text: route by it."""

    def view(body: dict[str, Any]) -> dict[str, Any] | None:
        for field in fields:
            value = body.get(field)
            if isinstance(value, list) and value and isinstance(value[0], str):
                value = value[0]
            if isinstance(value, str):
                view = {"prompt": value}
                if "cache_salt" in body:  # the request's index namespace
                    view["cache_salt"] = body["cache_salt"]
                return view
        return None

    return view


@dataclass(frozen=True, slots=True)
class ForwardedRoute:
    """One POST path forwarded to the engines, and how a request on it is checked and routed."""

    path: str
    # The body must hold at least one of these fields.
    required: tuple[str, ...]
    # The request as the policy reads it (`prompt` or `messages`, for a tokenizer); returning
    # None routes it to the least-loaded backend. None here: the path computes no KV cache
    # (/tokenize, /detokenize), so it always goes to the least-loaded backend.
    routing_view: Callable[[dict[str, Any]], dict[str, Any] | None] | None = _whole_body
    # vLLM and SGLang make `model` optional on these paths; with one configured model it is that one.
    model_optional: bool = False
    # The server-sent event that ends a stream the backend broke off: (status, message) -> bytes.
    stream_error: Callable[[int, str], bytes] = _openai_stream_error


# vLLM's OpenAI-compatible server and SGLang's serve these paths under these names (vLLM also
# answers /rerank, /v2/rerank and /score for the same handlers). /tokenize and /detokenize compute
# no KV cache, so where they land does not matter to one: they go to the least-loaded backend.
FORWARDED_ROUTES = (
    ForwardedRoute("/v1/completions", ("prompt",)),
    ForwardedRoute("/v1/chat/completions", ("messages",)),
    ForwardedRoute("/v1/responses", ("input",), _as_chat(responses_as_chat)),
    ForwardedRoute(
        "/v1/messages", ("messages",), _as_chat(messages_as_chat), stream_error=_anthropic_stream_error
    ),
    ForwardedRoute("/v1/embeddings", ("input", "messages"), _input_prompt),
    *(
        ForwardedRoute(path, ("query",), _first_text("query"), model_optional=True)
        for path in ("/v1/rerank", "/rerank", "/v2/rerank")
    ),
    *(
        ForwardedRoute(path, ("text_1", "queries"), _first_text("text_1", "queries"), model_optional=True)
        for path in ("/v1/score", "/score")
    ),
    # vLLM's Anthropic token count: no KV cache computed, like /tokenize.
    ForwardedRoute("/v1/messages/count_tokens", ("messages",), None),
    ForwardedRoute("/tokenize", ("prompt", "messages"), None, model_optional=True),
    ForwardedRoute("/detokenize", ("tokens",), None, model_optional=True),
)


class ForwardContext:
    """What forwarding reads and updates, shared by every ProxyEndpoint; router/wiring.py builds it."""

    __slots__ = (
        "access_log",
        "backends",
        "client_keys",
        "cluster",
        "config",
        "disaggregation",
        "metrics",
        "model_names",
        "policy",
        "pool",
        "request_preparers",
        "request_template_models",
        "served_names",
        "session_header",
    )

    def __init__(
        self,
        config: Config,
        backends: BackendRegistry,
        policy: Policy,
        pool: UpstreamPool,
        metrics: GatewayMetrics,
        *,
        cluster: ClusterSync | None = None,
        request_preparers: Sequence[Callable[[RouteRequest], Awaitable[None]]] = (),
        client_keys: ClientKeys | None = None,
        access_log: AccessLogWriter | None = None,
        disaggregation: Disaggregation | None = None,
    ) -> None:
        self.config = config
        # Splits generation requests into a prefill and a decode leg when configured
        # (router/disaggregation.py); None: every request runs whole on one backend.
        self.disaggregation = disaggregation
        self.backends = backends
        self.policy = policy
        self.pool = pool
        self.metrics = metrics
        # Told of every request routed and every load change (the replica sync), when configured.
        self.cluster = cluster
        # Awaited with each request the policy routes, before it chooses (the tokenizer fills
        # RouteRequest.tokens and .namespace there).
        self.request_preparers = tuple(request_preparers)
        # Client API keys (router/auth.py); None: requests need none.
        self.client_keys = client_keys
        # One JSON line per request when `access_log.enabled` (router/access_log.py); None: off.
        self.access_log = access_log
        self.model_names = frozenset(model.name for model in config.models)
        self.served_names = {
            model.name: model.served_name
            for model in config.models
            if model.served_name not in (None, model.name)
        }
        # Models whose clients may send their own chat template (refused with a 400 for the others).
        self.request_template_models = frozenset(
            model.name for model in config.models if model.trust_request_chat_template
        )
        header = config.policy.header if isinstance(config.policy, SessionPolicy) else "x-session-id"
        self.session_header = header.lower().encode()


class ProxyEndpoint:
    """One forwarded path: `serve` does the work; calling it serves the request as ASGI."""

    def __init__(self, context: ForwardContext, route: ForwardedRoute):
        self.context = context
        self.route = route
        self.path = route.path.encode()
        # What router/http_server.py's direct path checks before the body has been read.
        self.limits = context.config.limits
        self.metrics = context.metrics
        # Where requests with no prompt to route by go, whatever the configured policy.
        self.least_loaded = LeastLoaded()
        if context.access_log is not None:
            # Only then does a request pay for its line: serve() itself never checks.
            self.serve = self._serve_logged  # type: ignore[method-assign]

    def split_headers(
        self, headers: list[tuple[bytes, bytes]]
    ) -> tuple[list[tuple[bytes, bytes]], bytes, bytes | None, bytes | None]:
        """(headers to forward, request id, session header value, declared content-length).

        `headers` must have lower-case names. The request id is the client's, else a new one that
        is appended to the forwarded headers.
        """
        request_id = b""
        session_value = None
        declared_length = None
        connection_options: list[bytes] = []
        forward_headers: list[tuple[bytes, bytes]] = []
        session_header = self.context.session_header
        for name, value in headers:
            if name in _HOP_BY_HOP:
                if name == b"content-length":
                    declared_length = value
                elif name == b"connection":
                    connection_options.append(value)
                continue
            if name == b"x-request-id":
                request_id = value
            elif name == session_header:
                session_value = value
            forward_headers.append((name, value))
        if connection_options:
            named = connection_named_headers(connection_options)
            if any(name in named for name, _ in forward_headers):
                # Headers the client named in `Connection:` are for the gateway's hop alone (RFC 9110
                # section 7.6.1): read as if never sent, so neither forwarded nor used for routing.
                # (content-length frames this request whatever `Connection:` says.)
                return self.split_headers(
                    [
                        (name, value)
                        for name, value in headers
                        if name not in named or name == b"content-length"
                    ]
                )
        if not request_id:
            # 128 random bits, 32 hex digits; not os.urandom, which costs a system call per request.
            request_id = b"%032x" % getrandbits(128)
            forward_headers.append((b"x-request-id", request_id))
        return forward_headers, request_id, session_value, declared_length

    async def __call__(self, scope, receive, send) -> None:
        started = perf_counter()
        forward_headers, request_id, session_value, declared_length = self.split_headers(scope["headers"])
        responder = _AsgiResponder(send)
        try:
            body = await self._read_body(receive, declared_length)
        except GatewayError as exc:
            self.context.metrics.gateway_errors.labels(str(exc.status)).inc()
            self.log_refused(request_id, started, exc)
            await send_error(
                send, exc.status, exc.message, [(b"x-request-id", request_id)], gateway_error_body(exc)
            )
            return
        except _ClientGone:
            return
        watch = _DisconnectWatch(receive, responder)
        try:
            await self.serve(body, forward_headers, request_id, session_value, responder, started)
        finally:
            watch.stop()

    async def _serve_logged(
        self,
        body: bytes,
        forward_headers: list[tuple[bytes, bytes]],
        request_id: bytes,
        session_value: bytes | None,
        responder: Responder,
        started: float,
    ) -> None:
        """serve(), then its access log line, whatever the way it ended."""
        entry = AccessEntry(self.route.path, request_id, started)
        cancelled = True
        try:
            await ProxyEndpoint.serve(
                self, body, forward_headers, request_id, session_value, responder, started, entry
            )
            cancelled = False
        finally:
            self.context.access_log.write(entry, responder.client_gone, cancelled)  # type: ignore[union-attr]

    def log_refused(self, request_id: bytes, started: float, error: GatewayError) -> None:
        """The access log line of a request refused before its body was read (413), when on."""
        if self.context.access_log is not None:
            entry = AccessEntry(self.route.path, request_id, started)
            entry.status, entry.error = error.status, error.message
            self.context.access_log.write(entry, client_gone=False, cancelled=False)

    async def serve(
        self,
        body: bytes,
        forward_headers: list[tuple[bytes, bytes]],
        request_id: bytes,
        session_value: bytes | None,
        responder: Responder,
        started: float,
        entry: AccessEntry | None = None,
    ) -> None:
        """Validate, route and forward one request whose whole body has been read; answer every
        error in the OpenAI shape. Returns quietly when the client left (its task was cancelled).
        `entry` (access log on) is filled in as the request goes."""
        context = self.context
        id_header = (b"x-request-id", request_id)
        keys = context.client_keys
        allowed, tenant = (True, None) if keys is None else keys.tenant_of_headers(forward_headers)
        if not allowed:
            context.metrics.gateway_errors.labels("401").inc()
            if entry is not None:
                entry.status, entry.error = 401, UNAUTHORIZED_MESSAGE
            await _respond_error(
                responder, 401, error_body(401, UNAUTHORIZED_MESSAGE), id_header, UNAUTHORIZED_HEADERS
            )
            return
        try:
            route_request, data, by_policy = self._parse(body, request_id, session_value, tenant)
            # The tenant's cache_salt (the engine must see it too) and the engine's model name.
            rewritten = engine_body(self.route, data, tenant, context.served_names.get(route_request.model))
            if rewritten is not None:
                body = rewritten
            if entry is not None:
                entry.request = route_request
            if by_policy:
                for prepare in context.request_preparers:
                    await prepare(route_request)
            try:
                await self._forward(
                    route_request, data, by_policy, body, forward_headers, id_header, responder, started,
                    entry,
                )  # fmt: skip
            except asyncio.CancelledError:
                if not responder.client_gone:
                    raise
                return  # the client left: upstream closed and accounting done on the way out
        except GatewayError as exc:
            context.metrics.gateway_errors.labels(str(exc.status)).inc()
            if tenant is not None:
                context.metrics.count_tenant_request(tenant, exc.status)
            if entry is not None:
                entry.status, entry.error = exc.status, exc.message
            await _respond_error(responder, exc.status, gateway_error_body(exc), id_header)
        except Exception as exc:
            # Never a stack trace to the client; the log keeps it for the operator (throttled).
            log_unexpected(
                log, exc, "request %s failed inside the gateway", request_id.decode(errors="replace")
            )
            context.metrics.gateway_errors.labels("500").inc()
            if entry is not None:
                entry.status, entry.error = 500, "internal gateway error"
            with contextlib.suppress(Exception):
                body = error_body(500, "internal gateway error; see the gateway log")
                await _respond_error(responder, 500, body, id_header)

    async def _read_body(self, receive, declared_length: bytes | None) -> bytes:
        limit = self.context.config.limits.max_body_bytes
        if declared_length is not None:
            try:
                length = int(declared_length)
            except ValueError:
                raise GatewayError(400, "invalid content-length header") from None
            if length > limit:
                raise body_too_large(limit, length)
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientGone
        body = message.get("body", b"")
        size = len(body)
        if size > limit:
            raise body_too_large(limit)
        if not message.get("more_body"):
            return body
        parts = [body]
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientGone
            part = message.get("body", b"")
            size += len(part)
            if size > limit:
                raise body_too_large(limit)
            parts.append(part)
            if not message.get("more_body"):
                return b"".join(parts)

    def _parse(
        self, body: bytes, request_id: bytes, session_value: bytes | None, tenant: str | None = None
    ) -> tuple[RouteRequest, dict[str, Any], bool]:
        """router/request_routing.py parse_route_request for this path."""
        return parse_route_request(self.context, self.route, body, request_id, session_value, tenant)

    async def _forward(
        self,
        route_request: RouteRequest,
        data: dict[str, Any],
        by_policy: bool,
        body: bytes,
        forward_headers: list[tuple[bytes, bytes]],
        id_header: tuple[bytes, bytes],
        responder: Responder,
        started: float,
        entry: AccessEntry | None = None,
    ) -> None:
        context = self.context
        # `body` carries it already (engine_body); a split's prefill leg is built from `data`.
        served_name = context.served_names.get(route_request.model)
        policy = context.policy if by_policy else self.least_loaded
        limits = context.config.limits
        timeout_s = limits.upstream_timeout_s
        tried: list[BackendState] = []
        # Prefill/decode disaggregation: decided (and a split's prefill run) before the loop, which
        # then sends the request to the decode engine the plan chose, or on a retry another one.
        leg: DecodeLeg | None = None
        if context.disaggregation is not None and by_policy and self.path in SPLIT_PATHS:
            leg = await context.disaggregation.plan(
                policy, route_request, data, forward_headers, self.path, served_name or route_request.model
            )
        for attempt in range(limits.max_attempts):
            candidates = route_candidates(context.backends, route_request.model, tried)
            if not candidates:
                break
            if leg is not None and attempt == 0 and leg.first_choice.backend in candidates:
                choice = leg.for_decode(leg.first_choice)
            elif leg is not None:
                choice = leg.for_decode(policy.choose(route_request, candidates))
            else:
                choice = policy.choose(route_request, candidates)
            backend = choice.backend
            if entry is not None:
                entry.choice = choice
            if not backend.healthy:
                context.metrics.panic_routed.labels(backend.name).inc()
            tried.append(backend)
            # Counted from the moment the request is sent: the engine is busy with it from then on.
            prefill_tokens = prefill_tokens_of(route_request, choice)
            backend.in_flight += 1
            backend.in_flight_prefill_tokens += prefill_tokens
            if leg is not None:
                leg.sent(backend, choice)
            upstream_started = perf_counter()
            try:
                # The policy (and the peers) learn of the placement as the request is sent, not when
                # the answer starts: a non-streamed answer starts only when it is complete, and
                # requests sharing this prompt that arrive meanwhile must already see it placed
                # (kv_aware's predictions, approximate's blocks). The pool runs it right after the
                # write, before the loop runs anything else: the engine starts meanwhile.
                response = await context.pool.request(
                    backend.origin, b"POST", self.path, forward_headers, body, timeout_s,
                    partial(_placed, context.cluster, policy, route_request, choice, prefill_tokens),
                )  # fmt: skip
            except UpstreamTimeout:
                _release(backend, prefill_tokens, leg)
                raise GatewayError(
                    504,
                    f"backend {backend.name} sent no response within {timeout_s:g} s "
                    "(raise limits.upstream_timeout_s for longer generations)",
                ) from None
            except UpstreamError as exc:
                _release(backend, prefill_tokens, leg)
                context.backends.mark_down(backend, str(exc))
                if not exc.before_response:
                    raise GatewayError(502, f"backend {backend.name} failed: {exc}") from None
                context.metrics.retries.labels(backend.name, "connect").inc()
                continue
            except BaseException:  # cancelled: the client left
                _release(backend, prefill_tokens, leg)
                raise
            status = response.status
            if status >= 500:
                context.backends.mark_down(backend, f"answered HTTP {status}")
                if (
                    status in _RETRYABLE_STATUSES
                    and attempt + 1 < limits.max_attempts
                    and route_candidates(context.backends, route_request.model, tried)
                ):
                    _release(backend, prefill_tokens, leg)
                    response.close()  # unread body: the connection is dropped, not reused
                    context.metrics.retries.labels(backend.name, str(status)).inc()
                    continue
            elif not backend.healthy:
                context.backends.mark_up(backend)  # marked down, yet it answered: it is back
            if not _is_event_stream(response.headers):
                # A whole answer's head waits for its body (router/http_server.py), so a backend
                # that fails between the two has sent the client nothing: routed around as if it
                # had failed before answering, not a connection dropped on the client.
                try:
                    await response.body_started(timeout_s)
                except UpstreamError as exc:
                    _release(backend, prefill_tokens, leg)
                    response.close()
                    if isinstance(exc, UpstreamTimeout):
                        raise GatewayError(
                            504,
                            f"backend {backend.name} sent no body within {timeout_s:g} s of its headers "
                            "(raise limits.upstream_timeout_s for longer generations)",
                        ) from None
                    context.backends.mark_down(backend, str(exc))
                    context.metrics.retries.labels(backend.name, "body").inc()
                    continue
                except BaseException:  # cancelled: the client left
                    _release(backend, prefill_tokens, leg)
                    response.close()
                    raise
            await self._relay(
                policy,
                choice,
                route_request,
                prefill_tokens,
                response,
                id_header,
                responder,
                started,
                upstream_started,
                entry,
                leg,
            )
            return
        if tried:
            names = ", ".join(backend.name for backend in tried)
            raise GatewayError(
                503, f"no backend could take the request for `{route_request.model}` (tried {names})"
            )
        raise GatewayError(503, f"no healthy backend serves the model `{route_request.model}`")

    async def _relay(
        self,
        policy: Policy,
        choice: Choice,
        route_request: RouteRequest,
        prefill_tokens: int,
        response: UpstreamResponse,
        id_header: tuple[bytes, bytes],
        responder: Responder,
        started: float,
        upstream_started: float,
        entry: AccessEntry | None = None,
        leg: DecodeLeg | None = None,
    ) -> None:
        """Stream the answer to the client; release the backend's in-flight share when it ends.
        With a disaggregation `leg`, the answer's end is kept for it to read the engine's usage."""
        context = self.context
        backend = choice.backend
        status = response.status
        dropped = _RESPONSE_DROPPED
        connection_options = [value for name, value in response.headers if name == b"connection"]
        if connection_options:
            # (content-length frames the body relayed, whatever `Connection:` says.)
            dropped = dropped | (connection_named_headers(connection_options) - {b"content-length"})
        headers = [(name, value) for name, value in response.headers if name not in dropped]
        headers.append((b"x-kvgate-backend", backend.name_bytes))
        headers.append(id_header)
        headers_arrived = perf_counter()
        outcome_status = status
        # A streamed answer's first piece comes with its first token: the policy may learn from
        # the time to it (a whole answer's first piece says nothing about the prefill).
        first_piece_pending = status == 200 and _is_event_stream(response.headers)
        ttft_s: float | None = None
        tail = b""
        # A streamed decode leg times its pieces: the cost model learns the engine's stalls from the gaps.
        gaps = leg.stream_gaps(backend, prefill_tokens) if leg is not None and first_piece_pending else None
        # The answer's end is kept for the decode leg, and for missed reuse to read the cached
        # tokens the engine reports where the policy credited the winner some (stale index).
        # Missed reuse keeps references to the last two pieces (no copy per piece: a long stream
        # has hundreds); the usage event, near the end, lies in them.
        missed_reuse = context.metrics.missed_reuse
        keep_last = leg is None and missed_reuse.wants_tail(choice)
        before_last = last_piece = b""
        try:
            await responder.start(status, headers)
            context.metrics.overhead.observe(
                (upstream_started - started) + (perf_counter() - headers_arrived)
            )
            try:
                async for piece in response.pieces(context.config.limits.upstream_timeout_s):
                    if leg is not None:
                        leg.prefill_over()
                    if prefill_tokens:
                        backend.in_flight_prefill_tokens -= prefill_tokens
                        prefill_tokens = 0
                        if context.cluster is not None:
                            context.cluster.loads_changed()
                    if gaps is not None:
                        arrived = perf_counter()
                        gaps.piece(arrived)
                        if first_piece_pending:
                            ttft_s = arrived - upstream_started
                            first_piece_pending = False
                    elif first_piece_pending:
                        ttft_s = perf_counter() - upstream_started
                        first_piece_pending = False
                    if leg is not None:
                        tail = (tail + piece)[-USAGE_TAIL_BYTES:]
                    elif keep_last:
                        before_last, last_piece = last_piece, piece
                    if response.at_end:
                        # The last piece ends the response in the same write (saves a write per request).
                        await responder.body(piece, False)
                        return
                    await responder.body(piece, True)
            except UpstreamError as exc:
                outcome_status = 504 if isinstance(exc, UpstreamTimeout) else 502
                log.warning(
                    "backend %s failed mid-response to %s: %s", backend.name, route_request.request_id, exc
                )
                if entry is not None:
                    entry.error = f"backend {backend.name} failed mid-response: {exc}"
                if _is_event_stream(response.headers):
                    event = self.route.stream_error(outcome_status, f"backend {backend.name} failed: {exc}")
                    await responder.body(event, False)
                # Otherwise end without completing: the server closes the connection, so the client
                # sees a truncated response instead of a short one that looks whole.
                return
            await responder.body(b"", False)
        finally:
            if entry is not None:
                entry.backend, entry.policy, entry.status = backend.name, policy.name, outcome_status
                entry.upstream_failed = outcome_status != status
                entry.stream = _is_event_stream(response.headers)
                # The first streamed piece's time from sending upstream (200 event streams only).
                entry.upstream_started = upstream_started
                entry.first_piece_s = ttft_s
            response.close()
            context.metrics.observe_upstream(backend.name, perf_counter() - upstream_started)
            release_backend(backend, prefill_tokens)
            if context.cluster is not None:
                context.cluster.loads_changed()
            backend.requests_total += 1
            context.metrics.count_request(backend.name, outcome_status)
            if route_request.tenant is not None:
                context.metrics.count_tenant_request(route_request.tenant, outcome_status)
            policy.on_finished(choice, outcome_status, ttft_s)
            if missed_reuse.enabled:
                # Once per request: the Choice of the attempt that answered.
                missed_reuse.routed(choice)
                missed_reuse.finished(
                    choice,
                    outcome_status,
                    tail if leg is not None else (before_last + last_piece)[-USAGE_TAIL_BYTES:],
                )
            if leg is not None:
                leg.finished(backend, outcome_status, ttft_s, tail)


def _placed(
    cluster: ClusterSync | None, policy: Policy, request: RouteRequest, choice: Choice, prefill_tokens: int
) -> None:
    """What routing learns of a placement: the peers' note, the policy's own record."""
    if cluster is not None:
        cluster.routed(request, choice, prefill_tokens)
    policy.on_routed(choice)


def _release(backend: BackendState, prefill_tokens: int, leg: DecodeLeg | None) -> None:
    """An attempt ended before its answer was relayed: its load and its open prefill with it."""
    release_backend(backend, prefill_tokens)
    if leg is not None:
        leg.prefill_over()


def connection_named_headers(values: Sequence[bytes]) -> frozenset[bytes]:
    """The header names the `Connection:` header values list (lower-case), besides `connection`
    itself: hop-by-hop headers of that one connection, never forwarded (RFC 9110 section 7.6.1)."""
    named = {option.strip().lower() for value in values for option in value.split(b",")}
    named.discard(b"")
    named.add(b"connection")
    return frozenset(named)


def _is_event_stream(headers: list[tuple[bytes, bytes]]) -> bool:
    return any(name == b"content-type" and value.startswith(b"text/event-stream") for name, value in headers)


class _DisconnectWatch:
    """Cancels the request's task when the client disconnects, so the upstream connection closes and
    the engine stops generating for nobody.

    Watching costs a task per request, a sizeable share of the gateway's CPU per request
    (docs/gateway.md, "Performance design"), so it starts only after DISCONNECT_WATCH_DELAY_S:
    answers faster than that never pay for it.
    """

    __slots__ = ("_receive", "_responder", "_target", "_task", "_timer")

    def __init__(self, receive, responder: _AsgiResponder):
        self._receive = receive
        self._responder = responder
        self._target = asyncio.current_task()
        self._task: asyncio.Task | None = None
        self._timer = asyncio.get_running_loop().call_later(DISCONNECT_WATCH_DELAY_S, self._start)

    def _start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass
        self._responder.client_gone = True
        if self._target is not None:
            self._target.cancel()

    def stop(self) -> None:
        self._timer.cancel()
        if self._task is not None:
            self._task.cancel()


class _AsgiResponder:
    """Responder over an ASGI `send`."""

    __slots__ = ("_send", "client_gone")

    def __init__(self, send):
        self._send = send
        self.client_gone = False

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        await self._send({"type": "http.response.start", "status": status, "headers": headers})

    async def body(self, piece: bytes, more: bool) -> None:
        await self._send({"type": "http.response.body", "body": piece, "more_body": more})


async def _respond_error(
    responder: Responder,
    status: int,
    body: bytes,
    id_header: tuple[bytes, bytes],
    extra_headers: list[tuple[bytes, bytes]] = (),
) -> None:
    """Answer the encoded error `body` (error_body) with `status`."""
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", b"%d" % len(body)),
        id_header,
        *extra_headers,
    ]
    await responder.start(status, headers)
    await responder.body(body, False)

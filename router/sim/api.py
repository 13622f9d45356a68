"""The simulated engine's HTTP API: vLLM's OpenAI-compatible endpoints and its /metrics names.

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with SSE streaming in vLLM's chunk
format), POST /v1/responses and POST /v1/messages (the Responses and Anthropic Messages APIs, read
as vLLM reads them by router/api_formats.py, answered and streamed in vLLM's shapes; and
POST /v1/messages/count_tokens), GET /v1/models,
POST /tokenize, POST /detokenize, GET /health, GET /metrics, POST /reset_prefix_cache, GET /version.
Every usage says how many prompt tokens were cached (prompt_tokens_details.cached_tokens;
input_tokens_details.cached_tokens; cache_read_input_tokens). Requests are refused where vLLM
refuses them (router/sim/validation.py), in vLLM's error shape (router/errors.py).

Simulated pooling endpoints, in vLLM's request and response shapes but with made-up numbers (no
model runs): POST /v1/embeddings prefills each input through the simulated engine (so it is cached
and published like a prompt) and answers a unit vector derived from a hash of its tokens;
POST /v1/rerank (/rerank, /v2/rerank) and POST /v1/score (/score) score pairs by the share of
words they have in common. They exist so the gateway's forwarding of these paths can be tested.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from router.api_formats import ApiFormatError, messages_as_chat, responses_as_chat
from router.errors import error_body
from router.sim.engine import GenerationRequest, InsufficientCapacity, SimulatedEngine
from router.sim.prompts import PromptError, PromptTokenizer
from router.sim.validation import RequestRefused, check_chat_messages, check_request, schema_error

log = logging.getLogger("kvgate.sim")
OWNED_BY = "kvgate-simulated"
_json = msgspec.json.Encoder()


@dataclass(slots=True)
class ServedModel:
    name: str
    max_model_len: int
    default_max_tokens: int = 16
    # LoRA adapters served under their own names (`--lora-modules`); nothing is loaded.
    lora_names: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class _GenerationApi:
    """How /v1/completions or /v1/chat/completions shapes its JSON; the generation is the same."""

    id_prefix: str
    response_object: str
    chunk_object: str
    fields: str  # the validation.FIELDS entry of its request model
    check_shape: Callable[[dict], None]  # the prompt field's schema check (vLLM reports it first)
    read_prompt: Callable[[dict], Any]  # the request body -> prompt token ids (PromptError if bad)
    prompt_param: str  # the field a prompt error names
    max_tokens_field: str
    chunk_choice: Callable[[str, str | None], dict]  # (text, finish reason) -> a streamed choice
    response_choice: Callable[[str], dict]  # the whole text -> the choice of a non-streamed answer
    first_chunk_choice: dict | None = None  # streamed before the first token (chat: the role)
    response_trailer: dict = field(default_factory=dict)  # fields after `usage` in a non-streamed answer


def _error(message: str, status: int, param: str | None = None, error_type: str | None = None) -> Response:
    """vLLM's ErrorResponse (router/errors.py's error_body, the gateway's shape too)."""
    body = error_body(status, message, param, error_type)
    return Response(body, status_code=status, media_type="application/json")


def _refused(exc: RequestRefused) -> Response:
    return _error(str(exc), exc.status, exc.param, exc.error_type)


def _ok(body: Any) -> Response:
    return Response(_json.encode(body), media_type="application/json")


class _MetricsCollector:
    """Reads the engine's state at scrape time (nothing to keep in sync on the request path)."""

    def __init__(self, engine: SimulatedEngine, model: str):
        self.engine = engine
        self.labels = {"model_name": model, "engine": "0"}

    def collect(self):
        names, values = list(self.labels), list(self.labels.values())
        engine, counters = self.engine, self.engine.counters
        for name, doc, value in (
            (
                "vllm:num_requests_running",
                "Number of requests in model execution batches.",
                engine.num_running,
            ),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", engine.num_waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", engine.pool.usage),
        ):
            gauge = GaugeMetricFamily(name, doc, labels=names)
            gauge.add_metric(values, value)
            yield gauge
        for name, doc, value in (
            (
                "vllm:prefix_cache_queries",
                "Prefix cache queries, in terms of number of queried tokens.",
                counters.prefix_cache_queries,
            ),
            (
                "vllm:prefix_cache_hits",
                "Prefix cache hits, in terms of number of cached tokens.",
                counters.prefix_cache_hits,
            ),
            (
                "vllm:external_prefix_cache_hits",
                "External prefix cache hits from KV connector cross-instance cache sharing, in terms "
                "of number of cached tokens.",
                counters.external_prefix_cache_hits,
            ),
            ("vllm:prompt_tokens", "Number of prefill tokens processed.", counters.prompt_tokens),
            ("vllm:generation_tokens", "Number of generation tokens processed.", counters.generation_tokens),
            (
                "kvgate_sim:shared_load_seconds",
                "Simulated seconds spent loading prompt KV from the shared tier.",
                engine.shared_load_seconds,
            ),
        ):
            counter = CounterMetricFamily(name, doc, labels=names)
            counter.add_metric(values, value)
            yield counter
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=[*names, "finished_reason"],
        )
        success.add_metric([*values, "length"], counters.finished_requests)
        yield success
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=["block_size", "num_gpu_blocks", "enable_prefix_caching", "simulated"],
        )
        info.add_metric([str(engine.pool.block_size), str(engine.pool.num_blocks), "True", "True"], 1.0)
        yield info


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def _kv_transfer(generation: GenerationRequest) -> dict:
    """What the engine moved through the shared tier for this prompt, in the answer's top-level
    `kv_transfer_params` (the field vLLM's KV connectors answer in): the tokens it loaded and the
    load's seconds; a prefill engine's the tokens the store holds as it answers and its write's seconds."""
    params: dict[str, Any] = {}
    if generation.shared_loaded_tokens:
        params["loaded_tokens"] = generation.shared_loaded_tokens
        params["load_seconds"] = round(generation.shared_load_seconds, 6)
    if generation.stored_tokens is not None:
        params["stored_tokens"] = generation.stored_tokens
        params["store_seconds"] = round(generation.store_seconds, 6)
    return {"kv_transfer_params": params} if params else {}


def build_app(
    engine: SimulatedEngine,
    tokenizer: PromptTokenizer,
    model: ServedModel,
    on_startup: Callable[[], None] | None = None,
) -> Starlette:
    """The Starlette app of one simulated engine; `on_startup` runs inside the server's event loop."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_MetricsCollector(engine, model.name))
    started = int(time.time())

    async def read_body(request: Request, known_model: bool = True) -> dict:
        """The JSON object of the body; its model checked unless `known_model` is False (a
        generation path checks it after the request schema, in vLLM's order)."""
        try:
            body = msgspec.json.decode(await request.body())
        except msgspec.DecodeError as exc:
            raise schema_error(f"the request body is not valid JSON: {exc}", "") from None
        if not isinstance(body, dict):
            raise schema_error("the request body must be a JSON object", "")
        if known_model:
            check_model(body)
        return body

    def check_model(body: dict) -> None:
        requested = body.get("model")
        if requested is not None and requested != model.name and requested not in model.lora_names:
            raise RequestRefused(f"The model `{requested}` does not exist.", status=404, param="model")

    def generation_request(
        body: dict, prompt, max_tokens_field: str, values: dict | None = None
    ) -> GenerationRequest:
        """The engine's request for `prompt`; `values` are the body's fields as check_request read them."""
        values = values or {}
        if values.get("n", 1) not in (None, 1):
            raise RequestRefused("the simulated engine supports only n=1", param="n")
        requested = values.get(max_tokens_field)
        if requested is None and max_tokens_field == "max_completion_tokens":
            requested = values.get("max_tokens")
        room = model.max_model_len - len(prompt)
        if room <= 0 or (requested is not None and requested > room):
            raise RequestRefused(
                f"This model's maximum context length is {model.max_model_len} tokens. However, you "
                f"requested {len(prompt) + (requested or 0)} tokens ({len(prompt)} in the messages, "
                f"{requested or 0} in the completion). Please reduce the length of the messages or "
                "completion.",
                param="max_tokens",
            )
        salt = body.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise RequestRefused("`cache_salt` must be a non-empty string", param="cache_salt")
        seed = values.get("seed")
        transfer = body.get("kv_transfer_params")
        request = GenerationRequest(
            request_id=uuid.uuid4().hex,
            prompt=prompt,
            max_tokens=min(requested or model.default_max_tokens, room),
            # A LoRA adapter served under its own name: its blocks never match the base model's.
            lora_name=body.get("model") if body.get("model") in model.lora_names else None,
            cache_salt=salt,
            seed=seed,
            hand_over=isinstance(transfer, dict) and transfer.get("do_remote_decode") is True,
        )
        try:
            engine.check_fits(request)
        except InsufficientCapacity as exc:
            raise RequestRefused(str(exc), param="max_tokens") from None
        return request

    def stream_options(body: dict) -> bool:
        options = body.get("stream_options") or {}
        return bool(isinstance(options, dict) and options.get("include_usage"))

    def check_prompt_given(body: dict) -> None:
        if "prompt" not in body:
            raise schema_error("`prompt` is required", "prompt")

    def completion_prompt(body: dict):
        check_prompt_given(body)
        return tokenizer.completion_prompt(body["prompt"], bool(body.get("add_special_tokens", True)))

    def chat_prompt(body: dict):
        check_chat_messages(body.get("messages"))
        return tokenizer.chat_prompt(
            body.get("messages"),
            add_generation_prompt=bool(body.get("add_generation_prompt", True)),
            continue_final_message=bool(body.get("continue_final_message", False)),
            tools=body.get("tools"),
            chat_template_kwargs=body.get("chat_template_kwargs"),
            add_special_tokens=bool(body.get("add_special_tokens", False)),
        )

    async def generate(request: Request, api: _GenerationApi) -> Response:
        """One completion or chat completion, streamed or not; `api` says how its JSON is shaped."""
        try:
            body = await read_body(request, known_model=False)
            api.check_shape(body)
            values = check_request(body, api.fields)
            check_model(body)
            try:
                prompt = api.read_prompt(body)
            except PromptError as exc:
                raise RequestRefused(str(exc), param=api.prompt_param) from None
            generation = generation_request(body, prompt, api.max_tokens_field, values)
        except RequestRefused as exc:
            return _refused(exc)
        header = {
            "id": f"{api.id_prefix}-{generation.request_id}",
            "object": api.chunk_object,
            "created": int(time.time()),
            "model": generation.lora_name or model.name,
        }
        if values.get("stream"):
            return _sse(engine, generation, tokenizer, api, header, stream_options(body))
        tokens = [token async for token in engine.generate(generation)]
        text = "".join(tokenizer.output_text(t) for t in tokens)
        return _ok(
            {
                **header,
                "object": api.response_object,
                "choices": [api.response_choice(text)],
                "usage": _usage(len(prompt), len(tokens), generation.cached_tokens),
                **api.response_trailer,
                **_kv_transfer(generation),
            }
        )

    def completion_choice(text: str, finish: str | None) -> dict:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None}

    completion_api = _GenerationApi(
        id_prefix="cmpl",
        fields="completions",
        check_shape=check_prompt_given,
        response_object="text_completion",
        chunk_object="text_completion",
        read_prompt=completion_prompt,
        prompt_param="prompt",
        max_tokens_field="max_tokens",
        chunk_choice=completion_choice,
        response_choice=lambda text: {**completion_choice(text, "length"), "prompt_logprobs": None},
    )

    def chat_chunk_choice(delta: dict, finish: str | None) -> dict:
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}

    chat_api = _GenerationApi(
        id_prefix="chatcmpl",
        fields="chat",
        check_shape=lambda body: check_chat_messages(body.get("messages")),
        response_object="chat.completion",
        chunk_object="chat.completion.chunk",
        read_prompt=chat_prompt,
        prompt_param="messages",
        max_tokens_field="max_completion_tokens",
        chunk_choice=lambda text, finish: chat_chunk_choice({"content": text}, finish),
        first_chunk_choice=chat_chunk_choice({"role": "assistant", "content": ""}, None),
        response_choice=lambda text: {
            "index": 0,
            "message": {"role": "assistant", "content": text, "reasoning_content": None, "tool_calls": []},
            "logprobs": None,
            "finish_reason": "length",
            "stop_reason": None,
        },
        response_trailer={"prompt_logprobs": None},
    )

    def chat_tokens(chat: dict, param: str):
        """The prompt tokens of a chat request read from another API (router/api_formats.py)."""
        check_chat_messages(chat["messages"])
        try:
            return tokenizer.chat_prompt(
                chat["messages"],
                add_generation_prompt=chat.get("add_generation_prompt", True),
                continue_final_message=chat.get("continue_final_message", False),
                tools=chat.get("tools"),
                chat_template_kwargs=chat.get("chat_template_kwargs"),
            )
        except PromptError as exc:
            raise RequestRefused(str(exc), param=param) from None

    def as_chat(read: Callable[[dict], dict], body: dict) -> dict:
        try:
            return read(body)
        except ApiFormatError as exc:
            raise schema_error(str(exc), exc.param) from None

    async def responses(request: Request) -> Response:
        """POST /v1/responses: the Responses API, rendered as vLLM renders it, in its response shape."""
        try:
            body = await read_body(request, known_model=False)
            chat = as_chat(responses_as_chat, body)  # `input` first, as vLLM's schema reports it
            values = check_request(body, "responses")
            check_model(body)
            prompt = chat_tokens(chat, "input")
            generation = generation_request(body, prompt, "max_output_tokens", values)
        except RequestRefused as exc:
            return _refused(exc)
        answer = _ResponsesAnswer(
            f"resp_{generation.request_id}",
            f"msg_{uuid.uuid4().hex}",
            generation.lora_name or model.name,
            body,
        )
        if values.get("stream"):
            return StreamingResponse(
                answer.events(engine, generation, tokenizer), media_type="text/event-stream"
            )
        tokens = [token async for token in engine.generate(generation)]
        text = "".join(tokenizer.output_text(t) for t in tokens)
        return _ok(
            answer.response(text, _responses_usage(len(prompt), len(tokens), generation.cached_tokens))
        )

    async def messages(request: Request) -> Response:
        """POST /v1/messages: the Anthropic Messages API, as vLLM serves it (its chat underneath)."""
        try:
            body = await read_body(request, known_model=False)
            chat = as_chat(messages_as_chat, body)  # `messages` first, as vLLM's schema reports it
            values = check_request(body, "messages")
            check_model(body)
            prompt = chat_tokens(chat, "messages")
            generation = generation_request(body, prompt, "max_tokens", values)
        except RequestRefused as exc:
            return _refused(exc)
        message_id = f"chatcmpl-{generation.request_id}"  # vLLM answers with its chat completion's id
        served = generation.lora_name or model.name
        if values.get("stream"):
            return StreamingResponse(
                _anthropic_events(engine, generation, tokenizer, message_id, served),
                media_type="text/event-stream",
            )
        tokens = [token async for token in engine.generate(generation)]
        text = "".join(tokenizer.output_text(t) for t in tokens)
        return _ok(
            {
                "id": message_id,
                "type": "message",
                "role": "assistant",
                "content": [{"type": "text", "text": text}],
                "model": served,
                "stop_reason": "max_tokens",
                "usage": _anthropic_usage(len(prompt), len(tokens), generation.cached_tokens),
            }
        )

    async def count_tokens(request: Request) -> Response:
        """POST /v1/messages/count_tokens: the prompt tokens a /v1/messages body would have."""
        try:
            body = await read_body(request)
            prompt = chat_tokens(as_chat(messages_as_chat, body), "messages")
        except RequestRefused as exc:
            return _refused(exc)
        return _ok({"input_tokens": len(prompt)})

    async def completions(request: Request) -> Response:
        return await generate(request, completion_api)

    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat_api)

    async def models(request: Request) -> Response:
        def entry(name: str, parent: str | None) -> dict:
            return {
                "id": name,
                "object": "model",
                "created": started,
                "owned_by": OWNED_BY,
                "root": name,
                "parent": parent,
                "max_model_len": model.max_model_len,
                "permission": [],
            }

        entries = [entry(model.name, None)] + [entry(lora, model.name) for lora in model.lora_names]
        return _ok({"object": "list", "data": entries})

    async def tokenize(request: Request) -> Response:
        try:
            body = await read_body(request)
            if "messages" in body:
                tokens = chat_prompt(body)
            elif isinstance(body.get("prompt"), str):
                tokens = completion_prompt(body)
            else:
                raise schema_error("give `prompt` (a string) or `messages`", "prompt")
        except PromptError as exc:
            return _error(str(exc), 400)
        except RequestRefused as exc:
            return _refused(exc)
        strings = tokenizer.token_strings(tokens) if body.get("return_token_strs") else None
        return _ok(
            {
                "count": len(tokens),
                "max_model_len": model.max_model_len,
                "tokens": tokens.tolist(),
                "token_strs": strings,
            }
        )

    async def detokenize(request: Request) -> Response:
        try:
            body = await read_body(request)
            tokens = body.get("tokens")
            if not isinstance(tokens, list) or not all(isinstance(t, int) and t >= 0 for t in tokens):
                raise schema_error("`tokens` must be a list of token ids", "tokens")
        except RequestRefused as exc:
            return _refused(exc)
        return _ok({"prompt": tokenizer.tokenizer.decode(tokens)})

    async def embeddings(request: Request) -> Response:
        try:
            body = await read_body(request)
            inputs = body.get("input")
            if isinstance(inputs, str) or (
                isinstance(inputs, list) and inputs and all(isinstance(t, int) for t in inputs)
            ):
                inputs = [inputs]
            if not isinstance(inputs, list) or not inputs:
                raise schema_error(
                    "`input` must be a string, token ids, or a non-empty list of those", "input"
                )
            add_special = bool(body.get("add_special_tokens", True))
            try:
                prompts = [tokenizer.completion_prompt(item, add_special) for item in inputs]
            except PromptError as exc:
                raise RequestRefused(str(exc), param="input") from None
            # A salted request's blocks hash apart (vLLM's pooling requests take cache_salt too).
            salted = {"cache_salt": body["cache_salt"]} if "cache_salt" in body else {}
            generations = [generation_request(salted, prompt, "max_tokens") for prompt in prompts]
        except RequestRefused as exc:
            return _refused(exc)
        data = []
        for index, (prompt, generation) in enumerate(zip(prompts, generations, strict=True)):
            generation.max_tokens = 1  # a prefill: the prompt is cached and its blocks published
            async for _ in engine.generate(generation):
                pass
            data.append({"index": index, "object": "embedding", "embedding": _simulated_embedding(prompt)})
        prompt_tokens = sum(len(prompt) for prompt in prompts)
        return _ok(
            {
                "id": f"embd-{uuid.uuid4().hex}",
                "object": "list",
                "created": int(time.time()),
                "model": model.name,
                "data": data,
                "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
            }
        )

    async def rerank(request: Request) -> Response:
        try:
            body = await read_body(request)
            query, documents = body.get("query"), body.get("documents")
            if not isinstance(query, str) or not isinstance(documents, list):
                raise schema_error("give `query` (a string) and `documents` (a list of strings)", "query")
        except RequestRefused as exc:
            return _refused(exc)
        results = [
            {"index": i, "document": {"text": str(doc)}, "relevance_score": _word_overlap(query, str(doc))}
            for i, doc in enumerate(documents)
        ]
        results.sort(key=lambda result: -result["relevance_score"])
        top_n = body.get("top_n")
        if isinstance(top_n, int) and top_n > 0:
            results = results[:top_n]
        return _ok({"id": f"rerank-{uuid.uuid4().hex}", "model": model.name, "results": results})

    async def score(request: Request) -> Response:
        try:
            body = await read_body(request)
            first, second = body.get("text_1", body.get("queries")), body.get("text_2", body.get("documents"))
            firsts = [first] if isinstance(first, str) else first
            seconds = [second] if isinstance(second, str) else second
            if not isinstance(firsts, list) or not isinstance(seconds, list) or not seconds:
                raise schema_error("give `text_1` and `text_2` (strings or lists of strings)", "text_1")
            if len(firsts) == 1:
                firsts = firsts * len(seconds)
            if len(firsts) != len(seconds):
                raise RequestRefused("`text_1` must hold one text or as many as `text_2`", param="text_1")
        except RequestRefused as exc:
            return _refused(exc)
        data = [
            {"index": i, "object": "score", "score": _word_overlap(str(a), str(b))}
            for i, (a, b) in enumerate(zip(firsts, seconds, strict=True))
        ]
        return _ok({"id": f"score-{uuid.uuid4().hex}", "object": "list", "model": model.name, "data": data})

    async def health(request: Request) -> Response:
        return Response(status_code=200)

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def reset_prefix_cache(request: Request) -> Response:
        if not engine.reset_prefix_cache():
            return _error("cannot reset the prefix cache while requests are running", 400)
        return Response(status_code=200)

    async def version(request: Request) -> Response:
        return _ok({"version": "kvgate-simulated"})

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        engine.start()
        if on_startup is not None:
            on_startup()
        yield
        await engine.close()

    return Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/responses", responses, methods=["POST"]),
            Route("/v1/messages", messages, methods=["POST"]),
            Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/tokenize", tokenize, methods=["POST"]),
            Route("/detokenize", detokenize, methods=["POST"]),
            Route("/v1/embeddings", embeddings, methods=["POST"]),
            *(Route(path, rerank, methods=["POST"]) for path in ("/v1/rerank", "/rerank", "/v2/rerank")),
            *(Route(path, score, methods=["POST"]) for path in ("/v1/score", "/score")),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"]),
            Route("/version", version, methods=["GET"]),
        ],
        lifespan=lifespan,
    )


def _sse(
    engine: SimulatedEngine,
    generation: GenerationRequest,
    tokenizer: PromptTokenizer,
    api: _GenerationApi,
    header: dict,
    include_usage: bool,
) -> StreamingResponse:
    """The generation as server-sent events in vLLM's chunk format, ending with `data: [DONE]`."""

    async def events() -> AsyncIterator[bytes]:
        count = 0
        generator = engine.generate(generation)
        try:
            async for token in generator:
                if count == 0 and api.first_chunk_choice is not None:
                    yield _frame({**header, "choices": [api.first_chunk_choice]}, include_usage)
                count += 1
                finish = "length" if count == generation.max_tokens else None
                choice = api.chunk_choice(tokenizer.output_text(token), finish)
                yield _frame({**header, "choices": [choice]}, include_usage)
        finally:
            await generator.aclose()
        if include_usage:
            usage = _usage(len(generation.prompt), count, generation.cached_tokens)
            yield _frame({**header, "choices": [], "usage": usage, **_kv_transfer(generation)}, False)
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def _responses_usage(prompt_tokens: int, output_tokens: int, cached_tokens: int) -> dict:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + output_tokens,
    }


def _sse_event(kind: str, payload: dict) -> bytes:
    """One server-sent event as vLLM writes those of the Responses and Messages APIs."""
    return b"event: " + kind.encode() + b"\ndata: " + _json.encode(payload) + b"\n\n"


@dataclass(slots=True)
class _ResponsesAnswer:
    """A /v1/responses answer: its one output message, whole or as the API's stream of events.
    Output always ends at the token limit, so the response is `incomplete` (max_output_tokens)."""

    response_id: str
    message_id: str
    model: str
    body: dict
    created_at: int = field(default_factory=lambda: int(time.time()))

    def message(self, text: str, status: str) -> dict:
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        return {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": [part] if status == "completed" else [],
        }

    def response(self, text: str | None, usage: dict | None) -> dict:
        """The response object: in progress (text None), or final with its output and usage."""
        body = self.body
        final = text is not None
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "model": self.model,
            "status": "incomplete" if final else "in_progress",
            "incomplete_details": {"reason": "max_output_tokens"} if final else None,
            "instructions": body.get("instructions"),
            "output": [self.message(text, "completed")] if final else [],
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "tool_choice": body.get("tool_choice", "auto"),
            "tools": body.get("tools") or [],
            "temperature": body.get("temperature"),
            "top_p": body.get("top_p"),
            "max_output_tokens": body.get("max_output_tokens"),
            "previous_response_id": body.get("previous_response_id"),
            "reasoning": body.get("reasoning"),
            "text": {"format": {"type": "text"}},
            "truncation": body.get("truncation", "disabled"),
            "metadata": body.get("metadata"),
            "user": body.get("user"),
            "usage": usage,
        }

    async def events(
        self, engine: SimulatedEngine, generation: GenerationRequest, tokenizer: PromptTokenizer
    ) -> AsyncIterator[bytes]:
        sequence = 0

        def event(kind: str, **payload: Any) -> bytes:
            nonlocal sequence
            frame = _sse_event(kind, {"type": kind, "sequence_number": sequence, **payload})
            sequence += 1
            return frame

        at = {"output_index": 0, "item_id": self.message_id}
        yield event("response.created", response=self.response(None, None))
        yield event("response.in_progress", response=self.response(None, None))
        yield event("response.output_item.added", output_index=0, item=self.message("", "in_progress"))
        empty = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        yield event("response.content_part.added", **at, content_index=0, part=empty)
        pieces: list[str] = []
        generator = engine.generate(generation)
        try:
            async for token in generator:
                piece = tokenizer.output_text(token)
                pieces.append(piece)
                yield event("response.output_text.delta", **at, content_index=0, delta=piece, logprobs=[])
        finally:
            await generator.aclose()
        text = "".join(pieces)
        yield event("response.output_text.done", **at, content_index=0, text=text, logprobs=[])
        done = {"type": "output_text", "text": text, "annotations": []}
        yield event("response.content_part.done", **at, content_index=0, part=done)
        yield event("response.output_item.done", output_index=0, item=self.message(text, "completed"))
        usage = _responses_usage(len(generation.prompt), len(pieces), generation.cached_tokens)
        yield event("response.completed", response=self.response(text, usage))


def _anthropic_usage(prompt_tokens: int, output_tokens: int, cached_tokens: int) -> dict:
    # input_tokens counts the whole prompt, as vLLM reports it; cache_read_input_tokens the part
    # served from the prefix cache (a field of vLLM's AnthropicUsage).
    return {
        "input_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "cache_read_input_tokens": cached_tokens,
    }


async def _anthropic_events(
    engine: SimulatedEngine,
    generation: GenerationRequest,
    tokenizer: PromptTokenizer,
    message_id: str,
    model: str,
) -> AsyncIterator[bytes]:
    """The Messages API's stream as vLLM converts its chat stream: message_start, one text block
    (content_block_start, a content_block_delta per token, content_block_stop), message_delta with
    the stop reason and usage, message_stop."""
    start = {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "content": [],
        "model": model,
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": len(generation.prompt), "output_tokens": 0},
    }
    yield _sse_event("message_start", {"type": "message_start", "message": start})
    count = 0
    generator = engine.generate(generation)
    try:
        async for token in generator:
            if count == 0:
                block = {
                    "type": "content_block_start",
                    "index": 0,
                    "content_block": {"type": "text", "text": ""},
                }
                yield _sse_event("content_block_start", block)
            count += 1
            delta = {"type": "text_delta", "text": tokenizer.output_text(token)}
            yield _sse_event(
                "content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta}
            )
    finally:
        await generator.aclose()
    if count:
        yield _sse_event("content_block_stop", {"type": "content_block_stop", "index": 0})
    usage = _anthropic_usage(len(generation.prompt), count, generation.cached_tokens)
    stop = {"type": "message_delta", "delta": {"stop_reason": "max_tokens"}, "usage": usage}
    yield _sse_event("message_delta", stop)
    yield _sse_event("message_stop", {"type": "message_stop"})


def _simulated_embedding(tokens, dimensions: int = 8) -> list[float]:
    """A made-up unit vector, the same for the same tokens (no model runs in the simulator)."""
    digest = hashlib.sha256(np.asarray(tokens, dtype=np.uint32).tobytes()).digest()
    values = [byte - 127.5 for byte in digest[:dimensions]]
    norm = math.sqrt(sum(value * value for value in values)) or 1.0
    return [value / norm for value in values]


def _word_overlap(first: str, second: str) -> float:
    """A made-up relevance: the share of distinct words the two texts have in common."""
    a, b = set(first.lower().split()), set(second.lower().split())
    return len(a & b) / len(a | b) if a | b else 0.0


def _frame(payload: dict, usage_field: bool) -> bytes:
    if usage_field:
        payload["usage"] = None  # vLLM sends usage: null on every chunk when include_usage is on
    return b"data: " + _json.encode(payload) + b"\n\n"

"""`kvgate sim` as a real process: vLLM's OpenAI endpoints, cached_tokens, metrics and KV events."""

from __future__ import annotations

import json
import time

import httpx
import msgspec
import pytest
import zmq
from transformers import AutoTokenizer

from kvgate_testing.metrics import metric_samples
from kvgate_testing.ports import free_port
from kvgate_testing.processes import python_command, start_process
from kvwire import AllBlocksCleared, BlockStored, decode_batch
from router.config import builtin_tokenizer_dir

MODEL = "tiny-qwen3"
TOPIC = "kv-events"
# 40 words: well over two 16-token blocks.
LONG_PROMPT = " ".join(f"word{i} of a shared system prompt," for i in range(40))


class Sim:
    def __init__(self, url: str, events_endpoint: str, replay_endpoint: str):
        self.url = url
        self.events_endpoint = events_endpoint
        self.replay_endpoint = replay_endpoint
        self.client = httpx.Client(base_url=url, timeout=30)

    def post(self, path: str, body: dict) -> httpx.Response:
        return self.client.post(path, json=body)


@pytest.fixture(scope="module")
def sim():
    port, pub, replay = free_port(), free_port(), free_port()
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://127.0.0.1:{pub}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay}",
        "topic": TOPIC,
    }
    args = python_command(
        "-m", "router.cli", "sim", "--model", MODEL, "--tokenizer", "builtin:qwen3", "--port", str(port),
        "--block-size", "16", "--num-gpu-blocks-override", "512", "--kv-events-config", json.dumps(events),
        "--prefill-us-per-token", "20", "--decode-ms-per-token", "1",
        "--lora-modules", "sql-adapter=/nowhere",
    )  # fmt: skip
    process = start_process(args, f"http://127.0.0.1:{port}/health", timeout_s=90)
    try:
        yield Sim(f"http://127.0.0.1:{port}", events["endpoint"], events["replay_endpoint"])
    finally:
        process.stop()


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(builtin_tokenizer_dir("qwen3"))


def test_models_entry_says_it_is_simulated(sim):
    entry = sim.client.get("/v1/models").json()["data"][0]
    assert entry["id"] == MODEL
    assert entry["owned_by"] == "kvgate-simulated"


def test_completion_repeat_reports_cached_tokens(sim, tokenizer):
    body = {"model": MODEL, "prompt": LONG_PROMPT + " completion", "max_tokens": 4}
    first = sim.post("/v1/completions", body).json()
    second = sim.post("/v1/completions", body).json()
    prompt_tokens = len(tokenizer(body["prompt"])["input_ids"])
    assert first["usage"]["prompt_tokens"] == prompt_tokens
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # Every full block except the one holding the last token (always computed, as in vLLM).
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == (prompt_tokens - 1) // 16 * 16
    assert second["usage"]["completion_tokens"] == 4
    assert first["choices"][0]["text"] == second["choices"][0]["text"]  # deterministic output
    assert second["choices"][0]["finish_reason"] == "length"
    assert len(tokenizer.encode(second["choices"][0]["text"], add_special_tokens=False)) == 4


def test_chat_uses_the_chat_template_and_streams_like_vllm(sim, tokenizer):
    messages = [{"role": "system", "content": LONG_PROMPT}, {"role": "user", "content": "stream please"}]
    expected = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected_ids = tokenizer.encode(expected, add_special_tokens=False)
    assert sim.post("/tokenize", {"model": MODEL, "messages": messages}).json()["tokens"] == expected_ids

    body = {"model": MODEL, "messages": messages, "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    sim.post("/v1/chat/completions", {**body, "stream": False})  # warm the prefix
    with sim.client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert len(content) == 3
    assert content[-1]["choices"][0]["finish_reason"] == "length"
    usage = chunks[-1]
    assert usage["choices"] == []
    assert usage["usage"]["prompt_tokens"] == len(expected_ids)
    assert usage["usage"]["prompt_tokens_details"]["cached_tokens"] == (len(expected_ids) - 1) // 16 * 16


def test_completion_stream_chunks(sim):
    body = {"model": MODEL, "prompt": "short", "max_tokens": 2, "stream": True}
    with sim.client.stream("POST", "/v1/completions", json=body) as response:
        lines = [line for line in response.iter_lines() if line]
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert [c["object"] for c in chunks] == ["text_completion"] * 2
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, "length"]
    assert "usage" not in chunks[0]  # only with stream_options.include_usage


def vllm_metrics(sim) -> dict[str, float]:
    """The simulator's vllm:* samples by name (each has one series, labelled with the model)."""
    samples = metric_samples(sim.client.get("/metrics").text)
    return {name: value for (name, _labels), value in samples.items() if name.startswith("vllm:")}


def test_metrics_use_vllm_names_and_count_prefix_hits(sim):
    before = vllm_metrics(sim)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):  # fmt: skip
        assert name in before
    assert 'model_name="tiny-qwen3"' in sim.client.get("/metrics").text
    prompt = "metrics " + LONG_PROMPT
    first = sim.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1}).json()
    second = sim.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1}).json()
    after = vllm_metrics(sim)
    prompt_tokens = second["usage"]["prompt_tokens"]
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0 < cached
    queries = after["vllm:prefix_cache_queries_total"] - before["vllm:prefix_cache_queries_total"]
    assert queries == 2 * prompt_tokens
    assert after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"] == cached


def test_a_running_request_shows_in_metrics(sim):
    import threading

    # 400 decode tokens at 1 ms each keeps the request running while we scrape.
    worker = threading.Thread(
        target=sim.post, args=("/v1/completions", {"model": MODEL, "prompt": "busy", "max_tokens": 400})
    )
    worker.start()
    try:
        deadline = time.monotonic() + 10
        running = 0.0
        while time.monotonic() < deadline and running < 1:
            running = vllm_metrics(sim)["vllm:num_requests_running"]
            time.sleep(0.01)
        assert running == 1
    finally:
        worker.join()


def test_bad_requests_get_vllm_style_errors(sim):
    wrong_model = sim.post("/v1/completions", {"model": "nope", "prompt": "x"})
    assert wrong_model.status_code == 404
    assert "nope" in wrong_model.json()["error"]["message"]
    assert wrong_model.json()["error"]["type"] == "NotFoundError"
    no_prompt = sim.post("/v1/completions", {"model": MODEL})
    assert no_prompt.status_code == 400 and no_prompt.json()["error"]["param"] == "body.prompt"
    bad_json = sim.client.post("/v1/completions", content=b"{not json")
    assert bad_json.status_code == 400 and "not valid JSON" in bad_json.json()["error"]["message"]
    too_big = sim.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 100_000})
    assert too_big.status_code == 400 and "maximum context length" in too_big.json()["error"]["message"]
    pool = sim.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 9000})
    assert pool.status_code == 400 and "--num-gpu-blocks-override" in pool.json()["error"]["message"]
    bad_messages = sim.post("/v1/chat/completions", {"model": MODEL, "messages": "hello"})
    assert bad_messages.status_code == 400 and bad_messages.json()["error"]["param"] == "body.messages"


def test_cache_salt_isolates_and_events_announce_then_clear(sim):
    context = zmq.Context()
    subscriber = context.socket(zmq.SUB)
    subscriber.setsockopt(zmq.LINGER, 0)
    subscriber.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
    subscriber.connect(sim.events_endpoint)
    try:
        time.sleep(0.3)  # ZMQ's slow joiner
        prompt = "salted " + LONG_PROMPT
        salted = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "cache_salt": "tenant-a"}
        sim.post("/v1/completions", salted)
        unsalted = sim.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1}).json()
        assert unsalted["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        again = sim.post("/v1/completions", salted).json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0

        assert sim.client.post("/reset_prefix_cache").status_code == 200
        events = []
        while subscriber.poll(timeout=1000):
            _, _, payload = subscriber.recv_multipart()
            events.extend(decode_batch(payload).events)
        stored = [e for e in events if isinstance(e, BlockStored)]
        assert any(e.extra_keys and e.extra_keys[0] == ["tenant-a"] for e in stored)
        assert all(e.medium == "GPU" and e.block_size == 16 for e in stored)
        assert isinstance(events[-1], AllBlocksCleared)
        after_reset = sim.post("/v1/completions", salted).json()
        assert after_reset["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    finally:
        subscriber.close(linger=0)
        context.term()


def test_a_lora_name_is_served_and_its_blocks_hash_apart(sim):
    entries = {e["id"]: e for e in sim.client.get("/v1/models").json()["data"]}
    assert entries["sql-adapter"]["parent"] == MODEL
    prompt = "lora " + LONG_PROMPT
    sim.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1})
    body = {"model": "sql-adapter", "prompt": prompt, "max_tokens": 1}
    first = sim.post("/v1/completions", body).json()
    assert first["model"] == "sql-adapter"
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # base-model blocks do not match
    assert sim.post("/v1/completions", body).json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_tokenize_a_prompt_like_vllm(sim, tokenizer):
    answer = sim.post(
        "/tokenize", {"model": MODEL, "prompt": "Hello world", "return_token_strs": True}
    ).json()
    assert answer["tokens"] == tokenizer("Hello world")["input_ids"]
    assert answer["count"] == len(answer["tokens"]) and answer["max_model_len"] == 32768
    assert answer["token_strs"] == tokenizer.convert_ids_to_tokens(answer["tokens"])
    assert msgspec.json.decode(sim.client.get("/version").content)["version"] == "kvgate-simulated"


# ---- the Responses and Anthropic Messages APIs ----


def _events(response: httpx.Response) -> list[tuple[str, dict]]:
    """(event name, data) of each server-sent event of a Responses or Messages stream."""
    events, name = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line.removeprefix("event: ")
        elif line.startswith("data: "):
            events.append((name, json.loads(line.removeprefix("data: "))))
            name = None
    return events


def test_responses_render_their_input_like_vllm_and_repeats_hit_the_cache(sim, tokenizer):
    instructions = "responses " + LONG_PROMPT
    parts = [{"type": "input_text", "text": "first part"}, {"type": "input_text", "text": "second"}]
    body = {"model": MODEL, "instructions": instructions, "max_output_tokens": 3,
            "input": [{"type": "message", "role": "user", "content": parts}]}  # fmt: skip
    # vLLM: the instructions as a system message, text parts joined by newlines, the model's template.
    chat = [{"role": "system", "content": instructions}, {"role": "user", "content": "first part\nsecond"}]
    expected = tokenizer.encode(
        tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    )
    first = sim.post("/v1/responses", body).json()
    assert first["object"] == "response" and first["id"].startswith("resp_")
    assert first["usage"]["input_tokens"] == len(expected)
    assert first["usage"]["input_tokens_details"]["cached_tokens"] == 0
    assert first["usage"]["output_tokens"] == 3
    # Output always stops at the limit: incomplete, as the Responses API says it.
    assert first["status"] == "incomplete" and first["incomplete_details"] == {"reason": "max_output_tokens"}
    message = first["output"][0]
    assert message["type"] == "message" and message["role"] == "assistant"
    assert message["content"][0]["type"] == "output_text" and message["content"][0]["text"]
    second = sim.post("/v1/responses", body).json()
    assert second["usage"]["input_tokens_details"]["cached_tokens"] == (len(expected) - 1) // 16 * 16

    with sim.client.stream("POST", "/v1/responses", json={**body, "stream": True}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = _events(response)
    assert all(name == data["type"] for name, data in events)
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    kinds = [name for name, _ in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]  # fmt: skip
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]  # fmt: skip
    deltas = [data["delta"] for name, data in events if name == "response.output_text.delta"]
    final = events[-1][1]["response"]
    assert len(deltas) == 3 and "".join(deltas) == final["output"][0]["content"][0]["text"]
    assert final["usage"]["input_tokens_details"]["cached_tokens"] == (len(expected) - 1) // 16 * 16


def test_messages_render_like_vllm_and_stream_anthropic_events(sim, tokenizer):
    system = "messages " + LONG_PROMPT
    blocks = [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}]
    body = {"model": MODEL, "max_tokens": 3, "system": [{"type": "text", "text": system}],
            "messages": [{"role": "user", "content": blocks}]}  # fmt: skip
    chat = [{"role": "system", "content": system}, {"role": "user", "content": "part one\npart two"}]
    expected = tokenizer.encode(
        tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    )
    first = sim.post("/v1/messages", body).json()
    assert first["type"] == "message" and first["role"] == "assistant"
    assert first["content"][0]["type"] == "text" and first["stop_reason"] == "max_tokens"
    assert first["usage"] == {"input_tokens": len(expected), "output_tokens": 3, "cache_read_input_tokens": 0}

    with sim.client.stream("POST", "/v1/messages", json={**body, "stream": True}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = _events(response)
    assert all(name == data["type"] for name, data in events)
    kinds = [name for name, _ in events]
    assert kinds == ["message_start", "content_block_start", *["content_block_delta"] * 3,
                     "content_block_stop", "message_delta", "message_stop"]  # fmt: skip
    assert events[0][1]["message"]["usage"]["input_tokens"] == len(expected)
    assert all(
        data["delta"]["type"] == "text_delta" for name, data in events if name == "content_block_delta"
    )
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] == "max_tokens"
    assert delta["usage"]["cache_read_input_tokens"] == (len(expected) - 1) // 16 * 16


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
RESPONSES = {"model": MODEL, "input": "hi", "max_output_tokens": 1}
MESSAGES = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
SCHEMA = "Bad Request"  # vLLM's type for a body that fails its request schema


@pytest.mark.parametrize(
    ("path", "body", "error_type", "param"),
    [
        ("/v1/chat/completions", {**CHAT, "temperature": "hot"}, SCHEMA, "body.temperature"),
        ("/v1/chat/completions", {**CHAT, "temperature": -0.5}, "BadRequestError", "temperature"),
        ("/v1/chat/completions", {**CHAT, "top_p": 0}, "BadRequestError", "top_p"),
        ("/v1/chat/completions", {**CHAT, "top_p": 1.5}, "BadRequestError", "top_p"),
        ("/v1/chat/completions", {**CHAT, "max_tokens": 0}, "BadRequestError", "max_tokens"),
        ("/v1/chat/completions", {**CHAT, "n": 0}, "BadRequestError", "n"),
        ("/v1/chat/completions", {**CHAT, "presence_penalty": 3}, "BadRequestError", "presence_penalty"),
        ("/v1/chat/completions", {**CHAT, "max_tokens": 2.5}, SCHEMA, "body.max_tokens"),
        (
            "/v1/chat/completions",
            {**CHAT, "messages": [{"role": 7, "content": "x"}]},
            SCHEMA,
            "body.messages.0.role",
        ),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "seed": "lucky"}, SCHEMA, "body.seed"),
        (
            "/v1/responses",
            {**RESPONSES, "input": [{"role": "wizard", "content": "x"}]},
            SCHEMA,
            "body.input.0.role",
        ),
        ("/v1/responses", {**RESPONSES, "max_output_tokens": 0}, "BadRequestError", "max_output_tokens"),
        ("/v1/responses", {**RESPONSES, "temperature": "hot"}, SCHEMA, "body.temperature"),
        (
            "/v1/messages",
            {**MESSAGES, "messages": [{"role": "wizard", "content": "x"}]},
            SCHEMA,
            "body.messages.0.role",
        ),
        ("/v1/messages", {"model": MODEL, "messages": MESSAGES["messages"]}, SCHEMA, "body.max_tokens"),
        ("/v1/messages", {**MESSAGES, "temperature": -1}, "BadRequestError", "temperature"),
    ],
)
def test_what_vllm_refuses_is_refused_in_its_shape(sim, path, body, error_type, param):
    response = sim.post(path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"], error["code"]) == (error_type, param, 400)
    assert param.removeprefix("body.").split(".")[0] in error["message"]


def test_what_vllm_accepts_is_served(sim):
    # pydantic reads a numeric string as a number; vLLM's chat takes any role string (its custom-role
    # message type) and leaves the role to the chat template (Qwen3's renders only the ones it knows).
    lenient = {**CHAT, "temperature": "0.5", "top_p": 1, "max_tokens": 2.0}
    assert sim.post("/v1/chat/completions", lenient).status_code == 200
    custom_role = {**CHAT, "messages": [{"role": "wizard", "content": "x"}, *CHAT["messages"]]}
    assert sim.post("/v1/chat/completions", custom_role).status_code == 200

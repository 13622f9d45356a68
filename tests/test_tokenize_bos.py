"""Token parity for a tokenizer that adds a BOS token (Llama-3-style, tests/data/bos_tokenizer, built
by scripts/build_bos_tokenizer.py): a chat holds the one BOS its template writes, a completion the one
its encode adds, as vLLM computes them (chat: the template rendered to text, encoded without special
tokens unless the request asks; completions: encoded with them unless the request says not to).
Through PromptTokenizer, the gateway's RequestTokenizer (on the loop and off it), and a real gateway
whose engines announce the blocks of the engine's own tokens."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import numpy as np
import pytest

from kvgate_testing.kv_fleet import MODEL, Fleet
from kvgate_testing.tokenizers import BOS_TOKENIZER_DIR, completion_tokens, config, whole_prompt_tokens
from router.policies.base import RouteRequest
from router.tokenize import OFF_LOOP_MIN_CHARS, PromptTokenizer, RequestTokenizer
from scripts.build_bos_tokenizer import BOS, build

CHAT = {
    "messages": [
        {"role": "system", "content": "You are a helpful assistant. Answer briefly."},
        {"role": "user", "content": "What does the KV cache keep, and why does a prefix hit help?"},
    ]
}
PROMPT = "The gateway routes each request to the engine that already holds its prefix."


@pytest.fixture(scope="module")
def bos_tokenizer() -> PromptTokenizer:
    return PromptTokenizer(str(BOS_TOKENIZER_DIR))


@pytest.fixture(scope="module")
def bos_id(bos_tokenizer: PromptTokenizer) -> int:
    bos_id = bos_tokenizer.tokenizer.bos_token_id
    assert bos_tokenizer.tokenizer.bos_token == BOS and isinstance(bos_id, int)
    return bos_id


def test_the_shipped_tokenizer_is_what_the_script_builds(tmp_path) -> None:
    build(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (BOS_TOKENIZER_DIR / name).read_bytes(), (
            f"tests/data/bos_tokenizer/{name} is not what the script builds now (another `tokenizers`?): "
            "run `python scripts/build_bos_tokenizer.py` and commit the result"
        )
    assert sum(path.stat().st_size for path in BOS_TOKENIZER_DIR.iterdir()) < 200_000


def test_the_test_tokenizer_adds_a_bos_where_llama_3_does(
    bos_tokenizer: PromptTokenizer, bos_id: int
) -> None:
    hf = bos_tokenizer.tokenizer
    assert hf.encode(PROMPT)[0] == bos_id and hf.encode(PROMPT).count(bos_id) == 1
    assert bos_id not in hf.encode(PROMPT, add_special_tokens=False)
    assert json.loads((BOS_TOKENIZER_DIR / "tokenizer_config.json").read_text())["add_bos_token"] is True
    text = hf.apply_chat_template(CHAT["messages"], add_generation_prompt=True, tokenize=False)
    assert text.startswith(BOS) and text.count(BOS) == 1
    # The router's fast paths are on for it, so the parity below runs through them.
    assert bos_tokenizer.piecewise and bos_tokenizer.segmented and bos_tokenizer._ascii is not None
    assert bos_tokenizer.fast_render.engine != "off"


def test_a_chat_holds_the_one_bos_its_template_writes(bos_tokenizer: PromptTokenizer, bos_id: int) -> None:
    tokens = bos_tokenizer.tokens_for(CHAT).tolist()
    assert tokens == whole_prompt_tokens(bos_tokenizer, CHAT)
    assert tokens[0] == bos_id and tokens.count(bos_id) == 1
    # Encoding the rendered text with special tokens would add a second one: not what vLLM does.
    rendered = bos_tokenizer.render_chat(CHAT)
    assert bos_tokenizer.tokenizer.encode(rendered)[:2] == [bos_id, bos_id]
    # A follow-up turn (its history's tokens from the caches) keeps the one BOS.
    follow_up = {
        "messages": [*CHAT["messages"], {"role": "assistant", "content": "Keys and values."},
                     {"role": "user", "content": "And on a miss?"}]
    }  # fmt: skip
    tokens = bos_tokenizer.tokens_for(follow_up).tolist()
    assert tokens == whole_prompt_tokens(bos_tokenizer, follow_up) and tokens.count(bos_id) == 1


def test_a_chat_that_asks_for_special_tokens_gets_the_second_bos_vllm_adds(
    bos_tokenizer: PromptTokenizer, bos_id: int
) -> None:
    """vLLM's ChatCompletionRequest.add_special_tokens (default false) adds them "on top of what is
    added by the chat template": a request that sets it reaches the engine with two BOS."""
    body = {**CHAT, "add_special_tokens": True}
    tokens = bos_tokenizer.tokens_for(body).tolist()
    assert tokens == whole_prompt_tokens(bos_tokenizer, body)
    assert tokens[:2] == [bos_id, bos_id]


def test_a_completion_holds_the_one_bos_its_encode_adds(bos_tokenizer: PromptTokenizer, bos_id: int) -> None:
    tokens = bos_tokenizer.tokens_for({"prompt": PROMPT}).tolist()
    assert tokens == completion_tokens(bos_tokenizer, {"prompt": PROMPT})
    assert tokens[0] == bos_id and tokens.count(bos_id) == 1
    unspecial = {"prompt": PROMPT, "add_special_tokens": False}
    assert bos_tokenizer.tokens_for(unspecial).tolist() == completion_tokens(bos_tokenizer, unspecial)
    assert bos_id not in bos_tokenizer.tokens_for(unspecial).tolist()
    # A prompt that writes the BOS itself gets another from the encode, on the engine as here.
    written = {"prompt": BOS + PROMPT}
    assert bos_tokenizer.tokens_for(written).tolist() == completion_tokens(bos_tokenizer, written)
    assert bos_tokenizer.tokens_for(written).tolist()[:2] == [bos_id, bos_id]


@pytest.mark.parametrize("length", ["short", "off-loop"])
def test_the_gateway_tokenizer_matches_on_and_off_the_event_loop(bos_id: int, length: str) -> None:
    # Non-ASCII text past OFF_LOOP_MIN_CHARS is encoded in the tokenizer thread.
    content = "un document déjà lu sur les caches. " * (
        1 + OFF_LOOP_MIN_CHARS // 30 if length != "short" else 1
    )
    chat = {"model": "qwen", "messages": [{"role": "user", "content": content}]}
    completion = {"model": "qwen", "prompt": content}
    tokenizer = RequestTokenizer(config(tokenizer="bos"))
    prompt_tokenizer = tokenizer.tokenizer("qwen")
    assert prompt_tokenizer is not None

    async def prepare(body: dict) -> list[int]:
        request = RouteRequest(request_id="r", model="qwen", body=body)
        await tokenizer.prepare(request)
        assert request.tokens is not None
        return request.tokens.tolist()

    async def run() -> tuple[list[int], list[int]]:
        try:
            return await prepare(chat), await prepare(completion)
        finally:
            await tokenizer.close()

    chat_tokens, completion_tokens_ = asyncio.run(run())
    assert chat_tokens == whole_prompt_tokens(prompt_tokenizer, chat) and chat_tokens.count(bos_id) == 1
    assert completion_tokens_ == completion_tokens(prompt_tokenizer, completion)
    assert completion_tokens_.count(bos_id) == 1


@pytest.fixture(scope="module")
def bos_fleet() -> Iterator[Fleet]:
    fleet = Fleet(tokenizer=str(BOS_TOKENIZER_DIR))
    try:
        yield fleet
    finally:
        fleet.close()


def test_a_real_gateway_finds_the_blocks_an_engine_announced_for_its_own_tokens(
    bos_fleet: Fleet, bos_tokenizer: PromptTokenizer
) -> None:
    """The engine's blocks hash the tokens it computed (one BOS); a gateway that tokenized with a
    BOS too many, or none, would look up other blocks and miss them."""
    document = "A survey of tidal turbines in northern fjords, their placement and their yield. " * 12
    chat = {
        "model": MODEL,
        "messages": [{"role": "system", "content": document}, {"role": "user", "content": "Where?"}],
        "max_tokens": 2,
    }
    completion = {"model": MODEL, "prompt": document + " In short:", "max_tokens": 2}
    chat_tokens = whole_prompt_tokens(bos_tokenizer, chat)
    completion_tokens_ = completion_tokens(bos_tokenizer, completion)
    bos_fleet.cache("b1", np.asarray(chat_tokens, dtype=np.uint32), 1000)
    bos_fleet.cache("b2", np.asarray(completion_tokens_, dtype=np.uint32), 5000)
    bos_fleet.wait_for(lambda m: m["backends"]["b1"]["blocks"] and m["backends"]["b2"]["blocks"])
    for body, path, home, engine_tokens in (
        (chat, "/v1/chat/completions", "b1", chat_tokens),
        (completion, "/v1/completions", "b2", completion_tokens_),
    ):
        response = bos_fleet.client.post(path, json=body)
        assert response.status_code == 200
        assert response.headers["x-kvgate-backend"] == home
        decision = bos_fleet.prefix_map()["decisions"][0]
        assert decision["prompt_tokens"] == len(engine_tokens)
        assert decision["cached_tokens"] == len(engine_tokens) - len(engine_tokens) % 16

"""`kvgate epp` launching two simulated engines itself (`launch.simulated_engines`: real processes,
real KV-event streams, real prefix caches): the picks of a repeated long prompt follow the engine
that cached it, and that engine's own `usage` (read by the picker from the response body) says the
prompt was served from its cache. The client plays Envoy: it asks the picker, sends the request to
the endpoint picked, and shows the picker the answer."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from kvgate_testing.ext_proc_client import (
    ExtProcStream,
    exchange,
    response_body_message,
    response_headers_message,
)
from kvgate_testing.gateway import simulated_fleet_config
from kvgate_testing.metrics import metric_samples, sample_key
from kvgate_testing.picker import start_picker

MODEL = "sim-model"
DOCUMENT = "A long shared document about lighthouses, their keepers and the logbooks they kept. " * 30


# Two engines launched and their tokenizer loaded: about 35 s on a busy 2-core machine.
@pytest.mark.slow
def test_a_repeated_long_prompt_goes_to_the_engine_that_cached_it_and_hits_there() -> None:
    config = simulated_fleet_config(MODEL, "kv_aware", num_gpu_blocks=2048, prefill_us_per_token=1)
    with start_picker(config, timeout_s=120) as epp, epp.channel() as channel:
        picks = []
        for question in range(4):
            body = json.dumps(
                {
                    "model": MODEL,
                    "messages": [
                        {"role": "system", "content": DOCUMENT},
                        {"role": "user", "content": f"Question {question}?"},
                    ],
                    "max_tokens": 2,
                }
            ).encode()
            stream = ExtProcStream(channel)
            picked = exchange(stream, "/v1/chat/completions", body)
            assert picked.header, picked.body
            picks.append(picked.header)
            answer = httpx.post(
                f"http://{picked.header}/v1/chat/completions",
                content=body,
                headers={"content-type": "application/json"},
                timeout=30,
            )
            assert answer.status_code == 200
            stream.send(response_headers_message(200))
            stream.recv()
            stream.send(response_body_message(answer.content, True))
            stream.recv()
            stream.close()
            # The engine's BlockStored events reach the picker's index before the next question.
            time.sleep(0.3)
        assert len(set(picks)) == 1, picks
        metrics = metric_samples(httpx.get(f"{epp.url}/metrics", timeout=10).text)
        assert metrics[sample_key("kvgate_epp_picks_total", reason="cache_hit")] == 3
        prompt = metrics[sample_key("kvgate_epp_usage_tokens_total", kind="prompt")]
        cached = metrics[sample_key("kvgate_epp_usage_tokens_total", kind="cached")]
        # Three of the four prompts were served mostly from the engine's cache.
        assert cached > 0.6 * prompt * 3 / 4

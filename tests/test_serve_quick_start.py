"""`kvgate serve --backend URL [--backend URL ...] --model NAME`: a gateway without a file, in front
of real simulated engines (`kvgate sim`, started here), and the flags' mistakes refused in one line
(issue 35)."""

from __future__ import annotations

import os
import subprocess
from collections import Counter

import httpx
import pytest

from kvgate_testing.ports import free_port
from kvgate_testing.processes import REPO_ROOT, python_command, start_process

MODEL = "tiny-qwen3"


@pytest.fixture(scope="module")
def engines():
    """Two simulated engines on free ports (no KV events: the quick start does not read them)."""
    started = []
    try:
        for _ in range(2):
            port = free_port()
            args = python_command(
                "-m", "router.cli", "sim", "--model", MODEL, "--tokenizer", "builtin:qwen3",
                "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
            )  # fmt: skip
            started.append(
                (
                    f"http://127.0.0.1:{port}",
                    start_process(args, f"http://127.0.0.1:{port}/health", timeout_s=90),
                )
            )
        yield [url for url, _ in started]
    finally:
        for _, process in started:
            process.stop()


def test_a_gateway_started_with_backend_flags_routes_to_every_engine(engines):
    port = free_port()
    args = python_command(
        "-m", "router.cli", "serve", "--port", str(port), "--model", MODEL, "--policy", "round_robin",
        *(flag for url in engines for flag in ("--backend", url)),
    )  # fmt: skip
    gateway = start_process(args, f"http://127.0.0.1:{port}/health", timeout_s=60)
    try:
        names = [url.removeprefix("http://") for url in engines]  # backends are named host:port
        health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).json()
        assert health == {"status": "ok", "backends": dict.fromkeys(names, "healthy")}
        served = Counter()
        for n in range(4):
            answer = httpx.post(
                f"http://127.0.0.1:{port}/v1/chat/completions",
                json={
                    "model": MODEL,
                    "messages": [{"role": "user", "content": f"question {n}"}],
                    "max_tokens": 2,
                },
                timeout=30,
            )
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["message"]["content"]
            served[answer.headers["x-kvgate-backend"]] += 1
        assert served == dict.fromkeys(names, 2)  # round_robin: each engine in turn
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()
        assert [entry["id"] for entry in models["data"]] == [MODEL]
    finally:
        gateway.stop()


def _serve(*flags: str) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != "KVGATE_CONFIG"}
    return subprocess.run(
        python_command("-m", "router.cli", "serve", *flags),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO_ROOT,
        env=dict(env, PYTHONPATH=str(REPO_ROOT)),
    )


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ((), "give --config proxy.yaml (or set KVGATE_CONFIG), or start without a file: --backend URL"),
        (("--backend", "http://127.0.0.1:9"), "--backend needs --model NAME"),
        (
            ("--backend", "ftp://127.0.0.1:9", "--model", MODEL),
            "url 'ftp://127.0.0.1:9' must look like http://host:port",
        ),
        (("--backend", "http://127.0.0.1:9", "--model", MODEL, "--config", "proxy.yaml"), "give one of them"),
        (
            ("--backend", "http://127.0.0.1:9", "--model", MODEL, "--policy", "kv_aware"),
            "write a proxy.yaml with kv_events",
        ),
        (
            ("--backend", "http://127.0.0.1:9", "--model", MODEL, "--policy", "fastest"),
            "known policies: round_robin",
        ),
        (("--config", "proxy.yaml", "--model", MODEL), "--model: only with --backend URL"),
        (
            ("--backend", "http://127.0.0.1:9", "--model", MODEL, "--policy", "approximate"),
            "--policy approximate routes by the prompt's tokens: give --tokenizer DIR",
        ),
    ],
)
def test_a_mistake_in_the_quick_start_flags_is_one_line_that_says_what_to_give(flags, expected):
    result = _serve(*flags)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvgate: "), result.stderr
    assert expected in lines[0]

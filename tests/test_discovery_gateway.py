"""The gateway (`kvgate serve`, a real process) finding its engines by label: the fake Kubernetes
API on loopback (real HTTP, list + watch) names simulated engines (`kvgate sim`, real processes with
real KV-event streams) as pods, beside a backend from the file. A pod that becomes ready is routed
to and its KV events indexed; a terminating one gets no new request; a vanished one leaves the
registry and the index; an API server that goes down (and comes back with its history compacted:
410, a re-list) drops none of the backends; the file's backend stays throughout. Without
credentials, `kvgate serve` stops at start with what to give."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
import yaml

from kvgate_testing.fake_kube_api import FakeKubeAPI, endpoint_slice
from kvgate_testing.gateway import start_gateway
from kvgate_testing.ports import free_port
from kvgate_testing.processes import REPO_ROOT, python_command
from kvgate_testing.sim_fleet import EVENTS_TOPIC, MODEL, Engine, EngineFleet
from kvgate_testing.waiting import wait_for

NAMESPACE = "llm"
TOKEN = "gateway-discovery-token"
SERVICE = "vllm"
PROMPT = "The keeper of the lighthouse wrote in the logbook every night, whatever the weather. " * 6


def pod_slice(pod: str, engine: Engine, ready: bool = True, terminating: bool = False) -> dict:
    def port(endpoint: str) -> int:
        return urlsplit(endpoint).port or 0

    return endpoint_slice(
        f"{SERVICE}-{pod}",
        SERVICE,
        {pod: {"address": "127.0.0.1", "ready": ready, "terminating": terminating}},
        port(engine.url),
        {"kv-events": port(engine.events_endpoint), "kv-replay": port(engine.replay_endpoint)},
    )


def backends(url: str) -> dict[str, dict]:
    answer = httpx.get(f"{url}/backends", timeout=10).json()
    return {backend["name"]: backend for backend in answer["backends"]}


def indexed_blocks(url: str, name: str) -> int:
    entry = httpx.get(f"{url}/debug/prefix-map", params={"format": "json"}, timeout=10).json()["backends"]
    return sum((entry.get(name) or {}).get("blocks", {}).values())


def ask(url: str, question: str) -> str:
    """The backend that answered a chat with the shared prompt and `question`."""
    body = {
        "model": MODEL,
        "messages": [{"role": "system", "content": PROMPT}, {"role": "user", "content": question}],
        "max_tokens": 2,
    }
    answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
    assert answer.status_code == 200, answer.text
    return answer.headers["x-kvgate-backend"]


# Three simulated engines and a gateway: about 7 s.
def test_the_gateway_follows_pods_by_label_routes_to_them_and_indexes_their_events(tmp_path: Path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    api = FakeKubeAPI(NAMESPACE, TOKEN).start()
    fleet = EngineFleet(3, num_gpu_blocks=512)
    try:
        fleet.start()
        static, pod_a, pod_b = fleet.engines
        api.apply(pod_slice("vllm-a", pod_a))
        api.apply(pod_slice("vllm-b", pod_b, ready=False))
        config = {
            "models": [{"name": MODEL}],
            "policy": {"name": "round_robin"},
            "health": {"interval_s": 0.5},
            "backends": [
                {
                    "name": "static-0",
                    "url": static.url,
                    "kv_events": {
                        "endpoint": static.events_endpoint,
                        "replay_endpoint": static.replay_endpoint,
                        "topic": EVENTS_TOPIC,
                    },
                }
            ],
            "discovery": {
                "kubernetes": {
                    "namespace": NAMESPACE,
                    "label_selector": f"kubernetes.io/service-name={SERVICE}",
                    "api_server": api.url,
                    "token_file": str(token_file),
                },
                "ports": {"http": "http", "kv_events": "kv-events", "replay": "kv-replay"},
                "kv_events": {"topic": EVENTS_TOPIC},
                "models": [MODEL],
            },
        }
        with start_gateway(config, timeout_s=120) as gateway:
            url = gateway.url
            # The ready pod joins beside the file's backend; the one not ready does not, yet.
            wait_for(lambda: set(backends(url)) == {"static-0", "vllm-a"}, 30, "the ready pod as a backend")
            answered = {ask(url, f"Question {i}?") for i in range(4)}
            assert answered == {"static-0", "vllm-a"}
            wait_for(lambda: indexed_blocks(url, "vllm-a") > 0, 30, "vllm-a's KV events in the index")
            health = httpx.get(f"{url}/health", timeout=10).json()
            assert health["backends"] == {"static-0": "healthy", "vllm-a": "healthy"}
            assert health["discovery"]["api"] == "ok" and health["discovery"]["backends"] == ["vllm-a"]

            # The API server goes down: the set stays. It comes back having compacted its history
            # (the watch gets 410, the gateway lists again) while vllm-b became ready.
            api.stop()
            api.apply(pod_slice("vllm-b", pod_b))
            api.compact()
            assert set(backends(url)) == {"static-0", "vllm-a"}
            wait_for(
                lambda: httpx.get(f"{url}/health", timeout=10).json()["discovery"]["api"] == "failing",
                30,
                "/health saying the API fails",
            )
            served_by_a = backends(url)["vllm-a"]["requests_total"]
            api.start()
            wait_for(lambda: "vllm-b" in backends(url), 30, "the pod the re-list found")
            # vllm-a was kept, not removed and added again (its count would restart at 0).
            assert backends(url)["vllm-a"]["requests_total"] == served_by_a > 0
            assert indexed_blocks(url, "vllm-a") > 0
            assert "vllm-b" in {ask(url, f"Another {i}?") for i in range(6)}
            served_by_a = backends(url)["vllm-a"]["requests_total"]

            # vllm-a terminates: drained at once, no new request reaches it.
            api.apply(pod_slice("vllm-a", pod_a, terminating=True))
            wait_for(lambda: backends(url)["vllm-a"]["draining"], 30, "the terminating pod drained")
            answered = [ask(url, f"While draining {i}?") for i in range(6)]
            assert "vllm-a" not in answered and set(answered) == {"static-0", "vllm-b"}
            assert backends(url)["vllm-a"]["requests_total"] == served_by_a

            # It vanishes: out of the registry and the index; the file's backend stays.
            api.delete(f"{SERVICE}-vllm-a")
            wait_for(lambda: "vllm-a" not in backends(url), 30, "the vanished pod removed")
            page = httpx.get(f"{url}/debug/prefix-map", params={"format": "json"}, timeout=10).json()
            assert "vllm-a" not in page["backends"]
            assert all("vllm-a" not in prefix["backends"] for prefix in page["prefixes"])
            assert set(backends(url)) == {"static-0", "vllm-b"}
            assert "Traceback" not in gateway.process.output()
    finally:
        fleet.stop()
        api.stop()


@pytest.mark.parametrize("face", ["serve", "epp"])
def test_a_face_without_in_cluster_credentials_stops_at_start_saying_what_to_give(tmp_path: Path, face: str):
    config_path = tmp_path / "proxy.yaml"
    config_path.write_text(
        yaml.safe_dump(
            {"models": [{"name": MODEL}], "discovery": {"kubernetes": {"label_selector": "app=vllm"}}}
        )
    )
    env = {key: value for key, value in os.environ.items() if not key.startswith("KUBERNETES_SERVICE")}
    result = subprocess.run(
        python_command("-m", "router.cli", face, "--config", str(config_path), "--port", str(free_port())),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
        env=dict(env, PYTHONPATH=str(REPO_ROOT)),
    )
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert (
        f"{config_path}: invalid configuration at `discovery.kubernetes`: no in-cluster credentials" in line
    )
    assert "or set discovery.kubernetes.api_server and token_file" in line

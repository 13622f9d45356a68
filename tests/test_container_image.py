"""The container images (`make test-image`, marker `container`): scripts/build_image.sh builds them,
and the gateway image, run with podman on the host's loopback in front of simulated engines on the
host, answers the README's two questions with a cache hit on the same engine, runs as a non-root
user, reports healthy through its own HEALTHCHECK, and ends on `podman stop` within the grace
period (SIGTERM handled, not SIGKILL). The cache image runs `cachelayer server` with torch CPU."""

from __future__ import annotations

import secrets
import subprocess
import time

import httpx
import pytest
import yaml

from kvgate_testing.podman import Container, build_images, missing_tools, podman
from kvgate_testing.ports import free_port
from kvgate_testing.routers import kvgate_backends, wait_until_synced
from kvgate_testing.sim_fleet import MODEL, EngineFleet
from kvgate_testing.waiting import wait_for

pytestmark = [pytest.mark.container, pytest.mark.timeout(3600)]

GATEWAY_IMAGE = "localhost/kvgate-gateway:latest"
CACHE_IMAGE = "localhost/kvgate-cache:latest"
# The image's user (Containerfile): not root.
IMAGE_UID = 10001
STOP_GRACE_S = 10
SIGTERM_EXIT = 128 + 15
# The README's example: two questions behind one long system prompt (28 of the engines' 16-token blocks).
SYSTEM = " ".join(f"Rule {n}: answer in one short sentence and cite the manual." for n in range(1, 31))
# Whole blocks the system prompt fills at least (README: 28); the second question must hit them all.
SYSTEM_BLOCKS = 27


@pytest.fixture(scope="module")
def images() -> None:
    if missing := missing_tools():
        pytest.fail(
            f"{', '.join(missing)} missing: bash scripts/install_container_tools.sh (make test-image does it)"
        )
    build_images("gateway cache")


def ask(url: str, question: str) -> tuple[str, int]:
    body = {
        "model": MODEL,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
    }
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60.0)
    assert response.status_code == 200, response.text
    cached = response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return response.headers["x-kvgate-backend"], cached


@pytest.fixture
def engines():
    with EngineFleet(count=2, num_gpu_blocks=512) as fleet:  # started by `with`
        yield fleet


def start_gateway_container(tmp_path, fleet: EngineFleet) -> tuple[Container, str]:
    port = free_port()
    config = {
        # The host's loopback (--network host): nothing beyond this machine reaches it.
        "listen": {"host": "127.0.0.1", "port": port},
        "models": [{"name": MODEL, "tokenizer": "builtin:qwen3"}],
        "backends": kvgate_backends(fleet, "kv_aware"),
        "policy": {"name": "kv_aware"},
    }
    config_file = tmp_path / "proxy.yaml"
    config_file.write_text(yaml.safe_dump(config))
    config_file.chmod(0o644)  # read by the image's user, not the test's
    started = time.monotonic()
    container = Container(
        f"kvgate-test-{secrets.token_hex(4)}",
        GATEWAY_IMAGE,
        args=[],  # the entry point's default: kvgate serve, config from KVGATE_CONFIG
        volumes={config_file: "/etc/kvgate/proxy.yaml"},
        env={"KVGATE_HEALTH_URL": f"http://127.0.0.1:{port}/health"},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: healthy(url) or not container.running(), timeout_s=120, what="the gateway's /health")
        assert container.running(), container.logs()
        # Reported, not asserted (docs/deployment.md quotes it): `podman run` to the first /health 200.
        print(f"gateway container: cold start to first healthy answer {time.monotonic() - started:.1f} s")
    except BaseException:
        print(container.logs())
        container.remove()
        raise
    return container, url


def prefix_map(url: str) -> dict:
    return httpx.get(f"{url}/debug/prefix-map", params={"format": "json"}, timeout=10).json()


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


def test_the_gateway_image_routes_the_second_question_to_the_engine_holding_the_prefix(
    images, engines, tmp_path
):
    container, url = start_gateway_container(tmp_path, engines)
    try:
        # Both engines' KV-event streams reach the gateway inside the container.
        wait_until_synced(url, timeout_s=60)
        first_backend, first_cached = ask(url, "What is a KV cache?")
        assert first_cached == 0
        # The engine's events for the system prompt's blocks reach the index before the second question.
        wait_for(
            lambda: sum(prefix_map(url)["backends"][first_backend]["blocks"].values()) >= SYSTEM_BLOCKS,
            timeout_s=30,
            what=f"{first_backend}'s blocks in the gateway's index",
        )
        second_backend, second_cached = ask(url, "Why route by prefix?")
        assert second_backend == first_backend
        assert second_cached >= SYSTEM_BLOCKS * 16, second_cached

        # Every process of the container runs as the image's user, none as root.
        uids = container.process_uids()
        assert uids and set(uids.values()) == {IMAGE_UID}, uids
        # The image's HEALTHCHECK (kept by --format docker) passes against the running gateway.
        check = podman("healthcheck", "run", container.name, check=False)
        assert check.returncode == 0, check.stdout + check.stderr
    finally:
        print(container.logs())
        container.remove()


def test_podman_stop_ends_the_gateway_with_sigterm_within_its_grace_period(images, engines, tmp_path):
    container, _ = start_gateway_container(tmp_path, engines)
    try:
        exit_code, _took = container.stop(STOP_GRACE_S)
        logs = container.logs()
        # 137 would be SIGKILL after the grace period (SIGTERM ignored or not delivered). uvicorn shuts
        # down on SIGTERM, then ends by the signal it caught: 143, passed on by the init.
        assert exit_code in (0, SIGTERM_EXIT), f"exit code {exit_code}:\n{logs}"
        # The shutdown ran to its end: the lifespan's cleanup (subscribers, health checker) finished.
        assert "Application shutdown complete" in logs, logs
        assert not container.running()
    finally:
        container.remove()


def test_the_cache_image_serves_the_daemon_with_torch_cpu_as_a_non_root_user(images):
    data_port, http_port = free_port(), free_port()
    container = Container(
        f"kvgate-cache-test-{secrets.token_hex(4)}",
        CACHE_IMAGE,
        args=[f"--port={data_port}", f"--http-port={http_port}", "--l1-size-gb=0.1"],
        volumes={},
        env={"CACHELAYER_HEALTH_URL": f"http://127.0.0.1:{http_port}/healthcheck"},
    )
    try:
        url = f"http://127.0.0.1:{http_port}"
        wait_for(
            lambda: _answers(f"{url}/healthcheck") or not container.running(),
            timeout_s=120,
            what="the daemon's /healthcheck",
        )
        assert container.running(), container.logs()
        assert "cachelayer_" in httpx.get(f"{url}/metrics", timeout=5).text
        uids = container.process_uids()
        assert uids and set(uids.values()) == {IMAGE_UID}, uids
        torch = podman("exec", container.name, "python3", "-c", "import torch; print(torch.__version__)")
        assert torch.stdout.strip().endswith("+cpu"), torch.stdout
        exit_code, _took = container.stop(STOP_GRACE_S)
        assert exit_code in (0, SIGTERM_EXIT), f"exit code {exit_code}:\n{container.logs()}"
    finally:
        container.remove()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


def test_build_script_refuses_an_unknown_target():
    result = subprocess.run(
        ["bash", "scripts/build_image.sh", "localhost/kvgate-base:bookworm"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "TARGETS": "nope", "HOME": "/tmp"},
    )
    assert result.returncode == 1
    assert "unknown target nope" in result.stderr

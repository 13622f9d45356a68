"""deploy/prometheus/prometheus.yml: the scrape example's targets are where the gateway and the cache
daemon serve their metrics by default, and its paths are the routes a real gateway and a real
daemon answer with the metrics the Grafana dashboard's job variables look for."""

from __future__ import annotations

import argparse
from urllib.parse import urlsplit

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvgate_testing.backend import start_backend
from kvgate_testing.gateway import start_gateway
from kvgate_testing.ports import free_port
from kvgate_testing.processes import REPO_ROOT, ManagedProcess, python_command, wait_for_http
from router.config import Listen

SCRAPE_CONFIG = REPO_ROOT / "deploy" / "prometheus" / "prometheus.yml"


def _jobs() -> dict[str, dict]:
    config = yaml.safe_load(SCRAPE_CONFIG.read_text())
    return {job["job_name"]: job for job in config["scrape_configs"]}


def _target(job: dict) -> tuple[str, int]:
    (static,) = job["static_configs"]
    (target,) = static["targets"]
    parts = urlsplit(f"//{target}")
    assert parts.hostname and parts.port, target
    return parts.hostname, parts.port


def _families(text: str) -> set[str]:
    return {family.name for family in text_string_to_metric_families(text)}


def test_the_scrape_example_is_prometheus_shaped_yaml():
    config = yaml.safe_load(SCRAPE_CONFIG.read_text())
    assert set(config) == {"global", "scrape_configs"}
    jobs = _jobs()
    assert set(jobs) == {"kvgate", "kvgate-cachelayer"}
    for job in jobs.values():
        assert job["metrics_path"].startswith("/")
        _target(job)  # host:port, as Prometheus wants a static target


def test_the_gateway_job_targets_the_default_port_and_the_real_metrics_route():
    job = _jobs()["kvgate"]
    defaults = Listen()
    assert _target(job) == (defaults.host, defaults.port)
    backend = start_backend("b0", ["m"])
    config = {
        "models": [{"name": "m"}],
        "backends": [
            {"name": "b0", "url": backend.url, "kv_events": {"endpoint": f"tcp://127.0.0.1:{free_port()}"}}
        ],
        "policy": {"name": "kv_aware"},
        # Client keys and an admin token: /metrics stays open to Prometheus all the same.
        "auth": {"api_keys": ["sk-scrape-test-key-0001"]},
        "admin": {"token": "admin-scrape-test-token-0001"},
    }
    try:
        with start_gateway(config) as gateway:  # on a free port: 8080 may be taken on this host
            response = httpx.get(f"{gateway.url}{job['metrics_path']}", timeout=10)
    finally:
        backend.stop()
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    # What the dashboard's "Gateway job" variable lists jobs by: label_values(kvgate_backend_in_flight, job).
    assert "kvgate_backend_in_flight" in _families(response.text)


def test_the_cache_daemon_job_targets_its_default_http_port_and_metrics_route():
    from cachelayer.server.main import add_arguments

    job = _jobs()["kvgate-cachelayer"]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    defaults = parser.parse_args([])
    assert _target(job) == (defaults.host, defaults.http_port)
    http_port = free_port()
    flags = ["--port", "0", "--http-port", str(http_port), "--l1-size-gb", "0.01"]
    daemon = ManagedProcess(python_command("-m", "cachelayer.cli", "server", *flags))
    try:
        wait_for_http(f"http://127.0.0.1:{http_port}/healthcheck", daemon)
        response = httpx.get(f"http://127.0.0.1:{http_port}{job['metrics_path']}", timeout=10)
    finally:
        daemon.stop()
    assert response.status_code == 200, response.text
    # The dashboard's "Cache layer job" variable: label_values(lmcache_mp_l1_usage_ratio, job).
    assert "lmcache_mp_l1_usage_ratio" in _families(response.text)

"""deploy/grafana/kvgate.json: a dashboard Grafana imports, whose every query names a metric that
the real gateway's and the real cache daemon's /metrics pages declare (so a renamed metric breaks
this test, not an operator's dashboard)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvgate_testing.backend import start_backend
from kvgate_testing.gateway import start_gateway
from kvgate_testing.ports import free_port
from kvgate_testing.processes import REPO_ROOT, ManagedProcess, python_command, wait_for_http

DASHBOARD = REPO_ROOT / "deploy" / "grafana" / "kvgate.json"
_METRIC_NAME = re.compile(r"\b(?:kvgate|lmcache)_[a-zA-Z0-9_]+")
# What a family's samples are called, by its type (prometheus_client names counter families without
# `_total`, and a histogram's samples carry suffixes).
_SAMPLE_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("_sum", "_count", "_created"),
    "gauge": ("",),
    "untyped": ("",),
}


def _declared(text: str) -> set[str]:
    """Every sample name the page declares (HELP/TYPE), whether or not it has samples yet."""
    names = set()
    for family in text_string_to_metric_families(text):
        names.update(family.name + suffix for suffix in _SAMPLE_SUFFIXES.get(family.type, ("",)))
        names.update(sample.name for sample in family.samples)
    return names


def _panels(dashboard: dict) -> list[dict]:
    panels = []
    for panel in dashboard["panels"]:
        panels.append(panel)
        panels.extend(panel.get("panels", []))
    return panels


def _queried_metrics(dashboard: dict) -> set[str]:
    names = set()
    for panel in _panels(dashboard):
        for target in panel.get("targets", []):
            names.update(_METRIC_NAME.findall(target["expr"]))
    for variable in dashboard["templating"]["list"]:
        query = variable.get("query")
        if isinstance(query, dict):
            names.update(_METRIC_NAME.findall(query["query"]))
    return names


def test_the_dashboard_is_importable_grafana_json():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 30
    panels = _panels(dashboard)
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    queried = [panel for panel in panels if panel["type"] != "row"]
    assert len(queried) >= 15
    for panel in queried:
        assert panel["targets"], panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        assert len({target["refId"] for target in panel["targets"]}) == len(panel["targets"])


def test_every_metric_the_dashboard_queries_is_on_the_real_metrics_pages(tmp_path: Path):
    queried = _queried_metrics(json.loads(DASHBOARD.read_text()))
    assert any(name.startswith("kvgate_") for name in queried)
    assert any(name.startswith("lmcache_") for name in queried)

    backend = start_backend("b0", ["m"])
    http_port = free_port()
    flags = ["--port", "0", "--http-port", str(http_port), "--l1-size-gb", "0.01"]
    daemon = ManagedProcess(python_command("-m", "cachelayer.cli", "server", *flags))
    config = {
        # kv_aware declares the routing metrics; no tokenizer keeps the start fast.
        "models": [{"name": "m"}],
        "backends": [
            {"name": "b0", "url": backend.url, "kv_events": {"endpoint": f"tcp://127.0.0.1:{free_port()}"}}
        ],
        "policy": {"name": "kv_aware"},
    }
    try:
        with start_gateway(config) as gateway:
            wait_for_http(f"http://127.0.0.1:{http_port}/healthcheck", daemon)
            pages = httpx.get(f"{gateway.url}/metrics", timeout=10).text
            pages += httpx.get(f"http://127.0.0.1:{http_port}/metrics", timeout=10).text
    finally:
        daemon.stop()
        backend.stop()
    missing = sorted(queried - _declared(pages))
    assert not missing, f"the dashboard queries metrics no /metrics page declares: {missing}"

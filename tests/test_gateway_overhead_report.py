"""The gateway overhead benchmark's reports (kvgate_testing/gateway_overhead_report.py, which
benchmarks/gateway_overhead.py writes its results with): worker counts, which rows are synced
workers, the kv_aware table and CPU budget, no SSE rate."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvgate_testing.gateway_overhead_report import (
    synced_workers,
    worker_counts_argument,
    write_kv_aware_report,
    write_report,
)


def test_only_kvgate_rows_with_several_workers_count_the_redis_server():
    assert synced_workers("kvgate kv_aware --workers 2")
    assert synced_workers("kvgate kv_aware --workers 4")
    assert not synced_workers("kvgate kv_aware --workers 1")
    assert not synced_workers("kvgate least_loaded --workers 1")
    assert not synced_workers("kvgate kv_aware --workers 1 (before-2440423)")
    assert not synced_workers("sglang-router cache_aware")


def test_worker_counts_are_parsed_and_bad_ones_refused():
    assert worker_counts_argument("1,2,4") == [1, 2, 4]
    for bad in ("", "0", "1,x", "-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            worker_counts_argument(bad)


def _row(
    target: str, cpu_us: float, requests_per_s: float = 1000.0, redis_cpu_us: float | None = None
) -> dict:
    return {
        "target": target,
        "requests_per_s": requests_per_s,
        "latency_p50_ms": 5.0,
        "latency_p99_ms": 9.0,
        "cpu_us_per_request": cpu_us,
        "redis_cpu_us_per_request": redis_cpu_us,
        "backend_cpu_us_per_request": 150.0,
        "errors": 0,
    }


def _report(rows: list[dict], cpus: int = 2, **extra) -> dict:
    return {
        "command": "python -m benchmarks.gateway_overhead --kv-aware",
        "machine": f"x86_64, {cpus} CPUs, Python 3.12.3",
        "load_average_at_end": [1.0, 1.0, 1.0],
        "prompt_tokens": {"mean": 1600, "p10": 950, "p50": 1600, "p90": 2300},
        "load_requests": 2400,
        "concurrency": 64,
        "rounds": 1,
        "results": rows,
        "per_round": [{**row, "round": 0} for row in rows],
        "skipped": [],
        **extra,
    }


def test_report_gives_cores_busy_from_cpu_and_rate(tmp_path):
    entry = _row("kvgate kv_aware --workers 4", 400.0, requests_per_s=5000.0, redis_cpu_us=6.0)
    write_kv_aware_report(_report([entry], cpus=16), tmp_path / "report")
    text = (tmp_path / "report.md").read_text()
    assert "all on the same 16 cores" in text
    # 400 µs of CPU a request at 5000 requests/s: two cores busy.
    assert "| kvgate kv_aware --workers 4 | 5000 | 5.00 | 9.00 | 400 | 2.00 | 6 | 150 | 0 |" in text


def test_report_sets_the_step_costs_against_the_peer_budget(tmp_path):
    rows = [
        _row("kvgate kv_aware --workers 1", 500.0),
        _row("kvgate least_loaded --workers 1", 140.0),
        _row("sglang-router cache_aware", 230.0),
    ]
    steps = {"parse": 6.0, "render": 45.0, "encode": 63.0, "keys": 6.0, "lookup": 6.0, "policy": 56.0}
    report = _report(rows, request_path_steps_us=steps)
    write_kv_aware_report(report, tmp_path / "report")
    text = (tmp_path / "report.md").read_text()
    # 230 - 140 = 90 µs of budget; render + encode = 108 µs, 1.2x it; all steps 182 µs.
    assert "kvgate kv_aware may spend 90 µs beyond the HTTP path" in text
    assert "render 45 + encode 63 + keys 6 + lookup 6 + policy 56 = 182 µs" in text
    assert "the chat template and the encoding alone 108 µs (1.2x the budget)" in text
    # Without the peer's row (peers skipped) there is no budget to state.
    del report["results"][2]
    write_kv_aware_report(report, tmp_path / "report")
    assert "## CPU budget" not in (tmp_path / "report.md").read_text()


def test_the_overhead_report_claims_no_sse_rate_its_one_client_process_bounds(tmp_path):
    # The committed run: through kvgate the client read 2073 SSE streams/s, direct only 1380.
    committed = Path(__file__).parent.parent / "benchmarks" / "results" / "gateway_overhead.json"
    results = json.loads(committed.read_text())
    rates = {entry["target"]: entry["sse_load"]["requests_per_s"] for entry in results["results"]}
    assert rates["kvgate round_robin"] > rates["direct"]  # the artefact the report must not present
    write_report(results, tmp_path / "report")
    text = (tmp_path / "report.md").read_text()
    assert "SSE req/s" not in text and f"{rates['kvgate round_robin']:.0f}" not in text
    assert "No SSE requests/s: with one client process the SSE rate measures that client" in text
    assert "| JSON req/s |" in text  # the JSON rate stays

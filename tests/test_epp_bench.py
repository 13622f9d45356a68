"""routing_bench --via envoy's arithmetic and its refusals (kvgate_testing/epp_runs.py); the runs
themselves start real processes and are measured by the benchmark, not here."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvgate_testing import epp_runs
from kvgate_testing.processes import REPO_ROOT


def _run(hit_ratio: float, cpu_ms: float, load: float = 1.2) -> dict:
    return {"hit_ratio": hit_ratio, "router_cpu_ms_per_request": cpu_ms, "max_over_mean_load": load}


def test_summary_compares_the_picker_with_the_proxy_and_with_envoy_alone() -> None:
    results = {
        "workloads": {
            "a": {"policies": {"kv_aware": _run(0.8, 10.0), "kv_aware_via_envoy": _run(0.7, 5.0)}},
            "b": {"policies": {"kv_aware": _run(0.6, 30.0), "kv_aware_via_envoy": _run(0.5, 5.0)}},
        },
        "latency_probe": {
            "envoy_least_request": {"p50_ms": 10.0, "p99_ms": 20.0},
            "kv_aware_via_envoy": {"p50_ms": 10.5, "p99_ms": 23.5},
        },
    }
    top = epp_runs.summary(results)
    assert top["hit_ratio_epp"] == pytest.approx(0.6)
    assert top["hit_ratio_proxy"] == pytest.approx(0.7)
    assert top["added_latency_p50_ms"] == pytest.approx(0.5)
    assert top["added_latency_p99_ms"] == pytest.approx(3.5)
    assert top["cpu_per_request_epp_over_proxy"] == pytest.approx(5.0 / 20.0)
    assert top["hit_ratio_epp_streamed_body"] is None  # not run: not made up
    checks = epp_runs.goal_checks(top)
    assert checks["added_latency_p50_ms"].startswith("met")
    assert checks["added_latency_p99_ms"].startswith("missed")


def test_a_failed_run_is_left_out_of_the_means() -> None:
    results = {
        "workloads": {
            "a": {"policies": {"kv_aware": _run(0.8, 10.0), "kv_aware_via_envoy": {"failed": "boom"}}},
            "b": {"policies": {"kv_aware": _run(0.6, 30.0), "kv_aware_via_envoy": _run(0.5, 6.0)}},
        },
        "latency_probe": {},
    }
    top = epp_runs.summary(results)
    assert (top["hit_ratio_epp"], top["hit_ratio_proxy"]) == (0.5, 0.6)
    assert top["added_latency_p50_ms"] is None


@pytest.mark.parametrize("flags", [["--real-engines", "2"], ["--shared-tier"]])
def test_via_envoy_refuses_what_it_does_not_run(flags: list[str]) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.routing_bench", "--via", "envoy", *flags],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
    )
    assert result.returncode == 2, result.stderr
    assert "--via envoy runs simulated engines" in result.stderr

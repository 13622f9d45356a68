"""benchmarks/discovery_churn.py runs as a user runs it (`python -m benchmarks.discovery_churn`, small
arguments) and writes its json, markdown and plot with the keys issue 40 names."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from kvgate_testing.processes import REPO_ROOT, python_command


# Three simulated engines, a gateway and 12 s of churn: about 25 s.
@pytest.mark.slow
def test_the_churn_benchmark_writes_its_results_with_the_named_keys(tmp_path):
    output = tmp_path / "discovery"
    result = subprocess.run(
        python_command(
            "-m", "benchmarks.discovery_churn", "--pods", "6", "--initial", "2", "--engines", "2",
            "--clients", "2", "--duration-s", "12", "--output", str(output),
        ),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO_ROOT,
        env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    results = json.loads(output.with_suffix(".json").read_text())
    assert results["source"]["commit"]
    assert results["pods"] == 6 and results["requests"] > 0
    # Every pod that joined during the run was seen routable, and its time measured.
    assert results["pods_never_routable"] == 0
    assert isinstance(results["p99_ready_to_routable_s"], float)
    assert results["failed_requests"] == 0, results["failed_by_status"]
    assert isinstance(results["requests_to_terminating"], int)
    assert "ready -> routable" in output.with_suffix(".md").read_text()
    assert output.with_suffix(".png").stat().st_size > 0

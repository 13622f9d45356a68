"""The kv_aware request-path benchmark, run small: real simulated engines, real gateways from a source
tree, the stage breakdown in a child process importing that tree."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from kvgate_testing.processes import REPO_ROOT


@pytest.mark.slow  # ~60 s on two busy cores: two engines, two gateways and a stage child start
def test_a_small_run_reports_added_latency_cpu_and_stages(tmp_path: Path) -> None:
    command = [
        sys.executable, "-m", "benchmarks.kv_aware_latency", "--gateway", f"now={REPO_ROOT}",
        "--engines", "2", "--users", "3", "--turns", "2", "--out", str(tmp_path), "--name", "small",
    ]  # fmt: skip
    run = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=280)
    assert run.returncode == 0, run.stderr
    results = json.loads((tmp_path / "small.json").read_text())
    assert results["requests"] == {"first_turn": 3, "follow_up": 3}
    assert set(results["gateways"]) == {"now", "now least_loaded"}
    for entry in results["gateways"].values():
        assert entry["cpu_ms_per_request"] >= 0  # /proc counts 10 ms ticks: six requests may read 0
        assert entry["gateway_overhead_mean_ms"] > 0
        for kind in ("first_turn", "follow_up"):
            assert math.isfinite(entry["added_ms"][kind]["p50"])
    stages = results["stages"]["now"]
    # The stage child checked every prompt's tokens against the workload's (it raises otherwise).
    assert stages["steps"]["encode"]["follow_up"]["count"] == 3
    assert "ascii_fast_path_us_per_char" in stages["encode_rates"]
    assert (tmp_path / "small.png").stat().st_size > 0
    assert "| now |" in (tmp_path / "small.md").read_text()

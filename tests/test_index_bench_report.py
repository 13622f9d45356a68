"""The prefix-index benchmark's report (kvgate_testing/index_bench_report.py, which
benchmarks/index_bench.py writes its results with), read on the committed results."""

from __future__ import annotations

import json
from pathlib import Path

from kvgate_testing.index_bench_report import INGEST_LABELS, markdown_report, plot

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "index_bench.json"


def test_the_report_has_a_row_for_every_ingest_shape_in_both_tables() -> None:
    results = json.loads(RESULTS.read_text())
    assert set(INGEST_LABELS) == set(results["ingest"]) == set(results["ingest_own_process"]["after"])
    text = markdown_report(results, lone_calls_per_timing=256)
    own, side_by_side = text.split("## Ingest side by side")
    for label in set(INGEST_LABELS.values()):
        assert f"| {label} |" in own.split("## Ingest, each index alone")[1], label
        assert f"| {label} |" in side_by_side.split("## Lookup")[0], label
    assert "timed 256 calls at a time" in text  # the count is the benchmark's, passed in


def test_the_plot_is_written_from_the_results_alone(tmp_path: Path) -> None:
    plot(json.loads(RESULTS.read_text()), tmp_path / "index_bench.png")
    assert (tmp_path / "index_bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

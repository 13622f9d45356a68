"""The committed benchmark results say what they ran: each json names its commit, every repository path
a results file names exists, and the benchmarks' writers record the commit and a dirty flag."""

from __future__ import annotations

import json
import re
import statistics
import subprocess
from pathlib import Path

import pytest

from kvgate_testing import provenance

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
COMMIT = re.compile(r"[0-9a-f]{40}")
# A repository path as results files write them: a top-level directory of the repository, then more.
TOP_LEVEL = ("benchmarks", "kvgate_testing", "tests", "router", "cachelayer", "kvwire", "kvgate_common",
             "scripts", "docs",
             "deploy")  # fmt: skip
NAMED_PATH = re.compile(rf"(?<![\w./-])((?:{'|'.join(TOP_LEVEL)})/[\w./-]*\w)(?: at ([0-9a-f]{{7,40}})\b)?")


def _results_files(*suffixes: str) -> list[Path]:
    return sorted(path for path in RESULTS.rglob("*") if path.suffix in suffixes)


def _exists(path: str, commit: str | None) -> bool:
    if commit:  # "PATH at SHA": a file of an older tree, read from git history
        shown = subprocess.run(["git", "cat-file", "-e", f"{commit}:{path}"], cwd=REPO, capture_output=True)
        return shown.returncode == 0
    # An output prefix (`--output benchmarks/results/routing_64`) names the files it wrote.
    return any((REPO / f"{path}{suffix}").exists() for suffix in ("", ".json", ".md"))


def missing_paths(text: str) -> list[str]:
    return [match.group(0) for match in NAMED_PATH.finditer(text) if not _exists(*match.groups())]


def test_the_path_check_catches_a_moved_file_and_passes_present_and_historical_ones():
    assert missing_paths("Oracle: benchmarks/oracle.py (greedy") == ["benchmarks/oracle.py"]
    assert missing_paths("backend (tests/support/openai_backend.py) behind") == [
        "tests/support/openai_backend.py"
    ]
    present = "kvgate_testing/reference_placement.py, `--output benchmarks/results/routing_64`"
    assert missing_paths(present) == []
    # benchmarks/oracle.py existed before it moved into kvgate_testing (e02c2fb).
    old = subprocess.run(["git", "rev-parse", "e02c2fb~1"], cwd=REPO, capture_output=True, text=True)
    if old.returncode == 0:  # a shallow clone lacks the history; the check above still ran
        assert missing_paths(f"benchmarks/oracle.py at {old.stdout.strip()}") == []


@pytest.mark.parametrize("path", _results_files(".md", ".json"), ids=lambda p: str(p.relative_to(RESULTS)))
def test_every_repository_path_a_results_file_names_exists(path):
    assert missing_paths(path.read_text()) == [], f"{path.relative_to(REPO)} names paths that do not exist"


@pytest.mark.parametrize("path", _results_files(".json"), ids=lambda p: str(p.relative_to(RESULTS)))
def test_every_results_json_names_the_commit_it_ran_at_or_was_committed_at(path):
    source = json.loads(path.read_text()).get("source")
    assert isinstance(source, dict), f"{path.relative_to(REPO)}: no `source` (kvgate_testing/provenance.py)"
    commit = source.get("commit") or source.get("committed_at")
    assert isinstance(commit, str) and COMMIT.fullmatch(commit), f"{path.relative_to(REPO)}: {source}"
    if "commit" in source:  # a run's own record: its dirty flag too (null only where git could not say)
        assert "dirty" in source


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout


def test_source_of_a_checkout_is_its_commit_and_dirty_outside_the_results_only(tmp_path):
    _git(tmp_path, "init", "-q")
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "code.py").write_text("x = 1\n")
    (tmp_path / "benchmarks" / "results" / "old.json").write_text("{}\n")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@example.invalid", "commit", "-qm", "one")
    head = _git(tmp_path, "rev-parse", "HEAD").strip()
    assert provenance.source_of(tmp_path) == {"commit": head, "dirty": False, "changed_paths": []}
    # A run rewriting its own results leaves the source clean; a changed source file does not.
    (tmp_path / "benchmarks" / "results" / "old.json").write_text('{"new": 1}\n')
    (tmp_path / "benchmarks" / "results" / "new.md").write_text("new\n")
    assert provenance.source_of(tmp_path)["dirty"] is False
    (tmp_path / "code.py").write_text("x = 2\n")
    assert provenance.source_of(tmp_path) == {"commit": head, "dirty": True, "changed_paths": ["code.py"]}


def test_source_without_git_says_why_or_takes_the_commit_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(provenance.COMMIT_VARIABLE, raising=False)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))  # no repository above tmp_path counts
    unknown = provenance.source_of(tmp_path)
    assert unknown["commit"] is None and provenance.COMMIT_VARIABLE in unknown["why"]
    monkeypatch.setenv(provenance.COMMIT_VARIABLE, "a" * 40)
    from_environment = {"commit": "a" * 40, "dirty": None, "from": "KVGATE_SOURCE_COMMIT"}
    assert provenance.source_of(tmp_path) == from_environment


def test_with_source_puts_this_checkouts_commit_first_and_keeps_a_rewritten_reports_own():
    stamped = provenance.with_source({"rows": [1]})
    assert list(stamped) == ["source", "rows"]
    assert stamped["source"]["commit"] == _git(REPO, "rev-parse", "HEAD").strip()
    # Results read back to rewrite their report (--report-only) still name the run that measured them.
    old = {"committed_at": "b" * 40}
    assert provenance.with_source({"rows": [1], "source": old}) == {"source": old, "rows": [1]}


def test_every_benchmark_that_writes_a_results_json_stamps_its_source():
    writers = [
        path for path in (REPO / "benchmarks").glob("*.py")
        if re.search(r"write_text\(json\.dumps\(", path.read_text())
    ]  # fmt: skip
    assert writers, "no benchmark writes json?"
    unstamped = [
        path.name for path in writers
        if re.search(r"write_text\(json\.dumps\((?!with_source\()", path.read_text())
    ]  # fmt: skip
    assert unstamped == []


def _replicas_doc_rows(docs: str) -> dict[str, list[str]]:
    """docs/benchmarks.md's replicas table: replicas -> its three cells."""
    header = "| replicas | hit ratio, sync on / off | load max/mean, on / off | TTFT p90 ms, on / off |"
    lines = docs[docs.index(header) :].splitlines()[2:]
    rows = {}
    for line in lines:
        if not line.startswith("|"):
            break
        replicas, *cells = [cell.strip() for cell in line.strip("|").split("|")]
        rows[replicas] = cells
    return rows


def test_the_replicas_figures_in_the_docs_are_those_of_replicas_json():
    results = json.loads((RESULTS / "replicas.json").read_text())
    docs = (REPO / "docs" / "benchmarks.md").read_text()
    columns = (("hit_ratio_by_replicas", "{:.3f}"), ("max_over_mean_load_by_replicas", "{:.2f}"),
               ("ttft_p90_by_replicas", "{:.0f}"))  # fmt: skip
    expected = {}
    for replicas in results["hit_ratio_by_replicas"]:
        cells = []
        for key, form in columns:
            on = form.format(results[key][replicas])
            off = results[f"{key}_sync_off"][replicas]
            cells.append(on if replicas == "1" else f"{on} / {form.format(off)}")
        expected[replicas] = cells
    assert _replicas_doc_rows(docs) == expected
    # The section names the run it quotes.
    date = results["meta"]["date"].removesuffix(" UTC")
    assert f"benchmarks/results/replicas.json (run {date[:10]}" in " ".join(docs.split())
    assert f"{date[:10]} {date[11:]}" in " ".join(docs.split())


def test_the_vllm_connector_report_shows_every_run_and_their_median_not_only_the_last():
    runs = sorted(RESULTS.glob("vllm_connector_run*.json"), key=lambda p: int(p.stem.rpartition("run")[2]))
    runs = [json.loads(path.read_text()) for path in [*runs, RESULTS / "vllm_connector.json"]]
    assert len(runs) >= 2
    report = (RESULTS / "vllm_connector.md").read_text()
    keys = ("hit_over_cold_ttft_in_process", "hit_over_cold_ttft_daemon", "hit_over_cold_ttft_cross_engine",
            "cold_with_connector_over_without")  # fmt: skip
    for number, run in enumerate(runs, start=1):
        ratios = " | ".join(f"{run[key]:.2f}" for key in keys)
        assert f"| {number} | {run['prompts']} | {run['load_average_1m_at_end']:.1f} | {ratios} |" in report
    medians = " | ".join(f"{statistics.median(run[key] for run in runs):.2f}" for key in keys)
    assert f"| median | | | {medians} |" in report


def test_a_routing_report_names_the_commit_its_run_was_at(tmp_path):
    from kvgate_testing.routing_report import write_markdown

    for name in ("routing", "routing_64"):
        results = json.loads((RESULTS / f"{name}.json").read_text())
        write_markdown(results, tmp_path / f"{name}.md")
        first_line = (tmp_path / f"{name}.md").read_text().splitlines()[2]
        source = results["source"]
        if "commit" in source:
            state = "work tree dirty" if source["dirty"] else "clean tree"
            assert f" at {source['commit'][:10]} ({state}) with " in first_line
        else:
            assert f" (committed at {source['committed_at'][:10]}) with " in first_line

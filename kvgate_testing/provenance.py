"""Which source a benchmark ran: the commit and whether the work tree differed from it, for results files.

Every benchmark writes `with_source(results)`: its results with a first key `source`, `{"commit": <git
rev-parse HEAD>, "dirty": bool, "changed_paths": [...]}`. Dirty means files outside benchmarks/results/
(tracked or not, not ignored) differed from that commit when the source was first asked for (at the
start of a long benchmark, else at its first write); results files are left out because a run writes
them itself and they change no measured code. Where git cannot
answer (a copy of the tree without .git, as on the device machine), the commit comes from the
environment variable KVGATE_SOURCE_COMMIT if set, else it is null and `why` says so.

Results committed before this existed carry `{"committed_at": <the last commit that changed the
file then>}` instead: when it was committed, not the commit it ran at (tests/test_benchmark_results.py
checks that every results json has one or the other).
"""

from __future__ import annotations

import os
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = "benchmarks/results/"
COMMIT_VARIABLE = "KVGATE_SOURCE_COMMIT"
_MAX_CHANGED_PATHS = 20


def _git(root: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=root, capture_output=True, text=True, check=True, timeout=30
    ).stdout


def source_of(root: Path) -> dict[str, Any]:
    """The commit checked out at `root` and whether the work tree outside benchmarks/results/ differs."""
    try:
        commit = _git(root, "rev-parse", "HEAD").strip()
        status = _git(root, "status", "--porcelain")
    except (OSError, subprocess.SubprocessError) as exc:
        from_environment = os.environ.get(COMMIT_VARIABLE)
        if from_environment:
            return {"commit": from_environment, "dirty": None, "from": COMMIT_VARIABLE}
        return {"commit": None, "dirty": None, "why": f"git could not say ({exc}); set {COMMIT_VARIABLE}"}
    # Porcelain lines are "XY path" (renames "XY old -> new"); a results file changes nothing measured.
    changed = [line[3:] for line in status.splitlines() if not line[3:].startswith(RESULTS_DIR)]
    return {"commit": commit, "dirty": bool(changed), "changed_paths": changed[:_MAX_CHANGED_PATHS]}


@cache
def run_source() -> dict[str, Any]:
    """This checkout's source, asked at the first call and kept: a long benchmark asks at its start,
    so edits made while it runs do not change what it records."""
    return source_of(REPO_ROOT)


def with_source(results: dict[str, Any]) -> dict[str, Any]:
    """`results` with `source` as its first key: `run_source()` for a run's fresh results; results that
    carry a `source` already (read back to rewrite a report, `--report-only`) keep theirs, since
    rewriting a report changes nothing about which source measured it."""
    source = results.get("source") or run_source()
    return {"source": source, **{key: value for key, value in results.items() if key != "source"}}

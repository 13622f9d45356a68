"""No source file is over 900 lines (the project's guide): past that a file holds more than one
concept, and the next change to it is a split first. Every Python and Cython file of the code, the
shared helpers, the benchmarks, the tests and the scripts is counted, so a new one is checked
without being listed here."""

from __future__ import annotations

from pathlib import Path

REPOSITORY = Path(__file__).resolve().parent.parent
MAX_LINES = 900
SOURCE_DIRECTORIES = (
    "router", "cachelayer", "kvwire", "kvgate_common", "kvgate_testing", "benchmarks", "tests", "scripts",
)  # fmt: skip
SOURCE_SUFFIXES = (".py", ".pyx", ".pxd", ".pxi")


def oversized(root: Path) -> list[str]:
    """`path: N lines` for every source file under `root`'s SOURCE_DIRECTORIES over MAX_LINES."""
    found = []
    for directory in SOURCE_DIRECTORIES:
        for path in sorted((root / directory).rglob("*")):
            if path.suffix in SOURCE_SUFFIXES and path.is_file():
                lines = len(path.read_text(encoding="utf-8").splitlines())
                if lines > MAX_LINES:
                    found.append(f"{path.relative_to(root)}: {lines} lines")
    return found


def test_a_file_over_the_limit_is_found(tmp_path: Path) -> None:
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (tmp_path / "benchmarks" / "short.py").write_text("x = 1\n" * MAX_LINES)
    assert oversized(tmp_path) == [f"benchmarks/long.py: {MAX_LINES + 1} lines"]


def test_no_source_file_is_over_900_lines() -> None:
    assert (REPOSITORY / "router" / "__init__.py").exists()  # the walk starts where the code is
    found = oversized(REPOSITORY)
    assert not found, f"split these along a seam (one concept a file): {found}"

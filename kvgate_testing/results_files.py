"""A benchmark's results files: `<output>.json` (the results, stamped with the source they ran at),
`<output>.md` (its report) and `<output>.png` (its plot), the report then printed."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvgate_testing.provenance import with_source

Writer = Callable[[dict[str, Any], Path], None]


def write_results_files(
    results: dict[str, Any], output: Path, *, report: Writer, plot: Writer, json_too: bool = True
) -> None:
    """Write `results` beside `output` (a path prefix) as .json (unless `json_too` is False: a report
    rewritten from the json it read), .md by `report` and .png by `plot`; print the .md."""
    if json_too:
        output.with_suffix(".json").write_text(json.dumps(with_source(results), indent=2) + "\n")
    report(results, output.with_suffix(".md"))
    plot(results, output.with_suffix(".png"))
    print(output.with_suffix(".md").read_text())

"""Loading kvgate's optional Cython extensions (router/index/_ingest.pyx, router/_ascii_split.pyx).

Each is built by `pip install -e .` and optional: without it the pure-Python path it speeds up runs.
A build left from an older source (the source was updated, the package not reinstalled) may lack
a name its caller needs; it is then refused with a warning that says how to rebuild, never used
half-way.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Iterable
from types import ModuleType


def rebuild_hint(source: str) -> str:
    return f"rebuild it with `.venv/bin/pip install -e .` (or `cythonize -i {source}`)"


def load_compiled(
    module: str, source: str, names: Iterable[str], logger: logging.Logger
) -> ModuleType | None:
    """The built extension `module` (compiled from `source`) when it defines every one of `names`;
    None when it is not built (logged at debug level) or is stale (a warning on `logger`)."""
    try:
        compiled = importlib.import_module(module)
    except ImportError as missing:
        logger.debug("%s not built (%s): the pure-Python path runs", module, missing)
        return None
    missing_names = [name for name in names if not hasattr(compiled, name)]
    if missing_names:
        logger.warning(
            "%s (%s) is a stale build (no %s): not used; %s",
            module, getattr(compiled, "__file__", "?"), ", ".join(missing_names), rebuild_hint(source),
        )  # fmt: skip
        return None
    return compiled

"""The cache engine and its storage tiers know nothing of who serves them: `cachelayer/engine.py` and
`cachelayer/storage/` import nothing from `cachelayer.controller` (issue 36, item 3). The controller's
worker is attached by the engine's owner (cachelayer.controller.worker.attach_controller_worker).

The modules are read as source (an AST walk), so an import inside a function or under TYPE_CHECKING
counts too, and a new file under storage/ is checked without being listed here."""

from __future__ import annotations

import ast
import os
import subprocess
from pathlib import Path

import pytest

from kvgate_testing.processes import REPO_ROOT, python_command

FORBIDDEN = "cachelayer.controller"
STORE_FILES = [
    REPO_ROOT / "cachelayer" / "engine.py",
    *sorted((REPO_ROOT / "cachelayer" / "storage").rglob("*.py")),
]


def imported_modules(path: Path, root: Path = REPO_ROOT) -> list[tuple[int, str]]:
    """(line, module) for every module the file (under `root`) imports, relative imports resolved,
    wherever the statement is; `importlib.import_module("...")` and `__import__("...")` of a literal too."""
    package = list(path.relative_to(root).with_suffix("").parts)
    if path.name != "__init__.py":
        package = package[:-1]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package[: len(package) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.append((node.lineno, base))
            found.extend((node.lineno, f"{base}.{alias.name}") for alias in node.names)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if called in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                found.append((node.lineno, node.args[0].value))
    return found


def _is_controller(module: str) -> bool:
    return module == FORBIDDEN or module.startswith(FORBIDDEN + ".")


def test_the_walk_finds_every_kind_of_import_of_the_controller(tmp_path):
    """The checker itself: each way of importing the controller is found, and nothing else is."""
    sample = tmp_path / "cachelayer" / "storage" / "sample.py"
    sample.parent.mkdir(parents=True)
    sample.write_text(
        "import cachelayer.controller.worker\n"
        "from cachelayer.controller import worker\n"
        "from ..controller.auth import MessageAuth\n"
        "def later():\n"
        "    from cachelayer.controller.worker import ControllerWorker\n"
        "    importlib.import_module('cachelayer.controller.server')\n"
        "from cachelayer.controllers_elsewhere import x\n"
        "from cachelayer.storage.tier import Tier\n"
    )
    lines = sorted({line for line, module in imported_modules(sample, tmp_path) if _is_controller(module)})
    assert lines == [1, 2, 3, 5, 6]


@pytest.mark.parametrize("path", STORE_FILES, ids=lambda path: str(path.relative_to(REPO_ROOT)))
def test_the_engine_and_its_storage_tiers_import_nothing_from_the_controller(path):
    imports = [f"line {line}: {module}" for line, module in imported_modules(path) if _is_controller(module)]
    assert imports == [], (
        f"{path.relative_to(REPO_ROOT)} imports the controller ({'; '.join(imports)}): the store must "
        "not know who serves it; let the engine's owner call attach_controller_worker"
    )


def test_importing_the_engine_loads_no_controller_module():
    """At run time too: a fresh interpreter that builds an engine (with `enable_controller` set) has
    loaded nothing of the controller, and started no worker for it."""
    script = (
        "import sys\n"
        "from kvgate_testing.cachelayer import make_engine\n"
        "engine = make_engine(2, enable_controller=True, controller_pull_url='127.0.0.1:9')\n"
        "engine.close()\n"
        "print(sorted(name for name in sys.modules if name.startswith('cachelayer.controller')))\n"
    )
    result = subprocess.run(
        python_command("-c", script),
        cwd=REPO_ROOT,
        env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)),
        capture_output=True,
        text=True,
        timeout=300,  # importing torch on a saturated 2-core machine
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"

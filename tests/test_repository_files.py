"""What a fresh clone says about itself: the LICENSE that pyproject.toml names, and the README's
set-up words against what the Makefile and scripts/install_system_packages.sh really run (issue 35)."""

from __future__ import annotations

import re
import tomllib

from kvgate_testing.processes import REPO_ROOT

README = (REPO_ROOT / "README.md").read_text()
MAKEFILE = (REPO_ROOT / "Makefile").read_text()


def _setup_section() -> str:
    start = README.index("## Set up")
    return README[start : README.index("\n## ", start + 1)]


def test_the_license_file_is_the_apache_2_0_text_that_pyproject_names():
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["license"] == {"text": "Apache-2.0"}
    license_text = (REPO_ROOT / "LICENSE").read_text()
    assert license_text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in license_text
    assert "END OF TERMS AND CONDITIONS" in license_text
    # The full text (about 200 lines), not a one-line notice that points elsewhere.
    assert len(license_text.splitlines()) > 150


def test_the_readme_names_the_pip_installs_that_the_makefile_runs():
    # Makefile: PIP := $(BIN)/python -m pip install -q -c constraints.txt; then `$(PIP) ARGS`.
    makefile_installs = {
        args.strip() for args in re.findall(r"^\t\$\(PIP\) (.+)$", MAKEFILE, re.MULTILINE)
    } - {"--upgrade pip"}
    readme_installs = {args.strip() for args in re.findall(r"`pip install ([^`]+)`", _setup_section())}
    assert makefile_installs, "the Makefile's $(PIP) lines were not found"
    assert readme_installs == makefile_installs


def test_the_readme_says_make_test_installs_system_packages_as_root():
    section = _setup_section()
    script = (REPO_ROOT / "scripts" / "install_system_packages.sh").read_text()
    assert "bash scripts/install_system_packages.sh" in MAKEFILE.split("\ntest:")[1].split("\n\n")[0]
    assert "installs system packages" in section and "as root" in section
    assert "--no-install-recommends" in section and "--no-install-recommends" in script

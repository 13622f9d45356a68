"""scripts/install_system_packages.sh (run by `make test`): what it does on a machine that lacks the
system packages the suite drives and cannot install them."""

from __future__ import annotations

import os
import shutil
import subprocess

from kvgate_testing.processes import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "install_system_packages.sh"


def test_missing_packages_without_apt_get_are_named_with_what_to_do(tmp_path):
    # A PATH holding only `id`: no chromium, no redis-server, no apt-get.
    (tmp_path / "id").symlink_to(shutil.which("id"))
    result = subprocess.run(
        [shutil.which("bash"), str(SCRIPT)],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "PATH": str(tmp_path)},
    )
    assert result.returncode == 1
    assert "missing" in result.stderr
    assert "chromium" in result.stderr and "redis-server" in result.stderr
    assert "no apt-get" in result.stderr


def test_nothing_is_installed_when_everything_is_there():
    if not (shutil.which("chromium") and shutil.which("redis-server")):
        raise AssertionError("make test installs chromium and redis-server before the suite runs")
    result = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "" and result.stderr == ""

"""scripts/install_system_packages.sh (run by `make test`): what it does on a machine that lacks the
system packages the suite drives and cannot install them."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

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
    assert "chromium" in result.stderr and "redis-server" in result.stderr and "kubectl" in result.stderr
    assert "no apt-get" in result.stderr


def test_nothing_is_installed_when_everything_is_there():
    commands = ("chromium", "redis-server", "kubectl", "curl", "nghttp")
    if not all(shutil.which(command) for command in commands):
        raise AssertionError(
            "make test installs chromium, redis-server, kubectl, curl and nghttp before the suite runs"
        )
    result = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "" and result.stderr == ""


def _run_with_fake_apt(tmp_path, kubectl_candidate: str) -> tuple[subprocess.CompletedProcess, Path]:
    """The script on a PATH with `id`, `env`, `grep`, an apt-cache that offers kubectl at
    `kubectl_candidate` ("(none)": no repository has it) and an apt-get that only writes down each
    command line it was given: the script's real apt-get calls, without installing anything on the
    machine that runs the test. Running as root (uid 0) is what `make test` in CI does."""
    calls = tmp_path / "apt-get-calls"
    calls.touch()
    fake_apt_get = tmp_path / "apt-get"
    fake_apt_get.write_text(f'#!{shutil.which("bash")}\necho "$*" >> {calls}\n')
    fake_apt_get.chmod(0o755)
    fake_apt_cache = tmp_path / "apt-cache"
    answer = f'echo "$2:"; echo "  Candidate: {kubectl_candidate}"'
    fake_apt_cache.write_text(f"#!{shutil.which('bash')}\n{answer}\n")
    fake_apt_cache.chmod(0o755)
    fake_id = tmp_path / "id"
    fake_id.write_text(f"#!{shutil.which('bash')}\necho 0\n")
    fake_id.chmod(0o755)
    (tmp_path / "env").symlink_to(shutil.which("env"))
    (tmp_path / "grep").symlink_to(shutil.which("grep"))
    result = subprocess.run(
        [shutil.which("bash"), str(SCRIPT)],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "PATH": str(tmp_path)},
    )
    return result, calls


def test_kubectl_that_no_repository_offers_is_left_out_with_a_warning(tmp_path):
    result, calls = _run_with_fake_apt(tmp_path, "(none)")
    assert result.returncode == 0, result.stderr
    installs = [line.split() for line in calls.read_text().splitlines() if line.split()[0] == "install"]
    assert len(installs) == 1 and {"chromium", "redis-server"} <= set(installs[0])
    assert "kubectl" not in installs[0]
    assert "no apt repository here offers kubectl" in result.stderr


def test_missing_packages_are_installed_without_recommends_and_the_reasons_are_printed(tmp_path):
    result, calls = _run_with_fake_apt(tmp_path, "1:528.0.0-0")
    assert result.returncode == 0, result.stderr
    installs = [line for line in calls.read_text().splitlines() if line.split()[0] == "install"]
    assert len(installs) == 1
    assert "--no-install-recommends" in installs[0].split()
    assert {"chromium", "redis-server", "kubectl", "curl", "nghttp2-client"} <= set(installs[0].split())
    # What is installed and why, before apt-get runs.
    assert "as root" in result.stdout and "without recommended packages" in result.stdout
    assert "chromium: the debug page's browser tests" in result.stdout
    assert "redis-server: the shared Redis tier's tests" in result.stdout
    assert "kubectl: the Kubernetes manifests' test" in result.stdout
    assert "curl: the picker's HTTP/2 tests" in result.stdout
    assert "nghttp2-client: the picker's HTTP/2 tests" in result.stdout
    assert "apt-get install -y --no-install-recommends" in result.stdout

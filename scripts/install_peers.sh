#!/usr/bin/env bash
# Install the peer routers used by benchmarks/gateway_overhead.py, each into its own virtual
# environment under .cache/peers/<name>/ (ignored by git), so they never touch the project's venv.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
PEERS_DIR=".cache/peers"
mkdir -p "$PEERS_DIR"
for peer in sglang-router vllm-router; do
    venv="$PEERS_DIR/$peer"
    if [ -x "$venv/bin/python" ] && "$venv/bin/pip" show -q "$peer" >/dev/null 2>&1; then
        echo "$peer: already installed in $venv"
        continue
    fi
    "$PYTHON" -m venv "$venv"
    "$venv/bin/pip" install -q --upgrade pip
    "$venv/bin/pip" install -q "$peer"
    echo "$peer: installed in $venv"
done

#!/usr/bin/env bash
# Installs socat (Debian) when it is missing: benchmarks/real_added_latency.py times a socat byte relay
# beside the routers as the floor of one more hop on the host (kvgate_testing/routers.py
# start_socat_relay). A second run only checks.
set -euo pipefail
command -v socat >/dev/null && exit 0
script_dir=${BASH_SOURCE[0]%/*}
[ "$script_dir" = "${BASH_SOURCE[0]}" ] && script_dir=.
# shellcheck source=scripts/apt_packages.sh
source "$script_dir/apt_packages.sh"
apt_prepare install_socat " (or pass --references envoy to the benchmark)" socat
echo "install_socat: the added-latency benchmark's reference hop needs socat; installing it with apt-get"
apt_update
apt_install socat

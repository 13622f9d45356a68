#!/usr/bin/env bash
# Installs the system packages the test suite drives for real, when they are missing (Debian/Ubuntu
# apt-get): Chromium for the debug page's browser tests (marker `browser`) and redis-server for the
# Redis tier. Called by `make test` (and so by .ci/run); a second run only checks.
set -euo pipefail

# command that must be on PATH -> the Debian package that provides it
declare -A PACKAGE_FOR_COMMAND=([chromium]=chromium [redis-server]=redis-server)

missing=()
for command_name in "${!PACKAGE_FOR_COMMAND[@]}"; do
    command -v "$command_name" >/dev/null || missing+=("${PACKAGE_FOR_COMMAND[$command_name]}")
done
[ ${#missing[@]} -eq 0 ] && exit 0

if ! command -v apt-get >/dev/null; then
    echo "install_system_packages: missing ${missing[*]}, and there is no apt-get here: install them" \
        "with this system's package manager, then run the tests again" >&2
    exit 1
fi
SUDO=()
if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || {
        echo "install_system_packages: missing ${missing[*]}: run as root or install sudo," \
            "or install them yourself: apt-get install -y ${missing[*]}" >&2
        exit 1
    }
    SUDO=(sudo)
fi
echo "install_system_packages: installing ${missing[*]}"
"${SUDO[@]}" apt-get update -q
"${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}"

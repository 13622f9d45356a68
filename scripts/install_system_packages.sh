#!/usr/bin/env bash
# Installs the system packages the test suite drives for real, when they are missing (Debian/Ubuntu
# apt-get): Chromium for the debug page's browser tests (marker `browser`), redis-server for the
# Redis tier, kubectl for the Kubernetes manifests' test (`kubectl kustomize`), and curl and nghttp
# (nghttp2-client) for HTTP/2 clients through Envoy. kubectl is the package of the Kubernetes
# (pkgs.k8s.io) or Google Cloud apt repository: Debian's own kubernetes-client (kubectl 1.20) has a
# kustomize too old for deploy/kubernetes. Called by `make test` (and so by .ci/run); a second run
# only checks. Only the packages
# themselves and what they depend on: --no-install-recommends keeps out what apt would add besides
# (with recommends, Chromium alone pulled 115 packages and 479 MB, avahi-daemon and a systemd upgrade).
set -euo pipefail
# The shared apt steps, found beside this script (no dirname: the tests run it on a bare PATH).
script_dir=${BASH_SOURCE[0]%/*}
[ "$script_dir" = "${BASH_SOURCE[0]}" ] && script_dir=.
# shellcheck source=scripts/apt_packages.sh
source "$script_dir/apt_packages.sh"

# command that must be on PATH -> the Debian package that provides it
declare -A PACKAGE_FOR_COMMAND=([chromium]=chromium [redis-server]=redis-server [kubectl]=kubectl [curl]=curl [nghttp]=nghttp2-client)
# command -> why the test suite needs it (printed before anything is installed)
declare -A REASON_FOR_COMMAND=(
    [chromium]="the debug page's browser tests (pytest marker browser) drive a headless Chromium"
    [redis-server]="the shared Redis tier's tests (cachelayer remote_url, gateway cluster) start a real Redis"
    [kubectl]="the Kubernetes manifests' test renders deploy/kubernetes with kubectl kustomize"
    [curl]="the picker's HTTP/2 tests (tests/test_epp_http2.py) send their requests with curl's HTTP/2 client"
    [nghttp]="the picker's HTTP/2 tests send many streams on one connection with nghttp"
)

missing=()
reasons=()
for command_name in "${!PACKAGE_FOR_COMMAND[@]}"; do
    if ! command -v "$command_name" >/dev/null; then
        missing+=("${PACKAGE_FOR_COMMAND[$command_name]}")
        reasons+=("  ${PACKAGE_FOR_COMMAND[$command_name]}: ${REASON_FOR_COMMAND[$command_name]}")
    fi
done
[ ${#missing[@]} -eq 0 ] && exit 0

apt_prepare install_system_packages ", then run the tests again" "${missing[@]}"
echo "install_system_packages: the test suite needs system packages that are missing; installing" \
    "them with apt-get (as root), without recommended packages:"
printf '%s\n' "${reasons[@]}"
echo "install_system_packages: apt-get install -y --no-install-recommends ${missing[*]}"
apt_update
# kubectl comes from the Kubernetes or Google Cloud apt repository, which a machine may not have:
# then it is left out with a warning (only the manifests' test needs it, and it fails saying so)
# instead of failing the install of everything else.
installable=()
for package in "${missing[@]}"; do
    if [ "$package" = kubectl ] && ! apt-cache policy kubectl 2>/dev/null | grep -q 'Candidate: [0-9]'; then
        echo "install_system_packages: no apt repository here offers kubectl (Debian's kubernetes-client" \
            "is too old for deploy/kubernetes): install kubectl >= 1.21 yourself; the manifests' test" \
            "(tests/test_kubernetes_manifests.py) fails until then" >&2
        continue
    fi
    installable+=("$package")
done
[ ${#installable[@]} -eq 0 ] && exit 0
apt_install "${installable[@]}"

#!/usr/bin/env bash
# Installs the container tools the image tier needs (`make test-image`, scripts/build_image.sh),
# when they are missing (Debian/Ubuntu apt-get): podman and buildah to build and run the images,
# runc (crun, podman's default, fails here with "cgroups in hybrid mode not supported") and
# debootstrap to build the default base image's Debian rootfs, and catatonit, the init `podman run
# --init` starts (only recommended by Debian's podman, so not installed with it here). Not part of `make test`: the default
# suite needs none of them. --no-install-recommends keeps out what apt would add besides.
set -euo pipefail
# The shared apt steps, found beside this script (no dirname: the tests run it on a bare PATH).
script_dir=${BASH_SOURCE[0]%/*}
[ "$script_dir" = "${BASH_SOURCE[0]}" ] && script_dir=.
# shellcheck source=scripts/apt_packages.sh
source "$script_dir/apt_packages.sh"

# command that must be on PATH -> the Debian package that provides it
declare -A PACKAGE_FOR_COMMAND=([podman]=podman [buildah]=buildah [runc]=runc [debootstrap]=debootstrap [catatonit]=catatonit)

missing=()
for command_name in "${!PACKAGE_FOR_COMMAND[@]}"; do
    # debootstrap and runc live in /usr/sbin, which a non-root PATH may lack; catatonit where podman looks.
    if ! PATH="$PATH:/usr/sbin:/sbin:/usr/libexec/podman" command -v "$command_name" >/dev/null; then
        missing+=("${PACKAGE_FOR_COMMAND[$command_name]}")
    fi
done
[ ${#missing[@]} -eq 0 ] && exit 0

apt_prepare install_container_tools "" "${missing[@]}"
echo "install_container_tools: the image tier needs ${missing[*]}; installing them with apt-get" \
    "(as root), without recommended packages"
apt_update
apt_install "${missing[@]}"

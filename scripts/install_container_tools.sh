#!/usr/bin/env bash
# Installs the container tools the image tier needs (`make test-image`, scripts/build_image.sh),
# when they are missing (Debian/Ubuntu apt-get): podman and buildah to build and run the images,
# runc (crun, podman's default, fails here with "cgroups in hybrid mode not supported") and
# debootstrap to build the default base image's Debian rootfs, and catatonit, the init `podman run
# --init` starts (only recommended by Debian's podman, so not installed with it here). Not part of `make test`: the default
# suite needs none of them. --no-install-recommends keeps out what apt would add besides.
set -euo pipefail

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

if ! command -v apt-get >/dev/null; then
    echo "install_container_tools: missing ${missing[*]}, and there is no apt-get here: install them" \
        "with this system's package manager" >&2
    exit 1
fi
SUDO=()
if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || {
        echo "install_container_tools: missing ${missing[*]}: run as root or install sudo, or install" \
            "them yourself: apt-get install -y --no-install-recommends ${missing[*]}" >&2
        exit 1
    }
    SUDO=(sudo)
fi
echo "install_container_tools: the image tier needs ${missing[*]}; installing them with apt-get" \
    "(as root), without recommended packages"
"${SUDO[@]}" apt-get update -q
"${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"

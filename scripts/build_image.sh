#!/usr/bin/env bash
# Builds kvgate's two container images with podman from the Containerfile at the repository root:
#   kvgate-gateway  (target gateway: `kvgate serve` and `kvgate epp`, non-root, no torch)
#   kvgate-cache    (target cache:   `cachelayer server`, non-root, torch CPU)
#
#   scripts/build_image.sh                 # base: a Debian bookworm rootfs built here with debootstrap
#   scripts/build_image.sh python:3.11-slim  # base: any image with python3 >= 3.11 (a registry must be reachable)
#
# Environment:
#   TARGETS       which targets to build (default "gateway cache")
#   IMAGE_TAG     tag of both images (default: the short commit, and `latest` besides)
#   TORCH_WHEELS  a folder holding a torch CPU wheel, given to the cache build as a read-only build
#                 context (default: pip's find-links on this machine, when it holds one); without
#                 one, the build asks PyTorch's CPU index (download.pytorch.org/whl/cpu). PyPI's
#                 torch for Linux is the CUDA build (GBs of nvidia-* wheels): never taken here.
#   CA_BUNDLE     the CA bundle pip inside the build trusts (default: pip's `cert` on this machine,
#                 else /etc/ssl/certs/ca-certificates.crt); passed as a build secret, never stored
#                 in a layer.
#   DEBIAN_MIRROR the mirror debootstrap and apt in the build use (default http://deb.debian.org/debian)
#
# The rootfs is cached in .cache/image-rootfs/ (delete it to rebuild); a later build reuses it and
# podman's layer cache. Facts of these machines the flags below answer: crun fails with "cgroups in
# hybrid mode not supported" (so runc, the cgroupfs manager and file events), and the default
# nofile ulimit cannot be applied (so an explicit one).
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT=$PWD
BASE_IMAGE=${1:-}
TARGETS=${TARGETS:-"gateway cache"}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
IMAGE_TAG=${IMAGE_TAG:-$(git rev-parse --short HEAD 2>/dev/null || echo dev)}
# The flags every podman call here takes (see above).
PODMAN=(podman --runtime runc --cgroup-manager cgroupfs --events-backend file)

for target in $TARGETS; do
    case $target in gateway | cache) ;; *) echo "build_image: unknown target $target (gateway, cache)" >&2; exit 1 ;; esac
done
for tool in podman runc; do
    command -v "$tool" >/dev/null || {
        echo "build_image: $tool is missing; install the container tools first:" \
            "bash scripts/install_container_tools.sh" >&2
        exit 1
    }
done

PYTHON=${PYTHON:-$(command -v .venv/bin/python || command -v python3)}
pip_setting() {  # pip's own configuration value for KEY on this machine, or nothing
    "$PYTHON" -m pip config get "$1" 2>/dev/null || true
}

if [ -z "${CA_BUNDLE:-}" ]; then
    CA_BUNDLE=${PIP_CERT:-$(pip_setting global.cert)}
    CA_BUNDLE=${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
fi
[ -r "$CA_BUNDLE" ] || { echo "build_image: CA bundle $CA_BUNDLE is not readable; set CA_BUNDLE" >&2; exit 1; }

# --- the base image -------------------------------------------------------------------------
if [ -z "$BASE_IMAGE" ]; then
    BASE_IMAGE=localhost/kvgate-base:bookworm
    ROOTFS_DIR=$ROOT/.cache/image-rootfs
    ROOTFS_TAR=$ROOTFS_DIR/bookworm.tar
    if [ ! -s "$ROOTFS_TAR" ]; then
        command -v debootstrap >/dev/null || {
            echo "build_image: debootstrap is missing (bash scripts/install_container_tools.sh)," \
                "or give a base image: scripts/build_image.sh python:3.11-slim" >&2
            exit 1
        }
        [ "$(id -u)" -eq 0 ] || { echo "build_image: debootstrap needs root (or give a base image)" >&2; exit 1; }
        echo "build_image: building a Debian bookworm rootfs with debootstrap (cached in $ROOTFS_TAR)"
        started=$(date +%s)
        work=$ROOTFS_DIR/build.$$
        rm -rf "$work" && mkdir -p "$work"
        # minbase: dpkg, apt and the essentials only; python3 is what both images run on.
        debootstrap --variant=minbase --include=python3,ca-certificates bookworm "$work/rootfs" "$DEBIAN_MIRROR"
        # apt lists and caches are not part of the base.
        rm -rf "$work/rootfs/var/lib/apt/lists/"* "$work/rootfs/var/cache/apt/"*.bin "$work/rootfs/var/cache/apt/archives/"*.deb
        mkdir -p "$ROOTFS_DIR"
        tar -C "$work/rootfs" --numeric-owner -cf "$ROOTFS_TAR.partial" .
        mv "$ROOTFS_TAR.partial" "$ROOTFS_TAR"
        rm -rf "$work"
        echo "build_image: rootfs built in $(($(date +%s) - started)) s"
    fi
    if ! "${PODMAN[@]}" image exists "$BASE_IMAGE" \
        || [ "$("${PODMAN[@]}" image inspect --format '{{index .Labels "kvgate.rootfs-mtime"}}' "$BASE_IMAGE" 2>/dev/null)" != "$(stat -c %Y "$ROOTFS_TAR")" ]; then
        echo "build_image: importing $ROOTFS_TAR as $BASE_IMAGE"
        "${PODMAN[@]}" import --change "LABEL kvgate.rootfs-mtime=$(stat -c %Y "$ROOTFS_TAR")" \
            --change 'CMD ["/bin/bash"]' "$ROOTFS_TAR" "$BASE_IMAGE" >/dev/null
    fi
fi

# --- torch CPU for the cache image -----------------------------------------------------------
if [ -z "${TORCH_WHEELS:-}" ]; then
    for folder in ${PIP_FIND_LINKS:-} $(pip_setting global.find-links); do
        if compgen -G "$folder/torch-*+cpu-*.whl" >/dev/null; then TORCH_WHEELS=$folder; break; fi
    done
fi
WHEELS_CONTEXT=$(mktemp -d)
trap 'rm -rf "$WHEELS_CONTEXT"' EXIT
if [ -n "${TORCH_WHEELS:-}" ]; then
    # Only the torch CPU wheels go into the build context, not the whole folder.
    for wheel in "$TORCH_WHEELS"/torch-*+cpu-*.whl; do ln "$wheel" "$WHEELS_CONTEXT/" 2>/dev/null || cp "$wheel" "$WHEELS_CONTEXT/"; done
    echo "build_image: torch CPU from $TORCH_WHEELS: $(cd "$WHEELS_CONTEXT" && ls)"
else
    echo "build_image: no local torch CPU wheel; the cache build asks https://download.pytorch.org/whl/cpu"
fi

# --- the images ------------------------------------------------------------------------------
for target in $TARGETS; do
    image=localhost/kvgate-$target
    echo "build_image: building $image:$IMAGE_TAG from $BASE_IMAGE"
    started=$(date +%s)
    # --format docker: the OCI format has no HEALTHCHECK, and podman would drop it.
    "${PODMAN[@]}" build --format docker --target "$target" \
        --ulimit nofile=20000:20000 \
        --build-arg "BASE_IMAGE=$BASE_IMAGE" \
        --build-arg "DEBIAN_MIRROR=$DEBIAN_MIRROR" \
        --secret "id=ca_bundle,src=$CA_BUNDLE" \
        --build-context "torch_wheels=$WHEELS_CONTEXT" \
        -t "$image:$IMAGE_TAG" -t "$image:latest" -f Containerfile .
    size=$("${PODMAN[@]}" image inspect --format '{{.Size}}' "$image:$IMAGE_TAG")
    echo "build_image: $image:$IMAGE_TAG built in $(($(date +%s) - started)) s, $((size / 1000000)) MB"
done

# Sourced by the scripts that install missing Debian packages (install_system_packages.sh for the
# test suite, install_container_tools.sh for the image tier): the steps both take once they know
# what is missing, kept in one place so that their refusals and apt-get calls cannot drift apart.
# Installs only the packages themselves and what they depend on (--no-install-recommends).

# apt_prepare SCRIPT_NAME HINT PACKAGE...: exit 1 with what to do when there is no apt-get, or no
# root and no sudo; otherwise set APT_SUDO (empty as root). Nothing is changed yet.
apt_prepare() {
    local script_name=$1 hint=$2
    shift 2
    if ! command -v apt-get >/dev/null; then
        echo "$script_name: missing $*, and there is no apt-get here: install them" \
            "with this system's package manager$hint" >&2
        exit 1
    fi
    APT_SUDO=()
    if [ "$(id -u)" -ne 0 ]; then
        command -v sudo >/dev/null || {
            echo "$script_name: missing $*: run as root or install sudo," \
                "or install them yourself: apt-get install -y --no-install-recommends $*" >&2
            exit 1
        }
        APT_SUDO=(sudo)
    fi
}

# apt_update: refresh the package lists (before asking apt-cache what a repository offers).
apt_update() {
    "${APT_SUDO[@]}" apt-get update -q
}

# apt_install PACKAGE...: install them non-interactively, without recommended packages.
apt_install() {
    "${APT_SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$@"
}

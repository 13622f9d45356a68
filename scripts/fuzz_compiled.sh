#!/usr/bin/env bash
# Fuzz the compiled extensions that read what sockets bring (router/index/_ingest.pyx,
# router/_ascii_split.pyx) under AddressSanitizer: a copy of the package sources is built with
# -fsanitize=address in a temporary folder and kvgate_testing.fuzz_compiled runs against it, ASan's
# runtime preloaded into the interpreter. A memory error aborts with ASan's report (exit != 0); a
# wrong answer fails an assertion. Usage: scripts/fuzz_compiled.sh [SECONDS per target, 300].
set -euo pipefail
seconds="${1:-300}"
root="$(cd "$(dirname "$0")/.." && pwd)"
python="$root/.venv/bin/python"
libasan="$(gcc -print-file-name=libasan.so)"
if [ ! -e "$libasan" ]; then
    echo "fuzz_compiled: gcc's AddressSanitizer runtime (libasan.so) is missing; install gcc's libasan" >&2
    exit 2
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cd "$root"
cp -r --parents pyproject.toml router kvwire kvgate_common kvgate_testing "$work"
find "$work" -name '*.so' -delete
(cd "$work" && CFLAGS="-fsanitize=address -fno-omit-frame-pointer -O1 -g" LDFLAGS="-fsanitize=address" \
    "$python" -c "from setuptools import setup; setup()" -q build_ext --inplace >"$work/build.log" 2>&1) \
    || { cat "$work/build.log" >&2; exit 1; }
# The copy first on the path (its modules print their paths); leaks are not what this looks for.
cd "$work"
LD_PRELOAD="$libasan" ASAN_OPTIONS=detect_leaks=0 PYTHONPATH="$work" \
    "$python" -m kvgate_testing.fuzz_compiled --seconds "$seconds"

#!/usr/bin/env bash
# wheelhouse.sh [DIR]: make DIR (default /var/cache/capyctl-build/wheels, or
# $CAPYCTL_WHEELHOUSE) hold every file an offline `install.sh --wheelhouse DIR` needs for
# PYTHON (default /usr/bin/python3): the releases lock/build.txt and lock/py3.X/runtime.txt pin,
# for this machine, each file's hash checked against the lock.
#
# Offline first: when DIR already holds them nothing is downloaded, so repeated package builds
# take seconds. Otherwise pip fetches what is missing from the index (PIP_INDEX_URL and the
# other PIP_* variables apply).
set -euo pipefail

TOP=$(cd "$(dirname "$0")/.." && pwd)
DIR=${1:-${CAPYCTL_WHEELHOUSE:-/var/cache/capyctl-build/wheels}}
PYTHON=${PYTHON:-/usr/bin/python3}
MINOR=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
LOCK=$TOP/lock/py$MINOR/runtime.txt
[ -f "$LOCK" ] || { echo "wheelhouse.sh: no lock for Python $MINOR ($LOCK)" >&2; exit 1; }

mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# pip download for PYTHON's own version and platform: the venv install.sh makes runs on it.
"$PYTHON" -m venv "$work/env"
fill() {
  "$work/env/bin/python" -m pip --disable-pip-version-check --no-input --quiet download "$@" \
    --dest "$DIR" --find-links "$DIR" --only-binary :all: --require-hashes --no-deps \
    -r "$TOP/lock/build.txt" -r "$LOCK"
}

if fill --no-index 2>/dev/null; then
  echo "wheelhouse.sh: $DIR already holds every file of lock/build.txt and lock/py$MINOR/runtime.txt" >&2
else
  echo "wheelhouse.sh: fetching what lock/build.txt and lock/py$MINOR/runtime.txt pin into $DIR" >&2
  fill
fi

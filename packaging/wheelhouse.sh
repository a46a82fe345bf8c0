#!/usr/bin/env bash
# wheelhouse.sh [DIR]: make DIR (default /var/cache/capyctl-build/wheels, or
# $CAPYCTL_WHEELHOUSE) hold every wheel an offline `install.sh --wheelhouse DIR` needs:
# CapyCTL's dependencies for this Python, and setuptools/wheel to build CapyCTL itself.
#
# Offline first: when the cache already satisfies the checkout's requirements nothing is
# downloaded, so repeated package builds take seconds. Otherwise pip fetches what is missing
# from the index (PIP_INDEX_URL and the other PIP_* variables apply).
set -euo pipefail

TOP=$(cd "$(dirname "$0")/.." && pwd)
DIR=${1:-${CAPYCTL_WHEELHOUSE:-/var/cache/capyctl-build/wheels}}
PYTHON=${PYTHON:-/usr/bin/python3}
# setuptools>=77 is pyproject.toml's build requirement.
BUILD_REQUIREMENTS=("setuptools>=77" "wheel")

mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

"$PYTHON" -m venv "$work/env"
pip=("$work/env/bin/python" -m pip --disable-pip-version-check --no-input --quiet)
# A copy of the project (without the checkout's build leftovers) to resolve requirements from.
tar -C "$TOP" --exclude=__pycache__ -cf - pyproject.toml README.md capyctl | tar -C "$work" -xf -
mkdir "$work/project" && mv "$work/pyproject.toml" "$work/README.md" "$work/capyctl" "$work/project/"

fill() {
  "${pip[@]}" download "$@" --dest "$DIR" --find-links "$DIR" --only-binary :all: "${BUILD_REQUIREMENTS[@]}" &&
  "${pip[@]}" wheel "$@" --wheel-dir "$work/wheels" --find-links "$DIR" --prefer-binary "$work/project" &&
  find "$work/wheels" -name '*.whl' ! -name 'capyctl-*' -exec cp -n {} "$DIR/" \;
}

if fill --no-index 2>/dev/null; then
  echo "wheelhouse.sh: $DIR already holds every wheel" >&2
else
  echo "wheelhouse.sh: fetching missing wheels into $DIR" >&2
  fill
fi

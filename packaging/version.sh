#!/bin/sh
# Prints CapyCTL's version. The one source is capyctl/__init__.py (__version__), which
# pyproject.toml also reads; packaging scripts call this rather than repeat the number.
set -eu
top=$(cd "$(dirname "$0")/.." && pwd)
version=$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' "$top/capyctl/__init__.py")
[ -n "$version" ] || { echo "version.sh: no __version__ in $top/capyctl/__init__.py" >&2; exit 1; }
echo "$version"

#!/usr/bin/env bash
# packaging/rpm/build.sh [--out DIR] [--wheelhouse DIR]
#
# Builds capyctl-<version>-1.x86_64.rpm from packaging/rpm/capyctl.spec with rpmbuild
# (on Debian: apt-get install rpm). Prints the path of the .rpm on stdout.
#
#   --out DIR         where the .rpm goes (default: dist/ in the checkout)
#   --wheelhouse DIR  wheel cache (default /var/cache/capyctl-build/wheels), see wheelhouse.sh
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
TOP=$(cd "$HERE/../.." && pwd)
OUT="$TOP/dist"
WHEELHOUSE=${CAPYCTL_WHEELHOUSE:-/var/cache/capyctl-build/wheels}

while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT=$2; shift 2 ;;
    --wheelhouse) WHEELHOUSE=$2; shift 2 ;;
    -h|--help) sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "build.sh: unknown option '$1'" >&2; exit 2 ;;
  esac
done

command -v rpmbuild >/dev/null || { echo "build.sh: rpmbuild is not installed; apt-get install rpm" >&2; exit 1; }
VERSION=$("$TOP/packaging/version.sh")
"$TOP/packaging/wheelhouse.sh" "$WHEELHOUSE" >&2
WHEELHOUSE=$(cd "$WHEELHOUSE" && pwd)

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
rpmbuild -bb "$HERE/capyctl.spec" \
  --define "_topdir $work" \
  --define "_rpmdir $OUT" \
  --define "_build_name_fmt %%{NAME}-%%{VERSION}-%%{RELEASE}.%%{ARCH}.rpm" \
  --define "capyctl_version $VERSION" \
  --define "capyctl_python_abi $(/usr/bin/python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')" \
  --define "capyctl_src $TOP" \
  --define "capyctl_wheels $WHEELHOUSE" >&2
rpm="$OUT/capyctl-$VERSION-1.x86_64.rpm"
[ -f "$rpm" ] || { echo "build.sh: rpmbuild did not produce $rpm" >&2; exit 1; }
echo "$rpm"

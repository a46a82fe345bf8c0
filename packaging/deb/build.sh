#!/usr/bin/env bash
# packaging/deb/build.sh [--out DIR] [--wheelhouse DIR]
#
# Builds capyctl_<version>_<arch>.deb with dpkg-deb: a virtual environment under /opt/capyctl
# made at build time (install.sh --root) with CapyCTL and its dependencies from a wheel cache,
# the systemd units, sysusers.d and tmpfiles.d entries, the bash completion and the docs, and
# the maintainer scripts in this directory. Prints the path of the .deb on stdout.
#
#   --out DIR         where the .deb goes (default: dist/ in the checkout)
#   --wheelhouse DIR  wheel cache (default /var/cache/capyctl-build/wheels); filled by
#                     packaging/wheelhouse.sh, from the index only when something is missing
# Needs dpkg-deb and python3-venv for Debian's /usr/bin/python3, which the package runs on.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
TOP=$(cd "$HERE/../.." && pwd)
OUT="$TOP/dist"
WHEELHOUSE=${CAPYCTL_WHEELHOUSE:-/var/cache/capyctl-build/wheels}
# The interpreter the installed package runs on: the system's, named by the Depends below.
PYTHON=/usr/bin/python3

while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT=$2; shift 2 ;;
    --wheelhouse) WHEELHOUSE=$2; shift 2 ;;
    -h|--help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "build.sh: unknown option '$1'" >&2; exit 2 ;;
  esac
done

command -v dpkg-deb >/dev/null || { echo "build.sh: dpkg-deb is missing (apt-get install dpkg)" >&2; exit 1; }
VERSION=$("$TOP/packaging/version.sh")
ARCH=$(dpkg --print-architecture)
# The environment's site-packages and binary wheels are for this Python minor version only.
PY_MINOR=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
PY_NEXT=$("$PYTHON" -c 'import sys; print("%d.%d" % (sys.version_info[0], sys.version_info[1] + 1))')

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
root="$work/root"

PYTHON=$PYTHON "$TOP/packaging/wheelhouse.sh" "$WHEELHOUSE" >&2
"$TOP/install.sh" --root "$root" --prefix /opt/capyctl --vendor --unit-dir /lib/systemd/system \
  --python "$PYTHON" --wheelhouse "$WHEELHOUSE" --no-start >&2
# The record of installed files is for install.sh --uninstall; dpkg keeps its own.
rm -f "$root/opt/capyctl/share/capyctl/installed-files"
rmdir -p "$root/opt/capyctl/share/capyctl" 2>/dev/null || true

install -d "$root/DEBIAN"
for script in postinst prerm postrm; do
  install -m 0755 "$HERE/$script" "$root/DEBIAN/$script"
done
installed_kib=$(du -sk --exclude=DEBIAN "$root" | cut -f1)
cat > "$root/DEBIAN/control" <<CONTROL
Package: capyctl
Version: $VERSION
Architecture: $ARCH
Maintainer: CapyCTL maintainers <capyctl@localhost>
Installed-Size: $installed_kib
Depends: python3 (>= $PY_MINOR), python3 (<< $PY_NEXT), systemd, adduser
Recommends: bash-completion
Section: admin
Priority: optional
Description: runs more LLMs than a GPU machine can hold, behind one OpenAI endpoint
 CapyCTL deploys, parks, wakes and switches model servers (vLLM, SGLang, TensorFold,
 llama.cpp's llama-server or a custom server) as transient systemd units in capyctl.slice,
 behind one OpenAI-compatible endpoint with API keys. A parked model releases its memory
 and wakes on the next request for it. The endpoint is capyctl.socket (127.0.0.1:8000).
CONTROL

mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
deb="$OUT/capyctl_${VERSION}_${ARCH}.deb"
# zstd (dpkg >= 1.21.18, Debian 12): 2 s and 25 MB here, where gzip -9 takes 35 s for 26 MB
# and xz minutes, for the ~90 MB environment.
dpkg-deb --root-owner-group -Zzstd -z3 --build "$root" "$deb" >&2
echo "$deb"

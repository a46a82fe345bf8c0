#!/usr/bin/env bash
# install.sh: install CapyCTL from this checkout into a self-contained virtual environment.
#
# Run it as root on the machine itself, or with --root DESTDIR to stage a package tree
# (packaging/deb/build.sh and packaging/rpm/capyctl.spec do that). See --help.
set -euo pipefail

SRC=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
UNITS_SRC="$SRC/units"
COMPLETION_SRC="$SRC/packaging/bash-completion/capyctl"
# The unit files refer to the daemon by this path; another --prefix is substituted into them.
UNIT_PREFIX=/opt/capyctl
# Sockets enabled at install time. capyctl.socket is the OpenAI endpoint; capyctl-api.socket,
# when the units provide it, lets the CLI start the daemon too.
SOCKETS=(capyctl.socket capyctl-api.socket)
STATE_DIR=/var/lib/capyctl
RUNTIME_DIR=/run/capyctl

PREFIX=/opt/capyctl
DESTDIR=""
BIN_DIR=/usr/bin
UNIT_DIR=/etc/systemd/system
SYSUSERS_DIR=/etc/sysusers.d
TMPFILES_DIR=/etc/tmpfiles.d
COMPLETION_DIR=/usr/share/bash-completion/completions
DOC_DIR=/usr/share/doc/capyctl
PYTHON=/usr/bin/python3
WHEELHOUSES=()
ACTION=install
PURGE=0
START=1

usage() {
  cat <<EOF
Usage: install.sh [OPTIONS]
       install.sh --uninstall [--purge] [OPTIONS]

Install CapyCTL from this checkout ($SRC):
  - a virtual environment at PREFIX with CapyCTL and its dependencies at the versions
    lock/py3.X/runtime.txt pins for PYTHON, every file's hash checked (pip),
  - the link BIN_DIR/capyctl,
  - the systemd units from units/ into UNIT_DIR, sysusers.d and tmpfiles.d entries
    (then systemd-sysusers and systemd-tmpfiles --create, or groupadd/useradd and mkdir),
  - the bash completion and the documentation,
  - then systemctl daemon-reload and systemctl enable --now capyctl.socket when systemd runs.
Running it again upgrades in place; /var/lib/capyctl is never touched by an install.

Options:
  --prefix DIR          virtual environment location (default $PREFIX)
  --root DESTDIR        stage everything under DESTDIR for a package; runs nothing on this
                        system (no users, no systemctl) and makes the tree relocatable to /
  --bin-dir DIR         where the capyctl link goes (default $BIN_DIR)
  --unit-dir DIR        systemd unit directory (default $UNIT_DIR)
  --sysusers-dir DIR    default $SYSUSERS_DIR
  --tmpfiles-dir DIR    default $TMPFILES_DIR
  --completion-dir DIR  default $COMPLETION_DIR
  --doc-dir DIR         default $DOC_DIR
  --vendor              package layout: units in /usr/lib/systemd/system, sysusers.d and
                        tmpfiles.d under /usr/lib (give --unit-dir after it to change one)
  --python PYTHON       interpreter for the environment, 3.11 or newer (default $PYTHON)
  --wheelhouse DIR      install offline from wheels in DIR (pip --no-index --find-links DIR);
                        repeatable. DIR needs the files lock/build.txt and lock/py3.X/runtime.txt
                        name (packaging/wheelhouse.sh fills it); their hashes are checked.
  --no-start            install, but do not enable or start capyctl.socket
  --uninstall           remove what an install made; keeps $STATE_DIR
  --purge               with --uninstall: remove $STATE_DIR too (models, keys, state database)
  -h, --help            this text

Environment: PIP_INDEX_URL and the other PIP_* variables reach pip as usual.
EOF
}

say() { echo "install.sh: $*" >&2; }
die() { say "error: $*"; exit 1; }

while [ $# -gt 0 ]; do
  case "$1" in
    --prefix) PREFIX=${2:?--prefix needs a directory}; shift 2 ;;
    --root|--destdir) DESTDIR=${2:?--root needs a directory}; shift 2 ;;
    --bin-dir) BIN_DIR=${2:?}; shift 2 ;;
    --unit-dir) UNIT_DIR=${2:?}; shift 2 ;;
    --sysusers-dir) SYSUSERS_DIR=${2:?}; shift 2 ;;
    --tmpfiles-dir) TMPFILES_DIR=${2:?}; shift 2 ;;
    --completion-dir) COMPLETION_DIR=${2:?}; shift 2 ;;
    --doc-dir) DOC_DIR=${2:?}; shift 2 ;;
    --vendor) UNIT_DIR=/usr/lib/systemd/system; SYSUSERS_DIR=/usr/lib/sysusers.d
              TMPFILES_DIR=/usr/lib/tmpfiles.d; shift ;;
    --python) PYTHON=${2:?}; shift 2 ;;
    --wheelhouse) WHEELHOUSES+=("$(cd "${2:?--wheelhouse needs a directory}" && pwd)") || die "no directory $2"
                  shift 2 ;;
    --no-start) START=0; shift ;;
    --uninstall) ACTION=uninstall; shift ;;
    --purge) PURGE=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) usage >&2; die "unknown option '$1'" ;;
  esac
done

case "$PREFIX" in /*) ;; *) die "--prefix must be an absolute path, got '$PREFIX'" ;; esac
[ "$PREFIX" != / ] || die "--prefix / would put a virtual environment over the whole system"
if [ -n "$DESTDIR" ]; then
  mkdir -p "$DESTDIR"
  DESTDIR=$(cd "$DESTDIR" && pwd)
  [ "$DESTDIR" != / ] || DESTDIR=""
fi
[ $PURGE = 0 ] || [ $ACTION = uninstall ] || die "--purge goes with --uninstall"
if [ -z "$DESTDIR" ] && [ "$(id -u)" != 0 ]; then
  die "needs root to install into the system (or give --root DESTDIR to stage a tree)"
fi

# Where a path lands: under DESTDIR when staging.
dest() { echo "$DESTDIR$1"; }
# Files this install put outside PREFIX, so that --uninstall removes exactly those.
INSTALLED_LIST="$PREFIX/share/capyctl/installed-files"

systemd_running() {
  # sd_booted(3): systemd is PID 1 of this system (not just installed).
  [ -z "$DESTDIR" ] && [ -d /run/systemd/system ] && command -v systemctl >/dev/null 2>&1
}

version_of_checkout() {
  sed -n 's/^__version__ = "\(.*\)"$/\1/p' "$SRC/capyctl/__init__.py"
}

# ---------------------------------------------------------------------------------- install

make_venv() {
  local venv
  venv=$(dest "$PREFIX")
  command -v "$PYTHON" >/dev/null 2>&1 || die "no Python interpreter '$PYTHON' (give --python)"
  "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
    || die "$PYTHON is $("$PYTHON" -V 2>&1); CapyCTL needs Python 3.11 or newer"
  "$PYTHON" -c 'import venv, ensurepip' 2>/dev/null \
    || die "$PYTHON cannot make virtual environments; on Debian: apt-get install python3-venv"
  local want have=""
  want=$("$PYTHON" -c 'import sys; print(sys.version_info[:2])')
  [ -x "$venv/bin/python" ] && have=$("$venv/bin/python" -c 'import sys; print(sys.version_info[:2])' 2>/dev/null || true)
  if [ "$have" = "$want" ]; then
    say "upgrading the environment in $PREFIX"
  else
    # Missing, broken, or made by another Python: start afresh (state lives elsewhere).
    say "creating the environment in $PREFIX with $("$PYTHON" -V 2>&1)"
    "$PYTHON" -m venv --clear "$venv"
  fi
}

pip_install() {
  local venv=$1; shift
  local args=(--disable-pip-version-check --no-input --quiet)
  if [ ${#WHEELHOUSES[@]} -gt 0 ]; then
    args+=(--no-index)
    local w
    for w in "${WHEELHOUSES[@]}"; do args+=(--find-links "$w"); done
  fi
  local command=$1; shift
  # Staged trees are byte-compiled afterwards with the final paths (see relocate).
  [ -z "$DESTDIR" ] || [ "$command" != install ] || args+=(--no-compile)
  "$venv/bin/python" -m pip "$command" "${args[@]}" "$@"
}

# The lock for the environment's Python (scripts/lock writes one per supported Python).
lock_file() {
  local venv minor
  venv=$(dest "$PREFIX")
  minor=$("$venv/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  [ -f "$SRC/lock/py$minor/runtime.txt" ] || die "no lock for Python $minor in $SRC/lock (it has \
$(cd "$SRC/lock" && ls -d py* | sed 's/^py//' | tr '\n' ' ')); give --python one of those"
  echo "$SRC/lock/py$minor/runtime.txt"
}

install_project() {
  local venv build wheel lock
  venv=$(dest "$PREFIX")
  lock=$(lock_file)
  build=$(mktemp -d)
  # shellcheck disable=SC2064
  trap "rm -rf '$build'" EXIT
  # Exactly the locked releases, each file's hash checked (a file the lock does not name is
  # refused, from the index or a wheelhouse alike). --no-deps: the lock holds every dependency.
  say "installing pip, setuptools and wheel from lock/build.txt"
  pip_install "$venv" install --require-hashes --no-deps -r "$SRC/lock/build.txt" >&2 \
    || die "pip could not install lock/build.txt (offline? give --wheelhouse; packaging/wheelhouse.sh fills one)"
  # Build from a copy: the checkout may be read-only and may hold others' build leftovers.
  tar -C "$SRC" --exclude=.venv --exclude=.git --exclude='*.egg-info' --exclude=build --exclude=dist \
      --exclude=__pycache__ --exclude=.pytest_cache --exclude=.hypothesis \
      -cf - pyproject.toml README.md capyctl | tar -C "$build" -xf -
  [ -f "$SRC/LICENSE" ] && cp "$SRC/LICENSE" "$build/"
  say "building the CapyCTL $(version_of_checkout) wheel"
  # With the locked setuptools just installed, not one fetched for an isolated build.
  pip_install "$venv" wheel --no-deps --no-build-isolation --wheel-dir "$build/dist" "$build" >&2 \
    || die "building the CapyCTL wheel failed"
  wheel=$(ls "$build"/dist/capyctl-*.whl)
  say "installing CapyCTL's dependencies from ${lock#"$SRC/"} into $PREFIX"
  pip_install "$venv" install --require-hashes --no-deps -r "$lock" >&2 \
    || die "pip could not install ${lock#"$SRC/"} (offline? give --wheelhouse; packaging/wheelhouse.sh fills one)"
  # Same version, new code: make sure this build is the one installed.
  pip_install "$venv" install --force-reinstall --no-deps "$wheel" >&2
  # An upgrade in place leaves what an older lock named: remove every distribution this lock and
  # lock/build.txt do not name, so the environment is the lock.
  local stale
  stale=$("$venv/bin/python" - "$lock" "$SRC/lock/build.txt" <<'PY'
import importlib.metadata, re, sys
def canon(name): return re.sub(r"[-_.]+", "-", name).lower()
keep = {"capyctl"}
for path in sys.argv[1:]:
    keep |= {canon(m[1]) for m in re.finditer(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==", open(path).read(), re.M)}
print(" ".join(sorted({d.metadata["Name"] for d in importlib.metadata.distributions() if canon(d.metadata["Name"]) not in keep})))
PY
)
  if [ -n "$stale" ]; then
    say "removing what the lock no longer names: $stale"
    # shellcheck disable=SC2086
    "$venv/bin/python" -m pip uninstall --disable-pip-version-check --no-input -q -y $stale >&2
  fi
  "$venv/bin/python" -m pip check >&2 || die "the installed environment is inconsistent (pip check above)"
  rm -rf "$build"
  trap - EXIT
}

relocate() {
  # A virtual environment records its own path in scripts and activate files; a staged one
  # must name PREFIX, where it will live, not DESTDIR/PREFIX, where it was built.
  [ -n "$DESTDIR" ] || return 0
  local venv file
  venv=$(dest "$PREFIX")
  grep -rlI --null -F "$venv" "$venv" 2>/dev/null | while IFS= read -r -d '' file; do
    sed -i "s|$venv|$PREFIX|g" "$file"
  done
  if grep -rqI -F "$DESTDIR" "$venv"; then
    die "the staged environment still names $DESTDIR: $(grep -rlI -F "$DESTDIR" "$venv" | head -3)"
  fi
  find "$venv" -name __pycache__ -type d -prune -exec rm -rf {} +
  # Byte-code with the final source paths (tracebacks), so Python never rewrites it at runtime.
  "$venv/bin/python" -m compileall -q -j 0 -s "$DESTDIR" -p / "$venv/lib" >/dev/null
}

put() {  # put MODE SOURCE TARGET: install one file and remember it for --uninstall
  local mode=$1 source=$2 target=$3
  install -D -m "$mode" "$source" "$(dest "$target")"
  echo "$target" >> "$(dest "$INSTALLED_LIST").new"
}

substitute_prefix() {
  [ "$PREFIX" = "$UNIT_PREFIX" ] || sed -i "s|$UNIT_PREFIX/|$PREFIX/|g" "$1"
}

install_files() {
  mkdir -p "$(dest "$(dirname "$INSTALLED_LIST")")"
  : > "$(dest "$INSTALLED_LIST").new"

  local link
  link=$(dest "$BIN_DIR/capyctl")
  mkdir -p "$(dirname "$link")"
  ln -sfn "$PREFIX/bin/capyctl" "$link"
  echo "$BIN_DIR/capyctl" >> "$(dest "$INSTALLED_LIST").new"

  [ -f "$UNITS_SRC/capyctl.service" ] || die "$UNITS_SRC/capyctl.service is missing: this checkout has no units"
  local unit
  for unit in "$UNITS_SRC"/*.service "$UNITS_SRC"/*.socket "$UNITS_SRC"/*.slice; do
    [ -f "$unit" ] || continue
    put 0644 "$unit" "$UNIT_DIR/$(basename "$unit")"
    substitute_prefix "$(dest "$UNIT_DIR/$(basename "$unit")")"
  done
  [ -f "$UNITS_SRC/sysusers.d/capyctl.conf" ] && put 0644 "$UNITS_SRC/sysusers.d/capyctl.conf" "$SYSUSERS_DIR/capyctl.conf"
  [ -f "$UNITS_SRC/tmpfiles.d/capyctl.conf" ] && put 0644 "$UNITS_SRC/tmpfiles.d/capyctl.conf" "$TMPFILES_DIR/capyctl.conf"

  [ -f "$COMPLETION_SRC" ] || die "$COMPLETION_SRC is missing (scripts/gen-docs makes it)"
  put 0644 "$COMPLETION_SRC" "$COMPLETION_DIR/capyctl"

  local doc
  for doc in "$SRC/README.md" "$SRC"/docs/*.md "$SRC"/docs/*.json "$SRC"/docs/*.yaml; do
    [ -f "$doc" ] && put 0644 "$doc" "$DOC_DIR/$(basename "$doc")"
  done
  mv "$(dest "$INSTALLED_LIST").new" "$(dest "$INSTALLED_LIST")"
}

create_user_and_dirs() {
  [ -z "$DESTDIR" ] || return 0
  local sysusers="$SYSUSERS_DIR/capyctl.conf" tmpfiles="$TMPFILES_DIR/capyctl.conf"
  if [ -f "$sysusers" ] && command -v systemd-sysusers >/dev/null 2>&1; then
    systemd-sysusers "$sysusers"
  else
    getent group capyctl >/dev/null || groupadd --system capyctl
    getent passwd capyctl >/dev/null || useradd --system --gid capyctl --home-dir "$STATE_DIR" \
      --no-create-home --shell /usr/sbin/nologin --comment "CapyCTL" capyctl
  fi
  if [ -f "$tmpfiles" ] && command -v systemd-tmpfiles >/dev/null 2>&1; then
    systemd-tmpfiles --create "$tmpfiles"
  elif [ -f "$tmpfiles" ]; then
    # Without systemd-tmpfiles: the directory lines ("d PATH MODE USER GROUP AGE") by hand.
    local type path mode user group
    while read -r type path mode user group _; do
      case "$type" in
        d|D) install -d -m "${mode/#-/0755}" -o "${user/#-/root}" -g "${group/#-/root}" "$path" ;;
      esac
    done < "$tmpfiles"
  else
    install -d -m 0750 "$STATE_DIR"
  fi
}

start_sockets() {
  if ! systemd_running; then
    [ -n "$DESTDIR" ] || say "systemd is not running on this system: not enabling capyctl.socket" \
      "(run 'systemctl enable --now capyctl.socket' once it does, or 'capyctl start standalone')"
    return 0
  fi
  systemctl daemon-reload
  [ $START = 1 ] || { say "--no-start: capyctl.socket is installed but not enabled"; return 0; }
  local socket enable=()
  for socket in "${SOCKETS[@]}"; do
    [ -f "$UNIT_DIR/$socket" ] && enable+=("$socket")
  done
  systemctl enable --now "${enable[@]}"
  # An upgrade: a running daemon keeps the old code until it restarts; say so rather than
  # interrupt it (engines keep serving either way).
  if systemctl is-active --quiet capyctl.service; then
    say "capyctl.service runs the previous version; 'systemctl restart capyctl.service' loads this one"
  fi
}

do_install() {
  make_venv
  install_project
  relocate
  install_files
  create_user_and_dirs
  start_sockets
  say "installed CapyCTL $(version_of_checkout) in ${DESTDIR}$PREFIX"
}

# -------------------------------------------------------------------------------- uninstall

do_uninstall() {
  if systemd_running; then
    local socket
    for socket in "${SOCKETS[@]}"; do
      systemctl disable --now "$socket" >/dev/null 2>&1 || true
    done
    systemctl stop capyctl.service >/dev/null 2>&1 || true
  fi
  # What `systemctl enable` made, whether or not a systemd runs now to disable it (an install made
  # where systemd ran, removed from a rescue shell or a container) and whether or not its unit
  # files are still there: a link left behind makes the next install look half done.
  local socket_link
  for socket_link in "${SOCKETS[@]}"; do
    rm -f "$(dest "/etc/systemd/system/sockets.target.wants/$socket_link")"
  done
  local list file files=()
  list=$(dest "$INSTALLED_LIST")
  if [ -f "$list" ]; then
    mapfile -t files < "$list"
  else
    # No record (an older or damaged install): the default locations.
    files=("$BIN_DIR/capyctl" "$COMPLETION_DIR/capyctl" "$SYSUSERS_DIR/capyctl.conf" "$TMPFILES_DIR/capyctl.conf")
    for file in "$UNITS_SRC"/*.service "$UNITS_SRC"/*.socket "$UNITS_SRC"/*.slice; do
      [ -f "$file" ] && files+=("$UNIT_DIR/$(basename "$file")")
    done
    for file in "$SRC/README.md" "$SRC"/docs/*.md; do files+=("$DOC_DIR/$(basename "$file")"); done
  fi
  for file in "${files[@]}"; do
    [ -n "$file" ] || continue
    rm -f "$(dest "$file")"
  done
  # Only directories of our own; shared ones (completions, sysusers.d) stay even when empty.
  rmdir "$(dest "$DOC_DIR")" 2>/dev/null || true
  rm -rf "$(dest "$PREFIX")"
  systemd_running && systemctl daemon-reload
  if [ $PURGE = 1 ]; then
    rm -rf "$(dest "$STATE_DIR")" "$(dest "$RUNTIME_DIR")"
    say "removed CapyCTL and its state ($STATE_DIR); the capyctl user and group stay (userdel capyctl)"
  else
    say "removed CapyCTL; its state stays in $STATE_DIR (--purge removes it)"
  fi
}

case $ACTION in
  install) do_install ;;
  uninstall) do_uninstall ;;
esac

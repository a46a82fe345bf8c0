"""What an engine unit may see: an unprivileged user, its own cache, its model, nothing of CapyCTL's.

Each engine runs as a ``DynamicUser=yes`` user of its own. Homes are replaced by empty tmpfs
(``ProtectHome=tmpfs``) and CapyCTL's state directory by an empty read-only tmpfs, and only what
the engine needs is bound back read-only at its own path: its binary or virtual environment, the
Python installation that environment points to (``pyvenv.cfg`` ``home =``, often under
``/root/.pyenv``, which a non-root user could not enter anyway), and its model (a Hub model's
whole repository cache, whose snapshot files are links into ``blobs/``). The state database, the
secrets directory and the management API socket are then out of its reach; its key arrives as a
systemd credential (see TransientUnit.credentials).

Paths are probed on the engine's own host: through SSH for a remote one, in one shell command;
on the daemon's own host in its own process (probe_local, the same findings without a dozen
short processes on every wake).
"""

from __future__ import annotations

import grp
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any, Awaitable, Callable

from ..config import Paths

# What ProtectHome=tmpfs hides (systemd.exec(5): "/home/, /root, and /run/user").
HIDDEN_BY_PROTECT_HOME = ("/home", "/root", "/run/user")
# CacheDirectory= of every engine unit, below /var/cache: the engine's HOME and every cache.
ENGINE_CACHE_PARENT = "capyctl-engine"

# One round trip: the real path of each path argument (and of a virtual environment's
# interpreter, from its pyvenv.cfg), then mode and group of each device node after "--".
PROBE_SCRIPT = r'''
for p in "$@"; do
  shift
  [ "$p" = -- ] && break
  [ -e "$p" ] || continue
  if [ -d "$p" ]; then kind=dir; else kind=file; fi
  printf 'path %s %s\n' "$kind" "$(readlink -f -- "$p")"
  d=$p; [ -d "$d" ] || d=$(dirname -- "$p")
  for cfg in "$d/pyvenv.cfg" "$(dirname -- "$d")/pyvenv.cfg"; do
    [ -f "$cfg" ] || continue
    home=$(sed -n 's/^home *= *//p' "$cfg" | head -n 1)
    for py in "$home/python3" "$home/python"; do
      if [ -e "$py" ]; then printf 'python %s\n' "$(readlink -f -- "$py")"; break; fi
    done
  done
done
for dev in "$@"; do
  [ -e "$dev" ] && printf 'device %s %s\n' "$(stat -L -c '%a %G' -- "$dev")" "$dev"
done
exit 0
'''

Runner = Callable[[list[str]], Awaitable[tuple[int, bytes, bytes]]]


def engine_location(engine: Any) -> str | None:
    """The binary or virtual environment an engine registration runs from (a custom engine's
    command's first word)."""
    return engine.path or (engine.cmd[0] if getattr(engine, "cmd", None) else None)


def engine_cache_dir(deployment: str) -> str:
    return f"/var/cache/{ENGINE_CACHE_PARENT}/{deployment}"


def cache_environment(cache_dir: str) -> dict[str, str]:
    """Point every cache an engine writes into its own CacheDirectory=, not root's home.

    HOME covers whatever expands ``~`` (torch hub, triton's ``~/.triton``); the rest are the names
    the engines read: vLLM's VLLM_CACHE_ROOT and VLLM_CONFIG_ROOT (vllm/envs.py, 0.32.0, default
    ``~/.cache/vllm`` / ``~/.config/vllm`` through XDG_CACHE_HOME / XDG_CONFIG_HOME), Triton's
    TRITON_CACHE_DIR (triton/knobs.py), Hugging Face's HF_HOME (huggingface_hub/constants.py) and
    TorchInductor's TORCHINDUCTOR_CACHE_DIR (torch/_inductor/runtime/cache_dir_utils.py; its
    default under /tmp would be lost with PrivateTmp at every start).
    """
    return {
        "HOME": cache_dir,
        "XDG_CACHE_HOME": cache_dir,
        "XDG_CONFIG_HOME": f"{cache_dir}/config",
        "VLLM_CACHE_ROOT": f"{cache_dir}/vllm",
        "VLLM_CONFIG_ROOT": f"{cache_dir}/config/vllm",
        "TRITON_CACHE_DIR": f"{cache_dir}/triton",
        "HF_HOME": f"{cache_dir}/huggingface",
        "TORCHINDUCTOR_CACHE_DIR": f"{cache_dir}/torchinductor",
    }


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def hidden(path: str) -> bool:
    return any(_under(path, root) for root in HIDDEN_BY_PROTECT_HOME)


@dataclass
class Probe:
    """What PROBE_SCRIPT found on the host."""

    real_paths: list[tuple[str, bool]] = field(default_factory=list)  # (real path, is a directory)
    interpreters: list[str] = field(default_factory=list)
    devices: dict[str, tuple[int, str]] = field(default_factory=dict)  # node -> (mode, group)

    @classmethod
    def parse(cls, text: str) -> "Probe":
        probe = cls()
        for line in text.splitlines():
            kind, _, rest = line.partition(" ")
            if kind == "path":
                what, _, real = rest.partition(" ")
                if real.startswith("/"):
                    probe.real_paths.append((real, what == "dir"))
            elif kind == "python" and rest.startswith("/"):
                probe.interpreters.append(rest)
            elif kind == "device":
                mode, group, node = (rest.split(" ", 2) + ["", ""])[:3]
                try:
                    probe.devices[node] = (int(mode, 8), group)
                except ValueError:
                    continue
        return probe


@dataclass
class Confinement:
    """The TransientUnit fields that confine one engine (``TransientUnit(**c.unit_fields(), ...)``)."""

    bind_read_only_paths: list[str]
    temporary_file_systems: list[str]
    inaccessible_paths: list[str]
    supplementary_groups: list[str]
    cache_directory: str
    environment: dict[str, str]
    private_users: bool

    def unit_fields(self) -> dict[str, Any]:
        return {"dynamic_user": True, "protect_home": "tmpfs", "private_users": self.private_users,
                "bind_read_only_paths": self.bind_read_only_paths,
                "temporary_file_systems": self.temporary_file_systems,
                "inaccessible_paths": self.inaccessible_paths,
                "supplementary_groups": self.supplementary_groups, "cache_directory": self.cache_directory}


def confinement(paths: Paths, deployment: str, engine_path: str | None, model_path: str, devices: list[str],
                probe: Probe) -> Confinement:
    """Pure: the confinement of one engine from what was probed on its host."""
    state = str(paths.state_dir)
    models = str(paths.models_dir)
    binds: list[str] = []

    def bind(path: str) -> None:
        if path not in binds:
            binds.append(path)

    for path in [p for p in (engine_path, model_path) if p] + [real for real, _ in probe.real_paths]:
        if _under(path, models) and path != models:
            # A Hub snapshot's files are links into the repository's blobs/: the whole repository.
            rel = PurePosixPath(path).relative_to(models)
            bind(str(PurePosixPath(models) / rel.parts[0]))
        elif hidden(path):
            bind(path)
    if engine_path and probe.real_paths:
        real, is_dir = probe.real_paths[0]  # the engine's, probed first
        if not is_dir and hidden(real):
            # A binary in a build tree may load libraries beside it ($ORIGIN): its whole directory.
            bind(str(PurePosixPath(real).parent))
    for interpreter in probe.interpreters:
        prefix = str(PurePosixPath(interpreter).parent.parent)  # <prefix>/bin/python3.X
        if hidden(prefix):
            bind(prefix)
    groups = []
    for node in devices:
        mode, group = probe.devices.get(node, (0o666, "root"))
        # A node closed to others (mode o-rw) is opened through its group (render, video).
        if mode & 0o006 != 0o006 and mode & 0o060 == 0o060 and group not in ("root", "") and group not in groups:
            groups.append(group)
    cache = engine_cache_dir(deployment)
    return Confinement(
        bind_read_only_paths=binds,
        # An empty read-only tmpfs over the whole state directory: database, secrets and the other
        # models are gone; the bound model repository reappears alone at its own path.
        temporary_file_systems=[state],
        inaccessible_paths=[str(paths.runtime_dir), str(paths.secrets_dir), str(paths.database)],
        supplementary_groups=groups,
        cache_directory=f"{ENGINE_CACHE_PARENT}/{deployment}",
        environment=cache_environment(cache),
        # A user namespace hides every other uid; GPU units keep the host's (device groups).
        private_users=not devices,
    )


async def probe_host(run: Runner, engine_path: str | None, model_path: str, devices: list[str]) -> Probe:
    argv = ["sh", "-c", PROBE_SCRIPT, "capyctl-probe", *[p for p in (engine_path, model_path) if p], "--", *devices]
    rc, out, _ = await run(argv)
    return Probe.parse(out.decode(errors="replace")) if rc == 0 else Probe()


def probe_local(engine_path: str | None, model_path: str, devices: list[str]) -> Probe:
    """What PROBE_SCRIPT finds, found in this process: on the daemon's own host the script's
    dozen short processes (readlink, dirname, sed, stat) would be on every wake's path
    (benchmarks/wake_vs_manual.py)."""
    probe = Probe()
    for path in (engine_path, model_path):
        if not path or not os.path.exists(path):
            continue
        is_dir = os.path.isdir(path)
        probe.real_paths.append((os.path.realpath(path), is_dir))
        folder = path if is_dir else os.path.dirname(path)
        for cfg in (os.path.join(folder, "pyvenv.cfg"), os.path.join(os.path.dirname(folder), "pyvenv.cfg")):
            if not os.path.isfile(cfg):
                continue
            home = _pyvenv_home(cfg)
            for python in (f"{home}/python3", f"{home}/python"):
                if os.path.exists(python):
                    probe.interpreters.append(os.path.realpath(python))
                    break
    for node in devices:
        try:
            st = os.stat(node)
        except OSError:
            continue
        try:
            group = grp.getgrgid(st.st_gid).gr_name
        except KeyError:
            group = "UNKNOWN"  # what stat -c %G prints for a gid without a name
        probe.devices[node] = (stat.S_IMODE(st.st_mode), group)
    return probe


def _pyvenv_home(cfg: str) -> str:
    """The first ``home = ...`` of a pyvenv.cfg, as the script's ``sed -n 's/^home *= *//p' | head -n 1``."""
    try:
        with open(cfg, encoding="utf-8", errors="replace") as f:
            for line in f:
                match = re.match(r"home *= *", line)
                if match:
                    return line[match.end():].rstrip("\n")
    except OSError:
        pass
    return ""

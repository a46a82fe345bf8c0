"""What a transient engine unit is, and how it becomes systemd D-Bus properties.

Pure code, no bus: the property list is tested on any host.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from dbus_fast import Variant

from capyctl.config import SLICE
from capyctl.errors import SystemdError

# The gate shell a gated unit execs first (TransientUnit.gated; what an armed unit is: _gate.py).
from ._gate import GATE_NAME, GATE_SCRIPT

MARKER_PREFIX = "CAPYCTL_MARKER_"
_MARKER_KEY = re.compile(r"^[a-z][a-z0-9_]{0,63}$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_UNIT_NAME = re.compile(r"^[A-Za-z0-9:_.\\@-]{1,250}\.service$")
# ${NAME} stays a systemd expansion (secrets from EnvironmentFile); any other "$" is literal.
_BRACED_REF = re.compile(r"\$\{[A-Za-z_][A-Za-z0-9_]*\}")

# NVIDIA control nodes every CUDA process opens besides its /dev/nvidiaN.
GPU_CONTROL_DEVICES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")

# Address families a model server uses: loopback TCP, unix sockets (NCCL, tokenizer
# workers), netlink (interface discovery in NCCL/gloo).
_ADDRESS_FAMILIES = ["AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK"]

# A credential's name is a file name in the unit's credentials directory (systemd.exec(5)
# "LoadCredential=": no "/", not "." or "..").
_CREDENTIAL_NAME = re.compile(r"^[A-Za-z0-9_.@-]{1,200}$")
# MS_REC (linux/mount.h): BindReadOnlyPaths= binds recursively, as its unit-file form does.
_MS_REC = 16384
# The shell that exports credentials as environment variables (credential_environment).
CREDENTIAL_SHELL = "/bin/sh"


@dataclass
class TransientUnit:
    """One engine launch as a transient systemd service.

    ``argv`` is passed to systemd literally except that ``${NAME}`` is expanded by
    systemd from ``environment``/``environment_file`` (so a secret can be given on the
    command line without showing in ``systemctl show``); a bare ``$`` stays a ``$``.
    """

    name: str
    description: str
    argv: list[str]
    environment: dict[str, str] = field(default_factory=dict)
    environment_file: str | None = None
    working_directory: str | None = None
    slice: str = SLICE
    memory_max: int | None = None
    memory_high: int | None = None
    cpu_quota: float | None = None  # in cores: 1.5 = 150 % of one CPU
    allowed_cpus: str | None = None  # "0-3,6"
    # CPUWeight= (1 to 10000, systemd's default 100): its share of a CPU it contends for. On the
    # legacy hierarchy systemd writes it as the cpu controller's cpu.shares.
    cpu_weight: int | None = None
    tasks_max: int | None = None
    devices: list[str] = field(default_factory=list)  # /dev/nvidiaN nodes
    markers: dict[str, str] = field(default_factory=dict)
    # Paths the engine writes (caches, model dir while downloading); all else is read-only.
    read_write_paths: list[str] = field(default_factory=list)
    user: str | None = None
    group: str | None = None
    # A directory under /run that systemd creates for the unit (owned by its user, mode
    # runtime_directory_mode) and removes when it stops: where an engine's unix socket lives.
    runtime_directory: str | None = None
    runtime_directory_mode: int = 0o700
    # A network namespace of the unit's own with only loopback: for an engine served on a unix
    # socket, nothing on the machine can reach it over TCP either.
    private_network: bool = False
    hardening: bool = True
    # DynamicUser=yes: a uid/gid of its own, allocated at start and released at stop, that owns
    # nothing on the machine; systemd makes the unit's runtime/cache directories its own.
    dynamic_user: bool = False
    # PrivateUsers=yes: a user namespace with only root and the unit's own user mapped.
    private_users: bool = False
    # Groups for device nodes that are not open to everyone (/dev/dri/renderD* "render").
    supplementary_groups: list[str] = field(default_factory=list)
    # "read-only" (homes visible, read-only) or "tmpfs" (empty homes; bind back what is needed).
    protect_home: str = "read-only"
    # Paths made visible read-only at the same place (BindReadOnlyPaths=): under an empty home
    # (protect_home="tmpfs") or a hidden directory (temporary_file_systems) they reappear alone.
    bind_read_only_paths: list[str] = field(default_factory=list)
    # Directories replaced by an empty read-only tmpfs (TemporaryFileSystem=PATH:ro): nothing in
    # them is visible but what bind_read_only_paths brings back.
    temporary_file_systems: list[str] = field(default_factory=list)
    # Paths the unit cannot open at all (InaccessiblePaths=, "-": no error when absent).
    inaccessible_paths: list[str] = field(default_factory=list)
    # Credentials by name -> the file systemd reads (as root, before any sandboxing) and places
    # 0400, owned by the unit's user, in /run/credentials/<unit>/<name> (LoadCredential=).
    credentials: dict[str, str] = field(default_factory=dict)
    # The names among ``credentials`` whose file is encrypted (``systemd-creds encrypt``, with the
    # host's key and the TPM2 where there is one): loaded with LoadCredentialEncrypted=, so the
    # secret is never on disk in the clear; systemd decrypts it as it starts the unit.
    encrypted_credentials: frozenset[str] = frozenset()
    # Environment variables set at exec time from a credential, by name: for engines that read
    # their key only from the environment. A shell reads the credential file and execs argv;
    # the value is in neither the unit's properties nor any command line.
    credential_environment: dict[str, str] = field(default_factory=dict)
    # CacheDirectory= (relative to /var/cache): the engine's own caches, owned by its user.
    cache_directory: str | None = None
    # KillMode=mixed: SIGTERM to the main process, SIGKILL to stragglers after the timeout.
    stop_timeout: float = 30.0
    # Start the unit held at its gate (_gate.GATE_SCRIPT): sandboxed, its command not yet run;
    # SystemdClient.open_gate continues it.
    gated: bool = False

    def validate(self) -> None:
        if not _UNIT_NAME.match(self.name):
            raise SystemdError(f"'{self.name}' is not a valid service unit name.", code="invalid_unit")
        if not self.argv or not self.argv[0].startswith("/"):
            raise SystemdError("The command of a unit must start with an absolute path.",
                               code="invalid_unit")
        for key in self.environment:
            if not _ENV_NAME.match(key):
                raise SystemdError(f"'{key}' is not a valid environment variable name.",
                                   code="invalid_unit")
        for key in self.markers:
            if not _MARKER_KEY.match(key):
                raise SystemdError(f"Marker key '{key}' must be lower snake_case.", code="invalid_unit")
        if self.environment_file is not None and not self.environment_file.startswith("/"):
            raise SystemdError("The environment file must be an absolute path.", code="invalid_unit")
        for dev in self.devices:
            if not dev.startswith("/dev/"):
                raise SystemdError(f"Device '{dev}' is not a /dev node.", code="invalid_unit")
        if self.cpu_quota is not None and self.cpu_quota <= 0:
            raise SystemdError("cpu_quota must be a positive number of cores.", code="invalid_unit")
        if self.allowed_cpus is not None:
            parse_cpu_list(self.allowed_cpus)
        if self.cpu_weight is not None and not 1 <= self.cpu_weight <= 10000:
            raise SystemdError("cpu_weight must be from 1 to 10000.", code="invalid_unit")
        if self.runtime_directory is not None and (
                self.runtime_directory.startswith("/") or ".." in self.runtime_directory.split("/")):
            raise SystemdError("The runtime directory must be a relative path below /run.", code="invalid_unit")
        if self.cache_directory is not None and (
                self.cache_directory.startswith("/") or ".." in self.cache_directory.split("/")):
            raise SystemdError("The cache directory must be a relative path below /var/cache.", code="invalid_unit")
        if self.protect_home not in ("read-only", "tmpfs", "yes"):
            raise SystemdError(f"ProtectHome={self.protect_home} is not one CapyCTL uses.", code="invalid_unit")
        for path in [*self.bind_read_only_paths, *self.temporary_file_systems, *self.inaccessible_paths,
                     *self.credentials.values()]:
            if not path.startswith("/") or ":" in path:
                raise SystemdError(f"'{path}' must be an absolute path without ':'.", code="invalid_unit")
        for name in self.credentials:
            if not _CREDENTIAL_NAME.match(name) or name in (".", ".."):
                raise SystemdError(f"'{name}' is not a valid credential name.", code="invalid_unit")
        if not self.encrypted_credentials <= self.credentials.keys():
            raise SystemdError("An encrypted credential is not among the unit's credentials.", code="invalid_unit")
        for env, credential in self.credential_environment.items():
            if not _ENV_NAME.match(env):
                raise SystemdError(f"'{env}' is not a valid environment variable name.", code="invalid_unit")
            if credential not in self.credentials:
                raise SystemdError(f"Variable {env} names credential '{credential}', which the unit does not load.",
                                   code="invalid_unit")

    def exec_argv(self) -> list[str]:
        """The command systemd runs: argv itself, or the credential shell that exports
        credential_environment and then execs argv (same pid, so Type=exec and signals still
        reach the engine); a gated unit's gate shell first, which execs that in turn."""
        argv = list(self.argv)
        if self.credential_environment:
            argv = [CREDENTIAL_SHELL, "-c", credential_environment_script(self.credential_environment),
                    "capyctl-credentials", *argv]
        if self.gated:
            argv = [CREDENTIAL_SHELL, "-c", GATE_SCRIPT, GATE_NAME, *argv]
        return argv

    def environment_entries(self) -> list[str]:
        entries = [f"{k}={v}" for k, v in self.environment.items()]
        entries += [f"{MARKER_PREFIX}{k.upper()}={v}" for k, v in self.markers.items()]
        return entries

    def properties(self) -> list[tuple[str, Variant]]:
        """The a(sv) property list for StartTransientUnit."""
        self.validate()
        props: list[tuple[str, Variant]] = [
            ("Description", Variant("s", self.description)),
            ("Slice", Variant("s", self.slice)),
            # exec: the start job fails when the binary cannot be executed, not later.
            ("Type", Variant("s", "exec")),
            ("ExecStart", Variant("a(sasb)", [[self.exec_argv()[0], [escape_dollars(a) for a in self.exec_argv()],
                                               False]])),
            ("Environment", Variant("as", self.environment_entries())),
            # CapyCTL owns the restart policy: a crash must surface to it, not be hidden.
            ("Restart", Variant("s", "no")),
            ("KillMode", Variant("s", "mixed")),
            ("TimeoutStopUSec", Variant("t", int(self.stop_timeout * 1_000_000))),
            ("MemoryAccounting", Variant("b", True)),
            ("CPUAccounting", Variant("b", True)),
            ("TasksAccounting", Variant("b", True)),
            # Keep a failed unit loaded so its result and journal can be read.
            ("CollectMode", Variant("s", "inactive")),
        ]
        if self.environment_file:
            props.append(("EnvironmentFiles", Variant("a(sb)", [[self.environment_file, False]])))
        if self.working_directory:
            props.append(("WorkingDirectory", Variant("s", self.working_directory)))
        if self.memory_max is not None:
            props.append(("MemoryMax", Variant("t", self.memory_max)))
        if self.memory_high is not None:
            props.append(("MemoryHigh", Variant("t", self.memory_high)))
        if self.cpu_quota is not None:
            props.append(("CPUQuotaPerSecUSec", Variant("t", int(self.cpu_quota * 1_000_000))))
        if self.allowed_cpus is not None:
            mask = cpu_mask(parse_cpu_list(self.allowed_cpus))
            # AllowedCPUs= is the unified hierarchy's cpuset, which the engine cannot widen; on the
            # legacy hierarchy (cgroup v1) systemd ignores it, and CPUAffinity= (sched_setaffinity
            # at exec, inherited by every thread) is what binds. Both are given: each host takes
            # the one its hierarchy honours.
            props.append(("AllowedCPUs", Variant("ay", mask)))
            props.append(("CPUAffinity", Variant("ay", mask)))
        if self.cpu_weight is not None:
            props.append(("CPUWeight", Variant("t", self.cpu_weight)))
        if self.tasks_max is not None:
            props.append(("TasksMax", Variant("t", self.tasks_max)))
        if self.user:
            props.append(("User", Variant("s", self.user)))
        if self.group:
            props.append(("Group", Variant("s", self.group)))
        if self.runtime_directory is not None:
            props.append(("RuntimeDirectory", Variant("as", [self.runtime_directory])))
            props.append(("RuntimeDirectoryMode", Variant("u", self.runtime_directory_mode)))
        if self.private_network:
            props.append(("PrivateNetwork", Variant("b", True)))
        if self.dynamic_user:
            props.append(("DynamicUser", Variant("b", True)))
        if self.private_users:
            props.append(("PrivateUsers", Variant("b", True)))
        if self.supplementary_groups:
            props.append(("SupplementaryGroups", Variant("as", list(self.supplementary_groups))))
        plain = [[n, p] for n, p in self.credentials.items() if n not in self.encrypted_credentials]
        sealed = [[n, p] for n, p in self.credentials.items() if n in self.encrypted_credentials]
        if plain:
            props.append(("LoadCredential", Variant("a(ss)", plain)))
        if sealed:
            props.append(("LoadCredentialEncrypted", Variant("a(ss)", sealed)))
        if self.cache_directory is not None:
            props.append(("CacheDirectory", Variant("as", [self.cache_directory])))
            props.append(("CacheDirectoryMode", Variant("u", 0o700)))
        if self.temporary_file_systems:
            props.append(("TemporaryFileSystem", Variant("a(ss)", [[p, "ro"] for p in self.temporary_file_systems])))
        if self.bind_read_only_paths:
            props.append(("BindReadOnlyPaths", Variant("a(ssbt)", [[p, p, False, _MS_REC]
                                                                   for p in self.bind_read_only_paths])))
        if self.inaccessible_paths:
            props.append(("InaccessiblePaths", Variant("as", ["-" + p for p in self.inaccessible_paths])))
        if self.devices:
            allowed = list(dict.fromkeys([*self.devices, *GPU_CONTROL_DEVICES]))
            props.append(("DevicePolicy", Variant("s", "closed")))
            props.append(("DeviceAllow", Variant("a(ss)", [[d, "rw"] for d in allowed])))
        if self.hardening:
            props += self._hardening()
        return props

    def _hardening(self) -> list[tuple[str, Variant]]:
        props = [
            ("NoNewPrivileges", Variant("b", True)),
            ("ProtectSystem", Variant("s", "strict")),
            ("ProtectHome", Variant("s", self.protect_home)),
            ("PrivateTmp", Variant("b", True)),
            ("ProtectKernelTunables", Variant("b", True)),
            ("ProtectKernelModules", Variant("b", True)),
            ("ProtectKernelLogs", Variant("b", True)),
            ("ProtectControlGroups", Variant("b", True)),
            ("ProtectClock", Variant("b", True)),
            ("ProtectHostname", Variant("b", True)),
            ("ProtectProc", Variant("s", "invisible")),
            ("RestrictSUIDSGID", Variant("b", True)),
            ("RestrictRealtime", Variant("b", True)),
            ("RestrictNamespaces", Variant("t", 0)),  # the set of namespaces allowed: none
            ("LockPersonality", Variant("b", True)),
            ("RemoveIPC", Variant("b", True)),
            ("KeyringMode", Variant("s", "private")),
            ("UMask", Variant("u", 0o077)),
            ("CapabilityBoundingSet", Variant("t", 0)),
            ("AmbientCapabilities", Variant("t", 0)),
            ("SystemCallArchitectures", Variant("as", ["native"])),
            # Allow-list of the syscalls ordinary services make; @resources covers the
            # NUMA calls (mbind, set_mempolicy) that CUDA and PyTorch use.
            ("SystemCallFilter", Variant("(bas)", [True, ["@system-service", "@resources"]])),
            ("SystemCallErrorNumber", Variant("i", 1)),  # EPERM instead of a kill
            ("RestrictAddressFamilies", Variant("(bas)", [True, _ADDRESS_FAMILIES])),
        ]
        if not self.devices:
            # Without a GPU the engine needs no device nodes beyond /dev/null and friends.
            props.append(("PrivateDevices", Variant("b", True)))
        if self.read_write_paths:
            props.append(("ReadWritePaths", Variant("as", list(self.read_write_paths))))
        return props


def credential_environment_script(names: dict[str, str]) -> str:
    """A POSIX shell script: each variable from its credential file (the first line), then exec "$@".

    ``read`` is a shell builtin, so the value is never an argument of any process. A credential
    that cannot be read stops the start (set -e) rather than starting the engine without its key.
    """
    by_credential: dict[str, list[str]] = {}
    for env, credential in sorted(names.items()):
        by_credential.setdefault(credential, []).append(env)
    lines = ["set -e"]
    for credential, envs in by_credential.items():
        lines.append(f'IFS= read -r capyctl_value < "$CREDENTIALS_DIRECTORY/{credential}" || [ -n "$capyctl_value" ]')
        lines.append("export " + " ".join(f'{env}="$capyctl_value"' for env in envs))
    lines += ["unset capyctl_value", 'exec "$@"']
    return "\n".join(lines)


def escape_dollars(arg: str) -> str:
    """Make every '$' literal for systemd except ${NAME} references."""
    out, pos = [], 0
    for match in _BRACED_REF.finditer(arg):
        out.append(arg[pos:match.start()].replace("$", "$$"))
        out.append(match.group(0))
        pos = match.end()
    out.append(arg[pos:].replace("$", "$$"))
    return "".join(out)


def parse_cpu_list(text: str) -> list[int]:
    """'0-3,6' -> [0, 1, 2, 3, 6]."""
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            part = part.strip()
            if not part:
                continue
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                if lo > hi or lo < 0:
                    raise ValueError(part)
                cpus.update(range(lo, hi + 1))
            else:
                cpu = int(part)
                if cpu < 0:
                    raise ValueError(part)
                cpus.add(cpu)
    except ValueError:
        raise SystemdError(f"'{text}' is not a CPU list like '0-3,6'.", code="invalid_unit") from None
    if not cpus:
        raise SystemdError("The CPU list is empty.", code="invalid_unit")
    return sorted(cpus)


def cpu_mask(cpus: list[int]) -> bytes:
    """systemd's CPU set wire format: byte i, bit j stands for CPU 8*i + j."""
    mask = bytearray(max(cpus) // 8 + 1)
    for cpu in cpus:
        mask[cpu // 8] |= 1 << (cpu % 8)
    return bytes(mask)


def markers_from_environment(entries: list[str]) -> dict[str, str]:
    markers = {}
    for entry in entries:
        key, sep, value = entry.partition("=")
        if sep and key.startswith(MARKER_PREFIX):
            markers[key[len(MARKER_PREFIX):].lower()] = value
    return markers


def bus_path_escape(label: str) -> str:
    """systemd's object path label escaping (sd_bus_path_encode)."""
    if not label:
        return "_"
    out = []
    for i, ch in enumerate(label):
        if ch.isascii() and (ch.isalpha() or (ch.isdigit() and i > 0)):
            out.append(ch)
        else:
            out.extend(f"_{b:02x}" for b in ch.encode())
    return "".join(out)


def unit_object_path(name: str) -> str:
    return "/org/freedesktop/systemd1/unit/" + bus_path_escape(name)

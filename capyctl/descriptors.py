"""File descriptors: the daemon's limit against its caps, and a shortage told apart from an engine's fault.

Each client connection can hold two descriptors (its own socket and one to an engine), the proxy
keeps idle engine connections for reuse, and the daemon needs some of its own (the database, the
journal, D-Bus, the API socket, spooled uploads, ssh masters). When the process runs out of
descriptors (EMFILE: its RLIMIT_NOFILE; ENFILE: the whole system's), a connect to a healthy engine
fails exactly as one to a dead engine does. Before this module the proxy then answered
``502 engine_unreachable`` and blamed the engine (issue 45). Now:

- at start the daemon raises its soft limit to the hard one (:func:`raise_soft_limit`) and checks
  the limit against its connection cap (:func:`plan_connections`): a cap that does not fit is
  lowered to one that does, with a warning naming the setting and LimitNOFILE; a limit too low
  for even :data:`CONNECTIONS_MIN` refuses the start;
- an error whose cause is EMFILE/ENFILE (:func:`is_shortage`) becomes the daemon's own
  ``503 out_of_file_descriptors`` (:func:`shortage_error`), and no probe, retry or host-loss check
  counts it against the engine.
"""

from __future__ import annotations

import errno
import logging
import resource
import time
from dataclasses import dataclass

from .errors import CapyError

log = logging.getLogger("capyctl")

SHORTAGE_CODE = "out_of_file_descriptors"
_SHORTAGE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE})
# What a client is told to wait: descriptors come back as soon as any connection closes.
SHORTAGE_RETRY_AFTER_S = 1.0
# A shortage usually hits many requests at once: one warning per this many seconds, with a count.
SHORTAGE_LOG_EVERY_S = 10.0
# How far along __cause__/__context__ a shortage is looked for (aiohttp and the engine client wrap
# the OSError once or twice; a longer chain is not one error's story).
_CHAIN_MAX = 8

# Descriptors one client connection can hold: its socket and one engine connection in flight.
PER_CONNECTION = 2
# Idle engine connections the proxy keeps for reuse, counted once (proxy/_engine_side.py keeps at
# most this many per engine, and all of them were in flight a few seconds before).
IDLE_ENGINE_CONNECTIONS = 256
# The daemon's own: database, journal, D-Bus, the API socket and its clients, the controller's
# probes, spooled uploads, ssh masters and forwards, the event loop's.
DAEMON_OWN = 256
# Fewer connections than this and the daemon refuses to start rather than serve almost no one.
CONNECTIONS_MIN = 32


def is_shortage(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or what it was raised from) is the daemon running out of descriptors.

    aiohttp's ClientConnectorError is itself an OSError that copies the errno of the OSError it
    wraps (aiohttp/client_exceptions.py, ClientConnectorError.__init__; raised ``from exc`` in
    aiohttp/connector.py and in capyctl/proxy/connector.py), the proxy's own engine client raises
    EngineConnectionError ``from`` the OSError (capyctl/proxy/_engine_pool.py, EnginePool._connect),
    and a shortage already turned into :func:`shortage_error` counts too."""
    for _ in range(_CHAIN_MAX):
        if exc is None:
            return False
        if isinstance(exc, OSError) and exc.errno in _SHORTAGE_ERRNOS:
            return True
        if isinstance(exc, CapyError) and exc.code == SHORTAGE_CODE:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


class _Throttle:
    """At most one warning per SHORTAGE_LOG_EVERY_S, saying how many were left out."""

    def __init__(self) -> None:
        self.last = float("-inf")
        self.quiet = 0

    def warn(self, doing: str) -> None:
        now = time.monotonic()
        if now - self.last < SHORTAGE_LOG_EVERY_S:
            self.quiet += 1
            return
        more = f" ({self.quiet} more since the last warning)" if self.quiet else ""
        self.last, self.quiet = now, 0
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        log.warning("the daemon ran out of file descriptors (limit %d) and could not %s%s; answered 503 %s, "
                    "not counted against any engine (raise LimitNOFILE= or lower door.connections_max)",
                    soft, doing, more, SHORTAGE_CODE)


_throttle = _Throttle()


def shortage_error(doing: str, error: type[CapyError] = CapyError) -> CapyError:
    """The daemon's own 503 for a descriptor shortage met while trying to ``doing`` (logged, throttled);
    of type ``error`` where callers tell errors apart by type (EngineError for an engine call)."""
    _throttle.warn(doing)
    return error(f"CapyCTL has no file descriptor left and could not {doing}: the daemon is short of "
                     "descriptors, the engine is not at fault. Retry shortly.", code=SHORTAGE_CODE, status=503,
                     retry_after=SHORTAGE_RETRY_AFTER_S)


# ---------------------------------------------------------------- the limit against the caps

def descriptors_needed(connections: int) -> int:
    """Descriptors the daemon may need with ``connections`` client connections open."""
    return PER_CONNECTION * connections + IDLE_ENGINE_CONNECTIONS + DAEMON_OWN


def raise_soft_limit() -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard one (``capyctl start standalone`` under a shell or a
    bare systemd-run starts with the soft default, 1024); the (soft, hard) in force after.

    Under capyctl.service the two are equal (LimitNOFILE=) and setrlimit is not even allowed there
    (SystemCallFilter=~@resources): nothing is asked. Any refusal leaves the limit as it was;
    :func:`plan_connections` then fits the cap to it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else _nr_open()
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (OSError, ValueError) as exc:
            log.warning("could not raise the file descriptor limit from %d to %d: %s", soft, target, exc)
    return soft, hard


def _nr_open() -> int:
    """The kernel's ceiling for a process's descriptors (a hard limit of "infinity" means this)."""
    try:
        with open("/proc/sys/fs/nr_open", encoding="ascii") as file:
            return int(file.read().strip())
    except (OSError, ValueError):
        return 1 << 20  # the kernel's own default for nr_open


@dataclass(frozen=True)
class ConnectionPlan:
    """What the daemon enforces: ``connections_max`` client connections under descriptor ``limit``."""

    limit: int
    asked: int  # the configured cap
    connections_max: int  # the cap that fits the limit (``asked`` when it fits)

    @property
    def lowered(self) -> bool:
        return self.connections_max < self.asked


def plan_connections(asked: int, *, limit: int | None = None, setting: str = "door.connections_max") -> ConnectionPlan:
    """The client connection cap the daemon can keep under its descriptor limit (the soft
    RLIMIT_NOFILE now, unless ``limit`` is given): ``asked`` when it fits, else the most that fit,
    with a warning that names ``setting`` and LimitNOFILE; CapyError ``descriptor_limit_too_low``
    when not even CONNECTIONS_MIN fit."""
    if limit is None:
        limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if limit == resource.RLIM_INFINITY or descriptors_needed(asked) <= limit:
        return ConnectionPlan(limit=limit, asked=asked, connections_max=asked)
    fits = (limit - IDLE_ENGINE_CONNECTIONS - DAEMON_OWN) // PER_CONNECTION
    if fits < CONNECTIONS_MIN:
        raise CapyError(
            f"The file descriptor limit is {limit}: too low to serve even {CONNECTIONS_MIN} client connections "
            f"(that needs {descriptors_needed(CONNECTIONS_MIN)}: {PER_CONNECTION} a connection, "
            f"{IDLE_ENGINE_CONNECTIONS} idle engine connections and {DAEMON_OWN} for the daemon's own files). "
            f"Raise LimitNOFILE= in the daemon's unit (or `ulimit -n` before `capyctl start standalone`).",
            code="descriptor_limit_too_low", status=500)
    log.warning("the file descriptor limit is %d, too low for %s=%d (which needs %d: %d a connection, %d idle "
                "engine connections and %d for the daemon's own files): the daemon accepts at most %d client "
                "connections. Raise LimitNOFILE= in the daemon's unit, or lower %s.", limit, setting, asked,
                descriptors_needed(asked), PER_CONNECTION, IDLE_ENGINE_CONNECTIONS, DAEMON_OWN, fits, setting)
    return ConnectionPlan(limit=limit, asked=asked, connections_max=fits)

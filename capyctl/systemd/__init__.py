"""systemd for CapyCTL: engine launches as transient units, driven over D-Bus.

Engine units live in ``capyctl.slice``, outside the daemon's own cgroup, so they
outlive a daemon restart; their markers (``CAPYCTL_MARKER_*`` in the unit's
Environment) let the next daemon find and adopt them with ``list_units``.
"""

from ._client import SystemdClient, UnitState, failure_message, failure_reason
from ._journal import journal_follow, journal_tail
from ._security import security_exposure
from ._units import TransientUnit

__all__ = [
    "SystemdClient",
    "TransientUnit",
    "UnitState",
    "failure_message",
    "failure_reason",
    "journal_follow",
    "journal_tail",
    "security_exposure",
]

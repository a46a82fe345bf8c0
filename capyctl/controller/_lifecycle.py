"""A deployment's lifecycle: its states, the changes between them the actor may make, and the
commands that make them. The actor (controller/_actor.py) is the one writer of a deployment's
state; everything else submits a ``Command`` to its queue. The diagram is drawn at the top of
_actor.py; ``TRANSITIONS`` below is what it checks on every change.

The scheduler keeps its own copy of the state names (scheduler/_model.py ``STATES``: it is a
layer below and imports nothing from here); tests/unit/test_lifecycle.py keeps the two equal.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field
from typing import Any

from ..errors import CapyError


class DeploymentState(enum.StrEnum):
    """Where a deployment is. A StrEnum: it is stored, logged and sent as its value."""

    STOPPED = "stopped"
    STARTING = "starting"
    READY = "ready"
    PARKING = "parking"
    PARKED = "parked"
    WAKING = "waking"
    STOPPING = "stopping"
    FAILED = "failed"

    @property
    def resting(self) -> bool:
        """A state a command leaves the deployment in; the others last only while one runs."""
        return self in RESTING


S = DeploymentState
RESTING = frozenset({S.STOPPED, S.READY, S.PARKED, S.FAILED})
# Placed on a host, its unit started or starting (the port is meaningful).
RUNNING = frozenset({S.STARTING, S.READY, S.PARKING, S.WAKING})

# Every change of state the actor may make: from -> the states it may go to. Staying in a state
# (to record a new reason, or a launch's id before its unit exists) is always allowed. FAILED is
# reachable from everywhere: a command that errs half-way fails the deployment rather than
# leave it in a state no command is running.
TRANSITIONS: dict[DeploymentState, frozenset[DeploymentState]] = {
    # wake: STARTING; adopt (a unit a previous daemon started): READY or PARKED;
    # reconcile: PARKED (parked with no unit), FAILED (its unit failed while the daemon was down)
    S.STOPPED: frozenset({S.STARTING, S.READY, S.PARKED, S.FAILED}),
    S.STARTING: frozenset({S.READY, S.FAILED}),
    S.WAKING: frozenset({S.READY, S.FAILED}),
    # park: PARKING; stop: STOPPING; the proof after a wake failed: WAKING (a clean restart);
    # adopt after a host came back: READY; its host was lost and it may move: PARKED (its next
    # wake places it afresh)
    S.READY: frozenset({S.PARKING, S.STOPPING, S.WAKING, S.FAILED, S.PARKED}),
    # a park that found requests it may not wait for goes back to READY
    S.PARKING: frozenset({S.PARKED, S.READY, S.FAILED}),
    # wake: WAKING; stop: STOPPING; an in-place park whose unit exits: FAILED
    S.PARKED: frozenset({S.WAKING, S.STOPPING, S.FAILED}),
    S.STOPPING: frozenset({S.STOPPED, S.FAILED}),
    # wake (after its back-off): STARTING; stop: STOPPING; adopt after a host came back: READY, PARKED
    S.FAILED: frozenset({S.STARTING, S.STOPPING, S.READY, S.PARKED}),
}


def allowed(old: DeploymentState, new: DeploymentState) -> bool:
    return new == old or new in TRANSITIONS[old] or new == S.FAILED


class InvalidTransition(CapyError):
    """A bug: the actor tried a change of state its table does not allow."""

    code = "invalid_transition"
    status = 500


class Command(enum.StrEnum):
    """What may be asked of a deployment's actor (DeploymentActor.submit). Each has one handler,
    named in DeploymentActor's dispatch table, so that grep finds who asks and who answers."""

    WAKE = "wake"  # start or wake it; requests ask for one when it is not ready
    PARK = "park"  # release its memory (in place or by stopping its unit)
    STOP = "stop"
    DELETE = "delete"
    ADOPT = "adopt"  # take over a unit a previous daemon started (reconcile)
    RESTORE_PARKED = "restore_parked"  # recorded parked, no unit left: parked by stopping (reconcile)
    FAILED_WHILE_AWAY = "failed_while_away"  # its unit failed while the daemon was down (reconcile)
    UNIT_EXITED = "unit_exited"  # its unit (or a group member) exited on its own
    ENGINE_UNRESPONSIVE = "engine_unresponsive"  # the liveness watchdog found it hung
    RESTART_AFTER_FAILED_PROOF = "restart_after_failed_proof"  # the proof after a wake failed
    HOST_LOST = "host_lost"  # the host it runs on went offline and its manifest lets it move

    @property
    def changes_course(self) -> bool:
        """Whether a wake waiting for room should give way to it (DeploymentActor.redirected).
        Another wake only joins the one under way."""
        return self is not Command.WAKE


@dataclass
class QueuedCommand:
    """A submitted command: its handler's arguments and the future its caller awaits."""

    command: Command
    future: asyncio.Future
    args: dict[str, Any] = field(default_factory=dict)

"""How a deployment parks, as its actor's sub-state while parked, and the one strategy object per
way of parking that does the park, the wake and the adoption after a daemon restart.

``Parked`` says what a parked deployment's engine is doing (``NO`` while it is not parked): its
unit stopped, its next launch's unit held at its gate (armed), or the engine asleep in its unit.
The actor (controller/_actor.py) is its one writer, ``DeploymentActor._set_parked``, checked
against ``PARKED_TRANSITIONS`` as the deployment's state is against _lifecycle.TRANSITIONS.

A mode is a strategy (Nomad's task-runner hooks are the model): ``RESTART`` stops the unit and
starts one again (opening its gate when armed), ``IN_PLACE`` asks the engine to sleep and wake
(vLLM sleep, SGLang release, TensorFold sleep, a custom engine's calls). The actor picks the mode
and dispatches to it; a new way of parking (a process checkpoint, say) is one more class here.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from typing import Any, Callable, Protocol

from ..engines._tiers import TIER_SLEEP_LEVEL
from ..errors import CapyError
from . import _timeline as phases
from ._launch import PARKED_IN_PLACE
from ._lifecycle import InvalidTransition

log = logging.getLogger("capyctl.controller")

Progress = Callable[[str], None]


class Parked(enum.StrEnum):
    """A deployment's sub-state while parked (``NO`` otherwise)."""

    NO = "no"  # not parked: its unit runs, or it has none (stopped, failed)
    STOPPED = "stopped"  # parked by stopping its unit: a wake starts one
    ARMED = "armed"  # parked by stopping, its next launch's unit started and held at its gate
    IN_PLACE = "in_place"  # the engine sleeps in its running unit


P = Parked
# Every change of the sub-state: from -> the sub-states it may go to (staying is always allowed).
PARKED_TRANSITIONS: dict[Parked, frozenset[Parked]] = {
    # park by stopping, or in place; adopt or reconcile a parked deployment
    P.NO: frozenset({P.STOPPED, P.IN_PLACE}),
    # arm (at the park, or beside a wake's wait for room); a wake starts the unit, a stop or failure
    P.STOPPED: frozenset({P.ARMED, P.NO}),
    # the armed unit exited or was stopped; a wake opened its gate (or started afresh), a stop
    P.ARMED: frozenset({P.STOPPED, P.NO}),
    # woken, stopped or failed; its unit stopped to free the host RAM its weights hold, or lost with its host
    P.IN_PLACE: frozenset({P.NO, P.STOPPED}),
}


def parked_allowed(old: Parked, new: Parked) -> bool:
    return new == old or new in PARKED_TRANSITIONS[old]


class InvalidParkedTransition(InvalidTransition):
    """A bug: the actor tried a change of parked sub-state its table does not allow."""

    code = "invalid_parked_transition"


class ParkingDeployment(Protocol):
    """What a park mode reads and asks of its deployment (DeploymentActor provides it)."""

    controller: Any
    name: str
    spec: Any
    state: Any  # DeploymentState
    key: str | None
    model_path: str | None
    park_record: dict[str, Any]
    parked: Parked
    engine_unit: Any  # its EngineUnit (_unit.py)
    prompt_cache: Any  # its PromptCacheKeeper (_prompt_cache.py)
    proof: Any  # its WakeProof (_proof.py)
    requests: Any  # its Admission (_admission.py)

    def upstream(self) -> Any: ...
    def _set_parked(self, parked: Parked) -> None: ...


class RestartMode:
    """Park by stopping the unit (its prompt cache saved first, where the engine keeps one); wake
    by opening the gate of the unit armed at the park, else by starting one."""

    name = "restart"

    async def park(self, d: ParkingDeployment, timeline: phases.Timeline) -> dict[str, Any]:
        """Stop the unit; what the park record keeps of it (the saved prompt cache)."""
        saved_cache = await d.prompt_cache.save()
        timeline.lap(phases.SAVE_PROMPT_CACHE)
        if d.proof.left_for_park:
            with d.requests.hold_as_request():
                failure = await d.proof.at_park()
            if failure is not None:  # computed by an engine that failed its proof: not restored
                saved_cache = d.prompt_cache.discard(saved_cache, f"the proof after its last wake failed: {failure}")
            timeline.lap(phases.PROOF)
        await d.engine_unit.stop()
        timeline.lap(phases.UNIT_STOP)
        d._set_parked(Parked.STOPPED)
        return {"prompt_cache": saved_cache}

    async def arm(self, d: ParkingDeployment) -> None:
        """Seal the next launch's key and start its unit at its gate (where the host allows)."""
        await d.engine_unit.preseal()
        if d.engine_unit.can_arm() and await d.engine_unit.arm(d.prompt_cache.directory()):
            d._set_parked(Parked.ARMED)

    async def wake(self, d: ParkingDeployment, progress: Progress, launch: Callable[[], Any]) -> None:
        """Open the armed unit's gate, else start the unit (``launch``)."""
        if d.parked == Parked.ARMED and await d.engine_unit.open_armed(progress):
            d._set_parked(Parked.NO)
            await d.engine_unit.describe(d.state)  # starting or waking, as a started unit says
            return
        d._set_parked(Parked.NO)  # whatever was armed is stopped: the launch starts afresh
        await launch()

    async def adopt(self, d: ParkingDeployment) -> None:
        """A unit armed by the previous daemon, which alone knew what it was planned with: stopped;
        the next wake starts one."""
        await d.engine_unit.stop()
        d._set_parked(Parked.NO)


class InPlaceMode:
    """Park by asking the engine to sleep at its tier's level (its unit keeps running); wake it."""

    name = "in_place"

    async def park(self, d: ParkingDeployment, tier: str) -> bool:
        """Whether the engine went to sleep (else the caller parks by stopping)."""
        adapter = d.controller.adapter(d.spec)
        try:
            await asyncio.wait_for(adapter.park(d.controller.http, d.upstream().base_url, d.key,
                                                TIER_SLEEP_LEVEL[tier]), timeout=d.spec.timeouts.park)
        except (CapyError, asyncio.TimeoutError) as exc:
            log.warning("deployment %s: in-place park failed (%s); stopping the unit", d.name, exc)
            return False
        d._set_parked(Parked.IN_PLACE)
        await d.engine_unit.describe(PARKED_IN_PLACE)
        return True

    async def wake(self, d: ParkingDeployment) -> None:
        adapter = d.controller.adapter(d.spec)
        await asyncio.wait_for(adapter.wake(d.controller.http, d.upstream().base_url, d.key,
                                            TIER_SLEEP_LEVEL.get(d.park_record.get("tier") or "", 1),
                                            model_path=d.model_path),
                               timeout=d.spec.timeouts.wake)
        d._set_parked(Parked.NO)

    async def adopt(self, d: ParkingDeployment) -> None:
        """A unit the previous daemon parked in place: still asleep, kept."""
        d.engine_unit.adopted()
        d._set_parked(Parked.IN_PLACE)
        await d.engine_unit.describe(PARKED_IN_PLACE)


RESTART, IN_PLACE = RestartMode(), InPlaceMode()

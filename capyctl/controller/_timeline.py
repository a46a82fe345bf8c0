"""Where a wake's or a park's time goes: its phases in order, each with the wall-clock time it
began and how long it took, so that a slow swap says which phase was slow.

A swap (one model out, another in to take its room) is the outgoing deployment's park and the
incoming one's wake. The park's timeline begins at the outgoing model's last answer (its requests'
last release) and marks when its door closed for the other; the wake's timeline begins when the
wake was asked and ends at the incoming model's first answer, and carries the timelines of the
parks it made room with (``evicted``). The swap itself is the last answer of the first of them to
that first answer (``swap_seconds``).

A ``Timeline`` is written by one actor's command (its phases) and, for a wake, by the deployment's
admission at the first answer; ``record()`` is what the park record keeps, ``capyctl status``
shows, the journal line carries (benchmarks/contention.py reads it) and /metrics observes.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Callable

# The phases, by the name ``lap`` closes them with. A wake's, in the order they can occur:
WAIT_FOR_ROOM = "wait for room"  # in line behind busy deployments (controller/_turns.py)
EVICT = "evict"  # the parks or stops of the deployments evicted for it
MAKE_ROOM = "make room"  # planning and charging around those
PREPARE = "prepare"  # the model resolved, the port leased, the engine's command line built
CREDENTIALS = "credentials and confinement"
UNIT_START = "unit start"
OPEN_GATE = "open gate"  # instead of the three above when the park armed its next unit
WAKE_IN_PLACE = "wake in place"
HEALTH = "health"  # the engine loading, to its first healthy answer
PROOF = "proof"
RESTORE_PROMPT_CACHE = "restore prompt cache"
FIRST_ANSWER = "first answer"  # ready to the first request's answer
# A park's:
WAIT_FOR_PARK = "wait for park"  # the last answer to the park command's start (idle, door closed)
DRAIN = "drain"
PARK_IN_PLACE = "park in place"
SAVE_PROMPT_CACHE = "save prompt cache"
UNIT_STOP = "unit stop"
ARM = "arm"  # the next launch's key sealed and its unit started at its gate

WAKE, PARK = "wake", "park"


@dataclass(frozen=True)
class Clocks:
    """What a timeline reads: the wall clock, for when a phase began (what records, marks and the
    admission's last answer say), and the monotonic clock, for how long it took."""

    wall: Callable[[], float] = time.time
    monotonic: Callable[[], float] = time.monotonic


SYSTEM_CLOCKS = Clocks()


class Timeline:
    """Phases of one wake or park. ``lap(phase)`` closes the phase running since the previous lap
    (or since the start); a phase lapped again later adds up in ``stages``."""

    def __init__(self, kind: str = WAKE, *, began_at: float | None = None, clocks: Clocks = SYSTEM_CLOCKS) -> None:
        self.kind = kind
        self.clocks = clocks
        now_wall, now_mono = clocks.wall(), clocks.monotonic()
        # A timeline may begin before it was made (a park's begins at the last answer): the
        # monotonic clock is set back by as much.
        back = max(0.0, now_wall - began_at) if began_at is not None else 0.0
        self.began_at = now_wall - back
        self._last = now_mono - back
        self.phases: list[dict[str, Any]] = []  # {"phase", "at" (wall clock), "seconds"}
        self.marks: dict[str, float] = {}  # points in time with no duration: "door closed"
        self.evicted: list[dict[str, Any]] = []  # the park records of the deployments evicted for it
        self.ended_at: float | None = None

    @property
    def stages(self) -> dict[str, float]:
        """Seconds by phase (a phase lapped twice: their sum)."""
        out: dict[str, float] = {}
        for phase in self.phases:
            out[phase["phase"]] = out.get(phase["phase"], 0.0) + phase["seconds"]
        return out

    def lap(self, phase: str) -> float:
        """Close ``phase``: it ran from the previous lap to now (a phase lapped twice in a row is
        one, so a long wait for room is one entry however often it looked again). Its seconds."""
        now = self.clocks.monotonic()
        seconds = max(0.0, now - self._last)
        self._last = now
        if self.phases and self.phases[-1]["phase"] == phase:
            self.phases[-1]["seconds"] = round(self.phases[-1]["seconds"] + seconds, 6)
        else:
            began = self.clocks.wall() - seconds
            self.phases.append({"phase": phase, "at": round(began, 6), "seconds": round(seconds, 6)})
        return seconds

    def mark(self, name: str, at: float | None = None) -> None:
        """A point in time (wall clock) that begins or ends no phase of its own."""
        self.marks[name] = round(at if at is not None else self.clocks.wall(), 6)

    def end(self) -> None:
        self.ended_at = self.clocks.wall()

    @property
    def seconds(self) -> float:
        return sum(phase["seconds"] for phase in self.phases)

    def swap_seconds(self) -> float | None:
        """A wake that evicted: its first answer less the evicted deployments' first last answer."""
        answered = next((p for p in self.phases if p["phase"] == FIRST_ANSWER), None)
        last_answers = [e["marks"]["last answer"] for e in self.evicted if "last answer" in e.get("marks", {})]
        if answered is None or not last_answers:
            return None
        return round(answered["at"] + answered["seconds"] - min(last_answers), 6)

    def record(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "at": round(self.began_at, 6), "seconds": round(self.seconds, 6),
                               "phases": list(self.phases)}
        if self.marks:
            out["marks"] = dict(self.marks)
        if self.evicted:
            out["evicted"] = list(self.evicted)
            swap = self.swap_seconds()
            if swap is not None:
                out["swap_seconds"] = swap
        return out

    def journal_line(self) -> str:
        """One line of JSON for the daemon's journal (benchmarks read it)."""
        return json.dumps(self.record(), separators=(",", ":"))

    def __str__(self) -> str:
        return ", ".join(f"{stage} {seconds * 1000:.0f} ms" for stage, seconds in self.stages.items())


def phase_seconds(record: dict[str, Any]) -> dict[str, float]:
    """Seconds by phase of a timeline's record (the metrics and the summary read it)."""
    out: dict[str, float] = {}
    for phase in record.get("phases") or []:
        out[phase["phase"]] = out.get(phase["phase"], 0.0) + float(phase["seconds"])
    return out

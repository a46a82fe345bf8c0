"""``Idempotency-Key`` for the management API's actions.

A client that did not hear the answer (its deadline passed, the connection dropped) sends the
same request again with the same key and gets the first request's outcome, waiting for it if
it still runs, instead of a second park, a second deploy. The operation runs in a task of its
own, so a client that goes away does not cancel it.

Kept in memory: a restarted daemon has forgotten its keys (the operations themselves are
recorded in the state database; a repeat after a restart acts again, which for park, wake,
stop and an unchanged deploy leaves the same state).
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from ..errors import CapyError, InvalidRequest

HEADER = "Idempotency-Key"
KEY_PATTERN = re.compile(r"[\x21-\x7e]{1,200}")
REMEMBER_S = 24 * 3600.0
REMEMBER_AT_MOST = 4096


@dataclass
class _Operation:
    fingerprint: str
    task: asyncio.Task
    started: float


class IdempotentOperations:
    def __init__(self) -> None:
        self._by_key: dict[str, _Operation] = {}

    @staticmethod
    def fingerprint(method: str, path: str, body: bytes) -> str:
        return f"{method} {path} {hashlib.sha256(body).hexdigest()}"

    def start(self, key: str | None, fingerprint: str,
              operation: Callable[[], Awaitable[Any]]) -> tuple[asyncio.Task, bool]:
        """(the operation's task, whether this call started it). Without a key it always starts."""
        if key is None:
            return asyncio.create_task(operation()), True
        if not KEY_PATTERN.fullmatch(key):
            raise InvalidRequest(f"{HEADER} must be 1 to 200 printable ASCII characters without spaces",
                                 code="invalid_idempotency_key")
        self._forget_old()
        known = self._by_key.get(key)
        if known is not None:
            if known.fingerprint != fingerprint:
                raise CapyError(f"{HEADER} {key!r} was used for a different request; use a new key for a new "
                                "operation", code="idempotency_key_reused", status=422)
            return known.task, False
        task = asyncio.create_task(operation())
        task.add_done_callback(_retrieve)  # an outcome nobody awaits is not an "unretrieved" warning
        self._by_key[key] = _Operation(fingerprint, task, time.monotonic())
        return task, True

    def _forget_old(self) -> None:
        now = time.monotonic()
        for key in [k for k, op in self._by_key.items() if op.task.done() and now - op.started > REMEMBER_S]:
            del self._by_key[key]
        excess = len(self._by_key) - REMEMBER_AT_MOST
        if excess > 0:
            done = [k for k, op in self._by_key.items() if op.task.done()]  # oldest first (insertion order)
            for key in done[:excess]:
                del self._by_key[key]


def _retrieve(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()

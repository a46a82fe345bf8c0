"""Errors that cross a module boundary.

Every error a user can see carries a stable snake_case ``code`` (for scripts and
the OpenAI error body) and a human sentence (for people). ``status`` is the HTTP
status the proxy and the management API answer with.
"""

from __future__ import annotations


class CapyError(Exception):
    """Base of all CapyCTL errors with a stable code and a human message."""

    code: str = "internal_error"
    status: int = 500

    def __init__(self, message: str, *, code: str | None = None, status: int | None = None,
                 retry_after: float | None = None, detail: dict | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status
        self.retry_after = retry_after
        self.detail = detail or {}

    def to_dict(self) -> dict:
        body = {"code": self.code, "message": self.message}
        if self.detail:
            body["detail"] = self.detail
        return body

    def __str__(self) -> str:  # "code: sentence" reads well in logs and CLI output
        return f"{self.code}: {self.message}"


class NotFound(CapyError):
    code = "not_found"
    status = 404


class Conflict(CapyError):
    code = "conflict"
    status = 409


class InvalidRequest(CapyError):
    code = "invalid_request"
    status = 400


class Unavailable(CapyError):
    code = "unavailable"
    status = 503


class QueueFull(CapyError):
    code = "queue_full"
    status = 429


class SystemdError(CapyError):
    code = "systemd_error"
    status = 502


class EngineError(CapyError):
    code = "engine_error"
    status = 502

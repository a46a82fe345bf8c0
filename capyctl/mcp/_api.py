"""The management API as ``capyctl mcp`` reaches it: HTTP on the unix socket, every request
with the operator key, so the daemon authorizes it as ``operator`` whoever runs this process."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import os
from pathlib import Path
from typing import Any

import aiohttp

from ..errors import CapyError


class OperatorKey:
    """The operator key from its owner-only file, read again when the file changes (a rotation
    reaches a running ``capyctl mcp`` without a restart). Only this object holds the key."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stamp: tuple[int, int, int] | None = None
        self._secret = ""
        self._digest = b""
        self._refresh()

    def _refresh(self) -> None:
        try:
            st = os.stat(self.path)
        except OSError as exc:
            raise CapyError(f"cannot read the operator key at {self.path}: {exc.strerror}; run capyctl mcp as root "
                            "(or from capyctl-mcp.service), after the daemon has started once",
                            code="operator_key_unreadable") from None
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        if stamp == self._stamp:
            return
        secret = self.path.read_text().strip()
        if not secret:
            raise CapyError(f"{self.path} is empty", code="operator_key_unreadable")
        self._secret, self._digest, self._stamp = secret, hashlib.sha256(secret.encode()).digest(), stamp

    def matches(self, presented: str | None) -> bool:
        """Constant time on the digests, so the comparison says nothing about the key's bytes."""
        try:
            self._refresh()
        except CapyError:
            return False
        candidate = hashlib.sha256((presented or "").encode()).digest()
        return hmac.compare_digest(candidate, self._digest) and presented is not None

    def authorization(self) -> str:
        self._refresh()
        return f"Bearer {self._secret}"


class ApiError(CapyError):
    """An answer of the management API, with its code and sentence unchanged."""


class ManagementApi:
    def __init__(self, socket_path: str, key: OperatorKey) -> None:
        self.socket_path = socket_path
        self.key = key
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=self.socket_path),
                                                  timeout=aiohttp.ClientTimeout(total=None, sock_connect=5))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    def _headers(self, idempotency_key: str | None) -> dict[str, str]:
        headers = {"Authorization": self.key.authorization(), "Accept": "application/json"}
        if idempotency_key:
            headers["Idempotency-Key"] = idempotency_key
        return headers

    async def request(self, method: str, path: str, body: Any = None, *, timeout: float = 30.0,
                      idempotency_key: str | None = None) -> Any:
        """The answer's JSON; raises ApiError with the API's code, asyncio.TimeoutError past ``timeout``."""
        async with asyncio.timeout(timeout):
            try:
                async with self._client().request(method, f"http://capyctl{path}", json=body,
                                                  headers=self._headers(idempotency_key)) as resp:
                    raw = await resp.read()
                    status = resp.status
            except aiohttp.ClientConnectionError as exc:
                raise ApiError(f"the management API at {self.socket_path} cannot be reached: {exc}",
                               code="daemon_unreachable", status=503) from None
        payload = json.loads(raw) if raw else None
        if status >= 400:
            _raise(status, payload)
        return payload

    async def events(self, method: str, path: str, body: Any = None, *, timeout: float,
                     idempotency_key: str | None = None) -> list[dict]:
        """An NDJSON answer's events (deploy, logs), read until it ends or ``timeout`` passes."""
        out: list[dict] = []
        async with asyncio.timeout(timeout):
            try:
                async with self._client().request(method, f"http://capyctl{path}", json=body,
                                                  headers=self._headers(idempotency_key)) as resp:
                    if resp.status >= 400:
                        raw = await resp.read()
                        _raise(resp.status, json.loads(raw) if raw else None)
                    async for line in resp.content:
                        if line.strip():
                            out.append(json.loads(line))
            except aiohttp.ClientConnectionError as exc:
                raise ApiError(f"the management API at {self.socket_path} cannot be reached: {exc}",
                               code="daemon_unreachable", status=503) from None
        return out


def _raise(status: int, payload: Any) -> None:
    err = (payload or {}).get("error") if isinstance(payload, dict) else None
    err = err or {}
    raise ApiError(err.get("message") or f"the management API answered {status}",
                   code=err.get("code") or "api_error", status=status, detail=err.get("detail"))

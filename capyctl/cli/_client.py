"""A small client for the management API on its unix socket (standard library only: the CLI
starts fast and tab completion stays snappy)."""

from __future__ import annotations

import http.client
import json
import os
import socket
from typing import Any, Iterator

from ..config import Paths
from ..errors import CapyError


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float | None) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        if self.timeout is not None:
            self.sock.settimeout(self.timeout)
        self.sock.connect(self._path)


def default_socket() -> str:
    return os.environ.get("CAPYCTL_API_SOCKET") or str(Paths.from_env().api_socket)


class ApiClient:
    def __init__(self, socket_path: str | None = None, timeout: float | None = 30.0) -> None:
        self.socket_path = socket_path or default_socket()
        self.timeout = timeout

    def _open(self, method: str, path: str, body: Any = None, timeout: float | None = -1.0):
        conn = _UnixConnection(self.socket_path, self.timeout if timeout == -1.0 else timeout)
        headers = {"Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        try:
            conn.request(method, path, body=data, headers=headers)
            return conn, conn.getresponse()
        except FileNotFoundError:
            raise CapyError(f"no management socket at {self.socket_path}; is CapyCTL running? "
                            "(systemctl status capyctl.socket, or capyctl start standalone)",
                            code="daemon_unreachable") from None
        except PermissionError:
            raise CapyError(f"permission denied on {self.socket_path}; run as root or a member of "
                            "the capyctl group", code="permission_denied") from None
        except ConnectionRefusedError:
            raise CapyError(f"nothing listens on {self.socket_path}; is CapyCTL running?",
                            code="daemon_unreachable") from None

    @staticmethod
    def _raise_for(resp, raw: bytes) -> None:
        try:
            payload = json.loads(raw or b"{}")
        except json.JSONDecodeError:
            payload = {}
        err = payload.get("error") or {}
        raise CapyError(err.get("message") or f"management API answered {resp.status}",
                        code=err.get("code") or "api_error", status=resp.status, detail=err.get("detail"))

    def request(self, method: str, path: str, body: Any = None) -> Any:
        conn, resp = self._open(method, path, body)
        try:
            raw = resp.read()
        finally:
            conn.close()
        if resp.status >= 400:
            self._raise_for(resp, raw)
        return json.loads(raw) if raw else None

    def stream(self, method: str, path: str, body: Any = None) -> Iterator[dict]:
        """NDJSON events, one a line, for long operations (deploy --wait, logs -f)."""
        conn, resp = self._open(method, path, body, timeout=None)
        try:
            if resp.status >= 400:
                self._raise_for(resp, resp.read())
            while True:
                line = resp.readline()
                if not line:
                    break
                if line.strip():
                    yield json.loads(line)
        finally:
            conn.close()

"""Who is asking: every management request is authenticated to a role, ``admin`` or ``operator``.

* ``admin``: a peer on the unix socket that presents no credential (the socket's mode, 0660
  root:capyctl, is what admits it, as with systemd's private socket), or the admin token.
* ``operator``: the operator key, the credential ``capyctl mcp`` uses. It may read everything
  and deploy, park, wake, stop, delete and drain; host add/remove, engine registration and key
  management answer 403 ``operator_not_permitted``.

A request that presents a credential is judged by that credential alone, whoever the peer is:
the operator key never becomes admin because its holder could also open the socket. API keys
of the OpenAI endpoint authorize no management route.

Both credentials are 256 random bits, created on the daemon's first start in owner-only files
under ``<state>/credentials`` (0700); the daemon keeps only their SHA-256 digests in memory and
compares digests in constant time. The operator key is rotated by an admin-only route without
a restart: the new key is written atomically and the accepted digest replaced, so the old key
is refused from the next request on.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import socket
from pathlib import Path

from aiohttp import web

from ..errors import CapyError

log = logging.getLogger("capyctl.api")

ADMIN = "admin"
OPERATOR = "operator"
ROLE = web.RequestKey("role", str)  # request[ROLE]: ADMIN or OPERATOR

ADMIN_TOKEN_PREFIX = "capyadm-"
OPERATOR_KEY_PREFIX = "capyop-"

# Routes an operator may use besides every GET: (method, route pattern as registered).
OPERATOR_WRITES = frozenset({
    ("POST", "/v1/deployments"),
    ("DELETE", "/v1/deployments/{name}"),
    ("POST", "/v1/deployments/{name}/park"),
    ("POST", "/v1/deployments/{name}/wake"),
    ("POST", "/v1/deployments/{name}/stop"),
    ("POST", "/v1/hosts/{name}/drain"),
    ("POST", "/v1/hosts/{name}/uncordon"),  # undoes what drain did
    ("POST", "/v1/hosts/{name}/check"),  # a probe: reads the host, changes nothing
})


class Unauthenticated(CapyError):
    code = "unauthenticated"
    status = 401


class OperatorNotPermitted(CapyError):
    code = "operator_not_permitted"
    status = 403


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


def _write_owner_only(path: Path, text: str) -> None:
    """0600, written whole or not at all (a temporary file renamed in place)."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_secret_file(path: Path) -> str:
    return path.read_text().strip()


class Credentials:
    """The admin token's and the operator key's digests, loaded from (or created in) ``directory``."""

    def __init__(self, directory: Path, *, admin_token_path: Path | None = None) -> None:
        self.directory = directory
        # The configuration file's admin_token_file moves it (its directory must exist).
        self.admin_token_path = admin_token_path or directory / "admin.token"
        self.operator_key_path = directory / "operator.key"
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(directory, 0o700)
        self._admin = _digest(self._load_or_create(self.admin_token_path, ADMIN_TOKEN_PREFIX))
        self._operator = _digest(self._load_or_create(self.operator_key_path, OPERATOR_KEY_PREFIX))
        if hmac.compare_digest(self._admin, self._operator):
            raise CapyError(f"the admin token and the operator key in {directory} are the same; remove one of "
                            "them and restart to create a new one", code="credentials_not_distinct")

    @staticmethod
    def _load_or_create(path: Path, prefix: str) -> str:
        try:
            secret = read_secret_file(path)
        except FileNotFoundError:
            secret = ""
        if secret:
            os.chmod(path, 0o600)  # a copy restored with a looser mode
            return secret
        secret = prefix + secrets.token_urlsafe(32)
        _write_owner_only(path, secret)
        log.info("created %s", path)
        return secret

    def role_of(self, secret: str) -> str | None:
        """``admin``, ``operator`` or None; both digests are compared every time (constant time)."""
        presented = _digest(secret)
        is_admin = hmac.compare_digest(presented, self._admin)
        is_operator = hmac.compare_digest(presented, self._operator)
        return ADMIN if is_admin else OPERATOR if is_operator else None

    def rotate_operator_key(self) -> None:
        secret = OPERATOR_KEY_PREFIX + secrets.token_urlsafe(32)
        _write_owner_only(self.operator_key_path, secret)
        self._operator = _digest(secret)
        log.info("operator key rotated; the previous one is refused from now on")


def _bearer(request: web.Request) -> str | None:
    header = request.headers.get("Authorization")
    if header is None:
        return None
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        raise Unauthenticated("the Authorization header must be 'Bearer <admin token or operator key>'",
                              code="invalid_authorization")
    return value.strip()


def _on_unix_socket(request: web.Request) -> bool:
    sock = request.transport.get_extra_info("socket") if request.transport else None
    return sock is not None and sock.family == socket.AF_UNIX


def authenticate(request: web.Request, credentials: Credentials, is_inference_key) -> str:
    """The request's role, or raise 401."""
    secret = _bearer(request)
    if secret is None:
        if _on_unix_socket(request):
            return ADMIN
        raise Unauthenticated("the management API needs the admin token or the operator key",
                              code="credential_required")
    role = credentials.role_of(secret)
    if role is not None:
        return role
    if is_inference_key(secret):
        raise Unauthenticated("an API key of the OpenAI endpoint authorizes no management route; use the "
                              "operator key", code="inference_key_not_accepted")
    raise Unauthenticated("the credential is neither the admin token nor the current operator key",
                          code="invalid_credential")


def authorize(request: web.Request, role: str) -> None:
    if role == ADMIN or request.method in ("GET", "HEAD"):
        return
    resource = request.match_info.route.resource
    if resource is None:
        return  # no such route: the handler answers 404 whoever asks
    pattern = resource.canonical
    if (request.method, pattern) not in OPERATOR_WRITES:
        raise OperatorNotPermitted(f"{request.method} {pattern} is for the admin only; the operator key may "
                                   "read, deploy, park, wake, stop, delete and drain", code="operator_not_permitted")

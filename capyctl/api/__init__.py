"""The management API the CLI talks to, on a unix socket."""

from ._app import build_api
from ._auth import ADMIN, OPERATOR, Credentials

__all__ = ["ADMIN", "OPERATOR", "Credentials", "build_api"]

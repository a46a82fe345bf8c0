"""The management API the CLI talks to, on a unix socket."""

from ._app import build_api

__all__ = ["build_api"]

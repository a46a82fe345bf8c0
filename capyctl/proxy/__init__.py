"""The OpenAI-compatible proxy in front of every deployment.

Public surface: :func:`build_app`, :func:`serve` (and its :class:`DoorSettings`), :func:`listen_sockets_from_systemd`,
the key types (:class:`KeyVerifier`, :class:`KeyGrant`, :class:`StaticKeys`) and the
Router protocol the controller implements (:mod:`capyctl.proxy.router`).
"""

from ._app import build_app, metrics_text
from ._door_settings import DoorSettings
from ._exchange import MiB
from ._keys import KeyGrant, KeyVerifier, StaticKeys, token_digest
from ._sockets import listen_sockets_from_systemd, serve
from .router import ModelEntry, Router, Upstream

__all__ = [
    "DoorSettings", "KeyGrant", "KeyVerifier", "MiB", "ModelEntry", "Router", "StaticKeys", "Upstream",
    "build_app", "listen_sockets_from_systemd", "metrics_text", "serve", "token_digest",
]

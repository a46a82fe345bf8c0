"""API keys as the proxy sees them: a verifier that turns a bearer token into a grant."""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from typing import Mapping, Protocol


@dataclass(frozen=True)
class KeyGrant:
    """What one valid key may do: ``models`` None means every model."""

    name: str
    models: frozenset[str] | None = None

    def allows(self, model: str) -> bool:
        return self.models is None or model in self.models


class KeyVerifier(Protocol):
    def verify(self, token: str) -> KeyGrant | None:
        """The grant of ``token``, or None when it is not a valid key.

        Implementations compare in constant time (the proxy only passes the token on).
        """


def token_digest(token: str) -> bytes:
    """A one-way digest of an API key, to find it again in memory without keeping the key itself."""
    # BLAKE2s (the standard library's own code), not OpenSSL's SHA-256: the same 32 bytes of
    # one-way digest, and on the request's path less code to run cold (benchmarks/proxy_vs_nginx.py).
    return hashlib.blake2s(token.encode("utf-8", "surrogatepass")).digest()


class StaticKeys:
    """In-memory keys for tests and standalone setups.

    Keeps only BLAKE2s digests and compares every entry with ``hmac.compare_digest``
    without stopping early, so the time taken does not tell which key nearly matched.
    """

    def __init__(self, keys: Mapping[str, KeyGrant]) -> None:
        self._entries = [(token_digest(token), grant) for token, grant in keys.items()]

    def verify(self, token: str) -> KeyGrant | None:
        wanted = token_digest(token)
        found: KeyGrant | None = None
        for digest, grant in self._entries:
            if hmac.compare_digest(digest, wanted):
                found = grant
        return found

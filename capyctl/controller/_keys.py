"""Per-launch engine keys."""

from __future__ import annotations

import secrets


def new_engine_key() -> str:
    """A per-launch engine key. Hex, not urlsafe base64: a key that starts with "-" (one launch in
    64) is read by the engines' argparse (SGLang's and vLLM's --api-key) as an option, and the
    engine exits with status 2."""
    return secrets.token_hex(32)

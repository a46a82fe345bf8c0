"""Engine adapters: how each engine is launched, probed, parked and woken, and engine detection.

The controller builds a :class:`LaunchContext`, asks :func:`adapter_for` the engine's adapter
for a :class:`LaunchPlan`, and runs it as a transient unit that loads the per-launch key (and
``plan.secret_files``) as systemd credentials (KEY_CREDENTIAL).
"""

from __future__ import annotations

from ..errors import CapyError
from ..spec import EngineSpec
from ..spec.models import ENGINE_KIND_ALIASES
from ._base import (DEFAULT_KEY_ENV, KEY_CREDENTIAL, EngineAdapter, LaunchContext, LaunchPlan, ParkMethod,
                    RestoredPromptCache, SavedPromptCache)
from ._detect import detect_engine, find_engines
from .custom import CustomAdapter
from .llamacpp import LlamaCppAdapter
from .sglang import SglangAdapter
from .tensorfold import TensorFoldAdapter
from .vllm import VllmAdapter

_ADAPTERS: dict[str, EngineAdapter] = {
    a.kind: a for a in (LlamaCppAdapter(), VllmAdapter(), SglangAdapter(), TensorFoldAdapter())
}
KINDS = tuple(sorted([*_ADAPTERS, "custom"]))


def adapter_for(kind: str, engine: EngineSpec | None = None) -> EngineAdapter:
    """The adapter of an engine kind (aliases such as ``llama-server`` accepted).

    A custom engine's health path and park/wake calls live in its registration, so pass
    ``engine`` for ``custom``; the built-in kinds ignore it.
    """
    canonical = ENGINE_KIND_ALIASES.get(kind.lower())
    if canonical == "custom":
        return CustomAdapter(engine)
    if canonical is None or canonical not in _ADAPTERS:
        raise CapyError(f"{kind!r} is not an engine kind; known kinds: {', '.join(KINDS)}",
                        code="engine_kind_unknown", status=400)
    return _ADAPTERS[canonical]


__all__ = [
    "DEFAULT_KEY_ENV", "KEY_CREDENTIAL", "KINDS", "EngineAdapter", "LaunchContext", "LaunchPlan", "ParkMethod",
    "RestoredPromptCache", "SavedPromptCache", "adapter_for",
    "detect_engine",
    "find_engines",
]

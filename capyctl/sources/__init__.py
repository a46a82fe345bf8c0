"""Where a deployment's model comes from: a path on the host or the Hugging Face Hub.

:func:`resolve_model` turns a manifest's ``model`` into the local path the engine is given:
a GGUF file for llama.cpp, a directory for the other engines. A Hub model is pinned to the
commit its revision points to and downloaded into ``models_dir`` (a Hugging Face cache);
offline (``HF_HUB_OFFLINE=1``) or when the Hub is unreachable it resolves from that cache.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..spec import HubModel, PathModel
from ._local import resolve_local, size_of

# huggingface_hub is imported by the first Hub model, not by a daemon whose models are all paths
# on the host: it is a large share of the daemon's idle memory (docs/benchmarks.md, "Figures
# behind design choices").

# progress(stage, done_bytes, total_bytes or None); called from the event loop.
ProgressCallback = Callable[[str, int, "int | None"], None]


@dataclass(frozen=True)
class ResolvedModel:
    path: str
    revision: str | None  # the commit sha for a Hub model, None for a local path
    size_bytes: int


async def resolve_model(model: HubModel | PathModel, *, engine_kind: str, models_dir: Path,
                        progress: ProgressCallback | None = None) -> ResolvedModel:
    """The local path, pinned revision and size of ``model`` for an engine of ``engine_kind``.

    Raises CapyError: ``model_not_found``, ``model_ambiguous`` (several GGUF files, no ``file``),
    ``model_not_gguf``, ``model_not_directory``, ``model_revision_not_found``, ``model_gated``,
    ``model_not_cached`` (offline and not in the cache), ``hub_unreachable``.
    """
    if isinstance(model, PathModel):
        path = await asyncio.to_thread(resolve_local, model.path, engine_kind)
        return ResolvedModel(str(path), None, await asyncio.to_thread(size_of, path))
    from ._hub import resolve_hub
    path, sha, size = await resolve_hub(model, engine_kind, Path(models_dir), progress)
    return ResolvedModel(str(path), sha, size)


def hub_offline() -> bool:
    """Whether the Hub is not to be asked (HF_HUB_OFFLINE)."""
    from ._hub import hub_offline as offline
    return offline()


__all__ = ["ProgressCallback", "ResolvedModel", "hub_offline", "resolve_model"]

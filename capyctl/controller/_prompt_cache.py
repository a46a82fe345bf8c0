"""The prompt cache kept across a park by stopping (llama.cpp today; docs/engines-and-parking.md).

    ready --park--> save (engine writes its slots) --> unit stopped --> parked
    parked --wake--> unit started --> healthy --> restore, or drop if stale --> ready

The engine writes the files itself, into its unit's own cache directory, and CapyCTL keeps them
only while the deployment is parked: they are removed once restored (or refused), and at a stop
or a delete. What they were computed with (the model file, the engine binary, engine_args) is
written into the park record beside them; a wake whose launch differs in any of those drops them,
because llama.cpp's state file checks its shapes, not which weights produced it, and a cache
from other weights would be restored without a word. A save larger than the manifest's
``prompt_cache.disk`` is dropped at once, so the directory never holds more than that.

Nothing here can fail a park or a wake: a cache that cannot be saved or restored is a prefill
to pay again, and the record says why.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from ..errors import CapyError
from ._confine import engine_cache_dir

log = logging.getLogger("capyctl.controller")

SAVED, RESTORED, REFUSED, DROPPED, FAILED = "saved", "restored", "refused", "dropped", "failed"


def prompt_cache_dir(deployment: str) -> str:
    """Where the engine writes its saved prompt cache: its unit's CacheDirectory=, which the
    engine's dynamic user may write and which outlives the unit."""
    return engine_cache_dir(deployment)


def _file_identity(path: str | None) -> list[int] | None:
    if not path:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def identity(model_path: str | None, engine_path: str | None, engine_args: list[str]) -> dict[str, Any]:
    """What a saved cache is valid for: the model file and engine binary as the filesystem knows
    them (size, modification time, inode: a rewrite or a replacement changes one) and engine_args."""
    return {"model": _file_identity(model_path), "engine": _file_identity(engine_path),
            "engine_args": list(engine_args)}


def stale_reason(saved: dict[str, Any], current: dict[str, Any]) -> str | None:
    """Why a cache saved with ``saved`` must not be restored into a launch with ``current``."""
    if saved.get("model") is None or saved.get("model") != current.get("model"):
        return "the model file changed since the park"
    if saved.get("engine") != current.get("engine"):
        return "the engine binary changed since the park"
    if saved.get("engine_args") != current.get("engine_args"):
        return "engine_args changed since the park"
    return None


def remove_files(directory: str, files: list[str]) -> None:
    for name in files:
        if os.sep in name or name in ("", ".", ".."):
            continue  # only names this module wrote (the engine refuses others anyway)
        try:
            os.unlink(os.path.join(directory, name))
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("could not remove the saved prompt cache %s: %s", os.path.join(directory, name), exc)


async def save(adapter: Any, http: Any, base_url: str, key: str | None, *, budget: int, timeout: float,
               directory: str, identity_now: dict[str, Any]) -> dict[str, Any]:
    """Ask the drained engine to save its prompt cache; the park record's ``prompt_cache``."""
    try:
        saved = await asyncio.wait_for(adapter.save_prompt_cache(http, base_url, key, budget), timeout=timeout)
    except (CapyError, asyncio.TimeoutError, OSError) as exc:
        why = str(exc) or "it did not finish within the park timeout"
        log.warning("the prompt cache was not saved at the park: %s", why)
        return {"state": FAILED, "why": why}
    record = {"files": list(saved.files), "tokens": saved.tokens, "bytes": saved.bytes,
              "save_seconds": round(saved.seconds, 3), "seconds_per_token": saved.seconds_per_token}
    if saved.bytes > budget:
        remove_files(directory, list(saved.files))
        return {**record, "files": [], "state": DROPPED,
                "why": f"it took {saved.bytes} bytes, more than prompt_cache.disk ({budget})"}
    return {**record, "state": SAVED, "identity": identity_now}


async def restore(adapter: Any, http: Any, base_url: str, key: str | None, saved: dict[str, Any], *,
                  timeout: float, directory: str, identity_now: dict[str, Any]) -> dict[str, Any]:
    """Restore a saved cache into the healthy engine before it is admitted any request; the
    files are removed whatever the outcome. The park record's ``prompt_cache`` after the wake."""
    files = [str(f) for f in saved.get("files") or []]
    try:
        why = stale_reason(saved.get("identity") or {}, identity_now)
        if why is not None:
            return {"state": REFUSED, "why": why, "tokens": 0}
        try:
            restored = await asyncio.wait_for(adapter.restore_prompt_cache(http, base_url, key, tuple(files)),
                                              timeout=timeout)
        except (CapyError, asyncio.TimeoutError, OSError) as exc:
            why = str(exc) or "it did not finish within the wake timeout"
            log.warning("the prompt cache saved at the park was not restored: %s", why)
            return {"state": FAILED, "why": why, "tokens": 0}
    finally:
        remove_files(directory, files)
    per_token = saved.get("seconds_per_token")
    seconds_saved = None
    if isinstance(per_token, (int, float)):
        # The prefill the restored tokens would have cost at the engine's own rate before the
        # park, less what restoring them took.
        seconds_saved = round(max(0.0, restored.tokens * per_token - restored.seconds), 3)
    return {"state": RESTORED, "tokens": restored.tokens, "bytes": restored.bytes,
            "restore_seconds": round(restored.seconds, 3), "seconds_saved": seconds_saved,
            "saved_tokens": saved.get("tokens"), "refused": list(restored.refused)}


def pending_files(record: dict[str, Any] | None) -> list[str]:
    """The files a park record says are waiting on disk (saved and not yet restored)."""
    cache = (record or {}).get("prompt_cache") or {}
    return [str(f) for f in cache.get("files") or []] if cache.get("state") == SAVED else []


class PromptCacheKeeper:
    """One deployment's prompt cache across its parks: saved before a park stops its unit,
    restored after the wake's health check (before any request is admitted), dropped at a stop.
    ``deployment`` is its actor: its spec, model path, key, upstream and park record."""

    def __init__(self, deployment: Any) -> None:
        self._deployment = deployment

    def kept(self) -> bool:
        # Local only: the identity is read from the files as the daemon's host sees them.
        d = self._deployment
        return not d.remote and d.controller.adapter(d.spec).keeps_prompt_cache(d.spec)

    def directory(self) -> str | None:
        """The launch's prompt-cache directory, or None where it keeps none."""
        return prompt_cache_dir(self._deployment.name) if self.kept() else None

    def pending(self) -> bool:
        return bool(pending_files(self._deployment.park_record))

    def _identity(self) -> dict[str, Any]:
        from ._confine import engine_location
        d = self._deployment
        return identity(d.model_path, engine_location(d.controller.engine_for(d.spec)), list(d.spec.engine_args))

    async def save(self) -> dict[str, Any] | None:
        """Before a park stops the unit: the engine saves its prompt cache."""
        if not self.kept():
            return None
        d = self._deployment
        return await save(d.controller.adapter(d.spec), d.controller.http, d.upstream().base_url, d.key,
                          budget=d.spec.prompt_cache.disk, timeout=d.spec.timeouts.park,
                          directory=prompt_cache_dir(d.name), identity_now=self._identity())

    async def restore(self, progress: Any) -> dict[str, Any]:
        """After a wake's health check: the result, for the park record."""
        d = self._deployment
        saved = d.park_record.get("prompt_cache") or {}
        progress(f"restoring the prompt cache saved at the park ({saved.get('tokens', 0)} tokens)")
        return await restore(d.controller.adapter(d.spec), d.controller.http, d.upstream().base_url, d.key, saved,
                             timeout=d.spec.timeouts.wake, directory=prompt_cache_dir(d.name),
                             identity_now=self._identity())

    def discard(self, saved: dict[str, Any] | None, why: str) -> dict[str, Any] | None:
        """A cache just saved that must not be restored (the engine that computed it failed its
        proof): its files removed; the park record's entry."""
        if not saved or saved.get("state") != SAVED:
            return saved
        remove_files(prompt_cache_dir(self._deployment.name), [str(f) for f in saved.get("files") or []])
        return {"state": DROPPED, "why": why, "files": [], "tokens": 0}

    def drop(self) -> dict[str, Any] | None:
        """A stop or delete: a cache saved at a park is not kept past it; the park record's new
        entry, or None when nothing was saved."""
        files = pending_files(self._deployment.park_record)
        if not files:
            return None
        remove_files(prompt_cache_dir(self._deployment.name), files)
        return {"state": DROPPED, "why": "the deployment was stopped", "files": [], "tokens": 0}

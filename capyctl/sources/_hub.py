"""Models on the Hugging Face Hub: pinned to a commit, downloaded into CapyCTL's models cache."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Callable

from huggingface_hub import HfApi, constants, snapshot_download
from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                    RevisionNotFoundError)

from ..errors import CapyError
from ..spec import HubModel
from ._local import gguf_candidates, pick_gguf, shards_of, size_of

Progress = Callable[[str, int, "int | None"], None]
POLL_S = 0.5
_TRUE = {"1", "ON", "YES", "TRUE"}


def hub_offline() -> bool:
    # huggingface_hub reads HF_HUB_OFFLINE once at import; read it again so a later setting counts.
    return os.environ.get("HF_HUB_OFFLINE", "").upper() in _TRUE or constants.HF_HUB_OFFLINE


def repo_cache_dir(models_dir: Path, repo: str) -> Path:
    return models_dir / ("models--" + repo.replace("/", "--"))


def _bytes_in(folder: Path) -> int:
    total = 0
    if folder.is_dir():
        for f in folder.iterdir():  # blobs, including the *.incomplete ones being written
            try:
                total += f.stat().st_size
            except FileNotFoundError:
                pass
    return total


def _from_cache(model: HubModel, models_dir: Path) -> Path:
    revision = model.revision or "main"
    try:
        return Path(snapshot_download(model.repo, revision=revision, cache_dir=models_dir, local_files_only=True))
    except LocalEntryNotFoundError:
        raise CapyError(
            f"{model.repo}@{revision} is not in the local model cache {models_dir} and the Hub cannot be "
            "used (offline); download it once while online, or give a commit that is cached",
            code="model_not_cached", status=404,
            detail={"repo": model.repo, "revision": revision, "cache": str(models_dir)}) from None


def _pin(model: HubModel) -> tuple[str, dict[str, int | None]]:
    """The commit sha the revision points to now, and the repository's files with their sizes."""
    try:
        # HF_ENDPOINT is read here, not at import, so a mirror set later is honoured.
        api = HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None)
        info = api.model_info(model.repo, revision=model.revision, files_metadata=True)
    except RepositoryNotFoundError:
        raise CapyError(f"the Hub has no model {model.repo!r} (or it is private and no token is set)",
                        code="model_not_found", status=404, detail={"repo": model.repo}) from None
    except RevisionNotFoundError:
        raise CapyError(f"{model.repo} has no revision {model.revision!r} (branch, tag or commit)",
                        code="model_revision_not_found", status=404,
                        detail={"repo": model.repo, "revision": model.revision}) from None
    except GatedRepoError:
        raise CapyError(f"{model.repo} is gated: accept its terms on the Hub and set HF_TOKEN",
                        code="model_gated", status=403, detail={"repo": model.repo}) from None
    files = {s.rfilename: s.size for s in (info.siblings or [])}
    assert info.sha, "model_info always carries the commit sha"
    return info.sha, files


def _select(model: HubModel, engine_kind: str, files: dict[str, int | None]) -> list[str] | None:
    """allow_patterns for the download: one GGUF (and its shards) for llama.cpp, else everything."""
    names = sorted(files)
    if engine_kind == "llama.cpp":
        return shards_of(pick_gguf(names, model.file, f"{model.repo}"), names)
    if model.file is not None:
        pick_gguf(names, model.file, model.repo)  # checks that the file exists
        return [model.file]
    return None


def _final_path(model: HubModel, engine_kind: str, snapshot: Path) -> Path:
    if engine_kind != "llama.cpp" and model.file is None:
        return snapshot
    names = sorted(str(p.relative_to(snapshot)) for p in snapshot.rglob("*") if p.is_file())
    if engine_kind == "llama.cpp" and model.file is None:
        names = gguf_candidates(names)
    return snapshot / pick_gguf(names, model.file, f"{model.repo} (cached snapshot {snapshot.name})")


async def resolve_hub(model: HubModel, engine_kind: str, models_dir: Path,
                      progress: Progress | None) -> tuple[Path, str, int]:
    models_dir.mkdir(parents=True, exist_ok=True)
    if hub_offline():
        snapshot = await asyncio.to_thread(_from_cache, model, models_dir)
    else:
        try:
            sha, files = await asyncio.to_thread(_pin, model)
        except CapyError:
            raise
        except Exception as exc:  # the Hub cannot be reached: a cached copy still serves
            try:
                snapshot = await asyncio.to_thread(_from_cache, model, models_dir)
            except CapyError as cached:
                raise CapyError(f"the Hub cannot be reached ({exc}) and {cached.message}",
                                code="hub_unreachable", status=503, detail=cached.detail) from exc
        else:
            allow = _select(model, engine_kind, files)
            wanted = allow if allow is not None else list(files)
            total = sum(files.get(n) or 0 for n in wanted) or None
            snapshot = await _download(model, sha, allow, models_dir, total, progress)
    path = _final_path(model, engine_kind, snapshot)
    return path, snapshot.name, size_of(path)


async def _download(model: HubModel, sha: str, allow: list[str] | None, models_dir: Path, total: int | None,
                    progress: Progress | None) -> Path:
    blobs = repo_cache_dir(models_dir, model.repo) / "blobs"
    before = _bytes_in(blobs)
    task = asyncio.create_task(asyncio.to_thread(
        snapshot_download, model.repo, revision=sha, cache_dir=models_dir, allow_patterns=allow))
    # Byte progress from the growing blobs: snapshot_download's own tqdm counts files, not bytes.
    while not task.done():
        if progress is not None:
            progress("download", max(0, _bytes_in(blobs) - before), total)
        await asyncio.wait({task}, timeout=POLL_S)
    snapshot = Path(task.result())
    if progress is not None:
        done = max(0, _bytes_in(blobs) - before)
        progress("download", total if total is not None and done < total else done, total)
    return snapshot

"""Models already on disk: checks, the GGUF a llama.cpp deployment runs, sizes."""

from __future__ import annotations

import os
import re
from pathlib import Path

from ..errors import CapyError

# "model-00001-of-00003.gguf": llama-server loads every shard when given the first.
_SHARD = re.compile(r"^(?P<stem>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")


def model_not_found(message: str, **detail: object) -> CapyError:
    return CapyError(message, code="model_not_found", status=404, detail=dict(detail))


def size_of(path: Path) -> int:
    """Bytes on disk of a file or a directory tree, following symlinks (a Hub snapshot is links to
    blobs) and counting a file linked twice once."""
    if path.is_file():
        return path.stat().st_size
    seen: set[tuple[int, int]] = set()
    total = 0
    for root, _dirs, files in os.walk(path, followlinks=True):
        for name in files:
            try:
                st = os.stat(os.path.join(root, name))
            except FileNotFoundError:  # a dangling link: nothing to count
                continue
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


def gguf_candidates(names: list[str]) -> list[str]:
    """The GGUF files that are models: multimodal projectors (mmproj*) are not, and a sharded
    model counts once, by its first shard."""
    models = [n for n in names if n.endswith(".gguf") and not Path(n).name.startswith("mmproj")]
    firsts = []
    for n in sorted(models):
        m = _SHARD.match(Path(n).name)
        if m is None or int(m.group("index")) == 1:
            firsts.append(n)
    return firsts


def shards_of(name: str, names: list[str]) -> list[str]:
    """Every shard of the model whose first shard is ``name`` (just ``name`` when not sharded)."""
    m = _SHARD.match(Path(name).name)
    if m is None:
        return [name]
    parent = str(Path(name).parent)
    return sorted(n for n in names if str(Path(n).parent) == parent and (s := _SHARD.match(Path(n).name))
                  and s.group("stem") == m.group("stem") and s.group("count") == m.group("count"))


def pick_gguf(names: list[str], wanted: str | None, where: str) -> str:
    """The one GGUF file of ``names`` to run: ``wanted`` if given, else the only candidate."""
    if wanted is not None:
        if wanted not in names:
            raise model_not_found(f"{where} has no file {wanted!r}", where=where, file=wanted)
        return wanted
    candidates = gguf_candidates(names)
    if not candidates:
        raise model_not_found(f"{where} holds no .gguf model file; llama.cpp runs GGUF models", where=where)
    if len(candidates) > 1:
        raise CapyError(
            f"{where} holds {len(candidates)} GGUF models ({', '.join(candidates)}); name the one to run "
            f"with `file:` in the manifest or a path to the file itself", code="model_ambiguous", status=400,
            detail={"where": where, "candidates": candidates})
    return candidates[0]


def resolve_local(path: str, engine_kind: str) -> Path:
    """The path the engine is given: for llama.cpp a GGUF file, for the others the directory (or file)."""
    p = Path(path)
    if not p.exists():
        raise model_not_found(f"the model path {path} does not exist on this host", path=path)
    if engine_kind == "llama.cpp":
        if p.is_dir():
            names = sorted(str(f.relative_to(p)) for f in p.iterdir() if f.is_file())
            p = p / pick_gguf(names, None, path)
        with open(p, "rb") as f:
            if f.read(4) != b"GGUF":
                raise CapyError(f"{p} is not a GGUF file (llama.cpp runs GGUF models)", code="model_not_gguf",
                                status=400, detail={"path": str(p)})
        return p
    if engine_kind in ("vllm", "sglang", "tensorfold") and not p.is_dir():
        raise CapyError(f"{path} is a file; {engine_kind} loads a model directory (config.json and weights)",
                        code="model_not_directory", status=400, detail={"path": path})
    return p

"""Reading manifests from YAML with errors that name the file, the field and the line."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ValidationError

from .models import DeploymentSpec, EngineSpec

if TYPE_CHECKING:
    import yaml

MAX_MANIFEST_BYTES = 1 << 20


@dataclass(frozen=True)
class Problem:
    field: str  # dotted path, "" for the document itself
    line: int | None  # 1-based
    message: str

    def render(self, source: str) -> str:
        where = f"{source}:{self.line}" if self.line else source
        field = f" {self.field}:" if self.field else ""
        return f"{where}:{field} {self.message}"


class ManifestError(Exception):
    """A manifest that cannot be used; ``str()`` gives one line a problem."""

    code = "invalid_manifest"
    status = 422

    def __init__(self, source: str, problems: list[Problem]) -> None:
        self.source = source
        self.problems = problems
        super().__init__("\n".join(p.render(source) for p in problems))

    @property
    def message(self) -> str:
        return str(self)

    def to_dict(self) -> dict:
        return {"code": self.code, "message": str(self),
                "detail": {"file": self.source,
                           "problems": [{"field": p.field, "line": p.line, "message": p.message}
                                        for p in self.problems]}}


def _yaml():  # type: ignore[no-untyped-def]
    # Imported when there is YAML to read: a daemon without a configuration file never reads
    # any (it gets manifests as JSON), and PyYAML would be a share of its idle RSS for nothing
    # (docs/benchmarks.md, "Figures behind design choices").
    import yaml
    return yaml


@functools.cache
def _line_loader() -> type:
    """SafeLoader that refuses duplicate keys (a silent override is a classic manifest bug)."""
    yaml = _yaml()

    class _LineLoader(yaml.SafeLoader):
        pass

    def construct_mapping(loader: _LineLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value:
            key = loader.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first at line {seen[key].start_mark.line + 1})",
                    key_node.start_mark)
            seen[key] = key_node
        return loader.construct_mapping(node, deep=deep)

    _LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, construct_mapping)
    return _LineLoader


def _node_at(node: yaml.Node | None, loc: tuple) -> tuple[yaml.Node | None, bool]:
    """Walk the YAML node tree along a pydantic error location; returns the deepest node reached
    and whether the whole path was found."""
    if node is None:  # no YAML behind these errors (validated data from elsewhere)
        return None, not loc
    yaml = _yaml()
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                if k.value == str(part):
                    node = v
                    break
            else:
                return node, False
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
        else:
            return node, False
    return node, True


def _key_line(node: yaml.Node | None, loc: tuple) -> int | None:
    """Line of the key an error is about (the key's own line reads better than its value's)."""
    if not loc:
        return node.start_mark.line + 1 if node is not None else None
    parent, found = _node_at(node, loc[:-1])
    if found and parent is not None and isinstance(parent, _yaml().MappingNode):
        for k, _ in parent.value:
            if k.value == str(loc[-1]):
                return k.start_mark.line + 1
    target, _ = _node_at(node, loc)
    return target.start_mark.line + 1 if target is not None else None


def _clean_loc(loc: tuple) -> tuple:
    # pydantic adds union member names ("HubModel", "PathModel") and validator tags to locations;
    # users only know the fields they wrote.
    return tuple(p for p in loc if isinstance(p, int) or (p[:1].islower() or p[:1] == "_"))


def _friendly(err: dict) -> str:
    kind = err["type"]
    if kind == "missing":
        return "is required"
    if kind == "extra_forbidden":
        return "is not a known field"
    msg = err["msg"]
    for prefix in ("Value error, ", "Assertion failed, "):
        if msg.startswith(prefix):
            msg = msg[len(prefix):]
    return msg


def _problems(exc: ValidationError, root: yaml.Node | None, *, model_union: bool = True) -> list[Problem]:
    problems: list[Problem] = []
    model_errors = [e for e in exc.errors() if model_union and e["loc"] and e["loc"][0] == "model"]
    # `model` is a union: pydantic reports each member's failure. Keep the member the user meant.
    mapping = _yaml().MappingNode if root is not None else ()  # () matches nothing
    if len(model_errors) > 1 and isinstance(root, mapping):
        node, _ = _node_at(root, ("model",))
        keys = {k.value for k, _ in node.value} if isinstance(node, mapping) else set()
        wanted = "HubModel" if "hf" in keys else "PathModel" if "path" in keys else None
        if wanted:
            picked = [e for e in model_errors if wanted in e["loc"]]
            others = [e for e in exc.errors() if e not in model_errors]
            errors = others + picked
        else:
            errors = [e for e in exc.errors() if e not in model_errors] + [
                {"loc": ("model",), "type": "value_error",
                 "msg": "must be {hf: org/name[@revision]} or {path: /absolute/path}"}]
    else:
        errors = exc.errors()
    seen = set()
    for err in errors:
        loc = _clean_loc(tuple(err["loc"]))
        field = ".".join(str(p) for p in loc)
        msg = _friendly(err)
        if (field, msg) in seen:
            continue
        seen.add((field, msg))
        problems.append(Problem(field, _key_line(root, loc), msg))
    # Report in the order a reader meets them in the file.
    return sorted(problems, key=lambda p: (p.line is None, p.line or 0))


def load_yaml(text: str, source: str, *, max_bytes: int,
              error: type[ManifestError] = ManifestError) -> tuple[Any, Any]:
    """The YAML document's node tree (for line numbers, see _problems) and its data; a text over
    ``max_bytes`` or a syntax error raises ``error`` naming the source and the line."""
    if len(text.encode()) > max_bytes:
        raise error(source, [Problem("", None, f"is larger than {max_bytes} bytes")])
    yaml = _yaml()
    try:
        return yaml.compose(text, Loader=_line_loader()), yaml.load(text, Loader=_line_loader())
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else None
        what = exc.problem or str(exc)
        raise error(source, [Problem("", line, f"YAML syntax error: {what}")]) from None
    except yaml.YAMLError as exc:
        raise error(source, [Problem("", None, f"YAML syntax error: {exc}")]) from None


def validation_problems(exc: ValidationError, root: Any) -> list[Problem]:
    """A pydantic error of a document read with :func:`load_yaml` as problems naming field and line,
    for other documents checked like manifests (recipes). Their ``model`` is not the manifest's
    union of a Hub and a path model, which _problems otherwise picks a member of."""
    return _problems(exc, root, model_union=False)


def parse_manifest(text: str, source: str = "<manifest>") -> DeploymentSpec | EngineSpec:
    """Parse one manifest; ``kind: engine`` documents become EngineSpec, others DeploymentSpec."""
    root, data = load_yaml(text, source, max_bytes=MAX_MANIFEST_BYTES)
    if data is None:
        raise ManifestError(source, [Problem("", None, "is empty; a manifest needs at least name, engine and model")])
    if not isinstance(data, dict):
        line = root.start_mark.line + 1 if root is not None else None
        raise ManifestError(source, [Problem("", line, f"must be a mapping of fields, got a {type(data).__name__}")])
    model: type[BaseModel] = EngineSpec if data.get("kind") == "engine" else DeploymentSpec
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ManifestError(source, _problems(exc, root)) from None


def read_document(path: Path, error: type[ManifestError] = ManifestError) -> str:
    """The text of a manifest-like file; ``error`` naming the file when it is missing or unreadable."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise error(str(path), [Problem("", None, "no such file")]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise error(str(path), [Problem("", None, f"cannot be read: {exc}")]) from None


def load_manifest(path: str | Path) -> DeploymentSpec | EngineSpec:
    path = Path(path)
    return parse_manifest(read_document(path), str(path))


def problems_in_file(path: str | Path, problems: list[dict]) -> ManifestError:
    """Problems the daemon found in a manifest the CLI sent it as JSON (``ManifestError.to_dict``'s
    ``detail.problems``: ones only the daemon can see, such as more cores than its hosts have),
    each placed on its field's line in the file the manifest was read from."""
    path = Path(path)
    root, _ = load_yaml(read_document(path), str(path), max_bytes=MAX_MANIFEST_BYTES)
    placed = []
    for problem in problems:
        field = str(problem.get("field") or "")
        loc = tuple(int(part) if part.isdigit() else part for part in field.split(".")) if field else ()
        placed.append(Problem(field, _key_line(root, loc) if field else None, str(problem.get("message") or "")))
    return ManifestError(str(path), placed)


def load_deployment(path: str | Path) -> DeploymentSpec:
    spec = load_manifest(path)
    if not isinstance(spec, DeploymentSpec):
        raise ManifestError(str(path), [Problem("kind", None, "is 'engine'; a deployment manifest was expected")])
    return spec

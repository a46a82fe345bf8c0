"""Manifests: what a user writes, validated with pydantic, errors located to the line."""

from .loader import ManifestError, Problem, load_deployment, load_manifest, parse_manifest, problems_in_file
from .models import (CAPABILITIES, DeploymentSpec, EngineSpec, HttpCall, HubModel, PathModel, Resources,
                     Timeouts)
from ._units import parse_duration, parse_size

__all__ = [
    "CAPABILITIES", "DeploymentSpec", "EngineSpec", "HttpCall", "HubModel", "ManifestError", "PathModel",
    "Problem", "Resources", "Timeouts", "load_deployment", "load_manifest", "parse_duration", "parse_manifest",
    "parse_size", "problems_in_file",
]

"""What `capyctl status`, `capyctl list`, the dashboard and the API show of one deployment: read
from its actor's public fields, never written back."""

from __future__ import annotations

from typing import Any

from ..errors import CapyError
from ._launch import model_label, spec_model_path
from ._lifecycle import RUNNING, DeploymentState


def parsers(actor: Any) -> dict | None:
    """The tool-call and reasoning parsers its launch renders, and why (vLLM, SGLang)."""
    spec = actor.spec
    model_path = actor.model_path or spec_model_path(spec)
    try:
        choice = actor.controller.adapter(spec).parsers(spec, model_path)
    except CapyError:
        return None
    return choice.to_dict() if choice is not None else None


def describe(actor: Any) -> dict:
    """One deployment as the management API answers for it (DeploymentActor.describe)."""
    spec, state = actor.spec, actor.state
    return {
        "name": actor.name, "state": state, "reason": actor.reason, "revision": actor.revision.revision,
        "engine": spec.engine, "unit": actor.unit, "model": model_label(spec),
        "model_commit": actor.model_commit, "port": actor.port if state in RUNNING else None,
        "socket": actor.socket_path if state in RUNNING or actor.parked_in_place else None,
        "hosts": spec.hosts[:spec.nodes] if spec.nodes > 1
        else [actor.host] if actor.launch_id or not spec.hosts else spec.hosts,
        "host_state": actor.controller.host_state(actor.host), "in_flight": actor.in_flight,
        "waiting": actor.waiting, "last_used": actor.last_used or None, "parked_in_place": actor.parked_in_place,
        "armed": actor.parked == "armed", "parked": actor.parked,
        # Taking turns (_turns.py): its door closed while another deployment waits for its room.
        "door": "open" if actor.requests.door_open else "closed",
        "wakes": actor.wakes, "parks": actor.parks, "aliases": spec.aliases,
        "park_tier": actor.park_tier,
        "park_record": {k: v for k, v in actor.park_record.items() if k != "reference"},
        "parsers": parsers(actor),
        # Members (units) serving against those the deployment has (`nodes`): ready "1/1", "0/2".
        "members": {"ready": spec.nodes if state == DeploymentState.READY else 0, "desired": spec.nodes},
        # Which replica of which deployment it is (manifest `replicas`; index 1 is the deployment's own name).
        "replica": {"deployment": actor.deployment, "index": actor.replica, "min": spec.replicas.min,
                    "max": spec.replicas.max},
        "journal": actor.journal if state == DeploymentState.FAILED else [],
    }

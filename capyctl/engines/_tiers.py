"""Park tiers: what a park keeps, decided per deployment and checked against its engine and host.

- ``restart``: the unit is stopped; a wake starts it again (every engine).
- ``host_backed``: the weights stay in host RAM, the KV cache is dropped (vLLM sleep level 1;
  SGLang launched with ``--enable-weights-cpu-backup``). On a host whose GPU and host memory are
  one pool (GB10 and other unified-memory machines) the "host" copy sits in the very memory the
  park was meant to free, so this tier is refused there.
- ``deep``: weights and KV cache released, the weights re-read from the checkpoint on wake (vLLM
  sleep level 2; SGLang's memory saver without the CPU backup, then update_weights_from_disk;
  TensorFold's level-2 prototype).

SGLang's tier is a launch flag (its memory saver and CPU backup cannot be acquired by a running
server), vLLM's a parameter of the sleep call: so one tier is declared per deployment, never
tried in a ladder at park time.
"""

from __future__ import annotations

from typing import Protocol

from ..errors import CapyError
from ..spec import DeploymentSpec
from ..spec.models import PARK_LEVEL_TIERS


class TierRefuser(Protocol):
    """What a tier's resolution asks of an engine adapter (EngineAdapter has it). A protocol rather
    than the adapter class: _base.py's adapters resolve their tier here, and this module imports
    nothing of theirs."""

    def park_tier_refusal(self, deployment: DeploymentSpec, tier: str) -> str | None: ...


RESTART, HOST_BACKED, DEEP = "restart", "host_backed", "deep"
# The vLLM sleep level of each in-place tier; the adapters' park and wake take it as ``level``.
TIER_SLEEP_LEVEL = {HOST_BACKED: 1, DEEP: 2}
LEVEL_TIER = {level: tier for tier, level in TIER_SLEEP_LEVEL.items()}
UNIFIED_MEMORY_REFUSAL = ("its GPU and host memory are one pool, so weights kept in host RAM free nothing; "
                          "use park_tier: deep or restart")


def tier_refusal(adapter: TierRefuser, deployment: DeploymentSpec, tier: str, *,
                 unified_memory: bool) -> str | None:
    """Why ``tier`` cannot be delivered for ``deployment`` on a host (None: it can)."""
    if tier == RESTART:
        return None
    if tier == HOST_BACKED and unified_memory:
        return UNIFIED_MEMORY_REFUSAL
    return adapter.park_tier_refusal(deployment, tier)


def resolve_park_tier(adapter: TierRefuser, deployment: DeploymentSpec, *,
                      unified_memory: bool = False) -> str:
    """The tier a deployment parks at: the one it declares, else the engine's best that the host
    can deliver (``park_level``, the older spelling, first where it can), else ``restart``."""
    declared = deployment.declared_park_tier
    if declared is not None:
        return declared
    preferred = PARK_LEVEL_TIERS.get(deployment.park_level) if deployment.park_level else None
    for tier in ([preferred] if preferred else []) + [HOST_BACKED, DEEP]:
        if tier_refusal(adapter, deployment, tier, unified_memory=unified_memory) is None:
            return tier
    return RESTART


def in_place_tier(deployment: DeploymentSpec) -> str:
    """The in-place tier a deployment asks for where it parks in place, without a host to check
    against: declared, else park_level's, else host_backed (what an adapter's parked_host_bytes
    charges; the controller charges by the tier resolved against the host)."""
    declared = deployment.declared_park_tier
    if declared in TIER_SLEEP_LEVEL:
        return declared
    return PARK_LEVEL_TIERS.get(deployment.park_level or 1, HOST_BACKED)


def check_park_tier(adapter: TierRefuser, deployment: DeploymentSpec, *, host: str,
                    unified_memory: bool) -> None:
    """Refuse (``park_tier_unsupported``) a declared ``park_tier`` the engine or host cannot deliver."""
    tier = deployment.park_tier
    if tier is None:
        return
    why = tier_refusal(adapter, deployment, tier, unified_memory=unified_memory)
    if why is not None:
        raise CapyError(f"deployment {deployment.name!r}: park_tier: {tier} cannot be delivered on host {host!r}: "
                        f"{why}", code="park_tier_unsupported", status=400,
                        detail={"field": "park_tier", "tier": tier, "host": host})

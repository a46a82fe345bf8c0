"""The scheduler: a pure memory ledger, placement and eviction planning. No I/O, no asyncio, no clock.

The controller owns one ``Ledger`` built from its hosts' ``HostResources`` (memory, and the cores
CPU engines are given one each) and keeps it in step with
every deployment's state (``place`` / ``set_state`` / ``forget``), feeds it what the inventory sees
(``observe_card``: NVML's free memory and per-deployment use of a GPU; ``observe_free``,
``confirm_released``) and what a running deployment was measured to use (``correct``), and before
starting or waking a deployment asks
``plan(Request, ledger, [Candidate...], now)`` for a ``Plan``: the host, the cards, and the victims
to park or stop first. ``Ledger.apply(plan, request)`` records the plan once it is carried out.
``idle_to_park(candidates, now)`` lists deployments due to park after their idle time.
``plan_when_idle`` tells a wake that may wait for busy deployments' room from one that never fits.
"""

from ._ledger import Ledger, Placement
from ._model import (FULL_STATES, STATES, Candidate, Core, Domain, Footprint, GpuCard, HostResources, NoRoom, Plan,
                     Request, Victim, cpu_domain, format_amount, format_size, gpu_domain, ram_domain)
from ._planner import idle_to_park, plan, plan_when_idle

__all__ = [
    "FULL_STATES", "STATES", "Candidate", "Core", "Domain", "Footprint", "GpuCard", "HostResources", "Ledger",
    "NoRoom", "Placement", "Plan", "Request", "Victim", "cpu_domain", "format_amount", "format_size", "gpu_domain",
    "idle_to_park", "plan", "plan_when_idle", "ram_domain",
]

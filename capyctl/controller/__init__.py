"""The controller: one asyncio task owns each deployment's state machine."""

from ._actor import (FAILED, PARKED, PARKING, READY, STARTING, STOPPED, STOPPING, WAKING, DeploymentActor)
from ._controller import Controller
from ._usage import UsageView

__all__ = ["Controller", "DeploymentActor", "FAILED", "PARKED", "PARKING", "READY", "STARTING", "STOPPED",
           "STOPPING", "UsageView", "WAKING"]

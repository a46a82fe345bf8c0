"""The controller: one asyncio task owns each deployment's state machine."""

from ._actor import DeploymentActor
from ._controller import Controller
from ._lifecycle import Command, DeploymentState
from ._usage import UsageView

__all__ = ["Command", "Controller", "DeploymentActor", "DeploymentState", "UsageView"]

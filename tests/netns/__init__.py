"""Two hosts on one machine: network namespaces joined by a veth pair, each with a sandboxed systemd and sshd."""

from .rig import NetHost, TwoHostRig, entered_netns

__all__ = ["NetHost", "TwoHostRig", "entered_netns"]

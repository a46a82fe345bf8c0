"""Hosts: what a machine has (GPUs through NVML, RAM, CPUs), which deployment uses which GPU,
and remote hosts reached over SSH (``SshHost``)."""

from .inventory import (GpuInfo, GpuProcess, HostInventory, NvmlUnavailable, deployment_of_pid, device_nodes,
                        gpu_inventory, host_inventory, unified_memory_default)
from .ssh import DBUS_SYSTEM_SOCKET, SshError, SshHost

__all__ = ["DBUS_SYSTEM_SOCKET", "GpuInfo", "GpuProcess", "HostInventory", "NvmlUnavailable", "SshError", "SshHost",
           "deployment_of_pid", "device_nodes", "gpu_inventory", "host_inventory",
           "unified_memory_default"]

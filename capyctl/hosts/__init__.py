"""Hosts: what a machine has (GPUs through NVML, RAM, CPUs), which deployment uses which GPU,
and remote hosts reached over SSH (``SshHost``)."""

from .inventory import (GpuInfo, GpuProcess, HostInventory, NvmlUnavailable, cores_of, deployment_of_pid,
                        device_nodes, format_cpu_list, gpu_inventory, host_inventory, parse_cpu_list,
                        unified_memory_default)
from .ssh import DBUS_SYSTEM_SOCKET, SshError, SshHost

__all__ = ["DBUS_SYSTEM_SOCKET", "GpuInfo", "GpuProcess", "HostInventory", "NvmlUnavailable", "SshError", "SshHost",
           "cores_of", "deployment_of_pid", "device_nodes", "format_cpu_list", "gpu_inventory", "host_inventory",
           "parse_cpu_list", "unified_memory_default"]

"""Hosts: what a machine has (GPUs through NVML, RAM, CPUs) and which deployment uses which GPU."""

from .inventory import (GpuInfo, GpuProcess, HostInventory, NvmlUnavailable, deployment_of_pid, device_nodes,
                        gpu_inventory, host_inventory)

__all__ = ["GpuInfo", "GpuProcess", "HostInventory", "NvmlUnavailable", "deployment_of_pid", "device_nodes",
           "gpu_inventory", "host_inventory"]

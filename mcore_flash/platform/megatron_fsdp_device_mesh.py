"""CPU and NPU: the device type of Megatron-FSDP's ``DeviceMesh``.

``distributed/fsdp/mcore_fsdp_adapter.py`` (``FullyShardedDataParallel._init_dist_index``,
megatron-core 0.16.1 lines 251, 265, 276; 0.19 lines 409-449) builds the data-parallel x
tensor-parallel mesh with ``DeviceMesh.from_group(..., device_type="cuda")``. The mesh
builds on a CPU-only torch, but its first DTensor fails
(``fsdp/src/megatron_fsdp/param_and_grad_buffer.py: make_fsdp_dtensor`` ->
``DTensor.from_local`` moves the local shard to the mesh's device: "Torch not compiled
with CUDA enabled"); on the NPU a "cuda" mesh over npu tensors would move shards between
device types. Here the adapter module's global ``DeviceMesh`` is a subclass whose
``from_group`` builds the mesh on the device this process trains on; torch's own
``DeviceMesh`` is untouched for every other caller.
"""

from __future__ import annotations

from mcore_flash.import_hooks import on_import

from ._common import device_type as this_device
from ._common import once

ADAPTER_MODULE = "megatron.core.distributed.fsdp.mcore_fsdp_adapter"


def _mesh_on_this_device():
    from torch.distributed.device_mesh import DeviceMesh

    class DeviceMeshOnThisDevice(DeviceMesh):
        """``DeviceMesh`` whose ``from_group`` builds a ``device_type="cuda"`` mesh on the
        device ``mcore_flash.platform.setup()`` chose."""

        __mcore_flash__ = True

        @staticmethod
        def from_group(group, device_type: str = "cuda", *args, **kwargs):
            if device_type == "cuda":
                device_type = this_device()
            return DeviceMesh.from_group(group, device_type, *args, **kwargs)

    return DeviceMeshOnThisDevice


def _rebind(module) -> None:
    if not getattr(getattr(module, "DeviceMesh", None), "__mcore_flash__", False):
        module.DeviceMesh = _mesh_on_this_device()


@once
def megatron_fsdp_device_mesh():
    """Megatron-FSDP's meshes on this process's device (now, or when FSDP is imported)."""
    on_import(ADAPTER_MODULE, _rebind)

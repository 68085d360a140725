"""DTensor on the emulated npu: sharding propagation fakes its tensors on the CPU.

torch's DTensor works out an op's output placement by running the op on FakeTensors
(``ShardingPropagator._propagate_tensor_meta_non_cached`` in
``torch/distributed/tensor/_sharding_prop.py``), which ``OpSchema.gen_fake_args`` builds
with ``_rebuild_tensor_from_dtensor_meta`` (``torch/distributed/tensor/_op_schema.py``) on
the mesh's device type. A FakeTensor on the emulated ``npu`` wraps a meta tensor and reaches
the emulation's PrivateUse1 kernels (:mod:`.tensor`), which refuse it: "Expected all tensors
to be on the same device ... npu:0 and meta! (emulated npu, op aten.detach.default)", for
every DTensor op. Only the fake's shape, stride and dtype are read (into a ``TensorMeta``), so
on an ``npu`` mesh it is made on the CPU instead. ``gen_fake_args`` / ``gen_fake_kwargs``
look the function up in ``_op_schema``'s globals at each call (torch 2.13; nothing imports it
by name), so replacing it there suffices.

Not covered: an op whose own arguments put a FakeTensor on the npu (a ``device=`` argument
of a DTensor op, e.g. ``aten._to_copy`` to another device) still fails as above.
"""

from __future__ import annotations

import functools

import torch

from mcore_flash.import_hooks import on_import

from .runtime import NAME

OP_SCHEMA = "torch.distributed.tensor._op_schema"


def _on_cpu_for_npu_meshes(rebuild):
    @functools.wraps(rebuild)
    def rebuild_tensor_from_dtensor_meta(arg):
        meta = arg.tensor_meta
        if meta is None or arg.mesh.device_type != NAME:
            return rebuild(arg)  # other devices, and torch's own error for a missing meta
        return torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype, device="cpu")

    rebuild_tensor_from_dtensor_meta.__mcore_flash_emulation__ = True
    return rebuild_tensor_from_dtensor_meta


def _patch(module) -> None:
    rebuild = getattr(module, "_rebuild_tensor_from_dtensor_meta", None)
    if rebuild is not None and not getattr(rebuild, "__mcore_flash_emulation__", False):
        module._rebuild_tensor_from_dtensor_meta = _on_cpu_for_npu_meshes(rebuild)


def fake_tensors_on_cpu() -> None:
    """DTensor's sharding propagation (imported now or later) fakes npu-mesh tensors on the CPU."""
    on_import(OP_SCHEMA, _patch)

"""Every device: megatron's optimizer checkpoint finds torch FSDP2's parameters.

Answers ``dist_checkpointing/optimizer.py: get_optim_param_to_id_map`` (megatron-core
0.16.1-0.19), which keys the optimizer's parameters by ``id(to_local_if_dtensor(param))``,
while the model's sharded state dict holds each FSDP2 parameter's ``_local_tensor``
(``utils.py: make_sharded_tensor_for_checkpoint``). ``DTensor.to_local()`` returns a new
tensor object on every call, so no parameter matches: "Param id 0 does not match any model
sharded param" on the first save of a ``--use-torch-fsdp2`` run. The module's
``to_local_if_dtensor`` returns ``_local_tensor``, the object the model's state dict holds.
"""

from __future__ import annotations

from mcore_flash.import_hooks import on_import

from ._common import once

OPTIMIZER_CHECKPOINT_MODULE = "megatron.core.dist_checkpointing.optimizer"


def _local_tensor_of(tensor):
    """The local shard object a DTensor holds (the same object on every call)."""
    return getattr(tensor, "_local_tensor", tensor)


def _rebind(module) -> None:
    if hasattr(module, "to_local_if_dtensor"):
        module.to_local_if_dtensor = _local_tensor_of


@once
def megatron_optimizer_ckpt_dtensor():
    """megatron's optimizer checkpoint maps FSDP2 parameters by their local shard object."""
    on_import(OPTIMIZER_CHECKPOINT_MODULE, _rebind)

"""torch FSDP2 through megatron-core's ``TorchFullyShardedDataParallel`` on any device, with
host offload.

Answers ``distributed/torch_fully_sharded_data_parallel.py`` (megatron-core 0.16.1-0.19) and
the DDP interface of its base, ``distributed/data_parallel_base.py``. As shipped, the wrapper:

* builds its mesh with ``DeviceMesh.from_group(group, "cuda")``: "Torch not compiled with CUDA
  enabled" on the CPU, shards moved between device types on the NPU;
* takes no offload or mixed-precision policy;
* wraps ``ColumnParallelLinear`` unless ``transformer_impl == "local"``: the flash spec's
  ``linear_qkv`` / ``linear_fc1`` get a ``fully_shard`` nested in their layer's (a
  ``TypeError`` in ``DeviceMesh._concatenate``);
* lets FSDP2 reduce-scatter with ``ReduceOp.AVG``: HCCL refuses it, and gloo divides the
  gradients by the data-parallel size on top of the per-token loss's division;
* inherits a ``scale_gradients`` that does nothing (with per-token loss the gradients come
  out the token count times too large, silently), a ``finish_grad_sync`` that does not take
  ``force_all_reduce`` on 0.16.1, and a ``zero_grad_buffer`` that does nothing.

:func:`torch_fsdp2_class` is the subclass that does each of these as the trainer needs.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch


@functools.cache
def torch_fsdp2_class() -> type:
    """The subclass of megatron's wrapper (built on first use: megatron-core is imported
    lazily)."""
    from megatron.core import parallel_state
    from megatron.core.distributed.data_parallel_base import _BaseDataParallel
    from megatron.core.distributed.torch_fully_sharded_data_parallel import (
        TorchFullyShardedDataParallel,
    )
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule, OffloadPolicy, fully_shard

    class TorchFSDP2(TorchFullyShardedDataParallel):
        """megatron's FSDP2 wrapper of ``module`` (this rank's GPTModel) with ``fully_shard``
        on each module of a type in ``units`` (in module order), then on ``module`` itself,
        over the data x context parallel ranks on ``device``'s type.

        ``offload_policy``: FSDP2's (``CPUOffloadPolicy`` keeps the sharded weights,
        gradients and so the optimizer state on the host); the parameters may then be on the
        host at construction, and each unit is moved to ``device`` just before its
        ``fully_shard`` (which moves it back to the host sharded), so the whole model is never
        on the device. ``mp_policy``: FSDP2's ``MixedPrecisionPolicy``. Gradients are summed
        over the ranks (the per-token loss divides by the token count in
        ``finalize_model_grads``); megatron's parameter attributes (``sequence_parallel``,
        ``tensor_model_parallel``, ...) are kept on the sharded parameters."""

        def __init__(
            self,
            config,
            ddp_config,
            module: torch.nn.Module,
            *,
            device: torch.device,
            units: tuple[type, ...],
            reshard_after_forward: bool,
            mp_policy,
            offload_policy: Optional[OffloadPolicy] = None,
        ):
            _BaseDataParallel.__init__(self, config=config, module=module)
            self.ddp_config = ddp_config
            self.process_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
            self.device_mesh = DeviceMesh.from_group(self.process_group, device.type)
            attributes = {name: dict(vars(p)) for name, p in module.named_parameters()}
            settings = dict(
                mesh=self.device_mesh,
                reshard_after_forward=reshard_after_forward,
                mp_policy=mp_policy,
                offload_policy=offload_policy or OffloadPolicy(),
            )
            previous = None
            for sub_module in list(module.modules()):
                if isinstance(sub_module, units):
                    _move_unsharded(sub_module, device)
                    fully_shard(sub_module, **settings)
                    if config.recompute_granularity is not None:  # as megatron's wrapper
                        sub_module.set_modules_to_backward_prefetch([previous] if previous else [])
                    previous = sub_module
            _move_unsharded(module, device)
            fully_shard(module, **settings)
            for name, param in module.named_parameters():
                for key, value in attributes.get(name, {}).items():
                    setattr(param, key, value)
                param.is_torch_fsdp2_param = True  # megatron-core 0.19's marker
            for sub_module in module.modules():
                if isinstance(sub_module, FSDPModule):
                    sub_module.set_gradient_divide_factor(1.0)
                    sub_module.set_force_sum_reduction_for_comms(True)

        def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
            """Nothing to finish: FSDP2 reduce-scatters each unit's gradients in its backward."""

        def scale_gradients(self, scaling_factor) -> None:
            """Multiply this rank's gradient shards by ``scaling_factor`` (a number or a
            one-element tensor, on the device while the shards may be on the host)."""
            if torch.is_tensor(scaling_factor):
                scaling_factor = scaling_factor.item()
            with torch.no_grad():
                for param in self.module.parameters():
                    if param.grad is not None:
                        param.grad.to_local().mul_(scaling_factor)

        def zero_grad_buffer(self) -> None:
            """Drop the gradients (FSDP2 allocates each unit's in its backward)."""
            for param in self.module.parameters():
                param.grad = None

    return TorchFSDP2


def _move_unsharded(module: torch.nn.Module, device: torch.device) -> None:
    """Move the parameters and buffers of ``module`` that no ``fully_shard`` owns yet to
    ``device`` by replacing them (their attributes kept). FSDP2 would move them itself with
    ``param.data = param.to(device)``, which a device implemented in Python (the emulated
    NPU) cannot take; the replacement is the same on every device."""
    from torch.distributed.tensor import DTensor

    for sub_module in module.modules():
        for name, param in list(sub_module._parameters.items()):
            if param is None or isinstance(param, DTensor) or param.device == device:
                continue
            moved = torch.nn.Parameter(param.detach().to(device), param.requires_grad)
            moved.__dict__.update(param.__dict__)
            sub_module._parameters[name] = moved
        for name, buffer in list(sub_module._buffers.items()):
            if buffer is not None and not isinstance(buffer, DTensor) and buffer.device != device:
                sub_module._buffers[name] = buffer.to(device)

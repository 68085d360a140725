"""The checkpoint formats behind one interface, and the one place a run's format is chosen.

``torch_dist`` (megatron's ``dist_checkpointing``, :mod:`.torch_dist`) or, with
``--use-megatron-fsdp``, ``fsdp_dtensor`` (torch DCP of its DTensors, :mod:`.fsdp_dtensor`):
:func:`run_format` picks it from the model. Either format's weights load into a run of the
other (:meth:`CheckpointFormat.load_weights`). ``model_chunks``: this rank's model chunks in
megatron's DDP or FSDP wrappers (bare GPTModels for the weights alone); every method is
collective.
"""

from __future__ import annotations

import abc

from mcore_flash.checkpoint import fsdp_dtensor, torch_dist
from mcore_flash.checkpoint.compatibility import check_fsdp_weights_layout
from mcore_flash.checkpoint.directory import FSDP_DTENSOR, TORCH_DIST, saved_format

# the bare GPTModel's attribute naming the torch_dist checkpoint whose weights it was given
# before Megatron-FSDP sharded it (:meth:`FsdpDTensor.load_weights_before_sharding`)
_PRELOADED = "_mcore_flash_weights_from"


class CheckpointFormat(abc.ABC):
    """How a run of one kind writes its state and reads a checkpoint back."""

    name: str

    @abc.abstractmethod
    def save(self, path: str, model_chunks: list, optimizer, scheduler, common: dict) -> None:
        """The model, optimizer and scheduler, with the ``common`` counters, into ``path``."""

    def save_in_background(self, path: str, model_chunks: list, optimizer, scheduler, common: dict):
        """megatron's ``AsyncRequest`` writing what :meth:`save` writes (``--async-save``)."""
        raise NotImplementedError(f"--async-save writes torch_dist checkpoints, not {self.name}")

    @abc.abstractmethod
    def load(self, path: str, common: dict, model_chunks: list, optimizer, scheduler) -> None:
        """Weights, optimizer state and scheduler of a checkpoint in this format."""

    @abc.abstractmethod
    def load_weights(self, root: str, path: str, common: dict, model_chunks: list) -> None:
        """The weights alone of the checkpoint at ``path`` (under ``root``, named in errors),
        saved in either format."""

    def after_weights_loaded(self, optimizer) -> None:
        """Bring ``optimizer`` up to the weights :meth:`load_weights` loaded (nothing by default)."""


class TorchDist(CheckpointFormat):
    name = TORCH_DIST

    def save(self, path, model_chunks, optimizer, scheduler, common):
        torch_dist.save(path, model_chunks, optimizer, scheduler, common)

    def save_in_background(self, path, model_chunks, optimizer, scheduler, common):
        return torch_dist.async_request(path, model_chunks, optimizer, scheduler, common)

    def load(self, path, common, model_chunks, optimizer, scheduler):
        torch_dist.load(path, model_chunks, optimizer, scheduler)

    def load_weights(self, root, path, common, model_chunks):
        if saved_format(common) == FSDP_DTENSOR:
            check_fsdp_weights_layout(root, common)
            fsdp_dtensor.load_unsharded(path, gpt_model(model_chunks[0]))
        else:
            torch_dist.load_model(path, model_chunks)

    def after_weights_loaded(self, optimizer):
        optimizer.reload_model_params()  # fp32 main parameters from the loaded weights


class FsdpDTensor(CheckpointFormat):
    """One model chunk: Megatron-FSDP runs without pipelining."""

    name = FSDP_DTENSOR

    def save(self, path, model_chunks, optimizer, scheduler, common):
        fsdp_dtensor.save(fsdp_dtensor.state_dict(model_chunks[0], optimizer), path)
        fsdp_dtensor.write_common(
            path, {**common, "ckpt_format": FSDP_DTENSOR, "scheduler": scheduler.state_dict()}
        )

    def load(self, path, common, model_chunks, optimizer, scheduler):
        fsdp_dtensor.load_into(path, model_chunks[0], optimizer)
        scheduler.load_state_dict(common["scheduler"])

    def load_weights(self, root, path, common, model_chunks):
        if saved_format(common) == FSDP_DTENSOR:
            raise ValueError(
                f"--load {root}: the weights alone of an FSDP checkpoint (--no-load-optim / --finetune) do not "
                "load into a --use-megatron-fsdp run: megatron-core's Megatron-FSDP has no model-to-main "
                "parameter update (optimizer/distrib_optimizer.py: _copy_model_params_to_main_params); resume "
                "with its optimizer state, or load the weights into a run without --use-megatron-fsdp"
            )
        if getattr(gpt_model(model_chunks[0]), _PRELOADED, None) != path:
            raise ValueError(
                f"--load {root}: its weights were saved without --use-megatron-fsdp (torch_dist) and must "
                "be loaded before Megatron-FSDP shards the model (checkpointer.load_weights_before_sharding)"
            )
        # FSDP copied the weights loaded before sharding into its buffers itself

    @staticmethod
    def load_weights_before_sharding(path: str, model) -> None:
        """Give the bare GPTModel ``model`` the weights of the torch_dist checkpoint at ``path``
        before ``FullyShardedDataParallel`` wraps it: Megatron-FSDP copies the module's weights
        into its sharded buffers when it is built (``param_and_grad_buffer.py``,
        ``_init_each_parameter_group_buffers``: ``wbuf.set_item``), so the checkpoint's layout
        (megatron's sharded keys, any TP) needs no mapping onto FSDP's uneven shards."""
        torch_dist.load_model(path, [model])
        setattr(model, _PRELOADED, path)


def run_format(model) -> CheckpointFormat:
    """The format a run whose (first) model chunk is ``model`` saves and loads in."""
    return FsdpDTensor() if fsdp_dtensor.is_fsdp(model) else TorchDist()


def gpt_model(model):
    """The GPTModel inside megatron's wrappers (``DistributedDataParallel.module``;
    ``FullyShardedDataParallel.module`` is ``MegatronFSDP``, whose ``module`` it is)."""
    while hasattr(model, "module"):
        model = model.module
    return model

"""Atomic, exactly-resumable, verified checkpoints: :class:`Checkpointer` saves, loads and
runs background saves for one run, in the format its model chose (:mod:`.formats`).

A checkpoint is written into ``iter_XXXXXXX.tmp/`` by all ranks, hashed into its manifest,
renamed to its final name by rank 0 once every rank has finished, and only then is the
marker replaced (:mod:`.directory`). A save killed at any point therefore leaves the previous
checkpoint and marker untouched; stale ``.tmp`` directories are removed by the next save. A
save that fails (a full disk) removes its partial files and raises
:class:`~.failures.CheckpointSaveError`. Loading checks every file against the manifest and
every pickle with a restricted unpickler (:mod:`.safe_pickles`) before megatron reads anything.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
from typing import Callable, Optional

import torch
import torch.distributed as dist

from mcore_flash import faults
from mcore_flash.checkpoint import manifest, safe_pickles
from mcore_flash.checkpoint.compatibility import (
    check_optimizer_layout,
    check_same_model,
    optimizer_layout,
)
from mcore_flash.checkpoint.directory import (
    TORCH_DIST,
    checkpoint_dir,
    fsync_directory,
    latest_iteration,
    read_latest,
    saved_format,
    unfinished_saves,
    write_marker,
)
from mcore_flash.checkpoint.failures import CheckpointSaveError, failed_save
from mcore_flash.checkpoint.formats import FsdpDTensor, TorchDist, run_format
from mcore_flash.checkpoint.rng import rng_state, set_rng_state

# Where the weights came from (a converted Hugging Face checkpoint's original config.json,
# generation_config.json and directory) and the record of the tokenizer stored beside the
# checkpoints (``<save>/tokenizer/``, :func:`mcore_flash.data.tokenizers.tokenizer_record`):
# read on load and written into every later checkpoint, so an export after continued
# pretraining keeps the original token ids, decoding defaults, metadata and tokenizer. A run
# that saves into another directory copies the tokenizer files there (:meth:`Checkpointer.save`).
PROVENANCE_KEYS = (
    "hf_config",
    "converted_from",
    "generation_config",
    "tokenizer",
    "synthetic_key_depth",  # the built-in task a run trains on (--synthetic-key-depth)
)
# in the provenance Checkpointer.load returns: the --load directory whose tokenizer/ to copy
_TOKENIZER_SOURCE = "_tokenizer_source"


class Checkpointer:
    """Saves and loads one run's state: ``model_chunks`` (this rank's, in megatron's DDP or
    FSDP wrappers), ``optimizer`` and ``scheduler``, with the run's padded vocabulary size and
    ``model_args`` (:mod:`.model_args`) stored and checked. ``background`` (``--async-save``):
    torch_dist shards are written by megatron's forked writer while training goes on."""

    def __init__(
        self,
        model_chunks: list,
        optimizer,
        scheduler,
        padded_vocab_size: int,
        model_args: dict,
        background: bool = False,
    ):
        self.model_chunks = model_chunks
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.padded_vocab_size = padded_vocab_size
        self.model_args = model_args
        self.format = run_format(model_chunks[0])
        self.background = BackgroundSaves() if background else None

    def save(
        self,
        root: str,
        iteration: int,
        consumed_samples: int,
        provenance: Optional[dict] = None,
        progress: Callable[[str], None] = lambda step: None,
    ) -> str:
        """Write checkpoint ``iteration`` under ``root`` atomically (collective); returns its
        directory. ``progress(step)`` is called as each step of the save begins (the hang
        watchdog's mark). In the background, this returns once the shards are staged; the
        manifest, rename and marker follow in :meth:`finalize`, once every rank's writer is done."""
        from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

        rank = dist.get_rank()
        final = checkpoint_dir(root, iteration)
        tmp = final + ".tmp"
        provenance = dict(provenance or {})
        tokenizer_source = provenance.pop(_TOKENIZER_SOURCE, None)
        if rank == 0:
            for stale in unfinished_saves(root):
                shutil.rmtree(stale, ignore_errors=True)
            os.makedirs(tmp)
            if tokenizer_source is not None:
                _carry_tokenizer(tokenizer_source, root, provenance["tokenizer"])
        dist.barrier()
        faults.point("save-begin", iteration)
        common = dict(
            iteration=iteration,
            consumed_samples=consumed_samples,
            padded_vocab_size=self.padded_vocab_size,
            model_args=self.model_args,
            optimizer_layout=optimizer_layout(self.optimizer, self.format.name),
            **provenance,
        )
        state = (self.model_chunks, self.optimizer, self.scheduler, common)
        try:
            progress("save: the shards")
            if self.background is None:
                self.format.save(tmp, *state)
                faults.point("save-shards", iteration)
            else:
                request = self.format.save_in_background(tmp, *state)
            progress("save: the RNG state")
            torch.save(rng_state(), os.path.join(tmp, f"rng_rank{rank:05d}.pt"))
            faults.point("save-rng", iteration)
            if self.background is not None:
                request.add_finalize_fn(lambda: _publish(root, iteration, tmp, final, progress))
                if request.async_fn is not None:  # the fault point inside the forked writer
                    writer = functools.partial(_write_in_background, iteration, request.async_fn)
                    request = request._replace(async_fn=writer)
                self.background.schedule(request, root, iteration)
                faults.point("save-scheduled", iteration)
                return final
        except (Exception, CheckpointException) as error:
            raise failed_save(root, iteration, error) from error
        _publish(root, iteration, tmp, final, progress)
        return final

    def finalize(self, blocking: bool) -> Optional[str]:
        """Publish the background save in flight (:meth:`BackgroundSaves.finalize`; collective,
        None without ``background``)."""
        return None if self.background is None else self.background.finalize(blocking)

    def load(
        self,
        root: str,
        finetune: bool = False,
        load_optim: bool = True,
        load_rng: bool = True,
    ) -> tuple[int, int, dict]:
        """Load the latest checkpoint under ``root``; returns ``(iteration, consumed_samples,
        provenance)`` (``PROVENANCE_KEYS`` of the checkpoint, for :meth:`save`).

        Megatron-LM's modes: ``finetune`` loads the weights only and starts at iteration 0;
        ``load_optim=False`` (``--no-load-optim``) keeps the checkpoint's iteration and sample
        count but starts the optimizer afresh (the lr schedule is advanced to that point);
        ``load_rng=False`` keeps this run's seeds. Any TP/PP/DP layout loads any other
        (dist_checkpointing reshards; virtual pipeline sizes too: the layers' keys are global),
        as long as the model and the padded vocabulary agree; optimizer state only where
        :func:`~.compatibility.check_optimizer_layout` allows. The weights of either format
        load into a run of the other (a torch_dist checkpoint's into an FSDP run through
        :func:`load_weights_before_sharding`).
        """
        path, common = _open_checkpoint(root, self.padded_vocab_size, self.model_args)
        load_optim = load_optim and not finetune
        if common.get("model_only") and load_optim:
            raise ValueError(
                f"--load {root} holds model weights only (converted from {common.get('converted_from')}): add --finetune "
                "to train from them starting at iteration 0 (or --no-load-optim to keep the checkpoint's iteration)"
            )
        if load_optim:
            now = optimizer_layout(self.optimizer, self.format.name)
            check_optimizer_layout(root, common, now)
            self.format.load(path, common, self.model_chunks, self.optimizer, self.scheduler)
        else:
            self.format.load_weights(root, path, common, self.model_chunks)
            self.format.after_weights_loaded(self.optimizer)
        provenance = _provenance(root, common)
        if finetune:
            return 0, 0, provenance
        consumed = int(common["consumed_samples"])
        if not load_optim:
            self.scheduler.step(increment=consumed)
        rng_file = os.path.join(path, f"rng_rank{dist.get_rank():05d}.pt")
        # a run resumed on another world size draws fresh RNG streams
        if load_rng and os.path.exists(rng_file):
            set_rng_state(safe_pickles.load_rng_file(rng_file))
        return int(common["iteration"]), consumed, provenance


class BackgroundSaves:
    """``--async-save``: megatron-core's ``AsyncCallsQueue`` (its forked writer per save, as
    Megatron-LM's default), with at most one save in flight: a new save first waits for the
    previous one (its ``.tmp`` directory would otherwise be taken for a stale one).

    :meth:`finalize` is collective: every rank calls it at the same points (each iteration,
    and blocking before a save, an exit or the end of training)."""

    def __init__(self):
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        self.queue = AsyncCallsQueue()
        self.pending: Optional[tuple[str, int]] = None  # (root, iteration) being written

    def schedule(self, request, root: str, iteration: int) -> None:
        self.queue.schedule_async_request(request)
        self.pending = (root, iteration)

    def finalize(self, blocking: bool) -> Optional[str]:
        """Publish the save in flight if every rank's writer is done (with ``blocking``: wait
        for them); returns the published checkpoint's directory, or None. A writer that
        failed (or died) raises :class:`CheckpointSaveError` with the previous checkpoint
        untouched, as a synchronous save does."""
        from torch.distributed.checkpoint.api import CheckpointException

        if self.pending is None:
            return None
        root, iteration = self.pending
        try:
            done = self.queue.maybe_finalize_async_calls(blocking=blocking)
        except CheckpointSaveError:
            self.pending = None
            raise
        except (Exception, CheckpointException) as error:
            self.pending = None
            raise failed_save(root, iteration, error) from error
        if not done:
            return None
        self.pending = None
        return checkpoint_dir(root, iteration)


def load_weights(root: str, model, padded_vocab_size: int, model_args: dict) -> dict:
    """Load only the model weights of the latest checkpoint under ``root`` into ``model`` (one
    GPTModel, for inference); returns the checkpoint's common state (iteration,
    ``model_args``, ...)."""
    path, common = _open_checkpoint(root, padded_vocab_size, model_args)
    TorchDist().load_weights(root, path, common, [model])
    return common


def load_weights_before_sharding(
    root: Optional[str], model, padded_vocab_size: int, model_args: dict
) -> bool:
    """Give the bare GPTModel of a ``--use-megatron-fsdp`` run the weights of a torch_dist
    checkpoint under ``root`` (written without FSDP, or converted from Hugging Face) before
    ``FullyShardedDataParallel`` wraps it (:meth:`.formats.FsdpDTensor.load_weights_before_sharding`).
    Returns whether it loaded; :meth:`Checkpointer.load` then loads the counters (collective)."""
    if not root or latest_iteration(root) is None:
        return False
    path, common = _open_checkpoint(root, padded_vocab_size, model_args)
    if saved_format(common) != TORCH_DIST:
        return False
    FsdpDTensor.load_weights_before_sharding(path, model)
    return True


def _publish(
    root: str, iteration: int, tmp: str, final: str, progress: Callable[[str], None]
) -> None:
    """Every rank's files are in ``tmp``: the manifest, then rank 0 renames ``tmp`` to
    ``final`` and points the marker at it (collective); ``progress`` as in
    :meth:`Checkpointer.save`."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dist.barrier()
        progress("save: the manifest")
        manifest.write_manifest(tmp)
    except (Exception, CheckpointException) as error:
        raise failed_save(root, iteration, error) from error
    progress("save: the rename and the tracker")
    faults.point("save-manifest", iteration)
    if dist.get_rank() == 0:
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_directory(root)
        faults.point("save-renamed", iteration)
        write_marker(root, iteration)
        faults.point("save-tracker", iteration)
    dist.barrier()


def _write_in_background(iteration: int, write, *args, **kwargs) -> None:
    """megatron's writer ``write``, in the process it forks for the save of ``iteration``."""
    faults.point("save-writing", iteration)
    write(*args, **kwargs)


def _open_checkpoint(root: str, padded_vocab_size: int, model_args: dict) -> tuple[str, dict]:
    """The latest checkpoint, every file checked against its manifest (collective), and its
    common state, checked against this run's model."""
    from mcore_flash import platform

    path, common = read_latest(root)
    if not manifest.verify_checkpoint(path, platform.torch_device()) and dist.get_rank() == 0:
        print(
            f"note: {path} has no {manifest.MANIFEST} (not written by mcore-flash): its files are not verified",
            file=sys.stderr,
        )
    check_same_model(root, common, padded_vocab_size, model_args)
    return path, common


def _provenance(root: str, common: dict) -> dict:
    """``PROVENANCE_KEYS`` of the checkpoint under ``root``; with its stored tokenizer, where to
    copy the files from. A tokenizer whose files are gone or changed is not carried forward (a
    run without tokenizer flags has already stopped on it; one with them uses its own)."""
    from mcore_flash.data.tokenizers import TOKENIZER_DIR, check_stored_tokenizer

    provenance = {key: common[key] for key in PROVENANCE_KEYS if key in common}
    if provenance.get("tokenizer"):
        try:
            check_stored_tokenizer(
                os.path.join(root, TOKENIZER_DIR), provenance["tokenizer"], f"--load {root}"
            )
            provenance[_TOKENIZER_SOURCE] = os.path.abspath(root)
        except ValueError as error:
            del provenance["tokenizer"]
            if dist.get_rank() == 0:
                print(f"note: not carried into --save: {error}", file=sys.stderr)
    return provenance


def _carry_tokenizer(source: str, root: str, record: dict) -> None:
    """Copy the tokenizer stored under the ``--load`` directory ``source`` into ``root``/tokenizer
    (rank 0, once: not when ``root`` is ``source`` or already holds it)."""
    from mcore_flash.data.tokenizers import TOKENIZER_DIR, check_stored_tokenizer, store_tokenizer

    target = os.path.join(root, TOKENIZER_DIR)
    if os.path.realpath(source) == os.path.realpath(root):
        return
    if os.path.isdir(target):
        try:
            check_stored_tokenizer(target, record, target)
            return
        except ValueError:
            shutil.rmtree(target)  # another tokenizer's files: replaced by this run's
    store_tokenizer(os.path.join(source, TOKENIZER_DIR), target, record)

"""Atomic, exactly-resumable, verified checkpoints with megatron's ``dist_checkpointing``
(``--ckpt-format torch_dist``) or, with ``--use-megatron-fsdp``, torch DCP of its DTensors
(``fsdp_dtensor``, :mod:`mcore_flash.training.fsdp_checkpoint`).

Layout under ``--save`` (Megatron-LM's names)::

    iter_0000100/                       model + optimizer (sharded), scheduler, counters
        common.pt                       fsdp_dtensor (and torch_dist on megatron-core 0.16):
                                        counters, scheduler, model flags, optimizer layout
        rng_rank00000.pt                each rank's RNG states (CPU, device, TP tracker)
        manifest.json                   size + SHA-256 of every other file, written last
    latest_checkpointed_iteration.txt   "100"

A checkpoint is written into ``iter_XXXXXXX.tmp/`` by all ranks, hashed into its manifest,
renamed to its final name by rank 0 once every rank has finished, and only then is the
marker replaced (itself through a temporary file and ``os.replace``; renames are fsynced).
A save killed at any point therefore leaves the previous checkpoint and marker untouched;
stale ``.tmp`` directories are reported at start and removed by the next save. A save that
fails (a full disk) removes its partial files and stops training with
:class:`CheckpointSaveError`. Loading checks every file against the manifest and every
pickle with a restricted unpickler (:mod:`mcore_flash.training.safe_pickles`) before
megatron reads anything.
"""

from __future__ import annotations

import errno
import functools
import glob
import os
import random
import shutil
import sys
from typing import Callable, Optional

import numpy
import torch
import torch.distributed as dist

from mcore_flash.training import faults, fsdp_checkpoint, manifest, safe_pickles
from mcore_flash.training.host_adam import MOMENT_DTYPES

MARKER = "latest_checkpointed_iteration.txt"
# Where the weights came from (a converted Hugging Face checkpoint's original config.json,
# generation_config.json and directory) and the record of the tokenizer stored beside the
# checkpoints (``<save>/tokenizer/``, :func:`mcore_flash.data.tokenizers.tokenizer_record`):
# read on load and written into every later checkpoint, so an export after continued
# pretraining keeps the original token ids, decoding defaults, metadata and tokenizer. A run
# that saves into another directory copies the tokenizer files there (:func:`save_checkpoint`).
PROVENANCE_KEYS = (
    "hf_config",
    "converted_from",
    "generation_config",
    "tokenizer",
    "synthetic_key_depth",  # the built-in task a run trains on (--synthetic-key-depth)
)
# in the provenance load_checkpoint returns: the --load directory whose tokenizer/ to copy
_TOKENIZER_SOURCE = "_tokenizer_source"
# dist_checkpointing's index and non-tensor files, checked before anything is read
COMMON_FILES = ("metadata.json", "common.pt", ".metadata")
TORCH_DIST = "torch_dist"
# the bare GPTModel's attribute naming the torch_dist checkpoint whose weights it was given
# before Megatron-FSDP sharded it (:func:`load_weights_before_sharding`)
_PRELOADED = "_mcore_flash_weights_from"


class CheckpointSaveError(RuntimeError):
    """A save failed (disk full, I/O error); the previous checkpoint is untouched."""


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def unfinished_saves(root: Optional[str]) -> list[str]:
    """The ``iter_*.tmp`` directories under ``root``: saves that were killed or failed."""
    return sorted(glob.glob(os.path.join(root, "iter_*.tmp"))) if root else []


def refuse_overwrite(save: str, load: Optional[str]) -> None:
    """Raise ValueError when ``save`` holds a run (a checkpoint, a save that did not finish,
    or ``metrics.jsonl``) that this one does not resume (``load`` is not the same
    directory): training would replace its checkpoints. Megatron-LM overwrites silently."""
    names = sorted(os.listdir(save)) if os.path.isdir(save) else []
    held = [n for n in names if n in (MARKER, "metrics.jsonl") or n.startswith("iter_")]
    if held and not (load and os.path.realpath(load) == os.path.realpath(save)):
        given = f"--load {load} is another directory" if load else "no --load is given"
        shown = ", ".join(held[:3]) + (", ..." if len(held) > 3 else "")
        raise ValueError(
            f"--save {save} holds a run already ({shown}) and {given}: training would overwrite "
            f"it. Resume that run with --load {save}, or give this one another --save directory"
        )


def _marker_iteration(root: str) -> Optional[int]:
    """The iteration the marker names, or None (no marker, or one naming nothing)."""
    try:
        return latest_iteration(root)
    except ValueError:
        return None


def latest_iteration(root: str) -> Optional[int]:
    """The iteration the marker names, or None when ``root`` holds no finished checkpoint."""
    marker = os.path.join(root, MARKER)
    if not os.path.exists(marker):
        return None
    with open(marker) as f:
        text = f.read().strip()
    if not text.isdigit() or not os.path.isdir(checkpoint_dir(root, int(text))):
        raise ValueError(
            f"--load {root}: {marker} says {text!r} but that checkpoint is missing or unreadable"
        )
    return int(text)


def save_checkpoint(
    root: str,
    iteration: int,
    model_chunks: list,
    optimizer,
    scheduler,
    consumed_samples: int,
    padded_vocab_size: int,
    model_args: dict,
    provenance: Optional[dict] = None,
    background: Optional["BackgroundSaves"] = None,
    progress: Callable[[str], None] = lambda step: None,
) -> str:
    """Write checkpoint ``iteration`` of this rank's ``model_chunks`` (megatron's DDP or FSDP
    wrappers) under ``root`` atomically (collective over all ranks); returns its directory.
    ``progress(step)`` is called as each step of the save begins (the hang watchdog's mark).

    With ``background`` (``--async-save``, torch_dist only) the shards are written by
    megatron's asynchronous dist-checkpoint writer while training goes on: this returns once
    they are staged, and the manifest, rename and tracker follow in
    :meth:`BackgroundSaves.finalize`, once every rank's writer has finished."""
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
        padded_vocab_size=padded_vocab_size,
        model_args=model_args,
        optimizer_layout=optimizer_layout(optimizer),
        **provenance,
    )
    try:
        progress("save: the shards")
        if background is None:
            _write_state(tmp, model_chunks, optimizer, scheduler, common)
            faults.point("save-shards", iteration)
        else:
            request = _async_request(tmp, model_chunks, optimizer, scheduler, common)
        progress("save: the RNG state")
        torch.save(_rng_state(), os.path.join(tmp, f"rng_rank{rank:05d}.pt"))
        faults.point("save-rng", iteration)
        if background is not None:
            request.add_finalize_fn(lambda: _publish(root, iteration, tmp, final, progress))
            if request.async_fn is not None:  # the fault point inside the forked writer
                writer = functools.partial(_write_in_background, iteration, request.async_fn)
                request = request._replace(async_fn=writer)
            background.schedule(request, root, iteration)
            faults.point("save-scheduled", iteration)
            return final
    except (Exception, CheckpointException) as error:
        raise _failed_save(root, iteration, error) from error
    _publish(root, iteration, tmp, final, progress)
    return final


def _publish(
    root: str, iteration: int, tmp: str, final: str, progress: Callable[[str], None]
) -> None:
    """Every rank's files are in ``tmp``: the manifest, then rank 0 renames ``tmp`` to
    ``final`` and points the tracker at it (collective); ``progress`` as in
    :func:`save_checkpoint`."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dist.barrier()
        progress("save: the manifest")
        manifest.write_manifest(tmp)
    except (Exception, CheckpointException) as error:
        raise _failed_save(root, iteration, error) from error
    progress("save: the rename and the tracker")
    faults.point("save-manifest", iteration)
    if dist.get_rank() == 0:
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_directory(root)
        faults.point("save-renamed", iteration)
        write_marker(root, iteration)
        faults.point("save-tracker", iteration)
    dist.barrier()


def _failed_save(root: str, iteration: int, error: BaseException) -> "CheckpointSaveError":
    """The error to raise for a save that failed: its message measures the free space before
    rank 0 removes the partial files (giving the space back)."""
    message = _save_failure(root, iteration, error)
    if dist.get_rank() == 0:
        shutil.rmtree(checkpoint_dir(root, iteration) + ".tmp", ignore_errors=True)
    return CheckpointSaveError(message)


def _write_in_background(iteration: int, write, *args, **kwargs) -> None:
    """megatron's writer ``write``, in the process it forks for the save of ``iteration``."""
    faults.point("save-writing", iteration)
    write(*args, **kwargs)


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
            raise _failed_save(root, iteration, error) from error
        if not done:
            return None
        self.pending = None
        return checkpoint_dir(root, iteration)


def _write_state(path: str, model_chunks: list, optimizer, scheduler, common: dict) -> None:
    """The model, optimizer and scheduler with the ``common`` counters into ``path``
    (collective): megatron's ``dist_checkpointing.save`` (torch_dist), or DCP of the FSDP
    DTensors plus rank 0's ``common.pt`` with the scheduler (fsdp_dtensor)."""
    if fsdp_checkpoint.is_fsdp(model_chunks[0]):  # one chunk: FSDP runs without pipelining
        fsdp_checkpoint.save(fsdp_checkpoint.state_dict(model_chunks[0], optimizer), path)
        fsdp_checkpoint.write_common(
            path,
            {**common, "ckpt_format": fsdp_checkpoint.FORMAT, "scheduler": scheduler.state_dict()},
        )
        return
    from megatron.core import dist_checkpointing

    dist_checkpointing.save(
        {**_sharded_state(model_chunks, optimizer, scheduler, is_loading=False), **common}, path
    )


def _async_request(path: str, model_chunks: list, optimizer, scheduler, common: dict):
    """megatron's ``AsyncRequest`` writing the torch_dist checkpoint into ``path``: the common
    state is written now, the shards (staged to host memory first) by the forked writer.
    megatron-core's own writer (``async_strategy="mcore"``): 0.19 defaults to NVIDIA's
    ``nvidia-resiliency-ext`` package instead (CUDA-only, not a dependency here) and logs that
    its own is deprecated; 0.16 has only its own."""
    import inspect

    from megatron.core import dist_checkpointing

    strategy = {}
    if "async_strategy" in inspect.signature(dist_checkpointing.save).parameters:
        strategy = {"async_strategy": "mcore"}
    return dist_checkpointing.save(
        {**_sharded_state(model_chunks, optimizer, scheduler, is_loading=False), **common},
        path,
        async_sharded_save=True,
        **strategy,
    )


def checkpoint_format(common: dict) -> str:
    """``fsdp_dtensor`` or ``torch_dist`` (checkpoints that do not say: written by megatron's
    ``dist_checkpointing``, or converted from Hugging Face)."""
    return common.get("ckpt_format", TORCH_DIST)


def load_checkpoint(
    root: str,
    model_chunks: list,
    optimizer,
    scheduler,
    padded_vocab_size: int,
    model_args: dict,
    finetune: bool = False,
    load_optim: bool = True,
    load_rng: bool = True,
) -> tuple[int, int, dict]:
    """Load the latest checkpoint under ``root``; returns ``(iteration, consumed_samples,
    provenance)`` (``PROVENANCE_KEYS`` of the checkpoint, for :func:`save_checkpoint`).

    Megatron-LM's modes: ``finetune`` loads the weights only and starts at iteration 0;
    ``load_optim=False`` (``--no-load-optim``) keeps the checkpoint's iteration and sample
    count but starts the optimizer afresh (the lr schedule is advanced to that point);
    ``load_rng=False`` keeps this run's seeds. Any TP/PP/DP layout loads any other
    (dist_checkpointing reshards; virtual pipeline sizes too: the layers' keys are global),
    as long as the model and the padded vocabulary agree; distributed-optimizer state only
    at its TP, PP and virtual pipeline sizes (:func:`_check_optimizer_layout`).
    With ``--use-megatron-fsdp`` (``fsdp_dtensor``): its own optimizer state at its TP size
    and any data x context parallel size; the weights of either kind load into a run of the other
    (a torch_dist checkpoint's through :func:`load_weights_before_sharding`).
    """
    path, common = _open_checkpoint(root, padded_vocab_size, model_args)
    load_optim = load_optim and not finetune
    if common.get("model_only") and load_optim:
        raise ValueError(
            f"--load {root} holds model weights only (converted from {common.get('converted_from')}): add --finetune "
            "to train from them starting at iteration 0 (or --no-load-optim to keep the checkpoint's iteration)"
        )
    if load_optim:
        _check_optimizer_layout(root, common, optimizer)
        _load_with_optimizer(path, common, model_chunks, optimizer, scheduler)
    else:
        fsdp_run = fsdp_checkpoint.is_fsdp(model_chunks[0])
        if fsdp_run and checkpoint_format(common) == fsdp_checkpoint.FORMAT:
            raise ValueError(
                f"--load {root}: the weights alone of an FSDP checkpoint (--no-load-optim / --finetune) do not "
                "load into a --use-megatron-fsdp run: megatron-core's Megatron-FSDP has no model-to-main "
                "parameter update (optimizer/distrib_optimizer.py: _copy_model_params_to_main_params); resume "
                "with its optimizer state, or load the weights into a run without --use-megatron-fsdp"
            )
        _load_model(root, path, common, model_chunks)
        if not fsdp_run:  # FSDP copied the weights loaded before sharding into its buffers itself
            optimizer.reload_model_params()  # fp32 main parameters from the loaded weights
    provenance = _provenance(root, common)
    if finetune:
        return 0, 0, provenance
    consumed = int(common["consumed_samples"])
    if not load_optim:
        scheduler.step(increment=consumed)
    rng_file = os.path.join(path, f"rng_rank{dist.get_rank():05d}.pt")
    if load_rng and os.path.exists(
        rng_file
    ):  # a run resumed on another world size draws fresh RNG streams
        _set_rng_state(safe_pickles.load_rng_file(rng_file))
    return int(common["iteration"]), consumed, provenance


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


def _load_with_optimizer(path: str, common: dict, model_chunks: list, optimizer, scheduler) -> None:
    """Weights, optimizer state and scheduler of a checkpoint of this run's kind (collective)."""
    if fsdp_checkpoint.is_fsdp(model_chunks[0]):
        fsdp_checkpoint.load_into(path, model_chunks[0], optimizer)
        scheduler.load_state_dict(common["scheduler"])
        return
    from megatron.core import dist_checkpointing

    _materialise_optimizer_state(optimizer)
    loaded = dist_checkpointing.load(
        _sharded_state(model_chunks, optimizer, scheduler, is_loading=True), path
    )
    _load_chunk_states(model_chunks, loaded)
    with torch.no_grad():  # the distributed optimizer copies into views of fp32 parameters
        optimizer.load_state_dict(loaded["optimizer"])
    _restore_adam_steps(optimizer, loaded["optimizer"])
    scheduler.load_state_dict(loaded["scheduler"])


def load_weights(root: str, model, padded_vocab_size: int, model_args: dict) -> dict:
    """Load only the model weights of the latest checkpoint under ``root`` into ``model`` (one
    GPTModel, for inference); returns the checkpoint's common state (iteration,
    ``model_args``, ...)."""
    path, common = _open_checkpoint(root, padded_vocab_size, model_args)
    _load_model(root, path, common, [model])
    return common


def load_weights_before_sharding(
    root: Optional[str], model, padded_vocab_size: int, model_args: dict
) -> bool:
    """Give the bare GPTModel of a ``--use-megatron-fsdp`` run the weights of a torch_dist
    checkpoint under ``root`` (written without FSDP, or converted from Hugging Face) before
    ``FullyShardedDataParallel`` wraps it: Megatron-FSDP copies the module's weights into its
    sharded buffers when it is built (``param_and_grad_buffer.py``,
    ``_init_each_parameter_group_buffers``: ``wbuf.set_item``), so the checkpoint's layout
    (megatron's sharded keys, any TP) needs no mapping onto FSDP's uneven shards. Returns
    whether it loaded; :func:`load_checkpoint` then loads the counters (collective)."""
    if not root or latest_iteration(root) is None:
        return False
    path, common = _open_checkpoint(root, padded_vocab_size, model_args)
    if checkpoint_format(common) != TORCH_DIST:
        return False
    _load_torch_dist_model(path, [model])
    setattr(model, _PRELOADED, path)
    return True


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
    _check_same_model(root, common, padded_vocab_size, model_args)
    return path, common


def read_latest(root: str, verify_all: bool = False) -> tuple[str, dict]:
    """The latest checkpoint under ``root``: its directory and its common (non-tensor) state
    (iteration, ``model_args``, padded vocabulary, ...). Checks the index and common files
    against the manifest (``verify_all``: every file, in this process alone, for readers
    outside training such as the export) and every pickle before reading any."""
    iteration = latest_iteration(root)
    if iteration is None:
        raise ValueError(
            f"--load {root}: no {MARKER} there; point --load at a --save directory of an earlier run"
        )
    path = checkpoint_dir(root, iteration)
    manifest.verify_files(path, None if verify_all else COMMON_FILES)
    return path, safe_pickles.load_common_state(path)


def _load_model(root: str, path: str, common: dict, model_chunks: list) -> None:
    """The checkpoint's weights into ``model_chunks``, either kind into either (collective)."""
    saved_fsdp = checkpoint_format(common) == fsdp_checkpoint.FORMAT
    model = model_chunks[0]  # the only one where either side is FSDP
    if fsdp_checkpoint.is_fsdp(model) and saved_fsdp:
        fsdp_checkpoint.load_into(path, model)
    elif fsdp_checkpoint.is_fsdp(model):
        if getattr(_gpt_model(model), _PRELOADED, None) != path:
            raise ValueError(
                f"--load {root}: its weights were saved without --use-megatron-fsdp (torch_dist) and must "
                "be loaded before Megatron-FSDP shards the model (checkpointing.load_weights_before_sharding)"
            )
    elif saved_fsdp:
        _check_fsdp_weights_layout(root, common)
        fsdp_checkpoint.load_unsharded(path, _gpt_model(model))
    else:
        _load_torch_dist_model(path, model_chunks)


def _load_torch_dist_model(path: str, model_chunks: list) -> None:
    from megatron.core import dist_checkpointing

    loaded = dist_checkpointing.load(
        _sharded_state(model_chunks, None, None, is_loading=True), path
    )
    _load_chunk_states(model_chunks, loaded)


def _check_fsdp_weights_layout(root: str, common: dict) -> None:
    """An FSDP checkpoint's weights load without FSDP at its tensor-parallel size only: each
    DTensor is the concatenation of the TP shards (SwiGLU's fc1 interleaves gate and up per
    TP rank), which a run at another TP size would cut differently; and without pipelining:
    its keys are the whole model's (FSDP runs at PP 1), read by each stage's local names."""
    from megatron.core import parallel_state

    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        raise ValueError(
            f"--load {root}: its weights were saved with --use-megatron-fsdp and load without FSDP only at "
            "--pipeline-model-parallel-size 1; convert them once through a run at PP 1 (its save is "
            "torch_dist, which any layout loads), or resume with --use-megatron-fsdp"
        )
    saved = (common.get("optimizer_layout") or {}).get("tensor_model_parallel_size", 1)
    now = parallel_state.get_tensor_model_parallel_world_size()
    if saved != now:
        raise ValueError(
            f"--load {root}: its weights were saved with --use-megatron-fsdp at --tensor-model-parallel-size "
            f"{saved} and load without FSDP only at that size (this run: {now}); pass "
            f"--tensor-model-parallel-size {saved}, or --use-megatron-fsdp"
        )


def _check_moment_dtypes(root: str, saved: dict, now: dict) -> None:
    """Refuse Adam moments stored in another dtype than this run's (``--exp-avg-dtype`` /
    ``--exp-avg-sq-dtype``: the offloaded host step's narrower state), naming the flag;
    ``saved`` / ``now``: the checkpoint's and this run's :func:`optimizer_layout`."""
    for key in ("exp_avg_dtype", "exp_avg_sq_dtype"):
        was = saved.get(key, "fp32")  # checkpoints before the flags: fp32
        if was != now[key]:
            flag = "--" + key.replace("_", "-")
            raise ValueError(
                f"--load {root}: its Adam moments were saved as {flag} {was}, and this run stores them as "
                f"{now[key]}; pass {flag} {was}, or --no-load-optim to load the weights, iteration and "
                "schedule with a fresh optimizer"
            )


def read_model_args(root: str) -> dict:
    """The ``model_args`` stored with the latest checkpoint under ``root`` (``--use-checkpoint-args``)."""
    saved = read_latest(root)[1].get("model_args")
    if saved is None:
        raise ValueError(
            f"--use-checkpoint-args: the checkpoint in --load {root} predates stored model flags; pass them"
        )
    return saved


def _check_same_model(root: str, common: dict, padded_vocab_size: int, model_args: dict) -> None:
    """The checkpoint's model is this run's: same shape flags and vocabulary (errors name the flag)."""
    from mcore_flash.training.model import SHAPE_ARGS

    saved = common.get("model_args") or {}
    for name in SHAPE_ARGS:
        if name in saved and saved[name] != model_args[name]:
            flag = "--" + name.replace("_", "-")
            raise ValueError(
                f"--load {root}: the checkpoint's model has {flag}={saved[name]}, this run {model_args[name]}; "
                f"pass {flag} as the checkpoint has it (or --use-checkpoint-args)"
            )
    if "vocab_size" in saved and saved["vocab_size"] != model_args["vocab_size"]:
        raise ValueError(
            f"--load {root}: the checkpoint's vocabulary has {saved['vocab_size']} tokens, this run's tokenizer "
            f"{model_args['vocab_size']}; train with the checkpoint's tokenizer (--tokenizer-type / --tokenizer-model)"
        )
    saved_vocab = common.get("padded_vocab_size")
    if saved_vocab != padded_vocab_size:
        raise ValueError(
            f"--load {root}: the checkpoint's embedding has {saved_vocab} rows, this run pads the vocabulary "
            f"to {padded_vocab_size} (padding is a multiple of --make-vocab-size-divisible-by x TP); choose "
            "--make-vocab-size-divisible-by so both layouts pad alike"
        )


def optimizer_layout(optimizer) -> dict:
    """What decides whether optimizer state reloads: its format (``fsdp_dtensor`` with
    Megatron-FSDP), distributed or not, the TP, PP, virtual pipeline (1: no interleaving)
    and data x context parallel sizes, and the storage dtypes of Adam's moments."""
    from megatron.core import parallel_state
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    inners = getattr(optimizer, "chained_optimizers", [optimizer])
    names = {dtype: name for name, dtype in MOMENT_DTYPES.items()}
    groups = [group for inner in inners for group in inner.optimizer.param_groups]
    fsdp = any(
        getattr(getattr(inner, "ddp_config", None), "use_megatron_fsdp", False) for inner in inners
    )
    return {
        "format": fsdp_checkpoint.FORMAT if fsdp else TORCH_DIST,
        "distributed": any(isinstance(inner, DistributedOptimizer) for inner in inners),
        "tensor_model_parallel_size": parallel_state.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": parallel_state.get_pipeline_model_parallel_world_size(),
        "virtual_pipeline_model_parallel_size": (
            parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1
        ),
        "data_context_parallel_size": parallel_state.get_data_parallel_world_size(
            with_context_parallel=True
        ),
        # Adam's moments (the host step's bf16 ones: mcore_flash.training.offload)
        **{
            key: names[groups[0].get(key, torch.float32)] if groups else "fp32"
            for key in ("exp_avg_dtype", "exp_avg_sq_dtype")
        },
    }


def _check_optimizer_layout(root: str, common: dict, optimizer) -> None:
    """Refuse optimizer state that would not load into this run's optimizer (errors name the flag).

    The distributed optimizer's ``dp_reshardable`` state is cut into the DP ranks' flat
    buffers of each TP/PP shard and model chunk: it reloads under any data-parallel size, but
    only with the TP, PP and virtual pipeline sizes it was saved with. The plain optimizer's state is per parameter and
    reshards like the weights. Megatron-FSDP's reloads at any data x context parallel size but
    only at its TP size (:func:`_check_fsdp_optimizer_layout`). The two formats do not load
    into each other.
    """
    saved = common.get("optimizer_layout")
    now = optimizer_layout(optimizer)
    _check_moment_dtypes(root, saved or {}, now)
    if saved is None:  # written before the layout was recorded
        return
    fresh = (
        "or pass --no-load-optim to load the weights, iteration and schedule with a fresh optimizer"
    )
    if saved.get("format", TORCH_DIST) != now["format"]:
        which = "with" if now["format"] == TORCH_DIST else "without"
        raise ValueError(
            f"--load {root}: its optimizer state is {saved.get('format', TORCH_DIST)}, saved {which} "
            f"--use-megatron-fsdp, and does not load into this run's {now['format']} optimizer: resume "
            f"{which} --use-megatron-fsdp, or pass --no-load-optim (or --finetune) to load its weights only"
        )
    if now["format"] == fsdp_checkpoint.FORMAT:
        _check_fsdp_optimizer_layout(root, saved, now)
        return
    if saved["distributed"] != now["distributed"]:
        which = "with" if saved["distributed"] else "without"
        raise ValueError(
            f"--load {root}: its optimizer state was saved {which} --use-distributed-optimizer; "
            f"resume {which} it, {fresh}"
        )
    if now["distributed"]:
        for name in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "virtual_pipeline_model_parallel_size",
        ):
            was = saved.get(name, 1)  # checkpoints before the interleaved schedule: 1
            if was != now[name]:
                flag = "--" + name.replace("_", "-")
                raise ValueError(
                    f"--load {root}: its distributed-optimizer state was saved at {flag} {was} and reloads "
                    f"under any data-parallel size but only at that {flag} (this run: {now[name]}); "
                    f"pass {flag} {was}, {fresh}"
                )


def _check_fsdp_optimizer_layout(root: str, saved: dict, now: dict) -> None:
    """Megatron-FSDP's optimizer state reloads at any data x context parallel size but only at
    the TP size it was saved with.

    Each DTensor (weight, Adam's moments) is stored whole, its rows cut unevenly over the
    saving ranks with the offsets :func:`fsdp_checkpoint.attach_chunks` records, so DCP reads
    any other cut from them: DP2 -> DP4, DP4 -> DP2, DP2 -> DP1 x CP2 (and DP1 on megatron-core
    0.19) resume with the saved state bit for bit and the uninterrupted run's loss and grad
    norm (``tests/training/test_fsdp_checkpoint.py``). Another TP size is refused: the same
    key holds the TP shards side by side (``make_fsdp_dtensor``; SwiGLU's fc1 is each TP
    rank's gate and up halves in turn), so DCP loads it without an error into rows that mean
    something else (TP1 x DP2 -> TP2 x DP1 by hand on 0.19.2: iteration 3's loss 6.1653, the
    uninterrupted run's 6.1513)."""
    was, tp = saved.get("tensor_model_parallel_size"), now["tensor_model_parallel_size"]
    if was != tp:
        raise ValueError(
            f"--load {root}: FSDP optimizer state reloads at any data x context parallel size but only at "
            f"--tensor-model-parallel-size {was} (this run: {tp}): resume at that TP size; to change it, "
            "start a fresh optimizer from its weights: load them into a run without --use-megatron-fsdp at "
            f"--tensor-model-parallel-size {was} with --no-load-optim, whose save (torch_dist) a "
            "--use-megatron-fsdp run at any TP size loads with --finetune or --no-load-optim"
        )


def _model_keys(model_chunks: list) -> list[str]:
    """Megatron-LM's keys of the chunks' states: ``model``, or ``model0``, ``model1``, ... with
    the interleaved schedule (the tensors inside carry global layer numbers either way)."""
    if len(model_chunks) == 1:
        return ["model"]
    return [f"model{index}" for index in range(len(model_chunks))]


def _load_chunk_states(model_chunks: list, loaded: dict) -> None:
    for key, chunk in zip(_model_keys(model_chunks), model_chunks):
        _unwrap(chunk).load_state_dict(loaded[key])


def _sharded_state(model_chunks: list, optimizer, scheduler, is_loading: bool) -> dict:
    """The sharded part: the model chunks, and optimizer + scheduler unless ``optimizer`` is None."""
    model_state = {
        key: _unwrap(chunk).sharded_state_dict()
        for key, chunk in zip(_model_keys(model_chunks), model_chunks)
    }
    if optimizer is None:
        return model_state
    return {
        **model_state,
        # The distributed optimizer's 'dp_reshardable' format: megatron 0.16's default format is
        # refused by its own dist_checkpointing, and 'fully_reshardable' cannot load without
        # apex/TE (it drops torch Adam's per-parameter 'step'). So a distributed-optimizer
        # run resumes with any DP size but the same TP/PP; the plain optimizer reshards freely.
        "optimizer": optimizer.sharded_state_dict(
            model_state,
            is_loading=is_loading,
            metadata={"distrib_optim_sharding_type": "dp_reshardable"},
        ),
        "scheduler": scheduler.state_dict(),
    }


def _materialise_optimizer_state(optimizer) -> None:
    """Give a fresh distributed optimizer its Adam state before loading into it.

    Its state dict needs the per-parameter state (and its ``step``), which torch's Adam only
    creates at the first step; megatron's own helper takes one zero-gradient step, whose
    values the load then overwrites in place (the scheduler's lr is 0 before warm-up, so
    the parameters do not move).
    """
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        if hasattr(inner, "_init_optimizer_states_with_dummy_values") and not inner.optimizer.state:
            inner._init_optimizer_states_with_dummy_values()


def _restore_adam_steps(optimizer, loaded_state: dict) -> None:
    """Set each parameter's torch-Adam ``step`` from the checkpoint, as its own tensor.

    Without apex/TE, megatron 0.16's distributed optimizer saves the step count in its param
    groups but does not put it back into torch Adam's per-parameter state on load (and where
    it does, one tensor is shared by every parameter, which torch then advances once per
    parameter): either way Adam's bias correction after a resume would be wrong.
    """
    inners = getattr(optimizer, "chained_optimizers", [optimizer])
    states = [loaded_state] if len(inners) == 1 else [loaded_state[i] for i in range(len(inners))]
    for inner, state in zip(inners, states):
        groups = (
            state.get("optimizer", {}).get("param_groups", []) if isinstance(state, dict) else []
        )
        steps = {group["step"] for group in groups if "step" in group}
        if not hasattr(inner, "_init_optimizer_states_with_dummy_values") or len(steps) != 1:
            continue  # the plain optimizer restores torch's own state dict, steps included
        step = float(steps.pop())
        for param_state in inner.optimizer.state.values():
            param_state["step"] = torch.tensor(step)


def _unwrap(model):
    return getattr(model, "module", model)


def _gpt_model(model):
    """The GPTModel inside megatron's wrappers (``DistributedDataParallel.module``;
    ``FullyShardedDataParallel.module`` is ``MegatronFSDP``, whose ``module`` it is)."""
    while hasattr(model, "module"):
        model = model.module
    return model


def write_marker(root: str, iteration: int) -> None:
    tmp = os.path.join(root, MARKER + ".tmp")
    with open(tmp, "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, MARKER))
    _fsync_directory(root)


def _fsync_directory(path: str) -> None:
    """Make a rename inside ``path`` durable (POSIX: the directory entry is data too)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save_failure(root: str, iteration: int, error: BaseException) -> str:
    """The message for a failed save: the cause (ENOSPC said plainly) and what is still safe."""
    cause = _os_error(error)
    free = shutil.disk_usage(root).free
    # torch's C++ file writer (torch.save to a path) reports a full disk without an errno
    full = (cause is not None and cause.errno == errno.ENOSPC) or free < _FULL_DISK_BYTES
    if full:
        reason = f"No space left on device ({free:,} bytes free on the filesystem of --save)"
    elif cause is not None:
        reason = f"{cause.strerror} ({cause.filename or 'a checkpoint file'})"
    else:
        reason = f"{type(error).__name__}: {error}"
    previous = _marker_iteration(root)
    kept = (
        f"the checkpoint of iteration {previous} is intact"
        if previous is not None
        else "no earlier checkpoint exists"
    )
    advice = "free space on the disk of --save, then" if full else "then"
    return (
        f"saving iteration {iteration} to {checkpoint_dir(root, iteration)} failed: {str(reason)[:500]}; "
        f"its partial files were removed and {kept}; {advice} resume with --load {root}"
    )


_FULL_DISK_BYTES = 1 << 20  # less free than this after a failed save: the disk is full


def _os_error(error: BaseException) -> Optional[OSError]:
    """The OSError behind ``error``: its cause chain, or one of DCP's per-rank failures."""
    seen = set()
    stack = [error]
    while stack:
        current = stack.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno is not None:
            return current
        stack.extend([current.__cause__, current.__context__])
        failures = current.failures if isinstance(getattr(current, "failures", None), dict) else {}
        stack.extend(
            failure[0] if isinstance(failure, tuple) else failure for failure in failures.values()
        )
    return None


def _rng_state() -> dict:
    from megatron.core import tensor_parallel

    from mcore_flash import platform

    algorithm, key, position, has_gauss, cached_gaussian = numpy.random.get_state()
    state = {
        "python": random.getstate(),
        # numpy's state as tensors and numbers: the file loads with weights_only=True
        "numpy": (
            algorithm,
            torch.from_numpy(key.astype(numpy.int64)),
            position,
            has_gauss,
            cached_gaussian,
        ),
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if platform.device_type() != "cpu":
        state["device"] = getattr(torch, platform.device_type()).get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    from mcore_flash import platform

    random.setstate(state["python"])
    algorithm, key, *rest = state["numpy"]
    numpy.random.set_state((algorithm, numpy.asarray(key, dtype=numpy.uint32), *rest))
    torch.set_rng_state(state["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    if "device" in state:
        getattr(torch, platform.device_type()).set_rng_state(state["device"])

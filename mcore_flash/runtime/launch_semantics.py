"""Our own flags read as Megatron-LM reads them, where a launch line relies on it.

:func:`megatron_semantics` resolves the values of our flags that a Megatron-LM or
MindSpeed-LLM launch line gives with their meaning there: Megatron-LM's ``--attention-backend``
kernels and ``--ckpt-format torch`` (refused, with the equivalent), MindSpeed-LLM's
``--tokenizer-type PretrainedFromHF`` (with ``--tokenizer-name-or-path``),
``--sequence-parallel`` at TP 1 and ``--eval-iters 0`` (off, as Megatron-LM turns them off),
and a ``--split`` that kept the launch script's quotes (Megatron-LM reads only its numbers).
Pure Python.
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple, Optional

from mcore_flash.checkpoint.directory import FSDP_DTENSOR, TORCH_DIST
from mcore_flash.runtime.config_checks import CKPT_FORMATS

ATTENTION_BACKENDS = ("npu", "cuda", "cpu", "reference")  # ours: the fused kernel's implementation
# Megatron-LM's --attention-backend: its choice among Transformer Engine's and its own kernels
MEGATRON_ATTENTION_BACKENDS = ("flash", "fused", "unfused", "local", "auto")


class Resolved(NamedTuple):
    """:func:`megatron_semantics`' result: ``updates`` to our flags, ``notes`` to say once,
    ``refusals`` as ``[(flag, message)]``."""

    updates: dict
    notes: list
    refusals: list


def megatron_semantics(flags: Mapping[str, Any]) -> Resolved:
    """Our flags' values in ``flags`` (launch-line aliases applied) with Megatron-LM's meaning
    where it differs from a plain reading; see the module docstring."""
    updates, notes, refusals = {}, [], []
    for flag, check in (
        ("--attention-backend", _attention_backend),
        ("--ckpt-format", _ckpt_format),
        ("--tokenizer-type", _tokenizer_type),
    ):
        message = check(flags)
        if message:
            refusals.append((flag, message))
    if flags.get("cp_comm_type") is None:
        updates["cp_comm_type"] = "p2p"  # ring, the default (--context-parallel-algo may set it)
    split = flags.get("split")
    if isinstance(split, str) and split.strip("'\"") != split:
        updates["split"] = split.strip("'\"")
        notes.append(
            f"--split {split} is read as {updates['split']}: the quotes came through the launch "
            "script as characters (Megatron-LM reads only the numbers)"
        )
    if flags.get("sequence_parallel") and (flags.get("tensor_model_parallel_size") or 1) == 1:
        updates["sequence_parallel"] = False
        notes.append(
            "--sequence-parallel at --tensor-model-parallel-size 1 is turned off, as Megatron-LM "
            "turns it off (nothing to split without tensor parallelism)"
        )
    if flags.get("eval_iters") == 0 and flags.get("eval_interval") is not None:
        updates["eval_interval"] = None
        notes.append(
            f"--eval-iters 0 turns validation off (Megatron-LM's meaning): --eval-interval "
            f"{flags['eval_interval']} does nothing"
        )
    return Resolved(updates, notes, refusals)


def _attention_backend(flags: Mapping[str, Any]) -> Optional[str]:
    value = flags.get("attention_backend")
    if value is None or value in ATTENTION_BACKENDS:
        return None
    if value in MEGATRON_ATTENTION_BACKENDS:
        return (
            f"--attention-backend {value} (Megatron-LM's choice among Transformer Engine's and its "
            "own attention kernels): here attention is always the fused flash kernel, and "
            f"--attention-backend picks its implementation ({', '.join(ATTENTION_BACKENDS)}; "
            "default: by device): drop it"
        )
    return f"--attention-backend {value}: choose one of {', '.join(ATTENTION_BACKENDS)} (default: by device)"


def _ckpt_format(flags: Mapping[str, Any]) -> Optional[str]:
    value = flags.get("ckpt_format")
    if value is None or value in CKPT_FORMATS:
        return None
    if value == "torch":
        return (
            "--ckpt-format torch (Megatron-LM's legacy format, one file per rank) is neither "
            f"written nor read here: drop it ({TORCH_DIST}, the default) and bring Hugging Face "
            "weights in with `mcore-flash convert hf-to-mcore`"
        )
    return f"--ckpt-format {value}: choose {' or '.join(CKPT_FORMATS)} (default: {TORCH_DIST}; {FSDP_DTENSOR} with --use-megatron-fsdp)"


def _tokenizer_type(flags: Mapping[str, Any]) -> Optional[str]:
    if flags.get("tokenizer_type") != "PretrainedFromHF":
        return None
    return (
        "--tokenizer-type PretrainedFromHF (MindSpeed-LLM's) needs --tokenizer-name-or-path DIR, "
        "the directory holding tokenizer.json (or give --tokenizer-type HuggingFaceTokenizer "
        "--tokenizer-model DIR)"
    )

"""Megatron-LM's and MindSpeed-LLM's GPT launch-line flags that are not ``mcore-flash pretrain``'s own.

A training engineer's launch line (Megatron-LM's ``examples/llama/*.sh``, MindSpeed-LLM's
``examples/mcore/llama*/pretrain_*.sh``) is taken as written. Each flag of theirs that the
trainer does not define itself is registered here (:func:`add_launch_flags`) and resolved once
(:func:`resolve_launch_flags`) into one of three outcomes:

* **alias**: it asks for something the trainer does under another name: it sets our flag
  (``--use-rotary-position-embeddings`` -> ``--position-embedding-type rope``,
  ``--train-samples`` -> ``--train-iters``); reported once, saying what it became;
* **unchanged**: what it asks for happens here anyway, or it changes no result (a fusion the
  flash spec always uses, ``--distributed-backend nccl`` where the device picks the backend):
  accepted and reported once;
* **refused**: the reason and the equivalent, by name, before anything is built
  (:class:`LaunchFlagsRefused`, every refused flag of the line at once).

Some flags decide by their value or by the other flags (``--rotary-percent 1.0`` is unchanged,
0.5 refused). :func:`resolve_launch_flags` also gives our own flags the meaning Megatron-LM
gives them where a launch line relies on it (Megatron-LM's values of ``--attention-backend``,
``--ckpt-format`` and ``--tokenizer-type``; ``--sequence-parallel`` at TP 1; ``--eval-iters
0``; a ``--split`` with the script's quotes). docs/launch-scripts.md tables what happens to
each flag of the public scripts. Pure Python.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

from mcore_flash.runtime import launch_rules as rules
from mcore_flash.runtime.launch_rules import MEGATRON_ADAM_EPS, Outcome, refused, unchanged
from mcore_flash.runtime.launch_semantics import megatron_semantics

MEGATRON, MINDSPEED, BOTH = "Megatron-LM", "MindSpeed-LLM", "Megatron-LM and MindSpeed-LLM"
# megatron-core's Llama-3.1 RoPE scaling (``--use-rope-scaling``) fixes these
LLAMA3_SCALING = {
    "--low-freq-factor": 1.0,
    "--high-freq-factor": 4.0,
    "--original-max-position-embeddings": 8192.0,
}
FP8 = (
    "fp8 training needs Transformer Engine, which this trainer does not use (it has no Ascend "
    "build; the flash spec is built from megatron-core's local modules): train with --bf16"
)
PROFILE = "no profiler is wired here (Megatron-LM's torch / nsys profiler ranges): drop it"
CONVERT = (
    "MindSpeed-LLM's conversion of a Hugging Face checkpoint at start-up: convert it once with "
    "`mcore-flash convert hf-to-mcore --hf-dir HF --save DIR` and --load DIR"
)


@dataclass(frozen=True)
class LaunchFlag:
    """A flag of ``source``'s launch lines. ``kind``: "alias", "unchanged", "refused" or
    "depends" (on its value or the other flags: ``rule`` decides); ``text``: what happens here
    (the reason and the equivalent for a refusal; shown by ``--help``); ``type``: its value's
    argparse type (None: a switch); ``rule(value, flags) -> Outcome`` for alias and depends."""

    source: str
    kind: str
    text: str
    type: Optional[Callable] = None
    rule: Optional[Callable[[Any, Mapping[str, Any]], Outcome]] = field(default=None, repr=False)

    def outcome(self, value: Any, flags: Mapping[str, Any]) -> Outcome:
        if self.kind == "unchanged":
            return unchanged(self.text)
        if self.kind == "refused":
            return refused(self.text)
        return self.rule(value, flags)


class LaunchFlagsRefused(ValueError):
    """Flags of a launch line refused here: ``refusals`` is ``[(flag, message)]``, each message
    naming the flag (and its value), why, and the equivalent."""

    def __init__(self, refusals: Sequence[tuple[str, str]]):
        self.refusals = list(refusals)
        count = len(self.refusals)
        head = "this flag is" if count == 1 else f"these {count} flags are"
        lines = "".join(f"\n  {message}" for _, message in self.refusals)
        super().__init__(f"{head} refused here (docs/launch-scripts.md):{lines}")

    def in_order(self, argv: Sequence[str]) -> LaunchFlagsRefused:
        """The same refusals in the order their flags first appear in ``argv``."""
        first: dict[str, int] = {}
        for position, token in enumerate(argv):
            first.setdefault(token.split("=", 1)[0], position)
        return LaunchFlagsRefused(
            sorted(self.refusals, key=lambda item: first.get(item[0], len(argv)))
        )


LAUNCH_FLAGS: dict[str, LaunchFlag] = {
    # --- model
    "--use-mcore-models": LaunchFlag(
        BOTH, "unchanged", "megatron-core's GPTModel is the only kind here"
    ),
    "--transformer-impl": LaunchFlag(
        BOTH,
        "depends",
        "local: unchanged (the flash spec is megatron-core's local modules); "
        "transformer_engine: refused",
        str,
        rules.transformer_impl,
    ),
    "--use-flash-attn": LaunchFlag(BOTH, "unchanged", "the fused flash attention always runs here"),
    "--use-rotary-position-embeddings": LaunchFlag(
        MINDSPEED,
        "alias",
        "--position-embedding-type rope",
        None,
        rules.use_rotary_position_embeddings,
    ),
    "--rotary-percent": LaunchFlag(
        MEGATRON,
        "depends",
        "1.0: unchanged (every head dimension rotates); below 1: refused",
        float,
        rules.rotary_percent,
    ),
    "--rope-scaling-type": LaunchFlag(
        MINDSPEED,
        "depends",
        "llama3: --use-rope-scaling; others refused",
        str,
        rules.rope_scaling_type,
    ),
    **{
        flag: LaunchFlag(
            MINDSPEED,
            "depends",
            f"{expected:g}: unchanged (Llama-3.1's, which megatron-core's "
            "scaling fixes); other values refused",
            float,
            rules.equal_or_refused(
                expected,
                f"Llama-3.1's {expected:g}, which megatron-core's --use-rope-scaling fixes",
                "{value:g}: megatron-core's Llama-3.1 scaling fixes it at {expected:g}; drop it",
            ),
        )
        for flag, expected in LLAMA3_SCALING.items()
    },
    "--init-method-std": LaunchFlag(
        BOTH,
        "depends",
        "0.02, or any value when the weights come from --load (--finetune, "
        "--no-load-optim): unchanged; otherwise refused (not wired yet)",
        float,
        rules.init_method_std,
    ),
    "--apply-layernorm-1p": LaunchFlag(
        MEGATRON,
        "refused",
        "zero-centred norm weights (weight + 1) are not built by the flash spec's norms: drop it",
    ),
    "--padded-vocab-size": LaunchFlag(
        MINDSPEED,
        "refused",
        "the padded vocabulary is the tokenizer's rounded up to "
        "--make-vocab-size-divisible-by x TP (Megatron-LM's rule; the run prints it): drop it "
        "(with --make-vocab-size-divisible-by 1 it is the tokenizer's size rounded up to TP)",
        int,
    ),
    # --- fusions and kernels that change no result here
    "--use-fused-rmsnorm": LaunchFlag(
        MINDSPEED, "unchanged", "RMSNorm always runs fused (npu_rms_norm on an NPU)"
    ),
    "--use-fused-swiglu": LaunchFlag(
        MINDSPEED, "unchanged", "SwiGLU always runs fused with --swiglu (npu_swiglu on an NPU)"
    ),
    "--use-fused-rotary-pos-emb": LaunchFlag(
        MINDSPEED,
        "unchanged",
        "RoPE runs megatron-core's unfused code (the same numbers; the "
        "fused kernel needs Transformer Engine or apex)",
    ),
    "--no-masked-softmax-fusion": LaunchFlag(
        BOTH, "unchanged", "no masked softmax runs: the fused attention kernel replaces it"
    ),
    "--attention-softmax-in-fp32": LaunchFlag(
        BOTH, "unchanged", "the fused attention kernel computes its softmax in fp32"
    ),
    "--no-rope-fusion": LaunchFlag(MEGATRON, "unchanged", "RoPE runs unfused here anyway"),
    "--no-bias-swiglu-fusion": LaunchFlag(
        MEGATRON, "unchanged", "a fusion switch: the SwiGLU numbers are the same"
    ),
    "--no-bias-dropout-fusion": LaunchFlag(
        MEGATRON, "unchanged", "a fusion switch: the bias-dropout-add numbers are the same"
    ),
    "--cross-entropy-loss-fusion": LaunchFlag(
        MEGATRON,
        "unchanged",
        "the loss is megatron-core's vocab-parallel cross entropy, unfused (the same numbers)",
    ),
    "--sparse-mode": LaunchFlag(
        MINDSPEED,
        "depends",
        "0, 2, 3 (causal): unchanged; band and prefix modes refused",
        int,
        rules.sparse_mode,
    ),
    # --- parallelism
    "--context-parallel-algo": LaunchFlag(
        MINDSPEED,
        "depends",
        "megatron_cp_algo: --cp-comm-type p2p (ring); ulysses_cp_algo: "
        "--cp-comm-type a2a; others refused",
        str,
        rules.context_parallel_algo,
    ),
    "--num-layer-list": LaunchFlag(
        MINDSPEED,
        "depends",
        "an even split: unchanged; uneven stages refused",
        str,
        rules.num_layer_list,
    ),
    "--distributed-backend": LaunchFlag(
        BOTH,
        "depends",
        "nccl, hccl: unchanged (the device picks HCCL, NCCL or gloo); gloo refused",
        str,
        rules.distributed_backend,
    ),
    "--no-shared-storage": LaunchFlag(
        MINDSPEED,
        "refused",
        "the data index caches are built by global rank 0 and read by every "
        "rank, which needs --data-cache-path on storage every node sees: drop it and give such a "
        "--data-cache-path",
    ),
    # --- precision, optimiser and schedule
    "--train-samples": LaunchFlag(
        MEGATRON, "alias", "--train-iters (samples / --global-batch-size)", int, rules.train_samples
    ),
    "--lr-warmup-samples": LaunchFlag(
        MEGATRON,
        "alias",
        "--lr-warmup-iters (samples / --global-batch-size, rounded)",
        int,
        rules.lr_warmup_samples,
    ),
    "--lr-warmup-fraction": LaunchFlag(
        BOTH,
        "alias",
        "--lr-warmup-iters (fraction x the iterations, rounded)",
        float,
        rules.lr_warmup_fraction,
    ),
    "--lr-decay-samples": LaunchFlag(
        MEGATRON,
        "depends",
        "equal to --train-samples: unchanged; other lengths refused",
        int,
        rules.decay_length("--lr-decay-samples", "samples", "train_samples"),
    ),
    "--lr-decay-iters": LaunchFlag(
        MEGATRON,
        "depends",
        "equal to --train-iters: unchanged; other lengths refused",
        int,
        rules.decay_length("--lr-decay-iters", "iterations", "train_iters"),
    ),
    "--decoupled-lr": LaunchFlag(
        MEGATRON,
        "refused",
        "a separate learning rate for the embedding and output layer is not "
        "built here (one --lr for every parameter): drop it",
        float,
    ),
    "--decoupled-min-lr": LaunchFlag(
        MEGATRON,
        "refused",
        "a separate learning rate for the embedding and output layer is not "
        "built here (one --min-lr for every parameter): drop it",
        float,
    ),
    "--adam-eps": LaunchFlag(
        BOTH,
        "depends",
        "1e-8: unchanged; other values refused (not wired yet)",
        float,
        rules.equal_or_refused(
            MEGATRON_ADAM_EPS,
            "megatron-core's default 1e-8, which Adam uses here",
            "{value:g}: Adam's epsilon is megatron-core's default {expected:g} here (not a flag "
            "yet): drop it",
        ),
    ),
    "--initial-loss-scale": LaunchFlag(
        BOTH,
        "depends",
        "without --fp16, or 2^32: unchanged; other fp16 scales refused",
        float,
        rules.initial_loss_scale,
    ),
    "--recompute-activations": LaunchFlag(
        MEGATRON, "alias", "--recompute-granularity selective", None, rules.recompute_activations
    ),
    "--calculate-per-token-loss": LaunchFlag(
        MEGATRON, "unchanged", "the loss is always averaged per token here"
    ),
    "--fp8-format": LaunchFlag(MEGATRON, "refused", FP8, str),
    "--fp8-recipe": LaunchFlag(MEGATRON, "refused", FP8, str),
    "--fp8-amax-history-len": LaunchFlag(MEGATRON, "refused", FP8, int),
    "--fp8-amax-compute-algo": LaunchFlag(MEGATRON, "refused", FP8, str),
    "--fp8-param-gather": LaunchFlag(MEGATRON, "refused", FP8),
    # --- data and tokenizer
    "--tokenizer-name-or-path": LaunchFlag(
        MINDSPEED,
        "alias",
        "with --tokenizer-type PretrainedFromHF: --tokenizer-type "
        "HuggingFaceTokenizer --tokenizer-model DIR",
        str,
        rules.tokenizer_name_or_path,
    ),
    "--vocab-size": LaunchFlag(
        MEGATRON,
        "depends",
        "unchanged (the tokenizer's vocabulary); refused with NullTokenizer",
        int,
        rules.vocab_size,
    ),
    "--vocab-file": LaunchFlag(
        MEGATRON,
        "refused",
        "GPT2BPETokenizer's file; that tokenizer type is not implemented "
        "here: give its tokenizer.json with --tokenizer-type HuggingFaceTokenizer "
        "--tokenizer-model",
        str,
    ),
    "--merge-file": LaunchFlag(
        MEGATRON,
        "refused",
        "GPT2BPETokenizer's file; that tokenizer type is not implemented "
        "here: give its tokenizer.json with --tokenizer-type HuggingFaceTokenizer "
        "--tokenizer-model",
        str,
    ),
    "--no-create-attention-mask-in-dataloader": LaunchFlag(
        BOTH, "unchanged", "no attention mask is ever built: the fused kernel masks causally itself"
    ),
    "--no-mmap-bin-files": LaunchFlag(
        MEGATRON, "unchanged", "how the .bin files are read, not what is read"
    ),
    "--num-workers": LaunchFlag(
        MEGATRON,
        "unchanged",
        "batches are read in the training process (no DataLoader workers); the same batches",
        int,
    ),
    "--handler-name": LaunchFlag(
        MINDSPEED,
        "unchanged",
        "a flag of MindSpeed-LLM's preprocess_data.py; training reads "
        "the .bin/.idx files as they are",
        str,
    ),
    "--enable-hf2mg-convert": LaunchFlag(MINDSPEED, "refused", CONVERT),
    "--model-type-hf": LaunchFlag(MINDSPEED, "refused", CONVERT, str),
    # --- logging and memory
    "--log-throughput": LaunchFlag(
        MEGATRON, "unchanged", "tokens/s and TFLOP/s per device are always logged"
    ),
    "--manual-gc": LaunchFlag(
        MEGATRON,
        "unchanged",
        "Python's garbage collector runs on its own schedule (when it "
        "pauses, not what is computed)",
    ),
    "--empty-unused-memory-level": LaunchFlag(
        MEGATRON,
        "unchanged",
        "the allocator's cache is not emptied within the step (memory fragmentation, not results)",
        int,
    ),
    "--profile": LaunchFlag(MEGATRON, "refused", PROFILE),
    "--profile-step-start": LaunchFlag(MEGATRON, "refused", PROFILE, int),
    "--profile-step-end": LaunchFlag(MEGATRON, "refused", PROFILE, int),
    "--profile-ranks": LaunchFlag(MEGATRON, "refused", PROFILE, str),
}


_KIND_HELP = {
    "alias": "here: ",
    "unchanged": "accepted, changes nothing here: ",
    "refused": "refused: ",
    "depends": "",
}


def add_launch_flags(parser: argparse.ArgumentParser) -> None:
    """Register :data:`LAUNCH_FLAGS` in their own ``--help`` group (each help says what
    happens to the flag here); their values reach :func:`resolve_launch_flags`."""
    group = parser.add_argument_group(
        "Megatron-LM and MindSpeed-LLM launch-line flags (docs/launch-scripts.md)"
    )
    for flag, spec in LAUNCH_FLAGS.items():
        text = f"{spec.source} flag; {_KIND_HELP[spec.kind]}{spec.text}".replace("%", "%%")
        if spec.type is None:
            group.add_argument(flag, action="store_true", default=None, help=text)
        else:
            group.add_argument(flag, type=spec.type, default=None, help=text)


def resolve_launch_flags(flags: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``(our flags to set, notes)`` for the launch-line flags in ``flags`` (the parsed
    namespace as a dict); each note says once what an alias became or why a flag changes
    nothing here. Raises :class:`LaunchFlagsRefused` naming every refused flag."""
    updates, notes, refusals = {}, [], []
    for flag, spec in LAUNCH_FLAGS.items():
        value = flags.get(flag[2:].replace("-", "_"))
        if value is None:
            continue
        shown = flag if spec.type is None else f"{flag} {value}"
        outcome = spec.outcome(value, flags)
        if outcome.refusal:
            refusals.append((flag, f"{shown} (a {spec.source} flag): {outcome.refusal}"))
            continue
        updates.update(outcome.updates)
        what = "means" if outcome.updates else "accepted, changes nothing here"
        notes.append(f"{shown} (a {spec.source} flag) {what}: {outcome.note}")
    ours = megatron_semantics({**flags, **updates})
    refusals += ours.refusals
    if refusals:
        raise LaunchFlagsRefused(refusals)
    return {**updates, **ours.updates}, notes + ours.notes

"""``mcore-flash evaluate``: did the context extension work?

Provides :func:`main` (the CLI), :func:`resolve` (the flags as an :class:`EvaluateConfig`:
evaluate's own flags, frozen, defaults resolved and checked, plus ``run``, the trainer's
:class:`~mcore_flash.runtime.config.TrainingConfig`), :func:`evaluate` (one task's JSON-ready
result, the same on every rank) and :func:`format_table`. The model is built as
``mcore-flash pretrain`` builds it (its flags; those left out come from the checkpoint, as
with ``--use-checkpoint-args``) and runs under ``torchrun`` with TP, PP and CP. The tasks:

* ``needle``: :mod:`mcore_flash.evaluation.needle` (haystack: held-out ``--data-path``
  documents, else the built-in digits; byte tokenizer);
* ``loss-by-position``: :mod:`mcore_flash.evaluation.loss_by_position` over held-out
  ``--seq-length`` sequences (validation split of ``--data-path``, else the built-in task);
* ``perplexity``: :mod:`mcore_flash.evaluation.perplexity` (mean loss in nats/token, its exp,
  the token count) of ``--input`` texts in transformers' sliding windows, or of the validation
  split's samples of ``--data-path`` (the trainer's validation loss).

Lengths beyond ``--max-position-embeddings`` need a RoPE extension or a raised one; bad flags
are ValueErrors naming the flag (exit status 2). The manual: docs/evaluate.md.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from dataclasses import asdict
from typing import Optional, Sequence

import numpy
import torch.distributed as dist

from mcore_flash.runtime.arguments import build_parser as build_pretrain_parser
from mcore_flash.runtime.arguments import resolve_tool_config
from mcore_flash.runtime.config import TrainingConfig

TASKS = ("needle", "loss-by-position", "perplexity")
DEFAULT_DEPTHS = "0,0.25,0.5,0.75,1"
HELD_OUT_SEED_OFFSET = (
    1  # the built-in task's held-out documents: --seed + 1 (training uses --seed)
)


def build_parser():
    p = build_pretrain_parser()
    p.prog = "mcore-flash evaluate"
    p.description = (
        "Needle retrieval by length x depth, loss by token position, or perplexity of a checkpoint."
    )
    group = p.add_argument_group("evaluation")
    group.add_argument("--task", choices=TASKS, required=True)
    group.add_argument(
        "--lengths",
        default=None,
        help="needle: context lengths, e.g. 256,512 (default --seq-length)",
    )
    group.add_argument(
        "--depths",
        default=DEFAULT_DEPTHS,
        help=f"needle: depths in [0, 1] (default {DEFAULT_DEPTHS})",
    )
    group.add_argument(
        "--needle-length",
        type=int,
        default=None,
        help="needle: key letters (default max(2, --seq-length // 16), the built-in task's)",
    )
    group.add_argument(
        "--num-samples", type=int, default=100, help="samples per cell / held-out sequences"
    )
    group.add_argument("--eval-batch-size", type=int, default=20, help="sequences per forward pass")
    group.add_argument(
        "--input",
        default=None,
        help="perplexity: a .txt file (one text) or a .jsonl file (one text a line, under --json-key)",
    )
    group.add_argument(
        "--json-key",
        default="text",
        help="perplexity: the text field of each --input .jsonl line (preprocess's --json-keys default)",
    )
    group.add_argument(
        "--stride",
        type=int,
        default=None,
        help="perplexity: tokens between window starts, 1..--seq-length (None: --seq-length, disjoint windows)",
    )
    group.add_argument("--json", action="store_true", help="print the results as one JSON object")
    group.add_argument(
        "--plot", default=None, help="write a PNG: the needle heatmap or the loss-by-position line"
    )
    p.set_defaults(use_checkpoint_args=True)
    return p


def _int_list(text: str, flag: str) -> list[int]:
    try:
        return [int(item) for item in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag} {text!r}: give comma-separated integers, e.g. 256,512") from None


def _float_list(text: str, flag: str) -> list[float]:
    try:
        return [float(item) for item in text.split(",")]
    except ValueError:
        raise ValueError(
            f"{flag} {text!r}: give comma-separated numbers, e.g. {DEFAULT_DEPTHS}"
        ) from None


@dataclasses.dataclass(frozen=True)
class EncodedTexts:
    """``--task perplexity --input``: the texts as token ids; ``bos``: a BOS was prepended."""

    documents: tuple[tuple[int, ...], ...]
    bos: bool


@dataclasses.dataclass(frozen=True)
class EvaluateConfig:
    """``mcore-flash evaluate``'s own flags (field = flag), their defaults resolved, checked on
    construction (ValueError names the flag); ``run``: the trainer's config of the model it
    loads (model, tokenizer, ``--load``, layout, ``--data-path``, ``--seq-length``, ``--seed``)."""

    run: TrainingConfig
    task: str
    lengths: tuple[int, ...]  # the context lengths scored: needle's --lengths, else --seq-length
    depths: tuple[float, ...]  # needle: the key's depths in [0, 1]
    needle_length: Optional[int]  # needle: key letters (default max(2, --seq-length // 16))
    num_samples: int
    eval_batch_size: int
    input: Optional[str]
    json_key: str
    stride: Optional[int]  # perplexity of --input: tokens between windows (default --seq-length)
    json: bool
    plot: Optional[str]
    texts: Optional[EncodedTexts] = None  # perplexity of --input: read and tokenized once

    def __post_init__(self):
        _check(self)


def resolve(argv: Optional[Sequence[str]]) -> EvaluateConfig:
    """The parsed flags as an :class:`EvaluateConfig`, their defaults resolved, the needle's
    tokenizer checked and the ``--input`` texts tokenized (ValueError names the flag)."""
    flags = build_parser().parse_args(argv)
    run = resolve_tool_config(vars(flags))
    own = {
        field.name: getattr(flags, field.name)
        for field in dataclasses.fields(EvaluateConfig)
        if field.name not in ("run", "texts")
    }
    if flags.task == "needle":
        lengths = _int_list(flags.lengths, "--lengths") if flags.lengths else [run.seq_length]
        own.update(
            lengths=tuple(lengths),
            depths=tuple(_float_list(flags.depths, "--depths")),
            needle_length=(
                max(2, run.seq_length // 16) if flags.needle_length is None else flags.needle_length
            ),
        )
    else:
        own.update(lengths=(run.seq_length,), depths=())
    if flags.task == "perplexity" and flags.input is not None and flags.stride is None:
        own.update(stride=run.seq_length)
    config = EvaluateConfig(run, **own)
    if config.task == "needle":
        _check_needle_tokenizer(config.run)
    if config.task == "perplexity" and config.input is not None:
        config = dataclasses.replace(config, texts=_encoded_texts(config))
    return config


def _check(args: EvaluateConfig) -> None:
    """The flags that cannot work together (ValueError naming the flag)."""
    from mcore_flash.evaluation.needle import check_needle_lengths

    run = args.run
    if not run.load:
        raise ValueError("--load is required: the checkpoint to evaluate")
    if args.num_samples < 1 or args.eval_batch_size < 1:
        raise ValueError(
            f"--num-samples and --eval-batch-size must be >= 1, got {args.num_samples}, {args.eval_batch_size}"
        )
    if args.task == "needle":
        check_needle_lengths(list(args.lengths), list(args.depths), args.needle_length)
    # resolved as the trainer's: "fixed" unless given, None with --data-path (given: refused)
    if run.synthetic_key_depth == "uniform" and args.task != "loss-by-position":
        raise ValueError(
            "--synthetic-key-depth places the key of the built-in documents that --task loss-by-position "
            "scores without --data-path; drop it here"
        )
    if args.task == "perplexity":
        _check_perplexity(args)
    elif args.input is not None or args.stride is not None:
        raise ValueError(
            f"--input and --stride are flags of --task perplexity, not of --task {args.task}"
        )
    extended = run.use_rope_scaling or run.rotary_seq_len_interpolation_factor
    flag = "--lengths" if args.task == "needle" else "--seq-length"
    multiple = _length_multiple(run)
    for length in args.lengths:
        if length > run.max_position_embeddings and not extended:
            raise ValueError(
                f"{flag} {length} is beyond the model's {run.max_position_embeddings} positions "
                "(--max-position-embeddings, from the checkpoint) and RoPE is not scaled: pass "
                "--use-rope-scaling --rope-scaling-factor F or --rotary-seq-len-interpolation-factor N, or "
                f"--max-position-embeddings {length} to measure unscaled extrapolation"
            )
        if length % multiple:
            raise ValueError(
                f"{flag} {length} must be divisible by {multiple} with this TP/CP/SP layout"
            )


def _check_needle_tokenizer(run: TrainingConfig) -> None:
    """The needle task writes byte-tokenizer ids: the run's tokenizer (given, else the one
    stored with the checkpoint) must be the byte-level one."""
    kind, whose = run.tokenizer_type, ""
    if kind is None and run.tokenizer_model is None:
        from mcore_flash.checkpoint.tokenizer import stored_tokenizer_record

        stored = stored_tokenizer_record(run.load)  # the tokenizer the model runner takes
        kind = stored[0].get("type") if stored else None
        whose = " (stored with the checkpoint)"
    if kind not in (None, "ByteTokenizer"):
        raise ValueError(
            f"--task needle writes its markers and key letters as byte-tokenizer ids; --tokenizer-type "
            f"{kind} is not supported by it{whose} (use --task loss-by-position)"
        )


def _length_multiple(run: TrainingConfig) -> int:
    """What every sequence length must be a multiple of with this TP/CP/SP layout."""
    cp, tp = run.context_parallel_size, run.tensor_model_parallel_size
    return math.lcm(2 * cp if cp > 1 else 1, tp * cp if run.sequence_parallel else 1)


def _check_perplexity(args: EvaluateConfig) -> None:
    """``--task perplexity``: one source (``--input`` or ``--data-path``), a stride in range."""
    run = args.run
    if (args.input is None) == (not run.data_path):
        raise ValueError(
            "--task perplexity needs one source: --input FILE (.txt or .jsonl) or --data-path PREFIX "
            "(the validation split's samples)" + (", not both" if args.input is not None else "")
        )
    if args.plot:
        raise ValueError("--plot: --task perplexity prints numbers only; drop --plot")
    if run.data_path:
        if args.stride is not None:
            raise ValueError(
                "--stride applies to --input texts; --data-path is evaluated in the trainer's "
                "--seq-length samples (drop --stride)"
            )
        return
    if not 1 <= args.stride <= run.seq_length:
        raise ValueError(
            f"--stride {args.stride} must be in [1, --seq-length {run.seq_length}]: windows of "
            "--seq-length tokens start every --stride tokens"
        )


def _encoded_texts(args: EvaluateConfig) -> EncodedTexts:
    """The ``--input`` texts read and tokenized by the run's tokenizer (the flags', else the
    checkpoint's), as transformers' tokenizer gives them."""
    from mcore_flash.evaluation.perplexity import TextEncoder, read_texts
    from mcore_flash.runtime.tokenizer import run_tokenizer

    texts = read_texts(args.input, args.json_key)
    encode = TextEncoder(run_tokenizer(args.run))
    documents = tuple(tuple(encode(text)) for text in texts)
    if all(len(ids) < 2 for ids in documents):
        raise ValueError(
            f"--input {args.input}: no token to score; a text needs at least two tokens (nothing "
            "predicts the first)"
        )
    return EncodedTexts(documents, encode.bos)


def main(argv: Optional[Sequence[str]] = None) -> int:
    from mcore_flash.runtime.distributed import destroy_distributed, init_distributed

    try:
        args = resolve(argv)
    except ValueError as error:
        print(f"mcore-flash evaluate: error: {error}", file=sys.stderr)
        return 2
    init_distributed(args.run)
    try:
        result = evaluate(args)
    except ValueError as error:
        print(f"mcore-flash evaluate: error: {error}", file=sys.stderr)
        return 2
    finally:
        destroy_distributed()
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(result) if args.json else format_table(result))
    return 0


def evaluate(args: EvaluateConfig) -> dict:
    """Run ``args.task`` on the checkpoint in ``--load``; call after ``init_distributed(args.run)``.
    Returns the JSON-ready result (the same on every rank); rank 0 writes ``--plot``."""
    from mcore_flash.evaluation.model_runner import LoadedModel

    model = LoadedModel(args.run)
    if args.task == "needle":
        result = {
            "task": "needle",
            "iteration": model.iteration,
            "needle_length": args.needle_length,
            "cells": [asdict(cell) for cell in _needle_cells(args, model)],
        }
    elif args.task == "perplexity":
        result = {"task": "perplexity", "iteration": model.iteration, **_perplexity(args, model)}
    else:
        result = {
            "task": "loss-by-position",
            "iteration": model.iteration,
            "seq_length": args.run.seq_length,
            "buckets": [asdict(b) for b in _loss_buckets(args, model)],
        }
    if args.plot and _is_first_rank():
        from mcore_flash.evaluation import plots

        if args.task == "needle":
            from mcore_flash.evaluation.needle import NeedleCell

            plots.needle_heatmap([NeedleCell(**c) for c in result["cells"]], args.plot)
        else:
            from mcore_flash.evaluation.loss_by_position import PositionBucket

            plots.loss_by_position_plot([PositionBucket(**b) for b in result["buckets"]], args.plot)
        _progress(f"wrote {args.plot}")
    return result


def _needle_cells(args: EvaluateConfig, model):
    from mcore_flash.evaluation.needle import digit_filler, needle_grid, stream_filler

    filler = (
        stream_filler(_held_out_stream(args, model.tokenizer))
        if args.run.data_path
        else digit_filler
    )
    cells = needle_grid(
        model,
        list(args.lengths),
        list(args.depths),
        args.needle_length,
        args.num_samples,
        args.eval_batch_size,
        filler,
        args.run.seed,
    )
    total = len(args.lengths) * len(args.depths)
    for done, cell in enumerate(cells, 1):
        _progress(
            f"needle {done}/{total}: length {cell.length} depth {cell.depth:g}: exact {cell.exact:.3f}, "
            f"tokens {cell.token_accuracy:.3f}"
        )
        yield cell


def _held_out_stream(args: EvaluateConfig, tokenizer) -> numpy.ndarray:
    """Tokens of the validation split of ``--data-path`` (EOD removed), one epoch, in order."""
    valid = _validation_split(args.run, tokenizer, max(args.lengths))
    tokens = numpy.concatenate(
        [numpy.asarray(valid[i]["tokens"]) for i in range(min(len(valid), 256))]
    )
    return tokens[tokens != tokenizer.eod]


def _validation_split(run: TrainingConfig, tokenizer, seq_length: int):
    from mcore_flash.data.datasets import build_datasets

    _, valid, _ = build_datasets(
        run.data_path,
        False,
        run.split,
        seq_length,
        run.seed,
        tokenizer,
        0,
        None,
        0,
        cache_dir=run.data_cache_path or os.path.join(run.load, "data", "cache"),
    )
    if valid is None or len(valid) == 0:
        raise ValueError(
            f"--split {run.split}: the held-out (validation) split of --data-path is empty; give it weight"
        )
    return valid


def _loss_buckets(args: EvaluateConfig, model):
    import torch

    from mcore_flash.evaluation.loss_by_position import loss_by_position, stack_samples

    run = args.run
    if run.data_path:
        valid = _validation_split(run, model.tokenizer, run.seq_length)
        indices = range(min(args.num_samples, len(valid)))
        samples = [valid[i] for i in indices]
    else:
        from mcore_flash.data.synthetic import generate_documents, make_task

        docs = torch.from_numpy(
            generate_documents(
                make_task(run.seq_length, key_depth=run.synthetic_key_depth),
                args.num_samples,
                seed=run.seed + HELD_OUT_SEED_OFFSET,
            )
        )
        mask = torch.ones_like(docs, dtype=torch.float32)
        mask[:, -1] = 0  # the last token's label is the next document's
        samples = [
            {"tokens": d, "labels": torch.roll(d, -1), "loss_mask": m} for d, m in zip(docs, mask)
        ]
    batches = (
        stack_samples(samples[i : i + args.eval_batch_size])
        for i in range(0, len(samples), args.eval_batch_size)
    )
    return loss_by_position(model, batches)


def _perplexity(args: EvaluateConfig, model) -> dict:
    from mcore_flash.evaluation.loss_by_position import stack_samples
    from mcore_flash.evaluation.perplexity import perplexity_of_samples, perplexity_of_texts

    run = args.run
    if args.input is not None:
        source = {
            "input": args.input,
            "seq_length": run.seq_length,
            "stride": args.stride,
            "bos": args.texts.bos,
        }
        result = perplexity_of_texts(
            model,
            [list(ids) for ids in args.texts.documents],
            run.seq_length,
            args.stride,
            _length_multiple(run),
            args.eval_batch_size,
            lambda done, total: _progress(f"perplexity: {done}/{total} windows"),
        )
    else:
        valid = _validation_split(run, model.tokenizer, run.seq_length)
        samples = [valid[i] for i in range(min(args.num_samples, len(valid)))]
        source = {
            "data_path": list(run.data_path),
            "split": run.split,
            "seq_length": run.seq_length,
        }
        batches = (
            stack_samples(samples[i : i + args.eval_batch_size])
            for i in range(0, len(samples), args.eval_batch_size)
        )
        result = perplexity_of_samples(model, batches)
    return {**source, **asdict(result)}


def format_table(result: dict) -> str:
    """The human-readable table of a result."""
    if result["task"] == "perplexity":
        if "input" in result:
            where = (
                f"{result['input']}: {result['sequences']} text(s), {result['windows']} windows of "
                f"{result['seq_length']} tokens, stride {result['stride']}, "
                + ("BOS prepended" if result["bos"] else "no BOS")
            )
        else:
            where = (
                f"--data-path validation split: {result['sequences']} samples of "
                f"{result['seq_length']} tokens"
            )
        return "\n".join(
            [
                f"perplexity {result['perplexity']:.4f}",
                f"loss {result['loss']:.6f} nats/token over {result['tokens']} tokens",
                f"({where}; checkpoint iteration {result['iteration']})",
            ]
        )
    if result["task"] == "needle":
        depths = sorted({c["depth"] for c in result["cells"]})
        lengths = sorted({c["length"] for c in result["cells"]})
        exact = {(c["length"], c["depth"]): c["exact"] for c in result["cells"]}
        samples = result["cells"][0]["samples"]
        lines = [
            f"needle retrieval (exact, {samples} samples per cell, key of {result['needle_length']} letters; "
            f"checkpoint iteration {result['iteration']})",
            "length \\ depth " + " ".join(f"{d:>6g}" for d in depths),
        ]
        lines += [f"{n:>14} " + " ".join(f"{exact[n, d]:6.3f}" for d in depths) for n in lengths]
        return "\n".join(lines)
    lines = [
        f"loss by position (nats/token; checkpoint iteration {result['iteration']})",
        f"{'positions':>17} {'tokens':>9} {'loss':>8}",
    ]
    lines += [
        f"{b['start']:>8}-{b['end'] - 1:<8} {b['tokens']:>9} {b['loss']:8.4f}"
        for b in result["buckets"]
    ]
    return "\n".join(lines)


def _is_first_rank() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _progress(text: str) -> None:
    if _is_first_rank():
        print(f"[mcore-flash evaluate] {text}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())

"""``mcore-flash generate``: greedy decoding from a checkpoint with the trainer's model.

    mcore-flash generate --load DIR (--prompt TEXT | --prompt-ids 1,2,3) --max-new-tokens N
        [--ignore-eos] [--json]

The model is built exactly as ``mcore-flash pretrain`` builds it (its flags; those left out
come from the checkpoint, as with ``--use-checkpoint-args``), so this is the first check
that a converted or extended checkpoint works. Under ``torchrun`` it runs with TP and PP
(context parallelism: 1). There is no KV cache: every step runs the whole sequence.
Generation stops, as transformers' does, after the first end-of-sequence token (included in
the output), at most ``--max-new-tokens`` tokens: the EOS ids are those of the Hugging Face
checkpoint it was converted from (:func:`end_of_sequence_ids`); ``--ignore-eos`` produces
exactly ``--max-new-tokens``. Padding rows of the vocabulary are never chosen. ``--json``
prints ``{"prompt_ids": [...], "output_ids": [...]}``. The tokenizer is the one stored with the
checkpoint unless ``--tokenizer-type``/``--tokenizer-model`` are given
(:func:`mcore_flash.training.data.run_tokenizer`); ``--prompt`` is encoded without special
tokens (no BOS), as Megatron-LM's tokenizers do.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from mcore_flash import platform
from mcore_flash.training.arguments import build_parser as build_pretrain_parser
from mcore_flash.training.arguments import parse_args


def build_parser():
    p = build_pretrain_parser()
    p.prog = "mcore-flash generate"
    p.description = "Greedy decoding from a checkpoint with the trainer's model."
    group = p.add_argument_group("generation")
    prompt = group.add_mutually_exclusive_group(required=True)
    prompt.add_argument(
        "--prompt",
        help="text, tokenized with --tokenizer-type/--tokenizer-model, else with the tokenizer "
        "stored with the checkpoint (convert hf-to-mcore copies the source's), else byte-level",
    )
    prompt.add_argument("--prompt-ids", help="comma-separated token ids, e.g. 1,2,3")
    group.add_argument("--max-new-tokens", type=int, default=32)
    group.add_argument(
        "--ignore-eos",
        action="store_true",
        help="do not stop at the checkpoint's end-of-sequence ids: produce exactly --max-new-tokens",
    )
    group.add_argument(
        "--json", action="store_true", help='print {"prompt_ids": [...], "output_ids": [...]}'
    )
    p.set_defaults(use_checkpoint_args=True)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    from mcore_flash.training.distributed import destroy_distributed, init_distributed

    try:
        args = parse_args(argv, parser=build_parser())
        if not args.load:
            raise ValueError("--load is required: the checkpoint to generate from")
        if args.context_parallel_size != 1:
            raise ValueError("generate runs with --context-parallel-size 1")
        if args.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    except ValueError as error:
        print(f"mcore-flash generate: error: {error}", file=sys.stderr)
        return 2
    init_distributed(args)
    try:
        prompt_ids, output_ids, text = generate(args)
    except ValueError as error:
        print(f"mcore-flash generate: error: {error}", file=sys.stderr)
        return 2
    finally:
        destroy_distributed()
    if int(os.environ.get("RANK", "0")) == 0:
        print(
            json.dumps({"prompt_ids": prompt_ids, "output_ids": output_ids}) if args.json else text
        )
    return 0


def generate(args) -> tuple[list[int], list[int], str]:
    """``(prompt ids, generated ids, decoded text)``; call after ``init_distributed(args)``."""
    from mcore_flash.training import checkpointing
    from mcore_flash.training.data import tokenizer_and_vocab
    from mcore_flash.training.model import build_model, model_args, transformer_config

    tokenizer, vocab = tokenizer_and_vocab(args)
    config = transformer_config(args)
    model = build_model(args, config, vocab, parallel_output=False).to(platform.torch_device())
    common = checkpointing.load_weights(
        args.load, model, vocab, model_args(args, tokenizer.vocab_size)
    )
    stop = set() if args.ignore_eos else set(end_of_sequence_ids(common))
    model.eval()
    if args.prompt_ids is not None:
        try:
            prompt = [int(token) for token in args.prompt_ids.split(",")]
        except ValueError:
            raise ValueError(
                f"--prompt-ids {args.prompt_ids!r}: give comma-separated integers, e.g. 1,2,3"
            ) from None
    else:
        prompt = list(tokenizer.tokenize(args.prompt))
    bad = [token for token in prompt if not 0 <= token < tokenizer.vocab_size]
    if not prompt or bad:
        raise ValueError(
            f"the prompt must be non-empty token ids in [0, {tokenizer.vocab_size}); got {bad or 'none'}"
        )
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(args.max_new_tokens):
            ids.append(_next_token(model, config, ids, tokenizer.vocab_size))
            if ids[-1] in stop:  # every rank has the token: all stop together
                break
    new = ids[len(prompt) :]
    return prompt, new, tokenizer.detokenize(new)


def end_of_sequence_ids(common: dict) -> list[int]:
    """The token ids that end a generation from a checkpoint with common state ``common``, as
    transformers takes them for the model it was converted from: ``eos_token_id`` (an int or a
    list) of its ``generation_config.json`` where the Hugging Face directory had one, else of
    its ``config.json``; none for a checkpoint that was not converted from Hugging Face."""
    generation = common.get("generation_config")
    source = generation if generation is not None else (common.get("hf_config") or {})
    eos = source.get("eos_token_id")
    if eos is None:
        return []
    return [int(eos)] if isinstance(eos, int) else [int(token) for token in eos]


def _next_token(model, config, ids: list[int], vocab_size: int) -> int:
    """The argmax over the real vocabulary after ``ids``, computed on the last pipeline stage
    and sent to every rank."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    device = platform.torch_device()
    tokens = torch.tensor([ids], device=device)
    positions = torch.arange(len(ids), device=device).unsqueeze(0)
    chosen = torch.zeros(1, dtype=torch.long, device=device)

    def forward_step(data_iterator, model):
        def keep_argmax(logits):  # [1, s, padded vocab]
            chosen.copy_(logits[0, -1, :vocab_size].float().argmax().reshape(1))
            return logits.sum() * 0, torch.tensor(1, dtype=torch.int), {}

        return model(tokens, positions, None), keep_argmax

    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter([None]),
        model=[model],
        num_microbatches=1,
        seq_length=len(ids),
        micro_batch_size=1,
        decoder_seq_length=len(ids),
        forward_only=True,
    )
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(
            chosen,
            parallel_state.get_pipeline_model_parallel_last_rank(),
            group=parallel_state.get_pipeline_model_parallel_group(),
        )
    return int(chosen.item())


if __name__ == "__main__":
    sys.exit(main())

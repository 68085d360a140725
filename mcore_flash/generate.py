"""``mcore-flash generate``: decoding from a checkpoint with the trainer's model.

Provides :func:`main` (the CLI), :func:`parse_generate_args` (the flags as a
:class:`GenerateConfig`: generate's own flags, frozen and checked, plus ``run``, the trainer's
:class:`~mcore_flash.runtime.config.TrainingConfig`, model flags left out taken from the
checkpoint as with ``--use-checkpoint-args``), :func:`generate` and :func:`decode`. The model
is built as ``mcore-flash pretrain`` builds it: the first check that a converted or extended
checkpoint works.

Invariants: the processes are one model replica (TP x PP = ``WORLD_SIZE``, CP 1, no sequence
parallelism); token ids are ints of the real vocabulary (padding rows are never chosen);
every rank gets the same tokens (the last pipeline stage's first TP rank's); one ``--seed``
gives one output on any device and layout (:class:`Sampling`); generation ends after the
first end-of-sequence id (:func:`end_of_sequence_ids`) or at ``--max-new-tokens``. Answers to
megatron-core's static-batching KV cache (``StaticInferenceContext``, as its static inference
engine uses it: :func:`_cached_steps`), to transformers' ``generate`` (sampling order,
stopping) and chat templates (:mod:`mcore_flash.data.chat_template`), and to Megatron-LM's
flag names. The manual (flags, KV cache, sampling, ``--chat``, layout, stopping, tokenizer):
docs/conversion.md, section "``generate``".
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from mcore_flash import compat, platform
from mcore_flash.runtime.arguments import build_parser as build_pretrain_parser
from mcore_flash.runtime.arguments import resolve_tool_config
from mcore_flash.runtime.config import TrainingConfig


def build_parser():
    p = build_pretrain_parser()
    p.prog = "mcore-flash generate"
    p.description = (
        "Decoding (KV cache; greedy or sampled) from a checkpoint with the trainer's model."
    )
    group = p.add_argument_group("generation")
    prompt = group.add_mutually_exclusive_group(required=True)
    prompt.add_argument(
        "--prompt",
        help="text, tokenized with --tokenizer-type/--tokenizer-model, else with the tokenizer "
        "stored with the checkpoint (convert hf-to-mcore copies the source's), else byte-level",
    )
    prompt.add_argument("--prompt-ids", help="comma-separated token ids, e.g. 1,2,3")
    group.add_argument(
        "--chat",
        action="store_true",
        help="put --prompt in the tokenizer's chat template as one user message, followed by the "
        "assistant's header",
    )
    group.add_argument("--max-new-tokens", type=int, default=32)
    group.add_argument(
        "--ignore-eos",
        action="store_true",
        help="do not stop at the checkpoint's end-of-sequence ids: produce exactly --max-new-tokens",
    )
    group.add_argument(
        "--no-kv-cache",
        action="store_true",
        help="run the whole sequence every step instead of megatron's KV cache (slow; the cache's oracle)",
    )
    group.add_argument(
        "--json", action="store_true", help='print {"prompt_ids": [...], "output_ids": [...]}'
    )
    sampling = p.add_argument_group("sampling (--seed seeds the draws)")
    sampling.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sample from softmax(logits / T); the default 0 is greedy decoding",
    )
    sampling.add_argument(
        "--top-k", "--top_k", type=int, help="sample among the K most probable tokens only"
    )
    sampling.add_argument(
        "--top-p",
        "--top_p",
        type=float,
        help="sample among the fewest most probable tokens whose probability reaches P (0 < P <= 1)",
    )
    p.set_defaults(use_checkpoint_args=True)
    return p


@dataclasses.dataclass(frozen=True)
class GenerateConfig:
    """``mcore-flash generate``'s own flags (field = flag), checked on construction (ValueError
    names the flag), and ``run``: the trainer's config of the model it loads (model, tokenizer,
    ``--load``, layout, ``--seed``)."""

    run: TrainingConfig
    prompt: Optional[str]
    prompt_ids: Optional[str]  # comma-separated token ids
    chat: bool
    max_new_tokens: int
    ignore_eos: bool
    no_kv_cache: bool
    json: bool
    temperature: float
    top_k: Optional[int]
    top_p: Optional[float]

    def __post_init__(self):
        _check_generation_flags(self)


def main(argv: Optional[Sequence[str]] = None) -> int:
    from mcore_flash.runtime.distributed import destroy_distributed, init_distributed

    try:
        args = parse_generate_args(argv)
    except ValueError as error:
        return _error(error)
    init_distributed(args.run)
    try:
        prompt_ids, output_ids, text = generate(args)
    except ValueError as error:
        return _error(error)
    finally:
        destroy_distributed()
    if int(os.environ.get("RANK", "0")) == 0:
        print(
            json.dumps({"prompt_ids": prompt_ids, "output_ids": output_ids}) if args.json else text
        )
    return 0


def _error(error: ValueError) -> int:
    print(f"mcore-flash generate: error: {error}", file=sys.stderr)
    return 2


def parse_generate_args(argv: Optional[Sequence[str]] = None) -> GenerateConfig:
    """generate's flags, checked (ValueError names the flag). The launcher's processes
    (``WORLD_SIZE``, 1 without a launcher) are one model replica: the model-parallel flags
    must multiply to their number, and the training batch flags are checked for that one
    replica (generation has no data parallelism and no batch arithmetic)."""
    parser = build_parser()
    flags = parser.parse_args(argv)
    if flags.context_parallel_size != 1:
        raise ValueError("generate runs with --context-parallel-size 1")
    tp, pp = flags.tensor_model_parallel_size, flags.pipeline_model_parallel_size
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if tp * pp != world:
        raise ValueError(
            f"generate runs the {world} processes started as one model replica: "
            f"--tensor-model-parallel-size x --pipeline-model-parallel-size must be {world}, "
            f"got {tp} x {pp}; pass the layout to run the checkpoint at"
        )
    run = resolve_tool_config(vars(flags), world)
    own = [field.name for field in dataclasses.fields(GenerateConfig) if field.name != "run"]
    return GenerateConfig(run, **{name: getattr(flags, name) for name in own})


def _check_generation_flags(args: GenerateConfig) -> None:
    if not args.run.load:
        raise ValueError("--load is required: the checkpoint to generate from")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.run.sequence_parallel:
        raise ValueError(
            "--sequence-parallel: generate runs without it (a decoded token cannot be split over "
            "the tensor-parallel ranks; megatron-core's static inference refuses it too); drop the flag"
        )
    if args.chat and args.prompt is None:
        raise ValueError(
            "--chat puts --prompt TEXT in the chat template; it does not take --prompt-ids"
        )
    if not args.temperature >= 0:
        raise ValueError(f"--temperature must be >= 0 (0: greedy), got {args.temperature}")
    if args.top_k is not None and args.top_k < 1:
        raise ValueError(f"--top-k must be >= 1, got {args.top_k}")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1], got {args.top_p}")
    given = [flag for flag, value in (("--top-k", args.top_k), ("--top-p", args.top_p)) if value]
    if given and args.temperature == 0:
        raise ValueError(
            f"{' and '.join(given)} restrict sampling: give --temperature > 0 (without it "
            "decoding is greedy)"
        )


def generate(args: GenerateConfig) -> tuple[list[int], list[int], str]:
    """``(prompt ids, generated ids, decoded text)``; call after ``init_distributed(args.run)``."""
    from mcore_flash.runtime.trained_model import load_trained_model

    model, tokenizer, _, common = load_trained_model(args.run)
    prompt = prompt_ids(args, tokenizer)
    new = decode(
        model,
        prompt,
        args.max_new_tokens,
        tokenizer.vocab_size,
        Sampling.from_args(args),
        stop=() if args.ignore_eos else end_of_sequence_ids(common),
        kv_cache=not args.no_kv_cache,
    )
    return prompt, new, tokenizer.detokenize(new)


def prompt_ids(args: GenerateConfig, tokenizer) -> list[int]:
    """The prompt's token ids: ``--prompt-ids`` as given, or ``--prompt`` (in the chat
    template with ``--chat``) encoded without adding special tokens; all in the vocabulary."""
    if args.prompt_ids is not None:
        try:
            prompt = [int(token) for token in args.prompt_ids.split(",")]
        except ValueError:
            raise ValueError(
                f"--prompt-ids {args.prompt_ids!r}: give comma-separated integers, e.g. 1,2,3"
            ) from None
    else:
        text = chat_text(tokenizer, args.prompt) if args.chat else args.prompt
        prompt = list(tokenizer.tokenize(text))
    bad = [token for token in prompt if not 0 <= token < tokenizer.vocab_size]
    if not prompt or bad:
        raise ValueError(
            f"the prompt must be non-empty token ids in [0, {tokenizer.vocab_size}); got {bad or 'none'}"
        )
    return prompt


def chat_text(tokenizer, text: str) -> str:
    """``text`` as one user message in ``tokenizer``'s chat template, followed by the
    assistant's header (``add_generation_prompt=True``)."""
    import jinja2

    from mcore_flash.data.chat_template import ChatTemplate

    template = ChatTemplate.from_directory(tokenizer.directory) if tokenizer.directory else None
    if template is None:
        where = f" in {tokenizer.directory}" if tokenizer.directory else ""
        raise ValueError(
            f"--chat: the tokenizer ({type(tokenizer).__name__}{where}) has no chat template "
            "(chat_template.jinja, or chat_template in tokenizer_config.json); use a Hugging Face "
            "tokenizer that has one (--tokenizer-model DIR), or drop --chat"
        )
    try:
        return template.render([{"role": "user", "content": text}], add_generation_prompt=True)
    except jinja2.TemplateError as error:
        raise ValueError(f"--chat: the tokenizer's chat template failed: {error}") from None


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


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is chosen from the last position's logits over the real vocabulary
    (padding rows are never chosen): greedy (the argmax) unless ``temperature`` > 0. Then the
    logits are divided by ``temperature``, cut to the ``top_k`` largest (ties with the K-th
    kept) and then to the smallest set of most probable tokens whose probability reaches
    ``top_p`` (transformers' order), and one token is drawn from their softmax, in float64, by
    ``torch.multinomial`` with a CPU generator seeded with ``seed`` (``--seed``, default 1234):
    a seed gives the same tokens on every device (docs/conversion.md, "``generate``")."""

    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: no limit
    top_p: float = 1.0  # 1: no limit
    seed: int = 1234

    @classmethod
    def from_args(cls, args: GenerateConfig) -> "Sampling":
        top_p = 1.0 if args.top_p is None else args.top_p
        return cls(args.temperature, args.top_k or 0, top_p, args.run.seed)

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """Sampling probabilities, float64 ``[vocab]`` on the CPU, from ``logits`` ``[vocab]``
        over the real vocabulary (``temperature > 0``): temperature, top-k, then top-p."""
        scores = logits.detach().double().cpu() / self.temperature
        if self.top_k:
            kth = torch.topk(scores, min(self.top_k, scores.numel())).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probabilities = torch.softmax(scores, dim=-1)
        if self.top_p < 1:
            ordered, order = probabilities.sort(descending=True, stable=True)
            before = torch.cat([ordered.new_zeros(1), ordered.cumsum(0)[:-1]])  # mass ahead
            drop = torch.empty_like(order, dtype=torch.bool).scatter_(
                0, order, before >= self.top_p
            )
            probabilities = probabilities.masked_fill(drop, 0.0)
            probabilities = probabilities / probabilities.sum()
        return probabilities

    def choose(self, logits: torch.Tensor, generator: torch.Generator) -> int:
        """The next token from ``logits`` ``[vocab]``: the argmax, or one draw from
        :meth:`probabilities` with ``generator`` (a CPU one)."""
        if self.temperature == 0:
            return int(logits.argmax())
        return int(torch.multinomial(self.probabilities(logits), 1, generator=generator))


GREEDY = Sampling()


def decode(
    model,
    prompt: list[int],
    max_new_tokens: int,
    vocab_size: int,
    sampling: Sampling = GREEDY,
    stop: Sequence[int] = (),
    kv_cache: bool = True,
) -> list[int]:
    """The tokens ``model`` (this rank's pipeline stage, in ``eval()``, built with gathered
    logits) generates after ``prompt``: at most ``max_new_tokens``, ending after the first one
    in ``stop``, chosen among the first ``vocab_size`` rows (the rest pad the vocabulary).
    Every rank returns the same list."""
    generator = torch.Generator().manual_seed(sampling.seed)
    last_logits = (
        _cached_steps(model, vocab_size, len(prompt) + max_new_tokens)
        if kv_cache
        else (lambda ids: _last_logits(model, vocab_size, ids, 0, None))
    )
    ids = list(prompt)
    scope = compat.static_inference_scope() if kv_cache else contextlib.nullcontext()
    with torch.no_grad(), scope:
        for _ in range(max_new_tokens):
            logits = last_logits(ids)
            ids.append(_shared_token(-1 if logits is None else sampling.choose(logits, generator)))
            if ids[-1] in stop:  # every rank has the token: all stop together
                break
    return ids[len(prompt) :]


def _cached_steps(model, vocab_size: int, max_length: int) -> Callable:
    """``ids -> last logits`` (as :func:`_last_logits`) through megatron's static KV cache for
    one sequence of at most ``max_length`` tokens: the first call runs ``ids`` whole (prefill),
    each later call the tokens added since (decode), at their positions."""
    from megatron.core.inference.contexts import StaticInferenceContext

    context = StaticInferenceContext(max_batch_size=1, max_sequence_length=max_length)

    def step(ids: list[int]) -> Optional[torch.Tensor]:
        start = context.sequence_len_offset
        logits = _last_logits(model, vocab_size, ids[start:], start, context)
        context.increment_sequence_len_offset(len(ids) - start)
        context.enable_decode_mode()
        return logits

    return step


def _last_logits(
    model, vocab_size: int, tokens: list[int], start: int, context
) -> Optional[torch.Tensor]:
    """The logits after ``tokens`` (at positions ``start, start + 1, ...``; with an inference
    ``context`` the earlier ones are in its cache, else ``start`` is 0) over the real
    vocabulary: float32 ``[vocab_size]`` on the last pipeline stage, None on the others."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    device = platform.torch_device()
    token_ids = torch.tensor([tokens], device=device)  # [1, s]
    positions = torch.arange(start, start + len(tokens), device=device).unsqueeze(0)
    kept = []

    def forward_step(data_iterator, model):
        def keep_last(logits):  # [1, s | 1 (megatron may compute the last position only), padded]
            kept.append(logits[0, -1, :vocab_size].float())
            return logits.sum() * 0, torch.tensor(1, dtype=torch.int), {}

        output = model(
            token_ids, positions, None, inference_context=context, runtime_gather_output=True
        )
        return output, keep_last

    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter([None]),
        model=[model],
        num_microbatches=1,
        seq_length=len(tokens),
        micro_batch_size=1,
        decoder_seq_length=len(tokens),
        forward_only=True,
    )
    return kept[0] if kept else None


def _shared_token(token: int) -> int:
    """The token of the last pipeline stage's first tensor-parallel rank, on every rank (the
    stage's TP ranks drew it from equal logits with equal generators; this makes it certain)."""
    from megatron.core import parallel_state

    chosen = torch.tensor([token], device=platform.torch_device())
    if (
        parallel_state.is_pipeline_last_stage()
        and parallel_state.get_tensor_model_parallel_world_size() > 1
    ):
        dist.broadcast(
            chosen,
            parallel_state.get_tensor_model_parallel_src_rank(),
            group=parallel_state.get_tensor_model_parallel_group(),
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

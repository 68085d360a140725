"""``mcore-flash bench-generate``: decoding time with megatron's KV cache against without it.

The trainer's model of the given shape (``mcore-flash pretrain``'s model flags; default the
tiny preset), randomly initialised, greedily decodes ``--new-tokens`` tokens after a prompt of
``--prompt-length`` random ids in one CPU process, through :func:`mcore_flash.generate.decode`
with the KV cache (the prompt once, then one token a step) and as ``generate --no-kv-cache``
does (the whole sequence every step): ``--repeats`` timed runs of each, alternating, after
an untimed warm-up of each; the median and the fastest run are reported (on a busy machine the
fastest is the closer to the cost). The two must give the same tokens (exit 1
otherwise). Progress goes to stderr, a markdown table to stdout.

    mcore-flash bench-generate [--prompt-length 512] [--new-tokens 128] [--repeats 3]
        [pretrain's model flags]
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Optional, Sequence

import torch

from .common import MegatronGroup, loadavg, progress_log


def main(argv: Optional[Sequence[str]] = None) -> int:
    from mcore_flash.runtime.arguments import build_parser, parse_args

    parser = build_parser()
    parser.prog = "mcore-flash bench-generate"
    parser.description = __doc__.split("\n\n")[0]
    group = parser.add_argument_group("benchmark")
    group.add_argument("--prompt-length", type=int, default=512)
    group.add_argument("--new-tokens", type=int, default=128)
    group.add_argument("--repeats", type=int, default=3, help="timed runs of each")
    try:
        args = parse_args(argv, world_size=1, parser=parser)
        if min(args.prompt_length, args.new_tokens, args.repeats) < 1:
            raise ValueError("--prompt-length, --new-tokens and --repeats must be >= 1")
    except ValueError as error:
        print(f"mcore-flash bench-generate: error: {error}", file=sys.stderr)
        return 2
    with MegatronGroup():
        seconds, same = _time_both(args, progress_log("bench-generate"))
    print(
        "| KV cache | prompt tokens | new tokens | median s | fastest s | ms / new token (fastest) |"
    )
    print("|---|---|---|---|---|---|")
    for name, runs in zip(("megatron's (default)", "none (--no-kv-cache)"), seconds):
        fastest = min(runs)
        print(
            f"| {name} | {args.prompt_length} | {args.new_tokens} | {statistics.median(runs):.2f} "
            f"| {fastest:.2f} | {1e3 * fastest / args.new_tokens:.1f} |"
        )
    cached, full = (statistics.median(runs) for runs in seconds)
    print(
        f"\nspeed-up {full / cached:.1f}x (medians; fastest runs "
        f"{min(seconds[1]) / min(seconds[0]):.1f}x); same tokens: {'yes' if same else 'NO'}; "
        f"model {args.num_layers} layers, hidden {args.hidden_size}, "
        f"{args.num_attention_heads} heads; torch threads {torch.get_num_threads()}; "
        f"load {loadavg()}"
    )
    return 0 if same else 1


def _time_both(args, log) -> tuple[tuple[list[float], list[float]], bool]:
    """``((seconds of each run with the cache, without), same tokens)`` of greedy decoding
    (the prefill included); the repeats alternate (with, without, with, ...)."""
    from mcore_flash.generate import decode
    from mcore_flash.runtime.trained_model import build_untrained_model

    torch.manual_seed(args.seed)
    model, tokenizer, _, _ = build_untrained_model(args)
    generator = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(tokenizer.vocab_size, (args.prompt_length,), generator=generator)
    seconds, outputs = {True: [], False: []}, {}
    for kv_cache in (True, False):  # untimed warm-up
        decode(model, prompt[:8].tolist(), 2, tokenizer.vocab_size, kv_cache=kv_cache)
    for repeat in range(args.repeats):
        for kv_cache in (True, False):
            start = time.perf_counter()
            outputs[kv_cache] = decode(
                model, prompt.tolist(), args.new_tokens, tokenizer.vocab_size, kv_cache=kv_cache
            )
            seconds[kv_cache].append(time.perf_counter() - start)
            log(
                f"repeat {repeat + 1}: {args.new_tokens} tokens {'with' if kv_cache else 'without'}"
                f" the KV cache in {seconds[kv_cache][-1]:.2f} s"
            )
    return (seconds[True], seconds[False]), outputs[True] == outputs[False]

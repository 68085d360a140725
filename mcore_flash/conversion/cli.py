"""``mcore-flash convert``: Hugging Face Llama / Qwen2 / Qwen3 <-> megatron checkpoints (streamed, any TP/PP).

mcore-flash convert hf-to-mcore --hf-dir DIR --save DIR [--tensor-model-parallel-size N]
    [--pipeline-model-parallel-size M] [--make-vocab-size-divisible-by K] [--bf16]
mcore-flash convert mcore-to-hf --load DIR --save-hf DIR [--max-shard-size 5GB]

hf-to-mcore copies the source's tokenizer files into DIR/tokenizer; mcore-to-hf writes them back.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mcore-flash convert", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="direction", required=True)
    to_mcore = sub.add_parser(
        "hf-to-mcore", help="Hugging Face Llama/Qwen2/Qwen3 directory -> megatron dist checkpoint"
    )
    to_mcore.add_argument(
        "--hf-dir", required=True, help="directory with config.json and *.safetensors"
    )
    to_mcore.add_argument(
        "--save",
        required=True,
        help="new checkpoint directory (pretrain --load it with --finetune)",
    )
    to_mcore.add_argument("--tensor-model-parallel-size", type=int, default=1)
    to_mcore.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    to_mcore.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    to_mcore.add_argument("--bf16", action="store_true", help="store bf16 weights (default fp32)")
    to_hf = sub.add_parser(
        "mcore-to-hf", help="megatron checkpoint -> Hugging Face Llama/Qwen2/Qwen3 directory"
    )
    to_hf.add_argument(
        "--load", required=True, help="a pretrain --save directory (its latest checkpoint)"
    )
    to_hf.add_argument("--save-hf", required=True, help="new Hugging Face model directory")
    to_hf.add_argument(
        "--max-shard-size", default="5GB", help="largest safetensors file, e.g. 5GB, 500MB"
    )
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    from mcore_flash.quiet_imports import silence

    silence()
    args = build_parser().parse_args(argv)
    try:
        if args.direction == "hf-to-mcore":
            from mcore_flash.conversion.hf_to_mcore import hf_to_mcore

            result = hf_to_mcore(
                args.hf_dir,
                args.save,
                args.tensor_model_parallel_size,
                args.pipeline_model_parallel_size,
                args.make_vocab_size_divisible_by,
                args.bf16,
            )
            tokenizer = result["tokenizer"]
            stored = (
                f"; tokenizer ({', '.join(tokenizer['files'])}) in {result['path']}/tokenizer"
                if tokenizer
                else f"; {args.hf_dir} has no tokenizer files: later commands need --tokenizer-type/--tokenizer-model"
            )
            print(
                f"wrote {result['path']} (padded vocabulary {result['padded_vocab_size']}{stored}); "
                f"continue training with:\n"
                f"  mcore-flash pretrain --load {result['path']} --finetune --use-checkpoint-args ..."
            )
        else:
            from mcore_flash.conversion.mcore_to_hf import mcore_to_hf

            result = mcore_to_hf(args.load, args.save_hf, _bytes(args.max_shard_size))
            tokenizer = result["tokenizer_files"]
            print(
                f"wrote {args.save_hf}: config.json + {len(result['files'])} safetensors file(s) "
                f"from iteration {result['iteration']}"
                + (
                    f" + tokenizer ({', '.join(tokenizer)})"
                    if tokenizer
                    else " (no tokenizer stored)"
                )
            )
    except ValueError as error:  # ConversionError, or a checkpoint that is not there
        print(f"mcore-flash convert: error: {error}", file=sys.stderr)
        return 2
    return 0


def _bytes(text: str) -> int:
    units = {
        "KB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "KIB": 2**10,
        "MIB": 2**20,
        "GIB": 2**30,
        "B": 1,
    }
    upper = text.strip().upper()
    for unit, factor in units.items():
        if upper.endswith(unit) and upper[: -len(unit)].replace(".", "", 1).isdigit():
            return int(float(upper[: -len(unit)]) * factor)
    raise ValueError(f"--max-shard-size {text!r}: give a size such as 5GB or 500MB")


if __name__ == "__main__":
    sys.exit(main())

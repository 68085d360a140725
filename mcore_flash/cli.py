"""``mcore-flash`` command line: one subcommand per job, each in its own module."""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module with a ``main(argv)``, one-line help)
COMMANDS = {
    "pretrain": (
        "mcore_flash.pretrain",
        "pretrain a GPT on megatron-core with the fused-attention spec",
    ),
    "preprocess": ("mcore_flash.preprocess", "jsonl -> Megatron .bin/.idx indexed dataset"),
    "convert": (
        "mcore_flash.conversion.cli",
        "Hugging Face Llama / Qwen2 / Qwen3 <-> megatron checkpoints (hf-to-mcore, mcore-to-hf)",
    ),
    "generate": (
        "mcore_flash.generate",
        "decoding from a checkpoint: KV cache, greedy or sampled, --chat (does it speak?)",
    ),
    "evaluate": (
        "mcore_flash.evaluation.cli",
        "needle retrieval by length x depth, or loss by position, of a checkpoint",
    ),
    "plot": ("mcore_flash.plot", "training curves from metrics.jsonl into a PNG"),
    "plan": (
        "mcore_flash.planning.cli",
        "per-device memory plan for a model, sequence length and layout",
    ),
    "bench-attention": (
        "mcore_flash.benchmarks.attention",
        "fwd+bwd time and saved bytes of attention implementations",
    ),
    "bench-recompute": (
        "mcore_flash.benchmarks.recompute",
        "saved bytes and time of the recompute modes",
    ),
    "bench-convert": (
        "mcore_flash.benchmarks.convert",
        "peak RSS and time of hf-to-mcore and mcore-to-hf at >= 1B parameters",
    ),
    "bench-cp": (
        "mcore_flash.benchmarks.context_parallel",
        "per-rank time and saved bytes of context parallelism",
    ),
    "bench-packed": (
        "mcore_flash.benchmarks.packed",
        "attention time of packed documents vs one causal sequence",
    ),
    "bench-window": (
        "mcore_flash.benchmarks.window",
        "a sliding-window layer vs full causal attention, next to the pairs ratio",
    ),
    "bench-generate": (
        "mcore_flash.benchmarks.generate",
        "decoding time with megatron's KV cache vs --no-kv-cache",
    ),
    "bench-cuda": (
        "mcore_flash.benchmarks.cuda_kernels",
        "the cuda backend's kernels against torch SDPA's on one GPU",
    ),
    "bench-loss": (
        "mcore_flash.benchmarks.loss",
        "time and peak bytes of megatron's loss and MLP vs the sequence-tiled ones",
    ),
}


def _version() -> str:
    """``mcore-flash VERSION (python X, torch Y, megatron-core Z)``, from the installed
    packages' metadata (nothing imported)."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    found = [f"python {platform.python_version()}"]
    for package in ("torch", "torch_npu", "megatron-core"):
        try:
            found.append(f"{package} {version(package)}")
        except PackageNotFoundError:
            if package != "torch_npu":  # only an Ascend machine has it
                found.append(f"{package} not installed")
    return f"mcore-flash {version('mcore-flash')} ({', '.join(found)})"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--version"]:
        print(_version())
        return 0
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: mcore-flash <command> [options] | --version\n\ncommands:")
        for name, (_, help_text) in COMMANDS.items():
            print(f"  {name:<18} {help_text}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(
            f"mcore-flash: unknown command {name!r}; choose one of {', '.join(COMMANDS)}",
            file=sys.stderr,
        )
        return 2
    from mcore_flash.quiet_imports import silence

    silence()  # before the subcommand's imports: megatron-core warns when imported
    module = importlib.import_module(COMMANDS[name][0])
    if name == "plan":  # plan --from-pretrain-args reads the trainer's flags with its parser
        from mcore_flash.pretrain import planned_run

        return int(module.main(rest, pretrain_reader=planned_run) or 0)
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())

"""``--use-torch-fsdp2``: torch FSDP2 around the model, its settings and what it cannot combine.

Megatron-LM's flag wraps each rank's GPTModel in torch's ``fully_shard`` over the data x
context parallel ranks; ``--fsdp2-offload-to-cpu`` (or ``offload_to_cpu: true`` in the file)
adds FSDP2's ``CPUOffloadPolicy``: weights, gradients and the optimizer state live on the
host and each layer's weights are copied to the device while it computes.
``--fsdp2-config-path FILE`` reads MindSpeed's FSDP2 YAML keys that apply here
(:data:`CONFIG_KEYS`); any other key, or a value of the wrong type, is refused naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

# MindSpeed's FSDP2 config keys read here, each with its type and default. ``param_dtype``
# None: the run's precision (bf16 with --bf16, else fp32); the sharded weights, gradients
# and optimizer state stay fp32.
CONFIG_KEYS: dict[str, tuple[type, Any]] = {
    "offload_to_cpu": (bool, False),
    "pin_memory": (bool, True),
    "reshard_after_forward": (bool, True),
    "param_dtype": (str, None),
    "reduce_dtype": (str, "fp32"),
}
DTYPES = ("bf16", "fp32")


@dataclass(frozen=True)
class Fsdp2Settings:
    """What FSDP2 is built with (:mod:`mcore_flash.training.fsdp2`).

    ``offload_to_cpu``: FSDP2's ``CPUOffloadPolicy`` (``pin_memory``: page-locked host
    shards); ``reshard_after_forward``: a unit's gathered weights are freed after its
    forward and gathered again for its backward; ``param_dtype`` / ``reduce_dtype``: the
    ``MixedPrecisionPolicy`` ("bf16" or "fp32") of the gathered weights and of the gradient
    reduction."""

    offload_to_cpu: bool
    pin_memory: bool
    reshard_after_forward: bool
    param_dtype: str
    reduce_dtype: str


def read_config_file(path: str) -> dict[str, Any]:
    """The keys of the YAML file ``path`` (``--fsdp2-config-path``), each checked against
    :data:`CONFIG_KEYS`; ValueError names the key, the file and what it takes."""
    import yaml

    try:
        with open(path) as stream:
            loaded = yaml.safe_load(stream)
    except OSError as error:
        raise ValueError(f"--fsdp2-config-path {path}: cannot read it ({error})") from None
    except yaml.YAMLError as error:
        raise ValueError(f"--fsdp2-config-path {path}: not YAML ({error})") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ValueError(
            f"--fsdp2-config-path {path}: expected a mapping of keys "
            f"({', '.join(CONFIG_KEYS)}), got a {type(loaded).__name__}"
        )
    for key, value in loaded.items():
        if key not in CONFIG_KEYS:
            raise ValueError(
                f"--fsdp2-config-path {path}: unknown key {key!r}; this trainer reads "
                f"{', '.join(CONFIG_KEYS)} (MindSpeed's names; its other keys have no meaning here)"
            )
        kind, _ = CONFIG_KEYS[key]
        if not isinstance(value, kind):
            raise ValueError(
                f"--fsdp2-config-path {path}: {key} must be a {kind.__name__}, got {value!r}"
            )
        if key.endswith("_dtype") and value not in DTYPES:
            raise ValueError(
                f"--fsdp2-config-path {path}: {key} must be one of {', '.join(DTYPES)}, got {value!r}"
            )
    return loaded


def resolve_fsdp2(args) -> Optional[Fsdp2Settings]:
    """The FSDP2 settings of the flags ``args`` (None without ``--use-torch-fsdp2``); ValueError
    names the flag for what FSDP2 cannot combine with here."""
    if not args.use_torch_fsdp2:
        for flag in ("fsdp2_offload_to_cpu", "fsdp2_config_path"):
            if getattr(args, flag):
                raise ValueError(
                    f"--{flag.replace('_', '-')} sets how --use-torch-fsdp2 works: add --use-torch-fsdp2"
                )
        return None
    _refuse_combinations(args)
    values = {key: default for key, (_, default) in CONFIG_KEYS.items()}
    if args.fsdp2_config_path:
        values.update(read_config_file(args.fsdp2_config_path))
    values["offload_to_cpu"] = values["offload_to_cpu"] or args.fsdp2_offload_to_cpu
    if values["param_dtype"] is None:
        values["param_dtype"] = "bf16" if args.bf16 else "fp32"
    if values["param_dtype"] == "bf16" and not args.bf16:
        raise ValueError(
            "--fsdp2-config-path: param_dtype bf16 computes in bf16: add --bf16 (or set param_dtype fp32)"
        )
    return Fsdp2Settings(**values)


def _refuse_combinations(args) -> None:
    refusals = {
        "--pipeline-model-parallel-size > 1": (
            args.pipeline_model_parallel_size > 1,
            "FSDP2 shards one model chunk per rank here; train at --pipeline-model-parallel-size 1 "
            "(with tensor and context parallelism), or pipeline without --use-torch-fsdp2",
        ),
        "--use-distributed-optimizer": (
            args.use_distributed_optimizer,
            "FSDP2 shards the optimizer state itself (Megatron-LM refuses the pair too): drop it",
        ),
        "--use-megatron-fsdp": (
            args.use_megatron_fsdp,
            "two FSDP implementations exclude each other: pick one",
        ),
        "--optimizer-cpu-offload": (
            args.optimizer_cpu_offload,
            "with --fsdp2-offload-to-cpu the optimizer state is on the host already: drop it",
        ),
        "--fp16": (args.fp16, "FSDP2's loss scaling of sharded gradients is untested: use --bf16"),
        "--grad-reduce-in-bf16": (
            args.grad_reduce_in_bf16,
            "FSDP2 reduces in the config file's reduce_dtype (fp32 unless --fsdp2-config-path "
            "says bf16): drop the flag",
        ),
        "tied embeddings": (
            not args.untie_embeddings_and_output_weights,
            "the output layer would read the embedding's weight after FSDP2 freed it: add "
            "--untie-embeddings-and-output-weights",
        ),
        "--overlap-param-gather": (
            args.overlap_param_gather,
            "FSDP2 gathers each layer's weights in the forward pass already: drop it",
        ),
    }
    for flag, (given, why) in refusals.items():
        if given:
            raise ValueError(f"--use-torch-fsdp2 with {flag}: {why}")

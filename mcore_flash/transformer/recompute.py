"""Recompute settings: Megatron-LM's flags, validated, and the project's named modes.

:func:`recompute_settings` turns Megatron-LM's ``--recompute-granularity``,
``--recompute-method``, ``--recompute-num-layers`` and ``--recompute-modules`` into
:class:`RecomputeSettings` (``TransformerConfig`` keywords plus the selective modules our
layer applies itself), raising ValueError naming the flag to change for contradictory ones.
Beyond Megatron-LM it takes the module ``qkv``
(:mod:`mcore_flash.transformer.qkv_recompute`) and partial recompute (``full`` + ``block``
with ``--recompute-modules``). :func:`recompute_mode_settings` gives the named modes
(:data:`MODES`: ``none | qkv | attention | full``) that ``mcore-flash plan --recompute`` and
the benchmarks use. What each keeps: ``docs/megatron-spec.md``, "Recompute".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

MODES = ("none", "qkv", "attention", "full")
GRANULARITIES = ("full", "selective")
METHODS = ("uniform", "block")
QKV = "qkv"  # our module; megatron's TransformerConfig does not know it


@dataclass(frozen=True)
class RecomputeSettings:
    """``config``: ``TransformerConfig`` keyword arguments; ``layer_modules``: the spec's
    ``layer_recompute_modules``
    (:func:`~mcore_flash.transformer.get_gpt_decoder_block_flash_spec`), the selective modules
    our layer applies itself (``qkv``; all of them under partial recompute)."""

    config: dict = field(default_factory=dict)
    layer_modules: tuple[str, ...] = ()


def recompute_settings(
    granularity: Optional[str],
    method: Optional[str] = None,
    num_layers: Optional[int] = None,
    modules: Optional[Sequence[str]] = None,
) -> RecomputeSettings:
    """The settings for Megatron-LM's recompute flags (``qkv`` allowed among the modules).

    Partial recompute (for a plan that recomputes just enough): ``--recompute-granularity full
    --recompute-method block --recompute-num-layers N --recompute-modules M...`` recomputes the
    first N layers of each pipeline stage (chunk) whole, as Megatron-LM does, and gives the
    other layers the selective modules M (``qkv``, ``core_attn``, ``mlp``, ``layernorm``);
    Megatron-LM refuses modules with ``full``, so this combination is ours.

    Raises ValueError naming the flag to change for contradictory settings.
    """
    if granularity is None:
        if method is not None or num_layers is not None or modules:
            raise ValueError(
                "--recompute-method/--recompute-num-layers/--recompute-modules need --recompute-granularity"
            )
        return RecomputeSettings({"recompute_granularity": None})
    if granularity not in GRANULARITIES:
        raise ValueError(f"--recompute-granularity {granularity!r}: choose one of {GRANULARITIES}")
    if granularity == "full":
        if method not in METHODS:
            raise ValueError(
                f"--recompute-granularity full needs --recompute-method {' or '.join(METHODS)} (got {method!r})"
            )
        if num_layers is None or num_layers < 1:
            raise ValueError("--recompute-granularity full needs --recompute-num-layers >= 1")
        if modules and method != "block":
            raise ValueError(
                "--recompute-modules with --recompute-granularity full needs --recompute-method block (partial "
                "recompute: the modules apply to the layers after the first --recompute-num-layers); with uniform "
                "every layer is recomputed whole, drop --recompute-modules"
            )
        config = {
            "recompute_granularity": "full",
            "recompute_method": method,
            "recompute_num_layers": num_layers,
        }
        return RecomputeSettings(config, _check_modules(modules or ()))
    if method is not None or num_layers is not None:
        raise ValueError(
            "--recompute-method/--recompute-num-layers apply to --recompute-granularity full only; "
            "drop them for selective (choose what to recompute with --recompute-modules)"
        )
    modules = _check_modules(modules or ["core_attn"])
    layer_modules = (QKV,) if QKV in modules else ()
    megatron_modules = [name for name in modules if name != QKV]
    if not megatron_modules:  # qkv alone: nothing for megatron's selective recompute to do
        return RecomputeSettings({"recompute_granularity": None}, layer_modules)
    return RecomputeSettings(
        {"recompute_granularity": "selective", "recompute_modules": megatron_modules}, layer_modules
    )


def _check_modules(modules: Sequence[str]) -> tuple[str, ...]:
    if QKV in modules and "core_attn" in modules:
        raise ValueError(
            "--recompute-modules qkv core_attn: core_attn already recomputes the whole attention sub-block "
            "(kernel included) and qkv keeps its output; keep one"
        )
    return tuple(modules)


def recompute_mode_settings(mode: str) -> RecomputeSettings:
    """The settings of a named mode (what ``mcore-flash plan --recompute`` and the benchmarks
    call them):

    * ``none`` -- every layer keeps its activations;
    * ``qkv`` -- ``--recompute-granularity selective --recompute-modules qkv`` (ours): the
      attention sub-block keeps the layer input, the kernel's output and statistics, and
      re-runs input norm -> QKV -> RoPE in backward, never the kernel
      (:mod:`mcore_flash.transformer.qkv_recompute`);
    * ``attention`` -- Megatron's ``--recompute-granularity selective --recompute-modules
      core_attn``, which with our spec keeps only each layer's input for the attention
      sub-block (see :class:`~mcore_flash.transformer.layer.FlashTransformerLayer`);
    * ``full`` -- ``--recompute-granularity full --recompute-method uniform
      --recompute-num-layers 1``: each layer keeps only its input.
    """
    if mode == "none":
        return recompute_settings(None)
    if mode == "qkv":
        return recompute_settings("selective", modules=[QKV])
    if mode == "attention":
        return recompute_settings("selective", modules=["core_attn"])
    if mode == "full":
        return recompute_settings("full", method="uniform", num_layers=1)
    raise ValueError(f"recompute mode {mode!r}: choose one of {MODES}")

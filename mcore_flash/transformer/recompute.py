"""Recompute settings: Megatron-LM's flags, validated, and the project's named modes.

Modes (what ``mcore-flash plan --recompute`` and the benchmarks call them):

* ``none`` -- every layer keeps its activations;
* ``attention`` -- Megatron's ``--recompute-granularity selective --recompute-modules
  core_attn``, which with our spec keeps only each layer's input for the attention
  sub-block (see :class:`~mcore_flash.transformer.layer.FlashTransformerLayer`);
* ``full`` -- ``--recompute-granularity full --recompute-method uniform
  --recompute-num-layers 1``: each layer keeps only its input.
"""

from __future__ import annotations

from typing import Optional, Sequence

MODES = ("none", "attention", "full")
GRANULARITIES = ("full", "selective")
METHODS = ("uniform", "block")


def recompute_settings(
    granularity: Optional[str],
    method: Optional[str] = None,
    num_layers: Optional[int] = None,
    modules: Optional[Sequence[str]] = None,
) -> dict:
    """``TransformerConfig`` keyword arguments for Megatron-LM's recompute flags.

    Raises ValueError naming the flag to change for contradictory settings.
    """
    if granularity is None:
        if method is not None or num_layers is not None or modules:
            raise ValueError(
                "--recompute-method/--recompute-num-layers/--recompute-modules need --recompute-granularity"
            )
        return {"recompute_granularity": None}
    if granularity not in GRANULARITIES:
        raise ValueError(f"--recompute-granularity {granularity!r}: choose one of {GRANULARITIES}")
    if granularity == "full":
        if method not in METHODS:
            raise ValueError(
                f"--recompute-granularity full needs --recompute-method {' or '.join(METHODS)} (got {method!r})"
            )
        if num_layers is None or num_layers < 1:
            raise ValueError("--recompute-granularity full needs --recompute-num-layers >= 1")
        if modules:
            raise ValueError("--recompute-modules applies to --recompute-granularity selective only; drop it")
        return {"recompute_granularity": "full", "recompute_method": method, "recompute_num_layers": num_layers}
    if method is not None or num_layers is not None:
        raise ValueError(
            "--recompute-method/--recompute-num-layers apply to --recompute-granularity full only; "
            "drop them for selective (choose what to recompute with --recompute-modules)"
        )
    return {"recompute_granularity": "selective", "recompute_modules": list(modules or ["core_attn"])}


def recompute_mode_settings(mode: str) -> dict:
    """``TransformerConfig`` keyword arguments for a named mode (``none | attention | full``)."""
    if mode == "none":
        return recompute_settings(None)
    if mode == "attention":
        return recompute_settings("selective", modules=["core_attn"])
    if mode == "full":
        return recompute_settings("full", method="uniform", num_layers=1)
    raise ValueError(f"recompute mode {mode!r}: choose one of {MODES}")

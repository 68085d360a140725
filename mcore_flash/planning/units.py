"""Byte sizes: parse ``64GB`` / ``80GiB`` / ``1.5TB`` / ``123456``, print ``12.34 GiB``; the
bytes of an fp32 and a bf16 element."""

from __future__ import annotations

import re

__all__ = ["parse_bytes", "format_bytes", "GiB", "MiB", "FP32_BYTES", "BF16_BYTES"]

KiB, MiB, GiB, TiB = 2**10, 2**20, 2**30, 2**40
FP32_BYTES = 4  # an fp32 element (main gradients, the logits' gradient, the ring's dK/dV)
BF16_BYTES = 2
_UNITS = {
    "": 1,
    "b": 1,
    "k": KiB,
    "kb": KiB,
    "kib": KiB,
    "m": MiB,
    "mb": MiB,
    "mib": MiB,
    "g": GiB,
    "gb": GiB,
    "gib": GiB,
    "t": TiB,
    "tb": TiB,
    "tib": TiB,
}


def parse_bytes(text) -> int:
    """Bytes from ``"64GB"``, ``"64 GiB"``, ``"65536MB"`` or a number.

    Device memories are sized in binary units (an Ascend 910B's "64 GB" of HBM is 64 GiB),
    so ``GB`` and ``GiB`` both mean 2**30 here.
    """
    if isinstance(text, (int, float)):
        return int(text)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(
            f"cannot read a memory size from {text!r}; write e.g. 64GB, 80GiB or 65536MB"
        )
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_bytes(nbytes: float) -> str:
    """``12.34 GiB``, ``512.00 MiB``, ``3.0 KiB`` or ``17 B``."""
    nbytes = float(nbytes)
    for unit, size in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{nbytes:.0f} B"

"""Named values of torch_npu's ``npu_fusion_attention`` contract (``docs/npu-contract.md``).

Shared by the NPU backend (:mod:`mcore_flash.ops.backends.npu`, the op's client) and the
emulated torch_npu (:mod:`mcore_flash.emulation.fusion_attention`, the op's double), so
both name a sparse mode the same way. Standard library only: the emulation, the lowest
layer, imports it without importing :mod:`mcore_flash.ops`.
"""

from __future__ import annotations

import enum

MAX_TOCKENS = 2147483647
"""pre/next_tockens meaning "unbounded" (int32 max)."""
COMPRESSED_MASK_SIZE = 2048
"""Side of the compressed ``triu(ones, diagonal=1)`` mask of the causal and band modes."""


class SparseMode(enum.IntEnum):
    """``sparse_mode`` of ``npu_fusion_attention`` and its grad op (torch_npu 2.13).

    An ``IntEnum``: a member is the int the op receives. The names follow the CANN docs'
    (``defaultMask``, ``allMask``, ...). "Compressed mask" is the 2048 x 2048
    ``triu(ones, diagonal=1)`` the causal and band modes take instead of an Sq x Skv one.
    Without ``atten_mask`` the op computes full attention whatever the mode says.
    """

    DEFAULT_MASK = 0
    """The mask as given (SS, 11SS, B1SS or BNSS), which must agree with pre/next_tockens."""
    ALL_MASK = 1
    """The mask as given; pre/next_tockens are ignored."""
    LEFT_UP_CAUSAL = 2
    """Causal, diagonal from the top-left corner: key j visible to query i iff j <= i (compressed mask)."""
    RIGHT_DOWN_CAUSAL = 3
    """Causal, diagonal into the bottom-right corner: j <= i + Skv - Sq (compressed mask)."""
    BAND = 4
    """-pre_tockens <= j - i - (Skv - Sq) <= next_tockens, origin bottom-right (compressed mask)."""
    PREFIX = 5
    """Prefix: causal, plus the first ``prefix[b]`` keys of batch b; uncompressed mask; not in TND."""
    PREFIX_COMPRESSED = 6
    """Prefix with a compressed 3072 x 2048 mask."""
    VARLEN_SPLIT_RIGHT_DOWN_CAUSAL = 7
    """TND only: the queries of a mode-3 pack split across devices, keys unsplit (the cut
    sequence is the last one)."""
    VARLEN_SPLIT_LEFT_UP_CAUSAL = 8
    """TND only: as mode 7 for a mode-2 pack (the cut sequence is the first one)."""

"""Which keys each query sees in the ``npu_fusion_attention`` double.

From ``atten_mask`` by ``sparse_mode``, the pre/next_tockens band and the TND sequences:
bool ``[B|1, N|1, Sq, Skv]``, True where the key is visible, for canonical ``[B, N, S, D]``
q, k. Masks and rows the contract rejects raise :class:`NpuContractError`.
"""

from __future__ import annotations

import torch

from mcore_flash.npu_contract import COMPRESSED_MASK_SIZE, MAX_TOCKENS, SparseMode

from .fusion_attention_args import FusionAttentionArgs, _fail

MASK_DTYPES = (torch.bool, torch.uint8)
FULL_MASK_MODES = (SparseMode.DEFAULT_MASK, SparseMode.ALL_MASK)  # the mask as given, SS..BNSS
COMPRESSED_MASK_MODES = (SparseMode.LEFT_UP_CAUSAL, SparseMode.RIGHT_DOWN_CAUSAL, SparseMode.BAND)
MODES_IN_THE_DOUBLE = FULL_MASK_MODES + COMPRESSED_MASK_MODES  # modes 5-8 raise NotImplementedError


def compressed_causal_mask(device=None) -> torch.Tensor:
    """The contract's compressed causal mask ``triu(ones(2048, 2048, bool), diagonal=1)``."""
    return torch.triu(
        torch.ones(COMPRESSED_MASK_SIZE, COMPRESSED_MASK_SIZE, dtype=torch.bool, device=device),
        diagonal=1,
    )


_COMPRESSED_CPU = compressed_causal_mask()


# ---- visibility -----------------------------------------------------------------------------


def _visible(args: FusionAttentionArgs, q, k, seq_q, seq_k) -> torch.Tensor:
    """Bool [B|1, N|1, Sq, Skv]: True where the key is visible to the query.

    ``q``/``k`` canonical ``[B, N, S, D]``; ``seq_q``/``seq_k`` the validated cumulative
    sequence ends (TND) or None."""
    b, nq, sq, _ = q.shape
    sk = k.shape[2]
    dev = q.device
    mode, atten_mask = args.sparse_mode, args.atten_mask
    default_mode_band = mode == SparseMode.DEFAULT_MASK and (
        args.pre_tockens != MAX_TOCKENS or args.next_tockens != MAX_TOCKENS
    )  # mode 0 with tockens: a band the mask must agree with
    if mode == SparseMode.BAND:
        _check_band_tockens(args, seq_q, seq_k, sq, sk)
    if mode not in MODES_IN_THE_DOUBLE:
        raise NotImplementedError(f"npu_double: sparse_mode={mode} is unsupported in the double")
    if atten_mask is not None:
        if not isinstance(atten_mask, torch.Tensor) or atten_mask.dtype not in MASK_DTYPES:
            _fail(
                f"atten_mask must be a bool/uint8 tensor, got {getattr(atten_mask, 'dtype', type(atten_mask))}"
            )
        if atten_mask.dtype == torch.uint8 and bool(((atten_mask != 0) & (atten_mask != 1)).any()):
            _fail("uint8 atten_mask must hold only 0/1")
        atten_mask = atten_mask.bool()

    if args.layout == "TND":  # each sequence sees its own keys only, by the mode's rule
        if atten_mask is not None:
            if mode in FULL_MASK_MODES:
                raise NotImplementedError(
                    "npu_double: TND with an atten_mask in sparse_mode 0/1 is unsupported in the double"
                )
            _check_compressed(atten_mask, mode)
        same = torch.zeros(sq, sk, dtype=torch.bool, device=dev)
        q0 = k0 = 0
        for q1, k1 in zip(seq_q, seq_k):
            if atten_mask is None:
                same[q0:q1, k0:k1] = True
            else:
                same[q0:q1, k0:k1] = _compressed_mode_visible(args, q1 - q0, k1 - k0, dev)
            q0, k0 = q1, k1
        return same.view(1, 1, sq, sk)

    if atten_mask is None:
        if default_mode_band:
            raise NotImplementedError(
                "npu_double: tockens band without atten_mask is unsupported in the double"
            )
        return torch.ones(
            1, 1, sq, sk, dtype=torch.bool, device=dev
        )  # FULL attention, any sparse_mode

    if mode in COMPRESSED_MASK_MODES:
        _check_compressed(atten_mask, mode)
        return _compressed_mode_visible(args, sq, sk, dev).view(1, 1, sq, sk)

    # FULL_MASK_MODES: the mask as given, SS / 11SS / B1SS / BNSS (N = head_num)
    m = atten_mask
    ok = m.dim() == 2 and tuple(m.shape) == (sq, sk)
    if m.dim() == 4 and tuple(m.shape[2:]) == (sq, sk):
        ok = tuple(m.shape[:2]) in ((1, 1), (b, 1), (b, nq))
    if not ok:
        _fail(
            f"atten_mask shape {tuple(m.shape)} not accepted for sparse_mode={mode}: "
            f"use SS, 11SS, B1SS or BNSS = [{b}, {nq}, {sq}, {sk}]"
        )
    m4 = m.view(1, 1, sq, sk) if m.dim() == 2 else m
    if default_mode_band:
        rows = torch.arange(sq, device=dev).unsqueeze(-1)
        cols = torch.arange(sk, device=dev)
        outside = (cols < rows - args.pre_tockens) | (cols > rows + args.next_tockens)
        if bool((outside & ~m4).any()):
            _fail("sparse_mode=0: atten_mask does not agree with pre_tockens/next_tockens")
    return ~m4


def _compressed_mode_visible(args: FusionAttentionArgs, n_q: int, n_k: int, device) -> torch.Tensor:
    """Bool [n_q, n_k] of one block (a dense call, or one TND sequence) under the rule of a
    COMPRESSED_MASK_MODES mode: key j visible to query i iff ``j <= i`` (left-up causal),
    ``j <= i + n_k - n_q`` (right-down causal) or inside the band (:func:`_band`)."""
    rows = torch.arange(n_q, device=device).unsqueeze(-1)
    cols = torch.arange(n_k, device=device)
    if args.sparse_mode == SparseMode.BAND:
        return _band(rows, cols, n_k - n_q, args.pre_tockens, args.next_tockens)
    shift = 0 if args.sparse_mode == SparseMode.LEFT_UP_CAUSAL else n_k - n_q
    return cols <= rows + shift


def _band(rows, cols, shift: int, pre_tockens: int, next_tockens: int) -> torch.Tensor:
    """sparse_mode 4: ``-pre <= j - i - shift <= next`` (origin bottom-right)."""
    offset = cols - rows - shift
    return (offset >= -pre_tockens) & (offset <= next_tockens)


def _sequence_blocks(seq_q: list[int], seq_k: list[int]) -> list[tuple[int, int]]:
    """(queries, keys) of each TND sequence, from the cumulative sequence ends."""
    return [(b - a, d - c) for a, b, c, d in zip([0] + seq_q[:-1], seq_q, [0] + seq_k[:-1], seq_k)]


def _check_band_tockens(args: FusionAttentionArgs, seq_q, seq_k, sq: int, sk: int) -> None:
    """sparse_mode 4's rules on pre/next_tockens, for every (sequence's) block."""
    pre_tockens, next_tockens = args.pre_tockens, args.next_tockens
    if pre_tockens + next_tockens < 0:
        _fail(
            f"sparse_mode=4: pre_tockens={pre_tockens} and next_tockens={next_tockens} do not overlap"
        )
    blocks = _sequence_blocks(seq_q, seq_k) if args.layout == "TND" else [(sq, sk)]
    for n_q, n_k in blocks:
        if next_tockens < 0 and -next_tockens >= n_k:
            _fail(f"sparse_mode=4: |next_tockens|={-next_tockens} must be < Skv={n_k}")
        if pre_tockens < 0 and -pre_tockens >= n_q:
            _fail(f"sparse_mode=4: |pre_tockens|={-pre_tockens} must be < Sq={n_q}")


def _check_compressed(mask: torch.Tensor, sparse_mode: int) -> None:
    if tuple(mask.shape) != (COMPRESSED_MASK_SIZE, COMPRESSED_MASK_SIZE):
        _fail(
            f"sparse_mode={sparse_mode} requires the compressed {COMPRESSED_MASK_SIZE}x{COMPRESSED_MASK_SIZE} mask "
            f"triu(ones, 1), got shape {tuple(mask.shape)}"
        )
    if not torch.equal(mask.cpu(), _COMPRESSED_CPU):
        _fail(
            f"sparse_mode={sparse_mode}: the {COMPRESSED_MASK_SIZE}x{COMPRESSED_MASK_SIZE} mask is not triu(ones, diagonal=1)"
        )


def _check_empty_rows(args: FusionAttentionArgs, visible, seq_q, seq_k) -> torch.Tensor:
    """[B|1, N|1, Sq] bool of rows with no visible key; raise where the contract forbids them."""
    empty = ~visible.any(dim=-1)
    if args.layout == "TND":
        for i, (n_q, n_k) in enumerate(_sequence_blocks(seq_q, seq_k)):
            if args.sparse_mode == SparseMode.RIGHT_DOWN_CAUSAL and n_q > n_k:
                _fail(
                    f"TND sequence {i} has Sq={n_q} > Skv={n_k} with sparse_mode=3: varlen causal needs "
                    "Sq <= Skv for every sequence (inner_precise does not apply in TND)"
                )
        if bool(empty.any()):
            _fail(
                f"{int(empty.sum())} query rows see no key in TND; inner_precise does not apply in varlen"
            )
        return empty
    if (
        bool(empty.any())
        and args.inner_precise != 2
        and args.sparse_mode != SparseMode.RIGHT_DOWN_CAUSAL
    ):
        _fail(
            f"{int(empty.sum())} query rows are entirely masked with sparse_mode={args.sparse_mode} and "
            f"inner_precise={args.inner_precise}; the contract needs inner_precise=2 for such rows"
        )
    return empty

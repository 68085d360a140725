"""``npu_fusion_attention`` and its grad op as a contract double (pure PyTorch).

Written from the documented operator contract (``docs/npu-contract.md``: torch_npu 2.13's
op docs and meta registrations), not from our backend: it computes the math naively in
float64 and casts back, and it RAISES (:class:`NpuContractError`) on calls the contract
says are wrong or give silently wrong results on hardware, so a wrong call from our backend
fails a test instead of passing. Where the contract is silent, or the double does not
support an argument (``NotImplementedError``), its choices are listed in that page's
section "The doubles' choices" and asserted by tests/ops/test_npu_backend.py. The emulated
``torch_npu`` (:mod:`mcore_flash.emulation`) serves it; tests also use it directly on CPU
tensors::

    forward, grad = make_ops(calls := [])         # calls: one dict per op call
    out, smax, ssum, _, seed, offset, numels = forward(q, k, v, head_num, "BSND", scale=...)

Each op gathers its keyword arguments once, at entry, into a frozen
:class:`FusionAttentionArgs` (the grad op: :class:`FusionAttentionGradArgs`); the checks,
the visibility (mask and rows) logic and the recorded call (:func:`_call_record`) read
that. Internally q, k, v are canonical float64 ``[B, N, S, D]`` (TND: ``[1, N, T, D]``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar, Optional, Sequence

import torch

from mcore_flash.npu_contract import COMPRESSED_MASK_SIZE, MAX_TOCKENS, SparseMode

LAYOUTS = ("BSH", "SBH", "BSND", "BNSD", "TND")
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MASK_DTYPES = (torch.bool, torch.uint8)
FULL_MASK_MODES = (SparseMode.DEFAULT_MASK, SparseMode.ALL_MASK)  # the mask as given, SS..BNSS
COMPRESSED_MASK_MODES = (SparseMode.LEFT_UP_CAUSAL, SparseMode.RIGHT_DOWN_CAUSAL, SparseMode.BAND)
MODES_IN_THE_DOUBLE = FULL_MASK_MODES + COMPRESSED_MASK_MODES  # modes 5-8 raise NotImplementedError


class NpuContractError(RuntimeError):
    """A call that violates the documented npu_fusion_attention contract."""


def _fail(msg: str) -> None:
    raise NpuContractError("npu_fusion_attention (test double): " + msg)


def compressed_causal_mask(device=None) -> torch.Tensor:
    """The contract's compressed causal mask ``triu(ones(2048, 2048, bool), diagonal=1)``."""
    return torch.triu(
        torch.ones(COMPRESSED_MASK_SIZE, COMPRESSED_MASK_SIZE, dtype=torch.bool, device=device),
        diagonal=1,
    )


_COMPRESSED_CPU = compressed_causal_mask()


# ---- one call's arguments -------------------------------------------------------------------


@dataclass(frozen=True)
class DropoutDraw:
    """A call's dropout draw: ``seed + offset`` seeds its keep mask (:func:`dropout_keep`),
    ``numels`` is the mask's element count. All 0 without dropout (``keep_prob == 1``)."""

    seed: int = 0
    offset: int = 0
    numels: int = 0


@dataclass(frozen=True, eq=False)
class FusionAttentionArgs:
    """What one ``npu_fusion_attention`` call passed (the arguments the double reads), as
    given: nothing here is validated or converted (``sparse_mode`` stays the caller's int).

    ``query``/``key``/``value`` are in ``layout`` (the op's ``input_layout``, e.g. BSND
    ``[B, S, N, D]``); ``atten_mask`` is True where masked out; ``scale`` is the forward's
    ``scale``, the grad op's ``scale_value``; ``actual_seq_*len`` are the TND cumulative
    sequence ends. ``pse``, ``padding_mask``, ``prefix`` and ``sink`` are unsupported by the
    double (must be None); ``gen_mask_parallel`` and ``sync`` (scheduling hints) are not kept.
    """

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    head_num: int
    layout: str
    atten_mask: Optional[torch.Tensor]
    scale: float
    keep_prob: float
    pre_tockens: int
    next_tockens: int
    inner_precise: int
    actual_seq_qlen: Optional[Sequence[int]]
    actual_seq_kvlen: Optional[Sequence[int]]
    sparse_mode: int
    softmax_layout: str
    pse: Optional[torch.Tensor]
    padding_mask: Optional[torch.Tensor]
    prefix: Optional[Sequence[int]]
    sink: Optional[torch.Tensor]

    tensor_inputs: ClassVar[tuple[str, ...]] = ("query", "key", "value", "atten_mask")
    """The inputs a kernel reads in its layout, in the order a call record names them."""

    def noncontiguous(self) -> list[str]:
        """Names of the tensor inputs the kernel would have to copy into its layout first."""
        return [
            name
            for name in self.tensor_inputs
            if isinstance(getattr(self, name), torch.Tensor)
            and not getattr(self, name).is_contiguous()
        ]


@dataclass(frozen=True, eq=False)
class FusionAttentionGradArgs(FusionAttentionArgs):
    """What one ``npu_fusion_attention_grad`` call passed: the forward's arguments, plus
    ``dy`` (the gradient of the forward's output) and what the forward returned:
    ``attention_in`` (its output; both shaped and typed like ``query``), ``softmax_max`` and
    ``softmax_sum`` (float32 ``[B, N, Sq, 8]``, TND ``[T, N, 8]``; or merged over several
    calls) and its dropout draw. ``softmax_in`` (reserved, empty) is not kept."""

    dy: torch.Tensor
    attention_in: torch.Tensor
    softmax_max: torch.Tensor
    softmax_sum: torch.Tensor
    dropout: DropoutDraw

    tensor_inputs: ClassVar[tuple[str, ...]] = (
        "query",
        "key",
        "value",
        "dy",
        "attention_in",
        "atten_mask",
        "softmax_max",
        "softmax_sum",
    )


def _given_args(cls: type, call: dict, **named) -> FusionAttentionArgs:
    """``cls`` (:class:`FusionAttentionArgs` or :class:`FusionAttentionGradArgs`) of one op
    call, from ``call``: the op's ``locals()`` on entry, its arguments by name. Each field is
    the argument of its name, ``layout`` the op's ``input_layout``; ``named`` gives the fields
    the op names otherwise (the grad op's ``scale_value``, the dropout draw it replays)."""
    given = {"layout": call["input_layout"], **named}
    return cls(**{f.name: given[f.name] if f.name in given else call[f.name] for f in fields(cls)})


def _call_record(name: str, args: FusionAttentionArgs, dropout: DropoutDraw, score_shape) -> dict:
    """What one call passed, for tests and reports (``npu_double.calls``): the arguments as
    given, the input shapes and dtype, the mask's shape, the call's dropout draw (the
    forward's own, or the one the grad op replays), the canonical score shape
    ``[B, N, Sq, Skv]`` and the inputs the kernel would copy."""
    mask = args.atten_mask
    return {
        "name": name,
        "layout": args.layout,
        "head_num": args.head_num,
        "q_shape": tuple(args.query.shape),
        "k_shape": tuple(args.key.shape),
        "v_shape": tuple(args.value.shape),
        "dtype": args.query.dtype,
        "atten_mask": mask,
        "mask_shape": None if mask is None else tuple(mask.shape),
        "sparse_mode": args.sparse_mode,
        "scale": args.scale,
        "keep_prob": args.keep_prob,
        "pre_tockens": args.pre_tockens,
        "next_tockens": args.next_tockens,
        "inner_precise": args.inner_precise,
        "actual_seq_qlen": args.actual_seq_qlen,
        "actual_seq_kvlen": args.actual_seq_kvlen,
        "softmax_layout": args.softmax_layout,
        "seed": dropout.seed,
        "offset": dropout.offset,
        "numels": dropout.numels,
        "score_shape": tuple(score_shape),
        "noncontiguous": args.noncontiguous(),
    }


# ---- layouts ------------------------------------------------------------------------------


def _to_bnsd(x: torch.Tensor, layout: str, head_num: Optional[int], name: str) -> torch.Tensor:
    """Canonical [B, N, S, D] view of ``x`` (TND -> [1, N, T, D]). head_num splits H for BSH/SBH."""
    rank = 3 if layout in ("BSH", "SBH", "TND") else 4
    if x.dim() != rank:
        _fail(f"{name} must be {rank}-D for layout {layout}, got shape {tuple(x.shape)}")
    if layout == "BSND":
        return x.permute(0, 2, 1, 3)
    if layout == "BNSD":
        return x
    if layout == "TND":
        return x.permute(1, 0, 2).unsqueeze(0)
    if head_num is None:  # key/value of BSH/SBH: split by the query head_dim (set by caller)
        raise AssertionError
    h = x.shape[-1]
    if h % head_num:
        _fail(f"{name}: H={h} is not divisible by {head_num}")
    if layout == "BSH":
        b, s, _ = x.shape
        return x.reshape(b, s, head_num, h // head_num).permute(0, 2, 1, 3)
    s, b, _ = x.shape  # SBH
    return x.reshape(s, b, head_num, h // head_num).permute(1, 2, 0, 3)


def _from_bnsd(x: torch.Tensor, layout: str) -> torch.Tensor:
    """Inverse of :func:`_to_bnsd` (contiguous)."""
    b, n, s, d = x.shape
    if layout == "BSND":
        return x.permute(0, 2, 1, 3).contiguous()
    if layout == "BNSD":
        return x.contiguous()
    if layout == "TND":
        return x.squeeze(0).permute(1, 0, 2).contiguous()
    if layout == "BSH":
        return x.permute(0, 2, 1, 3).reshape(b, s, n * d).contiguous()
    return x.permute(2, 0, 1, 3).reshape(s, b, n * d).contiguous()  # SBH


def _canonical_qkv(args: FusionAttentionArgs):
    """Validate and return float64 [B, N, S, D] q, k, v plus (nq, nkv)."""
    query, key, value, head_num, layout = (
        args.query,
        args.key,
        args.value,
        args.head_num,
        args.layout,
    )
    if layout not in LAYOUTS:
        _fail(f"input_layout must be one of {LAYOUTS}, got {layout!r}")
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not isinstance(x, torch.Tensor):
            _fail(f"{name} must be a tensor, got {type(x).__name__}")
        if x.dtype not in DTYPES:
            _fail(f"{name} dtype {x.dtype} unsupported (float16, bfloat16, float32 only)")
    if not (query.dtype == key.dtype == value.dtype):
        _fail(f"query/key/value dtypes differ: {query.dtype}, {key.dtype}, {value.dtype}")
    if key.shape != value.shape:
        _fail(
            f"key and value must have the same shape, got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    if not isinstance(head_num, int) or isinstance(head_num, bool):
        _fail(f"head_num must be an int, got {type(head_num).__name__}")
    if layout in ("BSH", "SBH"):
        q = _to_bnsd(query, layout, head_num, "query")
        d = q.shape[-1]
        if key.dim() != 3 or key.shape[-1] % d:
            _fail(f"key H={key.shape[-1]} is not a multiple of the head dim {d}")
        k = _to_bnsd(key, layout, key.shape[-1] // d, "key")
        v = _to_bnsd(value, layout, value.shape[-1] // d, "value")
    else:
        q, k, v = (
            _to_bnsd(x, layout, None, n)
            for x, n in ((query, "query"), (key, "key"), (value, "value"))
        )
        if q.shape[1] != head_num:
            _fail(f"head_num={head_num} but query has {q.shape[1]} heads in layout {layout}")
    nq, nkv = q.shape[1], k.shape[1]
    if not 1 <= nq <= 256:
        _fail(f"query heads {nq} outside 1..256")
    if nkv == 0 or nq % nkv:
        _fail(f"query heads {nq} not a multiple of key/value heads {nkv}")
    if q.shape[0] != k.shape[0]:
        _fail(f"batch of query {q.shape[0]} != batch of key {k.shape[0]}")
    if q.shape[-1] != k.shape[-1]:
        _fail(f"head_dim of query {q.shape[-1]} != key {k.shape[-1]}")
    if not 1 <= q.shape[-1] <= 768:
        _fail(f"head_dim {q.shape[-1]} outside 1..768")
    return q.double(), k.double(), v.double(), nq, nkv


def _cum_list(x, name: str, total: int) -> list[int]:
    if not isinstance(x, (list, tuple)) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in x
    ):
        _fail(f"{name} must be a Python list/tuple of ints for TND, got {type(x).__name__}: {x!r}")
    x = list(x)
    if not x:
        _fail(f"{name} is empty")
    if any(b < a for a, b in zip([0] + x[:-1], x)):
        _fail(f"{name} must be cumulative (non-decreasing), got {x}")
    if x[-1] != total:
        _fail(f"{name}[-1]={x[-1]} must equal T={total}")
    return x


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


# ---- dropout --------------------------------------------------------------------------------


def dropout_keep(seed: int, offset: int, shape, keep_prob: float, device=None) -> torch.Tensor:
    """The bool keep mask of a call with this (seed, offset) over ``shape``."""
    gen = torch.Generator().manual_seed(int(seed) + int(offset))
    return (torch.rand(tuple(shape), generator=gen, dtype=torch.float64) < keep_prob).to(device)


def _draw_dropout(device, numels: int) -> DropoutDraw:
    """A forward's (seed, offset) from the default generator of ``device``, as the kernel
    draws them from the NPU's; offset is never 0, so a caller that drops it is caught."""
    seed = int(torch.randint(0, 2**31 - 1, (1,), device=device).item())
    offset = int(torch.randint(1, 2**20, (1,), device=device).item()) * 16
    return DropoutDraw(seed, offset, numels)


# ---- argument checks ------------------------------------------------------------------------


def _common_checks(args: FusionAttentionArgs) -> None:
    """The checks of the non-tensor arguments that forward and grad share."""
    if not isinstance(args.scale, (int, float)) or isinstance(args.scale, bool):
        _fail(f"scale must be a Python float, got {type(args.scale).__name__}")
    if not isinstance(args.keep_prob, (int, float)) or not 0.0 < args.keep_prob <= 1.0:
        _fail(f"keep_prob must be in (0, 1], got {args.keep_prob!r}")
    if args.inner_precise not in (0, 1, 2, 3):
        _fail(f"inner_precise must be 0..3, got {args.inner_precise!r}")
    if any(x is not None for x in (args.pse, args.padding_mask, args.prefix, args.sink)):
        raise NotImplementedError(
            "npu_double: pse / padding_mask / prefix / sink are unsupported in the double"
        )
    if args.softmax_layout not in ("", "TND"):
        _fail(f'only supported softmax_layout=TND (or the default ""), got {args.softmax_layout!r}')
    if args.softmax_layout == "TND" and args.layout != "TND":
        _fail("softmax_layout=TND only supported when input_layout_str=TND")
    if args.layout != "TND" and (
        args.actual_seq_qlen is not None or args.actual_seq_kvlen is not None
    ):
        _fail(f"actual_seq_qlen/actual_seq_kvlen are only for TND, got layout {args.layout}")


def _sequence_ends(
    args: FusionAttentionArgs, q, k
) -> tuple[Optional[list[int]], Optional[list[int]]]:
    """TND: the validated cumulative ends of the query and key sequences; (None, None) otherwise."""
    if args.layout != "TND":
        return None, None
    if args.actual_seq_qlen is None or args.actual_seq_kvlen is None:
        _fail("TND requires actual_seq_qlen and actual_seq_kvlen")
    sq_ = _cum_list(args.actual_seq_qlen, "actual_seq_qlen", q.shape[2])
    sk_ = _cum_list(args.actual_seq_kvlen, "actual_seq_kvlen", k.shape[2])
    if len(sq_) != len(sk_):
        _fail(f"actual_seq_qlen has {len(sq_)} sequences, actual_seq_kvlen {len(sk_)}")
    if sq_[0] == 0 and sk_[0] == 0:
        _fail(
            f"actual_seq_qlen/kvlen start with 0 ({sq_[:4]}...): they are cumulative ends WITHOUT the leading 0"
        )
    return sq_, sk_


def _check_grad_inputs(args: FusionAttentionGradArgs, q) -> None:
    """The grad op's ``dy`` and ``attention_in`` are shaped and typed like ``query``; its
    statistics are float32 ``[B, N, Sq, 8]`` (TND ``[T, N, 8]``), with ``q`` canonical
    ``[B, N, Sq, D]``."""
    query = args.query
    for name, x in (("dy", args.dy), ("attention_in", args.attention_in)):
        if not isinstance(x, torch.Tensor) or x.shape != query.shape or x.dtype != query.dtype:
            _fail(
                f"{name} must be a tensor shaped and typed like query {tuple(query.shape)} {query.dtype}"
            )
    b, nq, sq, _ = q.shape
    stat_shape = (sq, nq, 8) if args.layout == "TND" else (b, nq, sq, 8)
    for name, x in (("softmax_max", args.softmax_max), ("softmax_sum", args.softmax_sum)):
        if (
            not isinstance(x, torch.Tensor)
            or tuple(x.shape) != stat_shape
            or x.dtype != torch.float32
        ):
            _fail(
                f"{name} must be float32 {stat_shape}, got {getattr(x, 'dtype', None)} {tuple(getattr(x, 'shape', ()))}"
            )


# ---- statistics and scores ------------------------------------------------------------------


def _stats_out(row_stat: torch.Tensor, layout: str, softmax_layout: str) -> torch.Tensor:
    """Canonical ``[B, N, Sq]`` -> the op's float32 ``[B, N, Sq, 8]``, or TND ``[T, N, 8]``
    (data in ``[N, T, 8]`` order unless ``softmax_layout="TND"``)."""
    stat = row_stat.float().unsqueeze(-1).expand(*row_stat.shape, 8)
    if layout != "TND":
        return stat.contiguous()
    n, t = stat.shape[1], stat.shape[2]
    if softmax_layout == "TND":
        return stat.squeeze(0).transpose(0, 1).contiguous()
    return stat.squeeze(0).contiguous().view(t, n, 8)


def _stats_in(stat: torch.Tensor, layout: str, softmax_layout: str, n: int) -> torch.Tensor:
    """Inverse of :func:`_stats_out`: the op's statistics -> canonical ``[B, N, Sq, 8]`` float64."""
    if layout != "TND":
        return stat.double()
    t = stat.shape[0]
    if softmax_layout == "TND":
        return stat.transpose(0, 1).unsqueeze(0).double()
    return stat.reshape(n, t, 8).unsqueeze(0).double()


def _check_statistics(scores, visible, softmax_max, softmax_sum) -> None:
    """The grad op's statistics must be (row max, row sum) pairs, 8 identical copies each.

    ``scores`` ``[B, N, Sq, Skv]`` float64, masked entries -inf; statistics canonical
    ``[B, N, Sq, 8]``. For a row that sees a key here, ``softmax_max`` M is at least this
    call's largest score m; if M > m the maximum lies in keys of another call (merged
    statistics), whose ``exp(0)`` then adds at least 1 to ``softmax_sum`` beyond what this
    call's keys contribute. A logsumexp with sum 1 is neither.
    """
    for name, stat in (("softmax_max", softmax_max), ("softmax_sum", softmax_sum)):
        if not bool((stat == stat[..., :1]).all()):
            _fail(f"{name}: the 8 trailing values of each row must be identical copies")
    big, total = softmax_max[..., 0], softmax_sum[..., 0]
    seen = visible.expand(scores.shape).any(dim=-1)
    local_max = scores.amax(dim=-1)
    tol = 1e-4 * torch.clamp(local_max.abs(), min=1.0)
    local_sum = torch.exp(scores - torch.where(seen, big, 0.0).unsqueeze(-1)).sum(dim=-1)
    below = seen & (big < local_max - tol)
    if bool(below.any()):
        _fail(
            f"softmax_max is below the largest score of {int(below.sum())} rows: it is not a row maximum"
        )
    is_max = (big - local_max).abs() <= tol
    merged = total - local_sum >= 1.0 - 1e-3
    wrong = seen & ~(is_max | merged)
    if bool(wrong.any()):
        _fail(
            f"softmax_max of {int(wrong.sum())} rows is not a row maximum of the scores (a logsumexp with "
            "softmax_sum = 1?): pass the forward's softmax_max/softmax_sum, or (max, sum) pairs merged from them"
        )


def _scores(q, k, v, scale: float, visible):
    """K and V repeated to the query heads (GQA) and the scaled scores, -inf where not visible."""
    groups = q.shape[1] // k.shape[1]
    ke, ve = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    s = (q @ ke.transpose(-1, -2)) * float(scale)
    return ke, ve, s.masked_fill(~visible, float("-inf"))


# ---- the operators ----------------------------------------------------------------------------


def make_ops(record: list):
    """``(npu_fusion_attention, npu_fusion_attention_grad)`` appending one dict per call to ``record``."""

    def npu_fusion_attention(
        query,
        key,
        value,
        head_num,
        input_layout,
        *,
        pse=None,
        padding_mask=None,
        atten_mask=None,
        scale=1.0,
        keep_prob=1.0,
        pre_tockens=MAX_TOCKENS,
        next_tockens=MAX_TOCKENS,
        inner_precise=0,
        prefix=None,
        actual_seq_qlen=None,
        actual_seq_kvlen=None,
        sparse_mode=0,
        gen_mask_parallel=True,
        sync=False,
        softmax_layout="",
        sink=None,
        dropout_mask=None,
        seed=0,
        offset=0,
    ):
        """``-> (attention_out, softmax_max, softmax_sum, softmax_out, seed, offset, numels)``."""
        args = _given_args(FusionAttentionArgs, locals())
        q, k, v, _, _ = _canonical_qkv(args)
        _common_checks(args)
        if dropout_mask is not None or seed or offset:
            raise NotImplementedError(
                "npu_double: dropout_mask / seed / offset inputs are unsupported in the double"
            )
        seq_q, seq_k = _sequence_ends(args, q, k)
        visible = _visible(args, q, k, seq_q, seq_k)
        empty = _check_empty_rows(args, visible, seq_q, seq_k)
        ke, ve, s = _scores(q, k, v, scale, visible)
        row_max = s.amax(dim=-1)
        empty = empty.expand(row_max.shape)
        safe_max = torch.where(empty, 0.0, row_max)
        e = torch.exp(s - safe_max.unsqueeze(-1))
        row_sum = e.sum(dim=-1)
        p = e / torch.where(empty, 1.0, row_sum).unsqueeze(-1)

        dropout = DropoutDraw()
        if keep_prob < 1.0:
            dropout = _draw_dropout(query.device, p.numel())
            p = (
                p
                * dropout_keep(dropout.seed, dropout.offset, p.shape, keep_prob, p.device)
                / keep_prob
            )
        out = (p @ ve).to(query.dtype)

        max_out = torch.where(empty, float("-inf"), row_max)
        record.append(_call_record("npu_fusion_attention", args, dropout, p.shape))
        stats = [_stats_out(x, input_layout, softmax_layout) for x in (max_out, row_sum)]
        softmax_out = torch.empty(0, dtype=query.dtype, device=query.device)
        return (
            _from_bnsd(out, input_layout),
            stats[0],
            stats[1],
            softmax_out,
            dropout.seed,
            dropout.offset,
            dropout.numels,
        )

    def npu_fusion_attention_grad(
        query,
        key,
        value,
        dy,
        head_num,
        input_layout,
        *,
        pse=None,
        padding_mask=None,
        atten_mask=None,
        softmax_max=None,
        softmax_sum=None,
        softmax_in=None,
        attention_in=None,
        scale_value=1.0,
        keep_prob=1.0,
        pre_tockens=MAX_TOCKENS,
        next_tockens=MAX_TOCKENS,
        inner_precise=0,
        seed=0,
        offset=0,
        numels=0,
        prefix=None,
        actual_seq_qlen=None,
        actual_seq_kvlen=None,
        sparse_mode=0,
        gen_mask_parallel=True,
        sync=False,
        softmax_layout="",
        sink=None,
    ):
        """``-> (dq, dk, dv, dpse, dsink)``: ``dpse`` None, ``dsink`` empty, as torch_npu 2.13."""
        args = _given_args(
            FusionAttentionGradArgs,
            locals(),
            scale=scale_value,
            dropout=DropoutDraw(seed, offset, numels),
        )
        q, k, v, nq, nkv = _canonical_qkv(args)
        _common_checks(args)
        seq_q, seq_k = _sequence_ends(args, q, k)
        _check_grad_inputs(args, q)
        visible = _visible(args, q, k, seq_q, seq_k)
        empty = _check_empty_rows(args, visible, seq_q, seq_k)
        ke, ve, s = _scores(q, k, v, scale_value, visible)
        stats_max = _stats_in(softmax_max, input_layout, softmax_layout, nq)
        stats_sum = _stats_in(softmax_sum, input_layout, softmax_layout, nq)
        _check_statistics(s, visible, stats_max, stats_sum)
        smax, ssum = stats_max[..., 0], stats_sum[..., 0]
        do = _to_bnsd(dy, input_layout, head_num, "dy").double()
        o = _to_bnsd(attention_in, input_layout, head_num, "attention_in").double()
        p = torch.exp(s - smax.unsqueeze(-1)) / ssum.unsqueeze(-1)  # the GIVEN statistics
        p = torch.where(empty.expand(smax.shape).unsqueeze(-1), 0.0, p)

        dp = do @ ve.transpose(-1, -2)
        pd = p
        if keep_prob < 1.0:
            if numels != p.numel():
                _fail(
                    f"numels={numels} does not match this call's dropout size {p.numel()} (replay mismatch)"
                )
            z = dropout_keep(seed, offset, p.shape, keep_prob, p.device).double() / keep_prob
            pd, dp = p * z, dp * z
        delta = (do * o).sum(dim=-1, keepdim=True)
        ds = p * (dp - delta)
        dq = (ds @ ke) * float(scale_value)
        dke = (ds.transpose(-1, -2) @ q) * float(scale_value)
        dve = pd.transpose(-1, -2) @ do
        bk, _, skk, d = k.shape
        dk = dke.view(bk, nkv, nq // nkv, skk, d).sum(dim=2)
        dv = dve.view(bk, nkv, nq // nkv, skk, v.shape[-1]).sum(dim=2)
        record.append(_call_record("npu_fusion_attention_grad", args, args.dropout, p.shape))

        grads = (
            _from_bnsd(x, input_layout).to(like.dtype)
            for x, like in ((dq, query), (dk, key), (dv, value))
        )
        return (*grads, None, torch.empty(0, device=query.device))

    return npu_fusion_attention, npu_fusion_attention_grad

"""One ``npu_fusion_attention`` (or grad op) call's arguments as given, and the double's checks.

Each op gathers its keyword arguments once, at entry, into a frozen
:class:`FusionAttentionArgs` (the grad op: :class:`FusionAttentionGradArgs`); the checks,
the visibility logic and the recorded call (:func:`_call_record`) read that.
:func:`_canonical_qkv` gives q, k, v as canonical float64 ``[B, N, S, D]`` (TND:
``[1, N, T, D]``). A call outside the contract raises :class:`NpuContractError`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar, Optional, Sequence

import torch

LAYOUTS = ("BSH", "SBH", "BSND", "BNSD", "TND")
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class NpuContractError(RuntimeError):
    """A call that violates the documented npu_fusion_attention contract."""


def _fail(msg: str) -> None:
    raise NpuContractError("npu_fusion_attention (test double): " + msg)


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

"""``npu_fusion_attention`` and its grad op as a contract double (pure PyTorch).

Written from the documented operator contract (``shared/reference/npu-ops.md``, torch_npu
2.13's op docs and meta registrations), not from our backend: it computes the math naively
in float64 and casts back, and it RAISES (:class:`NpuContractError`) on calls the contract
says are wrong or give silently wrong results on hardware, so a wrong call from our backend
fails a test instead of passing. The emulated ``torch_npu`` (:mod:`mcore_flash.emulation`)
serves it; tests also use it directly on CPU tensors::

    forward, grad = make_ops(calls := [])         # calls: one dict per op call
    out, smax, ssum, _, seed, offset, numels = forward(q, k, v, head_num, "BSND", scale=...)

What it checks beyond shapes and dtypes:

* TND statistics are written as torch_npu 2.13 writes them by default
  (``softmax_layout=""``): shaped ``[T, N, 8]`` but with the data in ``[N, T, 8]`` order
  (``softmax_layout="TND"`` gives true ``[T, N, 8]`` order). In TND ``inner_precise`` does
  nothing: a fully masked row, or ``sparse_mode=3`` with ``Sq > Skv`` for a sequence, is an
  error whatever it says.
* The grad op takes the forward's own statistics or statistics merged from several calls
  (context parallelism): the 8 trailing copies must be identical, and ``softmax_max`` must
  be a row maximum - equal to the largest visible score of this call, or larger with
  ``softmax_sum`` then counting at least one more unit (the maximum's own ``exp(0)``) than
  this call's keys contribute. A logsumexp passed as ``softmax_max`` with ``softmax_sum=1``
  fails that check.
* Every call records which tensor inputs are not contiguous in their declared layout
  (``call["noncontiguous"]``): the kernel would copy them.

Choices where the contract is silent (documented here, asserted by tests/test_npu_backend.py):

* Dropout: the forward draws ``seed`` and ``offset`` from the default generator of the
  query's device, as the kernel does from the NPU's (so ``torch.manual_seed`` or megatron's
  RNG tracker make it reproducible; offset is deliberately nonzero so a caller that drops
  it is caught). The keep mask is ``torch.rand(shape, generator=
  Generator().manual_seed(seed + offset)) < keep_prob`` over the canonical score shape
  ``[B, N, Sq, Skv]`` (TND: ``[1, N, T, Tkv]``); ``numels`` is its element count. The grad
  op replays it from the (seed, offset, numels) it is given and raises if numels does
  not match. With keep_prob == 1, seed = offset = numels = 0 and no RNG is consumed.
* Fully masked rows (no visible key), dense layouts: allowed only with ``inner_precise=2``,
  or with ``sparse_mode=3`` (where the op switches it on itself; empty rows there come from
  Sq > Skv). Otherwise NpuContractError (hardware gives silently wrong rows). Such rows
  give ``attention_out = 0``, ``softmax_sum = 0``, ``softmax_max = -inf``; the grad op
  gives them probability 0 (zero gradients) whatever statistics it is handed.
* sparse_mode 0 with non-default tockens: the band (top-left aligned, key j visible to
  query i iff i - pre <= j <= i + next) must be implied by the mask, else NpuContractError;
  tockens without a mask, and sparse modes 5..8, raise NotImplementedError (unsupported
  in the double; our backend must never use them). TND takes no mask in modes 0/1 here.
* sparse_mode 4 (band, dense and TND per sequence): the compressed mask is required, origin
  bottom-right: key j visible to query i iff ``-pre <= j - i - (Skv - Sq) <= next``. The
  two tockens must overlap (``pre + next >= 0``), and a negative one must stay inside the
  block (``|next| < Skv``, ``|pre| < Sq``), else NpuContractError.
* Arguments past ``input_layout`` are keyword-only in both ops (torch_npu's forward also
  takes them positionally, but positions differ across CANN releases): a positional call
  raises TypeError. ``pse``, ``padding_mask``, ``prefix``, ``sink`` and ``dropout_mask``
  are unsupported here.
* ``softmax_out`` is ``torch.empty(0)``; the grad op returns ``(dq, dk, dv, dpse, dsink)``
  with ``dpse = None`` and ``dsink`` an empty tensor, as torch_npu 2.13 does.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

MAX_TOCKENS = 2147483647
COMPRESSED = 2048
LAYOUTS = ("BSH", "SBH", "BSND", "BNSD", "TND")
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MASK_DTYPES = (torch.bool, torch.uint8)


class NpuContractError(RuntimeError):
    """A call that violates the documented npu_fusion_attention contract."""


def _fail(msg: str) -> None:
    raise NpuContractError("npu_fusion_attention (test double): " + msg)


def compressed_causal_mask(device=None) -> torch.Tensor:
    """The contract's compressed causal mask ``triu(ones(2048, 2048, bool), diagonal=1)``."""
    return torch.triu(torch.ones(COMPRESSED, COMPRESSED, dtype=torch.bool, device=device), diagonal=1)


_COMPRESSED_CPU = compressed_causal_mask()


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


def _canonical_qkv(query, key, value, head_num, layout):
    """Validate and return float64 [B, N, S, D] q, k, v plus (nq, nkv)."""
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
        _fail(f"key and value must have the same shape, got {tuple(key.shape)} and {tuple(value.shape)}")
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
        q, k, v = (_to_bnsd(x, layout, None, n) for x, n in ((query, "query"), (key, "key"), (value, "value")))
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
    if not isinstance(x, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in x):
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


def _visible(q, k, layout, atten_mask, sparse_mode, pre_tockens, next_tockens, seq_q, seq_k):
    """Bool [B|1, N|1, Sq, Skv]: True where the key is visible to the query."""
    b, nq, sq, _ = q.shape
    sk = k.shape[2]
    dev = q.device
    if sparse_mode == 4:
        _check_band_tockens(pre_tockens, next_tockens, seq_q, seq_k, sq, sk, layout)
    if sparse_mode not in (0, 1, 2, 3, 4):
        raise NotImplementedError(f"npu_double: sparse_mode={sparse_mode} is unsupported in the double")
    if atten_mask is not None:
        if not isinstance(atten_mask, torch.Tensor) or atten_mask.dtype not in MASK_DTYPES:
            _fail(f"atten_mask must be a bool/uint8 tensor, got {getattr(atten_mask, 'dtype', type(atten_mask))}")
        if atten_mask.dtype == torch.uint8 and bool(((atten_mask != 0) & (atten_mask != 1)).any()):
            _fail("uint8 atten_mask must hold only 0/1")
        atten_mask = atten_mask.bool()

    if layout == "TND":
        same = torch.zeros(sq, sk, dtype=torch.bool, device=dev)
        rows = torch.arange(sq, device=dev).unsqueeze(-1)
        cols = torch.arange(sk, device=dev)
        q0 = k0 = 0
        for q1, k1 in zip(seq_q, seq_k):
            block = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool, device=dev)
            if atten_mask is not None and sparse_mode in (2, 3, 4):
                li, lj = rows[q0:q1] - q0, cols[k0:k1] - k0
                shift = 0 if sparse_mode == 2 else (k1 - k0) - (q1 - q0)
                block = _band(li, lj, shift, pre_tockens, next_tockens) if sparse_mode == 4 else lj <= li + shift
            same[q0:q1, k0:k1] = block
            q0, k0 = q1, k1
        if atten_mask is None:
            return same.view(1, 1, sq, sk)
        if sparse_mode in (0, 1):
            raise NotImplementedError("npu_double: TND with an atten_mask in sparse_mode 0/1 is unsupported in the double")
        _check_compressed(atten_mask, sparse_mode)
        return same.view(1, 1, sq, sk)

    if atten_mask is None:
        if sparse_mode == 0 and (pre_tockens != MAX_TOCKENS or next_tockens != MAX_TOCKENS):
            raise NotImplementedError("npu_double: tockens band without atten_mask is unsupported in the double")
        return torch.ones(1, 1, sq, sk, dtype=torch.bool, device=dev)  # FULL attention, any sparse_mode

    rows = torch.arange(sq, device=dev).unsqueeze(-1)
    cols = torch.arange(sk, device=dev)
    if sparse_mode in (2, 3):
        _check_compressed(atten_mask, sparse_mode)
        shift = 0 if sparse_mode == 2 else sk - sq
        return (cols <= rows + shift).view(1, 1, sq, sk)
    if sparse_mode == 4:
        _check_compressed(atten_mask, sparse_mode)
        return _band(rows, cols, sk - sq, pre_tockens, next_tockens).view(1, 1, sq, sk)

    # modes 0 / 1: a full mask, SS / 11SS / B1SS / BNSS (N = head_num)
    m = atten_mask
    ok = m.dim() == 2 and tuple(m.shape) == (sq, sk)
    if m.dim() == 4 and tuple(m.shape[2:]) == (sq, sk):
        ok = tuple(m.shape[:2]) in ((1, 1), (b, 1), (b, nq))
    if not ok:
        _fail(
            f"atten_mask shape {tuple(m.shape)} not accepted for sparse_mode={sparse_mode}: "
            f"use SS, 11SS, B1SS or BNSS = [{b}, {nq}, {sq}, {sk}]"
        )
    m4 = m.view(1, 1, sq, sk) if m.dim() == 2 else m
    if sparse_mode == 0 and (pre_tockens != MAX_TOCKENS or next_tockens != MAX_TOCKENS):
        outside = (cols < rows - pre_tockens) | (cols > rows + next_tockens)
        if bool((outside & ~m4).any()):
            _fail("sparse_mode=0: atten_mask does not agree with pre_tockens/next_tockens")
    return ~m4


def _band(rows, cols, shift: int, pre_tockens: int, next_tockens: int) -> torch.Tensor:
    """sparse_mode 4: ``-pre <= j - i - shift <= next`` (origin bottom-right)."""
    offset = cols - rows - shift
    return (offset >= -pre_tockens) & (offset <= next_tockens)


def _check_band_tockens(pre_tockens, next_tockens, seq_q, seq_k, sq, sk, layout) -> None:
    """sparse_mode 4's rules on pre/next_tockens, for every (sequence's) block."""
    if pre_tockens + next_tockens < 0:
        _fail(f"sparse_mode=4: pre_tockens={pre_tockens} and next_tockens={next_tockens} do not overlap")
    if layout == "TND":
        blocks = [(b - a, d - c) for a, b, c, d in zip([0] + seq_q[:-1], seq_q, [0] + seq_k[:-1], seq_k)]
    else:
        blocks = [(sq, sk)]
    for n_q, n_k in blocks:
        if next_tockens < 0 and -next_tockens >= n_k:
            _fail(f"sparse_mode=4: |next_tockens|={-next_tockens} must be < Skv={n_k}")
        if pre_tockens < 0 and -pre_tockens >= n_q:
            _fail(f"sparse_mode=4: |pre_tockens|={-pre_tockens} must be < Sq={n_q}")


def _check_compressed(mask: torch.Tensor, sparse_mode: int) -> None:
    if tuple(mask.shape) != (COMPRESSED, COMPRESSED):
        _fail(
            f"sparse_mode={sparse_mode} requires the compressed {COMPRESSED}x{COMPRESSED} mask "
            f"triu(ones, 1), got shape {tuple(mask.shape)}"
        )
    if not torch.equal(mask.cpu(), _COMPRESSED_CPU):
        _fail(f"sparse_mode={sparse_mode}: the {COMPRESSED}x{COMPRESSED} mask is not triu(ones, diagonal=1)")


def _check_empty_rows(visible, layout, inner_precise, sparse_mode, seq_q, seq_k) -> torch.Tensor:
    """[B|1, N|1, Sq] bool of rows with no visible key; raise where the contract forbids them."""
    empty = ~visible.any(dim=-1)
    if layout == "TND":
        starts_q, starts_k = [0] + seq_q[:-1], [0] + seq_k[:-1]
        for i, (q0, q1, k0, k1) in enumerate(zip(starts_q, seq_q, starts_k, seq_k)):
            if sparse_mode == 3 and q1 - q0 > k1 - k0:
                _fail(
                    f"TND sequence {i} has Sq={q1 - q0} > Skv={k1 - k0} with sparse_mode=3: varlen causal needs "
                    "Sq <= Skv for every sequence (inner_precise does not apply in TND)"
                )
        if bool(empty.any()):
            _fail(f"{int(empty.sum())} query rows see no key in TND; inner_precise does not apply in varlen")
        return empty
    if bool(empty.any()) and inner_precise != 2 and sparse_mode != 3:
        _fail(
            f"{int(empty.sum())} query rows are entirely masked with sparse_mode={sparse_mode} and "
            f"inner_precise={inner_precise}; the contract needs inner_precise=2 for such rows"
        )
    return empty


# ---- dropout --------------------------------------------------------------------------------


def dropout_keep(seed: int, offset: int, shape, keep_prob: float, device=None) -> torch.Tensor:
    """The bool keep mask of a call with this (seed, offset) over ``shape``."""
    gen = torch.Generator().manual_seed(int(seed) + int(offset))
    return (torch.rand(tuple(shape), generator=gen, dtype=torch.float64) < keep_prob).to(device)


def _common_checks(scale, keep_prob, inner_precise, pse, padding_mask, prefix, layout, qlen, kvlen, softmax_layout, sink):
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        _fail(f"scale must be a Python float, got {type(scale).__name__}")
    if not isinstance(keep_prob, (int, float)) or not 0.0 < keep_prob <= 1.0:
        _fail(f"keep_prob must be in (0, 1], got {keep_prob!r}")
    if inner_precise not in (0, 1, 2, 3):
        _fail(f"inner_precise must be 0..3, got {inner_precise!r}")
    if pse is not None or padding_mask is not None or prefix is not None or sink is not None:
        raise NotImplementedError("npu_double: pse / padding_mask / prefix / sink are unsupported in the double")
    if softmax_layout not in ("", "TND"):
        _fail(f"only supported softmax_layout=TND (or the default \"\"), got {softmax_layout!r}")
    if softmax_layout == "TND" and layout != "TND":
        _fail("softmax_layout=TND only supported when input_layout_str=TND")
    if layout != "TND" and (qlen is not None or kvlen is not None):
        _fail(f"actual_seq_qlen/actual_seq_kvlen are only for TND, got layout {layout}")


def _seqs(layout, q, k, actual_seq_qlen, actual_seq_kvlen):
    if layout != "TND":
        return None, None
    if actual_seq_qlen is None or actual_seq_kvlen is None:
        _fail("TND requires actual_seq_qlen and actual_seq_kvlen")
    sq_ = _cum_list(actual_seq_qlen, "actual_seq_qlen", q.shape[2])
    sk_ = _cum_list(actual_seq_kvlen, "actual_seq_kvlen", k.shape[2])
    if len(sq_) != len(sk_):
        _fail(f"actual_seq_qlen has {len(sq_)} sequences, actual_seq_kvlen {len(sk_)}")
    if sq_[0] == 0 and sk_[0] == 0:
        _fail(f"actual_seq_qlen/kvlen start with 0 ({sq_[:4]}...): they are cumulative ends WITHOUT the leading 0")
    return sq_, sk_


def _mask_summary(atten_mask) -> Any:
    if atten_mask is None:
        return None
    return tuple(atten_mask.shape)


# ---- the operators ----------------------------------------------------------------------------


def _noncontiguous(**tensors) -> list[str]:
    """Names of the tensor inputs the kernel would have to copy into its layout first."""
    return [name for name, x in tensors.items() if isinstance(x, torch.Tensor) and not x.is_contiguous()]


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
        _fail(f"softmax_max is below the largest score of {int(below.sum())} rows: it is not a row maximum")
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


def _call_record(name: str, args: dict, scale: float, score_shape, noncontiguous: list[str]) -> dict:
    """What one call passed (``args``: the op's local variables), for tests and reports."""
    query, key, value, atten_mask = args["query"], args["key"], args["value"], args["atten_mask"]
    record = dict(
        name=name, q_shape=tuple(query.shape), k_shape=tuple(key.shape), v_shape=tuple(value.shape),
        dtype=query.dtype, mask_shape=_mask_summary(atten_mask), scale=scale, score_shape=tuple(score_shape),
        noncontiguous=noncontiguous,
    )  # fmt: skip
    for field in ("layout", "head_num", "atten_mask", "sparse_mode", "keep_prob", "pre_tockens", "next_tockens",
                  "inner_precise", "actual_seq_qlen", "actual_seq_kvlen", "seed", "offset", "numels", "softmax_layout"):
        record[field] = args[field]  # fmt: skip
    return record


def make_ops(record: list):
    """``(npu_fusion_attention, npu_fusion_attention_grad)`` appending one dict per call to ``record``."""

    def npu_fusion_attention(
        query, key, value, head_num, input_layout, *, pse=None, padding_mask=None, atten_mask=None,
        scale=1.0, keep_prob=1.0, pre_tockens=MAX_TOCKENS, next_tockens=MAX_TOCKENS, inner_precise=0,
        prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0,
        gen_mask_parallel=True, sync=False, softmax_layout="", sink=None, dropout_mask=None, seed=0, offset=0,
    ):  # fmt: skip
        layout = input_layout
        q, k, v, nq, nkv = _canonical_qkv(query, key, value, head_num, layout)
        _common_checks(scale, keep_prob, inner_precise, pse, padding_mask, prefix, layout, actual_seq_qlen,
                       actual_seq_kvlen, softmax_layout, sink)  # fmt: skip
        if dropout_mask is not None or seed or offset:
            raise NotImplementedError("npu_double: dropout_mask / seed / offset inputs are unsupported in the double")
        seq_q, seq_k = _seqs(layout, q, k, actual_seq_qlen, actual_seq_kvlen)
        visible = _visible(q, k, layout, atten_mask, sparse_mode, pre_tockens, next_tockens, seq_q, seq_k)
        empty = _check_empty_rows(visible, layout, inner_precise, sparse_mode, seq_q, seq_k)
        ke, ve, s = _scores(q, k, v, scale, visible)
        row_max = s.amax(dim=-1)
        empty = empty.expand(row_max.shape)
        safe_max = torch.where(empty, 0.0, row_max)
        e = torch.exp(s - safe_max.unsqueeze(-1))
        row_sum = e.sum(dim=-1)
        p = e / torch.where(empty, 1.0, row_sum).unsqueeze(-1)

        seed = offset = numels = 0
        if keep_prob < 1.0:
            seed = int(torch.randint(0, 2**31 - 1, (1,), device=query.device).item())
            offset = int(torch.randint(1, 2**20, (1,), device=query.device).item()) * 16
            numels = p.numel()
            p = p * dropout_keep(seed, offset, p.shape, keep_prob, p.device) / keep_prob
        out = (p @ ve).to(query.dtype)

        max_out = torch.where(empty, float("-inf"), row_max)
        record.append(_call_record(
            "npu_fusion_attention", locals(), scale, p.shape,
            _noncontiguous(query=query, key=key, value=value, atten_mask=atten_mask),
        ))  # fmt: skip
        stats = [_stats_out(x, layout, softmax_layout) for x in (max_out, row_sum)]
        softmax_out = torch.empty(0, dtype=query.dtype, device=query.device)
        return (_from_bnsd(out, layout), stats[0], stats[1], softmax_out, seed, offset, numels)

    def npu_fusion_attention_grad(
        query, key, value, dy, head_num, input_layout, *, pse=None, padding_mask=None, atten_mask=None,
        softmax_max=None, softmax_sum=None, softmax_in=None, attention_in=None, scale_value=1.0,
        keep_prob=1.0, pre_tockens=MAX_TOCKENS, next_tockens=MAX_TOCKENS, inner_precise=0, seed=0,
        offset=0, numels=0, prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0,
        gen_mask_parallel=True, sync=False, softmax_layout="", sink=None,
    ):  # fmt: skip
        layout = input_layout
        q, k, v, nq, nkv = _canonical_qkv(query, key, value, head_num, layout)
        _common_checks(scale_value, keep_prob, inner_precise, pse, padding_mask, prefix, layout, actual_seq_qlen,
                       actual_seq_kvlen, softmax_layout, sink)  # fmt: skip
        seq_q, seq_k = _seqs(layout, q, k, actual_seq_qlen, actual_seq_kvlen)
        for name, x in (("dy", dy), ("attention_in", attention_in)):
            if not isinstance(x, torch.Tensor) or x.shape != query.shape or x.dtype != query.dtype:
                _fail(f"{name} must be a tensor shaped and typed like query {tuple(query.shape)} {query.dtype}")
        b, _, sq, _ = q.shape
        stat_shape = (sq, nq, 8) if layout == "TND" else (b, nq, sq, 8)
        for name, x in (("softmax_max", softmax_max), ("softmax_sum", softmax_sum)):
            if not isinstance(x, torch.Tensor) or tuple(x.shape) != stat_shape or x.dtype != torch.float32:
                _fail(f"{name} must be float32 {stat_shape}, got {getattr(x, 'dtype', None)} {tuple(getattr(x, 'shape', ()))}")
        visible = _visible(q, k, layout, atten_mask, sparse_mode, pre_tockens, next_tockens, seq_q, seq_k)
        empty = _check_empty_rows(visible, layout, inner_precise, sparse_mode, seq_q, seq_k)
        ke, ve, s = _scores(q, k, v, scale_value, visible)
        stats_max = _stats_in(softmax_max, layout, softmax_layout, nq)
        stats_sum = _stats_in(softmax_sum, layout, softmax_layout, nq)
        _check_statistics(s, visible, stats_max, stats_sum)
        smax, ssum = stats_max[..., 0], stats_sum[..., 0]
        do = _to_bnsd(dy, layout, head_num, "dy").double()
        o = _to_bnsd(attention_in, layout, head_num, "attention_in").double()
        p = torch.exp(s - smax.unsqueeze(-1)) / ssum.unsqueeze(-1)  # the GIVEN statistics
        p = torch.where(empty.expand(smax.shape).unsqueeze(-1), 0.0, p)

        dp = do @ ve.transpose(-1, -2)
        pd = p
        if keep_prob < 1.0:
            if numels != p.numel():
                _fail(f"numels={numels} does not match this call's dropout size {p.numel()} (replay mismatch)")
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
        record.append(_call_record(
            "npu_fusion_attention_grad", locals(), scale_value, p.shape,
            _noncontiguous(
                query=query, key=key, value=value, dy=dy, attention_in=attention_in, atten_mask=atten_mask,
                softmax_max=softmax_max, softmax_sum=softmax_sum,
            ),
        ))  # fmt: skip

        grads = (_from_bnsd(x, layout).to(like.dtype) for x, like in ((dq, query), (dk, key), (dv, value)))
        return (*grads, None, torch.empty(0, device=query.device))

    return npu_fusion_attention, npu_fusion_attention_grad

"""``FlashDotProductAttention``: a drop-in ``core_attention`` for megatron-core.

Replaces Megatron's ``DotProductAttention`` (which materialises ``[b, np, sq, sk]``
scores) with :func:`mcore_flash.ops.flash_attn_func`: only ``q, k, v, out`` and the
float32 logsumexp are kept for backward. Megatron's interface is kept exactly: inputs
``[sq, b, np, hn]`` (query) and ``[sk, b, ng, hn]`` (key/value, GQA not expanded), output
``[sq, b, np * hn]``; packed (THD) ``[t, np, hn]`` -> ``[t, np * hn]``; ``np``/``ng`` per
tensor-parallel rank; ``attention_mask`` bool, True = masked out.

Beyond the stock module it runs context parallelism (``context_parallel_size > 1``: ring or
Ulysses over Megatron's CP group), packed documents at any CP size, and sliding windows
(``config.window_size``) in the kernel. :class:`FlashDotProductAttention` states the
conventions and each path; ``docs/megatron-spec.md`` the tests behind them.

Differences from the stock module: causal is aligned bottom-right when ``sq != sk``
(flash-attn >= 2.1; identical when ``sq == sk``), and a query row whose keys are all
masked gives 0 (Megatron's -10000 fill gives a uniform average).
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention

from mcore_flash.ops import backend_names, checks, flash_attn_func
from mcore_flash.ops.context_parallel import (
    COMM_TYPES,
    context_parallel_attn_func,
    context_parallel_varlen_attn_func,
    split_for_cp_rank,
)

Tensor = torch.Tensor

_CAUSAL_TYPES = tuple(
    t for t in (AttnMaskType.causal, getattr(AttnMaskType, "causal_bottom_right", None)) if t
)


class FlashDotProductAttention(MegatronModule):
    """Fused-kernel core attention with Megatron's ``DotProductAttention`` interface.

    Megatron conventions kept exactly:

    * inputs ``[sq, b, np, hn]`` (query) and ``[sk, b, ng, hn]`` (key/value, GQA not
      expanded), output ``[sq, b, np * hn]``; packed (THD) inputs ``[t, np, hn]``, output
      ``[t, np * hn]``. ``np``/``ng`` are per tensor-parallel rank.
    * ``attention_mask`` is bool with True = masked out, broadcastable to ``[b, 1, sq, sk]``.
      A mask equal to the causal one takes the fused causal path (no mask tensor reaches the
      kernel); ``attention_mask=None`` follows ``attn_mask_type``; any other mask is honoured
      as given.
    * ``softmax_scale`` defaults to ``1/sqrt(kv_channels)``. ``apply_query_key_layer_scaling``
      divides the scores by ``layer_number`` and Megatron's softmax multiplies them back in
      fp32, so it does not change the result; the fused kernel always accumulates in fp32, so
      it is accepted and has no effect.
    * attention dropout is drawn inside ``get_cuda_rng_tracker().fork()`` when sequence
      parallel is off (as Megatron does): different per TP rank, replayed by recompute.

    Context parallelism: :meth:`_context_parallel_forward`; packed documents:
    :meth:`_packed_forward`; sliding windows: :func:`_layer_window_size`.

    Inference with megatron's static KV cache (``StaticInferenceContext``; ``mcore-flash
    generate``): megatron-core 0.16 and 0.19 pass the prompt as causal self-attention
    (``sq == sk``), then each new token's query alone against every cached key (``sq = 1``,
    ``sk`` = the tokens so far) with ``attn_mask_type=no_mask``, ``attention_mask=None`` and
    no ``packed_seq_params``. Both take the dense path as they are: the one query sees every
    key, as the last row of causal attention over the whole sequence does (sliding windows
    count back from it, bottom-right). A causal call with ``sq < sk`` (several new tokens
    against a cache; megatron's static cache sends none, which is why it feeds one token at a
    time after the prompt) is aligned bottom-right too: the last ``sq`` rows of causal
    attention (``test_kv_cache_calls_give_the_last_rows_of_causal_attention``).
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str = "self",
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
        backend: Optional[str] = None,
        **kwargs,
    ):
        super().__init__(config=config)
        tp_size = _tensor_parallel_size(pg_collection)
        heads, groups = (
            config.num_attention_heads,
            config.num_query_groups or config.num_attention_heads,
        )
        _check_heads(heads, groups, tp_size)
        self.cp_group, self.cp_comm_type = None, None
        if config.context_parallel_size > 1:
            self.cp_comm_type = _check_cp_comm_type(cp_comm_type, config.context_parallel_size)
            self.cp_group = _context_parallel_group(pg_collection, config.context_parallel_size)
            if self.cp_comm_type == "a2a":
                _check_a2a_heads(heads, groups, tp_size, config.context_parallel_size)
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError(
                f"softmax_type={config.softmax_type!r} is not supported by the fused kernel; use 'vanilla'"
            )
        if backend is not None and backend not in backend_names():
            raise ValueError(
                f"attention backend {backend!r} is unknown; choose one of {backend_names()} or None"
            )

        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.backend = backend
        self.num_attention_heads_per_partition = heads // tp_size
        self.num_query_groups_per_partition = max(1, groups // tp_size)
        self.hidden_size_per_attention_head = config.kv_channels
        self.softmax_scale = (
            softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        )
        self.dropout_p = (
            config.attention_dropout if attention_dropout is None else attention_dropout
        )
        self.window_size = _layer_window_size(config, self.layer_number)
        # set by FlashTransformerLayer while a forward runs under the qkv recompute boundary
        self.qkv_recompute = None

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params=None,
        **kwargs,
    ) -> Tensor:
        """``[sq, b, np, hn]`` (or packed ``[t, np, hn]``) -> ``[sq, b, np*hn]``
        (``[t, np*hn]``)."""
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by FlashDotProductAttention")
        causal_type = (attn_mask_type or self.attn_mask_type) in _CAUSAL_TYPES
        dropout_p = self.dropout_p if self.training else 0.0
        with self._dropout_rng(dropout_p):
            if packed_seq_params is not None:
                return self._packed_forward(
                    query, key, value, attention_mask, causal_type, dropout_p, packed_seq_params
                )
            if self.cp_group is not None:
                return self._context_parallel_forward(
                    query, key, value, attention_mask, causal_type, dropout_p
                )
            return self._dense_forward(query, key, value, attention_mask, causal_type, dropout_p)

    def _dense_forward(self, query, key, value, attention_mask, causal_type, dropout_p) -> Tensor:
        sq, b, np_, hn = query.shape
        causal, mask = _resolve_mask(attention_mask, causal_type, b, np_, sq, key.shape[0])
        # q, k, v are views into Megatron's fused QKV projection output; contiguous copies
        # let the kernel keep [s, b, n, d] each instead of that whole buffer for backward,
        # and are what the NPU kernel takes as "SBH" without another copy.
        query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
        with self._kernel_scope(query, key, value):
            out = flash_attn_func(
                query,
                key,
                value,
                dropout_p=dropout_p,
                softmax_scale=self.softmax_scale,
                causal=causal,
                window_size=self.window_size,
                backend=self.backend,
                attn_mask=mask,
                layout="sbhd",
            )  # [sq, b, np, hn]
        return out.reshape(sq, b, np_ * hn)

    def _packed_forward(
        self, query, key, value, attention_mask, causal_type, dropout_p, params
    ) -> Tensor:
        """Packed documents (``packed_seq_params``, THD ``[t, np, hn]``; Megatron-LM's
        ``--reset-attention-mask``): the kernel runs per document over ``cu_seqlens_q_padded``
        (else ``cu_seqlens_q``), at any CP size through
        :func:`mcore_flash.ops.context_parallel.context_parallel_varlen_attn_func` (each rank
        holds chunks ``r`` and ``2cp-1-r`` of every document;
        :mod:`mcore_flash.transformer.packed_sequences` builds such batches)."""
        cu_seqlens = _packed_layout(params, attention_mask, causal_type)
        # as in the dense path: [t, n, d] copies out of the fused QKV buffer, the NPU's "TND"
        query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
        with self._kernel_scope(query, key, value):
            out = context_parallel_varlen_attn_func(
                query,
                key,
                value,
                cu_seqlens,
                self.cp_group,
                causal=causal_type,
                softmax_scale=self.softmax_scale,
                dropout_p=dropout_p,
                comm_type=self.cp_comm_type or "p2p",
                backend=self.backend,
                window_size=self.window_size,
            )  # [t, np, hn]
        return out.reshape(out.shape[0], -1)

    def _context_parallel_forward(self, query, key, value, attention_mask, causal_type, dropout_p):
        """The sequence is split over the CP group (chunks r and 2cp-1-r of 2cp on rank r).

        Context parallelism (``context_parallel_size > 1``; the stock module refuses it): each
        rank holds chunks ``r`` and ``2cp-1-r`` of ``2cp`` of the sequence (Megatron's
        ``get_batch_on_this_cp_rank``; :mod:`mcore_flash.transformer.context_parallel` for the
        trainer), and :func:`mcore_flash.ops.context_parallel.context_parallel_attn_func` runs
        over Megatron's CP group (``pg_collection.cp``, else ``parallel_state``):
        ``cp_comm_type`` "p2p" (default; ring with K/V passing) or "a2a" (Ulysses; heads
        divisible by TP x CP). Causal and unmasked attention only (an explicit mask must be the
        causal one)."""
        cp_size = self.cp_group.size()
        sq, b, np_, hn = query.shape
        if key.shape[0] != sq:
            raise ValueError(
                f"context parallelism needs self-attention over one sequence: query has {sq} tokens "
                f"per rank, key/value {key.shape[0]}"
            )
        if sq % 2:
            raise ValueError(
                f"{sq} tokens per context-parallel rank is odd: --seq-length must be divisible by "
                f"2 x --context-parallel-size = {2 * cp_size} (split batches with "
                "mcore_flash.transformer.context_parallel.get_batch_on_this_cp_rank)"
            )
        causal = _resolve_cp_mask(attention_mask, causal_type, b, sq, cp_size, self.cp_group.rank())
        query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
        with self._kernel_scope(query, key, value):
            out = context_parallel_attn_func(
                query,
                key,
                value,
                self.cp_group,
                causal=causal,
                softmax_scale=self.softmax_scale,
                dropout_p=dropout_p,
                comm_type=self.cp_comm_type,
                backend=self.backend,
                layout="sbhd",
                window_size=self.window_size,
            )  # [sq, b, np, hn]
        return out.reshape(sq, b, np_ * hn)

    def _kernel_scope(self, query: Tensor, key: Tensor, value: Tensor):
        """The qkv recompute boundary's scope around the kernel call, if one is active."""
        if self.qkv_recompute is None:
            return contextlib.nullcontext()
        return self.qkv_recompute.kernel(query, key, value)

    def _dropout_rng(self, dropout_p: float):
        """Megatron's RNG scope for attention dropout (tracker fork unless sequence parallel)."""
        if dropout_p > 0 and not self.config.sequence_parallel:
            return tensor_parallel.get_cuda_rng_tracker().fork()
        return contextlib.nullcontext()


def _layer_window_size(config, layer_number: int) -> tuple[int, int]:
    """This layer's ``(left, right)`` window (-1 = unbounded): ``config.window_size`` where
    megatron's ``is_layer_window_attention`` (``window_attn_skip_freq``) makes it a
    sliding-window layer, else unbounded. Under a causal mask type the right side is 0.

    Sliding windows: ``config.window_size = (left, right)`` (-1 = unbounded; the layers
    ``window_attn_skip_freq`` picks, as megatron's ``is_layer_window_attention`` decides) runs
    flash-attn's bottom-right window in the kernel -- dense, packed and under context
    parallelism (ring: chunk pairs outside every window are skipped, for packed documents per
    document). With a causal mask type the right side is 0, as in flash-attn (Megatron's own
    mask would take ``right`` as given)."""
    window = getattr(config, "window_size", None)
    if window is None or not is_layer_window_attention(
        window, getattr(config, "window_attn_skip_freq", None), layer_number
    ):
        return (-1, -1)
    try:
        return checks.check_window_size(window)
    except ValueError as error:
        raise ValueError(f"config.window_size (--window-size): {error}") from None


def _packed_layout(params, attention_mask: Optional[Tensor], causal: bool) -> Tensor:
    """The cumulative document lengths the kernel runs over (THD ``PackedSeqParams``).

    ``cu_seqlens_q_padded`` (the rows as laid out, what megatron's THD RoPE and the CP split
    use) when given, else ``cu_seqlens_q``. Padding at the end of a document is sound only
    under causal attention (no real row sees it); self-attention only (q and kv alike).
    """
    if getattr(params, "qkv_format", "thd") != "thd":
        raise ValueError(
            f"packed_seq_params.qkv_format={params.qkv_format!r}: only 'thd' is supported"
        )
    if attention_mask is not None:
        raise ValueError(
            "packed sequences (THD) take no attention_mask: document boundaries come from cu_seqlens "
            "(--reset-attention-mask builds them from EOD tokens; an arbitrary 4D mask cannot be combined)"
        )
    layouts = []
    for name in ("q", "kv"):
        actual = getattr(params, f"cu_seqlens_{name}")
        padded = getattr(params, f"cu_seqlens_{name}_padded", None)
        if padded is not None and not causal and not torch.equal(padded.cpu(), actual.cpu()):
            raise ValueError(
                f"cu_seqlens_{name}_padded != cu_seqlens_{name}: padded documents need causal attention "
                "(the padding follows every real token of its document); use a causal attn_mask_type"
            )
        layouts.append(actual if padded is None else padded)
    if not torch.equal(layouts[0].cpu(), layouts[1].cpu()):
        raise ValueError(
            "packed sequences: cu_seqlens of q and kv must be equal (self-attention over one pack)"
        )
    return layouts[0]


def _tensor_parallel_size(pg_collection) -> int:
    """TP size from megatron's process-group collection, else from ``parallel_state``."""
    tp_group = getattr(pg_collection, "tp", None)
    if tp_group is not None:
        return tp_group.size()
    return parallel_state.get_tensor_model_parallel_world_size()


def _check_heads(heads: int, groups: int, tp_size: int) -> None:
    if heads % tp_size != 0:
        raise ValueError(
            f"num_attention_heads ({heads}) must be divisible by tensor_model_parallel_size ({tp_size}); "
            "change --num-attention-heads or --tensor-model-parallel-size"
        )
    if heads % groups != 0:
        raise ValueError(
            f"num_query_groups ({groups}) must divide num_attention_heads ({heads}); change --num-query-groups"
        )
    if groups >= tp_size and groups % tp_size != 0:
        raise ValueError(
            f"num_query_groups ({groups}) must be divisible by tensor_model_parallel_size ({tp_size}) "
            "(or smaller than it, then key/value heads are replicated); change --num-query-groups"
        )


def _check_cp_comm_type(cp_comm_type, cp_size: int) -> str:
    """``None`` -> "p2p" (Megatron's default); only the algorithms we implement pass."""
    if cp_comm_type is None:
        return "p2p"
    if cp_comm_type not in COMM_TYPES:
        raise ValueError(
            f"cp_comm_type={cp_comm_type!r} is not supported by FlashDotProductAttention with "
            f"--context-parallel-size {cp_size}; use --cp-comm-type p2p (ring) or --cp-comm-type a2a (Ulysses)"
        )
    return cp_comm_type


def _context_parallel_group(pg_collection, cp_size: int):
    """Megatron's CP group: ``pg_collection.cp``, else from ``parallel_state``."""
    group = getattr(pg_collection, "cp", None)
    if group is None:
        group = parallel_state.get_context_parallel_group(check_initialized=False)
    if group is None:
        raise ValueError(
            f"context_parallel_size={cp_size} but no context-parallel process group exists: initialise "
            f"megatron with initialize_model_parallel(context_parallel_size={cp_size}) "
            f"(--context-parallel-size {cp_size}) or pass pg_collection with a cp group; "
            "otherwise use --context-parallel-size 1"
        )
    if group.size() != cp_size:
        raise ValueError(
            f"context_parallel_size={cp_size} in the config but the context-parallel group has "
            f"{group.size()} ranks; pass the same --context-parallel-size to the config and to "
            "initialize_model_parallel"
        )
    return group


def _check_a2a_heads(heads: int, groups: int, tp_size: int, cp_size: int) -> None:
    """Ulysses splits each TP rank's heads over the CP ranks."""
    if heads % (tp_size * cp_size):
        raise ValueError(
            f"--cp-comm-type a2a splits the attention heads over tensor x context parallel ranks: "
            f"num_attention_heads ({heads}) must be divisible by --tensor-model-parallel-size x "
            f"--context-parallel-size = {tp_size} x {cp_size}; change --num-attention-heads or "
            "--context-parallel-size, or use --cp-comm-type p2p"
        )
    groups_per_rank = max(1, groups // tp_size)
    if groups_per_rank % cp_size and cp_size % groups_per_rank:
        raise ValueError(
            f"--cp-comm-type a2a: {groups_per_rank} key/value heads per tensor-parallel rank can neither be "
            f"split over nor replicated to --context-parallel-size {cp_size} ranks; change "
            "--num-query-groups or --context-parallel-size, or use --cp-comm-type p2p"
        )


def _resolve_cp_mask(
    mask: Optional[Tensor], causal_type: bool, b: int, sq: int, cp_size: int, cp_rank: int
) -> bool:
    """Whether the context-parallel attention is causal; only masks the ring can honour pass.

    ``None`` -> the mask type decides. Otherwise the mask must be the causal one: either the
    whole ``[b|1, 1, S, S]`` mask, or its rows for this rank's tokens ``[b|1, 1, sq, S]`` (what
    Megatron's ``get_batch_on_this_cp_rank`` leaves of it), with ``S = sq * cp``; an all-False
    mask means no masking.
    """
    if mask is None:
        return causal_type
    total = sq * cp_size
    shape_ok = mask.dim() == 4 and mask.shape[0] in (1, b) and mask.shape[1] == 1
    if (
        mask.dtype != torch.bool
        or not shape_ok
        or tuple(mask.shape[-2:]) not in ((sq, total), (total, total))
    ):
        raise ValueError(
            f"attention_mask of dtype {mask.dtype} and shape {tuple(mask.shape)} cannot be honoured with "
            f"context parallelism (--context-parallel-size {cp_size}): the ring computes causal or unmasked "
            f"attention only, and accepts a bool causal mask [b|1, 1, {total}, {total}] or its rows for this "
            f"rank [b|1, 1, {sq}, {total}]. Build batches without an attention mask (causal attn_mask_type), "
            "or use --context-parallel-size 1 for arbitrary masks"
        )
    if not mask.any():
        return False
    positions = torch.arange(total, device=mask.device)
    rows = (
        positions if mask.shape[-2] == total else split_for_cp_rank(positions, 0, cp_size, cp_rank)
    )
    causal = positions.unsqueeze(0) > rows.unsqueeze(-1)
    if bool((mask == causal).all()):
        return True
    raise ValueError(
        f"attention_mask is neither causal nor empty: an arbitrary mask cannot be honoured with context "
        f"parallelism (--context-parallel-size {cp_size}); use --context-parallel-size 1 for such masks"
    )


def _resolve_mask(
    mask: Optional[Tensor], causal_type: bool, b: int, heads: int, sq: int, sk: int
) -> tuple[bool, Optional[Tensor]]:
    """``(causal, mask for the kernel)`` from Megatron's mask and mask type.

    No mask -> the mask type decides. A mask equal to the causal mask -> fused causal with
    no mask tensor (checked exactly; the check is linear in the mask's size, which the
    caller already paid for). Anything else is passed on as ``[b|1, np|1, sq, sk]``.
    """
    if mask is None:
        return causal_type, None
    if mask.dtype != torch.bool:
        raise TypeError(f"attention_mask must be bool (True = masked out), got {mask.dtype}")
    if (
        mask.dim() != 4
        or mask.shape[0] not in (1, b)
        or mask.shape[1] not in (1, heads)
        or mask.shape[2] not in (1, sq)
        or mask.shape[3] != sk
    ):
        raise ValueError(
            f"attention_mask shape {tuple(mask.shape)} is not supported: use [b|1, 1, sq|1, sk] = "
            f"[{b}|1, 1, {sq}|1, {sk}] (True = masked out)"
        )
    mask = mask.expand(mask.shape[0], mask.shape[1], sq, sk)
    if sq == sk and _is_causal(mask):
        return True, None
    return False, mask


def _is_causal(mask: Tensor) -> bool:
    """Whether every ``[sq, sk]`` slice of ``mask`` is the upper-triangular causal mask."""
    sq, sk = mask.shape[-2:]
    if not (mask[..., 0, -1].all() and not mask[..., -1, :].any()):  # cheap rejection first
        return False
    causal = torch.ones(sq, sk, dtype=torch.bool, device=mask.device).triu_(1)
    return bool((mask == causal).all())

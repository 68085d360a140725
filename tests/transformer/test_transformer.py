"""FlashDotProductAttention and the flash GPT spec against megatron-core itself.

Oracles: Megatron's stock local spec (same weights), the TP=1 run for TP=2 (+SP, GQA),
and each sequence run alone for packed sequences.
"""

from __future__ import annotations

import types

import pytest
import torch

from _support.dist_utils import init_megatron, run_distributed, teardown_megatron
from _support.gpt_models import (
    batch,
    build_gpt,
    causal_mask,
    flash_gpt,
    full_grads,
    full_weights,
    load_full_weights,
    tiny_config,
)

ATOL = 1e-5


def _loss_and_grads(model, mask):
    tokens, labels, positions = batch()
    loss = model(tokens, positions, mask, labels=labels)
    loss.mean().backward()
    return loss.detach(), full_grads(model)


def _w_stock_vs_flash(rank, world_size, with_mask, fused_swiglu):
    init_megatron(tp=1)
    try:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        stock = build_gpt(tiny_config(), get_gpt_layer_local_spec(normalization="RMSNorm"))
        ours = flash_gpt(tiny_config(use_te_activation_func=fused_swiglu))
        ours.load_state_dict(stock.state_dict(), strict=True)
        mask = causal_mask() if with_mask else None
        return _loss_and_grads(stock, mask), _loss_and_grads(ours, mask)
    finally:
        teardown_megatron()


@pytest.mark.parametrize(
    "with_mask,fused_swiglu",
    [(True, False), (False, False), (False, True)],
    ids=["causal-mask", "mask-none", "mask-none-fused-swiglu"],
)
def test_matches_megatron_stock_local_spec(with_mask, fused_swiglu):
    (stock_loss, stock_grads), (loss, grads) = run_distributed(
        _w_stock_vs_flash, 1, with_mask, fused_swiglu
    )[0]
    torch.testing.assert_close(loss, stock_loss, atol=ATOL, rtol=1e-5)
    assert grads.keys() == stock_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], stock_grads[name], atol=ATOL, rtol=1e-4, msg=name)


def _w_tensor_parallel(rank, world_size, sequence_parallel, groups, use_ddp, weights=None):
    """Loss and full grads at TP=world_size; with ``weights`` (a TP=1 model's, else this
    run's own are returned) copied in over a model initialised from another seed."""
    init_megatron(tp=world_size)
    try:
        config = tiny_config(
            tensor_model_parallel_size=world_size,
            sequence_parallel=sequence_parallel,
            num_query_groups=groups,
        )
        model = flash_gpt(config, seed=0 if weights is None else 7)
        if weights is not None:
            load_full_weights(model, weights)
        if use_ddp:
            from megatron.core.distributed import (
                DistributedDataParallel,
                DistributedDataParallelConfig,
                finalize_model_grads,
            )

            model = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
        result = _loss_and_grads(model, causal_mask())
        if use_ddp:
            finalize_model_grads([model])
            result = (result[0], full_grads(model))
        sp_norms = sorted(
            n for n, p in model.named_parameters() if getattr(p, "sequence_parallel", False)
        )
        return result, sp_norms, full_weights(model) if weights is None else None
    finally:
        teardown_megatron()


@pytest.mark.parametrize(
    "sequence_parallel,groups",
    [(False, 2), (True, 2), (False, 1), (True, 4)],
    ids=["tp2-gqa2", "tp2-sp-gqa2", "tp2-mqa", "tp2-sp-mha"],
)
def test_tensor_parallel_matches_single_rank(sequence_parallel, groups):
    (ref_loss, ref_grads), _, weights = run_distributed(
        _w_tensor_parallel, 1, False, groups, False
    )[0]
    results = run_distributed(
        _w_tensor_parallel, 2, sequence_parallel, groups, sequence_parallel, weights
    )
    for (loss, grads), sp_norms, _ in results:
        torch.testing.assert_close(loss, ref_loss, atol=ATOL, rtol=1e-5)
        for name in ref_grads:
            torch.testing.assert_close(grads[name], ref_grads[name], atol=ATOL, rtol=1e-4, msg=name)
        if sequence_parallel:  # every norm weight is marked, so finalize_model_grads reduced it
            assert sp_norms and all("layernorm" in n for n in sp_norms)
            assert len(sp_norms) == 2 * 2 + 1  # two per layer + the final norm


def _w_packed(rank, world_size, lengths):
    init_megatron(tp=1)
    try:
        from megatron.core.packed_seq_params import PackedSeqParams

        model = flash_gpt(tiny_config()).eval()
        tokens, _, _ = batch(batch_size=1, seq=sum(lengths))
        cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
        positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
        params = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            max_seqlen_q=max(lengths),
            max_seqlen_kv=max(lengths),
        )
        with torch.no_grad():
            packed = model(tokens, positions, None, packed_seq_params=params)
            alone = [
                model(tokens[:, a:b], torch.arange(b - a).unsqueeze(0), None)
                for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())
            ]
        return packed, torch.cat(alone, dim=1)
    finally:
        teardown_megatron()


def test_packed_sequences_match_each_sequence_alone():
    packed, alone = run_distributed(_w_packed, 1, [5, 11, 16])[0]
    assert packed.shape == alone.shape
    torch.testing.assert_close(packed, alone, atol=ATOL, rtol=1e-5)


def _w_npu_vs_cpu(rank, world_size):
    import sys

    from mcore_flash.emulation import op_double

    init_megatron(tp=1)
    try:
        from megatron.core.packed_seq_params import PackedSeqParams

        double = op_double()
        sys.modules["torch_npu"] = double
        config = tiny_config()
        cpu, npu = (
            flash_gpt(config, attention_backend="cpu"),
            flash_gpt(config, attention_backend="npu"),
        )
        npu.load_state_dict(cpu.state_dict())
        results = [_loss_and_grads(model, None) for model in (cpu, npu)]
        cu = torch.tensor([0, 7, 32], dtype=torch.int32)
        params = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=25, max_seqlen_kv=25
        )
        tokens, _, _ = batch(batch_size=1)
        positions = torch.cat([torch.arange(7), torch.arange(25)]).unsqueeze(0)
        with torch.no_grad():
            packed = [
                model(tokens, positions, None, packed_seq_params=params) for model in (cpu, npu)
            ]
        return (
            results,
            packed,
            [(c["name"], c["layout"], c["sparse_mode"], c["noncontiguous"]) for c in double.calls],
        )
    finally:
        teardown_megatron()


def test_npu_path_through_torch_npu_double_matches_cpu():
    (cpu, npu), (packed_cpu, packed_npu), calls = run_distributed(_w_npu_vs_cpu, 1)[0]
    torch.testing.assert_close(npu[0], cpu[0], atol=ATOL, rtol=1e-5)
    for name in cpu[1]:
        torch.testing.assert_close(npu[1][name], cpu[1][name], atol=ATOL, rtol=1e-4, msg=name)
    torch.testing.assert_close(packed_npu, packed_cpu, atol=ATOL, rtol=1e-5)
    # Megatron's [s, b, n, d] goes in as "SBH" and packed [t, n, d] as "TND", never copied by the op
    assert ("npu_fusion_attention", "SBH", 3, []) in calls  # causal: bottom-right compressed mask
    assert ("npu_fusion_attention_grad", "SBH", 3, []) in calls
    assert ("npu_fusion_attention", "TND", 3, []) in calls
    assert all(noncontiguous == [] for *_, noncontiguous in calls)


def _w_dropout(rank, world_size):
    init_megatron(tp=world_size, seed=77)
    try:
        from megatron.core import tensor_parallel
        from megatron.core.transformer.enums import AttnMaskType

        from mcore_flash.transformer import FlashDotProductAttention

        config = tiny_config(
            tensor_model_parallel_size=world_size, attention_dropout=0.5, num_query_groups=4
        )
        attention = FlashDotProductAttention(
            config, layer_number=1, attn_mask_type=AttnMaskType.causal
        ).train()
        generator = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(16, 1, 2, 16, generator=generator) for _ in range(3))
        first = attention(q, k, v, None)
        tensor_parallel.model_parallel_cuda_manual_seed(77)
        again = attention(q, k, v, None)
        no_dropout = attention.eval()(q, k, v, None)
        return first, again, no_dropout
    finally:
        teardown_megatron()


def test_attention_dropout_uses_megatron_rng_tracker():
    (first0, again0, plain0), (first1, again1, plain1) = run_distributed(_w_dropout, 2)
    torch.testing.assert_close(first0, again0, atol=0, rtol=0)  # reseeding replays it
    torch.testing.assert_close(first1, again1, atol=0, rtol=0)
    torch.testing.assert_close(plain0, plain1)  # same inputs, same heads: same math ...
    assert not torch.allclose(first0, first1)  # ... but each TP rank draws its own dropout
    assert not torch.allclose(first0, plain0)


# ---- bad input (no process group needed) ---------------------------------------------------


def _attention(tp_size=1, backend=None, layer_number=1, **overrides):
    from megatron.core.transformer.enums import AttnMaskType

    from mcore_flash.transformer import FlashDotProductAttention

    pg = types.SimpleNamespace(tp=types.SimpleNamespace(size=lambda: tp_size))
    return FlashDotProductAttention(
        tiny_config(**overrides),
        layer_number=layer_number,
        attn_mask_type=AttnMaskType.causal,
        pg_collection=pg,
        backend=backend,
    )


def test_heads_not_divisible_by_tp():
    with pytest.raises(ValueError, match="num_attention_heads .* tensor_model_parallel_size"):
        _attention(tp_size=3)


def test_query_groups_not_dividing_heads():
    with pytest.raises(ValueError, match="--num-query-groups"):
        _attention(tp_size=1, num_attention_heads=4, num_query_groups=3, kv_channels=16)


def test_context_parallel_without_a_cp_group_is_refused():
    """CP > 1 needs megatron's CP process group (initialize_model_parallel(context_parallel_size=...))."""
    with pytest.raises(ValueError, match="--context-parallel-size 1"):
        _attention(context_parallel_size=2)


def test_unknown_and_unavailable_backend():
    with pytest.raises(ValueError, match="unknown"):
        _attention(backend="tpu")
    attention = _attention(backend="cuda")
    q = torch.randn(8, 1, 4, 16)
    k = torch.randn(8, 1, 2, 16)
    with pytest.raises(ValueError, match="cuda.*not available"):
        attention(q, k, k, None)


@pytest.mark.parametrize("shape", [(8, 8), (1, 1, 8, 5), (3, 1, 8, 8)])
def test_unsupported_mask_shape(shape):
    attention = _attention()
    q, k = torch.randn(8, 2, 4, 16), torch.randn(8, 2, 2, 16)
    with pytest.raises(ValueError, match="attention_mask shape"):
        attention(q, k, k, torch.zeros(shape, dtype=torch.bool))


def test_padding_mask_is_honoured_and_causal_mask_takes_fused_path(monkeypatch):
    import mcore_flash.transformer.attention as attention_module

    seen = []
    real = attention_module.flash_attn_func
    monkeypatch.setattr(
        attention_module, "flash_attn_func", lambda *a, **kw: seen.append(kw) or real(*a, **kw)
    )
    attention = _attention()
    q, k, v = torch.randn(8, 2, 4, 16), torch.randn(8, 2, 2, 16), torch.randn(8, 2, 2, 16)
    attention(q, k, v, torch.ones(1, 1, 8, 8, dtype=torch.bool).triu(1))
    assert seen[-1]["causal"] is True and seen[-1]["attn_mask"] is None
    padding = torch.zeros(2, 1, 1, 8, dtype=torch.bool)
    padding[1, ..., 5:] = True  # the second sequence has 3 padding keys
    out = attention(q, k, v, padding)
    assert seen[-1]["causal"] is False and seen[-1]["attn_mask"].shape == (2, 1, 8, 8)
    alone = attention(q[:, 1:], k[:5, 1:], v[:5, 1:], torch.zeros(1, 1, 8, 5, dtype=torch.bool))
    torch.testing.assert_close(out[:, 1:], alone, atol=ATOL, rtol=1e-5)


def _w_window_vs_stock(rank, world_size, window):
    """Ours with ``config.window_size`` against the stock local spec given the same sliding
    window as an explicit mask (megatron's own window mask is built on "cuda" only)."""
    init_megatron(tp=1)
    try:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        from _support.gpt_models import SEQ
        from _support.oracle import visible

        stock = build_gpt(tiny_config(), get_gpt_layer_local_spec(normalization="RMSNorm"))
        ours = flash_gpt(tiny_config(window_size=window))
        ours.load_state_dict(stock.state_dict(), strict=True)
        window_mask = ~visible(SEQ, SEQ, causal=True, window=window)
        return _loss_and_grads(stock, window_mask), _loss_and_grads(ours, None)
    finally:
        teardown_megatron()


def test_window_size_matches_stock_attention_with_the_window_mask():
    (stock_loss, stock_grads), (loss, grads) = run_distributed(_w_window_vs_stock, 1, (5, 0))[0]
    full_loss = run_distributed(_w_stock_vs_flash, 1, False, False)[0][1][0]
    assert not torch.allclose(loss, full_loss, atol=1e-3), "the window must change the result"
    torch.testing.assert_close(loss, stock_loss, atol=ATOL, rtol=1e-5)
    for name in grads:
        torch.testing.assert_close(grads[name], stock_grads[name], atol=ATOL, rtol=1e-4, msg=name)


@pytest.mark.parametrize(
    "skip_freq,expected",
    [(None, [(7, 0), (7, 0)]), (2, [(7, 0), (-1, -1)]), ([0, 1], [(-1, -1), (7, 0)])],
)
def test_window_attn_skip_freq_picks_the_sliding_window_layers(skip_freq, expected):
    got = [
        _attention(layer_number=n, window_size=(7, 0), window_attn_skip_freq=skip_freq).window_size
        for n in (1, 2)
    ]
    assert got == expected


def test_bad_window_size_names_the_flag():
    with pytest.raises(ValueError, match="--window-size"):
        _attention(window_size=(4.5, 0))


@pytest.mark.parametrize("window", [None, (5, 0)])
def test_kv_cache_calls_give_the_last_rows_of_causal_attention(window):
    """What megatron's static KV cache (``StaticInferenceContext``) passes to core attention:
    the newest token's query against every cached key with ``attn_mask_type=no_mask`` (decode),
    and a causal query shorter than its keys (a prompt fed after cached tokens). Both are the
    last rows of causal attention over the whole sequence (flash-attn's bottom-right
    alignment), sliding window included: the float64 oracle's."""
    from megatron.core.transformer.enums import AttnMaskType

    from _support import oracle

    attention = _attention(window_size=window)
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(12, 2, 4, 16, generator=generator)
    k, v = (torch.randn(12, 2, 2, 16, generator=generator) for _ in range(2))
    full, _ = oracle.attention(
        *(x.transpose(0, 1) for x in (q, k, v)), causal=True, window=window or (-1, -1)
    )
    full = full.transpose(0, 1).reshape(12, 2, 64).float()  # [s, b, np * hn]
    decode = attention(q[-1:], k, v, None, attn_mask_type=AttnMaskType.no_mask)
    chunk = attention(q[-3:], k, v, None, attn_mask_type=AttnMaskType.causal)
    torch.testing.assert_close(decode, full[-1:], atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(chunk, full[-3:], atol=ATOL, rtol=1e-5)

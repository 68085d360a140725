"""Context parallelism (ring "p2p" and Ulysses "a2a") against the unsplit computation.

Oracles: the same kernel on the whole sequence (CP=1, fp32) and the float64 naive oracle
(tests/_support/oracle.py) for the op; a CP=1 (TP=1) run of the same GPTModel for the model; Megatron's
own ``get_batch_on_this_cp_rank`` for the batch split.

Three spawns, each batching many checks (module-scoped fixtures): 1 process (the CP=1 GPT
reference), 2 processes (op at CP=2 on the cpu and npu-double backends, comm/compute
overlap, dropout replay, saved bytes; GPT at CP=2 with p2p and a2a) and 4 processes (op at
CP=4; GPT at TP=2 x CP=2 with p2p and a2a).
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from _support import oracle
from _support.dist_utils import init_megatron, run_distributed, teardown_megatron
from _support.gpt_models import (
    SEQ,
    assert_same_bits,
    batch,
    causal_mask,
    flash_gpt,
    full_grads,
    full_weights,
    load_full_weights,
    tiny_config,
)

B, S, HQ, HKV, D = 2, 32, 4, 2, 8
TOL = dict(atol=1e-5, rtol=1e-5)  # fp32 against fp32 CP=1 / float64
CASES = [
    (backend, comm, causal)
    for backend in ("cpu", "npu")
    for comm in ("p2p", "a2a")
    for causal in (True, False)
]
GPT_COMMS = ("p2p", "a2a")
# sliding windows over the whole sequence: (window_size, causal); chunks are 8 (cp2) or 4 (cp4) rows
WINDOWS = [((5, 0), True), ((3, 6), False), ((13, -1), False)]
WINDOW_CASES = [
    (backend, comm, window, causal)
    for backend in ("cpu", "npu")
    for comm in ("p2p", "a2a")
    for window, causal in WINDOWS
]
# softcap and ALiBi over the whole sequence on cpu and reference (npu refuses both, by name):
# (causal, window_size, softcap, slopes: None, "heads" [hq] or "batch" [b, hq])
SCORE_MODS = [
    (True, (-1, -1), 0.0, "heads"),
    (False, (3, 6), 0.0, "batch"),
    (True, (5, 0), 2.0, None),
    (True, (-1, -1), 1.5, "heads"),
]
SCORE_CASES = [
    (backend, comm, *mod)
    for backend in ("cpu", "reference")
    for comm in ("p2p", "a2a")
    for mod in SCORE_MODS
]


def _inputs(dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, HQ, D, generator=generator, dtype=dtype)
    k = torch.randn(B, S, HKV, D, generator=generator, dtype=dtype)
    v = torch.randn(B, S, HKV, D, generator=generator, dtype=dtype)
    dout = torch.randn(B, S, HQ, D, generator=generator, dtype=dtype)
    return q, k, v, dout


def _slopes(kind):
    """Float32 ALiBi slopes, distinct per head (and per sample for "batch"), or None."""
    if kind is None:
        return None
    generator = torch.Generator().manual_seed(9)
    return torch.rand((HQ,) if kind == "heads" else (B, HQ), generator=generator) * 0.5 + 0.1


# ---- workers -------------------------------------------------------------------------------


def _op_checks(rank, world_size, with_extras):
    """Ring and Ulysses on the WORLD group (size = world_size) for every case in CASES."""
    import torch.distributed as dist

    from mcore_flash.emulation import op_double
    from mcore_flash.measured_memory import measure_saved_bytes
    from mcore_flash.ops.context_parallel import context_parallel_attn_func, split_for_cp_rank

    double = op_double()
    sys.modules["torch_npu"] = double
    group = dist.group.WORLD
    q, k, v, dout = _inputs()

    def local(x):
        return split_for_cp_rank(x, 1, world_size, rank).detach().requires_grad_()

    results, calls = {}, {}
    for backend, comm, causal in CASES:
        double.calls.clear()
        ql, kl, vl = local(q), local(k), local(v)
        out, lse = context_parallel_attn_func(
            ql, kl, vl, group, causal=causal, comm_type=comm, backend=backend, return_lse=True
        )
        out.backward(split_for_cp_rank(dout, 1, world_size, rank))
        results[backend, comm, causal] = (out.detach(), lse, ql.grad, kl.grad, vl.grad)
        calls[backend, comm, causal] = [
            (
                c["name"],
                c["sparse_mode"],
                c["mask_shape"],
                c["q_shape"][1],
                c["k_shape"][1],
                c["score_shape"],
            )
            for c in double.calls
        ]
    for backend, comm, window, causal in WINDOW_CASES:
        double.calls.clear()
        ql, kl, vl = local(q), local(k), local(v)
        out, lse = context_parallel_attn_func(
            ql,
            kl,
            vl,
            group,
            causal=causal,
            comm_type=comm,
            backend=backend,
            return_lse=True,
            window_size=window,
        )
        out.backward(split_for_cp_rank(dout, 1, world_size, rank))
        results[backend, comm, window, causal] = (out.detach(), lse, ql.grad, kl.grad, vl.grad)
        calls[backend, comm, window, causal] = [
            (
                c["name"],
                c["sparse_mode"],
                c["mask_shape"],
                c["q_shape"][1],
                c["k_shape"][1],
                c["pre_tockens"],
                c["next_tockens"],
            )
            for c in double.calls
        ]
    for case in SCORE_CASES:
        backend, comm, causal, window, softcap, slopes = case
        ql, kl, vl = local(q), local(k), local(v)
        out, lse = context_parallel_attn_func(
            ql,
            kl,
            vl,
            group,
            causal=causal,
            comm_type=comm,
            backend=backend,
            return_lse=True,
            window_size=window,
            softcap=softcap,
            alibi_slopes=_slopes(slopes),
        )
        out.backward(split_for_cp_rank(dout, 1, world_size, rank))
        results[case] = (out.detach(), lse, ql.grad, kl.grad, vl.grad)
    extras = (
        _op_extras(rank, world_size, group, local, measure_saved_bytes) if with_extras else None
    )
    return results, calls, extras


def _op_extras(rank, world_size, group, local, measure_saved_bytes):
    """Communication/compute order, dropout replay, saved bytes (CP=2 worker only)."""
    import torch.distributed as dist

    from mcore_flash.ops import context_parallel as cpmod
    from mcore_flash.ops.backends.cpu import CpuBackend
    from mcore_flash.ops.context_parallel import ring

    q, k, v, dout = _inputs()
    events = []

    class Recording(CpuBackend):
        def forward(self, *args):
            events.append("fwd")
            return super().forward(*args)

        def backward(self, *args):
            events.append("bwd")
            return super().backward(*args)

    real_hop, real_wait = ring._Ring.hop, ring._wait
    tags = {ring._KV_TAG: "send:kv", ring._DKV_TAG: "send:dkv"}
    ring._Ring.hop = lambda self, send, recv, tag: (
        events.append(tags[tag]) or real_hop(self, send, recv, tag)
    )
    ring._wait = lambda requests: events.append("wait") or real_wait(requests)
    try:
        ql, kl, vl = local(q), local(k), local(v)
        out = cpmod.context_parallel_attn_func(ql, kl, vl, group, causal=True, backend=Recording())
        forward_events = list(events)
        events.clear()
        out.backward(split(dout, world_size, rank))
        backward_events = list(events)
    finally:
        ring._Ring.hop, ring._wait = real_hop, real_wait

    # dropout: the backward replays each block's mask -> gradient = directional derivative
    q64, k64, v64, _ = _inputs(torch.float64, seed=3)
    weight = split(
        torch.randn(B, S, HQ, D, generator=torch.Generator().manual_seed(4), dtype=torch.float64),
        world_size,
        rank,
    )
    dirs = [split(x, world_size, rank) for x in _inputs(torch.float64, seed=5)[:3]]

    def objective(xs, dropout_p=0.25):
        torch.manual_seed(11)  # same dropout seeds on every call
        out = cpmod.context_parallel_attn_func(
            *xs, group, causal=True, dropout_p=dropout_p, backend="reference"
        )
        return out, (out * weight).sum()

    xs = [local(x) for x in (q64, k64, v64)]
    out_drop, value = objective(xs)
    value.backward()
    analytic = sum((x.grad * d).sum() for x, d in zip(xs, dirs)).detach()

    def central_difference(eps):
        with torch.no_grad():
            plus = objective([x + eps * d for x, d in zip(xs, dirs)])[1]
            minus = objective([x - eps * d for x, d in zip(xs, dirs)])[1]
        return (plus - minus) / (2 * eps)

    # Richardson-extrapolated central differences: the blocks' fp32 lse makes the merged
    # output noisy at ~1e-7 relative, so a tiny eps would measure rounding, not the slope
    numeric = (4 * central_difference(5e-3) - central_difference(1e-2)) / 3
    with torch.no_grad():
        out_plain = objective(xs, dropout_p=0.0)[0]
    for t in (analytic, numeric):
        dist.all_reduce(t, group=group)

    ql, kl, vl = local(q), local(k), local(v)
    _, saved = measure_saved_bytes(
        lambda: cpmod.context_parallel_attn_func(ql, kl, vl, group, causal=True, backend="cpu")
    )

    deterministic = {}  # what every kernel call was asked, per call

    class Asked(CpuBackend):
        def forward(self, q, k, v, params):
            asked.append(params.deterministic)
            return super().forward(q, k, v, params)

        def backward(self, *args):
            asked.append(args[-1].deterministic)
            return super().backward(*args)

    cu = [0, 4 * world_size, 8 * world_size]  # two packed documents
    rows = cpmod.thd_positions_for_cp_rank(cu, world_size, rank)
    for comm in ("p2p", "a2a"):
        asked = deterministic[comm] = []
        ql, kl, vl = local(q), local(k), local(v)
        out = cpmod.context_parallel_attn_func(
            ql, kl, vl, group, causal=True, comm_type=comm, backend=Asked(), deterministic=True
        )
        out.backward(split(dout, world_size, rank))
        asked = deterministic[f"packed {comm}"] = []
        ql, kl, vl = (x[0, : cu[-1]][rows].detach().requires_grad_() for x in (q, k, v))
        out = cpmod.context_parallel_varlen_attn_func(
            ql,
            kl,
            vl,
            torch.tensor(cu),
            group,
            causal=True,
            comm_type=comm,
            backend=Asked(),
            deterministic=True,
        )
        out.sum().backward()
    return dict(
        deterministic=deterministic,
        forward_events=forward_events,
        backward_events=backward_events,
        dropout=(analytic.item(), numeric.item(), (out_drop - out_plain).abs().max().item()),
        saved_bytes=saved.total,
    )


def split(x, world_size, rank):
    from mcore_flash.ops.context_parallel import split_for_cp_rank

    return split_for_cp_rank(x, 1, world_size, rank)


def _gpt_run(tp, cp, comm, weights=None, with_mask_check=False, recompute_qkv=False):
    """Loss (global token mean), per-token losses (whole sequence), grads, saved bytes per rank;
    at TP>1 over ``weights`` (the TP=1 reference's), copied into a model from another seed;
    ``recompute_qkv``: under the qkv recompute boundary."""
    from megatron.core import parallel_state
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )

    from mcore_flash.measured_memory import measure_saved_bytes
    from mcore_flash.ops.context_parallel import gather_from_cp_ranks
    from mcore_flash.transformer.context_parallel import get_batch_on_this_cp_rank

    config = tiny_config(tensor_model_parallel_size=tp, context_parallel_size=cp, cp_comm_type=comm)
    model = flash_gpt(
        config,
        seed=0 if weights is None else 7,
        layer_recompute_modules=("qkv",) if recompute_qkv else (),
    )
    if weights is not None:
        load_full_weights(model, weights)
    model = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
    tokens, labels, positions = batch()
    loss_mask = torch.ones(labels.shape)
    local = get_batch_on_this_cp_rank(
        dict(tokens=tokens, labels=labels, loss_mask=loss_mask, position_ids=positions)
    )
    losses, saved = measure_saved_bytes(
        lambda: model(local["tokens"], local["position_ids"], None, labels=local["labels"]), model
    )
    num_tokens = loss_mask.sum()
    # DDP averages gradients over data x context parallel ranks: scale by cp (Megatron's loss_func)
    ((losses * local["loss_mask"]).sum() / num_tokens * cp).backward()
    finalize_model_grads([model])
    cp_group = parallel_state.get_context_parallel_group()
    loss = (losses * local["loss_mask"]).sum().detach()
    torch.distributed.all_reduce(loss, group=cp_group)
    parts = [torch.empty_like(losses) for _ in range(cp)]
    torch.distributed.all_gather(parts, losses.detach().contiguous(), group=cp_group)
    result = dict(
        loss=loss / num_tokens,
        token_losses=gather_from_cp_ranks(parts, 1),
        grads=full_grads(model),
        saved_bytes=saved.total,
        weights=full_weights(model) if tp == 1 else None,
    )
    if with_mask_check:  # Megatron-split causal mask, whole causal mask, no mask: same logits
        mask_rows = get_batch_on_this_cp_rank(dict(attention_mask=causal_mask()))["attention_mask"]
        with torch.no_grad():
            result["logits"] = [
                model(local["tokens"], local["position_ids"], m)
                for m in (None, mask_rows, causal_mask())
            ]
    return result


def _w_reference(rank, world_size):
    init_megatron(tp=1, cp=1)
    try:
        return _gpt_run(1, 1, None)
    finally:
        teardown_megatron()


def _w_cp2(rank, world_size):
    ops = _op_checks(rank, world_size, with_extras=True)
    init_megatron(tp=1, cp=2)
    try:
        runs = {comm: _gpt_run(1, 2, comm, with_mask_check=comm == "p2p") for comm in GPT_COMMS}
        runs.update({f"{comm}+qkv": _gpt_run(1, 2, comm, recompute_qkv=True) for comm in GPT_COMMS})
        return ops, runs
    finally:
        teardown_megatron()


def _w_cp4_and_tp2_cp2(rank, world_size, tp1_weights):
    ops = _op_checks(rank, world_size, with_extras=False)
    init_megatron(tp=2, cp=2)
    try:
        runs = {comm: _gpt_run(2, 2, comm, tp1_weights) for comm in GPT_COMMS}
        runs["p2p+qkv"] = _gpt_run(2, 2, "p2p", tp1_weights, recompute_qkv=True)
        return ops, runs
    finally:
        teardown_megatron()


@pytest.fixture(scope="module")
def reference_run():
    return run_distributed(_w_reference, 1)[0]


@pytest.fixture(scope="module")
def cp2_run():
    return run_distributed(_w_cp2, 2)


@pytest.fixture(scope="module")
def cp4_run(reference_run):
    return run_distributed(_w_cp4_and_tp2_cp2, 4, reference_run["weights"])


# ---- the op: CP=2 and CP=4 equal CP=1 and the float64 oracle ------------------------------


def _unsplit_references(causal):
    from mcore_flash.ops import flash_attn_func

    q, k, v, dout = _inputs()
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = flash_attn_func(*leaves, causal=causal, backend="cpu", return_lse=True)
    out.backward(dout)
    cp1 = (out.detach(), lse, *(x.grad for x in leaves))
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    out, lse = oracle.attention(*leaves, causal=causal)
    out.backward(dout.double())
    return cp1, (out.detach(), lse.detach(), *(x.grad for x in leaves))


def _check_op(per_rank_results):
    from mcore_flash.ops.context_parallel import gather_from_cp_ranks

    names = ("out", "lse", "dq", "dk", "dv")
    references = {causal: _unsplit_references(causal) for causal in (True, False)}
    for case in CASES:
        cp1, exact = references[case[2]]
        for i, name in enumerate(names):
            seq_dim = 2 if name == "lse" else 1
            got = gather_from_cp_ranks(
                [results[case][i] for results, _, _ in per_rank_results], seq_dim
            )
            assert got.dtype == cp1[i].dtype
            torch.testing.assert_close(got, cp1[i], **TOL, msg=f"{case} {name} vs CP=1")
            torch.testing.assert_close(
                got.double(), exact[i].double(), **TOL, msg=f"{case} {name} vs float64"
            )


def _check_npu_calls(per_rank_results, cp):
    """Diagonal: sparse_mode 3 + compressed mask; other blocks: no mask, half the rows or keys."""
    local, half = S // cp, S // (2 * cp)
    work = []
    for rank, (_, calls, _) in enumerate(per_rank_results):
        for name in ("npu_fusion_attention", "npu_fusion_attention_grad"):
            got = [c[1:5] for c in calls["npu", "p2p", True] if c[0] == name]
            expected = [(3, (2048, 2048), local, local)]
            for step in range(1, cp):
                src = (rank - step) % cp
                expected.append((0, None, local, half) if src < rank else (0, None, half, local))
            assert got == expected, (rank, name)
            unmasked = [c[1:5] for c in calls["npu", "p2p", False] if c[0] == name]
            assert unmasked == [(0, None, local, local)] * cp
        a2a = [c[1:5] for c in calls["npu", "a2a", True]]
        assert a2a == [(3, (2048, 2048), S, S)] * 2  # one fused call on the whole sequence
        work.append(
            sum(
                c[5][-1] * c[5][-2]
                for c in calls["npu", "p2p", True]
                if c[0] == "npu_fusion_attention"
            )
        )
    assert len(set(work)) == 1, f"causal work per rank is unbalanced: {work}"


def _check_windows(per_rank_results, cp):
    """Windowed CP equals the float64 oracle; the ring calls the kernel once per chunk pair the
    window reaches (found here by brute force over the global visibility), on just the rows
    of the pair that see a key and the keys they see, unmasked where those rows see all of
    them, and never for the others."""
    from mcore_flash.ops.context_parallel import cp_chunk_ids

    c = S // (2 * cp)
    for backend, comm, window, causal in WINDOW_CASES:
        case = (backend, comm, window, causal)
        _assert_equals_oracle(per_rank_results, case, causal=causal, window=window)
        if (backend, comm) != ("npu", "p2p"):
            continue
        visible = oracle.visible(S, S, causal, window=window)[0, 0]
        for rank, (_, calls, _) in enumerate(per_rank_results):
            pairs = [
                visible[a * c : (a + 1) * c, b * c : (b + 1) * c]
                for a in cp_chunk_ids(cp, rank)
                for b in range(2 * cp)
            ]
            reached = [p for p in pairs if p.any()]
            forward = [call for call in calls[case] if call[0] == "npu_fusion_attention"]
            assert len(forward) == len(reached), (case, rank)
            # each call is the square of the pair's rows that see a key and keys that are seen
            seen = sorted((int(p.any(1).sum()), int(p.any(0).sum())) for p in reached)
            assert sorted(call[3:5] for call in forward) == seen, (case, rank)
            # unmasked where those rows see all those keys
            filled = sum(bool(p[p.any(1)][:, p.any(0)].all()) for p in reached)
            assert sum(call[2] is None for call in forward) == filled, (case, rank)
            # a cut pair is a band (4), or causal (3) where its shifted band is exactly the causal one
            assert all(call[1] in (3, 4) for call in forward if call[2] is not None)


def _check_score_mods(per_rank_results):
    """softcap and ALiBi (with and without windows) under CP equal the float64 oracle on the
    whole sequence: ALiBi's distances are global positions, not local ones."""
    for case in SCORE_CASES:
        _, _, causal, window, softcap, slopes = case
        _assert_equals_oracle(
            per_rank_results,
            case,
            causal=causal,
            window=window,
            softcap=softcap,
            alibi_slopes=_slopes(slopes),
        )


def _assert_equals_oracle(per_rank_results, case, **oracle_kwargs):
    """The ranks' ``(out, lse, dq, dk, dv)`` of ``case``, gathered, equal the float64 oracle
    (:func:`oracle.attention` with ``oracle_kwargs``) on the whole sequence."""
    from mcore_flash.ops.context_parallel import gather_from_cp_ranks

    q, k, v, dout = _inputs()
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    out, lse = oracle.attention(*leaves, **oracle_kwargs)
    out.backward(dout.double())
    exact = (out.detach(), lse.detach(), *(x.grad for x in leaves))
    for i, name in enumerate(("out", "lse", "dq", "dk", "dv")):
        got = gather_from_cp_ranks(
            [results[case][i] for results, _, _ in per_rank_results], 2 if name == "lse" else 1
        )
        torch.testing.assert_close(got.double(), exact[i], **TOL, msg=f"{case} {name} vs float64")


def test_op_softcap_and_alibi_under_cp2_and_cp4_equal_the_oracle(cp2_run, cp4_run):
    _check_score_mods([ops for ops, _ in cp2_run])
    _check_score_mods([ops for ops, _ in cp4_run])


def test_op_windows_under_cp2_and_cp4_skip_the_pairs_outside(cp2_run, cp4_run):
    _check_windows([ops for ops, _ in cp2_run], 2)
    _check_windows([ops for ops, _ in cp4_run], 4)


def test_op_cp2_equals_cp1(cp2_run):
    ops = [ops for ops, _ in cp2_run]
    _check_op(ops)
    _check_npu_calls(ops, cp=2)


def test_op_cp4_equals_cp1(cp4_run):
    ops = [ops for ops, _ in cp4_run]
    _check_op(ops)
    _check_npu_calls(ops, cp=4)


def test_ring_overlaps_communication_with_compute(cp2_run):
    for (_, _, extras), _ in cp2_run:
        # forward: the next K/V block is in flight while this block is computed
        assert extras["forward_events"] == ["send:kv", "fwd", "wait", "fwd"]
        # backward: K/V ahead, dK/dV one hop behind (waited after the next block's kernel),
        # and a last hop that delivers each rank its own complete dK/dV
        assert extras["backward_events"] == [
            "send:kv",
            "bwd",
            "send:dkv",
            "wait",
            "bwd",
            "wait",
            "send:dkv",
            "wait",
        ]


def test_ring_replays_dropout_in_backward(cp2_run):
    for (_, _, extras), _ in cp2_run:
        analytic, numeric, dropped = extras["dropout"]
        assert dropped > 0.1  # dropout is on
        # a backward that replays another block's mask is off by tens of percent
        assert analytic == pytest.approx(numeric, rel=1e-3)


def test_deterministic_reaches_every_kernel_call_under_cp(cp2_run):
    for (_, _, extras), _ in cp2_run:
        assert sorted(extras["deterministic"]) == ["a2a", "p2p", "packed a2a", "packed p2p"]
        for call, asked in extras["deterministic"].items():
            assert len(asked) >= 2 and all(asked), (
                call,
                asked,
            )  # forward and backward kernels, each told


def test_pair_cut_is_the_tight_square_of_what_the_band_sees():
    """Brute force over bands, chunk sizes and chunk distances: the cut of a chunk pair holds
    every visible (query, key) pair, no row without a key and no key nobody sees; its band
    gives the same visibility and its ALiBi shift the same global distances; and the band
    holds its own diagonal, which is what torch's flash kernel needs to take a window."""
    from mcore_flash.ops.backends import AttentionParams
    from mcore_flash.ops.backends.cuda import CudaDevice, FlashKernel
    from mcore_flash.ops.context_parallel.ring_plan import pair_cut

    plain = AttentionParams(causal=False, softmax_scale=1.0)
    for lo in (None, -7, -3, 0):
        for hi in (None, 0, 2, 6):
            params = plain.with_band(lo, hi)
            for c in (1, 2, 3, 5, 8):
                i, j = torch.arange(c).unsqueeze(1), torch.arange(c).unsqueeze(0)
                for chunk_delta in range(-3, 4):
                    delta = chunk_delta * c
                    distance = j - i - delta  # global key position - query position
                    visible = torch.ones(c, c, dtype=torch.bool)
                    if lo is not None:
                        visible &= distance >= lo
                    if hi is not None:
                        visible &= distance <= hi
                    cut = pair_cut(params, delta, c)
                    where = (lo, hi, c, chunk_delta)
                    if not visible.any():
                        assert cut is None, where
                        continue
                    rows, keys = (
                        slice(cut.first_row, cut.first_row + cut.n),
                        slice(cut.first_key, cut.first_key + cut.n),
                    )
                    block = visible[rows, keys]
                    assert block.sum() == visible.sum(), where  # nothing visible left out
                    assert block.any(1).all() and block.any(0).all(), (
                        where
                    )  # nothing computed for nothing
                    offset = j[:, : cut.n] - i[: cut.n]
                    band_lo, band_hi = cut.band
                    inside = torch.ones_like(block)
                    if band_lo is not None:
                        inside &= offset >= band_lo
                    if band_hi is not None:
                        inside &= offset <= band_hi
                    assert torch.equal(inside, block), where
                    assert torch.equal(
                        (offset - cut.alibi_shift).abs(), distance[rows, keys].abs()
                    ), where
                    block_params = params.with_band(*cut.band)
                    q = torch.zeros(1, cut.n, 1, 8, dtype=torch.bfloat16)
                    assert (
                        FlashKernel(None).misfit(q, q, block_params, CudaDevice((9, 0), 91600))
                        is None
                    ), where


def test_op_saved_bytes_per_rank_are_half_at_cp2(cp2_run):
    from mcore_flash.measured_memory import measure_saved_bytes
    from mcore_flash.ops import flash_attn_func

    q, k, v, _ = (x.requires_grad_() for x in _inputs())
    _, saved = measure_saved_bytes(lambda: flash_attn_func(q, k, v, causal=True, backend="cpu"))
    for (_, _, extras), _ in cp2_run:
        assert extras["saved_bytes"] * 2 == saved.total  # q, k, v, out, lse: all per token


# ---- the model: GPTModel (RoPE, GQA) under CP equals CP=1 -------------------------------------


def _check_gpt(run, reference, what):
    torch.testing.assert_close(run["loss"], reference["loss"], atol=1e-6, rtol=1e-6, msg=what)
    torch.testing.assert_close(
        run["token_losses"], reference["token_losses"], atol=1e-5, rtol=1e-5, msg=what
    )
    assert run["grads"].keys() == reference["grads"].keys()
    for name, grad in reference["grads"].items():
        torch.testing.assert_close(
            run["grads"][name], grad, atol=1e-5, rtol=1e-4, msg=f"{what} {name}"
        )


@pytest.mark.parametrize("comm", GPT_COMMS + tuple(f"{comm}+qkv" for comm in GPT_COMMS))
def test_gpt_cp2_equals_cp1(cp2_run, reference_run, comm):
    for _, gpt in cp2_run:
        _check_gpt(gpt[comm], reference_run, f"cp2 {comm}")


def test_qkv_recompute_under_cp_saves_less(cp2_run):
    """Under the ring the kernel's own q, k, v are dropped too; under a2a the kernel keeps the
    all-to-all's head-split q, k, v (same bytes), the prelude's tensors are still dropped."""
    for _, gpt in cp2_run:
        for comm in GPT_COMMS:
            assert gpt[f"{comm}+qkv"]["saved_bytes"] < gpt[comm]["saved_bytes"], comm
        assert gpt["p2p+qkv"]["saved_bytes"] < gpt["a2a+qkv"]["saved_bytes"]


def test_qkv_recompute_under_cp_gives_the_same_bits_as_no_recompute(cp2_run, cp4_run):
    """Oracle: the same CP layout without recompute (tests/transformer/test_recompute.py does TP/SP, dropout)."""
    for _, gpt in cp2_run:
        for comm in GPT_COMMS:
            qkv, none = gpt[f"{comm}+qkv"], gpt[comm]
            assert_same_bits(qkv["loss"], qkv["grads"], none["loss"], none["grads"], f"cp2 {comm}")
    for _, gpt in cp4_run:
        qkv, none = gpt["p2p+qkv"], gpt["p2p"]
        assert_same_bits(qkv["loss"], qkv["grads"], none["loss"], none["grads"], "tp2 x cp2 p2p")


@pytest.mark.parametrize("comm", GPT_COMMS + ("p2p+qkv",))
def test_gpt_tp2_cp2_equals_tp1_cp1(cp4_run, reference_run, comm):
    for _, gpt in cp4_run:
        _check_gpt(gpt[comm], reference_run, f"tp2 x cp2 {comm}")


def test_gpt_causal_masks_under_cp_take_the_causal_path(cp2_run):
    for _, gpt in cp2_run:
        no_mask, rows_mask, whole_mask = gpt["p2p"]["logits"]
        torch.testing.assert_close(rows_mask, no_mask, atol=0, rtol=0)
        torch.testing.assert_close(whole_mask, no_mask, atol=0, rtol=0)


def test_gpt_saved_bytes_per_rank_about_half_at_cp2(cp2_run, reference_run):
    for _, gpt in cp2_run:
        for comm in GPT_COMMS:
            ratio = gpt[comm]["saved_bytes"] / reference_run["saved_bytes"]
            assert 0.45 <= ratio <= 0.55, (comm, ratio)


# ---- the batch helper -----------------------------------------------------------------------


def _fake_or(group, real):
    """``group`` if it is a test fake, else an object asking torch.distributed's ``real``."""
    if isinstance(group, types.SimpleNamespace):
        return group
    return types.SimpleNamespace(size=lambda: real(group), rank=lambda: real(group))


@pytest.mark.parametrize("cp", [2, 4])
def test_batch_helper_matches_megatron_split(monkeypatch, cp):
    import megatron.core.utils as mutils

    from mcore_flash.compat import megatron_get_batch_on_this_cp_rank
    from mcore_flash.transformer.context_parallel import get_batch_on_this_cp_rank

    # a fake group: megatron 0.16-0.17 asks utils.get_pg_size/get_pg_rank, 0.18+ torch.distributed
    size, rank_of = torch.distributed.get_world_size, torch.distributed.get_rank
    monkeypatch.setattr(mutils, "get_pg_size", lambda group=None: group.size())
    monkeypatch.setattr(mutils, "get_pg_rank", lambda group=None: group.rank())
    monkeypatch.setattr(
        torch.distributed, "get_world_size", lambda group=None: _fake_or(group, size).size()
    )
    monkeypatch.setattr(
        torch.distributed, "get_rank", lambda group=None: _fake_or(group, rank_of).rank()
    )
    tokens, labels, positions = batch(seq=SEQ)
    full = dict(
        tokens=tokens,
        labels=labels,
        loss_mask=torch.rand(labels.shape),
        position_ids=positions,
        attention_mask=causal_mask(),
        unused=None,
    )
    for rank in range(cp):
        group = types.SimpleNamespace(size=lambda: cp, rank=lambda r=rank: r)
        ours = get_batch_on_this_cp_rank(full, group)
        theirs = megatron_get_batch_on_this_cp_rank(dict(full), cp_group=group)
        assert ours.keys() == theirs.keys()
        for key, value in theirs.items():
            if value is None:
                assert ours[key] is None
            else:
                assert torch.equal(ours[key], value), (rank, key)
        assert ours["tokens"].shape[1] == SEQ // cp
        assert ours["position_ids"][0].tolist()[: SEQ // (2 * cp)] == list(
            range(rank * SEQ // (2 * cp), (rank + 1) * SEQ // (2 * cp))
        )


def test_batch_helper_rejects_length_not_divisible():
    from mcore_flash.transformer.context_parallel import get_batch_on_this_cp_rank

    with pytest.raises(ValueError, match="--seq-length as a multiple of 8"):
        get_batch_on_this_cp_rank(
            {"tokens": torch.zeros(2, 36, dtype=torch.long)}, cp_size=4, cp_rank=1
        )


# ---- bad input (no process group needed: every check runs before communication) -----------


def _fake_group(size, rank=0):
    return types.SimpleNamespace(size=lambda: size, rank=lambda: rank)


def _cp_attention(cp=2, tp=1, comm=None, **overrides):
    from megatron.core.transformer.enums import AttnMaskType

    from mcore_flash.transformer import FlashDotProductAttention

    pg = types.SimpleNamespace(tp=_fake_group(tp), cp=_fake_group(cp))
    config = tiny_config(context_parallel_size=cp, **overrides)
    return FlashDotProductAttention(
        config,
        layer_number=1,
        attn_mask_type=AttnMaskType.causal,
        cp_comm_type=comm,
        pg_collection=pg,
    )


def test_unsupported_cp_comm_type_names_the_flag():
    with pytest.raises(ValueError, match="--cp-comm-type p2p"):
        _cp_attention(comm="all_gather")


def test_a2a_heads_not_divisible_by_tp_times_cp():
    with pytest.raises(
        ValueError, match="--tensor-model-parallel-size x --context-parallel-size = 1 x 8"
    ):
        _cp_attention(cp=8, comm="a2a")
    with pytest.raises(ValueError, match="--num-query-groups"):
        _cp_attention(cp=2, comm="a2a", num_attention_heads=6, num_query_groups=3, kv_channels=16)
    _cp_attention(cp=8, comm="p2p")  # the ring has no such limit


def test_a2a_op_heads_not_divisible():
    from mcore_flash.ops.context_parallel import context_parallel_attn_func

    q, k, v, _ = _inputs()
    with pytest.raises(ValueError, match="divisible by the context-parallel size"):
        context_parallel_attn_func(q, k, v, _fake_group(3), comm_type="a2a", backend="cpu")


@pytest.mark.parametrize("comm", ["p2p", "a2a"])
@pytest.mark.parametrize("keyword,value", [("softcap", 1.0), ("alibi_slopes", torch.ones(HQ))])
def test_npu_refuses_softcap_and_alibi_under_cp_by_name(monkeypatch, comm, keyword, value):
    from mcore_flash.emulation import op_double
    from mcore_flash.ops.context_parallel import context_parallel_attn_func

    monkeypatch.setitem(sys.modules, "torch_npu", op_double())
    q, k, v, _ = _inputs()
    with pytest.raises(ValueError, match=f"npu.*{keyword}"):
        context_parallel_attn_func(
            q, k, v, _fake_group(2), comm_type=comm, backend="npu", **{keyword: value}
        )


def test_cp_group_size_must_match_config():
    from megatron.core.transformer.enums import AttnMaskType

    from mcore_flash.transformer import FlashDotProductAttention

    pg = types.SimpleNamespace(tp=_fake_group(1), cp=_fake_group(4))
    with pytest.raises(ValueError, match="same --context-parallel-size"):
        FlashDotProductAttention(
            tiny_config(context_parallel_size=2), 1, AttnMaskType.causal, pg_collection=pg
        )


def test_odd_local_length_names_seq_length():
    attention = _cp_attention(cp=2)
    q, k = torch.randn(7, 1, 4, 16), torch.randn(7, 1, 2, 16)
    with pytest.raises(
        ValueError, match="--seq-length must be divisible by 2 x --context-parallel-size = 4"
    ):
        attention(q, k, k, None)


def test_arbitrary_mask_is_refused_under_cp():
    attention = _cp_attention(cp=2)
    q, k = torch.randn(8, 2, 4, 16), torch.randn(8, 2, 2, 16)
    padding = torch.zeros(2, 1, 8, 16, dtype=torch.bool)
    padding[1, ..., 12:] = True
    with pytest.raises(ValueError, match="neither causal nor empty.*--context-parallel-size 1"):
        attention(q, k, k, padding)
    with pytest.raises(ValueError, match="cannot be honoured.*--context-parallel-size 1"):
        attention(q, k, k, torch.zeros(1, 1, 8, 8, dtype=torch.bool))  # a local-only mask

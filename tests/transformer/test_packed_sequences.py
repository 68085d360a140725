"""Packed documents (``--reset-attention-mask``) at CP 1, 2, 4, a2a and TP2 x CP2.

Oracles: for the model, the same GPTModel run on every document ALONE (an unpacked
``[1, len]`` batch, positions from 0, TP=1, CP=1) with the per-document losses summed -- so
packing, padding, the CP split of every document, the per-hop varlen blocks and the THD RoPE
must together reproduce it; for the op, the float64 naive oracle (tests/_support/oracle.py) per
document. The documents: lengths not multiples of 2*cp, documents of 1-3 tokens, one longer
than a CP chunk of the dense split.

Three spawns, batching many checks: 1 process (the one-by-one oracles, with and without a
sliding window, and CP=1 packed), 2 processes (CP=2 p2p and a2a, with and without the window;
the op on the cpu and npu-double backends, windows included), 4 processes (CP=4
p2p, TP=2 x CP=2 p2p and a2a, TP=2 + SP x CP=2; the op at CP=4).
"""

from __future__ import annotations

import sys

import pytest
import torch

from _support import oracle
from _support.dist_utils import init_megatron, run_distributed, teardown_megatron
from _support.gpt_models import (
    VOCAB,
    assert_same_bits,
    flash_gpt,
    full_grads,
    full_weights,
    load_full_weights,
    tiny_config,
)

SEQ = 32
EOD = VOCAB - 1
# per sample, documents end after each EOD: lengths 1, 3, 21, 7 and 2, 9, 5, 16
DOCS = [[1, 3, 21, 7], [2, 9, 5, 16]]
REL = 1e-5  # fp32 relative tolerance against the fp32 one-by-one run
WINDOW = (4, 0)  # the model's sliding window: each token sees itself and the 4 before it
OP_DOCS = [5, 13, 1, 3, 30, 2]  # op-level document lengths (padded per CP size in the test)
# (causal, window_size): documents padded to 2*cp are 8, 16, 4, 4, 32, 4 tokens at cp 2 (chunks of
# 2, 4, 1, 1, 8, 1) and 8, 16, 8, 8, 32, 8 at cp 4, so a window's shifted band differs between them
MASKS = [(True, (-1, -1)), (False, (-1, -1)), (True, (5, 0)), (False, (3, 6))]
OP_CASES = [
    (backend, comm, causal, window)
    for backend in ("cpu", "npu")
    for comm in ("p2p", "a2a")
    for causal, window in MASKS
]
# softcap and ALiBi within each document on cpu and reference (npu refuses both):
# (causal, window_size, softcap, slopes: None, "heads" [hq] or "docs" [num_docs, hq])
SCORE_MODS = [
    (True, (-1, -1), 0.0, "docs"),
    (False, (3, 6), 0.0, "heads"),
    (True, (5, 0), 2.0, None),
    (True, (-1, -1), 1.5, "heads"),
]
SCORE_CASES = [
    (backend, comm, *mod)
    for backend in ("cpu", "reference")
    for comm in ("p2p", "a2a")
    for mod in SCORE_MODS
]


def _packed_batch():
    """``tokens, labels, loss_mask, position_ids`` ``[2, SEQ]`` with EODs closing documents."""
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, EOD, (len(DOCS), SEQ + 1), generator=generator)
    positions = torch.zeros(len(DOCS), SEQ, dtype=torch.long)
    for row, lengths in enumerate(DOCS):
        assert sum(lengths) == SEQ
        start = 0
        for n in lengths:
            if start + n < SEQ:
                tokens[row, start + n - 1] = EOD  # the last token of every document but the final
            positions[row, start : start + n] = torch.arange(n)
            start += n
    loss_mask = torch.ones(len(DOCS), SEQ)
    loss_mask[0, 5] = 0.0  # an arbitrary masked token
    return dict(
        tokens=tokens[:, :-1].contiguous(),
        labels=tokens[:, 1:].contiguous(),
        loss_mask=loss_mask,
        position_ids=positions,
    )


# ---- workers -------------------------------------------------------------------------------


def _one_by_one(window_size=None):
    """Loss (token mean) and grads of every document run alone through the model (with a
    sliding ``window_size``, Megatron's ``config.window_size``, if given)."""
    config = tiny_config(window_size=window_size)
    model = flash_gpt(config)
    batch = _packed_batch()
    total = torch.zeros(())
    for row, lengths in enumerate(DOCS):
        start = 0
        for n in lengths:
            part = {key: value[row : row + 1, start : start + n] for key, value in batch.items()}
            losses = model(part["tokens"], part["position_ids"], None, labels=part["labels"])
            loss = (losses * part["loss_mask"]).sum()
            loss.backward()
            total += loss.detach()
            start += n
    count = batch["loss_mask"].sum()
    grads = {name: p.grad / count for name, p in model.named_parameters()}
    return dict(loss=total / count, grads=grads, weights=full_weights(model))


def _packed_run(
    tp, cp, comm, sequence_parallel=False, weights=None, recompute_qkv=False, window_size=None
):
    """Loss (token mean) and full grads of the packed batch at this TP x CP (+ SP); at TP>1
    over ``weights`` (the TP=1 model's), copied into a model initialised from another seed;
    ``recompute_qkv``: under the qkv recompute boundary; ``window_size``: a sliding window."""
    from megatron.core import parallel_state
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )

    from mcore_flash.transformer.packed_sequences import pack_documents

    config = tiny_config(
        tensor_model_parallel_size=tp,
        context_parallel_size=cp,
        cp_comm_type=comm,
        sequence_parallel=sequence_parallel,
        window_size=window_size,
    )
    model = flash_gpt(
        config,
        seed=0 if weights is None else 7,
        layer_recompute_modules=("qkv",) if recompute_qkv else (),
    )
    if weights is not None:
        load_full_weights(model, weights)
    model = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
    batch = _packed_batch()
    local, params = pack_documents(batch, EOD, pad_to_multiple_of=tp if sequence_parallel else 1)
    losses = model(
        local["tokens"],
        local["position_ids"],
        None,
        labels=local["labels"],
        packed_seq_params=params,
    )
    count = batch["loss_mask"].sum()
    loss = (losses * local["loss_mask"]).sum()
    (loss / count * cp).backward()  # DDP averages over data x context parallel ranks
    finalize_model_grads([model])
    loss = loss.detach()
    torch.distributed.all_reduce(loss, group=parallel_state.get_context_parallel_group())
    return dict(loss=loss / count, grads=full_grads(model), rows=local["tokens"].shape[1])


def _op_checks(rank, world_size):
    """The op on the WORLD group for OP_CASES; returns this rank's rows and results."""
    import torch.distributed as dist

    from mcore_flash.emulation import op_double
    from mcore_flash.measured_memory import measure_saved_bytes
    from mcore_flash.ops.backends import get_backend
    from mcore_flash.ops.context_parallel import (
        context_parallel_varlen_attn_func,
        thd_positions_for_cp_rank,
    )

    double = op_double()
    sys.modules["torch_npu"] = double
    npu = get_backend("npu")
    cu = _op_cu(world_size)
    q, k, v, dout = _op_inputs(cu[-1])
    rows = thd_positions_for_cp_rank(cu, world_size, rank)
    results, calls = {}, {}
    for case in OP_CASES:
        backend, comm, causal, window = case
        double.calls.clear()
        npu.__dict__.pop(
            "_logged_reasons", None
        )  # each fallback reason is logged once per instance
        ql, kl, vl = (x[rows].clone().requires_grad_() for x in (q, k, v))
        out, lse = context_parallel_varlen_attn_func(
            ql,
            kl,
            vl,
            torch.tensor(cu),
            dist.group.WORLD,
            causal=causal,
            comm_type=comm,
            backend=backend,
            return_lse=True,
            window_size=window,
        )
        out.backward(dout[rows])
        results[case] = (out.detach(), lse, ql.grad, kl.grad, vl.grad)
        calls[case] = {(c["name"], c["layout"], c["sparse_mode"]) for c in double.calls}
        calls[case, "fallbacks"] = sorted(npu.__dict__.get("_logged_reasons", ()))
    for case in SCORE_CASES:
        backend, comm, causal, window, softcap, slopes = case
        ql, kl, vl = (x[rows].clone().requires_grad_() for x in (q, k, v))
        out, lse = context_parallel_varlen_attn_func(
            ql,
            kl,
            vl,
            torch.tensor(cu),
            dist.group.WORLD,
            causal=causal,
            comm_type=comm,
            backend=backend,
            return_lse=True,
            window_size=window,
            softcap=softcap,
            alibi_slopes=_op_slopes(slopes),
        )
        out.backward(dout[rows])
        results[case] = (out.detach(), lse, ql.grad, kl.grad, vl.grad)
    ql, kl, vl = (x[rows].clone().requires_grad_() for x in (q, k, v))
    _, saved = measure_saved_bytes(
        lambda: context_parallel_varlen_attn_func(
            ql, kl, vl, torch.tensor(cu), dist.group.WORLD, causal=True, backend="cpu"
        )
    )
    return rows, results, calls, saved.total


def _op_cu(cp):
    multiple = 2 * cp
    cu = [0]
    for n in OP_DOCS:
        cu.append(cu[-1] + -(-n // multiple) * multiple)
    return cu


def _op_inputs(total):
    generator = torch.Generator().manual_seed(0)
    shapes = [(total, 4, 8), (total, 2, 8), (total, 2, 8), (total, 4, 8)]
    return [torch.randn(*shape, generator=generator) for shape in shapes]


def _op_slopes(kind):
    """Float32 ALiBi slopes for the op's 4 heads (and per document for "docs"), or None."""
    if kind is None:
        return None
    generator = torch.Generator().manual_seed(9)
    return (
        torch.rand((4,) if kind == "heads" else (len(OP_DOCS), 4), generator=generator) * 0.5 + 0.1
    )


def _w_single(rank, world_size):
    init_megatron(tp=1, cp=1)
    try:
        return dict(
            one_by_one=_one_by_one(), cp1=_packed_run(1, 1, None), window=_one_by_one(WINDOW)
        )
    finally:
        teardown_megatron()


def _w_cp2(rank, world_size):
    ops = _op_checks(rank, world_size)
    init_megatron(tp=1, cp=2)
    try:
        runs = {comm: _packed_run(1, 2, comm) for comm in ("p2p", "a2a")}
        for comm in ("p2p", "a2a"):
            runs[f"{comm}+qkv"] = _packed_run(1, 2, comm, recompute_qkv=True)
            runs[f"{comm}+window"] = _packed_run(1, 2, comm, window_size=WINDOW)
        return ops, runs
    finally:
        teardown_megatron()


def _w_cp4_and_tp2_cp2(rank, world_size, tp1_weights):
    ops = _op_checks(rank, world_size)
    runs = {}
    init_megatron(tp=1, cp=4)
    try:
        runs["cp4 p2p"] = _packed_run(1, 4, "p2p")
    finally:
        teardown_megatron()
    init_megatron(tp=2, cp=2)
    try:
        for comm in ("p2p", "a2a"):
            runs[f"tp2 cp2 {comm}"] = _packed_run(2, 2, comm, weights=tp1_weights)
        runs["tp2 sp cp2 p2p"] = _packed_run(
            2, 2, "p2p", sequence_parallel=True, weights=tp1_weights
        )
    finally:
        teardown_megatron()
    return ops, runs


@pytest.fixture(scope="module")
def single_run():
    return run_distributed(_w_single, 1)[0]


@pytest.fixture(scope="module")
def cp2_run():
    return run_distributed(_w_cp2, 2)


@pytest.fixture(scope="module")
def cp4_run(single_run):
    return run_distributed(_w_cp4_and_tp2_cp2, 4, single_run["one_by_one"]["weights"])


# ---- the model: packed == one by one --------------------------------------------------------


def _check_equal(run, reference, what):
    assert abs(run["loss"].item() - reference["loss"].item()) <= REL * abs(
        reference["loss"].item()
    ), what
    assert run["grads"].keys() == reference["grads"].keys()
    for name, expected in reference["grads"].items():
        got = run["grads"][name]
        scale = expected.abs().max().item()
        assert (got - expected).abs().max().item() <= REL * scale, f"{what}: gradient of {name}"


def test_packed_cp1_equals_documents_one_by_one(single_run):
    _check_equal(single_run["cp1"], single_run["one_by_one"], "CP=1 packed")


@pytest.mark.parametrize("comm", ["p2p", "a2a", "p2p+qkv", "a2a+qkv"])
def test_packed_cp2_equals_documents_one_by_one(cp2_run, single_run, comm):
    for rank, (_, runs) in enumerate(cp2_run):
        _check_equal(runs[comm], single_run["one_by_one"], f"CP=2 {comm} rank {rank}")


@pytest.mark.parametrize("comm", ["p2p", "a2a"])
def test_packed_qkv_recompute_under_cp2_gives_the_same_bits_as_no_recompute(cp2_run, comm):
    for rank, (_, runs) in enumerate(cp2_run):
        qkv, none = runs[f"{comm}+qkv"], runs[comm]
        assert_same_bits(qkv["loss"], qkv["grads"], none["loss"], none["grads"], f"rank {rank}")


@pytest.mark.parametrize("comm", ["p2p", "a2a"])
def test_packed_cp2_with_a_window_equals_documents_one_by_one(cp2_run, single_run, comm):
    """Megatron's config.window_size on packed documents under CP=2, ring and Ulysses."""
    assert not torch.equal(single_run["window"]["loss"], single_run["one_by_one"]["loss"]), (
        "the window changes nothing"
    )
    for rank, (_, runs) in enumerate(cp2_run):
        _check_equal(
            runs[f"{comm}+window"], single_run["window"], f"CP=2 {comm} window rank {rank}"
        )


@pytest.mark.parametrize("what", ["cp4 p2p", "tp2 cp2 p2p", "tp2 cp2 a2a", "tp2 sp cp2 p2p"])
def test_packed_cp4_and_tp2_cp2_equal_documents_one_by_one(cp4_run, single_run, what):
    for rank, (_, runs) in enumerate(cp4_run):
        _check_equal(runs[what], single_run["one_by_one"], f"{what} rank {rank}")


def test_padded_rows_per_rank(cp2_run, cp4_run):
    """Each document padded to 2*cp: the rows each rank holds (the stated rule)."""
    padded = lambda m: sum(-(-n // m) * m for lengths in DOCS for n in lengths)  # noqa: E731
    assert {runs["p2p"]["rows"] for _, runs in cp2_run} == {padded(4) // 2}
    assert {runs["cp4 p2p"]["rows"] for _, runs in cp4_run} == {padded(8) // 4}


# ---- the op: against the float64 oracle per document -----------------------------------------


def _op_references(cp, causal, window, softcap=0.0, slopes=None):
    cu = _op_cu(cp)
    q, k, v, dout = (x.double() for x in _op_inputs(cu[-1]))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    outs, lses = [], []
    all_slopes = _op_slopes(slopes)
    for doc, (start, end) in enumerate(zip(cu[:-1], cu[1:])):
        doc_slopes = (
            None if all_slopes is None else all_slopes if all_slopes.dim() == 1 else all_slopes[doc]
        )
        out, lse = oracle.attention(
            *(x[start:end].unsqueeze(0) for x in leaves),
            causal=causal,
            window=window,
            softcap=softcap,
            alibi_slopes=doc_slopes,
        )
        outs.append(out[0])
        lses.append(lse[0])
    out = torch.cat(outs)
    out.backward(dout)
    return out.detach(), torch.cat(lses, dim=-1).detach(), *(x.grad for x in leaves)


@pytest.mark.parametrize("spawn", ["cp2_run", "cp4_run"])
def test_packed_op_equals_oracle_per_document(spawn, request):
    """Causal, windows, softcap and ALiBi (per head and per document: a document's ring
    pairs carry its own distance shift) under CP, each document against the float64 oracle."""
    per_rank = request.getfixturevalue(spawn)
    cp = len(per_rank)
    references = {
        mods: _op_references(cp, *mods) for mods in MASKS + [case[2:] for case in SCORE_CASES]
    }
    for rank, ((rows, results, _, _), _) in enumerate(per_rank):
        for case in OP_CASES + SCORE_CASES:
            expected = references[case[2:]]
            picks = (
                expected[0][rows],
                expected[1][:, rows],
                expected[2][rows],
                expected[3][rows],
                expected[4][rows],
            )
            for name, g, e in zip(("out", "lse", "dq", "dk", "dv"), results[case], picks):
                torch.testing.assert_close(
                    g.double(), e, atol=2e-5, rtol=2e-5, msg=f"{name} {case} rank {rank}"
                )


# ---- the padding rule, memory, bad input (one process) --------------------------------------


def test_documents_and_padding_rule():
    from mcore_flash.transformer.packed_sequences import (
        document_lengths,
        pack_documents,
        padded_lengths,
    )

    batch = _packed_batch()
    assert document_lengths(batch["tokens"], EOD) == [n for lengths in DOCS for n in lengths]
    assert padded_lengths([1, 3, 21, 7], cp_size=2) == [4, 4, 24, 8]
    assert padded_lengths([1, 3, 21, 7], cp_size=1) == [1, 3, 21, 7]
    # sequence parallel at TP 3: each of the 2 CP ranks needs a multiple of 3 rows -> 40 + 8
    assert padded_lengths([1, 3, 21, 7], cp_size=2, pad_to_multiple_of=3) == [4, 4, 24, 8, 8]
    assert padded_lengths([1, 3, 21, 7], cp_size=2, pad_to_multiple_of=4) == [4, 4, 24, 8]
    local, params = pack_documents(batch, EOD, cp_size=2, cp_rank=1)
    cu = params.cu_seqlens_q_padded.tolist()
    assert cu == [0, 4, 8, 32, 40, 44, 56, 64, 80] and params.max_seqlen_q == 24
    # rank 1 of document 0 (1 token padded to 4): rows 1 and 2 of it -> both padding
    assert local["loss_mask"][0, :2].tolist() == [0.0, 0.0] and local["tokens"][0, :2].tolist() == [
        0,
        0,
    ]
    # padding continues its document's positions; real rows keep the dataset's
    assert local["position_ids"][0, :2].tolist() == [1, 2]
    # document 2 (21 tokens -> 24, chunks of 6): rank 1 holds positions 6..11 and 12..17
    assert local["position_ids"][0, 4:16].tolist() == list(range(6, 18))


def test_saved_bytes_linear_in_length_with_many_documents():
    """Packed attention at S and 2S with documents of 16 tokens saves exactly 2x (q, k, v,
    out and the fp32 statistics; nothing quadratic), at CP=1 on the fused CPU kernel."""
    from mcore_flash.measured_memory import measure_saved_bytes
    from mcore_flash.ops import flash_attn_varlen_func

    def saved(total, heads=4, dim=8):
        q, k, v = (torch.randn(total, heads, dim, requires_grad=True) for _ in range(3))
        cu = torch.arange(0, total + 1, 16, dtype=torch.int32)
        _, measured = measure_saved_bytes(
            lambda: flash_attn_varlen_func(q, k, v, cu, cu, 16, 16, causal=True, backend="cpu")
        )
        return measured.total

    small, large = saved(1024), saved(2048)
    assert large == 2 * small
    assert small == 4 * 1024 * 4 * 8 * 4 + 1024 * 4 * 4  # q, k, v, out fp32 + lse fp32 [h, t]


def _attention(cp=1):
    import types

    from megatron.core.transformer.enums import AttnMaskType

    from mcore_flash.transformer import FlashDotProductAttention

    group = lambda size: types.SimpleNamespace(size=lambda: size, rank=lambda: 0)  # noqa: E731
    pg = types.SimpleNamespace(tp=group(1), cp=group(cp))
    config = tiny_config(context_parallel_size=cp)
    return FlashDotProductAttention(
        config, layer_number=1, attn_mask_type=AttnMaskType.causal, pg_collection=pg
    )


def _params(cu, padded=None):
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor(cu, dtype=torch.int32)
    padded = None if padded is None else torch.tensor(padded, dtype=torch.int32)
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=padded,
        cu_seqlens_kv_padded=padded,
        max_seqlen_q=8,
        max_seqlen_kv=8,
    )


def test_packed_batch_with_a_4d_mask_is_refused():
    from mcore_flash.transformer.packed_sequences import pack_documents

    q, k = torch.randn(8, 4, 16), torch.randn(8, 2, 16)
    with pytest.raises(ValueError, match="no attention_mask.*--reset-attention-mask"):
        _attention()(
            q, k, k, torch.zeros(1, 1, 8, 8, dtype=torch.bool), packed_seq_params=_params([0, 3, 8])
        )
    batch = dict(_packed_batch(), attention_mask=torch.zeros(1, 1, SEQ, SEQ, dtype=torch.bool))
    with pytest.raises(
        ValueError, match="must not carry an attention_mask.*--reset-attention-mask"
    ):
        pack_documents(batch, EOD, cp_size=1, cp_rank=0)


def test_unpadded_documents_under_cp_and_padding_without_causal_are_refused():
    from megatron.core.transformer.enums import AttnMaskType

    q, k = torch.randn(8, 4, 16), torch.randn(8, 2, 16)
    with pytest.raises(ValueError, match=r"lengths \[3, 13\].*multiple of 4"):
        _attention(cp=2)(q, k, k, None, packed_seq_params=_params([0, 3, 16]))  # 8 rows per rank
    with pytest.raises(ValueError, match="padded documents need causal attention"):
        _attention()(
            q, k, k, None, AttnMaskType.no_mask, packed_seq_params=_params([0, 3, 6], [0, 4, 8])
        )


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--reset-attention-mask"], "pass --reset-position-ids too"),
        (["--reset-position-ids"], "needs --reset-attention-mask"),
    ],
)
def test_document_flags_that_contradict_name_the_flag(flags, message):
    from mcore_flash.runtime.arguments import parse_args

    with pytest.raises(ValueError, match=message):
        parse_args(["--model", "tiny", "--save", "/tmp/unused", *flags])
    parse_args(
        [
            "--model",
            "tiny",
            "--save",
            "/tmp/unused",
            "--position-embedding-type",
            "learned_absolute",
            *flags,
        ]
    )


def test_reset_attention_mask_needs_an_eod_token():
    import types

    from mcore_flash.runtime.arguments import parse_args
    from mcore_flash.training.setup import batch_splitter

    args = parse_args(
        [
            "--model",
            "tiny",
            "--save",
            "/tmp/unused",
            "--reset-attention-mask",
            "--reset-position-ids",
        ]
    )
    with pytest.raises(
        ValueError, match="--reset-attention-mask cuts documents at the tokenizer's EOD"
    ):
        batch_splitter(args, types.SimpleNamespace(eod=None))


@pytest.mark.parametrize("spawn", ["cp2_run", "cp4_run"])
def test_packed_op_on_npu_runs_tnd_calls(spawn, request):
    """The npu backend runs every block as a "TND" call: causal blocks sparse_mode 3, the
    others (and non-causal attention) sparse_mode 0, windows' cut pairs the band (4) or
    causal (3); no block falls back to the reference kernel, windowed ring pairs included
    (each pair is cut to the rows that see a key)."""
    window_modes = {"p2p": {0, 3, 4}, "a2a": {4}}
    for (_, _, calls, _), _ in request.getfixturevalue(spawn):
        for comm in ("p2p", "a2a"):
            cases = [(True, (-1, -1), {3} if comm == "a2a" else {0, 3}), (False, (-1, -1), {0})]
            cases += [(causal, window, window_modes[comm]) for causal, window in MASKS[2:]]
            for causal, window, modes in cases:
                got = calls["npu", comm, causal, window]
                assert {layout for _, layout, _ in got} == {"TND"}, (comm, causal, got)
                modes_used = {
                    mode for _, _, mode in got
                }  # a window's pairs need not use every mode
                assert modes_used <= modes if window != (-1, -1) else modes_used == modes, (
                    comm,
                    causal,
                    window,
                    got,
                )
                assert {name for name, _, _ in got} == {
                    "npu_fusion_attention",
                    "npu_fusion_attention_grad",
                }
                assert calls[("npu", comm, causal, window), "fallbacks"] == [], (
                    comm,
                    causal,
                    window,
                )


@pytest.mark.parametrize("spawn", ["cp2_run", "cp4_run"])
def test_packed_ring_saves_only_its_rows(spawn, request):
    """Saved for backward by the packed ring on each rank: exactly its t_local rows of q, k,
    v, out (fp32) and the fp32 logsumexp -- 1/cp of the pack, nothing per pair of rows."""
    per_rank = request.getfixturevalue(spawn)
    for (rows, _, _, saved), _ in per_rank:
        t = len(rows)
        assert t == _op_cu(len(per_rank))[-1] // len(per_rank)
        assert saved == t * (4 * 8 + 2 * 8 + 2 * 8 + 4 * 8) * 4 + 4 * t * 4


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("causal,window", MASKS[2:])
def test_packed_ring_with_a_window_runs_exactly_the_pairs_it_reaches(cp, causal, window):
    """Brute force over each document's own visibility: at every ring step the blocks compute
    exactly the (query, key) pairs the window lets a query see, each once; no block holds a
    row without a key or a key no row sees (a TND call cannot compute the first); documents
    whose cuts share a band share one kernel call."""
    import bisect

    from mcore_flash.ops.api import resolve_call
    from mcore_flash.ops.backends.base import band_mask
    from mcore_flash.ops.backends.reference import ReferenceBackend
    from mcore_flash.ops.context_parallel import thd_positions_for_cp_rank
    from mcore_flash.ops.context_parallel.ring import PackedBlocks

    cu = _op_cu(cp)
    local_cu = [n // cp for n in cu]
    _, params = resolve_call(
        torch.zeros(1, 1, 8), causal, None, 0.0, "reference", window_size=window
    )
    visible = [
        oracle.visible(b - a, b - a, causal, window=window)[0, 0] for a, b in zip(cu[:-1], cu[1:])
    ]

    def sees(query, key):  # global positions in the pack
        doc = bisect.bisect_right(cu, query) - 1
        return cu[doc] <= key < cu[doc + 1] and bool(visible[doc][query - cu[doc], key - cu[doc]])

    for rank in range(cp):
        blocks = PackedBlocks(ReferenceBackend(), params, local_cu, "cpu")
        q_positions = thd_positions_for_cp_rank(cu, cp, rank).tolist()
        for step in range(cp):
            kv_positions = thd_positions_for_cp_rank(cu, cp, (rank - step) % cp).tolist()
            computed, calls = [], set()
            for q_key, kv_key, block_params in blocks._pair_plan(step, rank, cp):
                call = (q_key[0], kv_key[0], block_params.band())
                assert call not in calls, "two kernel calls for one band"
                calls.add(call)
                rows, cols = blocks.rows[q_key].tolist(), blocks.rows[kv_key].tolist()
                cu_q, cu_k = blocks.cu[q_key], blocks.cu[kv_key]
                for q0, q1, k0, k1 in zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:]):
                    inside = ~band_mask(
                        *block_params.band(), (0, q1 - q0), (0, k1 - k0), q1 - q0, k1 - k0, "cpu"
                    )
                    assert inside.any(1).all() and inside.any(0).all(), (
                        rank,
                        step,
                        "a row or key with nothing to do",
                    )
                    for i, j in inside.nonzero().tolist():
                        computed.append((q_positions[rows[q0 + i]], kv_positions[cols[k0 + j]]))
            expected = [
                (query, key) for query in q_positions for key in kv_positions if sees(query, key)
            ]
            assert sorted(computed) == sorted(expected), (rank, step)

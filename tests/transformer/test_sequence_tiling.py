"""The sequence-tiled loss (``--loss-compute-mode chunk``) and MLP (``--mlp-chunk-size``).

Oracle: the same model (same weights, same inputs) computed megatron's way: the output layer's
whole-sequence logits and ``vocab_parallel_cross_entropy``, the MLP untiled. Loss and every
gradient agree to 1e-6 of the tensor's largest entry in fp32 (tiles change only the order of
the weight gradient's sums), within the project's bf16 tolerances in bf16; a float64 cross
entropy checks the tiled loss independently at TP1. The loss's masked mean, packed documents,
tied embeddings, TP2 with and without SP, CP2 and a last pipeline stage are covered.
"""

from __future__ import annotations

import pytest
import torch

from _support.dist_utils import init_megatron, run_distributed, teardown_megatron
from _support.gpt_models import SEQ, VOCAB, batch, tiny_config
from _support.oracle import BF16_GRAD, BF16_OUT

FP32_REL = 1e-6


def _model(config, loss_chunk=None, mlp_chunk=None, tied=False, layer_modules=(), **stage):
    from mcore_flash.transformer import get_gpt_decoder_block_flash_spec
    from mcore_flash.transformer.gpt_model import TiledLossGPTModel

    torch.manual_seed(0)
    spec = get_gpt_decoder_block_flash_spec(
        config, layer_recompute_modules=layer_modules, mlp_chunk_size=mlp_chunk
    )
    return TiledLossGPTModel(
        config,
        spec,
        vocab_size=VOCAB,
        max_sequence_length=4 * SEQ,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=tied,
        loss_chunk_size=loss_chunk,
        **stage,
    )


def _step(model, inputs, hidden=None):
    """Masked token-sum loss and this rank's gradients (the input's too on a last stage)."""
    tokens, labels, positions, loss_mask, params = inputs
    if hidden is not None:
        hidden = hidden.clone().requires_grad_()
        model.set_input_tensor(hidden)
    losses = model(tokens, positions, None, labels=labels, packed_seq_params=params)
    (losses * loss_mask).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    if hidden is not None:
        grads["<stage input>"] = hidden.grad.clone()
    return losses.detach(), grads


def _compare(config, inputs, hidden=None, bf16=False, **tiling):
    """(ref, tiled) losses and gradients of the untiled and the tiled model, equal weights."""
    ref = _model(config, tied=tiling.get("tied", False), **_stage(tiling))
    tiled = _model(config, **tiling)
    tiled.load_state_dict(ref.state_dict())
    if bf16:
        ref, tiled = ref.bfloat16(), tiled.bfloat16()
        hidden = None if hidden is None else hidden.bfloat16()
    return _step(ref, inputs, hidden), _step(tiled, inputs, hidden)


def _stage(tiling):
    return {k: v for k, v in tiling.items() if k in ("pre_process", "post_process")}


def _errors(pair):
    """Largest difference per tensor relative to the reference's largest entry."""
    (ref_loss, ref_grads), (loss, grads) = pair
    assert grads.keys() == ref_grads.keys()

    def rel(a, b):
        return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()

    return {"loss": rel(loss, ref_loss), **{n: rel(grads[n], g) for n, g in ref_grads.items()}}


def _inputs(tp=1, cp=1, sequence_parallel=False, packed=False, seed=1):
    tokens, labels, positions = batch(batch_size=1 if packed else 2, seq=2 * SEQ, seed=seed)
    loss_mask = (
        torch.rand(labels.shape, generator=torch.Generator().manual_seed(seed)) > 0.2
    ).float()
    if not packed and cp == 1:
        return tokens, labels, positions, loss_mask, None
    from mcore_flash.transformer.packed_sequences import pack_documents

    eod = 0
    tokens[0, [17, 40]] = eod  # three documents
    full = dict(tokens=tokens, labels=labels, position_ids=positions, loss_mask=loss_mask)
    local, params = pack_documents(full, eod, pad_to_multiple_of=tp if sequence_parallel else 1)
    return local["tokens"], local["labels"], local["position_ids"], local["loss_mask"], params


def _w_tiling(rank, world_size, cases):
    """Per case (name, parallel, tiling, options): the relative errors of every tensor."""
    results = {}
    for name, parallel, tiling, options in cases:
        init_megatron(**parallel)
        try:
            tp, cp = parallel.get("tp", 1), parallel.get("cp", 1)
            sp = options.get("sequence_parallel", False)
            config = tiny_config(
                tensor_model_parallel_size=tp,
                context_parallel_size=cp,
                sequence_parallel=sp,
                **options.get("config", {}),
            )
            inputs = _inputs(tp, cp, sp, options.get("packed", False))
            hidden = None
            if tiling.get("pre_process") is False:
                hidden = torch.randn(inputs[0].shape[1], inputs[0].shape[0], config.hidden_size)
            pair = _compare(config, inputs, hidden, options.get("bf16", False), **tiling)
            results[name] = _errors(pair)
        finally:
            teardown_megatron()
    return results


LOSS_CASES = [  # name, parallel, tiling, options: one process
    ("tp1 divides", {}, dict(loss_chunk=16), {}),
    ("tp1 ragged tied", {}, dict(loss_chunk=24, tied=True), {}),
    ("tp1 one tile", {}, dict(loss_chunk=4 * SEQ), {}),
    ("last stage", {}, dict(loss_chunk=24, pre_process=False), {}),
    ("packed", {}, dict(loss_chunk=20), dict(packed=True)),
]
MLP_CASES = [
    (f"mlp {mode} {chunk}", {}, dict(mlp_chunk=chunk, layer_modules=modules), dict(config=config))
    for chunk in (16, 24)
    for mode, modules, config in (
        ("none", (), {}),
        ("qkv", ("qkv",), dict(recompute_granularity="selective", recompute_modules=[])),
        ("attention", (), dict(recompute_granularity="selective", recompute_modules=["core_attn"])),
        (
            "full",
            (),
            dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
        ),
    )
]


def test_tiled_loss_and_mlp_equal_megatron_on_one_process():
    both = [("loss+mlp tied", {}, dict(loss_chunk=24, mlp_chunk=16, tied=True), {})]
    (results,) = run_distributed(_w_tiling, 1, LOSS_CASES + MLP_CASES + both)
    for name, errors in results.items():
        worst = max(errors, key=errors.get)
        assert errors[worst] <= FP32_REL, f"{name}: {worst} off by {errors[worst]:.2e}"
    assert "embedding.word_embeddings.weight" in results["tp1 ragged tied"]


def test_tiled_loss_and_mlp_in_bf16():
    cases = [("bf16", {}, dict(loss_chunk=24, mlp_chunk=16, tied=True), dict(bf16=True))]
    (results,) = run_distributed(_w_tiling, 1, cases)
    errors = results["bf16"]
    assert errors["loss"] <= BF16_OUT["rtol"], errors["loss"]
    worst = max(errors, key=errors.get)
    assert errors[worst] <= BF16_GRAD["rtol"], (worst, errors[worst])


PARALLEL_CASES = [
    ("tp2 sp", dict(tp=2), dict(loss_chunk=16, mlp_chunk=16), dict(sequence_parallel=True)),
    (
        "tp2 sp ragged",
        dict(tp=2),
        dict(loss_chunk=6, mlp_chunk=10, tied=True),
        dict(sequence_parallel=True),
    ),
    ("tp2", dict(tp=2), dict(loss_chunk=24, mlp_chunk=24), {}),
    (
        "cp2 packed",
        dict(cp=2),
        dict(loss_chunk=12, mlp_chunk=12),
        dict(packed=True, config=dict(cp_comm_type="p2p")),
    ),
]


def test_tiled_loss_and_mlp_under_tensor_sequence_and_context_parallelism():
    for rank_results in run_distributed(_w_tiling, 2, PARALLEL_CASES):
        for name, errors in rank_results.items():
            worst = max(errors, key=errors.get)
            assert errors[worst] <= FP32_REL, f"{name}: {worst} off by {errors[worst]:.2e}"


def _w_float64_loss(rank, world_size):
    """The tiled loss of a TP1 fp32 model against float64 cross-entropy of its logits."""
    init_megatron()
    try:
        config = tiny_config()
        tokens, labels, positions, _, _ = _inputs()
        model = _model(config, loss_chunk=24)
        losses = model(tokens, positions, None, labels=labels)
        model.loss_chunk_size = None  # megatron's path: the logits themselves
        logits = model(tokens, positions, None).double()
        oracle = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), labels.flatten(), reduction="none"
        ).view_as(labels)
        return ((losses - oracle).abs().max() / oracle.abs().max()).item()
    finally:
        teardown_megatron()


def test_tiled_loss_equals_float64_cross_entropy():
    (error,) = run_distributed(_w_float64_loss, 1)
    assert error <= FP32_REL  # megatron's loss is fp32 (``.float()`` logits), so is the tiled one


@pytest.mark.parametrize(
    "flags,flag",
    [
        (["--loss-compute-mode", "chunk", "--loss-chunk-size", "0"], "--loss-chunk-size"),
        (["--loss-chunk-size", "64"], "--loss-chunk-size"),
        (["--mlp-chunk-size", "-4"], "--mlp-chunk-size"),
        (
            [
                "--loss-compute-mode",
                "chunk",
                "--loss-chunk-size",
                "9",
                "--sequence-parallel",
                "--tensor-model-parallel-size",
                "2",
            ],
            "multiple of 2",
        ),
    ],
)
def test_bad_tiling_flags_name_the_flag(flags, flag):
    from mcore_flash.runtime.arguments import parse_config

    from _support.pretrain_flags import tiny_flags

    with pytest.raises(ValueError, match=flag):
        parse_config([*tiny_flags(), *flags], world_size=2)

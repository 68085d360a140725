"""The tiled loss's and the tiled MLP's device bytes on the emulated NPU equal the planner's (#49).

The emulated NPU counts every byte of every device tensor (``torch.npu.memory_allocated``);
where the planner and it disagree, one of them is wrong. The oracle is that counter; what is
compared with it is the planner's own functions for a ``ModelShape`` of the measured sizes:
:func:`~mcore_flash.planning.plan_memory` (its ``embeddings_and_loss``, ``logits_buffers``,
``activations`` and ``recompute_workspace``) and the terms behind them
(:func:`~mcore_flash.planning.activation_bytes.non_layer_terms`, ``layer_terms``,
:func:`~mcore_flash.planning.transient_bytes.loss_peak_terms`, ``mlp_backward_terms``).

The loss (bf16): a last pipeline stage's ``TiledLossGPTModel._postprocess`` on given hidden
states, megatron's path (``loss_chunk_size`` None: the output layer, then
``vocab_parallel_cross_entropy``) and the tiled one (``linear_cross_entropy``), followed by
the trainer's loss function (the masked sum) and the backward. Measured above the bytes
before the call (hidden states, labels, weights, the loss mask, the backward's seed, under
SP megatron's all-gather buffer, which the plan counts in ``communication_buffers``): the
loss's kept tensors (after the loss function) and its peak (forward and backward). The
planner's drop (megatron's less the tiled) in ``embeddings_and_loss`` equals the measured
kept drop, and in ``embeddings_and_loss + logits_buffers`` the measured peak drop; each
path's peak above its kept tensors is ``loss_peak_terms``' sum and its kept tensors the
loss's ``non_layer_terms``. Two exactly known differences from a device: the loss
function's 0-dim sum (4 B, alive into the backward; the planner counts no 0-dim tensors) is
left out of the measurement, and the emulated counter misses megatron's ``torch.arange``
over a loss tile (8 B a tile token, ``transient_bytes.NPU_ARANGE``: the CPU kernel resizes
the output inside the op, below the emulation's dispatch), alive at the tiled loss's peak,
which the planner counts as a device does.

The MLP (bf16, the trainer's layer MLP with the fused SwiGLU): untiled and tiled, as the flash
spec builds it, its output added to its input (the layer's residual) and the backward run
with a given gradient; weight gradients dropped as they are accumulated (megatron's DDP adds
each to its main gradient and drops it). Measured above the bytes before the forward (input,
gradient, weights, the all-gather buffer) less the residual sum: the kept bytes after the
forward and the backward's peak. The planner's drop in ``activations`` equals the kept drop,
in ``activations + recompute_workspace`` the backward-peak drop; each path's kept bytes are
its MLP intermediates and its peak those plus ``mlp_backward_terms``. ``npu_swiglu`` is a
double that allocates on the device what the NPU op returns (its output, its input's
gradient; computed on the host): the emulation's own double computes in fp32 scratch on the
device (``emulation/fused_ops.py``), which would make the MLP's peak the emulation's choice;
whether torch_npu's kernel takes device workspace for it is not known.

The cases make each moment of those functions the peak somewhere (megatron's loss: its
forward and its output layer's backward; the tiled loss: a tile's fp32 copy, its hidden-state
GEMM, the weight-gradient product; the MLP: fc2's, the activation's and fc1's backward, the
first tile's and the concatenated gradient), at TP1 and TP2 with and without sequence
parallelism, micro-batch 1 and 2, full tiles or one. Tolerance: none (the measurements equal
the predictions to the byte).

Activation offload parks the tiled MLP's tiles (item of #49: the pair is allowed): with
``N`` of 2 layers offloaded, the device after the forward holds ``N x P`` less, the host ``N x
V``, the released storages ``N x P``, ``P`` and ``V`` the planner's
:func:`~mcore_flash.planning.activation_bytes.offloaded_layer` of the tiled layer.
"""

from __future__ import annotations

import gc
import inspect
import sys
from dataclasses import replace

import torch

from mcore_flash.planning import Layout, plan_memory
from mcore_flash.planning import activation_bytes as act
from mcore_flash.planning import transient_bytes as tb
from mcore_flash.planning.models import ModelShape

from _support.dist_utils import run_distributed
from _support.models import TINY_TEST

# name: (seq s, loss tile N, vocabulary V, hidden h, micro-batch b, sequence parallel)
LOSS_TP1 = {
    "fp32 copy": (256, 64, 1024, 64, 1, False),  # megatron: forward; tiled: a tile's fp32 copy
    "b2": (256, 64, 1024, 64, 2, False),  # the labels' transposed copies
    "product": (256, 16, 1024, 64, 1, False),  # tiled: the weight-gradient product
    "gemm": (512, 128, 64, 256, 1, False),  # megatron: output layer's backward; tiled: GEMM
    "one tile": (256, 256, 1024, 64, 1, False),  # tiled: no previous tile
}
LOSS_TP2 = {
    "sp": (256, 64, 1024, 64, 1, True),
    "no sp": (256, 64, 1024, 64, 1, False),
    "sp b2": (256, 32, 1024, 64, 2, True),
    "sp backward": (256, 64, 256, 256, 1, True),  # megatron: the output layer's backward
}
# name: (seq s, MLP tile N, hidden h, ffn f, micro-batch b, sequence parallel)
MLP_TP1 = {
    "activation": (256, 64, 64, 256, 1, False),  # untiled: the activation's backward
    "b2": (256, 64, 64, 256, 2, False),  # tiled: the first tile's activation backward
    "concatenated": (512, 64, 128, 64, 1, False),  # tiled: the concatenated input gradient
}
MLP_TP2 = {
    "sp": (256, 64, 64, 256, 1, True),  # tiled: the first tile's fc2 backward
    "no sp": (256, 64, 64, 256, 1, False),
    "sp fc1": (128, 32, 128, 64, 2, True),  # both: fc1's backward
    "sp fc2": (256, 64, 128, 128, 1, True),  # untiled: fc2's backward
}
OFFLOAD_LAYERS, OFFLOAD_SEQ, OFFLOAD_BATCH, OFFLOAD_TILE = 2, 64, 2, 16


def _shape(h: int, f: int, vocab: int) -> ModelShape:
    """The measured sizes as a planner model (one layer; 4 heads, 2 groups: the tests')."""
    return ModelShape("measured", 1, h, f, 4, 2, vocab)


def _unmeasured_bytes() -> int:
    """Collect what reference cycles hold, then the device's bytes."""
    gc.collect()
    return torch.npu.memory_allocated()


def _transient_weight_gradients(module) -> None:
    """Drop each weight's gradient once accumulated, as megatron's DDP does after adding it to
    the main gradient (whose buffer exists before the step)."""
    for p in module.parameters():
        p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))


def _gather_buffer(seq: int, batch: int, hidden: int) -> None:
    """Megatron's sequence-parallel all-gather buffer, allocated once per process at its size."""
    from megatron.core.parallel_state import get_global_memory_buffer

    get_global_memory_buffer().get_tensor([seq, batch, hidden], torch.bfloat16, "mpu")


# -- the loss ---------------------------------------------------------------------------------


def _w_loss(rank, world_size, cases):
    """``{case: {path: {"kept", "peak"}}}`` of this rank (bytes; :func:`_loss_case`)."""
    from megatron.core import parallel_state

    from mcore_flash import platform

    assert platform.setup() == "npu"
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)
    try:
        return {name: _loss_case(world_size, *case) for name, case in cases.items()}
    finally:
        parallel_state.destroy_model_parallel()


def _loss_case(tp, seq, tile, vocab, hidden, batch, sp) -> dict:
    """Megatron's and the tiled loss's bytes (:func:`_loss_bytes`) of one case, this rank."""
    from megatron.core.models.gpt import GPTModel

    from mcore_flash import platform
    from mcore_flash.transformer import get_gpt_decoder_block_flash_spec
    from mcore_flash.transformer.gpt_model import TiledLossGPTModel

    from _support.gpt_models import tiny_config

    device = platform.torch_device()
    config = tiny_config(
        hidden_size=hidden,
        num_layers=1,
        params_dtype=torch.bfloat16,
        bf16=True,
        tensor_model_parallel_size=tp,
        sequence_parallel=sp,
    )
    out = {}
    for path, chunk in (("default", None), ("chunk", tile)):
        model = TiledLossGPTModel(
            config,
            get_gpt_decoder_block_flash_spec(config),
            vocab_size=vocab,
            max_sequence_length=seq,
            pre_process=False,
            post_process=True,
            position_embedding_type="rope",
            loss_chunk_size=chunk,
        ).to(device)
        _transient_weight_gradients(model)
        generator = torch.Generator().manual_seed(0)
        rows = seq // tp if sp else seq
        states = torch.randn(rows, batch, hidden, generator=generator).to(torch.bfloat16)
        states = states.to(device).requires_grad_()
        labels = torch.randint(0, vocab, (batch, seq), generator=generator).to(device)
        mask, seed = torch.ones(batch * seq, device=device), torch.ones((), device=device)
        if sp:
            _gather_buffer(seq, batch, hidden)
        arguments = dict.fromkeys(inspect.signature(GPTModel._postprocess).parameters)
        del arguments["self"]
        arguments.update(hidden_states=states, labels=labels)
        gc.disable()  # no collection at a moment set by the allocations
        try:
            out[path] = _loss_bytes(model, arguments, mask, seed)
        finally:
            gc.enable()
        del model, states
    return out


def _loss_bytes(model, arguments, mask, seed) -> dict:
    """The loss's kept bytes after the trainer's loss function and its peak (forward and
    backward), above the bytes before the call, the loss function's 0-dim sum left out."""
    base = _unmeasured_bytes()
    torch.npu.reset_peak_memory_stats()
    loss = model._postprocess(**arguments)
    forward = torch.npu.max_memory_allocated() - base
    total = (loss.float().reshape(-1) * mask).sum()  # mcore_flash.training.loop._loss_func
    del loss
    scalar = total.untyped_storage().nbytes()
    kept = torch.npu.memory_allocated() - base - scalar
    torch.npu.reset_peak_memory_stats()
    total.backward(seed)
    backward = torch.npu.max_memory_allocated() - base - scalar
    return {"kept": kept, "peak": max(forward, backward)}


def _loss_plan(tp, seq, tile, vocab, hidden, batch, sp, chunk) -> dict:
    """The planner's loss bytes of one path: the plan's categories, the loss's kept terms and
    its peak terms, and what the emulated counter misses of them."""
    model = _shape(hidden, 128, vocab)
    layout = Layout(
        tp=tp,
        sequence_parallel=sp,
        micro_batch_size=batch,
        global_batch_size=batch,
        loss_chunk_size=tile if chunk else None,
    )
    per_device = plan_memory(model, seq, layout).per_device
    options = dict(tp=tp, sequence_parallel=sp, loss_chunk_size=layout.loss_chunk_size)
    kept = act.non_layer_terms(model, seq, batch, first_stage=False, **options)
    return {
        "embeddings_and_loss": per_device["embeddings_and_loss"],
        "logits_buffers": per_device["logits_buffers"],
        "kept": act.sum_terms([t for t in kept if t.module == ""]),
        "peak": act.sum_terms(tb.loss_peak_terms(model, seq, batch, **options)),
        "missed": tb.NPU_ARANGE * tile * batch if chunk else 0,
    }


def _check_loss(cases, per_rank) -> list:
    """The failures (case, rank, what, measured, predicted): the drops and each path's bytes."""
    failures = []
    for name, case in cases.items():
        tp = len(per_rank)
        plans = {path: _loss_plan(tp, *case, path == "chunk") for path in ("default", "chunk")}
        d, c = plans["default"], plans["chunk"]
        kept_drop = d["embeddings_and_loss"] - c["embeddings_and_loss"]
        peak_drop = kept_drop + d["logits_buffers"] - c["logits_buffers"] + c["missed"]
        for rank, measured in enumerate(per_rank):
            m = measured[name]
            rows = {
                "kept drop": (m["default"]["kept"] - m["chunk"]["kept"], kept_drop),
                "peak drop": (m["default"]["peak"] - m["chunk"]["peak"], peak_drop),
            }
            for path, plan in plans.items():
                rows[f"{path} kept"] = (m[path]["kept"], plan["kept"])
                rows[f"{path} peak"] = (
                    m[path]["peak"],
                    plan["kept"] + plan["peak"] - plan["missed"],
                )
            print(f"loss {name} (TP{tp}), rank {rank}: {rows}")
            failures += [(name, rank, k, *v) for k, v in rows.items() if v[0] != v[1]]
    return failures


def test_the_loss_peak_and_kept_bytes_fall_by_the_planners_terms_at_tp1():
    (measured,) = run_distributed(_w_loss, 1, LOSS_TP1, emulate_npu=True, timeout=300)
    assert not _check_loss(LOSS_TP1, [measured])


def test_the_loss_peak_and_kept_bytes_fall_by_the_planners_terms_at_tp2():
    per_rank = run_distributed(_w_loss, 2, LOSS_TP2, emulate_npu=True, timeout=300)
    assert not _check_loss(LOSS_TP2, per_rank)


# -- the MLP ----------------------------------------------------------------------------------


class _SwiGLUDouble(torch.autograd.Function):
    """``npu_swiglu`` allocating on the device what the NPU op returns (its output; in
    backward its input's gradient), both of the input's dtype; the arithmetic on the host."""

    @staticmethod
    def forward(ctx, x, dim):
        ctx.save_for_backward(x)
        ctx.dim = dim
        a, b = x.cpu().float().chunk(2, dim=dim)
        return (torch.nn.functional.silu(a) * b).to(x.dtype).to(x.device)

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        a, b = x.cpu().float().chunk(2, dim=ctx.dim)
        sigmoid, dy = torch.sigmoid(a), dy.cpu().float()
        da = dy * b * sigmoid * (1 + a * (1 - sigmoid))
        grad = torch.cat([da, dy * a * sigmoid], dim=ctx.dim)
        return grad.to(x.dtype).to(x.device), None


def _w_mlp(rank, world_size, cases):
    """``{case: {path: {"kept", "peak"}}}`` of this rank (bytes; :func:`_mlp_bytes`)."""
    from megatron.core import parallel_state

    from mcore_flash import platform

    assert platform.setup() == "npu"
    sys.modules["torch_npu"].npu_swiglu = lambda x, dim=-1: _SwiGLUDouble.apply(x, dim)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)
    try:
        return {name: _mlp_case(world_size, *case) for name, case in cases.items()}
    finally:
        parallel_state.destroy_model_parallel()


def _mlp_case(tp, seq, tile, hidden, ffn, batch, sp) -> dict:
    """The untiled and the tiled MLP's bytes (:func:`_mlp_bytes`) of one case, this rank."""
    from mcore_flash import platform

    from _support.gpt_models import flash_gpt, tiny_config

    device = platform.torch_device()
    config = tiny_config(
        hidden_size=hidden,
        ffn_hidden_size=ffn,
        num_layers=1,
        params_dtype=torch.bfloat16,
        bf16=True,
        use_te_activation_func=True,
        tensor_model_parallel_size=tp,
        sequence_parallel=sp,
    )
    out = {}
    for path, chunk in (("untiled", None), ("tiled", tile)):
        mlp = flash_gpt(config, mlp_chunk_size=chunk).decoder.layers[0].mlp.to(device)
        _transient_weight_gradients(mlp)
        rows = seq // tp if sp else seq
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(rows, batch, hidden, generator=generator).to(torch.bfloat16)
        x = x.to(device).requires_grad_()
        grad = torch.ones(rows, batch, hidden, dtype=torch.bfloat16, device=device)
        if sp:
            _gather_buffer(seq, batch, hidden)
        gc.disable()
        try:
            out[path] = _mlp_bytes(mlp, x, grad)
        finally:
            gc.enable()
        del mlp, x, grad
    return out


def _mlp_bytes(mlp, x, grad) -> dict:
    """The MLP's kept bytes after its forward and its backward's peak, above the bytes before
    the forward, the residual sum (the layer's, not the MLP's) left out."""
    base = _unmeasured_bytes()
    output, _ = mlp(x)
    residual = x + output
    del output
    summed = residual.untyped_storage().nbytes()
    kept = torch.npu.memory_allocated() - base - summed
    torch.npu.reset_peak_memory_stats()
    residual.backward(grad)
    return {"kept": kept, "peak": torch.npu.max_memory_allocated() - base - summed}


def _mlp_plan(tp, seq, tile, hidden, ffn, batch, sp, tiled) -> dict:
    """The planner's MLP bytes of one path: the plan's categories, the MLP's intermediates
    (its kept terms beyond its input) and its backward's peak terms."""
    model = _shape(hidden, ffn, 128)
    chunk = tile if tiled else None
    layout = Layout(
        tp=tp,
        sequence_parallel=sp,
        micro_batch_size=batch,
        global_batch_size=batch,
        mlp_chunk_size=chunk,
    )
    per_device = plan_memory(model, seq, layout).per_device
    options = dict(tp=tp, sequence_parallel=sp, mlp_chunk_size=chunk)
    terms = act.layer_terms(model, seq, batch, **options)
    intermediates = [t for t in terms if t.module in ("mlp.activation_func", "mlp.linear_fc2")]
    return {
        "activations": per_device["activations"],
        "recompute_workspace": per_device["recompute_workspace"],
        "kept": act.sum_terms(intermediates),
        "peak": act.sum_terms(tb.mlp_backward_terms(model, seq, batch, **options)),
    }


def _check_mlp(cases, per_rank) -> list:
    """The failures (case, rank, what, measured, predicted): the drops and each path's bytes."""
    failures = []
    for name, case in cases.items():
        tp = len(per_rank)
        plans = {path: _mlp_plan(tp, *case, path == "tiled") for path in ("untiled", "tiled")}
        u, t = plans["untiled"], plans["tiled"]
        kept_drop = u["activations"] - t["activations"]
        peak_drop = kept_drop + u["recompute_workspace"] - t["recompute_workspace"]
        for rank, measured in enumerate(per_rank):
            m = measured[name]
            rows = {
                "kept drop": (m["untiled"]["kept"] - m["tiled"]["kept"], kept_drop),
                "backward peak drop": (m["untiled"]["peak"] - m["tiled"]["peak"], peak_drop),
            }
            for path, plan in plans.items():
                rows[f"{path} kept"] = (m[path]["kept"], plan["kept"])
                rows[f"{path} backward peak"] = (m[path]["peak"], plan["kept"] + plan["peak"])
            print(f"MLP {name} (TP{tp}), rank {rank}: {rows}")
            failures += [(name, rank, k, *v) for k, v in rows.items() if v[0] != v[1]]
    return failures


def test_the_mlp_kept_bytes_and_backward_peak_fall_by_the_planners_terms_at_tp1():
    (measured,) = run_distributed(_w_mlp, 1, MLP_TP1, emulate_npu=True, timeout=300)
    assert not _check_mlp(MLP_TP1, [measured])


def test_the_mlp_kept_bytes_and_backward_peak_fall_by_the_planners_terms_at_tp2():
    per_rank = run_distributed(_w_mlp, 2, MLP_TP2, emulate_npu=True, timeout=300)
    assert not _check_mlp(MLP_TP2, per_rank)


# -- activation offload of the tiled MLP ------------------------------------------------------


def _w_offload(rank, world_size):
    """Per offloaded layers N = 0..L of the tiled-MLP model (fp32, no recompute): the device
    bytes after the forward, the storages the offload released and its host bytes."""
    from megatron.core import parallel_state

    from mcore_flash import platform
    from mcore_flash.runtime.distributed import set_random_seed
    from mcore_flash.transformer import activation_offload

    from _support.gpt_models import batch, flash_gpt, tiny_config

    assert platform.setup() == "npu"
    parallel_state.initialize_model_parallel()
    set_random_seed(1234)
    device = platform.torch_device()
    tokens, labels, positions = (t.to(device) for t in batch(OFFLOAD_BATCH, OFFLOAD_SEQ))
    config = tiny_config(num_layers=OFFLOAD_LAYERS, use_te_activation_func=True)

    def model():
        return flash_gpt(config, mlp_chunk_size=OFFLOAD_TILE).to(device)

    model()(tokens, positions, None, labels=labels).mean().backward()  # the process's caches
    out = {}
    for layers in range(OFFLOAD_LAYERS + 1):
        gpt = model()
        offload = activation_offload.install(gpt.decoder, layers)
        start = _unmeasured_bytes()
        loss = gpt(tokens, positions, None, labels=labels)
        out[layers] = {
            "after_forward": torch.npu.memory_allocated() - start,
            "released": offload.released_bytes,
            "host": offload.parked_bytes,
        }
        loss.mean().backward()
        del gpt, offload, loss
    parallel_state.destroy_model_parallel()
    return out


def test_activation_offload_parks_the_tiled_mlps_tiles_as_the_planner_counts():
    (measured,) = run_distributed(_w_offload, 1, emulate_npu=True, timeout=300)
    model = replace(TINY_TEST, num_layers=OFFLOAD_LAYERS)
    terms = act.layer_terms(
        model,
        OFFLOAD_SEQ,
        OFFLOAD_BATCH,
        sequence_parallel=False,
        dtype_bytes=4,
        mlp_chunk_size=OFFLOAD_TILE,
    )
    assert any(t.name.startswith("input (the tiles'") for t in terms)  # tiled
    layer = act.offloaded_layer(terms, "none")
    print(f"activation offload of the tiled MLP's layers: {measured}; planner {layer}")
    for n in range(1, OFFLOAD_LAYERS + 1):
        run = measured[n]
        assert measured[0]["after_forward"] - run["after_forward"] == n * layer.parked, n
        assert run["released"] == n * layer.parked, n
        assert run["host"] == n * layer.fetched, n

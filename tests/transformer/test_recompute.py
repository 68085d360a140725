"""Recompute modes with the flash spec: identical gradients, and really less saved memory.

Oracle: the same model without recompute (same weights, same seeds), with attention and
hidden dropout on so that RNG replay is exercised.
"""

from __future__ import annotations

import pytest
import torch

from _support.dist_utils import init_megatron, run_distributed, teardown_megatron
from _support.gpt_models import assert_same_bits, batch, flash_gpt, full_grads, tiny_config

MODES = ("none", "qkv", "attention", "full", "attention+mlp", "qkv+mlp", "partial")


def _mode_settings(mode):
    from mcore_flash.transformer.recompute import recompute_mode_settings, recompute_settings

    if (
        mode == "partial"
    ):  # layer 1 of 2 recomputed whole, the other with qkv + megatron's mlp and layernorm
        return recompute_settings("full", "block", 1, ["qkv", "mlp", "layernorm"])
    if mode.endswith("+mlp"):
        first = {"attention": "core_attn", "qkv": "qkv"}[mode.split("+")[0]]
        return recompute_settings("selective", modules=[first, "mlp", "layernorm"])
    return recompute_mode_settings(mode)


def _model(mode, **config):
    settings = _mode_settings(mode)
    return flash_gpt(
        tiny_config(**settings.config, **config), layer_recompute_modules=settings.layer_modules
    )


def _w_recompute(rank, world_size, modes, sequence_parallel):
    """Per mode: (loss, full grads) with dropout on, and saved bytes per layer with it off."""
    init_megatron(tp=world_size, seed=11)
    try:
        from megatron.core import tensor_parallel

        from mcore_flash.measured_memory import measure_activation_bytes

        tokens, labels, positions = batch(seq=64)
        results = {}
        for mode in modes:
            common = dict(
                tensor_model_parallel_size=world_size, sequence_parallel=sequence_parallel
            )
            model = _model(mode, attention_dropout=0.3, hidden_dropout=0.2, **common)
            torch.manual_seed(5)
            tensor_parallel.model_parallel_cuda_manual_seed(11)
            loss = model(tokens, positions, None, labels=labels)
            loss.mean().backward()
            saved = measure_activation_bytes(
                _model(mode, **common), tokens, positions, None, labels=labels
            )
            results[mode] = (loss.detach(), full_grads(model), saved.per_layer())
        return results
    finally:
        teardown_megatron()


def _assert_same(results, reference="none"):
    ref_loss, ref_grads, _ = results[reference]
    for mode, (loss, grads, _) in results.items():
        assert_same_bits(loss, grads, ref_loss, ref_grads, mode)


def test_recompute_modes_give_identical_gradients_with_dropout():
    results = run_distributed(_w_recompute, 1, MODES, False)[0]
    _assert_same(results)
    none, attention, full = (results[m][2] for m in ("none", "attention", "full"))
    # attention-only keeps nothing of the attention sub-block but the layer input ...
    assert not any(k.startswith(("self_attention", "input_layernorm")) for k in attention)
    assert attention["<layer>"] == 64 * 2 * 64 * 4  # s * b * h * fp32
    # ... and the MLP sub-block exactly as without recompute
    assert {k: v for k, v in attention.items() if k.startswith(("mlp", "pre_mlp"))} == {
        k: v for k, v in none.items() if k.startswith(("mlp", "pre_mlp"))
    }
    assert sum(attention.values()) <= 0.75 * sum(none.values())  # >= 25% of the layer's bytes
    assert full == {}  # full recompute: nothing inside the layers (inputs are charged to the block)
    # partial: the block recomputes the first layer whole; the second keeps what qkv+mlp keeps
    assert results["partial"][2] == results["qkv+mlp"][2]
    # the no-recompute baseline really saves the attention sub-block (the test can fail)
    assert none["self_attention.core_attention"] > 0


def test_qkv_recompute_keeps_the_input_the_kernel_output_and_its_statistics():
    """qkv drops norm -> QKV -> RoPE's tensors and the kernel's q, k, v; the rest is as without recompute."""
    results = run_distributed(_w_recompute, 1, ("none", "qkv", "qkv+mlp"), False)[0]
    _assert_same(results)
    none, qkv, qkv_mlp = (results[m][2] for m in ("none", "qkv", "qkv+mlp"))
    s, b, h, heads, d = 64, 2, 64, 4, 16
    assert (
        qkv["input_layernorm"] == s * b * h * 4
    )  # the layer input, fp32 (its statistics are recomputed)
    assert (
        qkv["self_attention.core_attention"] == s * b * heads * d * 4 + b * heads * s * 4
    )  # out + lse
    assert not any(
        k.startswith(("self_attention.linear_qkv", "self_attention.linear_proj")) for k in qkv
    )
    assert "self_attention" not in qkv  # RoPE's cos/sin
    after_attention = ("mlp", "pre_mlp", "<layer>")
    assert {k: v for k, v in qkv.items() if k.startswith(after_attention)} == {
        k: v for k, v in none.items() if k.startswith(after_attention)
    }
    assert (
        none["self_attention.linear_qkv"] > 0 and none["self_attention"] > 0
    )  # the baseline keeps them
    assert sum(qkv_mlp.values()) < sum(qkv.values())  # megatron's mlp module combines with qkv


def test_recompute_modes_under_tp2_sequence_parallel():
    per_rank = run_distributed(_w_recompute, 2, ("none", "qkv", "attention", "full"), True)
    for results in per_rank:
        _assert_same(results)


@pytest.mark.parametrize(
    "kwargs,flag",
    [
        (dict(granularity="full"), "--recompute-method"),
        (dict(granularity="full", method="uniform"), "--recompute-num-layers"),
        (dict(granularity="selective", num_layers=2), "--recompute-num-layers"),
        (dict(granularity="selective", method="block"), "--recompute-method"),
        (dict(granularity="everything"), "--recompute-granularity"),
        (dict(granularity=None, modules=["core_attn"]), "--recompute-granularity"),
        (
            dict(granularity="full", method="uniform", num_layers=1, modules=["mlp"]),
            "--recompute-modules",
        ),
        (dict(granularity="selective", modules=["qkv", "core_attn"]), "qkv core_attn"),
    ],
)
def test_contradictory_recompute_flags(kwargs, flag):
    from mcore_flash.transformer.recompute import recompute_settings

    with pytest.raises(ValueError, match=flag):
        recompute_settings(**kwargs)

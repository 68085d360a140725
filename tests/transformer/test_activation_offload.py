"""Activation offload (``--activation-offload-layers``): the same numbers, fewer device bytes.

Oracles: the same model without offload (same weights, same seeds, dropout on so that the
recompute's RNG replay runs too) for gradients, bit for bit; on the emulated NPU, whose
``torch.npu.memory_allocated`` counts live npu storages exactly, the device bytes after the
forward and at the step's peak against the bytes of the tensors parked, counted by hand from
the shapes under full recompute (one layer input ``[s, b, h]`` per offloaded layer).
"""

from __future__ import annotations

import pytest
import torch

from mcore_flash.planning.layout import RECOMPUTE_FLAGS

from _support.dist_utils import init_megatron, run_distributed, teardown_megatron
from _support.gpt_models import assert_same_bits, batch, flash_gpt, full_grads, tiny_config
from _support.recipe_runs import TINY, w_recipe_runs

MODES = ("none", "full", "qkv")
SEQ, BATCH, HIDDEN = 64, 2, 64


def _model(mode, num_layers=2, **config):
    from mcore_flash.transformer.recompute import recompute_mode_settings

    settings = recompute_mode_settings(mode)
    return flash_gpt(
        tiny_config(num_layers=num_layers, **settings.config, **config),
        layer_recompute_modules=settings.layer_modules,
    )


def _step(model, offload_layers, device="cpu"):
    """(loss, full grads, the offload's events) of one forward + backward with dropout seeds fixed."""
    from megatron.core import tensor_parallel

    from mcore_flash.transformer import activation_offload

    offload = activation_offload.install(model.decoder, offload_layers)
    tokens, labels, positions = (t.to(device) for t in batch(BATCH, SEQ))
    torch.manual_seed(5)
    tensor_parallel.model_parallel_cuda_manual_seed(11)
    loss = model(tokens, positions, None, labels=labels)
    loss.float().mean().backward()
    return loss.detach(), full_grads(model), offload.events


def _w_grads(rank, world_size, cases):
    init_megatron(seed=11)
    try:
        results = {}
        for mode, dtype in cases:
            precision = dict(params_dtype=dtype, bf16=dtype == torch.bfloat16)
            for layers in (0, 1, 3):
                model = _model(
                    mode, num_layers=3, attention_dropout=0.3, hidden_dropout=0.2, **precision
                )
                results[mode, str(dtype), layers] = _step(model, layers)
        return results
    finally:
        teardown_megatron()


def test_offload_gives_identical_loss_and_gradients():
    cases = [(mode, dtype) for mode in MODES for dtype in (torch.float32, torch.bfloat16)]
    results = run_distributed(_w_grads, 1, cases, timeout=300)[0]
    for mode, dtype in cases:
        ref_loss, ref_grads, _ = results[mode, str(dtype), 0]
        for layers in (1, 3):
            loss, grads, events = results[mode, str(dtype), layers]
            assert_same_bits(loss, grads, ref_loss, ref_grads, f"{mode} {dtype} N={layers}")
            assert [e for e in events if e.startswith("d2h")] == [f"d2h {i}" for i in range(layers)]


def test_copies_are_issued_one_layer_ahead():
    """Forward: layer i's copies go out when layer i + 1 starts, its device copies are dropped
    at the next boundary; backward: layer i's first unpack waits for its own copies back and
    issues layer i - 1's (the prefetch), which is waited for only when layer i - 1's starts."""
    events = run_distributed(_w_grads, 1, [("full", torch.float32)])[0]["full", "torch.float32", 3]
    assert events[2] == [
        "forward 0",
        "forward 1",
        "d2h 0",
        "forward 2",
        "d2h 1",
        "release 0",
        "d2h 2",  # at the block's end (the final norm starts)
        "release 1",
        "release 2",
        # backward: layer 2 first, fetched on demand, then one layer ahead
        "h2d 2",
        "wait 2",
        "h2d 1",
        "wait 1",
        "h2d 0",
        "wait 0",
    ]


def _device_bytes():
    import gc

    gc.collect()
    return torch.npu.memory_allocated()


def _w_npu_bytes(rank, world_size, modes):
    """On the emulated NPU, per mode and N: (device bytes after the forward, peak of the
    step, bytes parked after the forward, every parked copy on the host, grads)."""
    from megatron.core import parallel_state

    from mcore_flash import platform
    from mcore_flash.training.distributed import set_random_seed
    from mcore_flash.transformer import activation_offload

    assert platform.setup() == "npu"
    parallel_state.initialize_model_parallel()
    set_random_seed(1234)
    device = platform.torch_device()
    tokens, labels, positions = (t.to(device) for t in batch(BATCH, SEQ))
    _model("none", num_layers=3).to(device)(
        tokens, positions, None, labels=labels
    ).mean().backward()
    out = {}  # (after the warm-up above: the first step leaves caches allocated)
    for mode in modes:
        for layers in (0, 2):
            model = _model(mode, num_layers=3).to(device)
            offload = activation_offload.install(model.decoder, layers)
            start = _device_bytes()
            torch.npu.reset_peak_memory_stats()
            loss = model(tokens, positions, None, labels=labels)
            after_forward = _device_bytes() - start
            parcels = offload._parcels
            on_host = all(
                host.device.type == "cpu" and dev is None
                for p in parcels
                for host, dev in zip(p.host, p.device)
            )
            parked = offload.parked_bytes, offload.released_bytes
            forward_peak = torch.npu.max_memory_allocated() - start
            loss.mean().backward()
            peak = torch.npu.max_memory_allocated() - start
            grads = {n: p.grad.cpu() for n, p in model.named_parameters()}
            out[mode, layers] = (after_forward, forward_peak, peak, parked, on_host, len(parcels))
            out[mode, layers] += (grads,)
            del model, offload, loss, parcels
    return out


def test_offloaded_bytes_leave_the_device_on_the_emulated_npu():
    results = run_distributed(_w_npu_bytes, 1, MODES, emulate_npu=True, timeout=300)[0]
    layer_input = SEQ * BATCH * HIDDEN * 4  # [s, b, h] fp32
    for mode in MODES:
        forward0, fpeak0, peak0, parked0, _, _, grads0 = results[mode, 0]
        forward2, fpeak2, peak2, (parked2, released2), on_host, parcels, grads2 = results[mode, 2]
        print(mode, forward0 - forward2, fpeak0 - fpeak2, peak0 - peak2, parked2, released2)
        assert parked0 == (0, 0) and parcels == 2 and on_host, mode
        if mode == "full":
            assert parked2 == released2 == 2 * layer_input
        assert forward0 - forward2 == released2, mode
        # the forward's peak: lower by all but the one layer whose copy is in flight (its
        # device tensors are released at the next boundary, after the copy)
        assert 0 <= fpeak0 - fpeak2 <= released2, mode
        assert peak2 <= peak0, mode
        for name, grad in grads0.items():
            torch.testing.assert_close(grads2[name], grad, atol=0, rtol=0, msg=name)


PACKED = ["--reset-attention-mask", "--reset-position-ids"]
TRAINER_CASES = {  # name: (layout flags, offloaded layers per stage)
    "tp2-sp-full": (
        ["--tensor-model-parallel-size", "2", "--sequence-parallel", *RECOMPUTE_FLAGS["full"]],
        2,
    ),
    "cp2-qkv": (["--context-parallel-size", "2", *RECOMPUTE_FLAGS["qkv"]], 2),
    "packed-none": (PACKED, 1),
    "pp2-full": (["--pipeline-model-parallel-size", "2", *RECOMPUTE_FLAGS["full"]], 1),
}


def _copies(recipe, _) -> dict:
    offload = getattr(recipe.model_chunks[0].module, "activation_offload", None)
    return {"d2h": 0 if offload is None else sum(e.startswith("d2h") for e in offload.events)}


def test_trainer_runs_equal_without_offload_at_two_ranks(tmp_path):
    """Per step, loss and grad norm equal to the run without offload (TP2 + SP, CP2 ring,
    packed documents, PP2)."""
    runs = []
    for name, (flags, layers) in TRAINER_CASES.items():
        runs += [
            (name, flags),
            (f"{name}-offload", [*flags, "--activation-offload-layers", str(layers)]),
        ]
    per_rank = run_distributed(w_recipe_runs, 2, runs, str(tmp_path), _copies, timeout=600)
    for rank, results in enumerate(per_rank):
        for name in TRAINER_CASES:
            base, offload = results[name], results[f"{name}-offload"]
            assert offload["steps"] == base["steps"], (rank, name)
            assert base["d2h"] == 0 and offload["d2h"] > 0, (rank, name)


def _refusal(argv, world_size=2) -> str:
    from mcore_flash.training.arguments import parse_config

    with pytest.raises(ValueError) as error:
        parse_config([*TINY, *argv], world_size=world_size)
    return str(error.value)


@pytest.mark.parametrize(
    "argv, names",
    [
        (["--activation-offload-layers", "-1"], ["--activation-offload-layers -1", "0..2"]),
        (["--activation-offload-layers", "3"], ["--activation-offload-layers 3", "0..2"]),
        (
            ["--pipeline-model-parallel-size", "2", "--activation-offload-layers", "2"],
            ["--activation-offload-layers 2", "0..1", "per pipeline stage"],
        ),
        (
            ["--activation-offload-layers", "1", *RECOMPUTE_FLAGS["full"][:-1], "2"],
            ["--recompute-method uniform", "--recompute-num-layers 1"],
        ),
        (
            ["--activation-offload-layers", "1", "--use-megatron-fsdp"],
            ["--use-megatron-fsdp", "--activation-offload-layers"],
        ),
    ],
)
def test_bad_offload_flags_are_refused_by_name(argv, names):
    message = _refusal(argv)
    for name in names:
        assert name in message, message


def test_offload_accepts_partial_recompute_and_the_block_refuses_too_many_layers():
    from mcore_flash.training.arguments import parse_config

    config = parse_config(
        [
            *TINY,
            "--activation-offload-layers",
            "2",
            "--recompute-granularity",
            "full",
            "--recompute-method",
            "block",
            "--recompute-num-layers",
            "1",
        ],
        world_size=1,
    )
    assert config.activation_offload_layers == 2
    from mcore_flash.transformer.activation_offload import ActivationOffload

    with pytest.raises(ValueError, match="--activation-offload-layers 3: choose 0..2"):
        ActivationOffload(_Block(2), 3)


class _Block(torch.nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Identity() for _ in range(layers))

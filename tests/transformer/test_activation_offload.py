"""Activation offload (``--activation-offload-layers``): the same numbers, fewer device bytes.

Oracles: the same model without offload (same weights, same seeds, dropout on so that the
recompute's RNG replay runs too) for gradients, bit for bit; on the emulated NPU, whose
``torch.npu.memory_allocated`` counts live npu storages exactly, the run without offload's
device bytes at each layer's backward and at each backward phase's peak, less what the
offload's order of events leaves alive there, counted from the planner's per-layer bytes
(:func:`mcore_flash.planning.activation_bytes.offloaded_layer`), never from the offload's own
counters; the step's peak follows from those phase peaks.
"""

from __future__ import annotations

import functools

import pytest
import torch

from mcore_flash.planning.parallel_layout import RECOMPUTE_FLAGS

from _support.dist_utils import init_megatron, run_distributed, teardown_megatron
from _support.gpt_models import assert_same_bits, batch, flash_gpt, full_grads, tiny_config
from _support.recipe_runs import TINY, refusal, w_recipe_runs

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


L = 4  # layers of the emulated-NPU model: every N of 1..L offloaded


def _npu_model(mode):
    """The trainer's layer (fused SwiGLU, ``use_te_activation_func``), L layers, fp32."""
    from mcore_flash.transformer.recompute import recompute_mode_settings

    settings = recompute_mode_settings(mode)
    return flash_gpt(
        tiny_config(num_layers=L, use_te_activation_func=True, **settings.config),
        layer_recompute_modules=settings.layer_modules,
    )


def _w_npu_phases(rank, world_size, modes):
    """On the emulated NPU, per mode and N (0 = no offload): the device bytes (current, and
    the peak since the previous mark) at each mark of one step, the step's peak, the bytes
    after the forward, the host copies, what each parked layer released, whether every
    parked copy is on the host with its device copy dropped, the grads.

    Marks: ``F i`` when layer i's forward starts (``F L``: the final norm's); ``B i`` when
    the gradient of layer i's input is computed, i.e. layer i's backward ends and layer
    i - 1's begins (``B L``: the logits' backward ends). Main gradients are allocated
    before the step (as megatron's DDP buffers are), so that the layers' backward phases
    differ only by the kept tensors alive."""

    from megatron.core import parallel_state

    from mcore_flash import platform
    from mcore_flash.runtime.distributed import set_random_seed
    from mcore_flash.transformer import activation_offload

    assert platform.setup() == "npu"
    parallel_state.initialize_model_parallel()
    set_random_seed(1234)
    device = platform.torch_device()
    tokens, labels, positions = (t.to(device) for t in batch(BATCH, SEQ))
    _npu_model("none").to(device)(tokens, positions, None, labels=labels).mean().backward()
    out = {}
    for mode in modes:
        for layers in range(L + 1):
            model = _npu_model(mode).to(device)
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
            marks = _Marks(model)
            offload = activation_offload.install(model.decoder, layers)
            _measured_step(model, offload, marks, tokens, positions, labels)  # lazy caches
            for p in model.parameters():
                p.grad.zero_()
            out[mode, layers] = _measured_step(model, offload, marks, tokens, positions, labels)
            out[mode, layers]["grads"] = {n: p.grad.cpu() for n, p in model.named_parameters()}
            del model, offload, marks
    return out


class _Marks:
    """The device bytes (current, peak since the previous mark) at the marks of one step."""

    def __init__(self, model):
        self.marks, self.forward = {}, True
        for index, module in [*enumerate(model.decoder.layers), (L, model.decoder.final_layernorm)]:
            module.register_forward_pre_hook(
                functools.partial(self.starts, index), with_kwargs=True
            )

    def mark(self, name):
        self.marks[name] = (torch.npu.memory_allocated(), torch.npu.max_memory_allocated())
        torch.npu.reset_peak_memory_stats()

    def starts(self, index, module, args, kwargs):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        if self.forward:  # not a recompute in backward
            self.mark(f"F {index}")
            hidden.register_hook(lambda grad: self.mark(f"B {index}"))


def _measured_step(model, offload, marks, tokens, positions, labels) -> dict:
    import gc

    gc.collect()
    gc.disable()  # what a reference cycle holds is freed at the next step's collect, not at
    try:  # a moment set by how many objects the offload allocates
        return _step_bytes(model, offload, marks, tokens, positions, labels)
    finally:
        gc.enable()


def _step_bytes(model, offload, marks, tokens, positions, labels) -> dict:
    marks.marks, marks.forward = {}, True
    released = offload.released_bytes
    start = torch.npu.memory_allocated()
    torch.npu.reset_peak_memory_stats()
    loss = model(tokens, positions, None, labels=labels)
    marks.forward = False
    after_forward = torch.npu.memory_allocated() - start
    forward_peak = max([torch.npu.max_memory_allocated()] + [p for _, p in marks.marks.values()])
    host = offload.parked_bytes  # (drops the previous step's freed copies from _parcels)
    parcels = offload._parcels
    on_host = all(
        host.device.type == "cpu" and dev is None
        for p in parcels
        for host, dev in zip(p.host, p.device)
    )
    result = dict(
        after_forward=after_forward,
        forward_peak=forward_peak - start,
        host=host,
        released=offload.released_bytes - released,
        on_host=on_host,
        parcels=len(parcels),
    )
    del parcels
    marks.mark("loss")
    loss.mean().backward()
    result["backward"] = {
        n: (now - start, peak - start) for n, (now, peak) in marks.marks.items() if n[0] == "B"
    }
    return result


def _offloaded_layer(mode):
    """The planner's S, R, P, V of one layer of :func:`_npu_model` (npu profile, fp32)."""
    from dataclasses import replace

    from mcore_flash.planning import activation_bytes as act

    from _support.models import TINY_TEST

    model = replace(TINY_TEST, num_layers=L)
    terms = act.layer_terms(
        model,
        SEQ,
        BATCH,
        tp=1,
        cp=1,
        sequence_parallel=False,
        recompute=mode,
        profile="npu",
        dtype_bytes=4,
    )
    return act.offloaded_layer(terms, mode)


def _predicted_drops(mode, n):
    """What N = n offloaded layers take off the device, by mark (``B i``), from the offload's
    order of events (``ActivationOffload``'s docstring;
    :func:`test_copies_are_issued_one_layer_ahead`) and the planner's per-layer bytes S
    (kept), R (left on the device), P = S - R (released), V (fetched back): ``(at the mark,
    at the peak of the phase that ends there)``.

    * ``B L`` (the logits' backward) and ``B i + 1`` for i >= n (layer i's backward, not
      offloaded): the n offloaded layers are parked, at the mark and throughout: n P.
    * layer j < n's backward starts at ``B j + 1``: layers 0..j hold (j + 1) R and, unless j
      = n - 1 (fetched on demand at its first unpack), layer j's copies prefetched by layer
      j + 1's backward, V: (j + 1) P - V, or n P for j = n - 1.
    * its phase's peak (the emulated attention backward's fp32 scratch, after the MLP and
      ``linear_proj`` have consumed their tensors: what is left of layer j is the same
      bytes with or without offload): layers below j hold j R, and layer j - 1 (j >= 1) its
      prefetched V: j P - V (j >= 1), 0 (j = 0).
    """
    layer = _offloaded_layer(mode)
    p, v = layer.parked, layer.fetched

    def starts(i):  # at the mark where layer i's backward starts
        return n * p if i >= n - 1 else (i + 1) * p - v

    def phase_peak(i):  # at the peak of layer i's backward
        return n * p if i >= n else (i * p - v if i else 0)

    drops = {f"B {L}": (starts(L - 1), n * p)}
    for k in range(L):
        drops[f"B {k}"] = (starts(k - 1) if k else 0, phase_peak(k))
    return drops


def test_offloaded_bytes_and_the_step_peak_on_the_emulated_npu():
    """Per recompute mode and N = 1..L: the device bytes at each layer's backward start and
    the peak of each backward phase, less than without offload by exactly the bytes the
    offload's order of events leaves alive (:func:`_predicted_drops`, from the planner's
    per-layer bytes); the step's peak lower by what those phase peaks give; after the
    forward lower by N P; the host copies N V; the gradients the same bits."""
    results = run_distributed(_w_npu_phases, 1, MODES, emulate_npu=True, timeout=300)[0]
    for mode in MODES:
        layer = _offloaded_layer(mode)
        base = results[mode, 0]
        assert base["host"] == base["released"] == 0 and base["parcels"] == 0
        base_peak = max(peak for _, peak in base["backward"].values())
        assert base["forward_peak"] < base_peak, mode  # the step's peak is in the backward
        for n in range(1, L + 1):
            run = results[mode, n]
            what = f"{mode} N={n}"
            assert run["parcels"] == n and run["on_host"], what
            assert run["released"] == n * layer.parked, what
            assert run["host"] == n * layer.fetched, what
            assert base["after_forward"] - run["after_forward"] == n * layer.parked, what
            predicted = _predicted_drops(mode, n)
            assert set(predicted) == set(base["backward"]) == set(run["backward"]), what
            for name, (now, peak) in base["backward"].items():
                now_n, peak_n = run["backward"][name]
                measured = (now - now_n, peak - peak_n)
                assert measured == predicted[name], (what, name, measured, predicted[name])
            # the step's peak: each backward phase's peak less its predicted drop
            peak_n = max(peak - predicted[name][1] for name, (_, peak) in base["backward"].items())
            assert run["forward_peak"] < peak_n, what
            assert max(peak for _, peak in run["backward"].values()) == peak_n, what
            print(what, "step peak drop", base_peak - peak_n, layer)
            for name, grad in base["grads"].items():
                torch.testing.assert_close(run["grads"][name], grad, atol=0, rtol=0, msg=name)


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
    message = refusal(argv)
    for name in names:
        assert name in message, message


def test_offload_accepts_partial_recompute_and_the_block_refuses_too_many_layers():
    from mcore_flash.runtime.arguments import parse_config

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

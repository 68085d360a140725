"""mcore_flash.platform: megatron-core 0.16 on the CPU with gloo, through setup("cpu") only.

Every megatron run happens in spawned workers (tests/_support/dist_utils.py), so the pytest process
itself never gets the CPU adaptations and each run starts from a clean interpreter. To keep
the file fast on 2 cores there are two runs - one process (`single`) and two processes
(`pair`) - each executing named sections; a failing section fails only its own tests.
Each distributed result is compared with an independent expectation (the 1-process run, a
run without checkpointing, a closed-form formula).
"""

from __future__ import annotations

import math
import subprocess
import sys
import traceback

import pytest
import torch

from mcore_flash import platform
from mcore_flash.runtime.distributed import set_random_seed

from _support.dist_utils import init_megatron, run_distributed, teardown_megatron
from _support.gpt_models import full_weights, load_full_weights

HIDDEN, HEADS, GROUPS, FFN, VOCAB, SEQ, LAYERS = 64, 4, 2, 128, 128, 32, 2
SEED = 1234
DDP_STEPS = 3


def _section(out, name, fn, *args):
    try:
        out[name] = (True, fn(*args))
    except Exception:
        out[name] = (False, traceback.format_exc())


def _get(run, name):
    ok, value = run[name]
    if not ok:
        pytest.fail(f"section {name!r} failed in the worker:\n{value}", pytrace=False)
    return value


def _single_worker(rank, world_size):
    """One process: platform checks, mask/RoPE, GPT at TP=1, DDP + dist-opt on 1 rank."""
    out = {}
    _section(out, "setup", _setup_section)
    init_megatron(tp=1, seed=SEED)
    try:
        _section(out, "fsdp", _fsdp_section)
        _section(out, "cpu_rng_scope", _cpu_rng_scope_section)
        _section(out, "mask_rope", _mask_rope_section)
        _section(out, "gpt", _gpt_section, 1, False)
        _section(out, "ddp", _ddp_section, 0, 1)
        _section(out, "recompute", _recompute_section)
    finally:
        teardown_megatron()
    return out


def _pair_worker(rank, world_size, ckpt_dir, tp1_weights):
    """Two processes: TP=2 (GPT + SP over the TP=1 weights, RNG, checkpoint, dist-ckpt), then DP=2 (DDP)."""
    out = {}
    init_megatron(tp=2, seed=SEED)
    try:
        _section(out, "gpt", _gpt_section, 2, True, tp1_weights)
        _section(out, "rng", _rng_section)
        _section(out, "dist_ckpt", _dist_ckpt_section, 2, ckpt_dir)
    finally:
        teardown_megatron()
    init_megatron(tp=1, seed=SEED)
    try:
        _section(out, "ddp", _ddp_section, rank, 2)
    finally:
        teardown_megatron()
    return out


@pytest.fixture(scope="module")
def single():
    return run_distributed(_single_worker, 1)[0]


@pytest.fixture(scope="module")
def pair(tmp_path_factory, single):
    return run_distributed(
        _pair_worker, 2, str(tmp_path_factory.mktemp("dist_ckpt")), _get(single, "gpt")["weights"]
    )


# --------------------------------------------------------------------------------------
# setup() itself
# --------------------------------------------------------------------------------------


def test_unknown_device_is_a_value_error():
    with pytest.raises(ValueError, match=r"device='tpu'.*npu, cuda, cpu"):
        platform.setup("tpu")
    with pytest.raises(ValueError, match="device"):
        platform.setup(0)


def test_npu_without_torch_npu_says_how_to_install(monkeypatch):
    monkeypatch.setitem(platform._state, "device", None)
    with pytest.raises(RuntimeError) as err:
        platform.setup("npu")
    assert "pip install" in str(err.value) and "CANN" in str(err.value)
    assert platform._state["device"] is None


def test_cuda_without_cuda_says_how_to_install(monkeypatch):
    monkeypatch.setitem(platform._state, "device", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="pip install"):
        platform.setup("cuda")


def test_device_type_before_setup_is_an_error(monkeypatch):
    monkeypatch.setitem(platform._state, "device", None)
    with pytest.raises(RuntimeError, match="setup"):
        platform.device_type()


def _setup_section():
    import sys

    import megatron.core.tensor_parallel.random as mrandom

    before = torch.Tensor.cuda
    assert platform.setup() == "cpu"  # detection: no torch_npu, no CUDA here
    first = platform.applied_adaptations()
    tensor_cuda = torch.Tensor.cuda
    rng_get = mrandom._get_cuda_rng_state
    assert platform.setup("cpu") == "cpu" and platform.setup() == "cpu"
    for adaptation in platform._ADAPTATIONS["cpu"]:  # applying again directly is a no-op too
        adaptation()
    with_switch = None
    try:
        platform.setup("cuda")
    except RuntimeError as e:
        with_switch = str(e)

    # megatron sees the view (modules imported before and after setup); torch does not
    assert "megatron.core.models.gpt.gpt_model" not in sys.modules
    from megatron.core.models.gpt import gpt_model  # first imported after setup()
    from megatron.core.transformer import utils as mutils  # imported before setup()

    from mcore_flash.platform.megatron_torch_view import ViewFinder

    x = torch.ones(3)
    out = dict(
        te_version_is_none=_te_version_is_none(),
        swiglu_factory_maps_fsdp2=_swiglu_factory_maps_fsdp2(),
        first=first,
        second=platform.applied_adaptations(),
        idempotent=(
            torch.Tensor.cuda is tensor_cuda
            and mrandom._get_cuda_rng_state is rng_get
            and before is not tensor_cuda
            and sum(isinstance(f, ViewFinder) for f in sys.meta_path) == 1
        ),
        switch_error=with_switch,
        device_type=platform.device_type(),
        torch_device=platform.torch_device(),
        megatron_torch_is_view=[
            m.torch is not torch and getattr(m.torch, "__mcore_flash_view__", False)
            for m in (mutils, gpt_model)
        ],
        real_current_device_raises=_raises(torch.cuda.current_device),
        our_type=x.type(),
        our_cuda_raises=_raises(x.cuda),
    )

    return out


def _mask_rope_section():
    """(f) get_default_causal_mask and RoPE (+ its context-parallel slicing)."""
    from megatron.core.transformer import utils as mutils

    out = {}
    out["mask"] = mutils.get_default_causal_mask(SEQ)
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    rope = RotaryEmbedding(kv_channels=16, rotary_percent=1.0, rotary_base=10000)
    emb = rope(SEQ)  # [s, 1, 1, d]
    out["rope_emb"] = emb
    t = torch.randn(SEQ, 2, HEADS, 16, generator=torch.Generator().manual_seed(0))
    out["rope_in"] = t
    out["rope_out"] = rope_utils.apply_rotary_pos_emb(t, emb, config=_config(tp=1))

    class _CpGroup:  # a stand-in process group: rank 1 of a 2-way CP group
        def size(self):
            return 2

        def rank(self):
            return 1

    out["rope_cp"] = rope_utils.get_pos_emb_on_this_cp_rank(emb, 0, _CpGroup())
    return out


def _raises(fn):
    try:
        fn()
    except Exception:
        return True
    return False


# megatron-core 0.16's get_te_version() is None without TE (its version check then raises:
# the adaptation applies); 0.19's is Version("0.0.0") (nothing to adapt)
TE_VERSION_CHECK_FAILS_WITHOUT_TE = {True: ["te_version_without_te"], False: []}


def _swiglu_factory_maps_fsdp2() -> bool:
    """megatron-core 0.19's SwiGLU checkpoint factory takes the data-parallel group and places
    FSDP2's pieces itself; 0.16-0.18's needs ``megatron_swiglu_fsdp2_checkpoint``."""
    import inspect

    from megatron.core.transformer import mlp

    return "dp_group" in inspect.signature(mlp.apply_swiglu_sharded_factory).parameters


def _te_version_is_none() -> bool:
    from megatron.core.utils import get_te_version

    return get_te_version() is None


def test_setup_is_idempotent_and_megatron_scoped(single):
    out = _get(single, "setup")
    assert out["first"] == [
        "megatron_jit_fuser_off",
        "megatron_torch_view",
        "megatron_tensor_methods",
        "megatron_cpu_rng",
        "checkpoint_without_output_no_te",
        "megatron_fsdp_device_mesh",
        "megatron_fsdp_premul_sum",
        "megatron_fsdp_no_te",
        "megatron_fsdp_cpu_view",
        *TE_VERSION_CHECK_FAILS_WITHOUT_TE[out["te_version_is_none"]],
        "megatron_optimizer_ckpt_dtensor",
        *([] if out["swiglu_factory_maps_fsdp2"] else ["megatron_swiglu_fsdp2_checkpoint"]),
    ]
    assert out["second"] == out["first"]
    assert out["idempotent"]
    assert out["switch_error"] and "cannot switch" in out["switch_error"]
    assert out["device_type"] == "cpu" and out["torch_device"] == torch.device("cpu")
    assert out["megatron_torch_is_view"] == [True, True]
    # outside megatron, torch is the real one
    assert out["real_current_device_raises"] and out["our_cuda_raises"]
    assert out["our_type"] == "torch.FloatTensor"


def _fsdp_section():
    """Megatron-FSDP's modules after setup("cpu") (``megatron.core.distributed`` imports them)."""
    import torch.distributed as dist
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.fsdp import mcore_fsdp_adapter
    from megatron.core.distributed.fsdp.src.megatron_fsdp import megatron_fsdp
    from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer as buffers
    from megatron.core.transformer import utils as mutils
    from torch.distributed.device_mesh import DeviceMesh

    group = dist.new_group([0])
    mesh = mcore_fsdp_adapter.DeviceMesh.from_group(group, device_type="cuda")
    grad = torch.full((4,), 3.0)
    averaging = DistributedDataParallelConfig(average_in_collective=True)
    fused = DistributedDataParallelConfig(gradient_reduce_div_fusion=True)
    ops = [buffers.gradient_reduce_preprocessing(grad, 0.5, cfg) for cfg in (averaging, fused)]
    stream = megatron_fsdp.torch.cuda.Stream()
    stream.record_event().wait()  # param_and_grad_buffer.py's pattern
    with megatron_fsdp.torch.cuda.stream(stream):
        pass
    return dict(
        mesh_device=mesh.device_type,
        torch_mesh_untouched=mcore_fsdp_adapter.DeviceMesh is not DeviceMesh
        and DeviceMesh.from_group.__module__ == "torch.distributed.device_mesh",
        ops=ops,
        scaled=grad.tolist(),
        fsdp_current_device=megatron_fsdp.torch.cuda.current_device(),
        megatron_current_device=mutils.torch.cuda.current_device(),
        buffer_module_view=buffers.torch is megatron_fsdp.torch,
    )


def test_megatron_fsdp_runs_on_the_cpu_with_megatron_scoped_adaptations(single):
    out = _get(single, "fsdp")
    assert out["mesh_device"] == "cpu"  # megatron asked for "cuda"
    assert out["torch_mesh_untouched"]
    # megatron would pick AVG and NCCL's PREMUL_SUM: scaled in place, then SUM
    assert out["ops"] == [torch.distributed.ReduceOp.SUM] * 2
    assert out["scaled"] == [0.75] * 4  # 3.0 x 0.5 x 0.5
    assert out["fsdp_current_device"] == 0 and out["buffer_module_view"]
    assert out["megatron_current_device"] == torch.device("cpu")  # the rest of megatron


def _cpu_rng_scope_section():
    from megatron.core import tensor_parallel

    torch.manual_seed(5)
    user_draw = torch.rand(3)
    torch.manual_seed(5)
    tensor_parallel.model_parallel_cuda_manual_seed(123)  # megatron's seeding: its own generator
    return torch.equal(user_draw, torch.rand(3))


def test_megatron_seeding_leaves_the_users_cpu_generator_alone(single):
    assert _get(single, "cpu_rng_scope")  # issue 10, defect 6


# --------------------------------------------------------------------------------------
# setup() on the emulated NPU (mcore_flash.emulation): the NPU branch of the adapter
# --------------------------------------------------------------------------------------


def _w_npu_setup(rank, world_size):
    import os

    from megatron.core import parallel_state
    from megatron.core.optimizer import clip_grads
    from megatron.core.tensor_parallel.random import CheckpointWithoutOutput

    from mcore_flash.runtime.distributed import set_random_seed

    os.environ["LOCAL_RANK"] = "3"  # as torchrun would set it for the 4th process of a node
    device = platform.setup()
    parallel_state.initialize_model_parallel()
    set_random_seed(1234)
    seeds = (torch.initial_seed(), torch.npu.initial_seed())
    param = torch.nn.Parameter(torch.ones(4, device=platform.torch_device()))
    param.grad = torch.full((4,), 2.0, device=param.device)
    clip_grads.clip_grad_by_total_norm_fp32(
        [param], max_norm=1.0, total_norm=4.0
    )  # asserts .type()
    return dict(
        te_version_is_none=_te_version_is_none(),
        swiglu_factory_maps_fsdp2=_swiglu_factory_maps_fsdp2(),
        device=device,
        applied=platform.applied_adaptations(),
        torch_device=str(platform.torch_device()),
        tensor_device=str(param.device),
        clipped=param.grad.cpu().tolist(),
        our_type=param.grad.type(),
        no_te_fp8=CheckpointWithoutOutput().fp8,
        capability=torch.cuda.get_device_capability(),
        seeds=seeds,
    )


def _draws(tracker_states):
    import random

    import numpy

    return (
        random.random(),
        float(numpy.random.rand()),
        torch.rand(3),
        {k: v.clone() for k, v in tracker_states().items()},
    )


def _w_seeding_per_pipeline_rank(rank, world_size):
    """Draws after set_random_seed(7) at PP 2, then after seeding by hand as Megatron-LM's
    _set_random_seed does (python, numpy, torch, megatron's tracker: seed + 100 x PP rank)."""
    import random

    import numpy
    from megatron.core import parallel_state, tensor_parallel

    init_megatron(pp=world_size, seed=7)
    try:
        tracker_states = tensor_parallel.get_cuda_rng_tracker().get_states
        ours = _draws(tracker_states)
        by_hand = 7 + 100 * parallel_state.get_pipeline_model_parallel_rank()
        random.seed(by_hand)
        numpy.random.seed(by_hand)
        torch.manual_seed(by_hand)
        tensor_parallel.model_parallel_cuda_manual_seed(by_hand)
        return ours, _draws(tracker_states)
    finally:
        teardown_megatron()


def test_seeding_is_megatron_lms_seed_plus_100_per_pipeline_rank():
    runs = run_distributed(_w_seeding_per_pipeline_rank, 2)
    for ours, by_hand in runs:
        assert ours[:2] == by_hand[:2]
        assert torch.equal(ours[2], by_hand[2])
        assert ours[3].keys() == by_hand[3].keys() and ours[3]
        assert all(torch.equal(ours[3][name], by_hand[3][name]) for name in ours[3])
    (first, _), (second, _) = runs
    assert first[:2] != second[:2] and not torch.equal(first[2], second[2])  # the stages differ


def test_npu_setup_binds_local_rank_and_adapts_megatron_only():
    out = run_distributed(_w_npu_setup, 1, emulate_npu=True, bind_device=False)[0]
    assert out["device"] == "npu"
    assert out["applied"] == [
        "megatron_jit_fuser_off",
        "npu_device_capability",
        "megatron_npu_tensor_type",
        "checkpoint_without_output_no_te",
        "megatron_fsdp_device_mesh",
        "megatron_fsdp_premul_sum",
        "megatron_fsdp_no_te",
        *TE_VERSION_CHECK_FAILS_WITHOUT_TE[out["te_version_is_none"]],
        "megatron_clip_host_grads",
        "megatron_optimizer_ckpt_dtensor",
        *([] if out["swiglu_factory_maps_fsdp2"] else ["megatron_swiglu_fsdp2_checkpoint"]),
    ]
    assert (
        out["torch_device"] == out["tensor_device"] == "npu:3"
    )  # set_device(LOCAL_RANK), defect 10
    assert out["clipped"] == pytest.approx(
        [2.0 / (4.0 + 1e-6)] * 4
    )  # megatron's 'torch.cuda.FloatTensor' assert passed
    assert (
        out["our_type"] == "torch.npu.FloatTensor"
    )  # everyone else: torch's own answer (defect 8)
    assert out["no_te_fp8"] is False  # CheckpointWithoutOutput without TE (defect 2)
    assert out["capability"] == (8, 0)  # torch's broadcast can index it
    # Megatron-LM's seeding: the CPU generator the weights come from and the device's
    # (defect 9: the device path never seeded the CPU one)
    assert out["seeds"] == (1234, 1234)


def test_causal_mask_and_rope(single):
    out = _get(single, "mask_rope")
    assert torch.equal(out["mask"], torch.ones(SEQ, SEQ).triu(1).bool())
    d = 16
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = torch.arange(SEQ, dtype=torch.float64)[:, None] * inv_freq[None]
    ang = torch.cat([ang, ang], -1)  # [s, d]
    torch.testing.assert_close(out["rope_emb"].squeeze(1).squeeze(1).double(), ang)
    x = out["rope_in"].double()
    rot = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    c, s = ang.cos()[:, None, None], ang.sin()[:, None, None]
    torch.testing.assert_close(out["rope_out"].double(), x * c + rot * s, atol=1e-5, rtol=1e-5)
    # CP rank 1 of 2 keeps chunks 1 and 2 of 4
    q = SEQ // 4
    expect = torch.cat([out["rope_emb"][q : 2 * q], out["rope_emb"][2 * q : 3 * q]])
    assert torch.equal(out["rope_cp"], expect)


# --------------------------------------------------------------------------------------
# (a) GPTModel forward/backward: TP=1 vs TP=2 + sequence parallel
# --------------------------------------------------------------------------------------


def _config(tp, sp=False, **kw):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    args = dict(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        ffn_hidden_size=FFN,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        gated_linear_unit=True,
        activation_func=F.silu,
        bias_activation_fusion=False,
        add_bias_linear=False,
        normalization="RMSNorm",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        sequence_parallel=sp,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
    )
    args.update(kw)
    return TransformerConfig(**args)


class _SPNorm(torch.nn.RMSNorm):
    """RMSNorm usable under sequence parallel (megatron's WrappedTorchNorm refuses SP)."""

    def __init__(self, config, hidden_size, eps=1e-5, **kwargs):
        super().__init__(hidden_size, eps=eps)
        for p in self.parameters():
            p.sequence_parallel = config.sequence_parallel


def _gpt(config):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec()
    if config.sequence_parallel:
        from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

        spec.submodules.input_layernorm = _SPNorm
        spec.submodules.pre_mlp_layernorm = _SPNorm
        spec = TransformerBlockSubmodules(layer_specs=[spec] * LAYERS, layer_norm=_SPNorm)
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        position_embedding_type="rope",
    )


def _batch(batch=2):
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (batch, SEQ + 1), generator=g)
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(batch, -1)
    return tokens[:, :-1].contiguous(), position_ids, tokens[:, 1:].contiguous()


def _gpt_section(tp, sp, weights=None):
    """GPT loss and embedding gradient; at TP>1 over ``weights`` from the TP=1 run, copied
    into a model initialised from another seed (the TP=1 run returns its weights)."""
    from megatron.core import parallel_state, tensor_parallel

    set_random_seed(SEED if weights is None else SEED + 1)
    model = _gpt(_config(tp=tp, sp=sp))
    if weights is not None:
        load_full_weights(model, weights)
    tokens, pos, labels = _batch()
    loss = model(tokens, pos, attention_mask=None, labels=labels).float().mean()
    loss.backward()
    grad = model.embedding.word_embeddings.weight.grad  # vocab-parallel: gather dim 0
    if tp > 1:
        grad = tensor_parallel.gather_from_tensor_model_parallel_region(grad.t()).t()
    return dict(
        loss=loss.item(),
        emb_grad=grad,
        sp_params=sum(getattr(p, "sequence_parallel", False) for p in model.parameters()),
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        weights=full_weights(model) if weights is None else None,
    )


def test_gpt_tp1_forward_backward(single):
    gpt_tp1 = _get(single, "gpt")
    # untrained model: cross entropy close to log(vocab); gradients flow to the embedding
    assert abs(gpt_tp1["loss"] - math.log(VOCAB)) < 0.5
    assert torch.isfinite(gpt_tp1["emb_grad"]).all() and gpt_tp1["emb_grad"].abs().sum() > 0


def test_gpt_tp2_sequence_parallel_matches_tp1(single, pair):
    gpt_tp1 = _get(single, "gpt")
    r0, r1 = (_get(r, "gpt") for r in pair)
    assert (r0["tp_rank"], r1["tp_rank"]) == (0, 1)
    assert r0["sp_params"] > 0
    for r in (r0, r1):
        assert r["loss"] == pytest.approx(gpt_tp1["loss"], rel=1e-5, abs=1e-5)
        torch.testing.assert_close(r["emb_grad"], gpt_tp1["emb_grad"], atol=1e-6, rtol=1e-4)


def _recompute_section():
    """GPT with hidden dropout: selective (core_attn, layernorm -> CheckpointWithoutOutput,
    mlp) and full recompute give the loss and gradients of no recompute."""

    runs = {}
    for name, kw in (
        ("none", {}),
        (
            "selective",
            dict(
                recompute_granularity="selective",
                recompute_modules=["core_attn", "layernorm", "mlp"],
            ),
        ),
        (
            "full",
            dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
        ),
    ):
        set_random_seed(SEED)
        model = _gpt(_config(tp=1, hidden_dropout=0.2, **kw))
        set_random_seed(SEED + 1)
        tokens, pos, labels = _batch()
        loss = model(tokens, pos, attention_mask=None, labels=labels).mean()
        loss.backward()
        runs[name] = (loss.item(), model.embedding.word_embeddings.weight.grad.clone())
    return runs


def test_recompute_matches_no_recompute(single):
    runs = _get(single, "recompute")
    loss, grad = runs["none"]
    for name in ("selective", "full"):
        assert runs[name][0] == pytest.approx(loss, rel=1e-6), name
        torch.testing.assert_close(runs[name][1], grad, atol=1e-7, rtol=1e-5)


# --------------------------------------------------------------------------------------
# (b) DDP + distributed optimizer on 2 DP ranks == 1 process
# --------------------------------------------------------------------------------------


def _ddp_section(rank, world_size):
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    set_random_seed(SEED)
    config = _config(tp=1)
    model = DistributedDataParallel(
        config,
        DistributedDataParallelConfig(
            use_distributed_optimizer=True, grad_reduce_in_fp32=True, bucket_size=4096
        ),
        _gpt(config),
    )
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=True, clip_grad=1.0),
        [model],
    )
    tokens, pos, labels = _batch(batch=2)
    per_rank = 2 // world_size
    sl = slice(rank * per_rank, (rank + 1) * per_rank)
    losses, norms = [], []
    for _ in range(DDP_STEPS):
        model.zero_grad_buffer()
        opt.zero_grad()
        loss = model(tokens[sl], pos[sl], attention_mask=None, labels=labels[sl]).mean()
        loss.backward()
        finalize_model_grads([model])
        ok, grad_norm, _ = opt.step()
        assert ok
        full = loss.detach().clone()
        torch.distributed.all_reduce(full)  # mean over ranks == mean over the batch
        losses.append(full.item() / world_size)
        norms.append(grad_norm)
    return dict(losses=losses, norms=norms)


def test_ddp_distributed_optimizer_two_ranks_match_one(single, pair):
    one = _get(single, "ddp")
    two = [_get(r, "ddp") for r in pair]
    assert one["losses"][-1] < one["losses"][0]  # it trains
    for r in two:
        assert r["losses"] == pytest.approx(one["losses"], rel=1e-5)
        assert r["norms"] == pytest.approx(one["norms"], rel=1e-4)


# --------------------------------------------------------------------------------------
# (c) tensor_parallel.checkpoint replays dropout; (d) RNG tracker fork per TP rank
# --------------------------------------------------------------------------------------


def _rng_section():
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel.random import (
        _get_all_rng_states,
        _set_all_rng_states,
        get_cuda_rng_tracker,
    )

    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    out = {}
    # (d) inside fork: per-TP-rank stream, reproducible per seed, state restored after
    tracker = get_cuda_rng_tracker()
    before = torch.get_rng_state()
    with tracker.fork():
        out["fork_a"] = torch.rand(64)
    out["default_after_fork"] = torch.rand(64)
    torch.set_rng_state(before)
    out["default_no_fork"] = torch.rand(64)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    with tracker.fork():
        out["fork_same_seed"] = torch.rand(64)
    tensor_parallel.model_parallel_cuda_manual_seed(4321)
    with tracker.fork():
        out["fork_other_seed"] = torch.rand(64)

    # (c) checkpoint of a block with dropout under fork == no checkpoint
    tensor_parallel.model_parallel_cuda_manual_seed(99)
    g = torch.Generator().manual_seed(3)
    w = torch.randn(HIDDEN, HIDDEN, generator=g, requires_grad=True)
    x0 = torch.randn(SEQ, 2, HIDDEN, generator=g)

    def block(x):
        h = torch.nn.functional.gelu(x @ w)
        with get_cuda_rng_tracker().fork():
            h = torch.nn.functional.dropout(h, p=0.5, training=True)
        h = torch.nn.functional.dropout(h, p=0.3, training=True)  # default stream too
        return h @ w

    states = _get_all_rng_states()
    grads = {}
    for mode in ("plain", "checkpoint", "distributed", "other_seed"):
        cpu_state, dev_state, tracker_states = states  # fork() mutates the dict: copy
        _set_all_rng_states(cpu_state, dev_state, {k: v.clone() for k, v in tracker_states.items()})
        if mode == "other_seed":
            tensor_parallel.model_parallel_cuda_manual_seed(100)
        x = x0.clone().requires_grad_(True)
        if mode in ("plain", "other_seed"):
            y = block(x)
        else:
            y = tensor_parallel.checkpoint(block, mode == "distributed", x)
        torch.randn(1000)  # disturb the generator between forward and backward
        (y * y).sum().backward()
        grads[mode] = (y.detach(), x.grad, w.grad.clone())
        w.grad = None
    out["ckpt"] = grads
    return out


def test_rng_tracker_fork_per_tp_rank_and_seed(pair):
    rng_runs = r0, r1 = [_get(r, "rng") for r in pair]
    assert not torch.equal(r0["fork_a"], r1["fork_a"])  # different per TP rank
    assert torch.equal(r0["default_no_fork"], r1["default_no_fork"])  # same default stream
    for r in rng_runs:
        assert torch.equal(r["fork_a"], r["fork_same_seed"])  # same per seed
        assert not torch.equal(r["fork_a"], r["fork_other_seed"])
        assert torch.equal(r["default_after_fork"], r["default_no_fork"])  # fork restores


def test_checkpoint_replays_dropout_exactly(pair):
    for r in (_get(r, "rng") for r in pair):
        plain = r["ckpt"]["plain"]
        # dropout really depends on the RNG state (so an unfaithful replay would show)
        assert not torch.equal(r["ckpt"]["other_seed"][1], plain[1])
        for mode in ("checkpoint", "distributed"):
            for a, b in zip(r["ckpt"][mode], plain):
                assert torch.equal(a, b), mode


# --------------------------------------------------------------------------------------
# (e) dist_checkpointing save -> load round trip (TP=2)
# --------------------------------------------------------------------------------------


def _dist_ckpt_section(tp, ckpt_dir):
    from megatron.core import dist_checkpointing

    set_random_seed(SEED)
    model = _gpt(_config(tp=tp))
    saved = {k: v.detach().clone() for k, v in model.state_dict().items() if v is not None}
    dist_checkpointing.save(model.sharded_state_dict(), ckpt_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    loaded = dist_checkpointing.load(model.sharded_state_dict(), ckpt_dir)
    model.load_state_dict(loaded, strict=False)
    after = model.state_dict()
    mismatched = [
        k for k, v in saved.items() if torch.is_tensor(v) and not torch.equal(v, after[k])
    ]
    return mismatched, len(saved)


def test_dist_checkpointing_round_trip(pair):
    for mismatched, n in (_get(r, "dist_ckpt") for r in pair):
        assert n > 0
        assert mismatched == []


FUSED = """
import sys
from mcore_flash import platform
platform.setup("cpu")
from megatron.core.fusions import fused_bias_swiglu
from megatron.core.transformer import transformer_block
print(hasattr(fused_bias_swiglu.swiglu, "_torchdynamo_orig_callable"), transformer_block.torch is sys.modules["torch"])
"""


def test_megatron_imported_after_setup_compiles_nothing_and_sees_the_view():
    """megatron's ``jit_fuser`` is ``torch.compile`` (seconds of dynamo set-up per process);
    after ``setup()`` its fused functions are plain ones (megatron's ``disable_jit_fuser``,
    run as ``megatron.core.jit`` is imported), and the torch view's hook on every megatron
    module still applies beside that hook on one of them (each asks the other for the
    module: the import must not recurse)."""
    run = subprocess.run([sys.executable, "-c", FUSED], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["False", "False"]

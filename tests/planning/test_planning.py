"""Memory planner: formulas vs measured saved bytes, parameter counts, Korthikanti, CLI.

Oracles: ``mcore_flash.measured_memory.measure_activation_bytes`` on tiny GPTModels built with our
spec (TP1 in one process, TP2 +/- SP in two; all configs of one TP size share a worker),
megatron-core's GPTModel built on the meta device (parameter counts), the formulas of
Korthikanti et al. 2022, Table 2, and FLOPs counted by hand (packed documents).
"""

from __future__ import annotations

import json
import math
from dataclasses import fields, replace
from fractions import Fraction

import pytest
import torch

from mcore_flash.planning import (
    MODELS,
    PROFILES,
    Layout,
    ModelShape,
    by_module,
    compare_standard,
    forward_flops,
    korthikanti_model,
    korthikanti_table2,
    layer_terms,
    non_layer_terms,
    plan_for_recipe,
    plan_memory,
    recompute_overhead,
    search_layouts,
    stage_parameters,
    step_flops,
    sum_terms,
    total_parameters,
)
from mcore_flash.planning.cli import main as plan_main
from mcore_flash.planning.flops import FUSED_ATTENTION_BACKWARD
from mcore_flash.planning.hardware import HARDWARE_PROFILES
from mcore_flash.planning.report import format_plan

from _support.dist_utils import init_megatron, run_distributed, teardown_megatron
from _support.gpt_models import VOCAB, build_gpt, tiny_config
from _support.launch_lines import TRAINER_SWITCHES
from _support.models import TINY_TEST

RECOMPUTE = ("none", "qkv", "attention", "full")
# the tests' tiny model (tests/_support/models.py, its vocabulary gpt_models' VOCAB) and a
# second, odd-sized shape (d = 16, 3 layers)
TINY = TINY_TEST
ODD = ModelShape("odd", 3, 96, 160, 6, 3, VOCAB, max_position_embeddings=128)


def _case(
    name,
    shape=TINY,
    recompute="none",
    b=2,
    s=256,
    dtype="fp32",
    sp=False,
    attention="fused",
    whole=0,
    **extra,
):
    """``whole`` > 0: partial recompute, that many layers recomputed whole, ``recompute`` for the rest."""
    return dict(
        name=name,
        shape=shape,
        recompute=recompute,
        b=b,
        s=s,
        dtype=dtype,
        sp=sp,
        attention=attention,
        whole=whole,
        extra=extra,
    )


TP1_CASES = [
    _case("none"),
    _case("qkv", recompute="qkv"),
    _case("attention", recompute="attention"),
    _case("full", recompute="full"),
    _case("partial-qkv", shape=ODD, recompute="qkv", whole=2, b=3, s=128),
    _case("bf16-none", dtype="bf16", b=1, s=512),
    _case("bf16-attention", dtype="bf16", recompute="attention", b=1, s=512),
    _case("odd-none", shape=ODD, b=3, s=128),
    _case("odd-attention", shape=ODD, recompute="attention", b=3, s=128),
    _case("dropout-none", hidden_dropout=0.1),
    _case("fused-swiglu", use_te_activation_func=True),
    _case("fused-swiglu-attention", recompute="attention", use_te_activation_func=True),
    _case("standard-fp32", attention="standard"),
    _case("standard-bf16-dropout", attention="standard", dtype="bf16", attention_dropout=0.1),
]
TP2_CASES = [
    _case(f"{mode}-sp{int(sp)}", recompute=mode, sp=sp)
    for sp in (False, True)
    for mode in RECOMPUTE
]


def _build(case, tp):
    from mcore_flash.transformer import get_gpt_decoder_block_flash_spec
    from mcore_flash.transformer.recompute import recompute_mode_settings, recompute_settings

    shape = case["shape"]
    dtype = dict(bf16=True, params_dtype=torch.bfloat16) if case["dtype"] == "bf16" else {}
    recompute = recompute_mode_settings(case["recompute"])
    if case["whole"]:
        modules = recompute.layer_modules or recompute.config.get("recompute_modules", [])
        recompute = recompute_settings("full", "block", case["whole"], modules)
    config = tiny_config(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_query_groups,
        ffn_hidden_size=shape.ffn_hidden_size,
        tensor_model_parallel_size=tp,
        sequence_parallel=case["sp"],
        **recompute.config,
        **dtype,
        **case["extra"],
    )
    spec = get_gpt_decoder_block_flash_spec(config, layer_recompute_modules=recompute.layer_modules)
    if case["attention"] == "standard":
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        for layer_spec in spec.layer_specs:
            layer_spec.submodules.self_attention.submodules.core_attention = DotProductAttention
    return build_gpt(config, spec)


def _w_measure(rank, world_size, cases, meta_models):
    """Per case: (per_layer, by_module, total) of one forward; parameter counts."""
    init_megatron(tp=world_size)
    try:
        from mcore_flash.measured_memory import measure_activation_bytes

        from _support.models import meta_parameter_count

        out = {"cases": {}, "params": {}}
        for case in cases:
            model = _build(case, world_size).train()
            generator = torch.Generator().manual_seed(3)
            tokens = torch.randint(0, VOCAB, (case["b"], case["s"]), generator=generator)
            positions = torch.arange(case["s"]).expand(case["b"], case["s"])
            saved = measure_activation_bytes(model, tokens, positions, None, labels=tokens)
            out["cases"][case["name"]] = (saved.per_layer(), saved.by_module, saved.total)
            out["params"].setdefault(case["shape"].name, sum(p.numel() for p in model.parameters()))
            if (
                case["recompute"] == "none"
                and case["dtype"] == "fp32"
                and case["attention"] == "fused"
            ):
                out.setdefault("flops", {})[case["name"]] = _count_gemm_flops(
                    model, tokens, positions
                )
        out["meta"] = {
            getattr(model, "name", model): meta_parameter_count(model, tp=world_size)
            for model in meta_models
        }
        if world_size == 1:
            out["trainer_tiny"] = _trainer_parameter_count("tiny")
        return out
    finally:
        teardown_megatron()


def _trainer_parameter_count(preset):
    """Parameters of the GPTModel ``mcore-flash pretrain --model <preset>`` builds: the
    trainer's own flag parsing, tokenizer (padded vocabulary) and model builder, on meta."""
    from mcore_flash.runtime.arguments import parse_args
    from mcore_flash.runtime.model import build_model, transformer_config
    from mcore_flash.runtime.tokenizer import tokenizer_and_vocab

    args = parse_args(["--model", preset, "--save", "/tmp/unused"])
    _, vocab = tokenizer_and_vocab(args)
    with torch.device("meta"):
        model = build_model(args, transformer_config(args), vocab)
    return sum(p.numel() for p in model.parameters())


def _count_gemm_flops(model, tokens, positions):
    """torch's FlopCounterMode over one fwd+bwd: the FLOPs of each leaf linear (by module name,
    forward and backward) and of the whole step, attention-kernel ops left out."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        model(tokens, positions, None, labels=tokens).mean().backward()
    per_module, step = {}, 0
    for module, ops in counter.get_flop_counts().items():
        gemms = sum(n for op, n in ops.items() if "scaled_dot_product" not in str(op))
        if module == "Global":
            step = gemms
        elif module.endswith(
            ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "output_layer")
        ):
            per_module[module] = gemms
    model.zero_grad()
    return per_module, step


def _predict(case, tp, cp=1, device="cpu"):
    profile = PROFILES[device].with_(
        attention=case["attention"],
        swiglu_fused=case["extra"].get("use_te_activation_func", False),
        hidden_dropout=case["extra"].get("hidden_dropout", 0.0),
        attention_dropout=case["extra"].get("attention_dropout", 0.0),
    )
    kwargs = dict(
        tp=tp,
        cp=cp,
        sequence_parallel=case["sp"],
        recompute=case["recompute"],
        profile=profile,
        dtype_bytes=2 if case["dtype"] == "bf16" else 4,
    )
    layer = layer_terms(case["shape"], case["s"], case["b"], **kwargs)
    outside = non_layer_terms(case["shape"], case["s"], case["b"], **kwargs)
    return layer, outside


def _exact(predicted, measured, what):
    """The planner's bytes equal the measured saved bytes exactly."""
    assert float(predicted) == measured, (
        f"{what}: predicted {float(predicted)}, measured {measured}"
    )


def _check_case(case, measured, tp, table):
    per_layer, modules, total = measured
    if case["whole"]:
        return _check_partial(case, total, tp, table)
    layer, outside = _predict(case, tp)
    layers = case["shape"].num_layers
    predicted_total = layers * sum_terms(layer) + sum_terms(outside)
    _exact(predicted_total, total, f"{case['name']} tp{tp}: whole model")
    table.append((f"tp{tp} {case['name']} (whole model)", float(predicted_total), total))
    if case["recompute"] == "full":
        # each layer's input is kept by the block's checkpoints ("decoder"), with the
        # RoPE frequencies they share
        decoder = layers * sum_terms(layer) + sum(t.bytes for t in outside if t.module == "decoder")
        _exact(decoder, modules["decoder"], f"{case['name']} tp{tp}: decoder")
        assert per_layer == {}
        rope = float(decoder - layers * sum_terms(layer))
        table.append(
            (
                f"tp{tp} {case['name']}",
                float(sum_terms(layer)),
                (modules["decoder"] - rope) / layers,
            )
        )
        return
    predicted = by_module(layer)
    for module in set(predicted) | set(per_layer):
        _exact(
            predicted.get(module, 0), per_layer.get(module, 0), f"{case['name']} tp{tp}: {module}"
        )
    _exact(sum_terms(layer), sum(per_layer.values()), f"{case['name']} tp{tp}: layer total")
    table.append((f"tp{tp} {case['name']}", float(sum_terms(layer)), sum(per_layer.values())))


def _check_partial(case, total, tp, table):
    """Partial recompute: the block's layers keep their input (charged to ``decoder``), the
    others their mode's terms; the plan's mean per layer is the same sum."""
    layers, whole = case["shape"].num_layers, case["whole"]
    selective, _ = _predict(case, tp)
    full, outside = _predict(dict(case, recompute="full"), tp)
    predicted = (
        whole * sum_terms(full) + (layers - whole) * sum_terms(selective) + sum_terms(outside)
    )
    _exact(predicted, total, f"{case['name']} tp{tp}: whole model")
    table.append((f"tp{tp} {case['name']} (whole model)", float(predicted), total))
    plan = plan_memory(
        case["shape"],
        case["s"],
        Layout(
            tp=tp,
            recompute=case["recompute"],
            recompute_num_layers=whole,
            micro_batch_size=case["b"],
        ),
        activation_profile=PROFILES["cpu"].with_(swiglu_fused=False),
        dtype_bytes=4,
    )
    mean = (
        whole * sum_terms(full) + (layers - whole) * sum_terms(selective, "activations")
    ) / layers
    assert plan.per_device["activations"] == math.ceil(
        layers * mean + sum_terms(o for o in outside if o.module == "decoder")
    )


CP2_CASES = [_case(f"cp2-{mode}", recompute=mode) for mode in RECOMPUTE] + [
    _case("cp2-fused-swiglu", use_te_activation_func=True)
]


def _w_measure_cp(rank, world_size, cases):
    """Per case at CP=2: this rank's (per_layer, by_module, total) on its half of the tokens."""
    init_megatron(cp=world_size)
    try:
        from mcore_flash.measured_memory import measure_activation_bytes
        from mcore_flash.transformer.context_parallel import get_batch_on_this_cp_rank

        out = {}
        for case in cases:
            case = dict(case, extra=dict(case["extra"], context_parallel_size=world_size))
            model = _build(case, 1).train()
            generator = torch.Generator().manual_seed(3)
            tokens = torch.randint(0, VOCAB, (case["b"], case["s"]), generator=generator)
            batch = get_batch_on_this_cp_rank(
                {"tokens": tokens, "position_ids": torch.arange(case["s"]).expand_as(tokens)}
            )
            saved = measure_activation_bytes(
                model, batch["tokens"], batch["position_ids"], None, labels=batch["tokens"]
            )
            out[case["name"]] = (saved.per_layer(), saved.by_module, saved.total)
        return out
    finally:
        teardown_megatron()


def test_predicted_activation_bytes_match_measured_under_context_parallel():
    """CP=2: each rank keeps the terms of s/2 tokens (ring attention keeps local q, k, v, out, lse)."""
    for rank_result in run_distributed(_w_measure_cp, 2, CP2_CASES, timeout=300):
        for case in CP2_CASES:
            per_layer, modules, _ = rank_result[case["name"]]
            layer, _ = _predict(case, 1, cp=2)
            if case["recompute"] == "full":
                assert per_layer == {} and modules["decoder"] >= case[
                    "shape"
                ].num_layers * sum_terms(layer)
                continue
            predicted = by_module(layer)
            for module in set(predicted) | set(per_layer):
                _exact(
                    predicted.get(module, 0), per_layer.get(module, 0), f"{case['name']}: {module}"
                )


NPU_CASES = [
    _case("npu-none", use_te_activation_func=True),
    _case("npu-attention", recompute="attention", use_te_activation_func=True),
    _case("npu-qkv", recompute="qkv", use_te_activation_func=True),
    _case("npu-bf16-none", dtype="bf16", b=1, s=512, use_te_activation_func=True),
]


def _w_measure_npu(rank, world_size, cases):
    """On the emulated NPU: npu_fusion_attention keeps softmax_max/softmax_sum, the norms
    and SwiGLU are torch_npu's (doubles): per case (per_layer, by_module, total)."""
    from megatron.core import parallel_state

    from mcore_flash import platform
    from mcore_flash.measured_memory import measure_activation_bytes
    from mcore_flash.runtime.distributed import set_random_seed

    assert platform.setup() == "npu"
    parallel_state.initialize_model_parallel()
    set_random_seed(1234)
    out = {}
    for case in cases:
        model = _build(case, 1).to(platform.torch_device()).train()
        generator = torch.Generator().manual_seed(3)
        tokens = torch.randint(0, VOCAB, (case["b"], case["s"]), generator=generator).npu()
        positions = torch.arange(case["s"]).expand(case["b"], case["s"]).npu()
        saved = measure_activation_bytes(model, tokens, positions, None, labels=tokens)
        out[case["name"]] = (saved.per_layer(), saved.by_module, saved.total)
    return out


def test_predicted_activation_bytes_match_measured_on_the_emulated_npu():
    """The planner's npu profile (64 bytes of statistics per row, not 4) against the bytes the
    NPU path really keeps, measured on npu tensors."""
    measured = run_distributed(_w_measure_npu, 1, NPU_CASES, emulate_npu=True, timeout=300)[0]
    npu, cpu = (by_module(_predict(NPU_CASES[0], 1, device=d)[0]) for d in ("npu", "cpu"))
    assert (
        npu["self_attention.core_attention"] - cpu["self_attention.core_attention"]
        == 2 * 4 * 256 * 60
    )
    for case in NPU_CASES:
        per_layer, _, _ = measured[case["name"]]
        predicted = by_module(_predict(case, 1, device="npu")[0])
        for module in set(predicted) | set(per_layer):
            _exact(predicted.get(module, 0), per_layer.get(module, 0), f"{case['name']}: {module}")


@pytest.fixture(scope="module")
def measured():
    tp1 = run_distributed(
        _w_measure, 1, TP1_CASES, ("llama2-70b", "llama3-70b", TINY), timeout=300
    )[0]
    tp2 = run_distributed(_w_measure, 2, TP2_CASES, ("llama2-70b",), timeout=300)
    return tp1, tp2


def test_predicted_activation_bytes_match_measured(measured):
    tp1, tp2 = measured
    table = []
    for case in TP1_CASES:
        _check_case(case, tp1["cases"][case["name"]], 1, table)
    for rank, rank_result in enumerate(tp2):
        for case in TP2_CASES:
            _check_case(case, rank_result["cases"][case["name"]], 2, table if rank == 0 else [])
    print("\nconfig                         predicted/layer  measured/layer")
    for name, predicted, got in table:
        print(f"{name:<30} {predicted:>15.0f} {got:>15.0f}")


def test_attention_recompute_keeps_only_the_layer_input(measured):
    """Guards the premise of the 'attention' terms: our spec's selective core_attn."""
    per_layer = measured[0]["cases"]["attention"][0]
    assert not any(k.startswith(("self_attention", "input_layernorm")) for k in per_layer), (
        per_layer
    )
    assert per_layer["<layer>"] == 256 * 2 * 64 * 4


def test_flop_model_matches_torch_flop_counter(measured):
    """Projection, MLP and logit FLOPs (forward x 3 for fwd+bwd) = torch's count of the real
    model's matmuls; the attention-kernel terms = torch's own SDPA counts, causal half."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    counted = measured[0]["flops"]
    assert {"none", "odd-none"} <= set(counted)
    for case in TP1_CASES:
        if case["name"] not in counted:
            continue
        shape, s, b = case["shape"], case["s"], case["b"]
        per_module, step = counted[case["name"]]
        predicted = forward_flops(shape, s, b)

        def group(*names, per_module=per_module):
            return sum(n for m, n in per_module.items() if m.endswith(names))

        assert (
            group("linear_qkv", "linear_proj")
            == 3 * shape.num_layers * predicted["attention_projections"]
        )
        assert group("linear_fc1", "linear_fc2") == 3 * shape.num_layers * predicted["mlp"]
        assert group("output_layer") == 3 * predicted["logits"]
        kernel_step = (
            (1 + FUSED_ATTENTION_BACKWARD) * shape.num_layers * predicted["attention_kernel"]
        )
        assert step == b * step_flops(shape, s) - kernel_step

        a, g, d = shape.num_attention_heads, shape.num_query_groups, shape.head_dim
        q, kv = (b, a, s, d), (b, g, s, d)
        assert sdpa_flop_count(q, kv, kv) == 2 * predicted["attention_kernel"]  # no causal skip
        assert sdpa_backward_flop_count(q, q, kv, kv) == FUSED_ATTENTION_BACKWARD * sdpa_flop_count(
            q, kv, kv
        )


def test_recompute_overhead_by_mode():
    """Each mode adds one forward of what it recomputes; at long s the kernel dominates."""
    fl = forward_flops("llama2-70b", 131072)
    step = step_flops("llama2-70b", 131072)
    full = recompute_overhead("llama2-70b", 131072, "full")
    assert full == pytest.approx(
        80 * (fl["attention_projections"] + fl["attention_kernel"] + fl["mlp"]) / step
    )
    assert (
        0
        < recompute_overhead("llama2-70b", 131072, "core_attention")
        < recompute_overhead("llama2-70b", 131072, "attention")
        < full
        < 1 / 3
    )
    assert recompute_overhead("llama2-70b", 131072, "full", fused_attention=False) == pytest.approx(
        1 / 3, rel=0.02
    )
    assert recompute_overhead("llama2-70b", 4096, "attention") < recompute_overhead(
        "llama2-70b", 131072, "attention"
    )
    with pytest.raises(ValueError, match="recompute 'selective'"):
        recompute_overhead("llama2-70b", 4096, "selective")


def test_parameter_counts_match_megatron(measured):
    tp1, tp2 = measured
    assert tp1["meta"]["llama2-70b"] == total_parameters("llama2-70b") == 68_976_648_192
    assert tp1["meta"]["llama3-70b"] == total_parameters("llama3-70b")
    assert tp1["meta"][TINY.name] == tp1["params"][TINY.name] == total_parameters(TINY)
    assert tp1["trainer_tiny"] == total_parameters(
        "tiny"
    )  # the model `pretrain --model tiny` trains
    assert tp1["params"]["odd"] == total_parameters(ODD)
    for rank_result in tp2:  # per TP rank: split weights, replicated norms
        assert rank_result["params"][TINY.name] == sum(stage_parameters(TINY, tp=2).values())
        assert rank_result["meta"]["llama2-70b"] == sum(
            stage_parameters("llama2-70b", tp=2).values()
        )


def test_planner_tiny_is_the_model_pretrain_trains():
    """``plan --model tiny`` plans what ``pretrain --model tiny`` trains: every field of
    ``MODELS["tiny"]`` equals the trainer's TransformerConfig and GPTModel settings after its
    own flag parsing, the vocabulary its built-in tokenizer padded (byte-level, 258 -> 384)."""
    import inspect

    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel

    from mcore_flash.runtime.arguments import parse_args
    from mcore_flash.runtime.model import transformer_config
    from mcore_flash.runtime.tokenizer import tokenizer_and_vocab

    args = parse_args(["--model", "tiny", "--save", "/tmp/unused"])
    config = transformer_config(args)
    _, vocab = tokenizer_and_vocab(args)
    gpt_defaults = {
        name: p.default for name, p in inspect.signature(GPTModel.__init__).parameters.items()
    }
    trained = {
        "num_layers": config.num_layers,
        "hidden_size": config.hidden_size,
        "ffn_hidden_size": config.ffn_hidden_size,
        "num_attention_heads": config.num_attention_heads,
        "num_query_groups": config.num_query_groups,
        "vocab_size": vocab,
        "head_dim": config.kv_channels,
        "normalization": config.normalization,
        "activation": "swiglu"
        if config.gated_linear_unit and config.activation_func is F.silu
        else "gelu",
        "add_bias_linear": config.add_bias_linear,
        "qk_layernorm": config.qk_layernorm,
        "add_qkv_bias": config.add_qkv_bias,
        "norm_epsilon": config.layernorm_epsilon,
        "untie_embeddings_and_output_weights": args.untie_embeddings_and_output_weights,
        "position_embedding_type": args.position_embedding_type,
        "max_position_embeddings": max(
            args.max_position_embeddings, args.seq_length
        ),  # build_model's rule
        "rotary_percent": gpt_defaults["rotary_percent"],  # build_model leaves GPTModel's default
        "rotary_base": args.rotary_base,
        "rope_scaling": bool(args.use_rope_scaling),
    }
    shape = MODELS["tiny"]
    assert {name: getattr(shape, name) for name in trained} == trained
    assert (vocab, config.hidden_size, config.ffn_hidden_size) == (384, 128, 352)
    # every field is compared (kv_channels as head_dim); the factor means nothing without scaling
    assert {f.name for f in fields(ModelShape)} - set(trained) == {
        "name",
        "kv_channels",
        "rope_scaling_factor",
    }


def test_public_functions_resolve_names_and_sizes_once():
    """``mcore_flash.planning``'s functions take preset names and sizes such as "1GiB" (also
    among the keywords search_layouts passes on); the stack below takes the typed values."""
    from mcore_flash.planning import memory

    layout = Layout(tp=8, pp=2, cp=16, global_batch_size=32)
    named = plan_memory("llama2-70b", 131072, layout, device_memory="64GB", runtime_reserve="1GiB")
    typed = memory.plan_memory(
        MODELS["llama2-70b"], 131072, layout, device_memory=64 * 2**30, runtime_reserve=2**30
    )
    assert named.per_device["runtime_reserve"] == 2**30 and named.device_memory == 64 * 2**30
    assert named.to_dict() == typed.to_dict()
    options = dict(
        tp_choices=[8],
        pp_choices=[2],
        cp_choices=[16],
        recompute_choices=["none"],
        global_batch_size=32,
    )
    (found,) = search_layouts(
        "llama2-70b", 131072, 256, "64GB", hardware="h100-80g", runtime_reserve="1GiB", **options
    )
    assert (
        found.step.hardware.name == "h100-80g" and found.plan.per_device["runtime_reserve"] == 2**30
    )


def test_llama2_70b_parameter_count():
    assert total_parameters("llama2-70b") == 68_976_648_192
    assert total_parameters("llama3-70b") == 70_553_706_496
    parts = stage_parameters("llama2-70b", tp=8, pp=2, stage=0)
    assert (
        parts["layers"] == 40 * (855_654_400 - 16384) // 8 + 40 * 16384
        and parts["embedding"] == 32000 * 8192 // 8
    )


@pytest.mark.parametrize(
    "s,b,h,a,t", [(2048, 1, 12288, 96, 8), (4096, 2, 8192, 64, 4), (512, 3, 1024, 16, 1)]
)
def test_korthikanti_table2_reproduced_term_by_term(s, b, h, a, t):
    model, profile = korthikanti_model(h, a), PROFILES["korthikanti"]

    def ours(tp, sp, recompute):
        return sum_terms(
            layer_terms(
                model, s, b, tp=tp, sequence_parallel=sp, recompute=recompute, profile=profile
            )
        )

    assert ours(1, False, "none") == korthikanti_table2(s, b, h, a, 1, "none")
    assert ours(t, False, "none") == korthikanti_table2(s, b, h, a, t, "tp")
    assert ours(t, True, "none") == korthikanti_table2(s, b, h, a, t, "tp_sp")
    assert ours(t, False, "core_attention") == korthikanti_table2(s, b, h, a, t, "tp_selective")
    assert ours(t, True, "core_attention") == korthikanti_table2(s, b, h, a, t, "tp_sp_selective")
    assert ours(t, False, "full") == korthikanti_table2(s, b, h, a, t, "full") == 2 * s * b * h
    sbh = Fraction(s * b * h)
    assert korthikanti_table2(s, b, h, a, 1, "none") == sbh * (34 + Fraction(5 * a * s, h))


def test_qkv_recompute_on_the_70b_128k_recipe_layout():
    """Issue 14's target: the qkv boundary costs <= 3% more compute and keeps <= 85% of a
    layer's activations at TP8 PP2 CP16, 128K tokens (npu profile: 64-byte statistics)."""
    plans = {
        mode: plan_memory(
            "llama2-70b", 131072, Layout(tp=8, pp=2, cp=16, recompute=mode), device_memory="64GB"
        )
        for mode in ("none", "qkv", "attention")
    }
    assert plans["qkv"].recompute_overhead <= 0.03 < plans["attention"].recompute_overhead
    assert plans["qkv"].layer_bytes <= 0.85 * plans["none"].layer_bytes
    assert (
        plans["attention"].layer_bytes < plans["qkv"].layer_bytes
    )  # attention-only cuts more, costs more
    # the FLOPs of the QKV projection alone, written out: 2 * s * h * (a + 2g) * d per layer
    s, h, a, g, d, layers = 131072, 8192, 64, 8, 128, 80
    qkv = layers * 2 * s * h * (a + 2 * g) * d
    assert plans["qkv"].recompute_overhead == pytest.approx(
        qkv / step_flops("llama2-70b", s), rel=1e-12
    )


def test_context_parallel_divides_the_local_sequence():
    """Per CP rank, a layer keeps what a layer of an s/cp-token sequence keeps (no cp-only terms)."""
    for recompute in ("none", "attention", "full"):
        kwargs = dict(tp=8, sequence_parallel=True, recompute=recompute, profile="npu")
        assert layer_terms("llama2-70b", 131072, 1, cp=16, **kwargs) == layer_terms(
            "llama2-70b", 8192, 1, cp=1, **kwargs
        )


def test_fused_layer_has_no_quadratic_term():
    def layer(seq):
        return sum_terms(layer_terms("llama2-70b", seq, 1, tp=8, cp=1, profile="npu"))

    assert layer(131072) == 32 * layer(4096)  # linear in s
    rows = {
        r["seq_length"]: r for r in compare_standard("llama2-7b", [4096, 131072], profile="cuda")
    }
    assert rows[4096]["scores_bytes"] == 2**30  # B*H*S^2*2 bytes at 32 heads, 4K: 1 GiB, not 4 GB
    assert rows[131072]["ratio"] > 100


def test_optimizer_and_weight_bytes_per_parameter():
    base = dict(tp=8, pp=2, cp=16, dp=2, global_batch_size=32)
    dist = plan_memory("llama2-70b", 131072, Layout(**base))
    plain = plan_memory("llama2-70b", 131072, Layout(**base, distributed_optimizer=False))
    params = dist.worst_stage.parameters
    d = 2 * 16  # the distributed optimizer shards over dp x cp
    assert dist.per_device["weights"] + dist.per_device["gradients"] == 6 * params
    assert dist.per_device["optimizer_state"] == -(-12 * params // d)
    assert (
        plain.per_device["weights"]
        + plain.per_device["gradients"]
        + plain.per_device["optimizer_state"]
        == 18 * params
    )


def test_in_flight_microbatches_1f1b_and_interleaved():
    assert [Layout(pp=4).in_flight(i) for i in range(4)] == [4, 3, 2, 1]
    assert Layout(pp=4, global_batch_size=2).in_flight(0) == 2
    # interleaved: L/(pp v) layers x (2(pp-1) + (v-1)pp + 1) chunks = L (1 + (pp-1)/(pp v))
    lay = Layout(pp=4, vp=2)
    assert Fraction(80, 8) * lay.in_flight(0) == 80 * (1 + Fraction(3, 8))


def test_recipe_70b_128k_fits_64gb():
    plan = plan_for_recipe()
    assert plan.layout.tp == 8 and plan.layout.sp and plan.layout.distributed_optimizer
    assert plan.fits and plan.headroom > 4 * 2**30, format_plan(plan)
    # exact parts, by hand: 40 layers x 2 micro-batches in flight x (input norm input 16 MiB +
    # QKV input 16 + RoPE cos/sin 8 + q 16 + k 2 + v 2 + out 16 + pre-MLP norm input 16 + fc1
    # input 16 + fused-SwiGLU input 112 + fc2 input 56 MiB + 2 x 4 KiB rstd) and 4 MiB of NPU
    # softmax statistics; s/cp = 8192 tokens, /tp = 1024 under SP, 1 KV head per TP rank, bf16
    assert plan.per_device["activations"] == 80 * (276 * 2**20 + 8192)
    assert plan.per_device["attention_statistics"] == 80 * 4 * 2**20
    assert not plan_for_recipe(pp=1).fits


def test_recipe_70b_128k_is_the_searchs_best_layout():
    """The recipe (and scripts/pretrain_70b.sh, which asks the search at launch) is the layout
    the step-time ranking puts first for 256 910Bs (what torch_npu can allocate of each)."""
    capacity = HARDWARE_PROFILES["ascend-910b-64g"].capacity
    best = search_layouts("llama2-70b", 131072, 256, capacity, global_batch_size=32)[0].plan.layout
    assert best == plan_for_recipe().layout


def test_the_recipe_figures_the_readme_and_docs_quote():
    """README's recipe row, docs/pretrain.md, docs/planner.md and docs/step-time.md quote the
    planner's output for the recipe layout on a 910B's 60.97 GiB: 54.9 GiB (6.0 free), and with
    qkv 51.4 GiB, 84.3% of a layer's bytes, +1.3% (55.1, 5.9 and 51.5 before the MLP
    backward's gradients were exact: 0.25 GiB of workspace, not 0.36)."""
    none = plan_for_recipe()
    qkv = plan_memory(
        "llama2-70b",
        131072,
        replace(none.layout, recompute="qkv"),
        device_memory=none.device_memory,
    )
    gib = 2**30
    assert (
        round(none.total / gib, 1),
        round(none.headroom / gib, 1),
        round(qkv.total / gib, 1),
    ) == (54.9, 6.0, 51.4)
    assert (
        round(qkv.layer_bytes / none.layer_bytes, 3) == 0.843
        and round(qkv.recompute_overhead, 3) == 0.013
    )


def test_search_recomputes_just_enough_layers_when_a_selective_mode_does_not_fit():
    """Oracle: every recompute_num_layers tried one by one with plan_memory. With a capacity
    between the needs of k - 1 and k layers recomputed whole, the search offers qkv with
    exactly k (the least that fits), and without partial recompute it offers no qkv at all."""
    layout = Layout(tp=8, pp=2, cp=16, dp=1, recompute="qkv", global_batch_size=32)
    need = [
        plan_memory("llama2-70b", 131072, replace(layout, recompute_num_layers=k)).total
        for k in range(40)
    ]
    k = 3
    assert need[0] > need[k - 1] > need[k]  # each layer recomputed whole frees memory
    capacity = (need[k - 1] + need[k]) // 2
    search = dict(
        min_free_memory=0,  # fits: total <= capacity
        tp_choices=[8],
        pp_choices=[2],
        cp_choices=[16],
        recompute_choices=["qkv"],
        global_batch_size=32,
    )
    (found,) = search_layouts("llama2-70b", 131072, 256, capacity, **search)
    assert found.plan.fits and found.plan.layout == replace(layout, recompute_num_layers=k)
    assert found.plan.total == need[k]
    assert (
        search_layouts("llama2-70b", 131072, 256, capacity, partial_recompute=False, **search) == []
    )


def test_cli_plan_json(capsys):
    rc = plan_main(
        "--model llama2-70b --seq-length 131072 --tp 8 --pp 2 --cp 16 --num-devices 256 "
        "--recompute attention --micro-batch-size 1 --device-memory 64GB --json".split()
        + TRAINER_SWITCHES
    )
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["fits"] is True
    assert out["total_parameters"] == 68_976_648_192
    assert set(out["per_device_bytes"]) >= {
        "weights",
        "gradients",
        "optimizer_state",
        "activations",
        "attention_statistics",
    }
    assert out["total_bytes_per_device"] == sum(out["per_device_bytes"].values())
    assert (
        "--recompute-granularity selective --recompute-modules core_attn" in out["launch_command"]
    )


def test_cli_plan_verdict_does_not_fit(capsys):
    rc = plan_main("--tp 8 --pp 1 --cp 1 --seq-length 128K --device-memory 64GB".split())
    assert rc == 1 and "DOES NOT FIT" in capsys.readouterr().out


def test_cli_search_lists_fitting_layouts_with_commands(capsys):
    rc = plan_main("--search --num-devices 256 --device-memory 64GB --top 3".split())
    out = capsys.readouterr().out
    assert rc == 0 and out.count("-m mcore_flash.pretrain") == 3
    assert "--tensor-model-parallel-size 8" in out and "--context-parallel-size" in out


def test_cli_compare_standard(capsys):
    assert plan_main("--compare-standard --model llama2-7b --seq-lengths 1K,4K,128K".split()) == 0
    out = capsys.readouterr().out
    assert "4K" in out and "1.00 GiB" in out and "128K" in out


# ---- packed documents: --mean-document-length ----------------------------------------------


def _hand_attention_kernel_flops(shape, b, document_lengths):
    """Forward FLOPs of causal attention run per document, by hand: per head and document
    of L tokens, QK^T and PV are L*L*d multiply-adds each (2 FLOPs per multiply-add), and
    the causal mask leaves half of them."""
    d = shape.head_dim
    per_head = sum((2 * L * L * d + 2 * L * L * d) / 2 for L in document_lengths)
    return b * shape.num_attention_heads * per_head


def _hand_linear_flops(shape, s):
    """Forward FLOPs of TINY's matmuls for one s-token sequence, from the weight shapes:
    2 * tokens * in * out per linear layer."""
    h, a, g, d, f, V = 64, 4, 2, 16, 128, VOCAB
    assert (
        shape.hidden_size,
        shape.num_attention_heads,
        shape.num_query_groups,
        shape.head_dim,
    ) == (h, a, g, d)
    assert (shape.ffn_hidden_size, shape.vocab_size, shape.gated) == (f, V, True)
    projections = 2 * s * (h * (a + 2 * g) * d + a * d * h)  # linear_qkv, linear_proj
    mlp = 2 * s * (h * 2 * f + f * h)  # linear_fc1 (gate and up), linear_fc2
    return projections, mlp, 2 * s * h * V


def test_attention_flops_follow_the_mean_document_length():
    """Documents of D tokens: the kernel's FLOPs are (s/D) documents x D^2, every other term
    is the one-document value."""
    s, b = 256, 2
    dense = forward_flops(TINY, s, b)
    for D in (s, s // 16):
        fl = forward_flops(TINY, s, b, mean_document_length=D)
        assert fl["attention_kernel"] == _hand_attention_kernel_flops(TINY, b, [D] * (s // D))
        assert {k: v for k, v in fl.items() if k != "attention_kernel"} == {
            k: v for k, v in dense.items() if k != "attention_kernel"
        }
    assert forward_flops(TINY, s, b, mean_document_length=s) == dense
    assert (
        forward_flops(TINY, s, b, mean_document_length=16)["attention_kernel"]
        == dense["attention_kernel"] / 16
    )
    # equal lengths are a lower bound: the same mean, unequal lengths cost more
    assert forward_flops(TINY, s, b, mean_document_length=16)[
        "attention_kernel"
    ] < _hand_attention_kernel_flops(TINY, b, [8, 24] * 8)


def test_step_flops_and_recompute_overhead_with_packed_documents():
    """By hand at s = 256, D = 16 (16 documents): forward x 3 for the GEMMs, x 3.5 for the
    fused kernel; recompute adds one forward of what it recomputes. Memory is unchanged."""
    s, D, L = 256, 16, TINY.num_layers
    projections, mlp, logits = _hand_linear_flops(TINY, s)
    kernel = _hand_attention_kernel_flops(TINY, 1, [D] * (s // D))
    step = 3 * (L * (projections + mlp) + logits) + 3.5 * L * kernel
    assert step_flops(TINY, s, mean_document_length=D) == pytest.approx(step, rel=1e-12)
    expected = {
        "none": 0.0,
        "attention": L * (projections + kernel) / step,
        "full": L * (projections + kernel + mlp) / step,
    }
    for mode, overhead in expected.items():
        assert recompute_overhead(TINY, s, mode, mean_document_length=D) == pytest.approx(
            overhead, rel=1e-12
        )
        layout = Layout(recompute=mode, global_batch_size=4)
        packed = plan_memory(TINY, s, layout, mean_document_length=D)
        one_document = plan_memory(TINY, s, layout)
        assert (
            packed.per_device == one_document.per_device
            and packed.layer_terms == one_document.layer_terms
        )
        assert packed.recompute_overhead == pytest.approx(overhead, rel=1e-12)
        assert (
            packed.to_dict()["mean_document_length"] == D
            and one_document.to_dict()["mean_document_length"] is None
        )
    assert recompute_overhead(TINY, s, "attention", mean_document_length=D) < recompute_overhead(
        TINY, s, "attention"
    )


RECIPE_ARGS = [
    *TRAINER_SWITCHES,
    *"--tp 8 --pp 2 --cp 16 --num-devices 256 --recompute attention --device-memory 64GB".split(),
]


def test_cli_mean_document_length_in_text_and_json(capsys):
    assert plan_main(RECIPE_ARGS + ["--json"]) == 0
    one_document = json.loads(capsys.readouterr().out)
    assert plan_main(RECIPE_ARGS + ["--mean-document-length", "8K", "--json"]) == 0
    packed = json.loads(capsys.readouterr().out)
    assert one_document["mean_document_length"] is None and packed["mean_document_length"] == 8192
    assert packed["per_device_bytes"] == one_document["per_device_bytes"]
    assert packed["recompute_overhead"] == recompute_overhead(
        "llama2-70b", 131072, "attention", mean_document_length=8192
    )
    assert packed["recompute_overhead"] < one_document["recompute_overhead"]
    # the launch command asks the trainer for the document masking the plan assumes
    assert "--reset-attention-mask --reset-position-ids" in packed["launch_command"]
    assert "--reset-attention-mask" not in one_document["launch_command"]

    assert plan_main(RECIPE_ARGS + ["--mean-document-length", "8192"]) == 0
    out = capsys.readouterr().out
    assert "documents: packed, mean 8,192 tokens" in out and "x 0.0625" in out
    assert f"recompute +{packed['recompute_overhead']:.1%}" in out

    search = (
        "--search --num-devices 256 --device-memory 64GB --top 2 --mean-document-length 8K".split()
    )
    assert plan_main(search) == 0
    assert "131,072 tokens (documents of mean 8,192)" in capsys.readouterr().out
    assert plan_main(search + ["--json"]) == 0
    assert {p["mean_document_length"] for p in json.loads(capsys.readouterr().out)["layouts"]} == {
        8192
    }


@pytest.mark.parametrize(
    "argv,problem,fix",
    [
        (
            "--mean-document-length 0",
            "--mean-document-length 0: a document has at least 1 token",
            "or omit the flag",
        ),
        (
            "--mean-document-length -5",
            "--mean-document-length -5: a document has at least 1 token",
            "or omit the flag",
        ),
        (
            "--seq-length 4K --mean-document-length 8K",
            "--mean-document-length 8192 is longer than --seq-length 4096",
            "give at most 4096",
        ),
        (
            "--compare-standard --mean-document-length 4K",
            "--mean-document-length changes FLOPs, not the saved bytes",
            "drop it",
        ),
    ],
)
def test_cli_mean_document_length_errors(capsys, argv, problem, fix):
    """Bad values stop the CLI (exit 2) with the flag, the problem and the fix."""
    assert plan_main(argv.split()) == 2
    err = capsys.readouterr().err
    assert err.startswith("mcore-flash plan: ") and problem in err and fix in err


def test_mean_document_length_is_checked_in_the_api():
    with pytest.raises(
        ValueError, match="--mean-document-length 512 is longer than --seq-length 256"
    ):
        forward_flops(TINY, 256, mean_document_length=512)
    with pytest.raises(ValueError, match="at least 1 token"):
        plan_memory(TINY, 256, Layout(), mean_document_length=0.5)


def test_cli_partial_recompute_plan_and_its_launch_flags(capsys):
    """--recompute qkv --recompute-num-layers 4: 4 of 40 layers per stage recomputed whole, qkv for
    the rest; the overhead mixes the modes by layer share and the launch flags parse back."""
    from mcore_flash.transformer.recompute import recompute_settings

    rc = plan_main(
        RECIPE_ARGS[:-4]
        + "--recompute qkv --recompute-num-layers 4 --device-memory 64GB --json".split()
    )
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["layout"]["recompute_num_layers"] == 4
    s = 131072
    mixed = 0.1 * recompute_overhead("llama2-70b", s, "full") + 0.9 * recompute_overhead(
        "llama2-70b", s, "qkv"
    )
    assert out["recompute_overhead"] == pytest.approx(mixed, rel=1e-12)
    flags = out["recompute_flags"]
    assert " ".join(flags) in out["launch_command"]
    assert (
        flags
        == "--recompute-granularity full --recompute-method block --recompute-num-layers 4 --recompute-modules qkv".split()
    )
    settings = recompute_settings(flags[1], flags[3], int(flags[5]), flags[7:])
    assert settings.config["recompute_method"] == "block" and settings.layer_modules == ("qkv",)
    qkv_only = plan_memory(
        "llama2-70b", s, Layout(tp=8, pp=2, cp=16, recompute="qkv"), device_memory="64GB"
    )
    assert out["total_bytes_per_device"] < qkv_only.total

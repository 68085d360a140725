"""Qwen2/Qwen2.5 (q/k/v biases) and dense Qwen3 (per-head q/k RMSNorm, its own head_dim) <->
megatron checkpoints, and their presets.

Oracle: `transformers` (it writes the source checkpoints, reads the exported ones, computes the
reference loss and greedy `generate`, and builds the published configs on the meta device for
the parameter counts). The conversion, generation and training runs are the CLI's, as in
``test_convert.py``, whose helpers these tests use.
"""

from __future__ import annotations

import os

import pytest
import torch
from test_convert import (
    LR0,
    TRAIN,
    _convert_in_process,
    _edit_config,
    _generate_ids,
    _w_loss,
    assert_same_tensors,
    convert,
    lr0_step,
)

from _support.dist_utils import init_megatron, run_distributed, teardown_megatron
from _support.hf_models import (
    hf_greedy,
    hf_padded_token_losses,
    make_hf_llama,
    make_hf_qwen2,
    make_hf_qwen3,
)

FAMILIES = {
    "qwen2.5": (make_hf_qwen2, "Qwen2ForCausalLM"),  # q/k/v biases
    "qwen3": (make_hf_qwen3, "Qwen3ForCausalLM"),  # q/k norms, head_dim 32 != 64 / 4
}
PROMPT = [1, 17, 99, 4, 250, 31]


def _same_model(src, out):
    """Every tensor of ``out`` equals ``src``'s bit for bit (same names, dtypes), and
    transformers reads the same architecture and shape from both config.json files."""
    from transformers import AutoConfig

    assert_same_tensors(src, out)
    a, b = AutoConfig.from_pretrained(src), AutoConfig.from_pretrained(out)
    for field in (
        "architectures",
        "model_type",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "tie_word_embeddings",
        "max_position_embeddings",
        "rope_parameters",
        "attention_bias",
        "sliding_window",
        "layer_types",
    ):
        assert getattr(a, field, None) == getattr(b, field, None), field


@pytest.mark.parametrize("family", FAMILIES)
def test_qwen_converts_with_transformers_loss_and_greedy_and_back_bit_exact(tmp_path, family):
    """hf -> mcore (TP1): the fp32 per-token loss equals transformers' (1e-5 relative; the
    258-token vocabulary padded to 384 zero rows, whose zero logits enter the softmax as in
    Megatron-LM), `generate --json` equals transformers' greedy `generate` token for token;
    mcore -> hf gives every tensor back bit-exact, with the same config for transformers."""
    make, architecture = FAMILIES[family]
    src = make(tmp_path / "hf")
    convert("hf-to-mcore", "--hf-dir", src, "--save", tmp_path / "mc")

    tokens = torch.randint(0, 258, (2, 48), generator=torch.Generator().manual_seed(3))
    [ours] = run_distributed(_w_loss, 1, str(tmp_path / "mc"), tokens)
    oracle = hf_padded_token_losses(src, tokens, 384)
    torch.testing.assert_close(ours.double().flatten(), oracle, rtol=1e-5, atol=0)

    printed = _generate_ids(
        tmp_path / "mc", "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", 12
    )
    assert printed == (PROMPT, hf_greedy(src, PROMPT, 12))

    convert("mcore-to-hf", "--load", tmp_path / "mc", "--save-hf", tmp_path / "out")
    _same_model(src, tmp_path / "out")
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(tmp_path / "out").architectures == [architecture]


@pytest.mark.parametrize("family", ["qwen3", pytest.param("qwen2.5", marks=pytest.mark.slow)])
def test_qwen_at_tp2_trains_generates_and_exports_bit_exact(tmp_path, family):
    """Converted for TP2, trained one lr-0 step at TP2 (the q/k norms' gradients all-reduced
    over TP by megatron: :func:`test_qwen3_norm_gradients_at_tp2_equal_tp1s`) and saved by the
    trainer: `generate` at TP2 from that checkpoint equals transformers' greedy `generate`, and
    the export gives every source tensor back bit-exact."""
    make, _ = FAMILIES[family]
    src = make(tmp_path / "hf")
    tp = ["--tensor-model-parallel-size", 2]
    convert("hf-to-mcore", "--hf-dir", src, "--save", tmp_path / "mc", *tp)
    lr0_step(2, tmp_path / "mc", tmp_path / "run", *tp)
    printed = _generate_ids(
        tmp_path / "run",
        "--prompt-ids",
        ",".join(map(str, PROMPT)),
        "--max-new-tokens",
        12,
        *tp,
        world_size=2,
    )
    assert printed == (PROMPT, hf_greedy(src, PROMPT, 12))
    convert("mcore-to-hf", "--load", tmp_path / "run", "--save-hf", tmp_path / "out")
    _same_model(src, tmp_path / "out")


def _w_first_step_gradients(rank, world_size, argv):
    """The trainer's first iteration (loss) and, after megatron's ``finalize_model_grads``,
    every norm weight's main gradient on this rank (the norms are whole on every TP rank)."""
    from megatron.core import parallel_state

    from mcore_flash.runtime import distributed
    from mcore_flash.runtime.arguments import parse_config
    from mcore_flash.training import loop

    config = parse_config(argv)
    distributed.init_distributed(config)
    recipe = loop.PretrainRecipe(config)
    try:
        loss, _, _ = recipe.train_step()
        grads = {
            name: param.main_grad.detach().clone()
            for name, param in recipe.model_chunks[0].named_parameters()
            if "layernorm" in name
        }
        return loss, grads
    finally:
        recipe.cleanup()
        parallel_state.destroy_model_parallel()


def test_qwen3_norm_gradients_at_tp2_equal_tp1s(tmp_path):
    """Qwen3's q/k norms are per head, and a TP2 rank holds half the heads: its local gradient
    of a q/k norm weight is a partial sum (about half) until megatron's
    ``finalize_model_grads`` all-reduces it over TP by name (``q_layernorm``/``k_layernorm``,
    the names our spec keeps). Oracle: the TP1 run of the same weights and data (the
    vocabulary padded alike), fp32; the loss and every norm's gradient on each TP2 rank."""
    src = make_hf_qwen3(tmp_path / "hf")
    runs = {1: ["--make-vocab-size-divisible-by", 256], 2: ["--tensor-model-parallel-size", 2]}
    results = {}
    for size, layout in runs.items():
        convert("hf-to-mcore", "--hf-dir", src, "--save", tmp_path / f"mc{size}", *layout)
        argv = [
            *("--load", tmp_path / f"mc{size}", "--finetune", "--use-checkpoint-args"),
            *("--save", tmp_path / f"run{size}", "--train-iters", 1, *LR0, *TRAIN, *layout),
        ]
        results[size] = run_distributed(
            _w_first_step_gradients, size, [*map(str, argv)], timeout=300
        )
    (want_loss, want), *_ = results[1]
    assert any("q_layernorm" in name for name in want)
    for rank, (loss, grads) in enumerate(results[2]):
        assert loss == pytest.approx(want_loss, rel=1e-5), f"TP2 rank {rank}"
        assert grads.keys() == want.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(
                grad,
                want[name],
                rtol=1e-5,
                atol=1e-7,
                msg=lambda m, n=f"rank {rank} {name}": f"{n}: {m}",
            )


QWEN_EDITS = {  # (family, config.json changes the converter must refuse, what its error names)
    "yarn rope (Qwen's long-context recipe)": (
        "qwen2.5",
        dict(
            rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
            rope_parameters=None,
        ),
        "rope_scaling type 'yarn' is not supported (megatron-core builds its YaRN embedding",
    ),
    "qwen3 yarn rope": (
        "qwen3",
        dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}, rope_parameters=None),
        "'yarn'",
    ),
    "sliding window": (
        "qwen2.5",
        dict(use_sliding_window=True, sliding_window=16, max_window_layers=2),
        "use_sliding_window=True",
    ),
    "sliding layer types": (
        "qwen3",
        dict(layer_types=["full_attention"] * 2 + ["sliding_attention"] * 2),
        "layer_types ['sliding_attention']",
    ),
    "qwen3 attention bias": ("qwen3", dict(attention_bias=True), "attention_bias=True"),
    "qwen2 mlp bias": (
        "qwen2.5",
        dict(mlp_bias=True),
        "field(s) mlp_bias would change the model and are not supported by the Qwen2 converter",
    ),
    "gelu": ("qwen3", dict(hidden_act="gelu"), "hidden_act='gelu'"),
    "qwen3 moe": (
        "qwen3",
        dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe"),
        "Qwen3MoeForCausalLM",
    ),
    "architecture and model_type disagree": (
        "qwen2.5",
        dict(model_type="qwen3"),
        "Qwen2ForCausalLM",
    ),
}


@pytest.mark.parametrize("case", QWEN_EDITS)
def test_unsupported_qwen_configs_are_refused_by_name(tmp_path, capsys, case):
    family, edit, expected = QWEN_EDITS[case]
    src = FAMILIES[family][0](tmp_path / "hf", layers=4)
    _edit_config(src, **edit)
    code, err = _convert_in_process(
        capsys, "hf-to-mcore", "--hf-dir", src, "--save", tmp_path / "mc"
    )
    assert code == 2 and expected in err and err.startswith("mcore-flash convert: error:"), err
    assert sorted(os.listdir(tmp_path)) == ["hf"]  # nothing written


def test_models_without_a_hugging_face_architecture_do_not_export():
    """Both Qwen options together (no transformers class has both) and a Llama whose head size
    is not hidden / heads (the Llama importer refuses that head_dim) are refused by name."""
    from mcore_flash.checkpoint.model_args import model_args
    from mcore_flash.conversion.hf_config import ConversionError, hf_config_from_model_args
    from mcore_flash.runtime.arguments import parse_args

    base = ["--model", "tiny", "--save", "/tmp/unused"]
    both = model_args(parse_args(base + ["--add-qkv-bias", "--qk-layernorm"]), 258)
    with pytest.raises(ConversionError, match="--add-qkv-bias with --qk-layernorm"):
        hf_config_from_model_args(both)
    llama = model_args(parse_args(base + ["--kv-channels", "64"]), 258)
    with pytest.raises(ConversionError, match="--kv-channels 64 differs"):
        hf_config_from_model_args(llama)
    # the default head size given explicitly is the default: stored as None, a Llama exports
    default = model_args(parse_args(base + ["--kv-channels", "32"]), 258)
    assert default["kv_channels"] is None and hf_config_from_model_args(default)["head_dim"] == 32


def test_llama_conversion_is_unchanged_by_the_qwen_options(tmp_path):
    """A Llama's model flags gain no Qwen option (the three are False/None in model_args)."""
    from mcore_flash.conversion.hf_config import model_args_from_hf, model_flags, read_config

    args = model_args_from_hf(read_config(make_hf_llama(tmp_path / "hf")))
    assert (args["add_qkv_bias"], args["qk_layernorm"], args["kv_channels"]) == (False, False, None)
    assert not {"--add-qkv-bias", "--qk-layernorm", "--kv-channels"} & set(model_flags(args))


# Published config.json files (huggingface.co/Qwen/<name>/blob/main/config.json)
QWEN25_72B_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "hidden_act": "silu",
    "hidden_size": 8192,
    "initializer_range": 0.02,
    "intermediate_size": 29568,
    "max_position_embeddings": 131072,
    "max_window_layers": 80,
    "model_type": "qwen2",
    "num_attention_heads": 64,
    "num_hidden_layers": 80,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0,
    "sliding_window": 131072,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.43.1",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 152064,
}
QWEN3_32B_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 5120,
    "initializer_range": 0.02,
    "intermediate_size": 25600,
    "max_position_embeddings": 40960,
    "max_window_layers": 64,
    "model_type": "qwen3",
    "num_attention_heads": 64,
    "num_hidden_layers": 64,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
QWEN3_8B_CONFIG = {
    **QWEN3_32B_CONFIG,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "max_window_layers": 36,
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
}
PUBLISHED = {
    "qwen2.5-72b": QWEN25_72B_CONFIG,
    "qwen3-32b": QWEN3_32B_CONFIG,
    "qwen3-8b": QWEN3_8B_CONFIG,
}


YARN = dict(head_dim=128, rope_theta=1e6, factor=4.0, original_max_position_embeddings=32768)


def _w_megatron(rank, world_size, names):
    """In a megatron worker (CPU platform): the presets' parameter counts (GPTModel with our
    spec on the meta device), and megatron-core's YaRN cos/sin (x its attention factor) for
    Qwen's recipe (:data:`YARN`) at 64 positions, with whether a TransformerConfig has the
    ``yarn_*`` fields GPTModel reads."""
    init_megatron()
    try:
        from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
            YarnRotaryEmbedding,
        )
        from megatron.core.transformer.transformer_config import TransformerConfig

        from _support.models import meta_parameter_count

        yarn = YarnRotaryEmbedding(
            kv_channels=YARN["head_dim"],
            rotary_base=YARN["rope_theta"],
            scaling_factor=YARN["factor"],
            original_max_position_embeddings=YARN["original_max_position_embeddings"],
            use_cpu_initialization=True,
        )
        emb, attention_factor = yarn(64)
        config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4)
        return {
            "counts": {name: meta_parameter_count(name) for name in names},
            "yarn": (emb[:, 0, 0].cos() * attention_factor, emb[:, 0, 0].sin() * attention_factor),
            "yarn_fields": hasattr(config, "yarn_rotary_scaling_factor"),
        }
    finally:
        teardown_megatron()


@pytest.fixture(scope="module")
def megatron_facts():
    [facts] = run_distributed(_w_megatron, 1, list(PUBLISHED))
    return facts


def test_yarn_is_refused_though_megatrons_embedding_matches_transformers(megatron_facts):
    """The reason for the yarn refusal, kept checked: megatron-core's YarnRotaryEmbedding gives
    transformers' Qwen2 YaRN cos/sin (attention factor included) for Qwen's recipe to fp32
    rounding, but a TransformerConfig has no ``yarn_*`` fields for GPTModel to build it from."""
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    config = Qwen2Config(
        hidden_size=4 * YARN["head_dim"],
        num_attention_heads=4,
        max_position_embeddings=131072,
        rope_parameters={"rope_type": "yarn", **{k: v for k, v in YARN.items() if k != "head_dim"}},
    )
    cos, sin = Qwen2RotaryEmbedding(config)(torch.zeros(1, 64, 1), torch.arange(64)[None])
    ours_cos, ours_sin = megatron_facts["yarn"]
    torch.testing.assert_close(ours_cos, cos[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours_sin, sin[0], rtol=1e-6, atol=1e-6)
    assert not megatron_facts["yarn_fields"]


def test_qwen_presets_have_the_published_parameter_counts(megatron_facts):
    """Each Qwen preset's parameter count (the planner's formula, and megatron's GPTModel with
    our spec on the meta device) equals transformers' model of the published config.json built
    on the meta device; the config converts to the preset's model flags (the trainer's
    ``--model`` parsed), and the config exported from them reads back in transformers alike."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from mcore_flash.checkpoint.model_args import model_args
    from mcore_flash.conversion.hf_config import hf_config_from_model_args, model_args_from_hf
    from mcore_flash.planning import total_parameters
    from mcore_flash.planning.models import get_model
    from mcore_flash.runtime.arguments import parse_args

    megatron = megatron_facts["counts"]
    for name, published in PUBLISHED.items():
        config = AutoConfig.for_model(**published)
        with torch.device("meta"):
            hf = AutoModelForCausalLM.from_config(config)
        hf_count = sum(p.numel() for p in hf.parameters())
        assert total_parameters(name) == megatron[name] == hf_count, name

        preset = get_model(name)
        ours = model_args_from_hf(published)
        assert ours == model_args(parse_args(["--model", name]), preset.vocab_size), name
        exported = AutoConfig.for_model(**hf_config_from_model_args(ours, published))
        for field in (
            "architectures",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "vocab_size",
            "rms_norm_eps",
            "max_position_embeddings",
            "tie_word_embeddings",
            "rope_parameters",
            "attention_bias",
            "sliding_window",
            "layer_types",
            "bos_token_id",
            "eos_token_id",
        ):
            assert getattr(exported, field, None) == getattr(config, field, None), (name, field)
    assert total_parameters("qwen2.5-72b") == 72_706_203_648  # "72.7B" on its model card

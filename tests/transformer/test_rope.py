"""RoPE for context extension and the norm epsilon: the trainer's model against transformers.

The oracle is `transformers`' own Llama rotary embedding (``LlamaRotaryEmbedding``) for the
same config: the rotation angles of the model `mcore-flash pretrain` builds from its flags
(``--rotary-base`` (ABF), ``--use-rope-scaling`` + ``--rope-scaling-factor`` (Llama-3.1),
``--rotary-seq-len-interpolation-factor`` (linear position interpolation)) must equal
Hugging Face's for the matching ``rope_theta`` / ``rope_scaling``.
"""

from __future__ import annotations

import pytest
import torch

from _support.dist_utils import init_megatron, run_distributed, teardown_megatron
from _support.pretrain_flags import model_shape

SHAPE = model_shape(num_layers=1, seq_length=256)
POSITIONS = 2048

CASES = {
    # name: (our flags, transformers' rope_theta and rope_scaling)
    "default": ([], 10000.0, None),
    "abf-500000": (["--rotary-base", "500000"], 500000.0, None),
    "llama3.1-scaling": (
        ["--rotary-base", "500000", "--use-rope-scaling", "--rope-scaling-factor", "8"],
        500000.0,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
    "linear-interpolation-4": (
        ["--rotary-seq-len-interpolation-factor", "4"],
        10000.0,
        {"rope_type": "linear", "factor": 4.0},
    ),
}


def _w_angles(rank, world_size, cases):
    """Per case: the rotation angles [POSITIONS, head_dim] of the trainer's model, and the
    eps of its norms."""
    init_megatron()
    try:
        from mcore_flash.runtime.arguments import parse_args
        from mcore_flash.runtime.model import build_model, transformer_config

        out = {}
        for name, (flags, _, _) in cases.items():
            args = parse_args([*SHAPE, *flags, "--norm-epsilon", "1e-6"])
            model = build_model(args, transformer_config(args), 256)
            angles = model.rotary_pos_emb(POSITIONS)[:, 0, 0, :]  # [s, 1, 1, d] -> [s, d]
            norms = [model.decoder.layers[0].input_layernorm, model.decoder.final_layernorm]
            out[name] = (angles, [norm.eps for norm in norms])
        return out
    finally:
        teardown_megatron()


def _hf_cos_sin(rope_theta, rope_scaling):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=131072,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
    )
    rope = LlamaRotaryEmbedding(config)
    x = torch.zeros(1, POSITIONS, 64, dtype=torch.float64)
    return rope(x, torch.arange(POSITIONS).unsqueeze(0))


@pytest.fixture(scope="module")
def ours():
    return run_distributed(_w_angles, 1, CASES)[0]


@pytest.mark.parametrize("name", sorted(CASES))
def test_rotary_angles_equal_transformers(ours, name):
    _, rope_theta, rope_scaling = CASES[name]
    cos, sin = _hf_cos_sin(rope_theta, rope_scaling)
    angles, _ = ours[name]
    torch.testing.assert_close(torch.cos(angles).double(), cos[0].double(), atol=2e-5, rtol=0)
    torch.testing.assert_close(torch.sin(angles).double(), sin[0].double(), atol=2e-5, rtol=0)


def test_the_extensions_change_the_angles(ours):
    default = ours["default"][0]
    for name in ("abf-500000", "llama3.1-scaling", "linear-interpolation-4"):
        assert (ours[name][0] - default).abs().max() > 0.1, name


def test_norm_epsilon_reaches_every_norm(ours):
    for _, eps in ours.values():
        assert eps == [1e-6, 1e-6]


def test_llama31_presets_scale_rope_to_128k():
    from mcore_flash.runtime.arguments import parse_args

    for preset in ("llama3.1-8b", "llama3.1-70b"):
        args = parse_args(["--model", preset, "--seq-length", "131072", "--global-batch-size", "1"])
        assert args.use_rope_scaling and args.rope_scaling_factor == 8.0
        assert (args.rotary_base, args.max_position_embeddings, args.norm_epsilon) == (
            500000,
            131072,
            1e-5,
        )


@pytest.mark.parametrize(
    "flags,match",
    [
        (["--use-rope-scaling", "--rotary-seq-len-interpolation-factor", "4"], "pick one"),
        (
            ["--use-rope-scaling", "--position-embedding-type", "learned_absolute"],
            "--use-rope-scaling needs",
        ),
        (["--use-rope-scaling", "--rope-scaling-factor", "0"], "--rope-scaling-factor"),
        (["--rope-scaling-factor", "16"], "has no effect without --use-rope-scaling"),
        (["--rotary-seq-len-interpolation-factor", "0"], "--rotary-seq-len-interpolation-factor"),
        (["--norm-epsilon", "0"], "--norm-epsilon"),
    ],
)
def test_bad_rope_flags_name_the_flag(flags, match):
    from mcore_flash.runtime.arguments import parse_args

    with pytest.raises(ValueError, match=match):
        parse_args([*SHAPE, *flags])

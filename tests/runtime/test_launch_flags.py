"""`mcore-flash pretrain`'s flag edge: Megatron-LM's and MindSpeed-LLM's flags (aliases, flags
that change nothing, refusals), Megatron-LM's derived defaults, unknown flags, ``--help``'s
defaults and the resolved-arguments block. Pure Python, in process: parse_config and main stop
before torch is needed. The public launch scripts as a whole: tests/training/test_launch_scripts.py.
"""

from __future__ import annotations

import re

import pytest

from mcore_flash.runtime.arguments import build_parser, parse_config
from mcore_flash.runtime.launch_flags import LaunchFlagsRefused


def _config(*argv, world_size=1):
    return parse_config([str(a) for a in argv], world_size=world_size)


def _refusal(*argv, world_size=1) -> str:
    with pytest.raises(ValueError) as error:
        _config(*argv, world_size=world_size)
    return str(error.value)


def _note(config, start: str) -> str:
    (note,) = [n for n in config.notes if n.startswith(start)]
    return note


def test_help_lists_a_default_for_every_flag_that_has_one():
    """Every flag of ours that takes a value, and every switch the preset decides, says its
    default in ``--help`` (a value, none and what that means, or the preset's with the tiny
    preset's value); the launch-line flags say what happens to them instead."""
    parser = build_parser()
    text = parser.format_help()
    ours, launch = text.split("Megatron-LM and MindSpeed-LLM launch-line flags")
    chunks = {
        chunk.split()[0]: " ".join(chunk.split()) for chunk in re.split(r"\n  (?=--)", ours)[1:]
    }
    actions = {a.option_strings[0]: a for a in parser._actions if a.option_strings}
    needing = [
        flag
        for flag, action in actions.items()
        if flag in chunks and (action.nargs != 0 or action.default is None)
    ]
    assert len(needing) > 70
    assert [flag for flag in needing if "default" not in chunks[flag]] == []
    assert "the --model preset's, tiny: 0.003, the others: 0.0003" in chunks["--lr"]
    assert (
        "tiny: 8, the others: --micro-batch-size x data-parallel size"
        in (chunks["--global-batch-size"])
    )
    assert "(default: 10)" in chunks["--distributed-timeout-minutes"]
    launch_chunks = re.split(r"\n  (?=--)", launch)[1:]
    assert len(launch_chunks) > 50
    assert all(" flag; " in chunk for chunk in launch_chunks)


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--tensor-parallel-size", "2"],
            "unknown flag --tensor-parallel-size: did you mean --tensor-model-parallel-size or",
        ),
        (
            ["--use-flash-attention"],
            "unknown flag --use-flash-attention: did you mean --use-flash-attn",
        ),
        (["--lr-warmup-sample=10"], "did you mean --lr-warmup-samples"),
        (
            ["--zzz-frobnicate"],
            "neither a flag of this trainer nor a Megatron-LM / MindSpeed-LLM flag",
        ),
        (
            ["--seq", "64"],
            "unknown flag --seq: did you mean --seq-length or --sequence-parallel",
        ),  # no abbreviations
        (["--model", "llama9-1t"], "argument --model: invalid choice: 'llama9-1t'"),
    ],
)
def test_unknown_flags_get_did_you_mean_and_no_usage_dump(capsys, argv, message):
    """An unknown flag: its nearest names among ours and the Megatron-LM / MindSpeed-LLM flags
    known here; a bad value: argparse's message; either way one message, exit code 2, and never
    argparse's usage dump of ~150 lines."""
    from mcore_flash.pretrain import main

    with pytest.raises(SystemExit) as exit:
        main(argv)
    err = capsys.readouterr().err
    assert exit.value.code == 2
    assert message in " ".join(err.split()), err
    assert err.startswith("mcore-flash pretrain: error: ") and "usage:" not in err
    assert len(err.splitlines()) <= 3


def test_sample_based_schedule_becomes_iterations_as_megatron_lm_counts_them():
    """``--train-samples`` over ``--global-batch-size`` (floored: Megatron-LM's
    ``update_train_iters``), ``--lr-warmup-samples`` rounded to iterations, ``--lr-warmup-fraction``
    of the decay (= the run), ``--lr-decay-samples`` / ``--lr-decay-iters`` equal to the run; each
    said once. A decay that ends elsewhere, or a mix of the two schedules, is refused by name."""
    samples = ["--global-batch-size", 8, "--train-samples", 804]
    config = _config(*samples, "--lr-warmup-samples", 36, "--lr-decay-samples", 804)
    assert (config.train_iters, config.lr_warmup_iters, config.save_interval) == (100, 4, 100)
    assert "--train-iters 100 (804 samples / --global-batch-size 8, the last 4 samples" in _note(
        config, "--train-samples 804"
    )
    assert "rounded from 4.50" in _note(config, "--lr-warmup-samples 36")
    assert "accepted, changes nothing here" in _note(config, "--lr-decay-samples 804")
    fraction = _config("--train-iters", 200, "--lr-warmup-fraction", 0.05, "--lr-decay-iters", 200)
    assert (fraction.train_iters, fraction.lr_warmup_iters) == (200, 10)
    assert "--lr-decay-samples 800 (a Megatron-LM flag): ends the decay at 800 samples" in _refusal(
        *samples, "--lr-decay-samples", 800
    )
    assert "--lr-decay-iters 150 (a Megatron-LM flag): ends the decay at 150" in _refusal(
        "--train-iters", 200, "--lr-decay-iters", 150
    )
    assert "--train-iters is given too" in _refusal(*samples, "--train-iters", 5)
    assert "give --global-batch-size too" in _refusal("--train-samples", 800)
    assert "give one of them" in _refusal(
        "--train-iters", 200, "--lr-warmup-fraction", 0.1, "--lr-warmup-iters", 3
    )


def test_shape_flags_given_take_megatron_lms_derived_defaults_not_the_presets():
    """A line that gives the heads means multi-head attention unless it says otherwise (the
    tiny preset's 2 query groups would silently make it GQA); 1 group with
    ``--group-query-attention``; the FFN is 4 x hidden (8/3 x, to a multiple of 64, with SwiGLU);
    the head size hidden / heads. Without shape flags the preset's values stand."""
    mha = _config("--num-attention-heads", 8, "--hidden-size", 256)
    assert (mha.num_query_groups, mha.group_query_attention, mha.kv_channels) == (8, False, None)
    assert mha.ffn_hidden_size == 640  # int(4 * 256 * 2 / 3 / 64) * 64, tiny's SwiGLU
    mqa = _config("--num-attention-heads", 8, "--group-query-attention")
    assert (mqa.num_query_groups, mqa.group_query_attention) == (1, True)
    llama = _config("--model", "llama2-7b", "--hidden-size", 1024, "--num-attention-heads", 8)
    assert (llama.ffn_hidden_size, llama.num_query_groups) == (2688, 8)  # not 11008, 32
    tiny = _config()
    assert (tiny.num_query_groups, tiny.ffn_hidden_size) == (2, 352)


def test_seq_length_past_max_position_embeddings_as_megatron_lm_checks_it():
    """Megatron-LM's validate_args asserts max_position_embeddings >= seq_length whatever the
    position embedding: refused here when the line gives both, and always with learned absolute
    positions (a table of that many rows); with RoPE and the preset's positions (context
    extension of a preset, as the planner's lines do) said once instead."""
    message = _refusal("--seq-length", 512, "--max-position-embeddings", 256)
    assert "--seq-length 512 is above --max-position-embeddings 256" in message
    assert "pass --max-position-embeddings 512" in message
    learned = _refusal("--seq-length", 512, "--position-embedding-type", "learned_absolute")
    assert "learned_absolute positions are a table of that many rows" in learned
    extended = _config("--seq-length", 512)
    assert "past the tiny preset's --max-position-embeddings 256: RoPE takes any position" in (
        _note(extended, "--seq-length 512")
    )
    assert _config("--seq-length", 128).notes == ()


@pytest.mark.parametrize(
    "argv, world_size, wanted",
    [
        (
            ["--recompute-granularity", "full"],
            1,
            "--recompute-granularity full needs --recompute-method uniform",
        ),
        (
            ["--hidden-size", 100, "--num-attention-heads", 3],
            1,
            "--hidden-size 100 is not divisible by --num-attention-heads 3",
        ),
        (
            ["--ffn-hidden-size", 350, "--tensor-model-parallel-size", 4],
            4,
            "--ffn-hidden-size 350 is not divisible by --tensor-model-parallel-size 4",
        ),
        (["--attention-backend", "fused"], 1, "--attention-backend fused (Megatron-LM's choice"),
        (
            ["--attention-backend", "gpu"],
            1,
            "--attention-backend gpu: choose one of npu, cuda, cpu, reference",
        ),
        (["--ckpt-format", "torch"], 1, "--ckpt-format torch (Megatron-LM's legacy format"),
        (["--tokenizer-type", "PretrainedFromHF"], 1, "needs --tokenizer-name-or-path DIR"),
        (["--tokenizer-name-or-path", "tok"], 1, "with --tokenizer-type PretrainedFromHF only"),
        (
            ["--finetune", "--load", "x"],
            1,
            "--finetune starts a new run from the weights in --load x: give it its own --save",
        ),
        (
            ["--rotary-percent", 0.5],
            1,
            "--rotary-percent 0.5 (a Megatron-LM flag): 0.5: partial rotary",
        ),
        (
            ["--init-method-std", 0.01],
            1,
            "--init-method-std 0.01 (a Megatron-LM and MindSpeed-LLM flag): weights drawn here",
        ),
        (["--transformer-impl", "transformer_engine"], 1, "Transformer Engine is not used here"),
        (["--fp8-format", "hybrid"], 1, "fp8 training needs Transformer Engine"),
        (
            ["--low-freq-factor", 2],
            1,
            "--low-freq-factor 2.0 (a MindSpeed-LLM flag): 2: megatron-core's Llama-3.1 scaling fixes it at 1",
        ),
        (["--sparse-mode", 4], 1, "--sparse-mode 4 (a MindSpeed-LLM flag): mode 4"),
        (["--context-parallel-algo", "hybrid_cp_algo"], 1, "hybrid_cp_algo is not built here"),
        (
            ["--context-parallel-algo", "ulysses_cp_algo", "--cp-comm-type", "p2p"],
            1,
            "contradicts --cp-comm-type p2p",
        ),
        (
            ["--pipeline-model-parallel-size", 2, "--num-layer-list", "1,3", "--num-layers", 4],
            2,
            "uneven pipeline stages are not built here",
        ),
        (
            ["--recompute-activations", "--recompute-granularity", "full"],
            1,
            "is selective recompute",
        ),
        (["--distributed-backend", "gloo"], 1, "the collective library follows the device"),
        (
            ["--tensor-model-parallel-size", 2],
            1,
            "one process (no WORLD_SIZE); launch 2 or a multiple with torchrun --nproc-per-node 2",
        ),
    ],
)
def test_refusals_name_the_flag_the_reason_and_the_fix(argv, world_size, wanted):
    """Each refusal says the flag as given (never a Python name, never "None"), why, and what
    to pass instead; megatron-core's own assertions (head and FFN divisibility, the recompute
    method) are met by checks of ours first."""
    message = _refusal(*argv, world_size=world_size)
    assert wanted in message, message
    assert "None" not in message
    assert not re.search(r"\b(hidden_size|num_attention_heads|ffn_hidden_size)\b", message)


def test_value_dependent_flags_resolve_to_ours_and_say_so_once():
    """The aliases set our flags; the flags that change nothing are accepted with a note each."""
    config = _config(
        *["--context-parallel-algo", "ulysses_cp_algo", "--use-rotary-position-embeddings"],
        *["--rope-scaling-type", "llama3", "--low-freq-factor", 1.0, "--high-freq-factor", 4],
        *["--original-max-position-embeddings", 8192, "--recompute-activations"],
        *["--sparse-mode", 2, "--transformer-impl", "local", "--distributed-backend", "nccl"],
        *["--use-flash-attn", "--use-fused-rmsnorm", "--initial-loss-scale", 4096],
        *["--init-method-std", 0.02, "--rotary-percent", 1.0, "--eval-iters", 0],
        *["--eval-interval", 5, "--mock-data", "--sequence-parallel"],
    )
    assert (config.cp_comm_type, config.position_embedding_type, config.use_rope_scaling) == (
        "a2a",
        "rope",
        True,
    )
    assert config.recompute.config["recompute_granularity"] == "selective"
    assert (config.eval_interval, config.sequence_parallel) == (None, False)
    assert len(config.notes) == len(set(config.notes)) == 17
    assert "--cp-comm-type a2a" in _note(config, "--context-parallel-algo ulysses_cp_algo")
    assert "accepted, changes nothing here" in _note(config, "--use-flash-attn")
    assert "turned off, as Megatron-LM turns it off" in _note(config, "--sequence-parallel")
    finetune = _config("--init-method-std", 0.01, "--no-load-optim", "--load", "ckpt")
    assert "the weights come from the checkpoint in --load" in _note(finetune, "--init-method-std")
    even = _config(*["--num-layer-list", "2,2", "--pipeline-model-parallel-size", 2], world_size=2)
    assert "2 layers per stage" in _note(even, "--num-layer-list")


def test_every_refused_flag_of_a_line_at_once_in_its_order():
    with pytest.raises(LaunchFlagsRefused) as error:
        _config("--profile", "--lr", 1e-4, "--apply-layernorm-1p", "--attention-backend", "flash")
    flags = [flag for flag, _ in error.value.refusals]
    assert flags == ["--profile", "--apply-layernorm-1p", "--attention-backend"]
    assert str(error.value).startswith("these 3 flags are refused here (docs/launch-scripts.md):")


def test_a_resume_saves_into_load_unless_save_says_otherwise():
    """Without --save a run saves where it resumes from (Megatron-LM would save nothing: a
    resumed run of ours that saved into runs/tiny split one run over two directories); with
    neither, runs/<preset>."""
    assert _config("--load", "run1").save == "run1"
    assert _config("--load", "run1", "--save", "run2").save == "run2"
    assert _config().save == "runs/tiny"
    assert _config("--no-load-optim", "--load", "run1").save == "run1"


def test_the_resolved_arguments_are_megatron_lms_block():
    """Megatron-LM's ``_print_args`` layout: a title line, ``  name ..... value`` per flag (48
    columns of name and dots), sorted case-insensitively, an end line; every flag's resolved
    value, the world size and the derived layout, the hardware profile by name."""
    from mcore_flash.runtime.startup import arguments_block

    layout = ["--tensor-model-parallel-size", 2, "--global-batch-size", 16]
    config = _config("--hardware", "h100-80g", *layout, world_size=4)
    lines = arguments_block(config).splitlines()
    assert lines[0] == "------------------------ arguments ------------------------"
    assert lines[-1] == "-------------------- end of arguments ---------------------"
    body = lines[1:-1]
    assert body == sorted(body, key=str.lower)
    assert "  data_parallel_size ." + "." * (48 - len("data_parallel_size") - 1) + " 2" in body
    assert "  hardware " + "." * 40 + " h100-80g" in body
    assert "  lr " + "." * 46 + " 0.003" in body
    names = {line.split()[0] for line in body}
    assert {"world_size", "num_micro_batches", "save"} <= names
    assert not {"notes", "recompute"} & names

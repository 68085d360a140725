"""Hugging Face Llama <-> megatron checkpoints, continued pretraining and `generate`.

Oracles: `transformers` (it writes the source checkpoints with `save_pretrained`, reads ours
with `from_pretrained`, computes the reference loss and greedy `generate`) and `safetensors`'
own reader. The round trips go through the trainer: a converted checkpoint is loaded at
TP/PP, trained one step with lr 0 (Adam then leaves every weight bit-identical), saved by
megatron at that layout and exported again.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from _support.cli_runs import convert
from _support.dist_utils import init_megatron, run_distributed, teardown_megatron
from _support.hf_models import make_hf_llama


def hf_tensors(path) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face directory, read by the `safetensors` library."""
    from safetensors.torch import load_file

    files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    return {name: t for f in files for name, t in load_file(os.path.join(path, f)).items()}


def _model_tensor_keys(save, iteration: int) -> set[str]:
    """The model tensors' keys in the torch_dist checkpoint of ``iteration`` under ``save``
    (DCP's index; the optimizer's left out)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from mcore_flash.checkpoint.directory import checkpoint_dir

    metadata = FileSystemReader(checkpoint_dir(str(save), iteration)).read_metadata()
    return {
        key
        for key, entry in metadata.state_dict_metadata.items()
        if isinstance(entry, TensorStorageMetadata) and not key.startswith("optimizer.")
    }


def _w_main(rank, world_size, module, argv):
    import importlib

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = importlib.import_module(module).main(argv)
    return code, out.getvalue()


def pretrain(world_size, *argv):
    results = run_distributed(
        _w_main, world_size, "mcore_flash.pretrain", [*map(str, argv)], timeout=400
    )
    assert [code for code, _ in results] == [0] * world_size
    return results


TRAIN = [
    "--seq-length",
    "32",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "2",
    "--log-interval",
    "1",
]


LR0 = ["--lr", 0, "--min-lr", 0, "--lr-warmup-iters", 0]  # Adam then moves no weight


def finetune(world_size, load, save, *flags):
    """``pretrain --load load --finetune --use-checkpoint-args --save save`` with ``flags``:
    the trainer continues a converted checkpoint with its model flags."""
    return pretrain(
        world_size, "--load", load, "--finetune", "--use-checkpoint-args", "--save", save, *flags
    )


def lr0_step(world_size, load, save, *flags):
    """:func:`finetune` for one step at learning rate 0 under ``flags`` (the layout): the
    weights pass through the trainer's load, model chunks and save unchanged in value."""
    finetune(
        world_size,
        load,
        save,
        "--train-iters",
        1,
        *LR0,
        *TRAIN,
        *flags,
    )


def assert_same_tensors(src, out):
    """Every tensor of the Hugging Face directory ``out`` equals ``src``'s bit for bit (same
    names, dtypes)."""
    before, after = hf_tensors(src), hf_tensors(out)
    assert sorted(before) == sorted(after)
    for name in before:
        assert after[name].dtype == before[name].dtype and torch.equal(after[name], before[name]), (
            name
        )


@pytest.mark.parametrize(
    "tp,pp,vp,tie",
    [
        pytest.param(1, 1, None, False, marks=pytest.mark.slow),
        (1, 1, None, True),
        pytest.param(2, 2, None, False, marks=pytest.mark.slow),
        pytest.param(2, 2, None, True, marks=pytest.mark.slow),
        (1, 2, 2, False),
    ],
)
def test_round_trip_through_the_trainer_is_bit_exact(tmp_path, tp, pp, vp, tie):
    """hf -> mcore -> (loaded, one lr-0 step, saved at TP/PP, or with VP model chunks of the
    interleaved schedule) -> hf: every tensor bit-identical, the vocabulary padding removed,
    and transformers loads the result with the same config. The interleaved run's checkpoint
    also generates (at PP 1) what transformers generates from the source."""
    src = make_hf_llama(tmp_path / "hf", tie=tie)
    interleaved = []  # 2 micro-batches: the interleaved schedule takes them in groups of PP
    if vp is not None:
        interleaved = ["--virtual-pipeline-model-parallel-size", vp, "--micro-batch-size", 1]
    convert(
        "hf-to-mcore",
        "--hf-dir",
        src,
        "--save",
        tmp_path / "mc",
        "--tensor-model-parallel-size",
        tp,
        "--pipeline-model-parallel-size",
        pp,
    )
    lr0_step(
        tp * pp,
        tmp_path / "mc",
        tmp_path / "run",
        "--tensor-model-parallel-size",
        tp,
        "--pipeline-model-parallel-size",
        pp,
        *interleaved,
    )
    convert(
        "mcore-to-hf",
        "--load",
        tmp_path / "run",
        "--save-hf",
        tmp_path / "out",
        "--max-shard-size",
        "150KB",
    )

    assert_same_tensors(src, tmp_path / "out")
    assert ("lm_head.weight" in hf_tensors(tmp_path / "out")) == (not tie)
    # the converted checkpoint holds the tensors the trainer's own save holds: a tied
    # model's embedding once
    assert _model_tensor_keys(tmp_path / "mc", 0) == _model_tensor_keys(tmp_path / "run", 1)
    assert os.path.exists(tmp_path / "out" / "model.safetensors.index.json")

    from transformers import AutoConfig

    a, b = AutoConfig.from_pretrained(src), AutoConfig.from_pretrained(tmp_path / "out")
    for field in (
        "vocab_size",
        "hidden_size",
        "num_key_value_heads",
        "rms_norm_eps",
        "tie_word_embeddings",
        "max_position_embeddings",
        "bos_token_id",
        "eos_token_id",
    ):
        assert getattr(a, field) == getattr(b, field), field
    assert a.rope_parameters == b.rope_parameters
    if vp is not None:
        prompt = [1, 17, 99, 4, 250, 31]
        printed = _generate_ids(
            tmp_path / "run", "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", 8
        )
        assert printed == (prompt, _hf_greedy(src, prompt, 8))


def test_direct_round_trip_bf16_single_file(tmp_path):
    """--bf16 stores bf16; a model under the shard size is one model.safetensors (no index)."""
    src = make_hf_llama(tmp_path / "hf")
    convert("hf-to-mcore", "--hf-dir", src, "--save", tmp_path / "mc", "--bf16")
    convert("mcore-to-hf", "--load", tmp_path / "mc", "--save-hf", tmp_path / "out")
    assert sorted(os.listdir(tmp_path / "out")) == [  # the source's generation config travels
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    before, after = hf_tensors(src), hf_tensors(tmp_path / "out")
    for name in before:
        assert after[name].dtype == torch.bfloat16 and torch.equal(
            after[name], before[name].bfloat16()
        ), name


def _w_loss(rank, world_size, load, tokens):
    """The trainer's model, loaded from ``load``: per-token losses and logits of ``tokens``."""
    init_megatron()
    try:
        from mcore_flash.checkpoint import checkpointer, directory
        from mcore_flash.data.tokenizers import padded_vocab_size
        from mcore_flash.runtime.arguments import parse_args
        from mcore_flash.runtime.model import build_model, transformer_config

        args = parse_args(["--load", load, "--use-checkpoint-args"])
        saved = directory.read_model_args(load)
        vocab = padded_vocab_size(saved["vocab_size"])
        model = build_model(args, transformer_config(args), vocab)
        checkpointer.load_weights(load, model, vocab, saved)
        positions = torch.arange(tokens.shape[1] - 1).expand(tokens.shape[0], -1)
        with torch.no_grad():
            loss = model(tokens[:, :-1], positions, None, labels=tokens[:, 1:])
        return loss
    finally:
        teardown_megatron()


def _converted_and_transformers_losses(src, converted, vocab):
    """``(transformers' model, tokens, our per-token losses, the oracle's)`` on random tokens: the
    converted checkpoint's fp32 losses, and the cross-entropy of transformers' logits for the
    Hugging Face model ``src`` with the padding rows' zero logits appended."""
    from transformers import LlamaForCausalLM

    tokens = torch.randint(0, vocab, (2, 48), generator=torch.Generator().manual_seed(3))
    [ours] = run_distributed(_w_loss, 1, str(converted), tokens)
    hf = LlamaForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(tokens[:, :-1]).logits.double()
    padded = -(-vocab // 128) * 128
    logits = torch.cat([logits, logits.new_zeros(*logits.shape[:2], padded - vocab)], dim=-1)
    oracle = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), tokens[:, 1:].flatten(), reduction="none"
    )
    return hf, tokens, ours.double().flatten(), oracle


FAMILIES = {
    # name: (vocabulary, config overrides)
    "llama3.1 (GQA, llama3 scaling)": (512, {}),
    "llama3.1, padded vocabulary": (258, {}),
    "llama2 (MHA, base 10000, eps 1e-5)": (
        512,
        dict(num_key_value_heads=4, rope_theta=10000.0, rope_scaling=None, rms_norm_eps=1e-5),
    ),
    "linear interpolation x2": (512, dict(rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "llama3.2 (tied)": (512, dict(tie_word_embeddings=True)),
}


@pytest.mark.parametrize(
    "family",
    [
        family
        if family in ("llama3.1 (GQA, llama3 scaling)", "llama3.2 (tied)")
        else pytest.param(family, marks=pytest.mark.slow)
        for family in FAMILIES
    ],
)
def test_loss_after_conversion_equals_transformers(tmp_path, family):
    """fp32 per-token loss of the converted model = transformers' (1e-5 relative), for each
    family's config. With 258 tokens the vocabulary is padded to 384 rows of zeros: their
    logits are 0 and, as in Megatron-LM, enter the softmax, so the oracle is the cross-entropy
    of transformers' logits with 126 zero logits appended (and it differs from transformers'
    own loss)."""
    vocab, overrides = FAMILIES[family]
    overrides = dict(overrides)
    tie = overrides.pop("tie_word_embeddings", False)
    src = make_hf_llama(tmp_path / "hf", vocab=vocab, tie=tie, **overrides)
    run = convert("hf-to-mcore", "--hf-dir", src, "--save", tmp_path / "mc")
    assert ("vocabulary padded from 258 to 384 rows" in run.stdout) == (vocab == 258)
    hf, tokens, ours, oracle = _converted_and_transformers_losses(src, tmp_path / "mc", vocab)
    torch.testing.assert_close(ours, oracle, rtol=1e-5, atol=0)
    if vocab == 258:
        with torch.no_grad():
            hf_loss = hf(tokens, labels=tokens).loss.item()
        assert (
            abs(ours.double().mean().item() - hf_loss) > 0.1
        )  # the padding really is in the softmax


def _hf_greedy(src, prompt, n, stop_at_eos=True):
    """transformers' `generate(do_sample=False)` of at most ``n`` tokens, stopping at the EOS ids
    its generation config gives (as loaded from ``src``), or exactly ``n`` tokens."""
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    if not stop_at_eos:
        hf.generation_config.eos_token_id = None
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


def _generate_ids(load, *argv, world_size=1):
    """`mcore-flash generate --json` from ``load`` on ``world_size`` processes (rank 0's
    output): ``(prompt ids, output ids)``."""
    results = run_distributed(
        _w_main,
        world_size,
        "mcore_flash.generate",
        ["--load", str(load), "--json", *map(str, argv)],
        timeout=300,
    )
    code, stdout = results[0]
    assert code == 0
    printed = json.loads(stdout.strip().splitlines()[-1])
    return printed["prompt_ids"], printed["output_ids"]


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_generate_equals_transformers_greedy(tmp_path, tp):
    """`mcore-flash generate --json` from the converted checkpoint = transformers'
    `generate(do_sample=False)` token for token (GQA, llama3 RoPE scaling), at TP1 and TP2."""
    src = make_hf_llama(tmp_path / "hf", vocab=258)
    convert(
        "hf-to-mcore",
        "--hf-dir",
        src,
        "--save",
        tmp_path / "mc",
        "--tensor-model-parallel-size",
        tp,
    )
    prompt = [1, 17, 99, 4, 250, 31]
    printed = _generate_ids(
        tmp_path / "mc",
        "--prompt-ids",
        ",".join(map(str, prompt)),
        "--max-new-tokens",
        12,
        "--tensor-model-parallel-size",
        tp,
        world_size=tp,
    )
    assert printed == (prompt, _hf_greedy(src, prompt, 12))


def test_generate_pipeline_parallel_and_text_prompt(tmp_path):
    """PP2 gives the same tokens; --prompt text goes through the (byte) tokenizer."""
    src = make_hf_llama(tmp_path / "hf", vocab=258)
    convert("hf-to-mcore", "--hf-dir", src, "--save", tmp_path / "mc")
    printed = _generate_ids(
        tmp_path / "mc",
        "--prompt",
        "abc",
        "--max-new-tokens",
        5,
        "--pipeline-model-parallel-size",
        2,
        world_size=2,
    )
    assert printed == ([97, 98, 99], _hf_greedy(src, [97, 98, 99], 5))


def test_generate_stops_at_the_checkpoints_eos_as_transformers_does(tmp_path):
    """With an EOS id that greedy decoding reaches at its 3rd token (found by transformers'
    own unstopped run), set in generation_config.json as a list and config.json saying
    another id: `generate` equals transformers' `generate(do_sample=False)` on that directory
    (it stops after the EOS, which it includes); `--ignore-eos` gives exactly --max-new-tokens.
    Without generation_config.json the EOS comes from config.json, as in transformers."""
    src = make_hf_llama(tmp_path / "hf", vocab=258)
    prompt, n = [1, 17, 99, 4, 250, 31], 12
    free = _hf_greedy(src, prompt, n, stop_at_eos=False)
    eos = free[2]
    assert eos not in free[:2]
    generation_path = os.path.join(src, "generation_config.json")
    with open(generation_path) as f:
        generation = json.load(f)
    with open(generation_path, "w") as f:
        json.dump({**generation, "eos_token_id": [257, eos]}, f)
    _edit_config(src, eos_token_id=free[1])  # what generation_config.json overrides
    stopped = _hf_greedy(src, prompt, n)
    assert stopped == free[:3]  # the oracle really stops there
    convert("hf-to-mcore", "--hf-dir", src, "--save", tmp_path / "mc")
    ids = ",".join(map(str, prompt))
    assert _generate_ids(tmp_path / "mc", "--prompt-ids", ids, "--max-new-tokens", n) == (
        prompt,
        stopped,
    )
    assert _generate_ids(
        tmp_path / "mc", "--prompt-ids", ids, "--max-new-tokens", n, "--ignore-eos"
    ) == (prompt, free)

    os.remove(generation_path)
    stopped = _hf_greedy(src, prompt, n)
    assert stopped == free[:2]
    convert("hf-to-mcore", "--hf-dir", src, "--save", tmp_path / "mc_no_generation_config")
    assert _generate_ids(
        tmp_path / "mc_no_generation_config", "--prompt-ids", ids, "--max-new-tokens", n
    ) == (prompt, stopped)


def _metrics(save):
    with open(os.path.join(save, "metrics.jsonl")) as f:
        return {r["iteration"]: r["loss"] for r in map(json.loads, f)}


@pytest.mark.slow
def test_finetune_from_converted_checkpoint_then_exact_resume(tmp_path):
    """--finetune starts at iteration 0 from the converted weights (its first loss is the
    converted model's), under torch FSDP2 too; interrupted at 2 and resumed with --load, the run equals the
    uninterrupted one bit for bit, losses and final weights (dropout on, so RNG is restored)."""
    src = make_hf_llama(tmp_path / "hf", vocab=258)
    convert("hf-to-mcore", "--hf-dir", src, "--save", tmp_path / "mc")
    common = [
        "--finetune",
        "--load",
        tmp_path / "mc",
        "--use-checkpoint-args",
        "--train-iters",
        4,
        "--hidden-dropout",
        0.1,
        "--attention-dropout",
        0.1,
        *TRAIN,
    ]
    pretrain(1, *common, "--save", tmp_path / "full")
    # torch FSDP2 fine-tunes the converted weights to the same run (1e-5: another sum order)
    pretrain(1, *common, "--use-torch-fsdp2", "--save", tmp_path / "fsdp2")
    full, fsdp2 = _metrics(tmp_path / "full"), _metrics(tmp_path / "fsdp2")
    assert sorted(fsdp2) == [1, 2, 3, 4]
    assert fsdp2 == pytest.approx(full, rel=1e-5)
    pretrain(1, *common, "--save", tmp_path / "part", "--exit-interval", 2)
    shutil.copytree(tmp_path / "part", tmp_path / "part_at_2")
    shutil.copytree(tmp_path / "part", tmp_path / "optim_at_2")
    pretrain(
        1,
        "--load",
        tmp_path / "part",
        "--use-checkpoint-args",
        "--train-iters",
        4,
        "--hidden-dropout",
        0.1,
        "--attention-dropout",
        0.1,
        *TRAIN,
        "--save",
        tmp_path / "part",
    )
    full, part = _metrics(tmp_path / "full"), _metrics(tmp_path / "part")
    assert sorted(full) == [1, 2, 3, 4] and full == part
    # --no-load-rng resumes the weights and optimizer but draws other dropout masks
    pretrain(
        1,
        "--load",
        tmp_path / "part_at_2",
        "--no-load-rng",
        "--use-checkpoint-args",
        "--train-iters",
        4,
        "--hidden-dropout",
        0.1,
        "--attention-dropout",
        0.1,
        *TRAIN,
        "--save",
        tmp_path / "part_at_2",
    )
    no_rng = _metrics(tmp_path / "part_at_2")
    assert no_rng[2] == full[2] and no_rng[3] != full[3]
    # --no-load-optim: the checkpoint's iteration, a fresh optimizer, the lr schedule where it was
    pretrain(
        1,
        "--load",
        tmp_path / "optim_at_2",
        "--no-load-optim",
        "--use-checkpoint-args",
        "--train-iters",
        4,
        "--hidden-dropout",
        0.1,
        "--attention-dropout",
        0.1,
        *TRAIN,
        "--save",
        tmp_path / "optim_at_2",
    )
    with open(tmp_path / "full" / "metrics.jsonl") as f:
        full_lr = {r["iteration"]: r["lr"] for r in map(json.loads, f)}
    with open(tmp_path / "optim_at_2" / "metrics.jsonl") as f:
        fresh = [json.loads(line) for line in f]
    assert [r["iteration"] for r in fresh] == [1, 2, 3, 4] and all(
        r["lr"] == full_lr[r["iteration"]] for r in fresh
    )
    # iteration 3's loss is computed before its step (same weights and RNG: equal); iteration
    # 4 follows a step with fresh Adam moments: different
    assert fresh[2]["loss"] == full[3] and fresh[3]["loss"] != full[4]
    convert("mcore-to-hf", "--load", tmp_path / "full", "--save-hf", tmp_path / "full_hf")
    convert("mcore-to-hf", "--load", tmp_path / "part", "--save-hf", tmp_path / "part_hf")
    a, b = hf_tensors(tmp_path / "full_hf"), hf_tensors(tmp_path / "part_hf")
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not all(
        torch.equal(a[n], t) for n, t in hf_tensors(src).items()
    )  # training moved the weights


def test_loading_rules_for_converted_checkpoints(tmp_path):
    """Without --finetune/--no-load-optim a converted checkpoint is refused (it has no
    optimizer); a model flag that contradicts the checkpoint is named; --no-load-optim keeps
    the checkpoint's iteration."""
    src = make_hf_llama(tmp_path / "hf", vocab=258)
    convert("hf-to-mcore", "--hf-dir", src, "--save", tmp_path / "mc")
    base = [
        sys.executable,
        "-m",
        "mcore_flash.cli",
        "pretrain",
        "--load",
        str(tmp_path / "mc"),
        "--train-iters",
        "1",
        *map(str, TRAIN),
        "--save",
        str(tmp_path / "x"),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [*base, "--use-checkpoint-args"], capture_output=True, text=True, timeout=300, env=env
    )
    assert run.returncode == 2 and "add --finetune" in run.stderr, run.stderr[-2000:]
    run = subprocess.run(
        [*base, "--use-checkpoint-args", "--hidden-size", "128", "--finetune"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert run.returncode == 2 and "--hidden-size=64" in run.stderr, run.stderr[-2000:]
    run = subprocess.run(
        [*base, "--use-checkpoint-args", "--no-load-optim"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert run.returncode == 0 and "resumed from" in run.stdout + run.stderr


def _convert_in_process(capsys, *argv):
    from mcore_flash.conversion.cli import main

    capsys.readouterr()  # drop what building the source model printed
    code = main([*map(str, argv)])
    return code, capsys.readouterr().err


def _edit_config(path, **changes):
    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config.update(changes)
    with open(config_path, "w") as f:
        json.dump(config, f)


CONFIG_EDITS = {  # config.json changes the converter must refuse, and what its error names
    "unknown architecture": (
        dict(architectures=["MistralForCausalLM"], model_type="mistral"),
        "MistralForCausalLM",
    ),
    "vocab mismatch": (dict(vocab_size=300), "vocab_size"),
    "yarn rope": (
        dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}, rope_parameters=None),
        "'yarn'",
    ),
    "dynamic rope": (
        dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}, rope_parameters=None),
        "'dynamic'",
    ),
    "longrope": (
        dict(rope_scaling={"rope_type": "longrope", "factor": 2.0}, rope_parameters=None),
        "'longrope'",
    ),
    "unsupported field": (dict(sliding_window=4096), "sliding_window"),
    "lm_head with tied config": (dict(tie_word_embeddings=True), "tie_word_embeddings=true"),
    "attention bias": (dict(attention_bias=True), "attention_bias=True"),
    "mlp bias": (dict(mlp_bias=True), "mlp_bias=True"),
    "gelu": (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    "head_dim": (dict(head_dim=32), "head_dim=32"),
    "pruned heads": (dict(pruned_heads={"1": [0, 2]}), "pruned_heads"),
}


@pytest.mark.parametrize(
    "case,expected",
    [
        ("missing shard", "model-00002-of-"),
        ("tp does not divide heads", "--tensor-model-parallel-size 3"),
        ("no config", "no config.json"),
        *((case, expected) for case, (_, expected) in CONFIG_EDITS.items()),
    ],
)
def test_bad_hf_inputs_are_clear_errors_and_write_nothing(tmp_path, capsys, case, expected):
    src = make_hf_llama(tmp_path / "hf")
    argv = ["hf-to-mcore", "--hf-dir", src, "--save", tmp_path / "mc"]
    if case == "missing shard":
        os.remove(
            os.path.join(
                src, next(f for f in sorted(os.listdir(src)) if f.startswith("model-00002-of-"))
            )
        )
    elif case == "tp does not divide heads":
        argv += ["--tensor-model-parallel-size", 3]
    elif case == "no config":
        os.remove(os.path.join(src, "config.json"))
    else:
        _edit_config(src, **CONFIG_EDITS[case][0])
    code, err = _convert_in_process(capsys, *argv)
    assert code == 2 and expected in err and err.startswith("mcore-flash convert: error:"), err
    assert sorted(os.listdir(tmp_path)) == ["hf"]  # no --save, no .tmp


# config.json fields transformers ignores or keeps as metadata, with values published checkpoints
# carry: underscore keys its loaders add, PretrainedConfig's own attributes (4.x and 5.x) and
# the decoding settings 4.x kept in config.json
TRANSFORMERS_METADATA = {
    "_name_or_path": "meta-llama/Llama-3.2-1B",
    "_model_name_or_path": "/models/llama-3.2-1b",
    "_attn_implementation_autoset": True,
    "_commit_hash": "4e20de362430cd3b72f300e6b0f18e50e7166e08",
    "torch_dtype": "float32",
    "return_dict": True,
    "output_hidden_states": False,
    "torchscript": False,
    "use_bfloat16": False,
    "pruned_heads": {},
    "chunk_size_feed_forward": 0,
    "is_decoder": False,
    "add_cross_attention": False,
    "id2label": {"0": "LABEL_0", "1": "LABEL_1"},
    "label2id": {"LABEL_0": 0, "LABEL_1": 1},
    "tokenizer_class": "PreTrainedTokenizerFast",
    "prefix": "summarize: ",
    "sep_token_id": 5,
    "decoder_start_token_id": 1,
    "task_specific_params": {"summarization": {"max_length": 128, "num_beams": 4}},
    "max_length": 4096,
    "min_length": 1,
    "do_sample": True,
    "num_beams": 1,
    "temperature": 0.6,
    "top_k": 50,
    "top_p": 0.9,
    "typical_p": 1.0,
    "repetition_penalty": 1.1,
    "length_penalty": 1.0,
    "num_return_sequences": 1,
    "bad_words_ids": [[3]],
}


def test_transformers_metadata_fields_are_accepted(tmp_path, capsys):
    """A config.json with the fields transformers ignores converts, and the converted model's
    losses still equal transformers' on that directory (1e-5 relative); every generic
    attribute of the installed transformers' PretrainedConfig and GenerationConfig's defaults
    is among them. A model-changing field next to them is still refused, named alone."""
    import dataclasses

    from transformers import GenerationConfig, PretrainedConfig

    from mcore_flash.conversion.hf_config import is_metadata

    generic = (
        {f.name for f in dataclasses.fields(PretrainedConfig)}
        | set(PretrainedConfig().to_dict())
        | set(GenerationConfig._get_default_generation_params())
    )
    assert [field for field in sorted(generic) if not is_metadata(field)] == []

    src = make_hf_llama(tmp_path / "hf", vocab=258)
    _edit_config(src, **{**TRANSFORMERS_METADATA, "sliding_window": 16, "pruned_heads": {"1": [0]}})
    code, err = _convert_in_process(
        capsys, "hf-to-mcore", "--hf-dir", src, "--save", tmp_path / "x"
    )
    assert code == 2 and "field(s) pruned_heads, sliding_window would change the model" in err, err
    _edit_config(src, **TRANSFORMERS_METADATA, sliding_window=None)
    convert("hf-to-mcore", "--hf-dir", src, "--save", tmp_path / "mc")
    _, _, ours, oracle = _converted_and_transformers_losses(src, tmp_path / "mc", 258)
    torch.testing.assert_close(ours, oracle, rtol=1e-5, atol=0)


def test_existing_target_is_refused_and_untouched(tmp_path, capsys):
    src = make_hf_llama(tmp_path / "hf")
    (tmp_path / "mc").mkdir()
    (tmp_path / "mc" / "keep.txt").write_text("user data")
    code, err = _convert_in_process(
        capsys, "hf-to-mcore", "--hf-dir", src, "--save", tmp_path / "mc"
    )
    assert code == 2 and "already exists" in err
    code, err = _convert_in_process(
        capsys, "mcore-to-hf", "--load", tmp_path / "nothing", "--save-hf", tmp_path / "out"
    )
    assert code == 2 and "--load" in err
    assert os.listdir(tmp_path / "mc") == ["keep.txt"] and not os.path.exists(tmp_path / "out")


def test_mcore_to_hf_names_a_changed_checkpoint_file_and_writes_nothing(tmp_path, capsys):
    """One flipped bit inside a tensor shard would load silently as a wrong weight: the
    manifest check of every file (before megatron reads any) stops it, naming the file."""
    import glob

    src = make_hf_llama(tmp_path / "hf")
    convert("hf-to-mcore", "--hf-dir", src, "--save", tmp_path / "mc")
    shard = max(glob.glob(str(tmp_path / "mc" / "iter_*" / "*.distcp")), key=os.path.getsize)
    with open(shard, "r+b") as f:
        f.seek(os.path.getsize(shard) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))
    code, err = _convert_in_process(
        capsys, "mcore-to-hf", "--load", tmp_path / "mc", "--save-hf", tmp_path / "out"
    )
    assert code == 2 and shard in err and "Traceback" not in err, err
    assert not os.path.exists(tmp_path / "out")


_FAIL_MID_WRITE = """
import sys
from mcore_flash.conversion import safetensors_io
calls = []
def failing(original):
    def wrapper(*args, **kwargs):
        calls.append(1)
        if len(calls) == 8:
            raise OSError(28, "No space left on device (injected)")
        return original(*args, **kwargs)
    return wrapper
safetensors_io.HFCheckpointReader.get = failing(safetensors_io.HFCheckpointReader.get)
safetensors_io.StreamingSafetensorsWriter.write = failing(safetensors_io.StreamingSafetensorsWriter.write)
from mcore_flash.conversion.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_failure_mid_conversion_leaves_no_target(tmp_path):
    """A write that fails half-way (ENOSPC injected at the 8th tensor) leaves neither the
    target nor its .tmp directory, in both directions (the target appears only by rename)."""
    src = make_hf_llama(tmp_path / "hf")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            _FAIL_MID_WRITE,
            "hf-to-mcore",
            "--hf-dir",
            src,
            "--save",
            str(tmp_path / "mc"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert run.returncode != 0 and "injected" in run.stderr
    assert sorted(os.listdir(tmp_path)) == ["hf"]
    convert("hf-to-mcore", "--hf-dir", src, "--save", tmp_path / "mc")
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            _FAIL_MID_WRITE,
            "mcore-to-hf",
            "--load",
            str(tmp_path / "mc"),
            "--save-hf",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert run.returncode != 0 and "injected" in run.stderr
    assert sorted(os.listdir(tmp_path)) == ["hf", "mc"]


# config.json of two published checkpoints as the Hub serves them (transformers 4.x names),
# transcribed from meta-llama/Llama-2-70b-hf and meta-llama/Llama-3.1-8B.
LLAMA2_70B_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 8192,
    "initializer_range": 0.02,
    "intermediate_size": 28672,
    "max_position_embeddings": 4096,
    "model_type": "llama",
    "num_attention_heads": 64,
    "num_hidden_layers": 80,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "tie_word_embeddings": False,
    "torch_dtype": "float16",
    "transformers_version": "4.32.0.dev0",
    "use_cache": True,
    "vocab_size": 32000,
}
LLAMA31_8B_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0",
    "use_cache": True,
    "vocab_size": 128256,
}


@pytest.mark.parametrize(
    "config,preset", [(LLAMA2_70B_CONFIG, "llama2-70b"), (LLAMA31_8B_CONFIG, "llama3.1-8b")]
)
def test_published_configs_read_as_our_presets_and_export_back(config, preset):
    """A Hub config.json gives the model flags of our preset for that model (presets are
    written from the published shapes), and the config exported from them reads back in
    transformers with the same RoPE, eps, shape and token ids."""
    from transformers import LlamaConfig

    from mcore_flash.checkpoint.model_args import model_args
    from mcore_flash.conversion.hf_config import hf_config_from_model_args, model_args_from_hf
    from mcore_flash.planning.models import get_model
    from mcore_flash.runtime.arguments import parse_args

    ours = model_args_from_hf(config)
    expected = model_args(
        parse_args(["--model", preset, "--norm-epsilon", "1e-5"]), get_model(preset).vocab_size
    )
    assert ours == expected
    exported, original = (
        LlamaConfig(**hf_config_from_model_args(ours, config)),
        LlamaConfig(**config),
    )
    for field in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
        "rms_norm_eps",
        "max_position_embeddings",
        "tie_word_embeddings",
        "rope_parameters",
        "bos_token_id",
        "eos_token_id",
    ):
        assert getattr(exported, field) == getattr(original, field), field


def test_export_after_context_extension_carries_the_new_rope(tmp_path):
    """Continued pretraining with a new RoPE base (ABF) and longer positions: the exported
    config.json says so (transformers reads rope_theta 1e6, the llama3 scaling kept, 512
    positions), while token ids come from the original config."""
    from transformers import AutoConfig

    src = make_hf_llama(tmp_path / "hf", vocab=258, bos_token_id=7, eos_token_id=9)
    convert("hf-to-mcore", "--hf-dir", src, "--save", tmp_path / "mc")
    pretrain(
        1,
        "--load",
        tmp_path / "mc",
        "--finetune",
        "--use-checkpoint-args",
        "--rotary-base",
        1000000,
        "--max-position-embeddings",
        512,
        "--train-iters",
        1,
        *TRAIN,
        "--save",
        tmp_path / "run",
    )
    convert("mcore-to-hf", "--load", tmp_path / "run", "--save-hf", tmp_path / "out")
    config = AutoConfig.from_pretrained(tmp_path / "out")
    assert (
        config.rope_parameters["rope_theta"] == 1e6
        and config.rope_parameters["rope_type"] == "llama3"
    )
    assert config.max_position_embeddings == 512 and (config.bos_token_id, config.eos_token_id) == (
        7,
        9,
    )

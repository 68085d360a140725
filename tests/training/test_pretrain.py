"""`mcore-flash pretrain`: parallel layouts agree, checkpoints resume exactly, stops are clean.

Oracles: the one-process run (for TP=2 + SP, PP=2, CP=2) and the uninterrupted run (for
resume); kills, damaged checkpoints and the distributed optimizer's resharding are in
tests/training/test_fault_tolerance.py. Runs are tiny (2 layers, h 64, s 64) and read the
built-in long-range dataset.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from _support.dist_utils import run_distributed
from _support.pretrain_flags import tiny_flags

TINY = tiny_flags()


def _losses(save_dir: str) -> dict[int, float]:
    with open(os.path.join(save_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return {r["iteration"]: r["loss"] for r in records if "loss" in r}  # not validation records


def _w_pretrain(rank, world_size, argv):
    from mcore_flash.pretrain import main

    return main(argv)


def _pretrain(save_dir, *extra, world_size=1):
    argv = [*TINY, "--save", str(save_dir), *extra]
    assert run_distributed(_w_pretrain, world_size, argv, timeout=300) == [0] * world_size
    return _losses(str(save_dir))


def _w_built_in_dataset(rank, world_size, save_dir):
    """Build the built-in dataset with a slow writer; return (prefix, writes on this rank)."""
    import torch.distributed as dist

    import mcore_flash.data.synthetic as synthetic
    from mcore_flash.training.batches import _built_in_dataset

    writes, write = [], synthetic.write_synthetic_dataset

    def slow_write(*args, **kwargs):  # widen the window in which a second writer would race
        writes.append(args[0])
        time.sleep(1.0)
        return write(*args, **kwargs)

    synthetic.write_synthetic_dataset = slow_write
    prefix = _built_in_dataset(save_dir, seq_length=64, seed=5)
    dist.barrier()
    return prefix, len(writes)


def test_built_in_dataset_is_written_by_rank_0_only(tmp_path):
    """Ranks sharing --save never write the built-in dataset concurrently (CI race, stop 8)."""
    (p0, w0), (p1, w1) = run_distributed(_w_built_in_dataset, 2, str(tmp_path), timeout=120)
    assert p0 == p1 and (w0, w1) == (1, 0)
    assert os.path.getsize(p0 + ".bin") == 4096 * 64 * 2  # uint16 tokens, complete


def test_resume_matches_uninterrupted_run_and_reshards_to_tp_sp_pp_and_cp(tmp_path):
    straight = _pretrain(tmp_path / "straight", "--train-iters", "4", "--save-interval", "100")
    first = tmp_path / "resumed"
    _pretrain(first, "--train-iters", "4", "--exit-interval", "2")  # same schedule, stopped at 2
    shutil.copytree(first, tmp_path / "tp2", ignore=shutil.ignore_patterns("metrics.jsonl"))
    shutil.copytree(first, tmp_path / "pp2", ignore=shutil.ignore_patterns("metrics.jsonl"))
    shutil.copytree(first, tmp_path / "cp2", ignore=shutil.ignore_patterns("metrics.jsonl"))
    resumed = _pretrain(first, "--train-iters", "4", "--load", str(first))
    assert resumed[3] == straight[3] and resumed[4] == straight[4]  # exact, not approximate
    tp2 = _pretrain(
        tmp_path / "tp2",
        "--train-iters",
        "4",
        "--load",
        str(tmp_path / "tp2"),
        "--tensor-model-parallel-size",
        "2",
        "--sequence-parallel",
        world_size=2,
    )
    pp2 = _pretrain(
        tmp_path / "pp2",
        "--train-iters",
        "4",
        "--load",
        str(tmp_path / "pp2"),
        "--pipeline-model-parallel-size",
        "2",
        world_size=2,
    )
    cp2 = _pretrain(
        tmp_path / "cp2",
        "--train-iters",
        "4",
        "--load",
        str(tmp_path / "cp2"),
        "--context-parallel-size",
        "2",
        world_size=2,
    )
    for other in (tp2, pp2, cp2):
        assert {k: other[k] for k in (3, 4)} == pytest.approx(
            {k: straight[k] for k in (3, 4)}, abs=2e-5
        )


def _cli(*argv, cwd=None, **kwargs):
    return subprocess.run(
        [sys.executable, "-m", "mcore_flash.pretrain", *argv],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=300,
        **kwargs,
    )


def test_sigterm_saves_and_exits_cleanly(tmp_path):
    save = tmp_path / "run"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mcore_flash.pretrain",
            *TINY,
            "--save",
            str(save),
            "--train-iters",
            "100000",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 240
    for line in proc.stdout:
        if line.startswith("iteration") or time.monotonic() > deadline:
            break
    proc.send_signal(signal.SIGTERM)
    output = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, output
    assert "stopped by a signal" in output
    iteration = int((save / "latest_checkpointed_iteration.txt").read_text())
    assert 1 <= iteration < 100000 and (save / f"iter_{iteration:07d}").is_dir()


def test_nan_loss_stops_with_clear_message(tmp_path):
    result = _cli(
        *TINY, "--save", str(tmp_path), "--train-iters", "20", "--lr", "1e30", "--clip-grad", "0"
    )
    assert result.returncode == 1, result.stderr[-2000:]
    assert "training diverged" in result.stderr and "--lr" in result.stderr


PP2 = ["--pipeline-model-parallel-size", "2"]
PP2_4 = [*PP2, "--num-layers", "4"]


def test_a_loss_only_the_last_stage_sees_diverge_stops_every_stage(tmp_path, capfd):
    """At PP 2 only the last stage has the loss; the first stage must stop with it (it used
    to run on into the next iteration's send to a peer that had left)."""
    diverge = ["--train-iters", "20", "--lr", "1e30", "--clip-grad", "0"]
    argv = [*TINY, *PP2, *diverge, "--save", str(tmp_path)]
    assert run_distributed(_w_pretrain, 2, argv, timeout=120) == [1, 1]
    err = capfd.readouterr().err
    assert "loss is not finite on the last pipeline stage at iteration" in err  # stage 0
    assert re.search(r"loss is (nan|inf) at iteration", err)  # stage 1, which has it


@pytest.mark.parametrize(
    "argv,world_size,flag",
    [
        (["--tensor-model-parallel-size", "3"], 3, "--num-attention-heads"),
        (["--context-parallel-size", "3"], 3, "--seq-length"),
        (["--global-batch-size", "3"], 1, "--global-batch-size"),
        (["--lr", "0"], 1, r"--min-lr \S+ must be in \[0, --lr 0\]"),
        (["--data-path", "/nonexistent/corpus_text_document"], 1, "--data-path"),
        (["--recompute-granularity", "full"], 1, "--recompute-method"),
        (["--tensor-model-parallel-size", "2"], 3, "world size"),
        (["--window-attn-skip-freq", "2"], 1, "--window-size"),
        (["--overlap-param-gather", "--use-distributed-optimizer"], 1, "--overlap-grad-reduce"),
        (["--overlap-param-gather", "--use-megatron-fsdp"], 2, "Megatron-FSDP gathers"),
        (["--eval-interval", "2"], 1, "the built-in task has none"),
        (["--eval-interval", "2", "--data-path", "x", "--split", "100,0,0"], 1, "--split 100,0,0"),
        (
            ["--virtual-pipeline-model-parallel-size", "2"],
            1,
            "needs --pipeline-model-parallel-size > 1",
        ),
        ([*PP2, "--virtual-pipeline-model-parallel-size", "3"], 2, "does not divide the 1 layers"),
        (
            [
                *PP2_4,
                "--virtual-pipeline-model-parallel-size",
                "2",
                "--num-layers-per-virtual-pipeline-stage",
                "1",
            ],
            2,
            "exclude each other",
        ),
        (
            [*PP2_4, "--virtual-pipeline-model-parallel-size", "2", "--global-batch-size", "2"],
            2,
            "in groups of --pipeline-model-parallel-size 2",
        ),
        (
            [
                *PP2_4,
                "--num-layers-per-virtual-pipeline-stage",
                "1",
                "--activation-offload-layers",
                "1",
            ],
            2,
            "with --activation-offload-layers is not validated",
        ),
    ],
)
def test_bad_flags_fail_before_allocation(tmp_path, argv, world_size, flag):
    from mcore_flash.runtime.arguments import parse_config

    with pytest.raises(ValueError, match=flag):
        parse_config([*TINY, "--save", str(tmp_path), *argv], world_size=world_size)


def test_window_size_flags_reach_the_config(tmp_path):
    from mcore_flash.runtime.arguments import parse_config
    from mcore_flash.runtime.model import transformer_config

    args = parse_config(
        [*TINY, "--save", str(tmp_path), "--window-size", "15,0", "--window-attn-skip-freq", "2"]
    )
    config = transformer_config(args)
    assert config.window_size == (15, 0) and config.window_attn_skip_freq == 2
    with pytest.raises(SystemExit):
        parse_config([*TINY, "--save", str(tmp_path), "--window-size", "15"])


def test_config_is_frozen_and_derives_the_layout_once(tmp_path):
    """The flags are resolved once into a frozen config: 8 ranks at TP 2 x PP 2 leave DP 2,
    and a global batch of 12 in micro-batches of 3 is 2 micro-batches per DP rank; without
    --global-batch-size (and no preset's) it is one micro-batch per DP rank."""
    import dataclasses

    from mcore_flash.runtime.arguments import parse_config

    layout = [
        "--tensor-model-parallel-size",
        "2",
        "--pipeline-model-parallel-size",
        "2",
        "--micro-batch-size",
        "3",
    ]
    config = parse_config(
        [*TINY, "--save", str(tmp_path), *layout, "--global-batch-size", "12"], world_size=8
    )
    assert (config.world_size, config.data_parallel_size, config.num_micro_batches) == (8, 2, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.lr = 1.0
    llama = parse_config(["--model", "llama2-7b", "--save", str(tmp_path), *layout], world_size=8)
    assert (llama.global_batch_size, llama.num_micro_batches, llama.hidden_size) == (6, 1, 4096)


def test_tools_extending_the_parser_get_the_config_and_their_own_flags(tmp_path):
    """evaluate and generate add flags to the pretrain parser: parse_args gives them one
    namespace with the resolved config (preset filled, layout derived) and their flags."""
    from mcore_flash.runtime.arguments import build_parser, parse_args

    parser = build_parser()
    parser.add_argument("--max-new-tokens", type=int, default=32)
    argv = ["--model", "llama2-7b", "--save", str(tmp_path), "--max-new-tokens", "5"]
    args = parse_args(argv, world_size=2, parser=parser)
    assert (
        args.max_new_tokens,
        args.hidden_size,
        args.data_parallel_size,
        args.global_batch_size,
    ) == (5, 4096, 2, 2)


def test_tiny_preset_is_the_default_cpu_job(tmp_path):
    """No flags: the tiny model (2 layers, hidden 128, ffn 352, 4 heads, 2 query groups, 256
    positions, RoPE, SwiGLU) with its training schedule; a flag given overrides the preset,
    and a short run keeps 10% warm-up."""
    from mcore_flash.runtime.arguments import parse_config

    config = parse_config([], world_size=1)
    heads = (config.num_attention_heads, config.num_query_groups)
    assert (config.num_layers, config.hidden_size, config.ffn_hidden_size, *heads) == (
        2,
        128,
        352,
        4,
        2,
    )
    assert config.max_position_embeddings == 256
    assert (config.position_embedding_type, config.swiglu, config.group_query_attention) == (
        "rope",
        True,
        True,
    )
    assert (config.seq_length, config.micro_batch_size, config.global_batch_size) == (256, 8, 8)
    assert (config.train_iters, config.lr, config.min_lr, config.lr_warmup_iters) == (
        1000,
        3e-3,
        3e-4,
        30,
    )
    assert (config.save, config.save_interval) == (os.path.join("runs", "tiny"), 1000)
    short = parse_config(["--hidden-size", "64", "--train-iters", "50"], world_size=1)
    assert (short.hidden_size, short.num_layers, short.lr_warmup_iters, short.save_interval) == (
        64,
        2,
        5,
        50,
    )


def test_bad_flags_cli_message_and_unknown_preset(tmp_path):
    result = _cli(*TINY, "--save", str(tmp_path), "--global-batch-size", "3")
    assert result.returncode == 2 and "--global-batch-size" in result.stderr
    result = _cli("--model", "llama9-1t")
    assert result.returncode == 2 and "invalid choice" in result.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


def test_dry_run_llama2_70b_counts_parameters_on_meta_device():
    result = _cli(
        "--model",
        "llama2-70b",
        "--seq-length",
        "4096",
        "--tensor-model-parallel-size",
        "8",
        "--sequence-parallel",
        "--pipeline-model-parallel-size",
        "2",
        "--use-distributed-optimizer",
        "--bf16",
        "--global-batch-size",
        "64",
        "--dry-run",
        env={**os.environ, "WORLD_SIZE": "128"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "total parameters: 68,976,648,192" in result.stdout
    assert "FITS" in result.stdout  # the planner's verdict for this layout


def _recipe_dry_run(**env) -> subprocess.CompletedProcess:
    """``bash scripts/pretrain_70b.sh --dry-run`` with ``env`` added; asserts it succeeded."""
    script = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "pretrain_70b.sh")
    result = subprocess.run(
        ["bash", script, "--dry-run"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHON": sys.executable, **env},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def test_70b_recipe_script_dry_run_fits_a_910b():
    """scripts/pretrain_70b.sh --dry-run: validates the cluster flags for 256 ranks, counts
    parameters on the meta device and asks the planner whether the layout fits what torch_npu
    can allocate of a 910B (60.97 GiB) with 5% of it free."""
    result = _recipe_dry_run()
    assert "total parameters: 68,976,648,192" in result.stdout
    assert "FITS" in result.stdout and "of 60.97 GiB" in result.stdout


@pytest.mark.parametrize(
    "devices, rung, flags",
    [
        (32, "ZeRO-3", "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params"),
        (16, "offload", "--use-precision-aware-optimizer --optimizer-cpu-offload"),
        (8, "offload", "--activation-offload-layers 63 --grad-reduce-in-bf16"),
    ],
)
def test_70b_recipe_script_climbs_the_ladder_below_64_npus(devices, rung, flags):
    """NUM_DEVICES below 64: nothing fits without sharding (32) or host offload (16), so the
    script's planner layout carries those flags, the trainer's dry run accepts them for that
    many ranks, and its own plan of them fits a 910B (and, offloaded, the node's host memory)."""
    result = _recipe_dry_run(NUM_DEVICES=str(devices))
    assert f"= {devices} devices" in result.stdout and "FITS" in result.stdout
    assert f"rung {rung}" in result.stderr and flags in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("model, parameters", [("llama3.1-70b", "70,553,706,496")])
def test_70b_recipe_script_takes_the_model_of_2026_on_one_node(model, parameters):
    """MODEL=llama3.1-70b NUM_DEVICES=8: the preset's model (its vocabulary, RoPE scaling and
    Hugging Face tokenizer) with the planner's one-node layout for it, sequence tiles included,
    accepted by the trainer's dry run for 8 ranks and fitting a 910B and the node's host."""
    result = _recipe_dry_run(MODEL=model, NUM_DEVICES="8")
    assert f"total parameters: {parameters}" in result.stdout and "FITS" in result.stdout
    assert "rung offload" in result.stderr and "--loss-compute-mode chunk" in result.stdout
    assert f"--model {model}" in result.stdout


def _short_documents(tmp_path) -> str:
    """An indexed dataset of 600 documents of 2..40 bytes + EOD (many per 64-token sample)."""
    import random

    from mcore_flash.preprocess import preprocess

    rng = random.Random(3)
    source = tmp_path / "docs.jsonl"
    with open(source, "w") as f:
        for _ in range(600):
            text = "".join(rng.choice("abcdefghij ") for _ in range(rng.randint(1, 39)))
            f.write(json.dumps({"text": text}) + "\n")
    return preprocess(str(source), str(tmp_path / "short"), append_eod=True)["text"]


@pytest.mark.slow
def test_document_masking_same_losses_at_cp1_cp2_and_pp2(tmp_path):
    """--reset-attention-mask --reset-position-ids --eod-mask-loss: CP=2 (every document split
    over both ranks, padded to multiples of 4) trains exactly the curve of the one-process run;
    PP=2 (row counts vary between micro-batches: stages exchange shapes) resumed from its
    iteration-1 checkpoint continues it (a fresh PP=2 model is initialised differently)."""
    prefix = _short_documents(tmp_path)
    flags = [
        "--train-iters",
        "3",
        "--data-path",
        prefix,
        "--split",
        "100,0,0",
        "--data-cache-path",
        str(tmp_path / "cache"),
        "--reset-attention-mask",
        "--reset-position-ids",
        "--eod-mask-loss",
    ]
    one_dir = tmp_path / "one"
    _pretrain(one_dir, *flags, "--exit-interval", "1")
    shutil.copytree(one_dir, tmp_path / "pp2", ignore=shutil.ignore_patterns("metrics.jsonl"))
    one = _pretrain(one_dir, *flags, "--load", str(one_dir))
    cp2 = _pretrain(tmp_path / "cp2", *flags, "--context-parallel-size", "2", world_size=2)
    pp2 = _pretrain(
        tmp_path / "pp2",
        *flags,
        "--load",
        str(tmp_path / "pp2"),
        "--pipeline-model-parallel-size",
        "2",
        world_size=2,
    )
    plain = _pretrain(tmp_path / "plain", *flags[:8])
    assert sorted(one) == [1, 2, 3] and sorted(pp2) == [2, 3]
    assert cp2 == pytest.approx(one, abs=2e-5)
    assert pp2 == pytest.approx({k: one[k] for k in (2, 3)}, abs=2e-5)
    assert abs(plain[1] - one[1]) > 1e-3  # document masking changes the loss: the flags act


@pytest.mark.parametrize("hardware", [None, "h100-80g"])
def test_tensorboard_scalars_equal_metrics_jsonl(tmp_path, hardware):
    """--tensorboard-dir: TensorBoard's own reader finds Megatron-LM's tags, one point per
    logged iteration, with the values metrics.jsonl holds; ``mfu`` only with --hardware,
    TFLOP/s per device over the profile's BF16 peak (989 for the H100)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    extra = ["--hardware", hardware] if hardware else []
    _pretrain(
        tmp_path / "run", "--train-iters", "2", "--tensorboard-dir", str(tmp_path / "tb"), *extra
    )
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = {
        "loss": "lm loss",
        "lr": "learning-rate",
        "grad_norm": "grad-norm",
        "iteration_time_s": "iteration-time",
        "tokens_per_s": "tokens-per-second",
        "tokens_per_s_per_device": "tokens-per-second-per-device",
        "tflops_per_device": "throughput",
        "peak_memory_bytes": "mem-max-allocated-bytes",
    }
    if hardware:
        tags["mfu"] = "mfu"
        assert [r["mfu"] for r in records] == pytest.approx(
            [r["tflops_per_device"] / 989 for r in records], rel=1e-3
        )
    assert set(events.Tags()["scalars"]) == set(tags.values())
    for key, tag in tags.items():
        points = events.Scalars(tag)
        assert [p.step for p in points] == [r["iteration"] for r in records] == [1, 2]
        assert [p.value for p in points] == pytest.approx([r[key] for r in records], rel=1e-6)


def _metrics(save) -> list[dict]:
    with open(os.path.join(save, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_a_rerun_is_refused_resumes_with_load_cleans_metrics_and_says_done(tmp_path):
    """No silent overwrite: a second run into a --save that holds a run, without --load, is
    refused with both fixes; with --load it resumes, and the records a killed run logged past
    its last checkpoint are dropped from metrics.jsonl (each iteration once, in order);
    re-run once finished, it says so. The lr logged is the one the update used: linear
    warm-up over 2 iterations from 0 (megatron-core's OptimizerParamScheduler) gives 0,
    lr/2, lr."""
    save = str(tmp_path / "run")
    run = [*TINY, "--save", save, "--train-iters", "3", "--lr-warmup-iters", "2"]
    first = _cli(*run, "--save-interval", "2")
    assert first.returncode == 0, first.stderr[-2000:]
    assert first.stdout.count("done:") == 1
    assert [r["lr"] for r in _metrics(save)] == [0.0, 5e-4, 1e-3]
    trained = _metrics(save)

    again = _cli(*run)
    assert again.returncode == 2
    assert f"--save {save} holds a run already" in again.stderr
    assert f"Resume that run with --load {save}, or give this one another --save" in again.stderr
    assert _metrics(save) == trained  # nothing written

    # a kill after iteration 3 was logged but before its save finished: the tracker says 2
    with open(os.path.join(save, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("2")
    resumed = _cli(*run, "--load", save)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "dropped 1 records past iteration 2" in resumed.stderr
    records = _metrics(save)
    assert [r["iteration"] for r in records] == [1, 2, 3]
    assert records[2]["loss"] == trained[2]["loss"] and records[2]["lr"] == trained[2]["lr"]

    # finished: a re-run says so; with --use-checkpoint-args the banner names the checkpoint's
    # model (2 layers, hidden 64), not the tiny preset's (hidden 128)
    done = _cli(*run, "--load", save, "--use-checkpoint-args")
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"already done: {save} is at iteration 3 of --train-iters 3" in done.stdout
    assert (
        f"training the model of {save} (2 layers, hidden 64, --use-checkpoint-args)" in done.stderr
    )
    assert _metrics(save) == records


def test_exit_duration_in_mins_saves_and_exits_0(tmp_path):
    """--exit-duration-in-mins 0.001 (60 ms, less than the setup takes): the run stops after
    its first iteration, saves it, and exits 0 saying why."""
    save = tmp_path / "run"
    result = _cli(
        *TINY, "--save", str(save), "--train-iters", "1000", "--exit-duration-in-mins", "0.001"
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "stopped by --exit-duration-in-mins 0.001 after iteration 1" in result.stderr
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "1"


def test_document_flags_on_data_without_eod_are_refused(tmp_path):
    """--reset-attention-mask on data preprocessed without --append-eod would do nothing:
    refused, naming the fix. The data: documents of plain bytes, no EOD (id 256)."""
    from mcore_flash.preprocess import main as preprocess

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(
        "".join(json.dumps({"text": "a b c d e f g h " * 40}) + "\n" for _ in range(20))
    )
    prefix = str(tmp_path / "no_eod")
    assert preprocess(["--input", str(corpus), "--output-prefix", prefix]) == 0
    result = _cli(
        *TINY,
        "--save",
        str(tmp_path / "run"),
        "--train-iters",
        "2",
        "--data-path",
        prefix + "_text_document",
        "--split",
        "100,0,0",
        "--reset-attention-mask",
        "--reset-position-ids",
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "hold no EOD token (id 256)" in result.stderr
    assert "mcore-flash preprocess --append-eod" in result.stderr


def test_overlap_param_gather_trains_and_saves_as_the_distributed_optimizer_does(tmp_path):
    """--overlap-param-gather (the parameter all-gather moved into the next forward, by
    megatron's DDP hooks): at DP2 iterations 1-2 equal the distributed optimizer's losses
    without it, exactly, and the checkpoint it saves at 2 holds the gathered weights:
    resumed without the flag, iterations 3-4 equal the straight run's (a shard not gathered
    before the save would change them)."""
    flags = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--train-iters", "4"]
    straight = _pretrain(tmp_path / "straight", *flags, world_size=2)
    run = tmp_path / "overlap"
    first = _pretrain(run, *flags, "--overlap-param-gather", "--exit-interval", "2", world_size=2)
    assert first == {k: straight[k] for k in (1, 2)}
    resumed = _pretrain(run, *flags, "--load", str(run), world_size=2)
    assert resumed == straight


def _validation(save) -> dict[int, float]:
    return {r["iteration"]: r["validation_loss"] for r in _metrics(save) if "validation_loss" in r}


def test_validation_loss_equal_across_layouts_and_read_back_from_tensorboard(tmp_path):
    """--eval-interval 2 --eval-iters 2 on mock data (megatron's split 1,1,1), 3 iterations:
    a validation after iteration 2 and one at the end. From one checkpoint of iteration 1
    (PP initialises each stage from its own seed, as Megatron-LM, so the layouts start from
    the same weights by loading it), TP1's validation losses equal TP2 + SP's, CP2's and
    PP2's (fp32, 1e-5 relative). TensorBoard's reader finds metrics.jsonl's values under
    Megatron-LM's tags, the perplexity exp(loss)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    flags = ["--mock-data", "--train-iters", "3", "--eval-interval", "2", "--eval-iters", "2"]
    start = tmp_path / "start"
    _pretrain(start, *flags, "--exit-interval", "1")
    assert _validation(start) == {}  # iteration 1: neither a multiple of 2 nor the last
    layouts = {
        "tp1": ["--tensorboard-dir", str(tmp_path / "tb")],
        "tp2": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
        "cp2": ["--context-parallel-size", "2"],
        "pp2": ["--pipeline-model-parallel-size", "2"],
    }
    for name, layout in layouts.items():
        run = tmp_path / name
        shutil.copytree(start, run, ignore=shutil.ignore_patterns("metrics.jsonl"))
        _pretrain(run, *flags, "--load", str(run), *layout, world_size=1 if name == "tp1" else 2)
    reference = _validation(tmp_path / "tp1")
    assert list(reference) == [2, 3]
    for name in ("tp2", "cp2", "pp2"):
        assert _validation(tmp_path / name) == pytest.approx(reference, rel=1e-5), name
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    losses = events.Scalars("lm loss validation")
    assert {p.step: p.value for p in losses} == pytest.approx(reference, rel=1e-6)
    ppl = events.Scalars("lm loss validation ppl")
    assert [p.value for p in ppl] == pytest.approx([math.exp(p.value) for p in losses], rel=1e-5)

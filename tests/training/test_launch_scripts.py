"""Public Megatron-LM and MindSpeed-LLM launch scripts on `mcore-flash pretrain`, and `--load`.

The scripts' flags are verbatim: each script run through bash with ``torchrun ... pretrain_gpt.py``
replaced by ``printf '%s\\n'``, so the argv is what their ``pretrain_gpt.py`` receives (bash's
word splitting included: Megatron-LM's ``"--split '99,1,0'"`` reaches it with its quotes), and
only the paths replaced (data, tokenizer, checkpoints, caches, TensorBoard). Megatron-LM's script
takes its real-data branch (a tokenizer and data path given), MindSpeed-LLM's are as written. Each
runs at its own world size (``WORLD_SIZE=`` as the script computes it) with ``--dry-run``: as
written it stops on the flags docs/launch-scripts.md marks refused, named in the line's order,
with no argparse usage dump; without them it builds every stage's model and optimizer, each
flag the table marks as an alias or unchanged said once. The table must list every flag of
each script.

Then ``--load``: a checkpoint the flags need that is not there is refused naming the path
before anything is imported or written; the main job's ``--load runs/tiny`` starts from
scratch on a fresh machine, resumes on the second run, saves its resolved arguments, and a
resume without ``--save`` saves where it resumed from.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass

import pytest

from _support.hf_models import make_tokenized_data

DOCS = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "launch-scripts.md")


@dataclass(frozen=True)
class Script:
    """A public launch script: ``repo path @ commit``, its world size, its column in the docs
    table and its argv (``{name}`` placeholders for the paths)."""

    source: str
    commit: str
    world_size: int
    column: int
    argv: str

    def flags(self, paths: dict) -> list[str]:
        return [token.format(**paths) for token in shlex.split(self.argv)]


SCRIPTS = {
    "megatron-lm-llama3-8b": Script(
        "NVIDIA/Megatron-LM examples/llama/train_llama3_8b_h100_fp8.sh",
        "779c5b748dbcf00ad9e36d539c576b404ab4abe9",  # the file at Megatron-LM main d98e8a64
        world_size=8,  # GPUS_PER_NODE=8 x NUM_NODES=1
        column=1,
        argv="""
--use-mcore-models --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336
--num-attention-heads 32 --group-query-attention --num-query-groups 8 --kv-channels 128
--seq-length 8192 --max-position-embeddings 8192 --position-embedding-type rope
--rotary-base 1000000 --rotary-percent 1.0 --attention-dropout 0.0 --hidden-dropout 0.0
--swiglu --normalization RMSNorm --init-method-std 0.0134 --attention-backend fused
--apply-layernorm-1p --untie-embeddings-and-output-weights --disable-bias-linear
--micro-batch-size 1 --global-batch-size 128 --train-samples 1953125000
--lr-decay-samples 1949218748 --lr-warmup-samples 3906252 --lr 0.00015 --min-lr 0.00001
--decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5 --lr-decay-style cosine --clip-grad 1.0
--weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --bf16 --grad-reduce-in-bf16
--cross-entropy-loss-fusion --calculate-per-token-loss --manual-gc
--empty-unused-memory-level 1 --exit-duration-in-mins 235 --use-distributed-optimizer
--overlap-grad-reduce --overlap-param-gather --fp8-format hybrid --fp8-amax-history-len 1024
--fp8-amax-compute-algo max --fp8-param-gather --tensor-model-parallel-size 1
--context-parallel-size 1 --sequence-parallel --data-path {data}
--tokenizer-type HuggingFaceTokenizer --tokenizer-model {tokenizer}
--data-cache-path {data_cache} --split "'99,1,0'" --no-create-attention-mask-in-dataloader
--no-mmap-bin-files --num-workers 1 --vocab-size 128256 --log-interval 1 --eval-iters 32
--eval-interval 100 --save-interval 1000 --log-throughput --profile --profile-step-start 4
--profile-step-end 6 --ckpt-format torch_dist --distributed-timeout-minutes 60
--save {checkpoints} --load {checkpoints} --tensorboard-dir {tensorboard}
""",
    ),
    "mindspeed-llm-llama2-13b": Script(
        "Ascend/MindSpeed-LLM examples/mcore/llama2/pretrain_llama2_13b_ptd.sh",
        "c8f3cada817361820657d09a19ccbf97778e1c61",  # the file at MindSpeed-LLM master c77308a1
        world_size=8,  # NPUS_PER_NODE=8 x NNODES=1
        column=2,
        argv="""
--use-mcore-models --tensor-model-parallel-size 8 --pipeline-model-parallel-size 1
--sequence-parallel --num-layers 40 --hidden-size 5120 --ffn-hidden-size 13824
--num-attention-heads 40 --tokenizer-type PretrainedFromHF
--tokenizer-name-or-path {tokenizer} --seq-length 4096 --max-position-embeddings 4096
--micro-batch-size 4 --global-batch-size 512 --make-vocab-size-divisible-by 1 --lr 1e-6
--train-iters 5000 --lr-decay-style cosine --untie-embeddings-and-output-weights
--disable-bias-linear --attention-dropout 0.0 --init-method-std 0.01 --hidden-dropout 0.0
--position-embedding-type rope --normalization RMSNorm --use-fused-rmsnorm --swiglu
--use-flash-attn --no-masked-softmax-fusion --attention-softmax-in-fp32 --min-lr 1e-8
--weight-decay 1e-1 --lr-warmup-fraction 0.01 --clip-grad 1.0 --adam-beta1 0.9
--initial-loss-scale 4096 --adam-beta2 0.95 --no-gradient-accumulation-fusion --load {load}
--no-load-optim --no-load-rng --use-fused-swiglu --use-fused-rotary-pos-emb --bf16
--ckpt-format torch --data-path {data} --handler-name GeneralPretrainHandler
--split 949,50,1 --log-interval 1 --save-interval 10000 --eval-interval 1000 --eval-iters 10
--enable-hf2mg-convert --model-type-hf llama2 --distributed-backend nccl --save {save}
--transformer-impl local
""",
    ),
    "mindspeed-llm-llama31-8b-128k": Script(
        "Ascend/MindSpeed-LLM examples/mcore/llama31/pretrain_llama31_8b_128k_ptd.sh",
        # its last version: the file was removed in 331add6b ("Model Sunset Plan II")
        "dfe2e3b0040acc4beb81d7cf48553ff14a8a7390",
        world_size=32,  # NPUS_PER_NODE=8 x NNODES=4
        column=3,
        argv="""
--tensor-model-parallel-size 8 --pipeline-model-parallel-size 1 --use-mcore-models
--context-parallel-size 4 --context-parallel-algo megatron_cp_algo
--no-create-attention-mask-in-dataloader --no-shared-storage --sparse-mode 2
--micro-batch-size 1 --global-batch-size 32 --sequence-parallel --use-flash-attn
--use-rotary-position-embeddings --use-fused-rmsnorm --use-fused-swiglu
--rope-scaling-type llama3 --rope-scaling-factor 8.0 --low-freq-factor 1.0
--high-freq-factor 4.0 --original-max-position-embeddings 8192
--tokenizer-type PretrainedFromHF --tokenizer-name-or-path {tokenizer} --num-layers 32
--hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 --group-query-attention
--num-query-groups 8 --seq-length 131072 --max-position-embeddings 131072
--make-vocab-size-divisible-by 1 --padded-vocab-size 128256
--untie-embeddings-and-output-weights --disable-bias-linear --attention-dropout 0.0
--init-method-std 0.01 --hidden-dropout 0.0 --position-embedding-type rope
--rotary-base 500000 --normalization RMSNorm --norm-epsilon 1e-5 --swiglu
--no-masked-softmax-fusion --attention-softmax-in-fp32 --lr 1.25e-6 --train-iters 2000
--lr-decay-style cosine --min-lr 1.25e-7 --weight-decay 1e-1 --lr-warmup-fraction 0.01
--clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95 --initial-loss-scale 4096
--no-gradient-accumulation-fusion --no-load-optim --no-load-rng --bf16 --data-path {data}
--split 100,0,0 --log-interval 1 --save-interval 2000 --eval-interval 2000 --eval-iters 0
--distributed-backend nccl --load {load} --save {save} --transformer-impl local
""",
    ),
}
OUTCOMES = ("ours", "ours, noted", "alias", "unchanged", "refused")


def _pretrain(argv, env=None, cwd=None, timeout=300) -> subprocess.CompletedProcess:
    """``mcore-flash pretrain ARGV`` in a fresh process (``env``: added to the environment)."""
    return subprocess.run(
        [sys.executable, "-m", "mcore_flash.pretrain", *map(str, argv)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict:
    """What the scripts' paths point at: a Hugging Face tokenizer directory, data tokenized
    with it, and a checkpoint stand-in for MindSpeed-LLM's ``--load`` (their ``--no-load-optim``
    needs a checkpoint there; the dry run reads none of it: a tracker and its directory)."""
    root = tmp_path_factory.mktemp("launch_scripts")
    made = make_tokenized_data(root)
    os.makedirs(root / "load" / "iter_0000001")
    (root / "load" / "latest_checkpointed_iteration.txt").write_text("1")
    return {
        **made,
        "load": str(root / "load"),
        **{name: str(root / name) for name in ("save", "checkpoints", "tensorboard", "data_cache")},
    }


def _docs_table() -> dict[str, tuple[str, ...]]:
    """``{flag: (outcome in each script's column, "" where the script has no such flag)}`` of
    docs/launch-scripts.md's table."""
    rows = {}
    with open(DOCS) as f:
        for line in f:
            match = re.match(r"\| `(--[\w-]+)[^`]*` \|(.*)", line)
            if match:
                cells = [cell.strip() for cell in match.group(2).split("|")]
                rows[match.group(1)] = ("", *cells[:3])
    return rows


def _without(argv: list[str], flags: list[str]) -> list[str]:
    """``argv`` less ``flags`` and their values (the next token where it is no flag)."""
    kept, skip = [], False
    for token in argv:
        if skip and not token.startswith("--"):
            skip = False
            continue
        skip = token in flags
        if not skip:
            kept.append(token)
    return kept


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_public_script_builds_or_stops_on_the_flags_the_docs_refuse(paths, name):
    script = SCRIPTS[name]
    argv = script.flags(paths)
    table = _docs_table()
    flags = list(dict.fromkeys(token for token in argv if token.startswith("--")))
    missing = [flag for flag in flags if not table.get(flag, ("",) * 4)[script.column]]
    assert missing == [], f"docs/launch-scripts.md lists no outcome for {missing} in {name}"
    outcome = {flag: table[flag][script.column] for flag in flags}
    assert set(outcome.values()) <= set(OUTCOMES), outcome
    refused = [flag for flag in flags if outcome[flag] == "refused"]
    env = {"WORLD_SIZE": str(script.world_size)}

    as_written = _pretrain([*argv, "--dry-run"], env)
    assert as_written.returncode == 2, as_written.stdout[-2000:] + as_written.stderr[-2000:]
    assert "usage:" not in as_written.stderr and as_written.stdout == ""
    named = re.findall(r"^  (--[\w-]+)", as_written.stderr, re.M)
    assert named == refused, as_written.stderr  # each by name, in the line's order

    built = _pretrain([*_without(argv, refused), "--dry-run"], env)
    out = built.stdout
    assert built.returncode in (0, 1), out[-3000:] + built.stderr[-3000:]  # 1: the plan's "no"
    assert "pipeline stage 0:" in out and "built for training" in out
    assert "------------------------ arguments ------------------------" in out
    notes = [line for line in built.stderr.splitlines() if line.startswith("[mcore-flash] ")]
    assert len(notes) == len(set(notes))
    said = [flag for flag in flags if outcome[flag] not in ("ours", "refused")]
    assert [flag for flag in said if not any(f" {flag} " in note for note in notes)] == [], notes


_IMPORTS_NOTHING = """
import sys
from mcore_flash.pretrain import main
code = main(sys.argv[1:])
heavy = sorted({m.split(".")[0] for m in sys.modules} & {"torch", "megatron"})
print("exit", code, "heavy", ",".join(heavy) or "none", file=sys.stderr)
"""


@pytest.mark.parametrize(
    "flags", [["--finetune"], ["--no-load-optim"], ["--use-checkpoint-args", "--finetune"]]
)
def test_a_load_the_flags_need_a_checkpoint_in_is_refused_naming_it(tmp_path, flags):
    """A typo in --load with --finetune, --no-load-optim or --use-checkpoint-args: exit code 2
    naming the path, before torch or megatron is imported and before anything is written (it
    used to train from random weights and exit 0)."""
    missing, save = tmp_path / "missing", tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-c", _IMPORTS_NOTHING, *flags, "--load", missing, "--save", save],
        capture_output=True,
        text=True,
        timeout=120,
    )
    err = result.stderr
    assert err.splitlines()[-1] == "exit 2 heavy none", err
    assert f"--load {missing}" in err and not save.exists()
    assert "does not exist" in err or "no latest_checkpointed_iteration.txt" in err


def test_the_main_jobs_command_starts_fresh_resumes_and_a_resume_saves_into_load(tmp_path):
    """``mcore-flash pretrain --load runs/tiny`` (the README's main job, 2 and then 4
    iterations): on a fresh machine it starts from scratch and says so, the second run resumes
    it; each writes its resolved arguments into runs/tiny/arguments.txt. Resuming a copy
    without --save saves into the copy (not runs/tiny, the preset's directory)."""
    tracker = "latest_checkpointed_iteration.txt"
    first = _pretrain(["--load", "runs/tiny", "--train-iters", 2], cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "no checkpoint in --load runs/tiny yet: starting from scratch" in first.stderr
    assert (tmp_path / "runs/tiny" / tracker).read_text().strip() == "2"
    saved = (tmp_path / "runs/tiny/arguments.txt").read_text()
    assert saved.startswith("------------------------ arguments ------------------------\n")
    assert "  train_iters " + "." * 37 + " 2\n" in saved and saved in first.stdout

    second = _pretrain(["--load", "runs/tiny", "--train-iters", 4], cwd=tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from runs/tiny at iteration 2" in second.stderr
    assert (tmp_path / "runs/tiny" / tracker).read_text().strip() == "4"
    assert (
        "  train_iters " + "." * 37 + " 4\n" in (tmp_path / "runs/tiny/arguments.txt").read_text()
    )

    shutil.copytree(tmp_path / "runs/tiny", tmp_path / "copy")
    third = _pretrain(["--load", "copy", "--train-iters", 6], cwd=tmp_path)
    assert third.returncode == 0, third.stderr[-3000:]
    assert "resumed from copy at iteration 4" in third.stderr
    assert (tmp_path / "copy" / tracker).read_text().strip() == "6"
    assert (tmp_path / "runs/tiny" / tracker).read_text().strip() == "4"

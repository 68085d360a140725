"""The NPU rehearsal: `mcore-flash pretrain --emulate-npu` under torchrun, against the CPU path.

Each layout runs twice through the real launcher (``python -m torch.distributed.run``): on
the emulated Ascend device (npu tensors, HCCL-strict groups, the torch_npu doubles,
transfer_to_npu) and on the CPU path (gloo). The oracle is the CPU run: fp32 losses and
gradient norms agree to 1e-5 relative (the doubles compute in float64/float32 where the
CPU path runs torch's fused CPU kernel), bf16 to 1e-3 relative (the doubles round their
float64 result to bf16 once; the CPU kernels accumulate differently). Every emulated rank
also reports which torch_npu ops ran in which layout and which inputs a kernel would
have had to copy first: Megatron -> NPU must need none.

Tiny model (2 layers, h 64, s 64), 3-4 iterations per run.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

from _support.pretrain_flags import tiny_flags

TINY = tiny_flags()
WORKER = os.path.join(os.path.dirname(__file__), "..", "_support", "rehearsal_worker.py")

LAYOUTS = {
    # name: (processes, flags)
    "tp2-sp-dp2-distopt-attention-recompute": (
        4,
        [
            "--tensor-model-parallel-size",
            "2",
            "--sequence-parallel",
            "--use-distributed-optimizer",
            "--recompute-granularity",
            "selective",
            "--recompute-modules",
            "core_attn",
        ],
    ),
    "cp2-p2p-recompute-core_attn-layernorm-mlp": (
        2,
        [
            "--context-parallel-size",
            "2",
            "--recompute-granularity",
            "selective",
            "--recompute-modules",
            "core_attn",
            "layernorm",
            "mlp",
        ],
    ),
    "cp2-a2a": (2, ["--context-parallel-size", "2", "--cp-comm-type", "a2a"]),
    "pp2-bf16": (2, ["--pipeline-model-parallel-size", "2", "--bf16"]),
    "dp2-zero3": (2, ["--use-megatron-fsdp"]),
}


def torchrun(
    nproc: int, argv: list[str], script: str | None = None, timeout: int = 420
) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run --standalone`` on 127.0.0.1 (its store binds a free port
    itself): ``mcore_flash.pretrain`` or ``script``."""
    target = [script] if script else ["-m", "mcore_flash.pretrain"]
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--local-addr",
        "127.0.0.1",
        "--nproc-per-node",
        str(nproc),
        *target,
        *argv,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)


def pretrain(nproc: int, save, *flags) -> dict:
    """Run the trainer; returns ``{iteration: (loss, grad_norm)}`` and the emulated ranks' reports."""
    result = torchrun(nproc, [*TINY, "--save", str(save), *flags])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    with open(os.path.join(save, "metrics.jsonl")) as f:
        metrics = {r["iteration"]: (r["loss"], r["grad_norm"]) for r in map(json.loads, f)}
    reports = []
    for path in sorted(glob.glob(os.path.join(save, "emulated_npu_rank*.json"))):
        with open(path) as f:
            reports.append(json.load(f))
    return {"metrics": metrics, "reports": reports, "stdout": result.stdout}


# CI's Python 3.12 job runs one layout (tests/conftest.py: slow)
ON_BOTH_VERSIONS = "cp2-p2p-recompute-core_attn-layernorm-mlp"


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(name, marks=() if name == ON_BOTH_VERSIONS else pytest.mark.slow)
        for name in sorted(LAYOUTS)
    ],
)
def layout_runs(request, tmp_path_factory):
    nproc, flags = LAYOUTS[request.param]
    root = tmp_path_factory.mktemp(request.param)
    iters = ["--train-iters", "3"]
    npu = pretrain(nproc, root / "npu", *iters, *flags, "--emulate-npu")
    cpu = pretrain(nproc, root / "cpu", *iters, *flags)
    return request.param, nproc, npu, cpu


def test_emulated_npu_training_matches_the_cpu_path(layout_runs):
    name, _, npu, cpu = layout_runs
    assert npu["metrics"].keys() == cpu["metrics"].keys() == {1, 2, 3}
    rel = 1e-3 if "bf16" in name else 1e-5
    for iteration, (loss, grad_norm) in cpu["metrics"].items():
        assert npu["metrics"][iteration] == pytest.approx((loss, grad_norm), rel=rel), iteration


def test_every_rank_ran_the_npu_kernels_without_layout_copies(layout_runs):
    name, nproc, npu, _ = layout_runs
    assert len(npu["reports"]) == nproc
    for rank, report in enumerate(npu["reports"]):
        assert report["device"] == f"npu:{rank}"  # platform.setup bound rank r to npu:LOCAL_RANK
        calls = report["op_calls"]
        assert (
            calls.get("npu_fusion_attention[SBH]", 0) > 0
            and calls.get("npu_fusion_attention_grad[SBH]", 0) > 0
        )
        assert set(calls) <= {
            "npu_fusion_attention[SBH]",
            "npu_fusion_attention_grad[SBH]",
            "npu_rms_norm",
            "npu_swiglu",
        }
        assert calls.get("npu_rms_norm", 0) > 0 and calls.get("npu_swiglu", 0) > 0, calls
        assert report["inputs_the_kernels_would_copy"] == {}, (name, rank)
        assert report["peak_memory_allocated_bytes"] > 0
    assert "inputs the kernels would copy" in npu["stdout"]


@pytest.mark.slow
def test_emulated_checkpoint_resumes_exactly(tmp_path):
    """Save at iteration 2 on the emulated device, resume: iterations 3-4 equal an
    uninterrupted emulated run bit for bit (model, Adam state, scheduler, device RNG)."""
    flags = ["--train-iters", "4", "--use-distributed-optimizer", "--emulate-npu"]
    straight = pretrain(2, tmp_path / "straight", *flags)["metrics"]
    pretrain(2, tmp_path / "resumed", *flags, "--exit-interval", "2")
    resumed = pretrain(2, tmp_path / "resumed", *flags, "--load", str(tmp_path / "resumed"))[
        "metrics"
    ]
    assert resumed[3] == straight[3] and resumed[4] == straight[4]


def test_a_cpu_tensor_in_a_trainer_collective_fails_the_rehearsal(tmp_path):
    """Defect 1 of issue 10, planted back: the SIGTERM flag all-reduced as a CPU tensor.
    The CPU path cannot see it (gloo takes CPU tensors); the rehearsal must."""
    argv = ["--plant-cpu-collective", *TINY, "--train-iters", "2"]
    cpu = torchrun(2, [*argv, "--save", str(tmp_path / "cpu")], script=WORKER)
    assert cpu.returncode == 0, cpu.stderr[-3000:]
    npu = torchrun(2, [*argv, "--save", str(tmp_path / "npu"), "--emulate-npu"], script=WORKER)
    assert npu.returncode != 0
    assert "No backend type associated with device type cpu" in npu.stderr


RECIPE_SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "pretrain_70b.sh")


def rehearse_recipe(save, *flags, **env) -> str:
    """``bash scripts/pretrain_70b.sh --rehearse`` into ``save`` with ``env`` added; asserts it
    succeeded and returns its output (progress on stdout, the [mcore-flash] notes on stderr)."""
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "REHEARSAL_SAVE": str(save),
        "PYTHONWARNINGS": "ignore",
        **env,
    }
    result = subprocess.run(
        ["bash", RECIPE_SCRIPT, "--rehearse", *flags],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result.stdout + result.stderr


def rank_reports(save, ranks: int = 8) -> list[dict]:
    """The emulated ranks' rehearsal reports, each checked: rank r drove npu:r, no layout copies."""
    reports = []
    for rank in range(ranks):
        with open(save / f"emulated_npu_rank{rank:05d}.json") as f:
            report = json.load(f)
        assert report["device"] == f"npu:{rank}" and report["inputs_the_kernels_would_copy"] == {}
        reports.append(report)
    return reports


@pytest.mark.slow
def test_70b_recipe_script_rehearses_on_8_emulated_npus(tmp_path):
    """scripts/pretrain_70b.sh --rehearse as a continued-pretraining run: HF_CHECKPOINT (a
    tiny random Llama of the rehearsal's shape) is converted once, then trained with
    --finetune and the recipe's flags (TP + SP, PP, CP ring, the distributed optimizer with
    overlapped reduction, bf16, ABF RoPE, the npu attention backend, document masking: packed
    TND batches split over CP) and RECOMPUTE=qkv (the planner's recipe runs without recompute)
    with every parallel size halved, on 8 emulated NPUs; launched again, it resumes from
    $SAVE instead."""
    from _support.hf_models import make_hf_llama

    hf_dir = make_hf_llama(tmp_path / "hf", vocab=258, hidden=64, ffn=176, layers=4)
    save = tmp_path / "run"
    env = {"HF_CHECKPOINT": hf_dir, "RECOMPUTE": "qkv"}
    output = rehearse_recipe(save, **env)
    assert "(TP 2, PP 2, CP 2, DP 1)" in output and "iteration 2/2" in output
    assert f"fine-tuning from {save}/hf_converted at iteration 0" in output
    for report in rank_reports(save):  # DOCUMENT_MASKING=1: packed
        assert report["op_calls"]["npu_fusion_attention_grad[TND]"] > 0

    output = rehearse_recipe(save, "--train-iters", "3", **env)
    assert f"resumed from {save} at iteration 2" in output and "iteration 3/3" in output


@pytest.mark.slow
def test_70b_recipe_script_rehearses_zero3_on_8_emulated_npus(tmp_path):
    """SHARDING=optim_grads_params (what the planner picks below 64 NPUs): the recipe's flags
    with Megatron-FSDP sharding over DP2 x CP2 (TP2 + SP, document masking, bf16, the npu
    attention backend) on 8 emulated NPUs: every FSDP all-gather and reduce-scatter goes
    through the HCCL-strict groups, and the run saves its checkpoint."""
    save = tmp_path / "run"
    output = rehearse_recipe(save, SHARDING="optim_grads_params")
    assert "(TP 2, PP 1, CP 2, DP 2)" in output and "iteration 2/2" in output
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "2"
    rank_reports(save)


@pytest.mark.slow
def test_70b_recipe_script_rehearses_the_streamed_plan_on_8_emulated_npus(tmp_path):
    """NUM_DEVICES=4 (nodes of 4): nothing below the ladder's top rung holds Llama-2-70B at 128K
    on 4 NPUs, so the plan streams the weights (--use-torch-fsdp2 --fsdp2-offload-to-cpu, no
    distributed optimizer); its flags run on 8 emulated NPUs (TP2 x CP2 x DP2: FSDP2 does not
    pipeline), and every rank's weights and Adam state are on the host, in fp32."""
    save = tmp_path / "run"
    output = rehearse_recipe(save, NUM_DEVICES="4", NPUS_PER_NODE="4")
    assert "rung streaming" in output and "iteration 2/2" in output
    assert "use_torch_fsdp2 ................................. True" in output
    assert "use_distributed_optimizer ....................... False" in output
    for report in rank_reports(save):
        assert report["model_state_bytes"].keys() == {"cpu"}, report
        assert report["model_state_bytes"]["cpu"].keys() == {"torch.float32"}, report
        assert report["optimizer_state_bytes"].keys() == {"cpu"}, report
        assert report["optimizer_state_bytes"]["cpu"].keys() == {"torch.float32"}, report


@pytest.mark.slow
def test_70b_recipe_script_rehearses_the_one_node_plan_on_8_emulated_npus(tmp_path):
    """NUM_DEVICES=8 on nodes of HOST_MEMORY=1.2TB: the planner's one-node layout needs host
    offload (rung 4) and, the host too small for fp32 optimizer state, bf16 host moments; the
    recipe's flags with it (the optimizer state on the host with bf16 moments, bf16 gradients,
    activation offload, full recompute) run on 8 emulated NPUs, and every rank's optimizer state
    is where the plan puts it: all of it on the host, the fp32 master copy and the two bf16
    moments of equal bytes (4 and 2 + 2 per element)."""
    save = tmp_path / "run"
    output = rehearse_recipe(save, NUM_DEVICES="8", HOST_MEMORY="1.2TB")
    assert "rung offload" in output and "iteration 2/2" in output
    plan = subprocess.run(
        [sys.executable, "-m", "mcore_flash.planning.cli", "--search", "--model", "llama2-70b"]
        + ["--seq-length", "131072", "--num-devices", "8"]
        + ["--hardware", "ascend-910b-64g", "--global-batch-size", "32", "--top", "1", "--json"]
        + ["--host-memory", "1.2TB"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    layout = json.loads(plan.stdout)["layouts"][0]["layout"]
    assert layout["optimizer_offload_fraction"] == 1.0
    assert layout["host_moment_dtype"] == "bf16"
    for report in rank_reports(save):
        assert report["optimizer_state_bytes"].keys() == {"cpu"}, report
        by_dtype = report["optimizer_state_bytes"]["cpu"]
        assert by_dtype.keys() == {"torch.float32", "torch.bfloat16"}, report
        assert by_dtype["torch.float32"] == by_dtype["torch.bfloat16"], report

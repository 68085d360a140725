"""The device as it really is: the capacity the framework allocates, the headroom every verdict
keeps, the limits a planned launch carries (pure Python, fast).

Oracles: the capacities torch and torch_npu print in their out-of-memory messages (the
profiles' sources), arithmetic on the plan's own total, and the step time's breakdown added
up by hand.
"""

from __future__ import annotations

import json
import math
import re

import pytest

from mcore_flash.planning.cli import main as plan_main
from mcore_flash.planning.hardware import HARDWARE_PROFILES

GiB = 2**30
# a layout that fits one 910B: Llama-3.2-1B at 4K tokens
SMALL = "--model llama3.2-1b --seq-length 4096 --tp 1 --num-devices 1 --recompute full".split()


@pytest.mark.parametrize(
    "name,reported,source",
    [
        ("ascend-910b-64g", 60.97, "60.97 GiB total capacity"),
        ("h100-80g", 79.11, "total capacity of 79.11 GiB"),
        ("h200-141g", 139.80, "total capacity of 139.80 GiB"),
    ],
)
def test_profiles_hold_the_capacity_torch_reports_beside_the_datasheets_hbm(name, reported, source):
    profile = HARDWARE_PROFILES[name]
    assert round(profile.capacity / GiB, 2) == reported < profile.hbm_bytes / GiB
    assert source in profile.sources["capacity_bytes"]


def _json(capsys, argv) -> tuple[int, dict]:
    code = plan_main([*argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_the_default_device_memory_is_the_profiles_capacity(capsys):
    code, out = _json(capsys, SMALL)
    assert code == 0 and out["device_memory_bytes"] == HARDWARE_PROFILES["ascend-910b-64g"].capacity
    assert plan_main(SMALL) == 0
    assert " of 60.97 GiB per device" in capsys.readouterr().out


def test_a_plan_fits_only_with_min_free_memory_left(capsys):
    """Oracle: the plan's total. A device with 1% of it to spare does not fit under the
    default 5% headroom, fits with --min-free-memory 0 or 1%-less, and the default headroom is
    5% of the device memory."""
    _, out = _json(capsys, SMALL)
    total = out["total_bytes_per_device"]
    memory = int(total * 1.01)
    argv = [*SMALL, "--device-memory", str(memory)]
    code, tight = _json(capsys, argv)
    assert code == 1 and tight["fits"] is False
    assert tight["min_free_memory_bytes"] == int(0.05 * memory)
    assert tight["headroom_bytes"] == memory - total > 0
    for free in ("0", f"{memory - total}B", "0.9%"):
        code, roomy = _json(capsys, [*argv, "--min-free-memory", free])
        assert code == 0 and roomy["fits"] is True, free
    assert plan_main(argv) == 1
    assert re.search(r"DOES NOT FIT: .* free; at least .* to keep free", capsys.readouterr().out)


def test_search_offers_only_layouts_that_keep_the_headroom(capsys):
    argv = "--search --model llama2-13b --seq-length 32768 --num-devices 8 --top 1000".split()
    _, kept = _json(capsys, argv)
    _, all_of_it = _json(capsys, [*argv, "--min-free-memory", "0"])
    assert kept["layouts"] and all(
        lay["headroom_bytes"]
        >= lay["min_free_memory_bytes"]
        == int(0.05 * lay["device_memory_bytes"])
        for lay in kept["layouts"]
    )
    assert kept["num_fitting"] < all_of_it["num_fitting"]  # some layouts leave less than 5%


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--min-free-memory=-1GiB"], "--min-free-memory -1GiB: give a size"),
        (["--min-free-memory", "100%"], "--min-free-memory 100%: give a size"),
        (["--min-free-memory", "lots"], "--min-free-memory lots: give a size"),
        (["--hccl-buffsize", "0"], "--hccl-buffsize 0: HCCL_BUFFSIZE is a positive number of MB"),
        (["--hccl-buffsize", "40000"], "--hccl-buffsize 40000: HCCL_BUFFSIZE is a positive"),
        (
            ["--hardware", "h100-80g", "--hccl-buffsize", "200"],
            "--hccl-buffsize: --hardware h100-80g does not use HCCL",
        ),
        (["--device-memory", "80GB"], "--device-memory 80GB: must be positive and at most the HBM"),
        (["--device-memory", "0"], "--device-memory 0: must be positive"),
    ],
)
def test_bad_capacity_flags_name_the_flag(capsys, flags, message):
    assert plan_main([*SMALL, *flags]) == 2
    assert message in capsys.readouterr().err


def test_the_one_node_launch_carries_limits_above_its_longest_phase(capsys):
    """Oracle: the step's breakdown by hand. The one-node Llama-2-70B layout steps its 32
    micro-batches one after another, so one micro-batch's forward and backward is the step's
    time less its once-per-step host optimizer step and copies, over 32; the watchdog's limit
    covers 3 times that (at least Megatron-LM's 10 minutes) and HCCL's is a multiple of 68 s
    between that phase and a minute below the watchdog."""
    argv = "--search --model llama2-70b --seq-length 131072 --num-devices 8 --top 1".split()
    _, out = _json(capsys, argv)
    [best] = out["layouts"]
    breakdown = best["step_time"]["breakdown_s"]
    per_step = breakdown["host_optimizer_step"] + breakdown["optimizer_offload_copies"]
    micro_batch = (best["step_time"]["step_time_s"] - per_step) / 32
    assert best["timeouts"]["longest_phase_s"] == pytest.approx(micro_batch, rel=1e-9)
    minutes = int(best["launch_command"].split("--distributed-timeout-minutes ")[1].split()[0])
    assert minutes * 60 >= max(600, 3 * micro_batch)
    hccl = int(best["launch_env"]["HCCL_EXEC_TIMEOUT"])
    assert hccl % 68 == 0 and micro_batch < hccl <= minutes * 60 - 60


SLOW = pytest.mark.slow  # a search each, about 10 s: two of them run in py312 too


@pytest.mark.parametrize(
    "devices",
    [pytest.param(8, marks=SLOW), pytest.param(16, marks=SLOW), 32]
    + [pytest.param(64, marks=SLOW), pytest.param(128, marks=SLOW), 256],
)
def test_every_llama31_70b_launch_line_at_128k_carries_limits_above_its_longest_phase(
    capsys, devices
):
    """Each printed line's --distributed-timeout-minutes and HCCL_EXEC_TIMEOUT exceed the
    predicted longest phase (8 NPUs print lines too since the search tiles the loss: one node
    at 128K fits with --loss-compute-mode chunk, tests/planning/test_tiling_plan.py)."""
    argv = f"--search --model llama3.1-70b --seq-length 131072 --num-devices {devices} --top 5"
    _, out = _json(capsys, argv.split())
    assert out["layouts"]
    for layout in out["layouts"]:
        command = layout["launch_command"]
        minutes = float(command.split("--distributed-timeout-minutes ")[1].split()[0])
        longest = layout["timeouts"]["longest_phase_s"]
        assert minutes * 60 > longest < int(layout["launch_env"]["HCCL_EXEC_TIMEOUT"])


@pytest.mark.parametrize("pp", [1, 2])
def test_a_phase_longer_than_hccl_can_wait_is_refused_only_across_pipeline_stages(pp):
    """A 19179 s micro-batch (a 64-NPU streamed layout at 8.9M tokens): the watchdog's limit is
    3 x the phase; HCCL can wait 17340 s at most. A pipeline receive waits for the previous
    stage's whole micro-batch, so with stages the layout is refused; without them no
    collective waits a phase, and HCCL's limit is its largest."""
    from types import SimpleNamespace

    from mcore_flash.planning.hardware import HARDWARE_PROFILES
    from mcore_flash.planning.timeouts import run_timeouts

    step = SimpleNamespace(
        longest_phase_s=19179.0,
        hardware=HARDWARE_PROFILES["ascend-910b-64g"],
        layout=SimpleNamespace(pp=pp),
    )
    if pp > 1:
        with pytest.raises(ValueError, match="HCCL_EXEC_TIMEOUT can wait"):
            run_timeouts(step)
        return
    limits = run_timeouts(step)
    assert limits.distributed_timeout_minutes == math.ceil(3 * 19179 / 60)
    assert limits.hccl_exec_timeout_s == 17340

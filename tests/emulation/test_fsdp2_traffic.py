"""DRAFT"""

from __future__ import annotations

import contextlib
import math
from dataclasses import replace

import pytest

from _support.dist_utils import run_distributed
from _support.models import TINY_TEST

MODEL = replace(TINY_TEST, vocab_size=384)
SEQ = 64
DP = 2
STEPS = 4
MEASURED_STEP = 2
FLAGS = [
    *("--num-layers", str(MODEL.num_layers), "--hidden-size", str(MODEL.hidden_size)),
    *("--ffn-hidden-size", str(MODEL.ffn_hidden_size)),
    *("--num-attention-heads", str(MODEL.num_attention_heads)),
    *("--num-query-groups", str(MODEL.num_query_groups)),
    *("--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ)),
    *("--micro-batch-size", "1", "--global-batch-size", "4", "--lr", "1e-3"),
    *("--lr-warmup-iters", "1", "--train-iters", str(STEPS), "--log-interval", "1"),
    *("--make-vocab-size-divisible-by", "128", "--untie-embeddings-and-output-weights"),
    *("--use-torch-fsdp2", "--fsdp2-offload-to-cpu", "--bf16"),
]


class _Traffic:
    on = False
    stack: list = []
    micro = 0
    events: list = []


def _transfer(func, args, kwargs, npu_type):
    import torch

    aten = torch.ops.aten
    if func is aten._to_copy.default:
        src, target = args[0], kwargs.get("device")
        if target is None:
            return None
        to_npu = torch.device(target).type == "npu"
        if isinstance(src, npu_type) == to_npu:
            return None
        dtype = kwargs.get("dtype") or src.dtype
        return ("up" if to_npu else "down", src.dtype, dtype, src.numel() * dtype.itemsize)
    if func in (aten.copy_.default,):
        dst, src = args[0], args[1]
        if not isinstance(src, torch.Tensor) or isinstance(dst, npu_type) == isinstance(
            src, npu_type
        ):
            return None
        return (
            "up" if isinstance(dst, npu_type) else "down",
            src.dtype,
            dst.dtype,
            dst.numel() * dst.element_size(),
        )
    if func is aten._local_scalar_dense.default:
        return ("down", args[0].dtype, args[0].dtype, args[0].element_size())
    if func.__name__.startswith("_copy_from"):
        raise AssertionError(f"uncounted {func}")
    return None


def _install():
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group_module

    from mcore_flash.emulation import tensor as emulated

    npu_type = emulated.NpuTensor
    dispatch = npu_type.__dict__["__torch_dispatch__"].__func__

    def counted(cls, func, types, args=(), kwargs=None):
        if _Traffic.on:
            moved = _transfer(func, args, kwargs or {}, npu_type)
            if moved is not None:
                if _Traffic.stack:
                    phase = _Traffic.stack[0][0]
                    unit = _Traffic.stack[-1][1]._module_fqn
                else:
                    import sys
                    f = sys._getframe(1)
                    where = []
                    while f is not None and len(where) < 3:
                        fn = f.f_code.co_filename
                        if ("mcore_flash" in fn or "megatron" in fn) and "test_fsdp2" not in fn:
                            where.append(f"{fn.split('site-packages/')[-1].replace('/work/main/','')}:{f.f_lineno}")
                        f = f.f_back
                    phase, unit = "other", str(func).split(".")[1] + " " + " < ".join(where)
                _Traffic.events.append((_Traffic.micro, phase, unit, *moved))
        return dispatch(cls, func, types, args, kwargs)

    npu_type.__torch_dispatch__ = classmethod(counted)

    def wrapped(name):
        original = getattr(group_module.FSDPParamGroup, name)

        def method(self, *args, **kwargs):
            if name == "pre_forward" and self._module_fqn == "":
                _Traffic.micro += 1
            _Traffic.stack.append((name, self))
            try:
                return original(self, *args, **kwargs)
            finally:
                _Traffic.stack.pop()

        setattr(group_module.FSDPParamGroup, name, method)

    for name in ("unshard", "pre_forward", "pre_backward", "post_backward", "finalize_backward"):
        wrapped(name)


def _w_measure(rank, world_size, root):
    from megatron.core import parallel_state

    from mcore_flash.runtime import distributed
    from mcore_flash.runtime.arguments import parse_config
    from mcore_flash.training import loop

    _install()
    out = {}
    for name in ("fp32",):
        config = parse_config([*FLAGS, "--save", f"{root}/{name}"], world_size=world_size)
        distributed.init_distributed(config)
        recipe = loop.PretrainRecipe(config)
        try:
            steps = []
            for step in range(1, STEPS + 1):
                _Traffic.events, _Traffic.micro, _Traffic.on = [], 0, True
                steps.append(recipe.train_step()[:2])
                _Traffic.on = False
                if step == MEASURED_STEP:
                    events = list(_Traffic.events)
                else:
                    print(rank, step, len(_Traffic.events))
            out[name] = dict(steps=steps, events=events)
        finally:
            recipe.cleanup()
            parallel_state.destroy_model_parallel()
            del recipe
    return out


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("fsdp2-traffic"))
    return run_distributed(_w_measure, DP, root, timeout=600, emulate_npu=True)


def test_draft(per_rank):
    for rank, result in enumerate(per_rank):
        for name, r in result.items():
            print(rank, name, r["steps"])
            for e in r["events"]:
                print(rank, name, e)

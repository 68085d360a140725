"""The emulated Ascend device (mcore_flash.emulation) behaves like a device, and like torch_npu.

Everything runs in spawned workers (the emulation changes torch for the whole process).
Oracles: the same computation on the CPU (bitwise), torch's own error messages for a CUDA
device, torch_npu 2.13's transfer_to_npu (what it patches), float64 formulas for the
fused-op doubles. These tests also pin the private torch APIs the emulation relies on.
"""

from __future__ import annotations

import functools
import io

import pytest
import torch

from _support.dist_utils import run_distributed


def _raises(fn, *needles):
    """The message of the exception ``fn`` raises (None if none) after checking its needles."""
    try:
        fn()
    except Exception as error:  # noqa: BLE001
        message = str(error)
        assert all(n in message for n in needles), message
        return message
    return None


def _train(device, steps=3):
    """A small model trained with AdamW, dropout and grad clipping; returns losses and weights."""
    torch.manual_seed(0)
    torch.npu.manual_seed(0) if device == "npu" else None
    model = torch.nn.Sequential(
        torch.nn.Embedding(50, 32),
        torch.nn.Linear(32, 64),
        torch.nn.GELU(),
        torch.nn.LayerNorm(64),
        torch.nn.Linear(64, 50),
    ).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, 50, (4, 8), generator=generator).to(device)
        loss = torch.nn.functional.cross_entropy(model(ids).view(-1, 50), ids.view(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
    return losses, [p.detach().cpu() for p in model.parameters()]


def _w_device(rank, world_size):
    out = {}
    x = torch.ones(3, device="npu")
    out["device"] = str(x.device)
    out["type"] = x.type()
    out["is_npu"] = x.is_npu
    out["mixing"] = _raises(
        lambda: x + torch.ones(3), "Expected all tensors to be on the same device", "cpu"
    )
    out["scalar_ok"] = (x + torch.tensor(2.0)).cpu().tolist()
    out["numpy"] = _raises(x.numpy, "Use Tensor.cpu()")
    out["other_index"] = _raises(lambda: torch.ones(1, device="npu:3"), "npu:3", "set_device")
    out["set_after_alloc"] = _raises(lambda: torch.npu.set_device(2), "one NPU")
    out["out_of_range"] = _raises(lambda: torch.npu.set_device(99), "invalid device ordinal")
    # the device generator is separate from the CPU one
    cpu_state = torch.get_rng_state()
    torch.npu.manual_seed(5)
    a = torch.randn(4, device="npu")
    torch.npu.manual_seed(5)
    b = torch.nn.functional.dropout(torch.ones(4, device="npu"), 0.5)
    torch.npu.manual_seed(5)
    out["rng"] = (
        torch.equal(a.cpu(), torch.randn(4, device="npu").cpu()),
        torch.equal(cpu_state, torch.get_rng_state()),
    )
    torch.npu.manual_seed(5)
    out["dropout_is_seeded"] = torch.equal(
        b.cpu(), torch.nn.functional.dropout(torch.ones(4, device="npu"), 0.5).cpu()
    )
    # views and in-place ops alias device memory
    base = torch.zeros(6, device="npu")
    view = base[2:4]
    view.add_(1.0)
    base.view(2, 3)[1].fill_(7.0)
    out["aliasing"] = base.cpu().tolist()
    # Module.to keeps the Parameter objects' attributes (megatron's sequence_parallel, ...)
    linear = torch.nn.Linear(3, 2)
    linear.weight.sequence_parallel = True
    linear.to("npu")
    out["param_attr"] = (
        getattr(linear.weight, "sequence_parallel", None),
        str(linear.weight.device),
    )
    # torch.save / torch.load of npu tensors, and .data assignment
    buffer = io.BytesIO()
    torch.save({"w": linear.weight.detach()}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)["w"]
    out["save_load"] = (str(loaded.device), torch.equal(loaded.cpu(), linear.weight.detach().cpu()))
    linear.weight.data = torch.zeros(2, 3, device="npu")
    out["data_assign"] = float(linear.weight.sum())
    # memory statistics: exact bytes of live storages, views counted once
    before = torch.npu.memory_allocated()
    big = torch.empty(1024, 256, device="npu")
    grown = torch.npu.memory_allocated() - before
    _ = big[:10], big.t()
    with_views = torch.npu.memory_allocated() - before
    del big, _
    out["memory"] = (
        grown,
        with_views,
        torch.npu.memory_allocated() - before,
        torch.npu.max_memory_allocated() >= grown,
    )
    # two live storages are two, whatever addresses the allocator gives them (it reuses a freed one's)
    data_ptr = torch.UntypedStorage.data_ptr
    torch.UntypedStorage.data_ptr = lambda storage: 0x1000 if storage.nbytes() else 0
    try:
        pair = torch.empty(1024, device="npu"), torch.empty(1024, device="npu")
        out["same_address"] = torch.npu.memory_allocated() - before
        del pair
    finally:
        torch.UntypedStorage.data_ptr = data_ptr
    # a storage grown by resize_ while a view shares it counts at its new size
    small = torch.empty(16, device="npu")
    view = small[:4]
    small.resize_(1024)
    out["grown_shared"] = torch.npu.memory_allocated() - before
    del small, view
    # storages resized in place, as Megatron-FSDP frees and regrows its buckets
    out["storage_resize"] = _storage_resize_counts()
    # training: bitwise the CPU's numbers
    out["train"] = (_train("cpu"), _train("npu"))
    return out


def _storage_resize_counts():
    """(allocated, peak) above the start after each step of freeing and regrowing storages
    in place (Megatron-FSDP's ``_free_storage`` / ``_alloc_storage``)."""
    torch.npu.reset_peak_memory_stats()
    start = torch.npu.memory_allocated()
    steps = []

    def record(name):
        counts = torch.npu.memory_allocated() - start, torch.npu.max_memory_allocated() - start
        steps.append((name, *counts))

    bucket = torch.empty(1024, device="npu")
    view = bucket[256:]
    record("made")
    bucket.untyped_storage().resize_(0)
    record("freed")
    other = torch.empty(512, device="npu")
    record("other")
    view._typed_storage()._resize_(1024)  # through the view: one storage, counted once
    record("regrown")
    bucket.untyped_storage().resize_(0)
    del bucket, view
    record("dropped")
    del other
    record("all_dropped")
    empty = torch.empty(0, device="npu")
    empty.untyped_storage().resize_(400)
    record("grown_from_empty")
    del empty
    record("end")
    return steps


@pytest.fixture(scope="module")
def device():
    return run_distributed(_w_device, 1, emulate_npu=True)[0]


def test_tensors_are_npu_tensors_that_refuse_cpu_mixing(device):
    assert device["device"] == "npu:0" and device["is_npu"]
    assert device["type"] == "torch.npu.FloatTensor"  # what real npu tensors say
    assert device["mixing"] and device["numpy"]
    assert device["scalar_ok"] == [3.0, 3.0, 3.0]  # 0-dim CPU scalars are fine, as on a device


def test_one_device_per_process(device):
    assert device["other_index"] and device["set_after_alloc"] and device["out_of_range"]


def test_device_generator_is_its_own(device):
    assert device["rng"] == (True, True)  # reproducible per seed; the CPU generator untouched
    assert device["dropout_is_seeded"]


def test_views_alias_and_module_to_keeps_parameter_attributes(device):
    assert device["aliasing"] == [0.0, 0.0, 1.0, 7.0, 7.0, 7.0]
    assert device["param_attr"] == (True, "npu:0")
    assert device["save_load"] == ("npu:0", True)
    assert device["data_assign"] == 0.0


def test_memory_statistics_are_exact(device):
    assert device["memory"] == (1024 * 256 * 4, 1024 * 256 * 4, 0, True)
    assert device["same_address"] == 2 * 1024 * 4
    assert device["grown_shared"] == 1024 * 4


def test_memory_statistics_follow_storage_resizes(device):
    """Bytes and peak after each step, counted by hand: 1024 fp32 = 4096 B, 512 fp32 = 2048 B."""
    assert device["storage_resize"] == [
        ("made", 4096, 4096),
        ("freed", 0, 4096),  # resize_(0) frees; the peak stays
        ("other", 2048, 4096),
        ("regrown", 2048 + 4096, 2048 + 4096),  # _typed_storage()._resize_(1024): a new peak
        ("dropped", 2048, 2048 + 4096),  # freed again, then its tensors die: nothing more
        ("all_dropped", 0, 2048 + 4096),
        ("grown_from_empty", 400, 2048 + 4096),
        ("end", 0, 2048 + 4096),
    ]


def test_training_on_the_device_is_bitwise_the_cpu(device):
    (cpu_losses, cpu_weights), (npu_losses, npu_weights) = device["train"]
    assert npu_losses == cpu_losses
    assert all(torch.equal(a, b) for a, b in zip(npu_weights, cpu_weights))


def _w_hccl(rank, world_size):
    import torch.distributed as dist

    out = {"device": str(torch.ones(1, device="npu").device), "backend": dist.get_backend()}
    t = torch.tensor([float(rank + 1)], device="npu")
    dist.all_reduce(t)
    out["all_reduce"] = t.cpu().tolist()
    out["cpu_all_reduce"] = _raises(
        lambda: dist.all_reduce(torch.tensor([1.0])),
        "No backend type associated with device type cpu",
    )
    out["cpu_barrier_ok"] = dist.barrier() is None
    gathered = torch.empty(4, device="npu")
    dist.all_gather_into_tensor(gathered, torch.full((2,), float(rank), device="npu"))
    scattered = torch.empty(2, device="npu")
    dist.reduce_scatter_tensor(scattered, torch.arange(4.0, device="npu"))
    broadcast = torch.full((2,), float(rank), device="npu")
    dist.broadcast(broadcast, src=1)
    a2a = torch.empty(2, device="npu")
    dist.all_to_all_single(a2a, torch.tensor([rank * 10.0, rank * 10.0 + 1], device="npu"))
    received = torch.empty(1, device="npu")
    ops = [
        dist.P2POp(dist.isend, torch.tensor([float(rank)], device="npu"), 1 - rank),
        dist.P2POp(dist.irecv, received, 1 - rank),
    ]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    objects = [None, None]
    dist.all_gather_object(objects, {"rank": rank})
    out["results"] = [x.cpu().tolist() for x in (gathered, scattered, broadcast, a2a, received)] + [
        objects
    ]
    group = dist.new_group([0, 1])
    out["subgroup_cpu"] = _raises(
        lambda: dist.all_reduce(torch.ones(2), group=group),
        "No backend type associated with device type cpu",
    )
    return out


def test_hccl_groups_take_npu_tensors_only():
    r0, r1 = run_distributed(_w_hccl, 2, emulate_npu=True)
    assert (r0["device"], r1["device"]) == ("npu:0", "npu:1") and r0["backend"] == "hccl"
    assert r0["all_reduce"] == r1["all_reduce"] == [3.0]
    for r in (r0, r1):
        assert r["cpu_all_reduce"] and r["subgroup_cpu"] and r["cpu_barrier_ok"]
    assert r0["results"] == [
        [0.0, 0.0, 1.0, 1.0],
        [0.0, 2.0],
        [1.0, 1.0],
        [0.0, 10.0],
        [1.0],
        [{"rank": 0}, {"rank": 1}],
    ]
    assert r1["results"][:5] == [[0.0, 0.0, 1.0, 1.0], [4.0, 6.0], [1.0, 1.0], [1.0, 11.0], [0.0]]


def _w_hccl_reduce_ops(rank, world_size):
    """Each reduction as megatron calls it: the refused ones give their message (None: no error)."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    avg, premul = dist.ReduceOp.AVG, dist._make_nccl_premul_sum(0.5)
    x = torch.tensor([float(rank + 2)], device="npu")  # 2 on rank 0, 3 on rank 1
    pair = torch.tensor([rank * 10.0, rank * 10.0 + 1], device="npu")
    out = {"refused": {}, "values": {}}
    calls = {
        "all_reduce": lambda op: dist.all_reduce(x.clone(), op=op),
        "all_reduce_async": lambda op: dist.all_reduce(x.clone(), op=op, async_op=True).wait(),
        "reduce": lambda op: dist.reduce(x.clone(), dst=0, op=op),
        "reduce_scatter_tensor": lambda op: dist.reduce_scatter_tensor(
            torch.empty(1, device="npu"), pair, op=op
        ),
        "reduce_scatter": lambda op: dist.reduce_scatter(
            torch.empty(1, device="npu"), list(pair.chunk(2)), op=op
        ),
    }
    for name, call in calls.items():
        for label, op in (("AVG", avg), ("PREMUL_SUM", premul)):
            out["refused"][f"{name}/{label}"] = _raises(functools.partial(call, op))
    out["refused"]["funcol.all_reduce/avg"] = _raises(
        lambda: funcol.all_reduce(x, "avg", dist.group.WORLD)
    )
    for op in ("SUM", "MAX", "MIN", "PRODUCT"):
        t = x.clone()
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
        out["values"][op] = t.cpu().tolist()
    scattered = torch.empty(1, device="npu")
    dist.reduce_scatter_tensor(scattered, pair)
    out["values"]["reduce_scatter_tensor"] = scattered.cpu().tolist()
    return out


def test_hccl_refuses_avg_and_premul_sum_like_torch_npu():
    """torch_npu's ProcessGroupHCCL (getHcclReduceOp) has SUM, PRODUCT, MIN and MAX only;
    gloo underneath takes AVG. The group keeps working after a refusal."""
    for rank, r in enumerate(run_distributed(_w_hccl_reduce_ops, 2, emulate_npu=True)):
        for case, message in r["refused"].items():
            op = case.split("/")[1].upper()
            needle = "Cannot use ReduceOp.AVG with HCCL" if op == "AVG" else "Unhandled ReduceOp"
            assert message is not None and needle in message and op in message, (case, message)
        assert r["values"] == {  # 2 and 3; reduce-scatter of [0, 1] and [10, 11]
            "SUM": [5.0],
            "MAX": [3.0],
            "MIN": [2.0],
            "PRODUCT": [6.0],
            "reduce_scatter_tensor": [[10.0], [12.0]][rank],
        }


def _w_dtensor(rank, world_size):
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Partial, Shard

    mesh = DeviceMesh.from_group(dist.group.WORLD, device_type="npu")
    local = torch.tensor([1.0, 2.0], device="npu") + 2 * rank  # [1, 2] and [3, 4]
    dt = DTensor.from_local(local, mesh, [Shard(0)])
    plus_one = dt.detach() + 1
    full = plus_one.full_tensor()  # all-gather
    total = dt.sum().full_tensor()  # a Partial sum, all-reduced
    partial = DTensor.from_local(local, mesh, [Partial()])
    scattered = partial.redistribute(mesh, [Shard(0)]).to_local()  # reduce-scatter of [4, 6]
    return {
        "devices": [str(t.device) for t in (plus_one.to_local(), full, total, scattered)],
        "local": plus_one.to_local().cpu().tolist(),
        "full": full.cpu().tolist(),
        "total": total.cpu().item(),
        "scattered": scattered.cpu().tolist(),
        "avg": _raises(
            lambda: DTensor.from_local(local, mesh, [Partial("avg")]).full_tensor(),
            "Cannot use ReduceOp.AVG with HCCL",
        ),
    }


def test_dtensor_ops_run_on_the_emulated_npu():
    """Sharding propagation fakes its tensors on the mesh's device (torch's _op_schema); on an
    npu mesh the emulation fakes them on the CPU. Redistributions reach the HCCL backend."""
    for rank, r in enumerate(run_distributed(_w_dtensor, 2, emulate_npu=True)):
        assert r["devices"] == [f"npu:{rank}"] * 4
        assert r["local"] == [[2.0, 3.0], [4.0, 5.0]][rank]
        assert r["full"] == [2.0, 3.0, 4.0, 5.0]
        assert r["total"] == 10.0
        assert r["scattered"] == [[4.0], [6.0]][rank]
        assert r["avg"]


def _w_nothing(rank, world_size):
    return rank


def test_ranks_sharing_an_npu_are_refused_like_hccl():
    """Ranks that never call set_device(LOCAL_RANK) all drive npu:0: HCCL builds no group."""
    with pytest.raises(
        RuntimeError,
        match=r"ranks 0 and 1 of this group both drive .*npu:0.*set_device\(LOCAL_RANK\)",
    ):
        run_distributed(_w_nothing, 2, emulate_npu=True, bind_device=False)


def _w_transfer(rank, world_size):
    import sys

    import torch.distributed as dist

    before = {name: sys.modules[name] for name in ("torch.cuda",)}
    from torch_npu.contrib import transfer_to_npu  # noqa: F401

    out = {
        "same_module": sys.modules["torch.cuda"] is before["torch.cuda"],  # patched in place
        "current_device": torch.cuda.current_device(),
        "available": torch.cuda.is_available(),
        "factory": str(torch.empty(2, device="cuda").device),
        "int_device": str(torch.zeros(1, device=0).device),
        "tensor_cuda": str(torch.ones(1).cuda().device),
        "is_cuda": torch.ones(1, device="npu").is_cuda,
        "type_untouched": torch.ones(1).cuda().type(),
        "module_cuda": str(torch.nn.Linear(2, 2).cuda().weight.device),
        "nccl_group": dist.get_backend(dist.new_group([0], backend="nccl")),
        "nccl_available": dist.is_nccl_available(),
        "generators": torch.cuda.default_generators is torch.npu.default_generators,
        "jit_script_is_identity": torch.jit.script(_train) is _train,
    }
    torch.cuda.manual_seed(3)
    out["rng"] = torch.equal(torch.cuda.get_rng_state(), torch.npu.get_rng_state())
    return out


def test_transfer_to_npu_patches_like_torch_npu():
    out = run_distributed(_w_transfer, 1, emulate_npu=True)[0]
    assert out["same_module"] and out["current_device"] == 0 and out["available"]
    assert (
        out["factory"] == out["int_device"] == out["tensor_cuda"] == out["module_cuda"] == "npu:0"
    )
    assert out["is_cuda"] and out["nccl_available"] and out["nccl_group"] == "hccl"
    assert out["type_untouched"] == "torch.npu.FloatTensor"  # transfer_to_npu leaves .type() alone
    assert out["generators"] and out["rng"] and out["jit_script_is_identity"]


# ---- the fused-op doubles against float64 formulas (CPU tensors, no device) ------------------


def _rms_norm_f64(x, gamma, eps):
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * gamma.double()


def _swiglu_f64(x):
    a, b = x.double().chunk(2, dim=-1)
    return a * torch.sigmoid(a) * b


def test_npu_rms_norm_double_matches_formula_and_contract():
    from mcore_flash.emulation import fusion_attention, op_double

    torch_npu = op_double()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 2, 16, generator=gen, requires_grad=True)
    gamma = torch.randn(16, generator=gen, requires_grad=True)
    dy = torch.randn(5, 2, 16, generator=gen)
    y, rstd = torch_npu.npu_rms_norm(x, gamma, epsilon=1e-5)
    assert rstd.shape == (5, 2, 1) and rstd.dtype == torch.float32
    y.backward(dy)
    x64, g64 = x.detach().double().requires_grad_(), gamma.detach().double().requires_grad_()
    _rms_norm_f64(x64, g64, 1e-5).backward(dy.double())
    torch.testing.assert_close(
        y.double(), _rms_norm_f64(x, gamma, 1e-5).detach(), atol=1e-6, rtol=1e-5
    )
    torch.testing.assert_close(x.grad.double(), x64.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gamma.grad.double(), g64.grad, atol=1e-5, rtol=1e-5)
    with pytest.raises(fusion_attention.NpuContractError, match="gamma dtype"):
        torch_npu.npu_rms_norm(x.bfloat16(), gamma)
    with pytest.raises(fusion_attention.NpuContractError, match="trailing dims"):
        torch_npu.npu_rms_norm(x, gamma[:8])


def test_npu_swiglu_double_matches_formula_and_contract():
    from mcore_flash.emulation import fusion_attention, op_double

    torch_npu = op_double()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 3, 32, generator=gen, requires_grad=True)
    dy = torch.randn(4, 3, 16, generator=gen)
    y = torch_npu.npu_swiglu(x, dim=-1)
    y.backward(dy)
    x64 = x.detach().double().requires_grad_()
    _swiglu_f64(x64).backward(dy.double())
    torch.testing.assert_close(y.double(), _swiglu_f64(x).detach(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(x.grad.double(), x64.grad, atol=1e-5, rtol=1e-5)
    with pytest.raises(fusion_attention.NpuContractError, match="even size"):
        torch_npu.npu_swiglu(torch.ones(3, 5))
    with pytest.raises(fusion_attention.NpuContractError, match="non-contiguous"):
        torch_npu.npu_swiglu(torch.ones(8, 4).t())


PACKED_DOCS = [0, 8, 24, 28, 32]  # cumulative lengths of packed documents (multiples of 2 * cp)


def _w_windowed_ring_on_the_device(rank, world_size):
    """Ring CP with a sliding window on npu tensors over HCCL-strict groups (the npu backend
    through the emulated torch_npu), one sequence and packed documents; returns this rank's
    results on the CPU."""
    import torch.distributed as dist

    from mcore_flash.ops import last_used_backend
    from mcore_flash.ops.context_parallel import (
        context_parallel_attn_func,
        context_parallel_varlen_attn_func,
        split_for_cp_rank,
        thd_positions_for_cp_rank,
    )

    g = torch.Generator().manual_seed(7)
    q, k, v, dout = (torch.randn(1, 32, h, 8, generator=g) for h in (4, 2, 2, 4))
    local = [
        split_for_cp_rank(x, 1, world_size, rank).to("npu").requires_grad_() for x in (q, k, v)
    ]
    out = context_parallel_attn_func(*local, dist.group.WORLD, causal=True, window_size=(5, 0))
    out.backward(split_for_cp_rank(dout, 1, world_size, rank).to("npu"))
    rows = thd_positions_for_cp_rank(PACKED_DOCS, world_size, rank)
    packed = [x[0, rows].to("npu").requires_grad_() for x in (q, k, v)]
    cu = torch.tensor(PACKED_DOCS)
    packed_out = context_parallel_varlen_attn_func(
        *packed, cu, dist.group.WORLD, causal=True, window_size=(5, 0)
    )
    packed_out.backward(dout[0, rows].to("npu"))
    return dict(
        backend=last_used_backend(),
        device=str(out.device),
        rows=rows,
        results=[x.detach().cpu() for x in (out, *(t.grad for t in local))],
        packed=[x.detach().cpu() for x in (packed_out, *(t.grad for t in packed))],
    )


def test_windowed_ring_attention_runs_on_the_emulated_npu():
    """One sequence and packed documents, against the float64 oracle (per document)."""
    from mcore_flash.ops.context_parallel import gather_from_cp_ranks

    from _support import oracle

    ranks = run_distributed(_w_windowed_ring_on_the_device, 2, emulate_npu=True)
    assert all(r["backend"] == "npu" and r["device"] == f"npu:{i}" for i, r in enumerate(ranks))
    g = torch.Generator().manual_seed(7)
    q, k, v, dout = (torch.randn(1, 32, h, 8, generator=g) for h in (4, 2, 2, 4))
    exact = oracle.attention_with_grads(q, k, v, dout, causal=True, window=(5, 0))
    for i, expected in enumerate((exact[0], *exact[2:])):
        got = gather_from_cp_ranks([r["results"][i] for r in ranks], 1)
        torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)
    packed = oracle.varlen_attention_with_grads(
        q[0], k[0], v[0], dout[0], PACKED_DOCS, PACKED_DOCS, causal=True, window=(5, 0)
    )
    for r in ranks:
        for got, expected in zip(r["packed"], (packed[0], *packed[2:])):
            torch.testing.assert_close(got.double(), expected[r["rows"]], atol=1e-5, rtol=1e-5)

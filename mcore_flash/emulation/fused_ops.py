"""``npu_rms_norm`` and ``npu_swiglu`` as contract doubles (pure PyTorch, differentiable).

Written from torch_npu 2.13's op docs, meta registrations and derivatives (see
``docs/npu-contract.md``); they compute in float32 and raise
:class:`NpuContractError` for calls outside the contract:

* ``npu_rms_norm(x, gamma, epsilon=1e-6) -> (y, rstd)``: x fp16/bf16/fp32 with 1-8 dims
  (the docs say 2-8, their own example passes 2 dims with a 1-D gamma), gamma of x's dtype
  (the 2.13 docs) and shaped like x's trailing dims; rstd float32 shaped
  ``x.shape[:x.dim() - gamma.dim()] + [1] * gamma.dim()``; autograd keeps x, gamma, rstd;
  dgamma is computed in float32.
* ``npu_swiglu(x, dim=-1) = A * sigmoid(A) * B`` with A, B the halves of x along ``dim``
  (A first): fp16/bf16/fp32, 1-8 dims, even size along ``dim``, contiguous and non-empty
  (the docs: non-contiguous tensors are not supported); autograd keeps x.

Each call appends a dict to the ``record`` list it was made with.
"""

from __future__ import annotations

import torch

from .fusion_attention_args import NpuContractError

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _fail(op: str, message: str) -> None:
    raise NpuContractError(f"{op} (test double): {message}")


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gamma, epsilon):
        reduce_dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
        x32 = x.float()
        rstd = torch.rsqrt(x32.pow(2).mean(dim=reduce_dims, keepdim=True) + epsilon)
        ctx.save_for_backward(x, gamma, rstd)
        ctx.mark_non_differentiable(rstd)
        return (x32 * rstd * gamma.float()).to(x.dtype), rstd

    @staticmethod
    def backward(ctx, dy, _drstd):
        x, gamma, rstd = ctx.saved_tensors
        reduce_dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
        x_hat = x.float() * rstd
        dy_gamma = dy.float() * gamma.float()
        dx = rstd * (dy_gamma - x_hat * (dy_gamma * x_hat).mean(dim=reduce_dims, keepdim=True))
        dgamma = (dy.float() * x_hat).sum(dim=tuple(range(x.dim() - gamma.dim())))
        return dx.to(x.dtype), dgamma.to(gamma.dtype), None


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim):
        ctx.save_for_backward(x)
        ctx.dim = dim
        a, b = x.float().chunk(2, dim=dim)
        return (a * torch.sigmoid(a) * b).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        a, b = x.float().chunk(2, dim=ctx.dim)
        sigmoid = torch.sigmoid(a)
        dy32 = dy.float()
        da = dy32 * b * sigmoid * (1 + a * (1 - sigmoid))
        db = dy32 * a * sigmoid
        return torch.cat([da, db], dim=ctx.dim).to(x.dtype), None


def make_ops(record: list):
    """``(npu_rms_norm, npu_swiglu)`` appending one dict per call to ``record``."""

    def npu_rms_norm(x, gamma, epsilon=1e-6):
        op = "npu_rms_norm"
        if x.dtype not in _DTYPES:
            _fail(op, f"x dtype {x.dtype} unsupported (float16, bfloat16, float32 only)")
        if gamma.dtype != x.dtype:
            _fail(op, f"gamma dtype {gamma.dtype} must equal x dtype {x.dtype}")
        if not 1 <= x.dim() <= 8 or not 1 <= gamma.dim() <= x.dim():
            _fail(
                op,
                f"x must have 1-8 dims and gamma at most as many, got {tuple(x.shape)} and {tuple(gamma.shape)}",
            )
        if tuple(gamma.shape) != tuple(x.shape[x.dim() - gamma.dim() :]):
            _fail(
                op,
                f"gamma shape {tuple(gamma.shape)} must equal x's trailing dims {tuple(x.shape)}",
            )
        record.append(
            dict(
                name=op,
                x_shape=tuple(x.shape),
                dtype=x.dtype,
                noncontiguous=[] if x.is_contiguous() else ["x"],
            )
        )
        return _RMSNorm.apply(x, gamma, float(epsilon))

    def npu_swiglu(x, dim=-1):
        op = "npu_swiglu"
        if x.dtype not in _DTYPES:
            _fail(op, f"x dtype {x.dtype} unsupported (float16, bfloat16, float32 only)")
        if not 1 <= x.dim() <= 8 or not -x.dim() <= dim < x.dim():
            _fail(
                op,
                f"x must have 1-8 dims and dim in [-{x.dim()}, {x.dim() - 1}], got {tuple(x.shape)}, dim={dim}",
            )
        if x.numel() == 0 or x.shape[dim] % 2:
            _fail(
                op, f"x must be non-empty with an even size along dim {dim}, got {tuple(x.shape)}"
            )
        if not x.is_contiguous():
            _fail(op, "non-contiguous input is not supported")
        record.append(dict(name=op, x_shape=tuple(x.shape), dtype=x.dtype, noncontiguous=[]))
        return _SwiGLU.apply(x, dim)

    return npu_rms_norm, npu_swiglu

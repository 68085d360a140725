"""The emulated ``torch_npu`` (``mcore_flash.emulation``): what ``import torch_npu`` finds
after ``mcore_flash.emulation.install()``. Importing it registers the ``npu`` device."""

import sys

from mcore_flash.emulation import _CALLS, activate, op_double

__version__ = "2.13.0+emulated"

npu = activate()
sys.modules[__name__ + ".npu"] = npu
_ops = op_double(_CALLS)
npu_fusion_attention = _ops.npu_fusion_attention
npu_fusion_attention_grad = _ops.npu_fusion_attention_grad
npu_rms_norm = _ops.npu_rms_norm
npu_swiglu = _ops.npu_swiglu

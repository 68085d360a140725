"""NPU: ``torch.cuda.get_device_capability()`` must answer, or torch's broadcast fails.

torch 2.13's ``torch.distributed.broadcast`` (``distributed_c10d.py:3138``) evaluates
``tensor.is_cuda and torch.cuda.get_device_capability(tensor.device)[0] >= 9``. Under
``transfer_to_npu`` an npu tensor ``is_cuda`` and ``torch.cuda.get_device_capability`` is
torch_npu's, which returns None unless ``TORCH_NPU_DEVICE_CAPABILITY`` is set (torch_npu
2.13 ``npu/__init__.py:565``): every broadcast of a device tensor raises TypeError -
megatron's ``finalize_model_grads`` broadcasts the token count each step
(``distributed/finalize_model_grads.py:490``). Found by the emulated-NPU rehearsal.

The capability torch_npu reports is "only for compatibility with PyTorch" (its docs); an
unset variable is set to ``8.0`` here, which keeps torch's sm90-only fp8 broadcast path
off. A value the user exported is left alone.
"""

from __future__ import annotations

import os

from ._common import once

ENV = "TORCH_NPU_DEVICE_CAPABILITY"
DEFAULT = "8.0"


@once
def npu_device_capability():
    """Set ``TORCH_NPU_DEVICE_CAPABILITY=8.0`` unless the user set it."""
    os.environ.setdefault(ENV, DEFAULT)

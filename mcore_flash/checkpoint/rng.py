"""Each rank's random-number state (Python, numpy, torch, the device, megatron's TP tracker),
as a dict that ``torch.load(weights_only=True)`` reads back."""

from __future__ import annotations

import random

import numpy
import torch


def rng_state() -> dict:
    from megatron.core import tensor_parallel

    from mcore_flash import platform

    algorithm, key, position, has_gauss, cached_gaussian = numpy.random.get_state()
    state = {
        "python": random.getstate(),
        # numpy's state as tensors and numbers: the file loads with weights_only=True
        "numpy": (
            algorithm,
            torch.from_numpy(key.astype(numpy.int64)),
            position,
            has_gauss,
            cached_gaussian,
        ),
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if platform.device_type() != "cpu":
        state["device"] = getattr(torch, platform.device_type()).get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    from mcore_flash import platform

    random.setstate(state["python"])
    algorithm, key, *rest = state["numpy"]
    numpy.random.set_state((algorithm, numpy.asarray(key, dtype=numpy.uint32), *rest))
    torch.set_rng_state(state["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    if "device" in state:
        getattr(torch, platform.device_type()).set_rng_state(state["device"])

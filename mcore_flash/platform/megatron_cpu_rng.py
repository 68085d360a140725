"""CPU: megatron's device RNG is a generator of its own, active only inside tracker forks.

On a GPU megatron seeds and forks the *CUDA* generator (``model_parallel_cuda_manual_seed``
seeds it and gives the TP tracker ``seed + 2718 + tp_rank``; ``get_cuda_rng_tracker().fork()``
swaps that state in) and never touches the CPU generator that user code shares. On the CPU the tensors'
generator *is* the CPU one, so this adaptation keeps a separate device generator that
megatron seeds, saves and restores (``torch.cuda.*`` RNG calls in :mod:`.megatron_torch_view`,
``_get_cuda_rng_state`` / ``_set_cuda_rng_state`` in ``tensor_parallel/random.py:41,72``),
and makes it the CPU generator only inside ``CudaRNGStatesTracker.fork()`` (``random.py:243``):
dropout in a fork draws from the tracker's per-TP-rank stream, ``tensor_parallel.checkpoint``
(which saves and restores the CPU, device and tracker states) replays it exactly, and
megatron's seeding leaves the user's CPU generator alone.
"""

from __future__ import annotations

import contextlib

import torch

from ._common import once

_GENERATOR = torch.Generator()


def device_generator() -> torch.Generator:
    """The generator megatron sees as the device's default generator on the CPU."""
    return _GENERATOR


@contextlib.contextmanager
def _device_generator_active():
    """The CPU generator draws from the device generator's stream for the duration."""
    cpu = torch.default_generator
    saved = cpu.get_state()
    cpu.set_state(_GENERATOR.get_state())
    try:
        yield
    finally:
        _GENERATOR.set_state(cpu.get_state())
        cpu.set_state(saved)


@once
def megatron_cpu_rng():
    """Megatron's device-RNG primitives and tracker forks on the CPU (see the module doc)."""
    try:
        from megatron.core.tensor_parallel import random as mrandom
    except ImportError:
        return False
    tracker = getattr(mrandom, "CudaRNGStatesTracker", None)
    if (
        tracker is None
        or not hasattr(mrandom, "_get_cuda_rng_state")
        or not hasattr(mrandom, "_set_cuda_rng_state")
    ):
        return False

    def _get_cuda_rng_state(device="cuda", clone=False, graph_safe=False):
        """CPU stand-in (mcore_flash.platform): the device generator's state."""
        return _GENERATOR.get_state()

    def _set_cuda_rng_state(new_state, device=-1, graph_safe=False):
        """CPU stand-in (mcore_flash.platform): set the device generator's state."""
        _GENERATOR.set_state(new_state)

    mrandom._get_cuda_rng_state = _get_cuda_rng_state
    mrandom._set_cuda_rng_state = _set_cuda_rng_state
    megatron_fork = tracker.fork

    @contextlib.contextmanager
    def fork(self, *args, **kwargs):
        with megatron_fork(self, *args, **kwargs), _device_generator_active():
            yield

    tracker.fork = fork

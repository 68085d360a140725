"""``torch.npu`` of the emulated device: device selection, RNG, streams, memory statistics.

What torch_npu's ``torch.npu`` module gives a training script, backed by the CPU
(:class:`NpuRuntime`, one per process: :func:`runtime`):

* **Devices.** ``device_count()`` devices are visible (``MCORE_FLASH_EMULATED_NPUS``,
  default 8, one Ascend node). A process drives exactly one of them (:meth:`NpuRuntime.claim`):
  asking for another index, or a ``set_device`` to another index after the first allocation,
  raises. Index 0 is accepted as an alias of the process's device.
* **RNG.** Each device has its own generator, separate from the CPU one, as on hardware.
* **Lazy initialisation** as in torch_npu, with ``_lazy_call`` queues.
* **Streams and events** exist and do nothing (work is synchronous on the CPU).
* **Memory statistics** count the bytes of live npu tensor storages (what the caching
  allocator calls "allocated"; nothing is cached, so "reserved" equals it).
"""

from __future__ import annotations

import contextlib
import os
from types import SimpleNamespace
from typing import Optional, Union

import torch

NAME = "npu"
DEFAULT_DEVICE_COUNT = 8
DEVICE_COUNT_ENV = "MCORE_FLASH_EMULATED_NPUS"
TOTAL_MEMORY = 64 * 2**30  # Atlas 800T A2 (910B): 64 GB of HBM per NPU


class Stream:
    """A device stream: work is synchronous here, so every method is a no-op."""

    def __init__(self, device=None, priority: int = 0, **kwargs):
        self.device = runtime().bound_device()
        self.priority = priority

    def synchronize(self) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        event = event or Event()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        return False


class Event:
    """A device event; ``elapsed_time`` is 0 (no device clock is modelled)."""

    def __init__(
        self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False
    ):
        self.enable_timing = enable_timing

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end_event) -> float:
        return 0.0


_RANDOM_API = (
    "get_rng_state",
    "set_rng_state",
    "get_rng_state_all",
    "set_rng_state_all",
    "manual_seed",
    "manual_seed_all",
    "seed",
    "seed_all",
    "initial_seed",
)


class NpuRuntime:
    """The object installed as ``torch.npu`` (and ``torch_npu.npu``).

    ``__all__`` names what ``transfer_to_npu`` copies onto ``torch.cuda`` (the subset of
    torch_npu 2.13's ``torch_npu.npu.__all__`` emulated here); ``random`` is
    ``torch_npu.npu.random``.

    * **Devices.** ``device_count()`` devices are visible (``MCORE_FLASH_EMULATED_NPUS``,
      default 8, one Ascend node). A process drives exactly one of them: the current device
      (``set_device``) when it first allocates. Asking for another index afterwards, or a
      ``set_device`` to another index after the first allocation, raises - on hardware that
      is a second device in one rank, which a training rank never wants. Every emulated
      tensor *reports* the process's device (``npu:<index>``); underneath, torch's Python
      device guard knows a single physical device, so index 0 is accepted as an alias of the
      process's device (torch's own internals allocate on it). Ranks of one host that end up
      on the same device are caught when they build an HCCL group (:mod:`.hccl`).
    * **RNG.** Each device has its own generator, separate from the CPU one, as on hardware;
      seeded ops on npu tensors draw from the current device's generator.
    * **Lazy initialisation** as in torch_npu: ``is_initialized()`` turns True at the first
      ``set_device``, ``current_device``, ``get_rng_state`` or allocation; ``_lazy_call``
      queues callbacks (``manual_seed``, ``set_rng_state``) until then.
    * **Streams and events** exist and do nothing (work is synchronous on the CPU).
    * **Memory statistics** count the bytes of live npu tensor storages (what the caching
      allocator calls "allocated"; nothing is cached, so "reserved" equals it).
    """

    Stream = Stream
    Event = Event
    __all__ = (
        "is_initialized",
        "is_available",
        "device_count",
        "set_device",
        "current_device",
        "device",
        "get_device_name",
        "get_device_properties",
        "get_device_capability",
        "is_bf16_supported",
        "get_amp_supported_dtype",
        "synchronize",
        "stream",
        "set_stream",
        "current_stream",
        "default_stream",
        "Stream",
        "Event",
        "mem_get_info",
        "empty_cache",
        "memory_stats",
        "memory_allocated",
        "max_memory_allocated",
        "memory_reserved",
        "max_memory_reserved",
        "reset_peak_memory_stats",
        "reset_max_memory_allocated",
        *_RANDOM_API,
    )

    def __init__(self, device_count: int):
        self._count = device_count
        self._current = 0
        self._bound: Optional[int] = None  # the device this process allocated on
        self._initialized = False
        self._queued_calls: list = []
        self._generators = tuple(torch.Generator() for _ in range(device_count))
        self._allocated = 0
        self._peak = 0
        self.random = SimpleNamespace(
            __all__=_RANDOM_API, **{name: getattr(self, name) for name in _RANDOM_API}
        )

    # ---- devices -----------------------------------------------------------------------

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return self._initialized

    def _lazy_init(self) -> None:
        if self._initialized:
            return
        self._initialized = True
        queued, self._queued_calls = self._queued_calls, []
        for callback in queued:
            callback()

    def _lazy_call(self, callback, **kwargs) -> None:
        if self._initialized:
            callback()
        else:
            self._queued_calls.append(callback)

    def _is_in_bad_fork(self) -> bool:
        return False

    def device_count(self) -> int:
        return self._count

    def current_device(self) -> int:
        self._lazy_init()
        return self._current

    def set_device(self, device: Union[int, str, torch.device]) -> None:
        if isinstance(device, int) and device < 0:
            return  # torch_npu ignores negative indices
        index = self._index(device)
        if self._bound is not None and index != self._bound:
            raise RuntimeError(
                f"emulated npu: set_device({index}) after this process allocated tensors on npu:{self._bound}; "
                "a training rank drives one NPU: call torch.npu.set_device(LOCAL_RANK) before allocating anything"
            )
        self._current = index
        self._lazy_init()

    @contextlib.contextmanager
    def device(self, device):
        previous = self._current
        self.set_device(device)
        try:
            yield
        finally:
            self._current = previous

    def claim(self, index: Optional[int]) -> int:
        """The device index of a new tensor requested on ``npu:index`` (None: current device).

        Binds the process to its current device on first use; raises for any other index
        (0 is the one physical device torch's guard knows and aliases the process's device).
        """
        if index is not None and index not in (0, self._current):
            raise RuntimeError(
                f"emulated npu: a tensor was requested on npu:{index} but this process's current device is "
                f"npu:{self._current}; a training rank drives one NPU: call torch.npu.set_device(LOCAL_RANK) "
                "first and allocate on torch.npu.current_device()"
            )
        if self._bound is None:
            self._lazy_init()
            self._bound = self._current
        return self._bound

    def bound_device(self) -> torch.device:
        """The device every emulated tensor of this process reports."""
        return torch.device(NAME, self._current if self._bound is None else self._bound)

    def _index(self, device) -> int:
        if isinstance(device, str):
            device = torch.device(device)
        if isinstance(device, torch.device):
            if device.type != NAME:
                raise ValueError(f"Expected a npu device, but got: {device}")
            index = self._current if device.index is None else device.index
        else:
            index = int(device)
        if not 0 <= index < self._count:
            raise RuntimeError(
                f"emulated npu: invalid device ordinal {index}: {self._count} NPUs are visible "
                f"(set {DEVICE_COUNT_ENV} to emulate another number)"
            )
        return index

    def get_device_name(self, device=None) -> str:
        return "Ascend910B (emulated on the CPU)"

    def get_device_properties(self, device=None):
        return SimpleNamespace(
            name=self.get_device_name(),
            total_memory=TOTAL_MEMORY,
            cube_core_num=24,
            vector_core_num=48,
        )

    def get_device_capability(self, device=None):
        """torch_npu 2.13: ``(major, minor)`` from ``TORCH_NPU_DEVICE_CAPABILITY="major.minor"``,
        else None."""
        value = os.environ.get("TORCH_NPU_DEVICE_CAPABILITY", "")
        major, dot, minor = value.partition(".")
        if not (dot and major.isdigit() and minor.isdigit()):
            return None
        return int(major), int(minor)

    def is_bf16_supported(self, including_emulation: bool = False) -> bool:
        return True

    def get_amp_supported_dtype(self) -> list:
        return [torch.float16, torch.bfloat16]

    # ---- synchronisation ---------------------------------------------------------------

    def synchronize(self, device=None) -> None:
        pass

    def current_stream(self, device=None) -> Stream:
        return Stream()

    def default_stream(self, device=None) -> Stream:
        return Stream()

    def set_stream(self, stream) -> None:
        pass

    @contextlib.contextmanager
    def stream(self, stream):
        yield

    # ---- RNG: one generator per device, separate from the CPU's -------------------------

    @property
    def default_generators(self) -> tuple:
        return self._generators

    def generator(self) -> torch.Generator:
        """The generator seeded ops on this process's device draw from."""
        return self._generators[self.bound_device().index]

    def manual_seed(self, seed: int) -> None:
        seed = int(seed)
        self._lazy_call(lambda: self._generators[self._current].manual_seed(seed))

    def manual_seed_all(self, seed: int) -> None:
        seed = int(seed)
        self._lazy_call(lambda: [generator.manual_seed(seed) for generator in self._generators])

    def seed(self) -> None:
        self._generators[self._current].seed()

    def seed_all(self) -> None:
        for generator in self._generators:
            generator.seed()

    def initial_seed(self) -> int:
        return self._generators[self._current].initial_seed()

    def get_rng_state(self, device: Union[int, str, torch.device] = NAME) -> torch.Tensor:
        self._lazy_init()
        return self._generators[self._index(device)].get_state()

    def set_rng_state(
        self, new_state: torch.Tensor, device: Union[int, str, torch.device] = NAME
    ) -> None:
        new_state = new_state.clone()
        self._lazy_call(lambda: self._generators[self._index(device)].set_state(new_state))

    def get_rng_state_all(self) -> list:
        return [generator.get_state() for generator in self._generators]

    def set_rng_state_all(self, new_states) -> None:
        for generator, state in zip(self._generators, new_states):
            generator.set_state(state)

    # ---- memory ------------------------------------------------------------------------

    def _record_allocation(self, nbytes: int) -> None:
        self._allocated += nbytes
        self._peak = max(self._peak, self._allocated)

    def _record_free(self, nbytes: int) -> None:
        self._allocated -= nbytes

    def memory_allocated(self, device=None) -> int:
        return self._allocated

    def max_memory_allocated(self, device=None) -> int:
        return self._peak

    memory_reserved = memory_allocated
    max_memory_reserved = max_memory_allocated

    def reset_peak_memory_stats(self, device=None) -> None:
        self._peak = self._allocated

    reset_max_memory_allocated = reset_peak_memory_stats

    def memory_stats(self, device=None) -> dict:
        return {
            "allocated_bytes.all.current": self._allocated,
            "allocated_bytes.all.peak": self._peak,
            "reserved_bytes.all.current": self._allocated,
            "reserved_bytes.all.peak": self._peak,
        }

    def mem_get_info(self, device=None) -> tuple[int, int]:
        return TOTAL_MEMORY - self._allocated, TOTAL_MEMORY

    def empty_cache(self) -> None:
        pass


def _device_count_from_env() -> int:
    value = os.environ.get(DEVICE_COUNT_ENV, str(DEFAULT_DEVICE_COUNT))
    if not value.isdigit() or int(value) < 1:
        raise ValueError(
            f"{DEVICE_COUNT_ENV}={value!r}: set it to the number of NPUs to emulate per host (>= 1)"
        )
    return int(value)


_RUNTIME: Optional[NpuRuntime] = None


def runtime() -> NpuRuntime:
    """The process's emulated ``torch.npu`` (created on first use)."""
    global _RUNTIME
    if _RUNTIME is None:
        _RUNTIME = NpuRuntime(_device_count_from_env())
    return _RUNTIME

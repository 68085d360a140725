"""Hardware profiles for the step-time model: one device's compute, memory and links.

Profiles are data (``hardware_profiles.json`` next to this module, every number with its
public source in ``sources``); a custom profile is a JSON file with the same fields.
Resolve a name or path once, at the edge, with :func:`load_hardware` and pass the
:class:`HardwareProfile` down.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Optional

__all__ = [
    "HardwareProfile",
    "HARDWARE_PROFILES",
    "HOST_FIELDS",
    "load_hardware",
    "DEFAULT_HARDWARE",
]

DEFAULT_HARDWARE = "ascend-910b-64g"
# the host figures of the offload rung: optional fields (None = the profile does not say)
HOST_FIELDS = (
    "host_memory_bytes",
    "host_device_bandwidth",
    "host_optimizer_elements_per_s",
    "host_runtime_bytes_per_rank",
    "host_reserved_bytes",
)
_MAY_BE_ZERO = ("host_runtime_bytes_per_rank", "host_reserved_bytes")
_PROFILES_FILE = os.path.join(os.path.dirname(__file__), "hardware_profiles.json")


@dataclass(frozen=True)
class HardwareProfile:
    """One accelerator as the step-time model sees it.

    ``peak_bf16_tflops``: dense BF16 matrix peak (TFLOP/s). ``achievable_fraction``: the
    fraction of that peak the model's FLOPs run at (GEMMs and the fused attention kernel
    alike). ``hbm_bytes``: device memory as the datasheet gives it (bytes);
    ``capacity_bytes``: what the framework can allocate of it (torch's or torch_npu's "total
    capacity", bytes; default ``hbm_bytes``), the plan's default device memory;
    ``communicator_buffer_bytes``: device bytes each communicator of the collective library
    holds outside the framework's allocator (HCCL: 2 x HCCL_BUFFSIZE; default 0);
    ``collective_library``: ``"hccl"`` or ``"nccl"`` (``""``: not said). ``intra_node_bandwidth`` and
    ``inter_node_bandwidth``: bytes/s one device sends in one direction inside a node and
    to another node. ``devices_per_node``: devices sharing the intra-node links.
    ``sources``: field name -> where the number comes from (or that it is an assumption).

    The host, for the offload rung (optional: None where a profile does not say; a plan
    that offloads then refuses it by name): ``host_memory_bytes``: host DRAM per node
    (bytes); ``host_device_bandwidth``: bytes/s one device copies to or from the host in one
    direction; ``host_optimizer_elements_per_s``: parameters per second the node's CPUs step
    with torch's fp32 AdamW (all of the node's ranks together); ``host_runtime_bytes_per_rank``:
    host bytes one training process holds besides what it offloads (framework, runtime,
    data loader); ``host_reserved_bytes``: host bytes per node kept for the OS and the rest.
    """

    name: str
    peak_bf16_tflops: float
    achievable_fraction: float
    hbm_bytes: int
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    devices_per_node: int
    host_memory_bytes: Optional[int] = None
    host_device_bandwidth: Optional[float] = None
    host_optimizer_elements_per_s: Optional[float] = None
    host_runtime_bytes_per_rank: Optional[int] = None
    host_reserved_bytes: Optional[int] = None
    capacity_bytes: Optional[int] = None
    communicator_buffer_bytes: int = 0
    collective_library: str = ""
    description: str = ""
    sources: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in (
            "peak_bf16_tflops",
            "hbm_bytes",
            "intra_node_bandwidth",
            "inter_node_bandwidth",
            "devices_per_node",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(
                    f"--hardware {self.name}: {name} must be positive (got {getattr(self, name)})"
                )
        for name in HOST_FIELDS:
            value = getattr(self, name)
            if value is not None and (value < 0 if name in _MAY_BE_ZERO else not value > 0):
                raise ValueError(
                    f"--hardware {self.name}: {name} must be {'>= 0' if name in _MAY_BE_ZERO else 'positive'} "
                    f"(got {value})"
                )
        if self.capacity_bytes is not None and not 0 < self.capacity_bytes <= self.hbm_bytes:
            raise ValueError(
                f"--hardware {self.name}: capacity_bytes must be positive and at most hbm_bytes "
                f"{self.hbm_bytes} (got {self.capacity_bytes})"
            )
        if self.collective_library not in ("", "hccl", "nccl"):
            raise ValueError(
                f"--hardware {self.name}: collective_library is hccl, nccl or empty "
                f"(got {self.collective_library!r})"
            )
        if not self.communicator_buffer_bytes >= 0:
            raise ValueError(
                f"--hardware {self.name}: communicator_buffer_bytes must be >= 0 "
                f"(got {self.communicator_buffer_bytes})"
            )
        if not 0 < self.achievable_fraction <= 1:
            raise ValueError(
                f"--hardware {self.name}: achievable_fraction is a fraction of the peak in (0, 1] "
                f"(got {self.achievable_fraction})"
            )

    @property
    def capacity(self) -> int:
        """Device bytes the framework can allocate: ``capacity_bytes``, else ``hbm_bytes``."""
        return self.hbm_bytes if self.capacity_bytes is None else self.capacity_bytes

    @property
    def achievable_flops(self) -> float:
        """FLOP/s the model's work runs at: peak x achievable fraction."""
        return self.peak_bf16_tflops * 1e12 * self.achievable_fraction

    def host(self, name: str) -> float:
        """The host figure ``name`` (:data:`HOST_FIELDS`), or ValueError naming it when the
        profile does not give it (offload cannot be planned without it)."""
        value = getattr(self, name)
        if value is None:
            raise ValueError(
                f"--hardware {self.name}: host offload needs {name} in the profile (docs/step-time.md)"
            )
        return value

    def assumptions(self) -> list[str]:
        """The fields whose source is marked an assumption (or a calibration), in field order."""
        marked = ("ASSUMPTION", "calibrated")
        return [
            f.name
            for f in fields(self)
            if str(self.sources.get(f.name, "")).startswith(marked)
            and isinstance(getattr(self, f.name), (int, float))
        ]

    def with_(self, **changes) -> "HardwareProfile":
        """A copy with some fields changed (e.g. a different ``achievable_fraction``)."""
        return HardwareProfile(**{**asdict(self), **changes})

    def to_dict(self) -> dict:
        return asdict(self)


OPTIONAL_FIELDS = HOST_FIELDS + (
    "capacity_bytes",
    "communicator_buffer_bytes",
    "collective_library",
)
REQUIRED_FIELDS = tuple(
    f.name
    for f in fields(HardwareProfile)
    if f.name not in ("name", "description", "sources") + OPTIONAL_FIELDS
)


def _profile(name: str, data: dict, origin: str) -> HardwareProfile:
    if not isinstance(data, dict):
        raise ValueError(
            f"--hardware {origin}: expected a JSON object with the fields {', '.join(REQUIRED_FIELDS)}"
        )
    known = {f.name for f in fields(HardwareProfile)}
    missing = [k for k in REQUIRED_FIELDS if k not in data]
    unknown = sorted(set(data) - known)
    if missing or unknown:
        problems = [f"missing {', '.join(missing)}"] if missing else []
        problems += [f"unknown {', '.join(unknown)}"] if unknown else []
        raise ValueError(
            f"--hardware {origin}: {'; '.join(problems)}; a profile has the fields {', '.join(REQUIRED_FIELDS)} "
            f"(and optionally {', '.join(OPTIONAL_FIELDS)}, name, description, sources)"
        )
    return HardwareProfile(**{"name": name, **data})


def _builtin() -> dict[str, HardwareProfile]:
    with open(_PROFILES_FILE) as f:
        return {name: _profile(name, data, name) for name, data in json.load(f).items()}


HARDWARE_PROFILES: dict[str, HardwareProfile] = _builtin()


def load_hardware(name_or_path) -> HardwareProfile:
    """A built-in profile by name (``ascend-910b-64g``, ``h100-80g``, ``h200-141g``), a
    custom profile from a JSON file path, or a HardwareProfile as is."""
    if isinstance(name_or_path, HardwareProfile):
        return name_or_path
    key = str(name_or_path)
    if key.lower() in HARDWARE_PROFILES:
        return HARDWARE_PROFILES[key.lower()]
    if not key.endswith(".json"):
        raise ValueError(
            f"--hardware {key}: unknown profile; choose one of {', '.join(HARDWARE_PROFILES)} "
            "or give the path of a JSON file with the fields " + ", ".join(REQUIRED_FIELDS)
        )
    try:
        with open(key) as f:
            data = json.load(f)
    except OSError as error:
        raise ValueError(f"--hardware {key}: cannot read the file ({error.strerror})") from None
    except json.JSONDecodeError as error:
        raise ValueError(
            f"--hardware {key}: not valid JSON ({error.msg}, line {error.lineno})"
        ) from None
    name = (
        data.pop("name", os.path.splitext(os.path.basename(key))[0])
        if isinstance(data, dict)
        else key
    )
    return _profile(name, data, key)

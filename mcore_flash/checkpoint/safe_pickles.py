"""Every pickle in a checkpoint passes a restricted unpickler before megatron loads it.

A torch_dist checkpoint holds three kinds of pickle that megatron's ``dist_checkpointing``
loads with Python's full unpickler or ``torch.load(weights_only=False)`` (megatron-core
0.16-0.19 on torch 2.13): ``.metadata`` (DCP's index), the byte items inside
``__*_*.distcp`` and ``common.pt`` (which loader reads each: :func:`check_pickles`).
:func:`check_pickles` and :func:`load_common_state` read each of them first with an
unpickler that can only build plain data: torch's ``weights_only`` unpickler for
``torch.save`` data, and for ``.metadata`` an allowlist of DCP's own metadata classes (and
torch sizes, dtypes, paths). A file that asks for anything else (``os.system``, any class
outside the list) is refused with :class:`UnsafeCheckpoint`, naming the file and the global,
so by the time megatron unpickles a file it is known to hold data only; one that cannot be
read is a :class:`~mcore_flash.checkpoint.manifest.CorruptCheckpoint`. The RNG files are ours
and are loaded with ``weights_only=True`` directly (:func:`load_rng_file`). One exception to
"data only": the optimizer classes of :data:`OPTIMIZER_CLASSES` (why: :func:`check_pickles`).
"""

from __future__ import annotations

import functools
import io
import os
import pickle

import torch

from mcore_flash.checkpoint.manifest import CorruptCheckpoint
from mcore_flash.optim.host_adam import HostAdamW

_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner")
_ALLOWED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # rebuilds a torch.layout from its name
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id when DCP was given a path object
    ("pathlib", "PurePosixPath"),
}


# the classes megatron-core's offloaded optimizer stores in its param groups (HostAdamW: its host
# step with narrower moments, :mod:`mcore_flash.optim.host_adam`)
OPTIMIZER_CLASSES = (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD, HostAdamW)


class UnsafeCheckpoint(CorruptCheckpoint):
    """A checkpoint file holds a pickle that would build something other than data."""


def load_common_state(path: str) -> dict:
    """The common (non-sharded) state of the checkpoint at ``path``, as megatron's
    ``load_common_state_dict`` returns it, after :func:`check_pickles`.

    megatron-core 0.16 keeps it in ``common.pt``, loaded here with ``weights_only=True``
    whatever the environment says; 0.19 keeps it as a byte item (``common_state``) in the
    DCP files, which megatron reads with ``weights_only=True`` itself.
    """
    check_pickles(path)
    common = os.path.join(path, "common.pt")
    if os.path.exists(common):
        return _weights_only(
            common, lambda: torch.load(common, map_location="cpu", weights_only=True)
        )
    from megatron.core import dist_checkpointing

    return dist_checkpointing.load_common_state_dict(path)


def check_pickles(path: str) -> None:
    """Read the pickles of the torch_dist checkpoint at ``path`` that megatron would load
    unrestricted (``.metadata``, the byte items) with a restricted unpickler first; for
    ``common.pt`` :func:`load_common_state` is that check. Only the byte items are read, at
    their offsets, not the tensor data; one that cannot be read is a damaged checkpoint.

    How megatron-core 0.16-0.19 (torch 2.13) would load each kind of pickle:

    * ``.metadata``: DCP's index, read with ``pickle.load``
      (``FileSystemReader.read_metadata``);
    * the byte items inside ``__*_*.distcp`` (optimizer param groups, layers' extra state):
      ``torch.load(weights_only=False)`` in ``DefaultLoadPlanner.load_bytes``;
    * ``common.pt``: ``torch.load`` with torch's default, ``weights_only=True`` unless the
      environment sets ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD``.

    One exception to "data only": megatron-core's ``HybridDeviceOptimizer``
    (``--optimizer-cpu-offload``) keeps its sub-optimizers' classes in its param groups
    (``cpu_optimizer_cls``, ``gpu_optimizer_cls``:
    ``optimizer/cpu_offloading/hybrid_optimizer.py``), so the byte items may name torch's own
    optimizer classes and ours (:data:`OPTIMIZER_CLASSES`); naming them imports nothing new,
    and building one runs only an optimizer constructor."""
    metadata_path = os.path.join(path, ".metadata")
    if not os.path.exists(metadata_path):
        return
    with open(metadata_path, "rb") as f:
        metadata = _DCPMetadataUnpickler(f, metadata_path).load()
    for index, info in metadata.storage_data.items():
        if not _is_bytes_item(metadata, index.fqn):
            continue
        item = os.path.join(path, info.relative_path)
        if info.transform_descriptors:
            raise UnsafeCheckpoint(
                f"{item}: item {index.fqn!r} is stored through transforms "
                f"{list(info.transform_descriptors)}, which cannot be checked before loading"
            )
        with open(item, "rb") as f:
            f.seek(info.offset)
            data = io.BytesIO(f.read(info.length))
        with torch.serialization.safe_globals(list(OPTIMIZER_CLASSES)):
            _weights_only(
                f"{item} (item {index.fqn!r})",
                functools.partial(torch.load, data, weights_only=True),
            )


def load_rng_file(path: str) -> dict:
    """One of our ``rng_rank*.pt`` files: tensors, numbers and strings only."""
    return _weights_only(path, lambda: torch.load(path, weights_only=True))


def _weights_only(name: str, load):
    """``load()`` (a ``torch.load(..., weights_only=True)``), its failures named after ``name``."""
    try:
        return load()
    except pickle.UnpicklingError as error:
        raise UnsafeCheckpoint(
            f"{name} holds a pickle that torch's weights_only loader refuses ({str(error)[:300]}); "
            "a checkpoint written by mcore-flash never does: refusing to load it"
        ) from error
    except (RuntimeError, EOFError, ValueError) as error:  # not a torch.save stream: damaged bytes
        raise CorruptCheckpoint(
            f"{name} cannot be read ({str(error)[:200]}): the checkpoint is damaged"
        ) from error


def _is_bytes_item(metadata, fqn: str) -> bool:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    return isinstance(metadata.state_dict_metadata.get(fqn), BytesStorageMetadata)


class _DCPMetadataUnpickler(pickle.Unpickler):
    """Builds DCP's ``Metadata`` and nothing else: its classes, torch sizes and dtypes."""

    def __init__(self, file, name: str):
        super().__init__(file)
        self._name = name

    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED or module in _DCP_MODULES:
            found = super().find_class(module, name)
            if module not in _DCP_MODULES or isinstance(found, type):
                return found
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpoint(
            f"{self._name} asks to unpickle {module}.{name}, which DCP's metadata never holds: "
            "refusing to load the checkpoint (a pickle can run code)"
        )

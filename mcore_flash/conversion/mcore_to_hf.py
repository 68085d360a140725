"""A megatron checkpoint (converted, or written by ``mcore-flash pretrain`` at any TP/PP) ->
a Hugging Face Llama directory: ``config.json`` + ``*.safetensors`` (+ index), streamed.

Each megatron tensor is read one layer at a time from its global layout
(:func:`mcore_flash.conversion.dcp_stream.load_chunk`), split into its Hugging Face tensors
and appended to the current safetensors shard. The model comes from the ``model_args``
stored in the checkpoint, so RoPE settings changed by continued pretraining are exported;
token ids and other metadata come from the original ``config.json`` when the checkpoint was
converted from one. Written under ``<save-hf>.tmp`` and renamed into place.
"""

from __future__ import annotations

import json
import os

import torch

from mcore_flash.conversion import dcp_stream
from mcore_flash.conversion.hf_config import ConversionError, hf_config_from_model_args
from mcore_flash.conversion.llama import tensor_maps
from mcore_flash.conversion.output import Progress, atomic_directory
from mcore_flash.conversion.safetensors_io import StreamingSafetensorsWriter
from mcore_flash.training import checkpointing

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' "5GB"


def mcore_to_hf(
    load: str, save_hf: str, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, log=print
) -> dict:
    """Export the latest checkpoint under ``load``; returns ``{"config", "files", "iteration"}``."""
    path, common = checkpointing.read_latest(load, verify_all=True)
    model_args = common.get("model_args")
    if model_args is None:
        raise ConversionError(
            f"--load {load}: the checkpoint does not record its model flags (written before they were stored)"
        )
    config = hf_config_from_model_args(model_args, common.get("hf_config"))

    stored = dcp_stream.stored_tensors(path)
    maps = tensor_maps(model_args, common["padded_vocab_size"])
    missing = sorted({m.key for m in maps} - set(stored))
    if missing:
        raise ConversionError(
            f"--load {load}: the checkpoint lacks {missing[:3]}: not a Llama-shaped GPT checkpoint"
        )
    dtype = stored[maps[0].key][1]
    plan = [
        (name, tuple(t.shape), dtype)
        for m in maps
        for name, t in zip(m.hf_names, m.to_hf(_meta(m, stored)))
    ]
    config["torch_dtype"] = str(dtype).removeprefix("torch.")

    progress = Progress(len(maps), log)
    with atomic_directory(save_hf, "--save-hf") as tmp:
        writer = StreamingSafetensorsWriter(tmp, plan, max_shard_bytes)
        for tensor_map in maps:
            for name, tensor in zip(
                tensor_map.hf_names, tensor_map.to_hf(_read(path, tensor_map, stored))
            ):
                writer.write(name, tensor.to(dtype).contiguous())
            progress.step(tensor_map.key, tensor_map.layer)
        files = writer.close()
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
    return {"config": config, "files": files, "iteration": common["iteration"]}


def _chunk(tensor_map, stored) -> dcp_stream.Chunk:
    shape, dtype = stored[tensor_map.key]
    if tensor_map.layer is None:
        return dcp_stream.Chunk(tensor_map.key, shape, (0,) * len(shape), shape, dtype)
    return dcp_stream.Chunk(
        tensor_map.key, shape, (tensor_map.layer,) + (0,) * (len(shape) - 1), (1, *shape[1:]), dtype
    )


def _meta(tensor_map, stored) -> torch.Tensor:
    chunk = _chunk(tensor_map, stored)
    sizes = chunk.sizes[1:] if tensor_map.layer is not None else chunk.sizes
    return torch.empty(sizes, dtype=chunk.dtype, device="meta")


def _read(path: str, tensor_map, stored) -> torch.Tensor:
    tensor = dcp_stream.load_chunk(path, _chunk(tensor_map, stored))
    return tensor[0] if tensor_map.layer is not None else tensor

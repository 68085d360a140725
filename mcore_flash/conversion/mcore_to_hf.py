"""A megatron checkpoint (converted, or written by ``mcore-flash pretrain`` at any TP/PP) ->
a Hugging Face Llama / Qwen2 / Qwen3 directory: ``config.json`` + ``*.safetensors`` (+ index), streamed.

Each megatron tensor is read one layer at a time from its global layout
(:func:`mcore_flash.checkpoint.dcp_stream.load_chunk`), split into its Hugging Face tensors
and appended to the current safetensors shard. The model comes from the ``model_args``
stored in the checkpoint, so RoPE settings changed by continued pretraining are exported;
token ids and other metadata come from the original ``config.json`` when the checkpoint was
converted from one. The tokenizer files stored with the checkpoint (``<load>/tokenizer/``) are
copied back, checked against the checkpoint's record, and its ``generation_config.json`` is
written where the source had one, so ``AutoTokenizer``, ``AutoModelForCausalLM`` and
``pipeline("text-generation")`` load the export. Written under ``<save-hf>.tmp`` and renamed into
place.

A ``--use-megatron-fsdp`` checkpoint (``fsdp_dtensor``) stores each module's weight under its
own name, one tensor per layer, as the TP shards laid side by side (:class:`_Source`).
"""

from __future__ import annotations

import json
import os

import torch

from mcore_flash.checkpoint import dcp_stream, directory
from mcore_flash.conversion.hf_config import ConversionError, hf_config_from_model_args
from mcore_flash.conversion.llama import tensor_maps
from mcore_flash.conversion.output import Progress, atomic_directory
from mcore_flash.conversion.safetensors_io import StreamingSafetensorsWriter
from mcore_flash.data.tokenizers import TOKENIZER_DIR, store_tokenizer

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' "5GB"


def mcore_to_hf(
    load: str, save_hf: str, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, log=print
) -> dict:
    """Export the latest checkpoint under ``load``; returns ``{"config", "files", "iteration",
    "tokenizer_files"}``."""
    path, common = directory.read_latest(load, verify_all=True)
    model_args = common.get("model_args")
    if model_args is None:
        raise ConversionError(
            f"--load {load}: the checkpoint does not record its model flags (written before they were stored)"
        )
    config = hf_config_from_model_args(model_args, common.get("hf_config"))

    source = _Source(path, common)
    maps = tensor_maps(model_args, common["padded_vocab_size"])
    missing = sorted({source.key(m) for m in maps} - set(source.stored))
    if missing:
        raise ConversionError(
            f"--load {load}: the checkpoint lacks {missing[:3]}: not a checkpoint of the model its flags describe"
        )
    dtype = source.stored[source.key(maps[0])][1]
    plan = [
        (name, tuple(t.shape), dtype)
        for m in maps
        for name, t in zip(m.hf_names, m.to_hf(source.meta(m)))
    ]
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    tokenizer = common.get("tokenizer")
    tokenizer_dir = os.path.join(load, TOKENIZER_DIR)
    if tokenizer and not os.path.isdir(tokenizer_dir):
        log(
            f"warning: the checkpoint records tokenizer files ({', '.join(tokenizer['files'])}) but "
            f"{tokenizer_dir} is gone: the export has no tokenizer (copy it from the source model)"
        )
        tokenizer = None

    progress = Progress(len(maps), log)
    with atomic_directory(save_hf, "--save-hf") as tmp:
        writer = StreamingSafetensorsWriter(tmp, plan, max_shard_bytes)
        for tensor_map in maps:
            for name, tensor in zip(tensor_map.hf_names, tensor_map.to_hf(source.read(tensor_map))):
                writer.write(name, tensor.to(dtype).contiguous())
            progress.step(tensor_map.key, tensor_map.layer)
        files = writer.close()
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        if common.get("generation_config") is not None:
            with open(os.path.join(tmp, "generation_config.json"), "w") as f:
                json.dump(common["generation_config"], f, indent=2)
        if tokenizer:
            store_tokenizer(tokenizer_dir, tmp, tokenizer)
    return {
        "config": config,
        "files": files,
        "iteration": common["iteration"],
        "tokenizer_files": sorted(tokenizer["files"]) if tokenizer else [],
    }


class _Source:
    """Where each megatron tensor of :func:`tensor_maps` lies in the checkpoint at ``path``.

    torch_dist: under megatron's sharded key, per-layer tensors on a leading layer axis.
    fsdp_dtensor: ``model.module.<the module's name>`` per layer (the layer norms by their
    module names, which our spec's ``sharded_state_dict_keys_map`` renames for torch_dist:
    ``mcore_flash/transformer/specs.py``), each the TP shards concatenated on the partition
    dimension, so SwiGLU's ``linear_fc1`` is ``[gate_0; up_0; gate_1; up_1; ...]`` at TP > 1.
    """

    _FSDP_NAMES = {
        "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
        "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    }

    def __init__(self, path: str, common: dict):
        self.path = path
        self.fsdp = directory.saved_format(common) == "fsdp_dtensor"
        self.tp = (common.get("optimizer_layout") or {}).get("tensor_model_parallel_size", 1)
        self.stored = dcp_stream.stored_tensors(path)

    def key(self, tensor_map) -> str:
        if not self.fsdp:
            return tensor_map.key
        if tensor_map.layer is None:
            return f"model.module.{tensor_map.key}"
        suffix = tensor_map.key.removeprefix("decoder.layers.")
        name = self._FSDP_NAMES.get(suffix, suffix)
        return f"model.module.decoder.layers.{tensor_map.layer}.{name}"

    def _chunk(self, tensor_map) -> dcp_stream.Chunk:
        key = self.key(tensor_map)
        shape, dtype = self.stored[key]
        if self.fsdp or tensor_map.layer is None:
            return dcp_stream.Chunk(key, shape, (0,) * len(shape), shape, dtype)
        offsets = (tensor_map.layer,) + (0,) * (len(shape) - 1)
        return dcp_stream.Chunk(key, shape, offsets, (1, *shape[1:]), dtype)

    def _layered(self, tensor_map) -> bool:
        return tensor_map.layer is not None and not self.fsdp

    def meta(self, tensor_map) -> torch.Tensor:
        chunk = self._chunk(tensor_map)
        sizes = chunk.sizes[1:] if self._layered(tensor_map) else chunk.sizes
        return torch.empty(sizes, dtype=chunk.dtype, device="meta")

    def read(self, tensor_map) -> torch.Tensor:
        tensor = dcp_stream.load_chunk(self.path, self._chunk(tensor_map))
        if self._layered(tensor_map):
            return tensor[0]
        if self.fsdp and self.tp > 1 and tensor_map.key.endswith("mlp.linear_fc1.weight"):
            # [g_0; u_0; g_1; u_1; ...] -> [g; u]
            rows = tensor.shape[0] // (2 * self.tp)
            tensor = tensor.reshape(self.tp, 2, rows, -1).transpose(0, 1).reshape(tensor.shape)
        return tensor

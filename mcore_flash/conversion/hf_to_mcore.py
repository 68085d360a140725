"""Hugging Face Llama / Qwen2 / Qwen3 (safetensors) -> a megatron ``dist_checkpointing`` checkpoint, streamed.

The checkpoint's layout (keys, global shapes, chunks, megatron's per-module extra-state
objects) is read off the model ``mcore-flash pretrain`` would build, instantiated on the meta
device; its data is produced chunk by chunk from the Hugging Face tensors while DCP writes
(:mod:`mcore_flash.checkpoint.dcp_stream`), so memory holds one layer's tensor at a time.

megatron stores tensors in their global layout, which any TP/PP loads; the TP size only
decides the vocabulary padding (a multiple of ``--make-vocab-size-divisible-by`` x TP) and,
with PP, is validated against the model. The result is written under ``<save>.tmp`` and
renamed into place, like a training checkpoint: a failed conversion leaves nothing at ``--save``.

The source's tokenizer files (whichever of :data:`mcore_flash.data.tokenizers.TOKENIZER_FILES`
exist) are copied into ``<save>/tokenizer/`` and recorded in the checkpoint's common state, as
its ``generation_config.json`` is, so later commands need no tokenizer flags.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from mcore_flash.checkpoint import dcp_stream, directory, manifest
from mcore_flash.conversion.hf_config import (
    ConversionError,
    architecture_of,
    model_args_from_hf,
    model_flags,
    read_config,
    read_generation_config,
)
from mcore_flash.conversion.llama import hf_shape, tensor_maps
from mcore_flash.conversion.output import Progress, atomic_directory
from mcore_flash.conversion.safetensors_io import HFCheckpointReader
from mcore_flash.data.tokenizers import TOKENIZER_DIR, padded_vocab_size, store_tokenizer

# DCP's writer keeps the last chunk it wrote of every key alive until the file is done
# (torch 2.13 ``_write_files_from_queue``), so chunks are cut into row blocks of at most
# this size: what stays alive is one block per key, not an embedding per key.
BLOCK_BYTES = 64 * 2**20

# Buffers some Hugging Face checkpoints carry that are not weights (recomputed from the config).
_NOT_WEIGHTS = ("rotary_emb.inv_freq",)


def hf_to_mcore(
    hf_dir: str,
    save: str,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    make_vocab_size_divisible_by: int = 128,
    bf16: bool = False,
    log=print,
) -> dict:
    """Convert; returns ``{"model_args", "padded_vocab_size", "flags", "path", "tokenizer"}``
    (``tokenizer``: the record of the tokenizer files copied to ``<save>/tokenizer/``, None when
    ``hf_dir`` has none)."""
    from mcore_flash.runtime.arguments import parse_args

    config = read_config(hf_dir)
    generation_config = read_generation_config(hf_dir)
    model_args = model_args_from_hf(config)
    flags = model_flags(model_args) + (["--bf16"] if bf16 else [])
    layout_flags = [
        "--tensor-model-parallel-size",
        str(tensor_parallel),
        "--pipeline-model-parallel-size",
        str(pipeline_parallel),
        "--make-vocab-size-divisible-by",
        str(make_vocab_size_divisible_by),
    ]
    try:
        parse_args(flags + layout_flags, world_size=tensor_parallel * pipeline_parallel)
    except ValueError as error:  # e.g. heads not divisible by TP: name the flag
        raise ConversionError(str(error)) from None
    reader = HFCheckpointReader(hf_dir)
    padded = padded_vocab_size(
        model_args["vocab_size"], make_vocab_size_divisible_by, tensor_parallel
    )
    maps = tensor_maps(model_args, padded)
    _check_tensors(reader, maps, model_args)
    if padded != model_args["vocab_size"]:
        log(
            f"note: vocabulary padded from {model_args['vocab_size']} to {padded} rows (multiple of "
            f"--make-vocab-size-divisible-by {make_vocab_size_divisible_by} x TP {tensor_parallel}); the padding rows "
            "are zero, so their logits are 0 and, as in Megatron-LM, take part in the softmax. Choose "
            "--make-vocab-size-divisible-by so that it times TP divides the vocabulary to avoid padding."
        )

    dtype = torch.bfloat16 if bf16 else torch.float32
    chunks, objects = _checkpoint_layout(_layout_config(flags, model_args), padded)
    chunks = [block for chunk in chunks for block in _row_blocks(chunk, BLOCK_BYTES)]
    by_tensor = {(m.key, m.layer): m for m in maps}
    expected = {(c.key, c.offsets[0] if _layered(c) else None) for c in chunks}
    if expected != set(by_tensor):
        raise AssertionError(
            f"megatron's checkpoint layout and the tensor mapping disagree: {expected ^ set(by_tensor)}"
        )

    with atomic_directory(save, "--save") as tmp:
        # the tokenizer beside the checkpoints (outside iter_*), recorded in their common state
        tokenizer = store_tokenizer(hf_dir, os.path.join(tmp, TOKENIZER_DIR))
        path = directory.checkpoint_dir(tmp, 0)
        os.makedirs(path)
        dcp_stream.save_chunks(
            path,
            chunks,
            objects,
            _ChunkSource(reader, by_tensor, dtype, Progress(len(by_tensor), log)),
        )
        _write_megatron_files(
            path,
            {
                "iteration": 0,
                "consumed_samples": 0,
                "padded_vocab_size": padded,
                "model_args": model_args,
                "hf_config": config,
                "generation_config": generation_config,  # None: the directory had none
                "tokenizer": tokenizer,  # None: likewise
                "converted_from": os.path.abspath(hf_dir),
                "model_only": True,
            },
        )
        manifest.write_manifest(path)
        directory.write_marker(tmp, 0)
    return {
        "model_args": model_args,
        "padded_vocab_size": padded,
        "flags": flags,
        "path": save,
        "tokenizer": tokenizer,
    }


class _ChunkSource:
    """Data for each chunk DCP writes: the layer's megatron tensor, built once from its
    Hugging Face tensors (kept while the next chunk is of the same tensor), then narrowed."""

    def __init__(self, reader, maps, dtype, progress):
        self._reader, self._maps, self._dtype, self._progress = reader, maps, dtype, progress
        self._cached, self._seen = (None, None), set()

    def __call__(self, chunk: dcp_stream.Chunk) -> torch.Tensor:
        layered = _layered(chunk)
        which = (chunk.key, chunk.offsets[0] if layered else None)
        tensor_map = self._maps[which]
        if self._cached[0] is not tensor_map:
            self._cached = (None, None)  # free the previous tensor before building the next
            full = tensor_map.to_mcore([self._reader.get(name) for name in tensor_map.hf_names]).to(
                self._dtype
            )
            self._cached = (tensor_map, full)
            if which not in self._seen:
                self._seen.add(which)
                self._progress.step(*which)
        tensor = self._cached[1]
        offsets, sizes = (
            (chunk.offsets[1:], chunk.sizes[1:]) if layered else (chunk.offsets, chunk.sizes)
        )
        for dim, (start, size) in enumerate(zip(offsets, sizes)):
            tensor = tensor.narrow(dim, start, size)
        return tensor.reshape(chunk.sizes)  # DCP copies a view of a larger tensor before writing it


def _row_blocks(chunk: dcp_stream.Chunk, max_bytes: int) -> list[dcp_stream.Chunk]:
    """``chunk`` cut along its first row dimension (after the layer axis) into blocks of at
    most ``max_bytes`` (any cover of a tensor by chunks loads: DCP reads by overlap)."""
    dim = 1 if _layered(chunk) else 0
    if len(chunk.sizes) <= dim:
        return [chunk]
    row_bytes = torch.empty((), dtype=chunk.dtype).element_size()
    for i, size in enumerate(chunk.sizes):
        row_bytes *= size if i != dim else 1
    rows = max(1, max_bytes // row_bytes)
    blocks = []
    for start in range(0, chunk.sizes[dim], rows):
        offsets, sizes = list(chunk.offsets), list(chunk.sizes)
        offsets[dim] += start
        sizes[dim] = min(rows, chunk.sizes[dim] - start)
        blocks.append(dataclasses.replace(chunk, offsets=tuple(offsets), sizes=tuple(sizes)))
    return blocks


def _layered(chunk: dcp_stream.Chunk) -> bool:
    return chunk.key.startswith("decoder.layers.")


def _layout_config(flags: list[str], model_args: dict):
    """The one-process training config of the model ``model_args`` describes. ``flags`` leave
    out a model flag whose value is false, which the trainer then takes from its default preset
    (``--use-checkpoint-args`` takes them from the checkpoint): here every model field is the
    checkpoint's, so that a tied model's layout has one embedding, as the trainer saves it."""
    from mcore_flash.runtime.arguments import parse_config

    config = parse_config(flags + ["--dry-run"], world_size=1)
    fields = {f.name for f in dataclasses.fields(config)}
    return dataclasses.replace(
        config, **{name: value for name, value in model_args.items() if name in fields}
    )


def _checkpoint_layout(args, padded: int):
    """Chunks and objects of the TP1/PP1 model's sharded state dict (built on the meta device)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    from mcore_flash.runtime.distributed import destroy_distributed, init_fake_world
    from mcore_flash.runtime.model import build_model, transformer_config

    init_fake_world(args)
    try:
        with torch.device("meta"):
            model = build_model(args, transformer_config(args), padded)
        chunks, objects = [], []
        for item in nested_values(model.sharded_state_dict()):
            if hasattr(item, "build"):  # a ShardedTensorFactory (the GLU fc1: gate and up halves)
                parts = list(nested_values(item.build()))
            else:
                parts = [item]
            for part in parts:
                if isinstance(part, ShardedObject):
                    objects.append(dcp_stream.BytesItem(part.unique_key, [part.data]))
                elif isinstance(part, ShardedTensor):  # TP = PP = DP = 1: no replicas
                    sizes = (1,) * part.prepend_axis_num + tuple(part.local_shape)
                    chunks.append(
                        dcp_stream.Chunk(
                            part.key,
                            tuple(part.global_shape),
                            tuple(part.global_offset),
                            sizes,
                            part.dtype,
                        )
                    )
        return chunks, objects
    finally:
        destroy_distributed()


def _check_tensors(reader: HFCheckpointReader, maps, model_args: dict) -> None:
    """Every tensor the mapping needs is there with the shape config.json implies; nothing else is."""
    wanted = {name for m in maps for name in m.hf_names}
    extra = sorted(n for n in reader.names() - wanted if not n.endswith(_NOT_WEIGHTS))
    if extra:
        hint = " (config.json says tie_word_embeddings=true)" if "lm_head.weight" in extra else ""
        raise ConversionError(
            f"unexpected tensor(s) in the checkpoint, not part of a {architecture_of(model_args)} with this "
            f"config.json{hint}: {extra[:5]}"
        )
    for name in sorted(wanted):
        shape, expected = reader.shape(name), hf_shape(name, model_args)
        if shape != expected:
            what = (
                "vocab_size"
                if name in ("model.embed_tokens.weight", "lm_head.weight")
                else "the model shape"
            )
            raise ConversionError(
                f"tensor {name} has shape {shape} but config.json ({what}) implies {expected}: "
                "the checkpoint and its config.json do not match"
            )


def _write_megatron_files(path: str, common: dict) -> None:
    """megatron's ``metadata.json`` (format: torch_dist) and ``common.pt`` (non-tensor state)."""
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config

    save_config(CheckpointingConfig("torch_dist"), path)
    torch.save(common, os.path.join(path, "common.pt"))

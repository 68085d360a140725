"""Megatron's MLP computed in sequence tiles (ALST's TiledMLP): fc1 -> activation -> fc2 per
tile of tokens, each tile's intermediates recomputed in its own backward.

The ``[s, b, 2*ffn/TP]`` fc1 output and ``[s, b, ffn/TP]`` activation then exist for one tile at
a time, in forward, in backward and inside full / attention / qkv recompute (which re-run the
layer and so re-run the tiles). The MLP is position-wise, so a tile is simply a slice of this
rank's rows: under sequence parallelism megatron's fc1 all-gathers the tile's rows of every rank
and fc2 reduce-scatters them back, one tile at a time. Cost: the MLP's forward runs once more
per step (the tile's recompute), and the collectives are per tile.

The tiles are megatron's checkpoints (``tensor_parallel.checkpoint``, reentrant): each saves its
input slice with ``save_for_backward``, so what sees a layer's saved tensors (activation offload's
hooks) sees the tiles' inputs too, and parks them like any other.
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.mlp import MLP


class TiledMLP(MLP):
    """``MLP`` whose forward runs in tiles of ``chunk_size`` tokens of the fc1 GEMM (under
    sequence parallelism ``chunk_size / TP`` of this rank's rows per tile); None: untiled.
    Input ``[s_local, b, h]``, output ``([s_local, b, h], bias)`` as megatron's."""

    def __init__(self, *args, chunk_size: Optional[int] = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.chunk_size = chunk_size

    @classmethod
    def as_mlp_submodule(cls, *args, chunk_size: Optional[int] = None, **kwargs):
        """megatron-core 0.18+'s builder (``MLP.as_mlp_submodule``), with the tile size."""
        mlp = super().as_mlp_submodule(*args, **kwargs)
        mlp.chunk_size = chunk_size
        return mlp

    def forward(self, hidden_states, per_token_scale=None, **kwargs):
        rows = self.chunk_size
        if rows is not None and self.config.sequence_parallel:
            rows //= self.config.tensor_model_parallel_size
        if rows is None or hidden_states.shape[0] <= rows:
            return super().forward(hidden_states, per_token_scale, **kwargs)
        if per_token_scale is not None:
            raise ValueError("--mlp-chunk-size: the tiled MLP takes no per_token_scale (MoE)")
        outputs = [
            tensor_parallel.checkpoint(self._tile, False, tile)
            for tile in hidden_states.split(rows, dim=0)
        ]
        bias = self.linear_fc2.bias if self.linear_fc2.skip_bias_add else None
        return torch.cat(outputs, dim=0), bias

    def _tile(self, tile: torch.Tensor) -> torch.Tensor:
        output, _ = super().forward(tile)
        return output

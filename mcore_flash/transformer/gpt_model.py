"""``TiledLossGPTModel``: megatron-core's ``GPTModel`` whose training loss can be computed per tile.

With ``loss_chunk_size`` set, a forward with labels (training and evaluation, not inference or
multi-token prediction) computes the output layer and the vocab-parallel cross-entropy together,
one tile of tokens at a time (:mod:`mcore_flash.transformer.linear_cross_entropy`), instead of
megatron's whole-sequence ``[s, b, V/TP]`` logits. Everything else (no labels: logits; the
checkpoint layout; tied embeddings) is ``GPTModel``'s own.
"""

from __future__ import annotations

from typing import Optional

from megatron.core.models.gpt import GPTModel

from .linear_cross_entropy import linear_cross_entropy


class TiledLossGPTModel(GPTModel):
    """``GPTModel(*args, **kwargs)`` plus ``loss_chunk_size`` (tokens per loss tile; None: the
    whole sequence, megatron's path). The returned loss is megatron's: per token, ``[b, s]``."""

    def __init__(self, *args, loss_chunk_size: Optional[int] = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_chunk_size = loss_chunk_size

    def _postprocess(self, **kwargs):
        labels = kwargs["labels"]
        if (
            self.loss_chunk_size is None
            or not self.post_process
            or labels is None
            or kwargs.get("mtp_in_postprocess")
            or kwargs.get("inference_context") is not None
        ):
            return super()._postprocess(**kwargs)
        weight = (
            self.shared_embedding_or_output_weight()
            if self.share_embeddings_and_output_weights
            else self.output_layer.weight
        )
        loss = linear_cross_entropy(
            kwargs["hidden_states"],
            weight,
            labels.transpose(0, 1).contiguous(),
            self.loss_chunk_size,
            self.output_layer.tp_group,
            self.output_layer.sequence_parallel,
        )
        return loss.transpose(0, 1).contiguous()

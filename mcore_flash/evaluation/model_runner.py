"""The trainer's model loaded from a checkpoint and run forward-only under TP, PP and CP.

:class:`LoadedModel` answers one question for a batch of equal-length sequences: at every
position, the greedy next token and (given labels) the token's loss. Everything the
evaluation tasks need follows from that: a needle is retrieved exactly by greedy decoding
iff the greedy token at every answer position, fed the true answer so far, is the true
answer token (so one teacher-forced pass scores exact greedy retrieval), and loss by position
is the loss array bucketed.

How the parallel pieces fit: the sequences are split over the CP ranks as in training
(chunks ``r`` and ``2cp-1-r``); each rank computes its positions' argmax and loss on the
last pipeline stage from the full-vocabulary logits (``parallel_output=False``: identical on
every TP rank), scatters them into a zero ``[n, s]`` array at its positions, the CP ranks
sum those arrays, and the last stage broadcasts them over the pipeline group. Every rank
returns the same arrays. Data-parallel replicas compute the same batch (no sharding).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mcore_flash import platform
from mcore_flash.transformer.context_parallel import get_batch_on_this_cp_rank

__all__ = ["LoadedModel"]


class LoadedModel:
    """The latest checkpoint under ``args.load`` in the model ``mcore-flash pretrain`` builds
    for ``args``; construct after ``init_distributed(args)``."""

    def __init__(self, args):
        from mcore_flash.runtime.trained_model import load_trained_model

        loaded = load_trained_model(args)
        self.model, self.tokenizer, self.config = (
            loaded.model,
            loaded.tokenizer,
            loaded.model_config,
        )
        self.vocab_size = self.tokenizer.vocab_size
        self.iteration = loaded.iteration

    @torch.no_grad()
    def predict(
        self, tokens: torch.Tensor, labels: Optional[torch.Tensor] = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy next tokens and per-token losses at every position.

        ``tokens``, ``labels``: ``[n, s]`` int64 (positions ``0..s-1``; ``s`` divisible by
        ``2 * cp``, and by ``tp * cp`` with sequence parallelism). Returns ``(greedy [n, s]
        int64, loss [n, s] float32 in nats)``; ``loss`` is zero when ``labels`` is None.
        The greedy token is the argmax over the real vocabulary (never a padding row).
        """
        from megatron.core import parallel_state
        from megatron.core.pipeline_parallel import get_forward_backward_func

        device = platform.torch_device()
        n, s = tokens.shape
        batch = {
            "tokens": tokens.to(device),
            "labels": (labels if labels is not None else torch.zeros_like(tokens)).to(device),
            "position_ids": torch.arange(s, device=device).expand(n, s).contiguous(),
        }
        local = get_batch_on_this_cp_rank(batch)
        greedy = torch.zeros(
            n, s, dtype=torch.float32, device=device
        )  # float: token ids < 2^24 are exact
        loss = torch.zeros(n, s, dtype=torch.float32, device=device)

        def keep_outputs(logits):  # [n, s_local, padded vocab] on the last stage
            logits = logits[..., : self.vocab_size].float()
            greedy.scatter_(1, local["position_ids"], logits.argmax(dim=-1).float())
            if labels is not None:
                token_loss = (
                    -F.log_softmax(logits, dim=-1)
                    .gather(-1, local["labels"].unsqueeze(-1))
                    .squeeze(-1)
                )
                loss.scatter_(1, local["position_ids"], token_loss)
            return logits.sum() * 0, torch.tensor(1, dtype=torch.int), {}

        def forward_step(data_iterator, model):
            return model(local["tokens"], local["position_ids"], None), keep_outputs

        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter([None]),
            model=[self.model],
            num_microbatches=1,
            seq_length=s,
            micro_batch_size=n,
            decoder_seq_length=s,
            forward_only=True,
        )
        out = torch.stack([greedy, loss])
        if parallel_state.get_context_parallel_world_size() > 1:
            dist.all_reduce(out, group=parallel_state.get_context_parallel_group())
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            dist.broadcast(
                out,
                parallel_state.get_pipeline_model_parallel_last_rank(),
                group=parallel_state.get_pipeline_model_parallel_group(),
            )
        return out[0].long().cpu(), out[1].cpu()

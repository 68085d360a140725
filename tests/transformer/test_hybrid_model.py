"""Our spec in megatron-core's HybridModel (0.19+) against GPTModel with the flash spec.

Oracle: the GPTModel run (itself tested against megatron's stock local spec), with its
weights copied into the HybridModel by ``gpt_to_hybrid_state_dict``. Before 0.19 (no
HybridModel) the spec builder must refuse with the fix.
"""

from __future__ import annotations

import logging
from importlib.metadata import version

import pytest
import torch

from _support.dist_utils import init_megatron, run_distributed, teardown_megatron
from _support.gpt_models import SEQ, VOCAB, batch, flash_gpt, tiny_config

HAS_HYBRID_MODEL = tuple(int(x) for x in version("megatron-core").split(".")[:2]) >= (0, 19)
WARNINGS = ("DEPRECATED", "Rewrapping")


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _loss_and_grads(model):
    tokens, labels, positions = batch()
    loss = model(tokens, positions, None, labels=labels).mean()
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def _w_hybrid_vs_gpt(rank, world_size):
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    from mcore_flash.transformer.hybrid import (
        get_hybrid_flash_stack_spec,
        gpt_to_hybrid_state_dict,
        hybrid_config,
        hybrid_layer_pattern,
    )

    init_megatron(tp=1)
    records = _Records()
    logging.getLogger("megatron").addHandler(records)
    try:
        config = tiny_config(use_te_activation_func=True, hidden_dropout=0.1)
        gpt = flash_gpt(config)
        gpt_warnings = [m for m in records.messages if any(w in m for w in WARNINGS)]
        records.messages.clear()
        torch.manual_seed(5)  # other initial weights: the copy below must make them equal
        hybrid = HybridModel(
            hybrid_config(config),
            get_hybrid_flash_stack_spec(config),
            vocab_size=VOCAB,
            max_sequence_length=4 * SEQ,
            hybrid_layer_pattern=hybrid_layer_pattern(config.num_layers),
            position_embedding_type="rope",
        )
        hybrid_warnings = [m for m in records.messages if any(w in m for w in WARNINGS)]
        hybrid.load_state_dict(gpt_to_hybrid_state_dict(gpt.state_dict()), strict=True)
        results = []
        for model in (gpt, hybrid):
            torch.manual_seed(11)  # the same dropout masks in both
            results.append(_loss_and_grads(model))
        return dict(gpt_warnings=gpt_warnings, hybrid_warnings=hybrid_warnings, results=results)
    finally:
        logging.getLogger("megatron").removeHandler(records)
        teardown_megatron()


@pytest.mark.skipif(
    not HAS_HYBRID_MODEL, reason="HybridModel is new in megatron-core 0.19 (see the test below)"
)
def test_hybrid_model_with_our_spec_equals_gpt_model():
    out = run_distributed(_w_hybrid_vs_gpt, 1)[0]
    assert any(
        "GPTModel IS DEPRECATED" in m for m in out["gpt_warnings"]
    )  # the log capture sees warnings
    assert out["hybrid_warnings"] == []
    (gpt_loss, gpt_grads), (loss, grads) = out["results"]
    torch.testing.assert_close(loss, gpt_loss, atol=1e-6, rtol=1e-6)
    from mcore_flash.transformer.hybrid import gpt_to_hybrid_state_dict

    mapped = gpt_to_hybrid_state_dict(gpt_grads)
    assert mapped.keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, mapped[name], atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.skipif(HAS_HYBRID_MODEL, reason="megatron-core 0.19+ has HybridModel (the test above)")
def test_before_0_19_the_hybrid_spec_names_the_fix():
    from mcore_flash.transformer.hybrid import get_hybrid_flash_stack_spec

    with pytest.raises(
        ImportError, match="needs megatron-core 0.19 or later .*get_gpt_decoder_block_flash_spec"
    ):
        get_hybrid_flash_stack_spec(tiny_config())

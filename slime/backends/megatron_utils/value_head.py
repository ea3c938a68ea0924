"""The critic's model: the actor's GPTModel with its vocabulary head replaced by one scalar per position.

The value head is `score.weight` [1, hidden] of transformers' `*ForTokenClassification` (num_labels 1), so a
critic checkpoint in HF format maps one to one. It is replicated over tensor parallelism: with sequence
parallelism the final hidden states are gathered over the TP group first, and every TP rank computes the same
values (the gather's backward takes this rank's slice, so no gradient is counted twice).
"""
from __future__ import annotations

from typing import Any

import torch
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

# the value head's name in an HF token-classification checkpoint
HF_VALUE_HEAD_KEY = "score.weight"


class ValueHead(torch.nn.Module):
    """Takes GPTModel.output_layer's place: [s, b, h] hidden states -> ([s, b, 1] values, None)."""

    def __init__(self, hidden_size: int, *, sequence_parallel: bool, tp_group: Any, weight: torch.Tensor | None = None):
        super().__init__()
        init = torch.zeros(1, hidden_size) if weight is None else weight.detach().float().reshape(1, hidden_size)
        self.weight = torch.nn.Parameter(init.clone())
        self.sequence_parallel = sequence_parallel
        self.tp_group = tp_group

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, None]:
        # `weight` is the tied embedding GPTModel offers its vocabulary head; the value head has its own
        if self.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False,
                                                          group=self.tp_group)
        return torch.nn.functional.linear(hidden, self.weight.to(hidden.dtype)), None


def attach_value_head(model: Any, weight: torch.Tensor | None = None) -> Any:
    """Replace a last-stage GPTModel's vocabulary head by a value head (zeros unless `weight` is given).

    The model's forward then returns values [b, s, 1] where it returned logits [b, s, V/tp].
    """
    if not model.post_process:
        raise ValueError("only the last pipeline stage holds the output layer a value head replaces")
    config = model.config
    model.output_layer = ValueHead(config.hidden_size, sequence_parallel=bool(config.sequence_parallel),
                                   tp_group=model.pg_collection.tp, weight=weight)
    # a value head shares nothing with the input embedding, whatever the checkpoint ties
    model.share_embeddings_and_output_weights = False
    return model

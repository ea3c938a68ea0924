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


def value_model_provider(pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None) -> Any:
    """A model provider (build_model_and_optimizer's hook) of the critic: the actor's GPTModel, value head on the
    last stage, built before the DDP wrap and the optimizer so the head trains with the rest."""
    from slime.backends.megatron_utils.model import build_gpt_model, model_provider_context

    args, hf_config = model_provider_context()
    model = build_gpt_model(args, hf_config, pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)
    return attach_value_head(model) if post_process else model


def hf_value_head(hf_dir: str) -> torch.Tensor | None:
    """`score.weight` of an HF token-classification checkpoint; None for a language-model checkpoint."""
    from pathlib import Path

    from safetensors import safe_open

    for path in sorted(Path(hf_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            if HF_VALUE_HEAD_KEY in handle.keys():
                return handle.get_tensor(HF_VALUE_HEAD_KEY)
    return None


@torch.no_grad()
def load_value_model(model_chunks: list[Any], hf_dir: str, hf_config: Any) -> bool:
    """The backbone from `hf_dir` (the actor's checkpoint or a token-classification one), the value head from
    its `score.weight` when it has one, else the head stays zero. Returns whether the head was loaded."""
    from megatron.core.utils import unwrap_model

    from slime.models.hf_weights import load_hf_weights

    models = [unwrap_model(chunk) for chunk in model_chunks]
    heads = [(model, model.output_layer) for model in models
             if isinstance(getattr(model, "output_layer", None), ValueHead)]
    for model, _ in heads:  # the loader maps the vocabulary head; the value head is not one
        model.output_layer = torch.nn.Identity()
    try:
        load_hf_weights(model_chunks, hf_dir, hf_config)
    finally:
        for model, head in heads:
            model.output_layer = head
    weight = hf_value_head(hf_dir)
    if weight is not None:
        for _, head in heads:
            head.weight.copy_(weight.reshape(head.weight.shape).to(head.weight.dtype))
    return weight is not None

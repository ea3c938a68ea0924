"""megatron-core's multi-token-prediction block on the GPT model, run only where it is trained.

`mtp_block_spec` builds megatron's MultiTokenPredictionBlock from the family's own layer spec (this project's
SP-capable norms; eh_proj is megatron's column-parallel linear). `MTPGPTModel` changes what the model returns,
not how it computes: megatron's GPTModel turns the MTP outputs into a loss inside the model (given labels, it then
returns the main loss instead of logits), while the RL loss here needs the main logits. So, in training mode with
MTP training on, the model returns the main logits and each MTP depth's logits stacked on the batch dimension
([(1 + D) * b, s, V/tp]) and the loss (slime/backends/megatron_utils/mtp_loss.py) weighs them; otherwise (the
old-policy forward, eval, --mtp-num-layers without --enable-mtp-training) the MTP layers do not run and the
output is the plain logits, unchanged by them.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.transformer.multi_token_prediction import (
    MultiTokenPredictionBlock,
    MultiTokenPredictionBlockSubmodules,
    MultiTokenPredictionLayer,
    MultiTokenPredictionLayerSubmodules,
)
from megatron.core.transformer.spec_utils import ModuleSpec

from slime.models.sp_norm import SequenceParallelNorm


def mtp_block_spec(layer_spec: ModuleSpec, num_layers: int) -> ModuleSpec:
    """megatron's MTP block of `num_layers` layers, each around a transformer layer of `layer_spec`."""
    layer = ModuleSpec(module=MultiTokenPredictionLayer, submodules=MultiTokenPredictionLayerSubmodules(
        enorm=SequenceParallelNorm, hnorm=SequenceParallelNorm, eh_proj=ColumnParallelLinear,
        transformer_layer=layer_spec, layer_norm=SequenceParallelNorm))
    return ModuleSpec(module=MultiTokenPredictionBlock,
                      submodules=MultiTokenPredictionBlockSubmodules(layer_specs=[layer] * num_layers))


@contextlib.contextmanager
def _main_head_only(config: Any) -> Iterator[None]:
    # GPTModel._postprocess turns MTP outputs into a loss whenever config.mtp_num_layers is set; the main head alone
    # runs with it unset (nothing else reads it during the call)
    saved, config.mtp_num_layers = config.mtp_num_layers, None
    try:
        yield
    finally:
        config.mtp_num_layers = saved


class MTPGPTModel(GPTModel):
    """A GPTModel whose MTP layers run only when trained, their logits returned beside the main ones."""

    def __init__(self, *args: Any, train_mtp: bool, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.train_mtp = train_mtp
        if self.mtp_process and not train_mtp:  # --mtp-num-layers alone: the layers are carried, not trained
            for param in self.mtp.parameters():
                param.requires_grad_(False)

    def _postprocess(self, hidden_states, input_ids, position_ids, labels, rotary_pos_emb, rotary_pos_cos,
                     rotary_pos_sin, mtp_in_postprocess=None, **kwargs):
        depth_states: tuple[torch.Tensor, ...] = ()
        if mtp_in_postprocess and self.train_mtp and self.training:
            stacked = self.mtp(input_ids=input_ids, position_ids=position_ids, hidden_states=hidden_states,
                               attention_mask=kwargs.get("attention_mask"), rotary_pos_emb=rotary_pos_emb,
                               rotary_pos_cos=rotary_pos_cos, rotary_pos_sin=rotary_pos_sin,
                               packed_seq_params=kwargs.get("packed_seq_params"), embedding=self.embedding)
            hidden_states, *depths = torch.chunk(stacked, 1 + len(self.mtp.layers), dim=0)
            depth_states = tuple(depths)
        with _main_head_only(self.config):
            logits = super()._postprocess(hidden_states, input_ids, position_ids, labels, rotary_pos_emb,
                                          rotary_pos_cos, rotary_pos_sin, mtp_in_postprocess=False, **kwargs)
        if not depth_states or not self.post_process:
            return logits
        weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        depth_logits = [self.output_layer(h, weight=weight)[0].transpose(0, 1) for h in depth_states]
        return torch.cat([logits, *depth_logits], dim=0)

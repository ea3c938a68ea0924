"""megatron-core's multi-token-prediction block on the GPT model, run only where it is trained.

`mtp_block_spec` builds megatron's MultiTokenPredictionBlock from the family's own layer spec (this project's
SP-capable norms; eh_proj is megatron's column-parallel linear). `MTPGPTModel` changes what the model returns,
not how it computes: megatron's GPTModel turns the MTP outputs into a loss inside the model (given labels, it then
returns the main loss instead of logits), while the RL loss here needs the main logits. So, in training mode with
MTP training on, the model returns the main logits and each MTP depth's logits stacked on the batch dimension
([(1 + D) * b, s, V/tp]) and the loss (slime/backends/megatron_utils/mtp_loss.py) weighs them; otherwise (the
old-policy forward, eval, --mtp-num-layers without --enable-mtp-training) the MTP layers do not run and the
output is the plain logits, unchanged by them.

Shifted inputs: megatron's MTP layer rolls the token ids by one per depth itself (`roll_tensor`), which under context
parallelism sends each chunk's boundary tokens to the neighbouring CP rank with point-to-point messages. Here the
trained forward takes them instead (`mtp_input_ids`, [D, s] for the one packed row: depth k's row holds the token k
places after each position), shifted on the whole sequence before the CP slice (slime/backends/megatron_utils/
data.py), so the MTP layers add no collective of their own beyond their transformer layer's; a position's hidden
state pairs with the embedding at that same position, which needs no shift.
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
from megatron.core.utils import make_viewless_tensor

from slime.models.sp_norm import SequenceParallelNorm


class PreShiftedMTPLayer(MultiTokenPredictionLayer):
    """megatron's MTP layer, fed its depth's shifted token ids instead of rolling them across CP ranks.

    The block hands each layer the ids its predecessor returned: here the rows of `mtp_input_ids` still to use, this
    layer's first.
    """

    def _get_embeddings(self, input_ids, position_ids, embedding, hidden_states, packed_seq_params=None):
        if embedding.add_position_embedding:  # learned positions would need the shifted positions too
            raise ValueError("MTP layers here need rotary positions (--position-embedding-type rope)")
        decoder_input = embedding(input_ids=input_ids[:1], position_ids=position_ids)
        hidden_states = make_viewless_tensor(inp=hidden_states, requires_grad=True, keep_graph=True)
        return input_ids[1:], position_ids, decoder_input, hidden_states


def mtp_block_spec(layer_spec: ModuleSpec, num_layers: int) -> ModuleSpec:
    """megatron's MTP block of `num_layers` layers, each around a transformer layer of `layer_spec`."""
    layer = ModuleSpec(module=PreShiftedMTPLayer, submodules=MultiTokenPredictionLayerSubmodules(
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
        self._mtp_input_ids: torch.Tensor | None = None
        if self.mtp_process and not train_mtp:  # --mtp-num-layers alone: the layers are carried, not trained
            for param in self.mtp.parameters():
                param.requires_grad_(False)

    def forward(self, *args: Any, mtp_input_ids: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        """GPTModel's forward; `mtp_input_ids` [D, s]: each MTP depth's shifted token ids of the one packed row
        (module docstring), needed when the MTP layers run."""
        self._mtp_input_ids = mtp_input_ids
        try:
            return super().forward(*args, **kwargs)
        finally:
            self._mtp_input_ids = None

    def _postprocess(self, hidden_states, input_ids, position_ids, labels, rotary_pos_emb, rotary_pos_cos,
                     rotary_pos_sin, mtp_in_postprocess=None, **kwargs):
        depth_states: tuple[torch.Tensor, ...] = ()
        if mtp_in_postprocess and self.train_mtp and self.training:
            if self._mtp_input_ids is None:
                raise ValueError("training the MTP layers needs each depth's shifted token ids: pass mtp_input_ids "
                                 "(PackedMicroBatch.mtp_tokens, packed with mtp_depths)")
            stacked = self.mtp(input_ids=self._mtp_input_ids, position_ids=position_ids, hidden_states=hidden_states,
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

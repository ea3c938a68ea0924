"""A vision + text checkpoint on megatron: megatron's GPTModel is the text model, transformers' own vision tower class
of the checkpoint (`AutoModel.from_config(vision_config)`, the class transformers' composite model holds) sits in
front of it under the checkpoint's parameter names (`visual.X` <-> `model.visual.X`).

Per micro-batch (a THD pack, `VisionBatch` from slime/backends/megatron_utils/data.py):
- the tower encodes every image of the micro-batch; each image token of this rank takes its feature row
  (`feature_index`), replacing the token's word embedding before the decoder. The scatter is made on the whole
  CP-local sequence, before the sequence-parallel split (the embedding is built unsplit and split here), so every
  TP rank holds the whole gradient of the features: the tower, replicated over TP, gets the same gradient on every
  TP rank and needs no reduction of its own beyond the data-parallel one (DP x CP, megatron's
  finalize_model_grads, with the text model's gradients); its norm is counted once (it is a TP duplicate).
- the rotary angles come from the three position rows of the WHOLE micro-batch (`position_rows`, not CP-sliced):
  a table as long as the packed batch, from which the THD RoPE takes each local token's row (megatron's
  `_apply_rotary_pos_emb_thd` with batch offsets, slime/patches/megatron_core.py), so the zig-zag split never cuts a
  position row apart from its token.
- Qwen3-VL's deepstack feature maps are added to the image tokens' hidden states after the first decoder layers,
  each split for sequence parallelism like the embedding.
The tower is built on the first pipeline stage only; every stage builds the rotary table.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.models.gpt import GPTModel

from slime.models.mrope import angles, image_token_counts
from slime.models.vision_arch import VISION_MODULE, VisionArch, VisionBatch


def build_vision_tower(vision: VisionArch, dtype: torch.dtype) -> torch.nn.Module:
    """transformers' vision class of the checkpoint, random-initialised (the checkpoint's weights load over it)."""
    from transformers import AutoModel

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    with device:
        return AutoModel.from_config(vision.vision_config, dtype=dtype)


class VisionLanguageModel(GPTModel):
    """megatron's GPTModel with transformers' vision tower in front (module docstring)."""

    def __init__(self, *, vision: VisionArch, **gpt_kwargs: Any) -> None:
        super().__init__(scatter_embedding_sequence_parallel=False, **gpt_kwargs)
        self.vision_arch = vision
        if self.pre_process:
            setattr(self, VISION_MODULE, build_vision_tower(vision, self.config.params_dtype))
        self._batch: VisionBatch | None = None
        self._deepstack: list[torch.Tensor] = []
        for layer in self.decoder.layers:
            index = layer.layer_number - 1
            if index < vision.deepstack_layers:
                if not self.pre_process:
                    raise ValueError(f"{vision.family}: decoder layer {index} takes deepstack image features, which "
                                     "the first pipeline stage computes; put the first "
                                     f"{vision.deepstack_layers} layers on the first stage")
                layer.register_forward_hook(self._deepstack_hook(index))

    # ----------------------------------------------------------------- forward
    def forward(self, input_ids, position_ids, attention_mask, *args, vision: VisionBatch | None = None,
                packed_seq_params=None, **kwargs):
        if vision is None or packed_seq_params is None:
            raise ValueError(f"{self.vision_arch.family} with its vision tower runs on packed micro-batches with "
                             "their multimodal RoPE positions (VisionBatch) only")
        self._batch = vision
        try:
            return super().forward(input_ids, position_ids, attention_mask, *args,
                                   packed_seq_params=packed_seq_params, **kwargs)
        finally:
            self._batch, self._deepstack = None, []

    def _preprocess(self, input_ids, position_ids, decoder_input=None, inference_context=None,
                    packed_seq_params=None, padding_mask=None):
        embedded_here = decoder_input is None and self.pre_process
        out = list(super()._preprocess(input_ids, position_ids, decoder_input=decoder_input,
                                       inference_context=inference_context, packed_seq_params=packed_seq_params,
                                       padding_mask=padding_mask))
        if embedded_here:
            out[0] = self._sequence_parallel_split(self._with_images(out[0]))
        out[1] = self._rotary_table(self._batch.position_rows)
        return tuple(out)

    def _rotary_table(self, rows: torch.Tensor) -> torch.Tensor:
        """[whole packed length, 1, 1, rotary dims] angles, rotate-half layout (megatron's RotaryEmbedding's)."""
        pairs = angles(rows, self.rotary_pos_emb.inv_freq, self.vision_arch.rope)
        return torch.cat([pairs, pairs], dim=-1)[:, None, None, :]

    def _with_images(self, embeddings: torch.Tensor) -> torch.Tensor:
        """The word embeddings [tokens, 1, hidden] (unsplit) with each local image token's feature in its place."""
        batch = self._batch
        if batch.pixel_values is None:
            return embeddings
        tower = getattr(self, VISION_MODULE)
        output = tower(batch.pixel_values.to(tower.dtype), grid_thw=batch.image_grid_thw)
        features = output.pooler_output
        expected = sum(image_token_counts(batch.image_grid_thw, self.vision_arch.merge_size))
        if features.shape[0] != expected:
            raise ValueError(f"{self.vision_arch.family}: the vision tower gave {features.shape[0]} image features "
                             f"for {expected} image tokens")
        local = (batch.feature_index >= 0).nonzero().squeeze(1)
        rows = batch.feature_index[local]
        embeddings = _placed(embeddings, local, features[rows].to(embeddings.dtype))
        maps = getattr(output, "deepstack_features", None) or ()
        self._deepstack = [self._sequence_parallel_split(_placed(torch.zeros_like(embeddings), local,
                                                                 feature[rows].to(embeddings.dtype)))
                           for feature in list(maps)[: self.vision_arch.deepstack_layers]]
        return embeddings

    def _sequence_parallel_split(self, tensor: torch.Tensor) -> torch.Tensor:
        """This TP rank's sequence part under SP (backward: an all-gather over TP, as megatron's embedding's)."""
        if not self.config.sequence_parallel:
            return tensor
        from megatron.core import tensor_parallel

        return tensor_parallel.scatter_to_sequence_parallel_region(tensor).clone()

    def _deepstack_hook(self, index: int):
        def add_features(module, inputs, output):
            if index >= len(self._deepstack):  # a micro-batch without images
                return output
            hidden, context = output
            return hidden + self._deepstack[index], context

        return add_features


def _placed(base: torch.Tensor, positions: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """`base` [tokens, 1, hidden] with rows `positions` replaced by `values` [n, hidden] (out of place)."""
    batch_index = torch.zeros_like(positions)
    return base.index_put((positions, batch_index), values)

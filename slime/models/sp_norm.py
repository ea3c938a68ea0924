"""RMSNorm / LayerNorm for megatron's local layer spec that works with sequence parallelism.

megatron's torch norm wrapper refuses `sequence_parallel=True`. A norm acts per token, so under
SP each TP rank normalises its own sequence shard with the same replicated weight; the only
extra requirement is that the weight's gradient is summed over TP, which megatron's
`finalize_model_grads` does for every parameter marked `.sequence_parallel = True`.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from slime.models import fused_kernels


class SequenceParallelNorm(torch.nn.Module):
    """Per-token RMSNorm or LayerNorm (chosen by config.normalization), SP-safe.

    Math follows HF Qwen/Llama RMSNorm: normalise in fp32, cast back, then scale; zero-centred
    (config.layernorm_zero_centered_gamma, HF Qwen3-Next / Qwen3.5): scale by 1 + weight in fp32, then cast.
    """

    def __init__(
        self,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str | None = None,
    ):
        super().__init__()
        self.zero_centered = bool(config.layernorm_zero_centered_gamma or zero_centered_gamma)
        self.normalization = normalization or config.normalization
        if self.normalization not in ("RMSNorm", "LayerNorm"):
            raise ValueError(f"unsupported normalization {self.normalization!r}")
        if self.zero_centered and self.normalization != "RMSNorm":
            raise ValueError("zero-centred gamma (--apply-layernorm-1p) is implemented for RMSNorm only")
        self.eps = eps
        dtype = config.params_dtype
        # zero-centred (Qwen3-Next / Qwen3.5): the scale is 1 + weight, the weight starts at 0
        self.weight = torch.nn.Parameter((torch.zeros if self.zero_centered else torch.ones)(hidden_size, dtype=dtype))
        self.bias = (
            torch.nn.Parameter(torch.zeros(hidden_size, dtype=dtype))
            if self.normalization == "LayerNorm"
            else None
        )
        for param in self.parameters():
            # finalize_model_grads sums grads of these over TP when config.sequence_parallel.
            param.sequence_parallel = config.sequence_parallel

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.zero_centered:
            return fused_kernels.rms_norm_zero_centered(hidden_states, self.weight, self.eps)
        if self.normalization == "RMSNorm":
            return fused_kernels.rms_norm(hidden_states, self.weight, self.eps)
        input_dtype = hidden_states.dtype
        x = torch.nn.functional.layer_norm(hidden_states.float(), hidden_states.shape[-1:], eps=self.eps)
        return (self.weight * x.to(input_dtype)) + self.bias

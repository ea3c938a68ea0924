"""Manifold-constrained hyper-connections (DeepSeek-V4's residual) on megatron-core's TransformerBlock.

The residual is `hc_mult` = n streams instead of one hidden state. Between layers megatron's block carries them as
one tensor [s, b, n * h] (stream k in columns k h .. (k + 1) h), so the block, its recompute, SP's sequence split and
CP's token split all work unchanged: everything here acts per token. The first layer repeats the embedding into the
n streams; the final norm (HyperHeadNorm) collapses them back to [s, b, h] before the output layer.

Each branch (attention, then MLP) of a layer has a mixer (transformers' DeepseekV4HyperConnection; HF
`hc_attn_{fn,base,scale}`, `hc_ffn_*`): from the streams, normalised (RMS, no weight) and flattened per token, one
projection gives n "pre", n "post" and n x n "comb" logits; pre = sigmoid(.) + eps collapses the streams into the
branch's input, post = 2 sigmoid(.) spreads the branch's output over the streams, and comb = softmax(.) + eps,
made doubly stochastic by `hc_sinkhorn_iters` Sinkhorn-Knopp steps, mixes the old streams into the new:

    new_k = post_k * branch(sum_j pre_j stream_j) + sum_j comb[j, k] stream_j

The mixers' weights are replicated over TP; under SP each rank mixes its own tokens, so they are marked
`sequence_parallel` and finalize_model_grads sums their gradient over TP, as a norm's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_layer import TransformerLayer


def _replicated(config, shape: tuple[int, ...], init) -> torch.nn.Parameter:
    """A weight replicated over TP, in fp32 whatever --bf16 says (transformers keeps the mixers and the head in
    fp32; their Sinkhorn-normalised products compound over every layer), but where DeepseekV4Layers.fp32_weights
    is off (the hybrid CPU optimizer's 16-bit parameters)."""
    tensor = torch.empty(shape, dtype=torch.float32)
    init(tensor)
    device = "cpu" if config.use_cpu_initialization or not torch.cuda.is_available() else torch.cuda.current_device()
    dtype = torch.float32 if config.hf_layer_config.fp32_weights else config.params_dtype
    param = torch.nn.Parameter(tensor.to(device=device, dtype=dtype))
    param.sequence_parallel = config.sequence_parallel  # summed over TP by finalize_model_grads under SP
    return param


def _unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


def collapse(streams: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_k weights_k stream_k: [..., n * h] with [..., n] (fp32) -> [..., h] in the streams' dtype."""
    n = weights.shape[-1]
    split = streams.view(*streams.shape[:-1], n, -1)
    return (weights.unsqueeze(-1) * split).sum(dim=-2).to(streams.dtype)


class HyperMixer(torch.nn.Module):
    """The pre / post / comb weights of one branch (HF `fn`, `base`, `scale`)."""

    def __init__(self, config) -> None:
        super().__init__()
        layers = config.hf_layer_config
        n, hidden = layers.streams, config.hidden_size
        self.streams, self.iters, self.eps, self.norm_eps = n, layers.sinkhorn_iters, layers.hc_eps, layers.norm_eps
        self.fn = _replicated(config, ((2 + n) * n, n * hidden), config.init_method)
        self.base = _replicated(config, ((2 + n) * n,), torch.nn.init.zeros_)
        self.scale = _replicated(config, (3,), torch.nn.init.ones_)

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [..., n * h] -> (post [..., n], comb [..., n, n] (fp32), the branch's input [..., h])."""
        n = self.streams
        mixes = F.linear(_unit_rms(streams.float(), self.norm_eps), self.fn.float())
        pre, post, comb = mixes.split([n, n, n * n], dim=-1)
        base_pre, base_post, base_comb = self.base.float().split([n, n, n * n])
        scale_pre, scale_post, scale_comb = self.scale.float().unbind(0)
        pre = torch.sigmoid(pre * scale_pre + base_pre) + self.eps
        post = 2 * torch.sigmoid(post * scale_post + base_post)
        comb = torch.softmax(comb.view(*comb.shape[:-1], n, n) * scale_comb + base_comb.view(n, n), dim=-1) + self.eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        return post, comb, collapse(streams, pre)


def expand(streams: torch.Tensor, output: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """new_k = post_k * output + sum_j comb[j, k] stream_j, in the streams' dtype ([..., n * h])."""
    dtype, n = streams.dtype, post.shape[-1]
    split = streams.view(*streams.shape[:-1], n, -1)
    new = post.to(dtype).unsqueeze(-1) * output.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), split)
    return new.reshape(streams.shape)


class HyperConnectedLayer(TransformerLayer):
    """megatron's TransformerLayer (its norms, attention and MLP built from the spec as usual) whose residual is
    the mixers' (module docstring). Layer 1 takes the embedding [s, b, h]; every layer returns [s, b, n * h]."""

    def __init__(self, config, submodules, layer_number: int = 1, hidden_dropout=None, pg_collection=None,
                 vp_stage=None) -> None:
        super().__init__(config, submodules, layer_number=layer_number, hidden_dropout=hidden_dropout,
                         pg_collection=pg_collection, vp_stage=vp_stage)
        self.streams = config.hf_layer_config.streams
        self.attention_mixer = HyperMixer(config)
        self.mlp_mixer = HyperMixer(config)

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, p=self.hidden_dropout, training=self.training) if self.hidden_dropout else x

    def forward(self, hidden_states: torch.Tensor, packed_seq_params=None, padding_mask=None, **unused):
        streams = hidden_states
        if self.layer_number == 1:  # the embedding, repeated into every stream
            streams = hidden_states.unsqueeze(-2).expand(*hidden_states.shape[:-1], self.streams, -1)
            streams = streams.reshape(*hidden_states.shape[:-1], -1)
        post, comb, branch_in = self.attention_mixer(streams)
        attended = self.self_attention(self.input_layernorm(branch_in), packed_seq_params=packed_seq_params)
        streams = expand(streams, self._dropout(attended), post, comb)
        post, comb, branch_in = self.mlp_mixer(streams)
        mlp_out, bias = self.mlp(self.pre_mlp_layernorm(branch_in), padding_mask=padding_mask)
        if bias is not None:
            mlp_out = mlp_out + bias
        return expand(streams, self._dropout(mlp_out), post, comb), None


class HyperHeadNorm(torch.nn.Module):
    """The block's final norm: the streams collapsed by their own pre weights (HF `hc_head.{hc_fn, hc_base,
    hc_scale}`), then RMSNorm (HF `norm`)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **unused) -> None:
        super().__init__()
        layers = config.hf_layer_config
        n = layers.streams
        self.eps, self.hc_eps, self.norm_eps = eps, layers.hc_eps, layers.norm_eps
        self.weight = _replicated(config, (hidden_size,), torch.nn.init.ones_)
        self.hc_fn = _replicated(config, (n, n * hidden_size), config.init_method)
        self.hc_base = _replicated(config, (n,), torch.nn.init.zeros_)
        self.hc_scale = _replicated(config, (1,), torch.nn.init.ones_)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        mixes = F.linear(_unit_rms(streams.float(), self.norm_eps), self.hc_fn.float())
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.hc_eps
        collapsed = collapse(streams, pre)
        normed = collapsed.float() * torch.rsqrt(collapsed.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * normed).to(collapsed.dtype)  # transformers' RMSNorm: scaled in fp32, cast back

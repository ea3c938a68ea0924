"""Grouped expert MLPs for megatron-core's MoE layer without TransformerEngine.

`GroupedExperts` is a drop-in for megatron's `SequentialMLP` in the local layer spec: the same per-expert
`local_experts.{i}.linear_fc1/linear_fc2` parameters (names, shapes, expert-TP sharding, checkpoint keys), so
the HF weight mapping, checkpoints, the weight push, routing replay and EP are unchanged. Only the forward
differs: the dispatcher's tokens arrive sorted by local expert; they are multiplied in that one layout by all
experts at once (`torch._grouped_mm` on CUDA for bf16 on Hopper and later), and the activation and the routing
weights are applied to all experts' rows in one elementwise pass; LoRA adapters on the experts
(slime/models/lora.py) add two grouped GEMMs per layer. Elsewhere (CPU, fp32) the GEMMs loop over the experts of the
same layout with the sequential path's own formulas, so the numbers are the same bit for bit.

The experts' weight gradients go into megatron DDP's `main_grad` buffers with one multi-tensor add per GEMM, the way
megatron's fused gradient accumulation hands them over (`grad_added_to_main_grad`: DDP's hook then skips its add),
instead of one add per expert and micro-batch (8,908 kernels in a Qwen3-30B-A3B-shaped step); the same sums.

Each GEMM reads the experts' weights stacked into one [E, out, in] copy, taken again in the backward rather than
kept, so the step holds no more memory than the sequential path. (Reading them in place from megatron's DDP buffer
would need the experts registered in another order, which moves them in that buffer: the distributed optimizer's
dp_reshardable checkpoints follow the buffer, so a checkpoint crossing --moe-grouped-gemm settings would load
optimizer state into the wrong experts.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.experts import SequentialMLP

from slime.models.lora import expert_adapter


def grouped_experts_chosen(choice: bool | None) -> bool:
    """--moe-grouped-gemm: the grouped experts in the local spec. Default (None): on CUDA. False keeps megatron's
    SequentialMLP (the same parameters and numbers)."""
    return torch.cuda.is_available() if choice is None else bool(choice)


def grouped_mm_usable(x: torch.Tensor) -> bool:
    """torch's grouped GEMM serves bf16 on Hopper (sm90) and later GPUs; elsewhere the experts loop."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and torch.cuda.get_device_capability(x.device) >= (9, 0))


def _loop_forward(x: torch.Tensor, counts: list[int], weights: list[torch.Tensor]) -> torch.Tensor:
    """y_e = x_e W_e^T for each expert's rows, as megatron's linear computes it."""
    parts = [torch.matmul(xe, w.t()) for xe, w in zip(torch.split(x, counts), weights)]
    return torch.cat(parts) if parts else x.new_zeros(0, weights[0].shape[0])


class _GroupedLinear(torch.autograd.Function):
    """y[rows of e] = x[rows of e] @ W_e^T for every expert e, rows sorted by expert. Saves x and the
    parameters only (never their stack)."""

    @staticmethod
    def forward(ctx, x, tokens_per_expert, use_grouped_mm, into_main_grad, *weights):
        ctx.grouped = grouped_mm_usable(x) if use_grouped_mm is None else use_grouped_mm
        ctx.params = weights if into_main_grad else ()  # the parameters themselves: DDP's main_grad is on them
        if ctx.grouped:
            offsets = tokens_per_expert.to(x.device, non_blocking=True).cumsum(0, dtype=torch.int32)
            empty = tokens_per_expert == 0  # on the host as the dispatcher gives it: no device sync
            ctx.empty = empty.nonzero().flatten().tolist() if not empty.is_cuda else empty
            y = torch._grouped_mm(x, torch.stack(weights).transpose(1, 2), offs=offsets)
            ctx.save_for_backward(x, offsets, *weights)
        else:
            ctx.counts = tokens_per_expert.tolist()
            y = _loop_forward(x, ctx.counts, list(weights))
            ctx.save_for_backward(x, *weights)
        return y

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()  # grouped_mm refuses an output gradient with zero strides (an expanded one)
        need_w = ctx.needs_input_grad[4]  # frozen weights (LoRA's base) get no gradient computed
        if ctx.grouped:
            x, offsets, *weights = ctx.saved_tensors
            grad_x = torch._grouped_mm(grad, torch.stack(weights), offs=offsets)
            if not need_w:
                return grad_x, None, None, None, *([None] * len(weights))
            grad_w = torch._grouped_mm(grad.t(), x, offs=offsets)  # [E, out, in]
            _zero_experts(grad_w, ctx.empty)  # an expert without rows gets a zero gradient
            grad_w = grad_w.unbind(0)
            if ctx.params:
                add_to_main_grads(ctx.params, grad_w)
            return grad_x, None, None, None, *grad_w
        x, *weights = ctx.saved_tensors
        grad_x, grad_w = [], []
        for g, xe, w in zip(torch.split(grad, ctx.counts), torch.split(x, ctx.counts), weights):
            grad_x.append(g.matmul(w))  # megatron's linear backward, expert by expert
            grad_w.append(g.t().matmul(xe) if need_w else None)
        if ctx.params and need_w:
            add_to_main_grads(ctx.params, grad_w)
        return (torch.cat(grad_x) if grad_x else torch.zeros_like(x)), None, None, None, *grad_w


def add_to_main_grads(weights: list[torch.Tensor] | tuple[torch.Tensor, ...], grads: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> bool:
    """Add the weights' gradients into megatron DDP's `main_grad` buffers with one multi-tensor add and mark them
    added (`grad_added_to_main_grad`, megatron's contract for fused gradient accumulation: DDP's hook then skips
    its own add and the next zero_grad_buffer resets the mark). False, and nothing added, where a weight is not
    under megatron's DDP or asks for megatron's own handling (`zero_out_wgrad`)."""
    if not all(hasattr(w, "main_grad") and hasattr(w, "grad_added_to_main_grad")
               and not getattr(w, "zero_out_wgrad", False) for w in weights):
        return False
    main_grads = [w.main_grad for w in weights]
    if all(m.dtype == g.dtype and m.device == g.device for m, g in zip(main_grads, grads)):
        torch._foreach_add_(main_grads, list(grads))
    else:  # e.g. fp32 main grads of bf16 weights (--accumulate-allreduce-grads-in-fp32)
        for m, g in zip(main_grads, grads):
            m.add_(g)
    for w in weights:
        w.grad_added_to_main_grad = True
    return True


def _zero_experts(grad_w: torch.Tensor, empty: list[int] | torch.Tensor) -> None:
    if isinstance(empty, list):
        for expert in empty:
            grad_w[expert].zero_()
    else:
        grad_w.masked_fill_(empty.view(-1, 1, 1), 0)


def grouped_linear(x: torch.Tensor, tokens_per_expert: torch.Tensor, weights: list[torch.Tensor],
                   use_grouped_mm: bool | None = None, into_main_grad: bool = True) -> torch.Tensor:
    """Each expert's rows of `x` (sorted by expert, `tokens_per_expert` rows each) times its weight^T; with
    torch's grouped GEMM where usable (None) or as asked, else expert by expert. `into_main_grad`: the weight
    gradients also go straight into megatron DDP's main_grad buffers where the weights have them."""
    return _GroupedLinear.apply(x, tokens_per_expert, use_grouped_mm, into_main_grad, *weights)


class GroupedExperts(SequentialMLP):
    """SequentialMLP's experts and parameters, run as grouped GEMMs over the expert-sorted tokens.

    `grouped` switches back to SequentialMLP's per-expert forward (same parameters), which the benchmark
    uses to compare the two in one process.
    """

    grouped: bool = True
    into_main_grad: bool = True
    """False: DDP's hook adds each expert's gradient on its own (the benchmark's "grouped-base" path)."""

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        if not self.grouped or not self._supported():
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        x, probs = permuted_local_hidden_states, permuted_probs
        if self.config.moe_apply_probs_on_input:  # top-1 only (megatron checks): the weight scales the input
            x = (probs.unsqueeze(-1) * x).to(x.dtype)
            probs = torch.ones_like(probs)
        counts = tokens_per_expert if torch.is_tensor(tokens_per_expert) else torch.tensor(tokens_per_expert)
        fc1 = self._linear(x, counts, "linear_fc1") + self._bias_rows(counts, "linear_fc1", x)
        hidden = self._activation(fc1, probs)
        out = self._linear(hidden, counts, "linear_fc2")
        return out + self._bias_rows(counts, "linear_fc2", x) * probs.unsqueeze(-1).to(out.dtype), None

    def _bias_rows(self, counts: torch.Tensor, name: str, x: torch.Tensor) -> torch.Tensor | float:
        """Each row's expert's bias of layer `name` (experts with biases: gpt-oss), 0 without. megatron's expert MLP
        adds fc1's before the activation and fc2's times the routing weight, as here."""
        biases = [getattr(e, name).bias for e in self.local_experts]
        if biases[0] is None:
            return 0.0
        return torch.repeat_interleave(torch.stack(biases), counts.to(x.device, non_blocking=True), dim=0,
                                       output_size=x.shape[0])

    def _linear(self, x: torch.Tensor, counts: torch.Tensor, name: str) -> torch.Tensor:
        """Every expert's `name` layer over its rows, plus its LoRA update (x A_e^T) B_e^T * alpha/r where the
        experts carry adapters (the layers' forward hooks do not run on this path)."""
        layers = [getattr(e, name) for e in self.local_experts]
        y = grouped_linear(x, counts, [layer.weight for layer in layers], into_main_grad=self.into_main_grad)
        adapters = [expert_adapter(layer) for layer in layers]
        if adapters[0] is None:
            return y
        a = adapters[0]
        x = F.dropout(x, a.dropout) if a.training and a.dropout else x
        h = grouped_linear(x, counts, [ad.lora_A for ad in adapters], into_main_grad=self.into_main_grad)
        delta = grouped_linear(h, counts, [ad.lora_B for ad in adapters], into_main_grad=self.into_main_grad)
        return y + delta * a.scale

    def _supported(self) -> bool:
        """What the grouped forward reproduces: no FP8/FP4 padding, and of megatron's fused activations only the
        SwiGLU one (biased experts only unfused)."""
        c = self.config
        fused_other = c.bias_activation_fusion and not (c.gated_linear_unit and c.activation_func is F.silu
                                                        and not c.add_bias_linear)
        return not (c.fp8 or getattr(c, "fp4", None) or c.use_te_activation_func or fused_other)

    def _activation(self, fc1: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """The expert MLP's activation and routing weight over all experts' rows at once (row-wise, so the
        same numbers as expert by expert); megatron's fused weighted SwiGLU where the config asks for it."""
        c = self.config
        if c.bias_activation_fusion and c.gated_linear_unit and c.activation_func is F.silu:
            from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl

            return weighted_bias_swiglu_impl(fc1, None, probs.unsqueeze(-1), c.activation_func_fp8_input_store)
        if c.gated_linear_unit:
            gate, linear = torch.chunk(fc1, 2, dim=-1)
            if c.activation_func_clamp_value is not None:
                gate = gate.clamp(min=None, max=c.activation_func_clamp_value)
                linear = linear.clamp(min=-c.activation_func_clamp_value, max=c.activation_func_clamp_value)
            hidden = c.activation_func(gate) * (linear + c.glu_linear_offset)
        else:
            hidden = c.activation_func(fc1)
        return (hidden * probs.unsqueeze(-1)).to(hidden.dtype)

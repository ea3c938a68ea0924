"""The gated DeltaNet kernels (slime/models/gated_delta_rule.py) against transformers' torch paths.

transformers' Qwen3-Next module is the reference: its chunked and token-by-token gated delta rule and its
depthwise causal convolution. Our chunked rule must equal both in fp32 (<= 1e-6), restart at every packed
sequence start, carry initial and final states, and differentiate like the token-by-token recurrence (fp64).
The dispatcher's decision is tested as a pure function of (device, capability, Triton version, fla present).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_next import modeling_qwen3_next as hf

from slime.models import gated_delta_rule as gdr

TOL = 1e-6


def _inputs(lengths, heads=3, dim_k=16, dim_v=24, *, batch=1, dtype=torch.float32, seed=0):
    """q, k (l2-normalised), v, g (<= 0), beta in (0, 1), initial state; all sequences of `lengths` packed."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    q = gdr.l2norm(rand(batch, total, heads, dim_k))
    k = gdr.l2norm(rand(batch, total, heads, dim_k))
    v = rand(batch, total, heads, dim_v)
    g = -torch.rand(batch, total, heads, generator=gen, dtype=dtype) * 0.7
    beta = torch.rand(batch, total, heads, generator=gen, dtype=dtype).sigmoid()
    state = rand(batch * len(lengths), heads, dim_k, dim_v)
    return q, k, v, g, beta, state


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _max_diff(a, b):
    return (a - b).abs().max().item()


@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_rule_equals_transformers_chunked_and_recurrent(with_state):
    # Two sequences of 150 tokens: two full chunks of 64 and a partial one; Dk != Dv, several heads.
    q, k, v, g, beta, state = _inputs([150], batch=2)
    init = state if with_state else None
    out, final = gdr.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=init, output_final_state=True)
    for reference in (hf.torch_chunk_gated_delta_rule, hf.torch_recurrent_gated_delta_rule):
        ref_out, ref_final = reference(q, k, v, g, beta, initial_state=init, output_final_state=True)
        assert out.shape == ref_out.shape == (2, 150, 3, 24) and final.shape == (2, 3, 16, 24)
        assert _max_diff(out, ref_out) <= TOL and _max_diff(final, ref_final) <= TOL
    # A non-default scale and chunk size change nothing but what they should.
    out2, _ = gdr.chunk_gated_delta_rule(q * 2, k, v, g, beta, scale=16 ** -0.5 / 2, initial_state=init,
                                         chunk_size=32)
    assert _max_diff(out2, out) <= TOL


def test_packed_sequences_equal_each_sequence_alone():
    lengths = [70, 5, 64, 129, 0, 40]  # partial, tiny, exactly one chunk, three chunks, empty
    q, k, v, g, beta, state = _inputs(lengths)
    cu = _cu(lengths)
    out, final = gdr.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=True,
                                            cu_seqlens=cu)
    assert final.shape == (len(lengths), 3, 16, 24) and final.dtype == torch.float32
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        if a == b:  # an empty sequence passes its state through
            assert torch.equal(final[i], state[i])
            continue
        alone = [x[:, a:b] for x in (q, k, v, g, beta)]
        ref_out, ref_final = hf.torch_recurrent_gated_delta_rule(*alone, initial_state=state[i:i + 1],
                                                                 output_final_state=True)
        assert _max_diff(out[:, a:b], ref_out) <= TOL and _max_diff(final[i:i + 1], ref_final) <= TOL
    # The token loop of the module's own reference agrees on the packed stream too.
    rec_out, rec_final = gdr.recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=state,
                                                        output_final_state=True, cu_seqlens=cu)
    assert _max_diff(out, rec_out) <= TOL and _max_diff(final, rec_final) <= TOL


def test_gradients_equal_the_recurrence_in_fp64():
    lengths = [37, 10, 70]
    inputs = [x.requires_grad_() for x in _inputs(lengths, heads=2, dim_k=8, dim_v=12, dtype=torch.float64)]
    cu = _cu(lengths)
    gen = torch.Generator().manual_seed(1)

    def grads(rule):
        out, final = rule(*inputs[:5], initial_state=inputs[5], output_final_state=True, cu_seqlens=cu,
                          chunk_size=16)
        loss = (out * weights[0]).sum() + (final * weights[1]).sum()
        return torch.autograd.grad(loss, inputs)

    out, final = gdr.recurrent_gated_delta_rule(*inputs[:5], initial_state=inputs[5], output_final_state=True,
                                                cu_seqlens=cu)
    weights = [torch.randn(out.shape, generator=gen, dtype=out.dtype),
               torch.randn(final.shape, generator=gen, dtype=final.dtype)]
    chunked, recurrent = grads(gdr.chunk_gated_delta_rule), grads(gdr.recurrent_gated_delta_rule)
    for name, a, b in zip(("q", "k", "v", "g", "beta", "initial_state"), chunked, recurrent):
        assert b.abs().max() > 0.1, name  # every input matters to the loss
        assert _max_diff(a, b) <= 1e-12, name


def test_bf16_inputs_accumulate_in_fp32():
    lengths = [100, 60]
    q, k, v, g, beta, state = _inputs(lengths)
    cu = _cu(lengths)
    ref, ref_final = gdr.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=True,
                                                cu_seqlens=cu)
    low = [x.bfloat16() for x in (q, k, v)]
    out, final = gdr.chunk_gated_delta_rule(*low, g, beta.bfloat16(), initial_state=state,
                                            output_final_state=True, cu_seqlens=cu)
    assert out.dtype == torch.bfloat16 and final.dtype == torch.float32
    # Against the fp32 rule on the same rounded inputs: only the output's rounding to bf16 differs.
    exact, exact_final = gdr.chunk_gated_delta_rule(*(x.float() for x in low), g, beta.bfloat16().float(),
                                                    initial_state=state, output_final_state=True, cu_seqlens=cu)
    assert torch.equal(out, exact.bfloat16()) and _max_diff(final, exact_final) <= TOL
    assert _max_diff(out.float(), ref) < 0.05 and _max_diff(final, ref_final) < 0.05


def test_bad_shapes_are_refused_naming_the_fix():
    q, k, v, g, beta, state = _inputs([20], batch=2)
    with pytest.raises(ValueError, match="packed as B=1"):
        gdr.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=_cu([10, 10]))
    with pytest.raises(ValueError, match="initial_state must be"):
        gdr.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=state[:1])
    with pytest.raises(ValueError, match="power of two"):
        gdr.chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=48)
    with pytest.raises(ValueError, match="HV a multiple of H"):
        gdr.chunk_gated_delta_rule(q[:, :, :1], k, v, g, beta)
    with pytest.raises(ValueError, match="HV a multiple of H"):  # 3 value heads over 2 key heads
        gdr.chunk_gated_delta_rule(q[:, :, :2], k[:, :, :2], v, g, beta)


def test_grouped_value_heads_read_key_head_j_over_r():
    """q, k with H key heads and v with HV = r H value heads equal q, k repeated to the value heads."""
    q, k, v, g, beta, state = _inputs([37, 50], heads=4)
    keys_q, keys_k = q[:, :, ::2], k[:, :, ::2]  # 2 key heads; value heads 0, 1 read key head 0, 2 and 3 key head 1
    repeated = (keys_q.repeat_interleave(2, 2), keys_k.repeat_interleave(2, 2))
    for rule in (gdr.chunk_gated_delta_rule, gdr.recurrent_gated_delta_rule):
        got = rule(keys_q, keys_k, v, g, beta, initial_state=state, output_final_state=True, cu_seqlens=_cu([37, 50]))
        want = rule(*repeated, v, g, beta, initial_state=state, output_final_state=True, cu_seqlens=_cu([37, 50]))
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _conv_per_sequence(x, weight, bias, cu):
    """Each sequence alone through torch's conv1d with K-1 zeros of left padding, then silu."""
    width = weight.shape[1]
    pieces = [F.conv1d(F.pad(x[:, a:b].transpose(1, 2), (width - 1, 0)), weight.unsqueeze(1), bias,
                       groups=x.shape[-1]) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]
    return F.silu(torch.cat(pieces, dim=2)).transpose(1, 2)


def test_causal_conv1d_restarts_at_each_sequence_and_equals_transformers():
    gen = torch.Generator().manual_seed(0)
    channels, width = 6, 4
    lengths = [5, 1, 9, 3, 2]  # sequences shorter than the kernel too
    x = torch.randn(1, sum(lengths), channels, generator=gen)
    weight, bias = torch.randn(channels, width, generator=gen), torch.randn(channels, generator=gen)
    cu = _cu(lengths)
    leaves = [t.requires_grad_() for t in (x, weight, bias)]
    packed = gdr.causal_conv1d(x, weight, bias, cu_seqlens=cu)
    reference = _conv_per_sequence(x, weight, bias, cu)
    assert _max_diff(packed, reference) <= TOL
    mix = torch.randn(packed.shape, generator=gen)
    for ours, theirs in zip(torch.autograd.grad((packed * mix).sum(), leaves),
                            torch.autograd.grad((reference * mix).sum(), leaves)):
        assert _max_diff(ours, theirs) <= 1e-5
    packed, x, weight, bias = (t.detach() for t in (packed, x, weight, bias))
    # Without cu_seqlens the stream is one sequence: transformers' torch path, with and without activation.
    batch = torch.randn(2, 7, channels, generator=gen)
    for activation in ("silu", None):
        ref = hf.causal_conv1d_fn(batch.transpose(1, 2), weight, bias, activation=activation).transpose(1, 2)
        assert _max_diff(gdr.causal_conv1d(batch, weight, bias, activation=activation), ref) <= TOL
    # The packed form differs from the unpacked one exactly where a window crosses a sequence start.
    assert _max_diff(packed, gdr.causal_conv1d(x, weight, bias)) > 1e-3
    with pytest.raises(ValueError, match="activation"):
        gdr.causal_conv1d(x, weight, activation="gelu")


def test_l2norm_is_transformers_l2norm():
    x = torch.randn(4, 5, 16)
    assert _max_diff(gdr.l2norm(x), hf.l2norm(x)) <= TOL
    assert _max_diff(gdr.l2norm(x).norm(dim=-1), torch.ones(4, 5)) < 1e-5


def _choose(**kw):
    args = dict(device_type="cuda", capability=(9, 0), triton_version="3.6.0", fla_available=True)
    return gdr.choose_kernel(**{**args, **kw})


def test_dispatch_decision():
    assert gdr.choose_kernel(device_type="cpu", capability=None, triton_version=None, fla_available=True).name \
        == "torch"
    # Hopper with a Triton fla refuses for its gated backward: fla with the project's chunk_bwd_dqkwg, saying why.
    hopper = _choose()
    assert hopper.name == "fla-dqkwg" and "Triton 3.6.0" in hopper.reason and "chunk_bwd_dqkwg" in hopper.reason
    assert _choose(triton_version="3.4.0").name == "fla-dqkwg" and _choose(triton_version="3.7.0").name == "fla-dqkwg"
    assert _choose(triton_version="3.7.1").name == "fla" and _choose(triton_version="3.8.0+git1").name == "fla"
    assert _choose(triton_version="3.3.1").name == "fla"
    assert _choose(tilelang_available=True).name == "fla"
    assert _choose(capability=(8, 0)).name == "fla" and _choose(capability=(10, 0)).name == "fla"
    assert _choose(fla_available=False).name == "compiled"
    # Forcing: torch anywhere; fla and compiled on CUDA only; fla only where importable.
    assert _choose(requested="fla").name == "fla" and _choose(requested="torch").name == "torch"
    assert _choose(requested="fla-dqkwg", capability=(8, 0)).name == "fla-dqkwg"
    with pytest.raises(ValueError, match="fla-dqkwg but flash-linear-attention is not importable"):
        _choose(requested="fla-dqkwg", fla_available=False)
    assert _choose(requested="compiled", capability=(8, 0)).name == "compiled"
    with pytest.raises(ValueError, match="not importable"):
        _choose(requested="fla", fla_available=False)
    with pytest.raises(ValueError, match="needs CUDA"):
        _choose(requested="compiled", device_type="cpu")
    with pytest.raises(ValueError, match=gdr.KERNEL_ENV):
        _choose(requested="triton")


def test_cpu_tensors_run_the_eager_rule(monkeypatch):
    monkeypatch.delenv(gdr.KERNEL_ENV, raising=False)
    assert gdr.active_kernel(torch.device("cpu")).name == "torch"
    monkeypatch.setattr(gdr, "KERNEL_OVERRIDE", "compiled")
    with pytest.raises(ValueError, match="needs CUDA"):
        gdr.active_kernel(torch.device("cpu"))


def test_no_tokens_pass_the_state_through():
    q, k, v, g, beta, state = _inputs([0, 0])
    out, final = gdr.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=True,
                                            cu_seqlens=_cu([0, 0]))
    assert out.shape == (1, 0, 3, 24) and torch.equal(final, state)

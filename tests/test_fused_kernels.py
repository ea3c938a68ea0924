"""--fused-kernels: the compiled kernels and the fused log-prob/entropy head agree with the eager reference.

Compiled here with torch.compile's CPU backend (inductor, C++): the same graphs Triton compiles on CUDA.
The head is also checked against the unfused loss code it replaces (values and gradients, several chunks,
a temperature, vocab-parallel on two gloo ranks).
"""
from __future__ import annotations

import pytest
import torch
from mp_utils import run_ranks

from slime.backends.megatron_utils import logprob_head
from slime.utils.ppo_utils import compute_entropy_from_logits, compute_log_probs
from slime_plugins.models import fused_kernels

pytestmark = pytest.mark.ranks


@pytest.fixture
def impl():
    """Selects an implementation for one test and puts the process default (eager) back."""
    yield fused_kernels.configure
    fused_kernels.configure("eager")


def test_auto_compiles_on_cuda_only():
    assert fused_kernels.resolve("auto", "cpu") == "eager"
    assert fused_kernels.resolve("eager", "cuda") == "eager" and fused_kernels.resolve("compile", "cpu") == "compile"
    with pytest.raises(ValueError, match="--fused-kernels"):
        fused_kernels.resolve("triton", "cuda")


def _unfused(logits, labels, temperature):
    z = logits.float() / temperature
    return compute_log_probs(z, labels), compute_entropy_from_logits(z)


def _with_grads(fn, logits, labels, temperature, seed=0):
    """(log-probs, entropy, d/dlogits of a random mix of both)."""
    gen = torch.Generator().manual_seed(seed)
    weights = torch.randn(2, logits.size(0), generator=gen)
    x = logits.detach().clone().requires_grad_(True)
    log_probs, entropy = fn(x, labels, temperature)
    ((log_probs * weights[0]).sum() + (entropy * weights[1]).sum()).backward()
    return log_probs.detach(), entropy.detach(), x.grad


def _case(rows=37, vocab=301, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=gen) * 4, torch.randint(0, vocab, (rows,), generator=gen)


def test_fused_head_matches_the_unfused_loss_code(monkeypatch):
    logits, labels = _case()
    monkeypatch.setattr(logprob_head, "CHUNK_ELEMENTS", 301 * 10)  # four chunks, the last one short
    want = _with_grads(_unfused, logits, labels, 0.7)
    got = _with_grads(logprob_head.log_probs_and_entropy, logits, labels, 0.7)
    for name, a, b in zip(("log_probs", "entropy", "grad"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6, msg=name)
    assert got[2].abs().sum() > 0


def test_fused_head_keeps_bf16_logits_and_their_gradient_dtype():
    logits, labels = _case()
    got = _with_grads(logprob_head.log_probs_and_entropy, logits.bfloat16(), labels, 1.0)
    want = _with_grads(_unfused, logits.bfloat16(), labels, 1.0)
    assert got[0].dtype == torch.float32 and got[2].dtype == torch.bfloat16
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


def test_compiled_kernels_agree_with_eager(impl):
    """One compile of each kernel (forward and backward) against the same function run eagerly."""
    gen = torch.Generator().manual_seed(1)
    logits, labels = _case(rows=23, vocab=257, seed=2)
    hidden = torch.randn(11, 2, 24, generator=gen)
    norm_weight = torch.rand(24, generator=gen) + 0.5
    query = torch.randn(13, 5, 16, generator=gen)[:, 1:4]  # a strided view, as megatron's QKV split gives
    freqs = torch.randn(40, 1, 1, 16, generator=gen)
    positions = torch.randint(0, 40, (13,), generator=gen)

    def norm(x):
        return fused_kernels.rms_norm(x, norm_weight, 1e-6)

    def rope(x):
        return fused_kernels.rotary_bshd(x, freqs, positions, False, False, 1.0)

    results = {}
    for mode in ("eager", "compile"):
        impl(mode)
        head = _with_grads(logprob_head.log_probs_and_entropy, logits, labels, 0.9)
        pointwise = []
        for fn, x in ((norm, hidden), (rope, query)):
            x = x.detach().clone().requires_grad_(True)
            out = fn(x)
            out.backward(torch.ones_like(out))
            pointwise += [out.detach(), x.grad]
        results[mode] = (*head, *pointwise)
    for a, b in zip(results["compile"], results["eager"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_compiled_kernels_take_their_float_arguments_as_constants(impl):
    """A float left dynamic is a 0-d CPU tensor input of the graph: on CUDA its C++ kernel makes every fresh
    process build inductor's CPU vector-ISA probes (most of a warm start). The graphs see eps as a constant."""
    impl("compile")
    inputs = []

    def record(graph, example_inputs):
        inputs.extend(example_inputs)
        return graph.forward

    rows = torch.compile(fused_kernels._rms_norm_rows.__wrapped__, dynamic=True, backend=record)
    rows(torch.randn(6, 8), torch.randn(8), 1e-6)
    assert inputs and all(not isinstance(x, torch.Tensor) or x.dim() > 0 for x in inputs), inputs


def test_megatron_swiglu_is_compiled_when_the_config_asks(impl):
    """--fused-kernels compile sets bias_activation_fusion: megatron's compiled SwiGLU gives the eager GLU."""
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl

    impl("compile")  # megatron's jit_fuser compiles only under compile (slime/patches/megatron_core.py)

    x = torch.randn(9, 1, 12, requires_grad=True)
    fused = bias_swiglu_impl(x, None)
    fused.backward(torch.ones_like(fused))
    grad, x.grad = x.grad, None
    a, b = torch.chunk(x, 2, dim=-1)
    eager = torch.nn.functional.silu(a) * b
    eager.backward(torch.ones_like(eager))
    torch.testing.assert_close(fused, eager)
    torch.testing.assert_close(grad, x.grad)


def _vocab_parallel_head(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    logits, labels = _case(rows=19, vocab=64, seed=5)
    shard = logits.chunk(world_size, dim=-1)[rank]
    got = _with_grads(lambda x, y, t: logprob_head.log_probs_and_entropy(x, y, t, dist.group.WORLD),
                      shard, labels, 0.8)
    want = _with_grads(_unfused, logits, labels, 0.8)
    return {"log_probs": (got[0] - want[0]).abs().max().item(), "entropy": (got[1] - want[1]).abs().max().item(),
            "grad": (got[2] - want[2].chunk(world_size, dim=-1)[rank]).abs().max().item()}


@pytest.mark.timeout(120)
def test_fused_head_over_a_vocab_shard_per_rank():
    """TP2: each rank holds half the vocabulary; values equal the full-vocabulary head, gradients its shard's."""
    for diffs in run_ranks(_vocab_parallel_head, world_size=2, timeout_s=90):
        assert max(diffs.values()) < 2e-6, diffs

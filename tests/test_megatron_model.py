"""megatron-core GPTModel built from a tiny HF Qwen3: parity with transformers, TP2 x CP4 x SP
packed forward/backward, optimizer step and dist checkpoint round trip (gloo, deadlines)."""

from __future__ import annotations


import pytest
import torch

from mp_utils import run_ranks
from tiny_models import save_tiny_qwen3
from train_step_harness import build_loaded_model, model_args

pytestmark = pytest.mark.ranks

SEQ_LENS = (13, 29, 7)  # real lengths of the packed sequences


def _sequences(vocab: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (n,), generator=gen) for n in SEQ_LENS]


def _zigzag(t: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """Test-local zig-zag slice (the data side owns the real one)."""
    chunks = t.chunk(2 * cp)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]])


def _packed_batch(seqs, cp: int, cp_rank: int, multiple: int):
    """input_ids/targets/positions [1, T_local], loss mask and PackedSeqParams for a CP rank."""
    from megatron.core.packed_seq_params import PackedSeqParams

    ids, targets, positions, mask, lengths = [], [], [], [], []
    for seq in seqs:
        length = -(-len(seq) // multiple) * multiple
        padded = torch.zeros(length, dtype=torch.long)
        padded[: len(seq)] = seq
        target = torch.zeros(length, dtype=torch.long)
        target[: len(seq) - 1] = seq[1:]
        valid = torch.zeros(length)
        valid[: len(seq) - 1] = 1
        pos = torch.arange(length)
        for out, full in ((ids, padded), (targets, target), (positions, pos), (mask, valid)):
            out.append(_zigzag(full, cp, cp_rank))
        lengths.append(length)
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
    cat = lambda xs: torch.cat(xs).unsqueeze(0)
    return cat(ids), cat(targets), cat(positions), cat(mask), params


def _token_log_probs(model, ids, targets, positions, params):
    """Per-token log p(target) [1, T_local] from vocab-parallel logits [1, T_local, V/tp]."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits = model(ids, positions, attention_mask=None, packed_seq_params=params)
    return -vocab_parallel_cross_entropy(logits.transpose(0, 1).contiguous(), targets.t()).t()


def _hf_reference(hf_dir):
    """Per-sequence target log-probs and the grad norm of their (masked) sum, from transformers."""
    from transformers import Qwen3ForCausalLM

    hf = Qwen3ForCausalLM.from_pretrained(hf_dir).float()
    total, per_seq = 0.0, []
    for seq in _sequences(hf.config.vocab_size):
        logp = torch.log_softmax(hf(seq.unsqueeze(0)).logits[0, :-1], -1)
        token_logp = logp.gather(-1, seq[1:, None])[:, 0]
        per_seq.append(token_logp.detach())
        total = total + token_logp.sum()
    total.backward()
    grad_norm = torch.sqrt(sum((p.grad ** 2).sum() for p in hf.parameters() if p.grad is not None))
    return per_seq, float(grad_norm)


def _forward_backward_step(rank, world, hf_dir, tp, cp, sp):
    """One packed micro-batch: log-probs, backward of -sum(logp), optimizer step, new loss."""
    from megatron.core import parallel_state
    from megatron.core.distributed import finalize_model_grads

    args = model_args(tensor_model_parallel_size=tp, context_parallel_size=cp, sequence_parallel=sp)
    model, optimizer, scheduler = build_loaded_model(args, hf_dir)
    vocab = model[0].module.vocab_size
    cp_rank = parallel_state.get_context_parallel_rank()
    ids, targets, positions, mask, params = _packed_batch(
        _sequences(vocab), cp, cp_rank, 2 * cp * (tp if sp else 1))
    model[0].zero_grad_buffer()
    optimizer.zero_grad()
    logp = _token_log_probs(model[0], ids, targets, positions, params)
    # DDP averages grads over DP x CP (= cp ranks here): scale so the result is d(sum)/d(theta).
    loss = -(logp * mask).sum() * cp
    loss.backward()
    finalize_model_grads(model)
    ok, grad_norm, _ = optimizer.step()
    scheduler.step(1)
    with torch.no_grad():
        new_loss = float(-(_token_log_probs(model[0], ids, targets, positions, params) * mask).sum())
    return dict(cp_rank=cp_rank, positions=positions[0], mask=mask[0], logp=logp[0].detach(),
                grad_norm=float(grad_norm), ok=bool(ok), loss=float(loss) / cp, new_loss=new_loss)


def _per_sequence_log_probs(results, cp, multiple):
    """Reassemble per-sequence real-token log-probs from the CP ranks' zig-zag slices."""
    out = []
    offset = 0
    for n in SEQ_LENS:
        length = -(-n // multiple) * multiple
        full = torch.zeros(length)
        local = length // cp
        for res in results:
            positions = res["positions"][offset: offset + local]
            full[positions] = res["logp"][offset: offset + local]
        out.append(full[: n - 1])
        offset += local
    return out


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return save_tiny_qwen3(str(tmp_path_factory.mktemp("tiny_qwen3")))


def _logits_single_rank(rank, world, hf_dir):
    # 512 -> 768 rows: padded vocabulary columns must not change the softmax.
    model, _, _ = build_loaded_model(model_args(make_vocab_size_divisible_by=384), hf_dir)
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(24).unsqueeze(0).expand(2, -1)
    with torch.no_grad():
        return ids, model[0](ids, positions, attention_mask=None)


@pytest.mark.timeout(120)
def test_single_rank_logits_match_transformers(hf_dir):
    from transformers import Qwen3ForCausalLM

    ((ids, logits),) = run_ranks(_logits_single_rank, 1, args=(hf_dir,), timeout_s=100)
    with torch.no_grad():
        reference = Qwen3ForCausalLM.from_pretrained(hf_dir).float()(ids).logits
    assert logits.shape == (*reference.shape[:2], 768)
    torch.testing.assert_close(logits[..., :512], reference, rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.log_softmax(logits, -1)[..., :512],
                               torch.log_softmax(reference, -1), rtol=0, atol=1e-5)


@pytest.mark.timeout(300)
def test_tp2_cp4_sp_packed_forward_backward_matches_transformers(hf_dir):
    tp, cp = 2, 4
    results = run_ranks(_forward_backward_step, tp * cp, args=(hf_dir, tp, cp, True), timeout_s=280)
    reference_logp, reference_grad_norm = _hf_reference(hf_dir)
    # Both TP ranks of a CP rank hold the same log-probs; take TP rank 0 of each CP rank.
    by_cp = {res["cp_rank"]: res for res in results}
    assert sorted(by_cp) == list(range(cp))
    got = _per_sequence_log_probs([by_cp[r] for r in range(cp)], cp, 2 * cp * tp)
    for mine, ref in zip(got, reference_logp):
        torch.testing.assert_close(mine, ref, rtol=0, atol=2e-5)
    # Grad norm: every rank reports the same global norm, equal to transformers'.
    norms = {round(res["grad_norm"], 6) for res in results}
    assert len(norms) == 1, norms
    assert abs(results[0]["grad_norm"] - reference_grad_norm) < 1e-4 * reference_grad_norm
    # The optimizer step ran everywhere and lowered the loss of the batch it trained on.
    assert all(res["ok"] for res in results)
    total_before = sum(by_cp[r]["loss"] for r in range(cp))
    total_after = sum(by_cp[r]["new_loss"] for r in range(cp))
    assert total_after < total_before


def test_cpu_patches_are_scoped_to_megatron_and_idempotent():
    from slime import patches

    patches.apply_all()
    patches.apply_all()
    from megatron.core.tensor_parallel import layers

    assert layers.torch.cuda.current_device() == torch.device("cpu")
    assert layers.torch.zeros(2, device="cuda").device.type == "cpu"
    assert torch.zeros(1).device.type == "cpu"  # the real torch is untouched
    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(1, device="cuda")


def _checkpoint_round_trip(rank, world, hf_dir, ckpt_dir):
    from slime.backends.megatron_utils.checkpoint import load_checkpoint, save_checkpoint

    args = model_args(tensor_model_parallel_size=world, use_distributed_optimizer=True)
    model, optimizer, scheduler = build_loaded_model(args, hf_dir)
    ids, targets, positions, mask, params = _packed_batch(_sequences(512), 1, 0, 2 * world)
    # One step so the optimizer has state worth saving.
    from megatron.core.distributed import finalize_model_grads

    model[0].zero_grad_buffer()
    optimizer.zero_grad()
    (-(_token_log_probs(model[0], ids, targets, positions, params) * mask).sum()).backward()
    finalize_model_grads(model)
    optimizer.step()
    scheduler.step(1)
    saved = {n: p.detach().clone() for n, p in model[0].named_parameters()}
    save_checkpoint(ckpt_dir, 3, model, optimizer, scheduler)
    with torch.no_grad():
        for p in model[0].parameters():
            p.add_(1.0)
    iteration = load_checkpoint(ckpt_dir, model, optimizer, scheduler)
    restored = all(torch.equal(saved[n], p) for n, p in model[0].named_parameters())
    return iteration, restored, scheduler.num_steps


@pytest.mark.timeout(200)
def test_dist_checkpoint_save_load_restores_model_at_tp2(hf_dir, tmp_path):
    results = run_ranks(_checkpoint_round_trip, 2, args=(hf_dir, str(tmp_path / "ckpt")), timeout_s=190)
    assert results == [(3, True, 1), (3, True, 1)]


def test_transformer_config_from_hf_reads_architecture_and_checks_flags():
    from transformers import Qwen2Config

    from slime.backends.megatron_utils.model import padded_vocab_size, transformer_config_from_hf
    from tiny_models import tiny_qwen3_config

    qwen3 = transformer_config_from_hf(tiny_qwen3_config(), model_args(tensor_model_parallel_size=2))
    assert (qwen3.num_query_groups, qwen3.kv_channels, qwen3.qk_layernorm, qwen3.add_qkv_bias) == (2, 16, True, False)
    assert qwen3.gated_linear_unit and qwen3.normalization == "RMSNorm" and qwen3.layernorm_epsilon == 1e-6
    assert qwen3.params_dtype == torch.float32 and qwen3.tensor_model_parallel_size == 2
    qwen2 = transformer_config_from_hf(
        Qwen2Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2), model_args())
    assert (qwen2.qk_layernorm, qwen2.add_qkv_bias, qwen2.kv_channels) == (False, True, 16)
    with pytest.raises(ValueError, match="num-query-groups"):
        transformer_config_from_hf(tiny_qwen3_config(), model_args(num_query_groups=4))
    with pytest.raises(ValueError, match="untie"):
        transformer_config_from_hf(tiny_qwen3_config(tie_word_embeddings=True),
                                   model_args(untie_embeddings_and_output_weights=True))
    assert padded_vocab_size(151936, 2) == 151936
    assert padded_vocab_size(151936, 2, divisible_by=128) == 152064


def test_the_layer_spec_is_the_measured_local_one_unless_transformer_engine_is_asked_for():
    from argparse import Namespace

    from slime.backends.megatron_utils import model

    assert model._use_transformer_engine(Namespace(transformer_impl=None)) is False
    assert model._use_transformer_engine(Namespace(transformer_impl="local")) is False
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="needs CUDA"):
            model._use_transformer_engine(Namespace(transformer_impl="transformer_engine"))

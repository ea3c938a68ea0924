"""Micro-batch plans, packing and zig-zag slicing (pure CPU)."""

import random
import warnings

import pytest
import torch

from slime.backends.megatron_utils.data import (
    PADDING_SAMPLE_ID,
    build_rollout_plans,
    pack_micro_batch,
    pad_multiple_for,
    round_up,
    unpack_response_values,
    zigzag_gather,
    zigzag_index,
    zigzag_slice,
)


def _plans(lengths, loss_counts=None, *, dp_size, dynamic=True, max_tokens=64, cp=2, num_steps=1,
           mbs=1, balance=True, pad=8):
    loss_counts = loss_counts if loss_counts is not None else [max(0, n - 3) for n in lengths]
    return [
        build_rollout_plans(lengths, loss_counts, num_steps=num_steps, dp_size=dp_size, dp_rank=r,
                            use_dynamic_batch_size=dynamic, max_tokens_per_gpu=max_tokens, cp_size=cp,
                            micro_batch_size=mbs, global_batch_size=None, balance_data=balance, pad_multiple=pad)
        for r in range(dp_size)
    ]


ADVERSARIAL = [
    [1] * 17,
    [128] * 3 + [1] * 40,
    [127, 1, 127, 1, 64, 65, 63, 8, 9, 120],
    [5],
    list(range(1, 60)),
]


@pytest.mark.parametrize("lengths", ADVERSARIAL)
@pytest.mark.parametrize("dp_size", [1, 2, 3, 4])
def test_dynamic_plan_invariants(lengths, dp_size):
    cp, pad, max_tokens = 2, 8, 64
    budget = max_tokens * cp
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        per_rank = _plans(lengths, dp_size=dp_size, cp=cp, pad=pad, max_tokens=max_tokens)
    seen = []
    for plans in per_rank:
        (plan,) = plans
        seen += [i for mb in plan.micro_batches for i in mb]
        for mb, padded in zip(plan.micro_batches, plan.padded_lengths):
            if mb:
                assert len(mb) == 1 or padded <= budget, (mb, padded)
            assert padded > 0  # a padding micro-batch still runs a dummy sequence
        assert plan.step_loss_token_total == sum(max(0, n - 3) for n in lengths)
        assert plan.step_sample_count == len(lengths)
    # what the all-rank fence compares is equal on every DP rank
    assert len({repr(plans[0].fingerprint_fields()) for plans in per_rank}) == 1
    assert sorted(seen) == list(range(len(lengths)))
    # Only ranks that have no sample at all (more ranks than samples) or single-sample
    # micro-batches only need padding micro-batches.
    for plans in per_rank:
        plan = plans[0]
        if plan.num_padding_micro_batches:
            assert all(len(mb) <= 1 for mb in plan.micro_batches)


def test_plan_is_deterministic():
    rng = random.Random(0)
    lengths = [rng.randint(1, 200) for _ in range(64)]
    a = _plans(lengths, dp_size=4, max_tokens=100)
    b = _plans(list(lengths), dp_size=4, max_tokens=100)
    assert a == b
    assert [p[0].fingerprint_fields() for p in a] == [p[0].fingerprint_fields() for p in b]
    c = _plans(lengths[:-1] + [lengths[-1] + 50], dp_size=4, max_tokens=100)
    assert c[0][0].global_digest != a[0][0].global_digest


def test_oversized_sample_gets_own_micro_batch_and_warns():
    with pytest.warns(UserWarning, match="micro-batch of its own"):
        (plans,) = _plans([300, 10, 10], dp_size=1, max_tokens=32, cp=2)
    assert (0,) in plans[0].micro_batches
    assert all(p <= 64 for mb, p in zip(plans[0].micro_batches, plans[0].padded_lengths) if mb != (0,))


def test_counts_equalised_by_splitting_before_padding():
    # rank 0 gets one 3-sample micro-batch, rank 1 three single-sample ones (big samples)
    lengths = [60, 60, 60, 4, 4, 4]
    plans = _plans(lengths, dp_size=2, balance=False, max_tokens=32, cp=2, pad=4)
    assert [p[0].num_micro_batches for p in plans] == [3, 3]
    assert plans[0][0].num_padding_micro_batches == 0
    assert plans[1][0].num_padding_micro_batches == 0


def test_padding_micro_batches_when_a_rank_has_no_sample():
    plans = _plans([10, 10, 10], dp_size=4, max_tokens=64, cp=1, pad=2)
    assert [p[0].num_micro_batches for p in plans] == [1, 1, 1, 1]
    assert plans[3][0].micro_batches == ((),)
    assert plans[3][0].num_padding_micro_batches == 1


def test_fixed_micro_batches_and_steps():
    lengths = list(range(10, 26))
    plans = _plans(lengths, dp_size=2, dynamic=False, mbs=2, num_steps=2, balance=False)
    assert [len(p) for p in plans] == [2, 2]
    step1_rank0 = plans[0][1]
    assert step1_rank0.step_index == 1
    assert step1_rank0.micro_batches == ((8, 9), (10, 11))
    assert step1_rank0.step_sample_count == 8
    with pytest.raises(ValueError):
        _plans(lengths, dp_size=2, num_steps=3)


def test_zigzag_round_trip_and_layout():
    seq = torch.arange(16)
    parts = [zigzag_slice(seq, 4, r) for r in range(4)]
    assert parts[0].tolist() == [0, 1, 14, 15]
    assert parts[1].tolist() == [2, 3, 12, 13]
    assert torch.equal(zigzag_gather(parts), seq)
    x = torch.randn(24, 3)
    assert torch.equal(zigzag_gather([zigzag_slice(x, 3, r) for r in range(3)]), x)
    with pytest.raises(ValueError):
        zigzag_slice(torch.arange(10), 4, 0)


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_zigzag_index_takes_what_zigzag_slice_of_each_sequence_holds(cp):
    lengths = [2 * cp, 6 * cp, 4 * cp]
    packed = torch.arange(sum(lengths)) * 10
    sequences = packed.split(lengths)
    for r in range(cp):
        expected = torch.cat([zigzag_slice(s, cp, r) for s in sequences])
        assert torch.equal(packed[zigzag_index(lengths, cp, r)], expected)
    with pytest.raises(ValueError):
        zigzag_index([2 * cp, 2 * cp + 1], cp, 0)


def _rollout():
    tokens = [[5, 6, 7, 8, 9], [11, 12, 13], [21, 22, 23, 24, 25, 26, 27]]
    responses = [2, 1, 4]
    return {
        "tokens": tokens,
        "response_lengths": responses,
        "loss_masks": [[1, 1], [1], [1, 0, 1, 1]],
        "advantages": [[0.5, 0.5], [-1.0], [2.0, 2.0, 2.0, 2.0]],
        "log_probs": [[-0.1, -0.2], [-0.3], [-0.4, -0.5, -0.6, -0.7]],
        "rewards": [1.0, 0.0, 1.0],
    }


def test_pack_alignment_single_rank():
    data = _rollout()
    packed = pack_micro_batch(data, [0, 2], cp_size=1, cp_rank=0, tp_size=1, sequence_parallel=False)
    assert packed.cu_seqlens.tolist() == [0, 6, 14]
    assert packed.cu_seqlens.dtype == torch.int32
    # sample 0: prompt 3 tokens; response tokens 8, 9 are predicted at positions 2, 3
    assert packed.labels[:6].tolist() == [6, 7, 8, 9, 0, 0]
    assert packed.loss_mask[:6].tolist() == [0, 0, 1, 1, 0, 0]
    assert packed.old_log_probs[2:4].tolist() == pytest.approx([-0.1, -0.2])
    assert packed.position_ids[0, 6:14].tolist() == list(range(8))
    assert packed.loss_mask[6:14].tolist() == [0, 0, 1, 0, 1, 1, 0, 0]
    assert packed.sample_weight[6].item() == pytest.approx(1 / 3)
    assert packed.ref_log_probs is None


@pytest.mark.parametrize("cp,tp,sp", [(2, 1, False), (4, 2, True), (3, 1, False)])
def test_pack_cp_slices_gather_back(cp, tp, sp):
    data = _rollout()
    ids = [0, 1, 2]
    parts = [pack_micro_batch(data, ids, cp_size=cp, cp_rank=r, tp_size=tp, sequence_parallel=sp) for r in range(cp)]
    multiple = pad_multiple_for(cp, tp, sp)
    assert parts[0].padded_lengths == tuple(round_up(len(t), multiple) for t in data["tokens"])
    assert len({p.input_ids.shape for p in parts}) == 1
    if sp:
        assert parts[0].input_ids.shape[1] % tp == 0
    gathered = torch.stack([p.old_log_probs for p in parts])
    values = unpack_response_values(gathered, parts[0])
    assert values.keys() == {0, 1, 2}
    for i in ids:
        assert values[i] == pytest.approx(data["log_probs"][i])
    total_mask = sum(float(p.loss_mask.sum()) for p in parts)
    assert total_mask == sum(sum(m) for m in data["loss_masks"])


def test_padding_micro_batch_is_a_dummy_sequence():
    data = _rollout()
    packed = pack_micro_batch(data, [], cp_size=2, cp_rank=1, tp_size=2, sequence_parallel=True)
    assert packed.is_padding and packed.sample_ids == (PADDING_SAMPLE_ID,)
    assert packed.input_ids.shape == (1, 4)
    assert float(packed.loss_mask.abs().sum()) == 0.0
    assert packed.advantages is not None and float(packed.advantages.abs().sum()) == 0.0
    assert unpack_response_values(torch.zeros(2, 4), packed) == {}


def test_fuzzed_plans_keep_invariants():
    rng = random.Random(7)
    for _ in range(150):
        n = rng.randint(1, 40)
        lengths = [rng.choice([rng.randint(1, 16), rng.randint(1, 300)]) for _ in range(n)]
        dp, cp = rng.randint(1, 5), rng.choice([1, 2, 4])
        max_tokens = rng.choice([8, 32, 100])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            per_rank = _plans(lengths, dp_size=dp, cp=cp, max_tokens=max_tokens, pad=2 * cp,
                              balance=rng.random() < 0.5)
        plans = [p[0] for p in per_rank]
        assert len({p.num_micro_batches for p in plans}) == 1
        ids = sorted(i for p in plans for mb in p.micro_batches for i in mb)
        assert ids == list(range(n))
        for p in plans:
            for mb, padded in zip(p.micro_batches, p.padded_lengths):
                assert (not mb and padded == 2 * cp) or len(mb) == 1 or padded <= max_tokens * cp
            assert p.num_padding_micro_batches == sum(1 for mb in p.micro_batches if not mb)

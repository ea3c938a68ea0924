"""The critic's model: the actor's megatron GPTModel with a scalar value head, against transformers'
Qwen3ForTokenClassification (num_labels 1) built from the same tiny checkpoint: values and the head's gradient,
on one rank and at TP2 x SP (the head replicated over TP after the sequence-parallel gather)."""
from __future__ import annotations


import pytest
import torch

from mp_utils import run_ranks
from tiny_models import save_tiny_qwen3
from train_step_harness import build_loaded_model, model_args

pytestmark = pytest.mark.ranks

SEQ = 16


def _reference(hf_dir: str):
    from transformers import Qwen3ForTokenClassification

    torch.manual_seed(5)
    model = Qwen3ForTokenClassification.from_pretrained(hf_dir, num_labels=1).float()
    torch.nn.init.normal_(model.score.weight, std=0.5)  # a head that is not zero, so the values say something
    return model


def _gpt(module):
    while hasattr(module, "module"):
        module = module.module
    return module


def _values_and_grads(rank, world, hf_dir, head_weight, ids):
    from slime.backends.megatron_utils.value_head import attach_value_head

    chunks, _, _ = build_loaded_model(model_args(tensor_model_parallel_size=world, sequence_parallel=world > 1), hf_dir)
    model = attach_value_head(_gpt(chunks[0]), head_weight)
    positions = torch.arange(ids.shape[1]).unsqueeze(0).expand(ids.shape[0], -1)
    values = model(ids, positions, attention_mask=None)
    values.sum().backward()
    norm = model.decoder.final_layernorm.weight
    norm_grad = norm.grad if norm.grad is not None else norm.main_grad  # DDP moves it into its buffer
    return values.detach(), model.output_layer.weight.grad.clone(), norm_grad.detach().clone()


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    hf_dir = save_tiny_qwen3(str(tmp_path_factory.mktemp("tiny_qwen3_critic")))
    reference = _reference(hf_dir)
    ids = torch.randint(0, reference.config.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(3))
    values = reference(ids).logits
    values.sum().backward()
    grads = (reference.score.weight.grad.clone(), reference.model.norm.weight.grad.clone())
    return hf_dir, reference.score.weight.detach().clone(), ids, values.detach(), grads


@pytest.mark.timeout(200)
@pytest.mark.parametrize("tp", [1, 2], ids=["one_rank", "tp2_sp"])
def test_value_model_matches_transformers_token_classification(case, tp):
    hf_dir, head, ids, ref_values, (ref_head_grad, ref_norm_grad) = case
    results = run_ranks(_values_and_grads, tp, args=(hf_dir, head, ids), timeout_s=150)
    for values, head_grad, _ in results:
        assert values.shape == ref_values.shape == (2, SEQ, 1)
        torch.testing.assert_close(values, ref_values, rtol=0, atol=1e-5)
        torch.testing.assert_close(head_grad, ref_head_grad, rtol=1e-4, atol=1e-4)
    # under SP each rank holds the final norm's gradient of its sequence slice (megatron all-reduces them over TP
    # after backward): their sum is the whole gradient once, the gather's backward did not add the TP copies
    norm_grad = torch.stack([r[2] for r in results]).sum(0)
    torch.testing.assert_close(norm_grad, ref_norm_grad, rtol=1e-4, atol=1e-4)


def test_a_value_head_starts_at_zero_without_weights():
    from slime.backends.megatron_utils.value_head import ValueHead

    head = ValueHead(8, sequence_parallel=False, tp_group=None)
    values, bias = head(torch.randn(3, 2, 8))
    assert bias is None and values.shape == (3, 2, 1) and torch.count_nonzero(values) == 0

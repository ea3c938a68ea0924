"""The embedded engine decodes with its KV cache under both spellings of transformers' cache argument.

transformers renamed forward's `past_key_values` to `cache`; the GPU machines' image has 5.17 (only
`past_key_values`), this venv a later one (`cache`, the old name deprecated). A name the model does not
take vanishes into its **kwargs: every decode step after the first then saw its new token alone, and
the log-probs the engine reported were not the policy's (seen: a 0.54 trainer/engine log-prob diff
on the H200 before any training step). The proof here: the log-probs of what the engine generates equal
a full-sequence forward's, for the stock model and for one with the older signature.
"""
from __future__ import annotations

import pytest
import torch
from transformers import Qwen3ForCausalLM

from slime.backends.embedded_engine.engine import EmbeddedEngine, GenerationRequest, cache_keyword
from slime.backends.embedded_engine.sampling import SamplingParams
from slime.tools.tiny_checkpoint import TinyQwen3Spec, write_tiny_checkpoint

pytestmark = pytest.mark.timeout(120)

PROMPTS = ("123", "4567890", "55")  # different lengths: a left-padded batch


class PastKeyValuesQwen3(Qwen3ForCausalLM):
    """The forward signature of transformers before the rename: the cache is `past_key_values`, and
    any other keyword is swallowed by **kwargs (as the real 5.17 model does with `cache`)."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                use_cache=None, logits_to_keep=0, **kwargs):
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               cache=past_key_values, use_cache=use_cache, logits_to_keep=logits_to_keep)


class CacheIgnoringQwen3(Qwen3ForCausalLM):
    """Takes `cache` but decodes without it: what the engine must refuse rather than report."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, use_cache=None,
                logits_to_keep=0, **kwargs):
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               use_cache=use_cache, logits_to_keep=logits_to_keep)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("kv"), TinyQwen3Spec(alphabet="0123456789", layers=2))


def _engine(checkpoint, model_class) -> EmbeddedEngine:
    engine = EmbeddedEngine(str(checkpoint), seed=3)
    engine.model.__class__ = model_class  # same weights, that class's forward signature
    return engine


def _generate(engine: EmbeddedEngine):
    params = SamplingParams(max_new_tokens=5, ignore_eos=True)
    requests = [GenerationRequest(rid=str(i), input_ids=tuple(engine.tokenize(p)), params=params,
                                  return_logprob=True) for i, p in enumerate(PROMPTS)]
    return requests, engine.generate_batch(requests)


def test_cache_keyword_follows_the_forward_signature(checkpoint):
    engine = EmbeddedEngine(str(checkpoint))
    assert cache_keyword(engine.model) == "cache"  # this venv's transformers
    engine.model.__class__ = PastKeyValuesQwen3
    assert cache_keyword(engine.model) == "past_key_values"
    with pytest.raises(TypeError, match="neither `cache` nor `past_key_values`"):
        cache_keyword(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("model_class", [Qwen3ForCausalLM, PastKeyValuesQwen3], ids=["cache", "past_key_values"])
def test_decoded_log_probs_equal_a_full_forward(checkpoint, model_class):
    engine = _engine(checkpoint, model_class)
    requests, results = _generate(engine)
    for request, result in zip(requests, results):
        assert len(result.output_ids) == 5
        sequence = torch.tensor([list(request.input_ids) + result.output_ids])
        with torch.no_grad():
            logp = torch.log_softmax(Qwen3ForCausalLM.forward(engine.model, sequence).logits[0].float(), -1)
        start = len(request.input_ids) - 1
        reference = [logp[start + k, token].item() for k, token in enumerate(result.output_ids)]
        torch.testing.assert_close(torch.tensor(result.output_logprobs), torch.tensor(reference),
                                   rtol=0, atol=1e-5)


def test_a_model_that_ignores_the_cache_is_refused(checkpoint):
    engine = _engine(checkpoint, CacheIgnoringQwen3)
    with pytest.raises(RuntimeError, match="did not use the engine's cache"):
        _generate(engine)

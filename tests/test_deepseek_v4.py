"""DeepSeek-V4 (slime/models/deepseek_v4.py) against transformers' own DeepseekV4ForCausalLM, from a tiny checkpoint
that class wrote (tests/tiny_models.py: one layer of each attention kind, a hash-routed and two sqrt(softplus)-routed
MoE layers, 3 hyper-connection streams, every part perturbed so a wrong mapping shows up):

- one rank: the logits equal transformers' (fp32, 1e-5), every gradient of the summed log-probs equals transformers'
  (the frozen indexer has none on either side), HF -> megatron -> HF gives back every tensor bit-exactly under the
  checkpoint's own names;
- forked gloo ranks at TP2 x SP x CP2 x EP2: the same logits and export; two fenced training steps whose loss and
  grad norm equal the single process's, each followed by the weight push (WeightSync, the distributed transport) to
  an embedded engine serving transformers' class, whose log-probs then equal the trainer's; every collective of
  the steps and the pushes in the ledger, the order proof holding; the expert bias moves, the hash table and the
  indexer do not;
- what is not built is refused before Ray starts, naming the fix.
"""
from __future__ import annotations

import json

import pytest
import torch

from family_push import TP2_SP_CP2_EP2, engine_log_probs
from mp_utils import run_ranks
from slime.backends.megatron_utils.model import PADDED_VOCAB_LOGIT

pytestmark = pytest.mark.ranks

SEQ = 16
ARCHITECTURE = "DeepseekV4ForCausalLM"
TRAINING = dict(expert_tensor_parallel_size=1, calculate_per_token_loss=True, lr=1e-3,
                moe_router_bias_update_rate=0.05)
LAYOUT = TP2_SP_CP2_EP2
FENCE_S = 60.0
_REFERENCE = {}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """(checkpoint dir with the tiny checkpoint's tokenizer, rollout)."""
    from slime.tools.tiny_checkpoint import TinyQwen3Spec, write_tiny_checkpoint
    from tiny_models import replace_model, save_tiny_deepseek_v4
    from train_step_harness import make_rollout

    checkpoint = write_tiny_checkpoint(tmp_path_factory.mktemp("deepseek_v4") / "m",
                                       TinyQwen3Spec(alphabet="0123456789"))
    replace_model(checkpoint, save_tiny_deepseek_v4)
    vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    return str(checkpoint), make_rollout(num_samples=4, seed=2, vocab=vocab, max_len=20)


def _tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (1, SEQ), generator=torch.Generator().manual_seed(0))


def _logits_and_export(args, hf_dir, grads: bool = False) -> dict:
    """This rank's logits of `_tokens` (its CP positions), the HF export and, with `grads`, the HF-named gradients
    of the summed next-token log-probs (one rank)."""
    import transformers
    from megatron.core import parallel_state

    from slime.backends.megatron_utils.model import build_gpt_model
    from slime_plugins.models.cp_attention import zigzag_positions
    from slime_plugins.models.hf_weights import export_hf_weights, load_hf_weights

    hf_config = transformers.AutoConfig.from_pretrained(hf_dir)
    model = build_gpt_model(args, hf_config)
    load_hf_weights([model], hf_dir, hf_config)
    exported = {name: t.clone() for name, t in export_hf_weights([model], hf_config)}
    tokens, positions = _tokens(hf_config.vocab_size), torch.arange(SEQ)
    if args.context_parallel_size > 1:
        positions = zigzag_positions(SEQ, args.context_parallel_size, parallel_state.get_context_parallel_rank())
    model.eval()
    with torch.no_grad():
        logits = model(tokens[:, positions], positions.unsqueeze(0), None)[0]
    result = dict(logits=logits, positions=positions, tp_rank=parallel_state.get_tensor_model_parallel_rank(),
                  exported=exported)
    if grads:
        log_probs = model(tokens, positions.unsqueeze(0), None)[0].float().log_softmax(-1)
        log_probs[:-1].gather(-1, tokens[0, 1:, None]).sum().backward()
        with torch.no_grad():
            for param in model.parameters():
                param.copy_(param.grad if param.grad is not None else torch.full_like(param, float("nan")))
        result["grads"] = {name: t.clone() for name, t in export_hf_weights([model], hf_config)}
    return result


def _train_child(rank, world, hf_dir, data, layout, url, ledger_dir):
    """The logits and export at this layout, then two fenced training steps, each followed by the weight push to
    the engine at `url` (None: no push) and the engine's log-probs; every collective in a ledger."""
    import datetime

    import torch.distributed as dist
    from megatron.core import parallel_state
    from transformers import AutoConfig

    from slime.backends.weight_sync import sync as weight_sync
    from slime.backends.megatron_utils.train_step import compute_log_probs, train_one_step
    from slime.distributed import Fence, Watchdog
    from slime.distributed.instrument import instrument_collectives, uninstrument_collectives
    from slime.distributed.ledger import Ledger
    from slime.models.registry import family_of
    from slime_plugins.models.hf_weights import export_hf_weights, unwrap_model
    from train_step_harness import build_loaded_model, layout_args, plans_for_this_rank

    from slime.models import compressed_attention

    if world == 1:  # the reference attends a few queries at a time: the chunks and their recompute are exercised
        compressed_attention.QUERY_CHUNK = 5
    args = layout_args(dict(layout, **TRAINING), fence_timeout=FENCE_S, colocate=False, rollout_num_gpus_per_engine=1,
                       update_weight_buffer_size=64 * 1024)
    model, optimizer, scheduler = build_loaded_model(args, hf_dir)
    hf_config = AutoConfig.from_pretrained(hf_dir)
    result = _logits_and_export(args, hf_dir, grads=world == 1)
    assert family_of(hf_config).name == "DeepSeek-V4"
    frozen = lambda: {n: t.clone() for n, t in export_hf_weights(model, hf_config)  # noqa: E731
                      if ".indexer." in n or n.endswith("tid2eid")}
    loaded_frozen = frozen()
    (plan,) = plans_for_this_rank(data, args)
    before = compute_log_probs(model, data, plan, args)
    data = dict(data, log_probs=before, ref_log_probs=before, rollout_log_probs=before)
    ledger = Ledger(rank, world, ledger_dir, record_sequence=True)
    fence = Fence(dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=FENCE_S)), rank=rank,
                  world_size=world, timeout_s=FENCE_S, ledger=ledger)
    watchdog = Watchdog(FENCE_S, ledger_dir, rank, world, ledger=ledger)
    sync = weight_sync.WeightSync(args, hf_config, [url], engine_kind="embedded") if url else None
    steps = []
    instrument_collectives(ledger)
    try:
        for rollout_id in range(2):
            with ledger.phase("actor_train"):
                step = train_one_step(model, optimizer, scheduler, data, plan, args)
            after = compute_log_probs(model, data, plan, args)
            served = None
            if sync is not None:
                sync.sync(model, rollout_id, fence=fence, watchdog=watchdog)
                served = engine_log_probs(url, data) if rank == 0 else None
            steps.append(dict(loss=step.loss, grad_norm=step.grad_norm, skipped=step.skipped, after=after,
                              served=served))
    finally:
        uninstrument_collectives()
        watchdog.close()
        ledger.close()
        if sync is not None:
            sync.close()
    bias = {n: t.clone() for n, t in export_hf_weights(model, hf_config) if n.endswith("gate.bias")}
    layers = unwrap_model(model[0]).decoder.layers
    # --save / --load's sharded state: the head-split weights with their TP axis, the shared key's replicated
    sharded = unwrap_model(model[0]).sharded_state_dict()
    attention = "decoder.layers.1.self_attention."
    shards = {name: (tuple(sharded[attention + name].local_shape), tuple(sharded[attention + name].global_shape))
              for name in ("linear_q_up_proj.weight", "sinks", "linear_proj.weight", "linear_kv_proj.weight")}
    refused = None
    if world == 1:  # a loaded table listing an expert twice for a token is refused when first used
        with torch.no_grad():
            layers[0].mlp.router.tid2eid[3] = 1
        try:
            compute_log_probs(model, data, plan, args)
        except ValueError as exc:
            refused = str(exc)
    return dict(result, before=before, steps=steps, bias=bias, refused=refused, frozen_moved=[n for n, t in frozen().items()
                                                                           if not torch.equal(t, loaded_frozen[n])],
                stream_width=layers[1].attention_mixer.fn.shape[-1], rank=rank, shards=shards,
                dp=parallel_state.get_data_parallel_world_size())


def _hf(hf_dir):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    assert type(model).__name__ == ARCHITECTURE
    return model


def _check_logits_and_export(result, reference_logits, original):
    width = result["logits"].shape[-1]  # this TP rank's columns of the padded vocabulary
    want = reference_logits[result["positions"]][:, result["tp_rank"] * width:(result["tp_rank"] + 1) * width]
    real = want.shape[-1]  # a TP rank may hold padded columns only (the tokenizer's vocabulary is small)
    assert real == 0 or (result["logits"][:, :real] - want).abs().max().item() < 1e-5
    assert (result["logits"][:, real:] == PADDED_VOCAB_LOGIT).all()
    exported = result["exported"]
    assert sorted(exported) == sorted(original)
    assert all(torch.equal(exported[name], original[name]) for name in original)


def _check_gradients(model, grads):
    """transformers' gradients (in its in-memory names and fused experts) against ours (checkpoint names)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, apply_renamings

    renamings = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]
    in_memory = {apply_renamings(name, renamings): name for name in grads}
    in_memory.update({name: name for name in grads})  # model.norm.weight keeps its name
    compared = 0
    for name, param in model.named_parameters():
        if ".indexer." in name:  # frozen here; transformers' indexer gives indices only
            assert param.grad is None and grads[in_memory[name]].isnan().all(), name
            continue
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            prefix = name.rsplit(".experts.", 1)[0].replace(".mlp", ".ffn")
            parts = ("w1", "w3") if name.endswith("gate_up_proj") else ("w2",)
            ours = torch.stack([torch.cat([grads[f"{prefix}.experts.{e}.{p}.weight"] for p in parts])
                                for e in range(param.shape[0])])
        else:
            ours = grads[in_memory[name]]
        assert (ours - param.grad).abs().max().item() <= 1e-5 * max(1.0, param.grad.abs().max().item()), name
        compared += 1
    assert compared == sum(".indexer." not in n for n, _ in model.named_parameters())


def _reference(hf_dir, data, tmp_path):
    if hf_dir not in _REFERENCE:
        (_REFERENCE[hf_dir],) = run_ranks(_train_child, 1, args=(hf_dir, data, {}, None, str(tmp_path / "single")),
                                          timeout_s=200)
    return _REFERENCE[hf_dir]


@pytest.mark.timeout(240)
def test_one_rank_logits_gradients_and_export_are_transformers(assets, tmp_path):
    from safetensors.torch import load_file

    hf_dir, data = assets
    single = _reference(hf_dir, data, tmp_path)
    hf = _hf(hf_dir)
    tokens = _tokens(hf.config.vocab_size)
    logits = hf(tokens, use_cache=False).logits[0]
    logits.log_softmax(-1)[:-1].gather(-1, tokens[0, 1:, None]).sum().backward()
    _check_logits_and_export(single, logits.detach(), load_file(f"{hf_dir}/model.safetensors"))
    _check_gradients(hf, single["grads"])
    assert "tid2eid row 3 is [1, 1]; each token needs 2 distinct experts" in single["refused"]
    assert single["stream_width"] == hf.config.hc_mult * hf.config.hidden_size


@pytest.fixture(scope="module")
def engine(assets, tmp_path_factory):
    from slime.backends.sglang_utils.launcher import launch_engine
    from slime.config import defaults_namespace

    handle = launch_engine("embedded", defaults_namespace(seed=7), 0, 0, assets[0], startup_timeout_s=120,
                           log_dir=str(tmp_path_factory.mktemp("engine-logs")))
    yield handle
    handle.stop(grace_s=2.0)


@pytest.mark.timeout(360)
def test_tp2_sp_cp2_ep2_trains_as_one_rank_and_every_push_gives_the_engine_the_trainers_log_probs(
        assets, engine, tmp_path):
    from safetensors.torch import load_file

    from slime.distributed.order_proof import check_order, read_sequences

    hf_dir, data = assets
    single = _reference(hf_dir, data, tmp_path)
    served_before = engine_log_probs(engine.url, data)  # transformers' class, as loaded
    for got, want in zip(single["before"], served_before):
        assert got == pytest.approx(want, abs=1e-5)
    (tmp_path / "ledger").mkdir()
    results = run_ranks(_train_child, 4, args=(hf_dir, data, LAYOUT, engine.url, str(tmp_path / "ledger")),
                        timeout_s=330)
    report = check_order(read_sequences(str(tmp_path / "ledger")))
    assert report.ok, report.format()
    with torch.no_grad():
        hf = _hf(hf_dir)
        reference = hf(_tokens(hf.config.vocab_size), use_cache=False).logits[0]
    original = load_file(f"{hf_dir}/model.safetensors")
    for result in results:  # every rank exports every tensor (the experts gathered over EP)
        _check_logits_and_export(result, reference, original)
        assert result["frozen_moved"] == [] and result["dp"] == 1
        assert result["shards"] == {"linear_q_up_proj.weight": ((64, 32), (128, 32)), "sinks": ((2,), (4,)),
                                    "linear_proj.weight": ((64, 16), (64, 32)), "linear_kv_proj.weight": ((32, 64),
                                                                                                         (32, 64))}
    first = results[0]
    for got, want in zip(first["before"], single["before"]):
        assert got == pytest.approx(want, abs=1e-5)
    for step, alone in zip(first["steps"], single["steps"]):
        assert not step["skipped"]
        assert step["loss"] == pytest.approx(alone["loss"], abs=1e-5)
        assert step["grad_norm"] == pytest.approx(alone["grad_norm"], rel=1e-4)
        for got, want in zip(step["after"], alone["after"]):
            assert got == pytest.approx(want, abs=1e-5)
        for got, want in zip(step["after"], step["served"]):  # the pushed weights: the trainer's log-probs
            assert got == pytest.approx(want, abs=1e-5)
    moved = max(abs(a - b) for x, y in zip(first["steps"][-1]["after"], first["before"]) for a, b in zip(x, y))
    assert moved > 1e-2
    assert sorted(first["bias"]) == ["model.layers.1.ffn.gate.bias", "model.layers.2.ffn.gate.bias"]
    assert all(not torch.equal(first["bias"][n], original[n]) for n in first["bias"])  # aux-loss-free balancing
    assert all(torch.equal(first["bias"][n], single["bias"][n]) for n in first["bias"])


def test_the_engine_runs_one_row_at_a_time(assets):
    """Left padding would move a compressor's windows: a batch of prompts of different lengths gets each prompt's own
    log-probs, and decoding with the cache gives the full forward's."""
    from slime.backends.embedded_engine.engine import EmbeddedEngine, GenerationRequest
    from slime.backends.embedded_engine.sampling import SamplingParams

    engine = EmbeddedEngine(assets[0])
    params = SamplingParams.from_request({"max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True})
    prompts = [tuple(range(3, 12)), (3, 4)]
    batch = engine.generate_batch([GenerationRequest(rid=str(i), input_ids=p, params=params, return_logprob=True)
                                   for i, p in enumerate(prompts)])
    for prompt, result in zip(prompts, batch):
        sequence = torch.tensor([list(prompt) + result.output_ids])
        with torch.no_grad():
            log_probs = engine.model(sequence, use_cache=False).logits[0].log_softmax(-1)
        want = log_probs[len(prompt) - 1:-1].gather(-1, sequence[0, len(prompt):, None]).squeeze(-1)
        assert result.output_logprobs == pytest.approx(want.tolist(), abs=1e-5)


@pytest.mark.parametrize("flags, says", [
    (dict(pipeline_model_parallel_size=2, num_layers=None), "--pipeline-model-parallel-size above 1"),
    (dict(mtp_num_layers=1), "--mtp-num-layers: transformers' class does not build V4's MTP"),
    (dict(enable_lora=True), "--enable-lora"),
    (dict(spec=["slime_plugins.models.glm4", "get_glm_spec"]), "--spec"),
    (dict(use_rollout_routing_replay=True), "--use-rollout-routing-replay"),
    (dict(moe_aux_loss_coeff=0.01), "--moe-aux-loss-coeff"),
    (dict(dsa_indexer_loss_coeff=1.0), "--dsa-indexer-loss-coeff"),
    (dict(tensor_model_parallel_size=4), "o_groups"),
])
def test_what_is_not_built_is_refused_before_ray(flags, says, tmp_path):
    from slime.config import defaults_namespace
    from slime.config.errors import ArgumentValidationError
    from slime.config.launch import check_hf_config
    from tiny_models import tiny_deepseek_v4_config

    tiny_deepseek_v4_config().save_pretrained(tmp_path)
    config = str(tmp_path / "config.json")
    check_hf_config(defaults_namespace(), config)
    with pytest.raises((ArgumentValidationError, ValueError), match=__import__("re").escape(says)):
        check_hf_config(defaults_namespace(**flags), config)


def test_router_flags_must_agree_with_the_checkpoint():
    from slime.backends.megatron_utils.moe import MoEConfigError, moe_config_fields
    from slime.config import defaults_namespace
    from tiny_models import tiny_deepseek_v4_config

    flags = lambda **f: defaults_namespace(expert_model_parallel_size=1, pipeline_model_parallel_size=1, **f)  # noqa
    fields = moe_config_fields(tiny_deepseek_v4_config(), flags(moe_router_topk_scaling_factor=1.5))
    assert fields["moe_layer_freq"] == [1, 1, 1] and fields["moe_router_enable_expert_bias"]
    assert fields["moe_shared_expert_intermediate_size"] == 32 and not fields["moe_shared_expert_gate"]
    for given, says in [(dict(moe_router_score_function="sigmoid"), "(score_function=sqrtsoftplus)"),
                        (dict(moe_router_topk=4), "(topk=2)")]:
        with pytest.raises(MoEConfigError, match=__import__("re").escape(says)):
            moe_config_fields(tiny_deepseek_v4_config(), flags(**given))

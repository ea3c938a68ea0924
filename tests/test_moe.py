"""Qwen3-MoE on megatron-core: HF parity, weights both ways, the engine's fused experts, bad input,
and the same step (loss, grad norm, log-probs) under every expert-parallel layout (gloo, deadlines)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from mp_utils import run_ranks
from test_train_step import MODES, TOL, assert_matches_reference
from tiny_models import save_tiny_qwen3_moe
from train_step_harness import layout_child, make_rollout, recorded_phase
from slime.config import defaults_namespace

pytestmark = pytest.mark.ranks


@pytest.fixture(scope="module")
def moe_hf_dir(tmp_path_factory):
    return save_tiny_qwen3_moe(str(tmp_path_factory.mktemp("tiny_qwen3_moe")))


@pytest.fixture(scope="module")
def moe_rollout():
    return make_rollout(num_samples=6, seed=3)


def _hf_log_probs(hf_dir: str, data: dict) -> list[list[float]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(hf_dir).float().eval()
    out = []
    with torch.no_grad():
        for tokens, response in zip(data["tokens"], data["response_lengths"]):
            ids = torch.tensor(tokens)[None]
            logp = torch.log_softmax(hf(ids).logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
            out.append(logp[-response:].tolist())
    return out


def _round_trip_child(rank, world, hf_dir, layout):
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from slime_plugins.models.hf_weights import export_hf_weights
    from train_step_harness import build_loaded_model, layout_args

    model, _, _ = build_loaded_model(layout_args(layout), hf_dir)
    exported = list(export_hf_weights(model, AutoConfig.from_pretrained(hf_dir)))
    original = load_file(os.path.join(hf_dir, "model.safetensors"))
    names = [n for n, _ in exported]
    assert sorted(names) == sorted(original) and len(set(names)) == len(names)
    return max(float((t - original[n]).abs().max()) for n, t in exported)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world, layout", [
    (1, {}),
    (4, dict(tensor_model_parallel_size=2, expert_model_parallel_size=2)),  # ETP2: expert rows split too
], ids=["single", "tp2_ep2"])
def test_hf_weights_round_trip(moe_hf_dir, world, layout):
    """load_hf_weights then export_hf_weights gives every checkpoint tensor back, all experts included."""
    assert max(run_ranks(_round_trip_child, world, args=(moe_hf_dir, layout), timeout_s=200)) == 0.0


_EP_REFERENCE = {}


def _single_process(hf_dir, data, aux: float):
    key = (hf_dir, aux)
    if key not in _EP_REFERENCE:
        layout = dict(calculate_per_token_loss=True, moe_aux_loss_coeff=aux)
        (_EP_REFERENCE[key],) = run_ranks(layout_child, 1, args=(layout, hf_dir, data, MODES), timeout_s=120)
    return _EP_REFERENCE[key]


@pytest.mark.timeout(120)
def test_single_process_log_probs_match_transformers(moe_hf_dir, moe_rollout):
    reference = _single_process(moe_hf_dir, moe_rollout, 0.0)
    for got, want in zip(reference["log_probs"], _hf_log_probs(moe_hf_dir, moe_rollout)):
        assert got == pytest.approx(want, abs=1e-5)


MOE_LAYOUTS = {
    "tp2_sp_ep4": dict(tensor_model_parallel_size=2, sequence_parallel=True, expert_model_parallel_size=4),
    "ep2_cp2_tp2": dict(tensor_model_parallel_size=2, sequence_parallel=True, context_parallel_size=2,
                        expert_model_parallel_size=2),
}


def _recorded_layout_child(rank, world, ledger_dir, *args):
    """layout_child with every collective in a ledger that records the whole sequence (the order proof's input)."""
    with recorded_phase(rank, world, ledger_dir):
        return layout_child(rank, world, *args)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", sorted(MOE_LAYOUTS))
def test_moe_layout_matches_single_process(name, moe_hf_dir, moe_rollout, tmp_path):
    """8 ranks, the alltoall dispatcher with uneven per-rank token counts: the single process's numbers, and
    the order proof holds on the recorded step (every all-to-all's token counts pair up across its EP group)."""
    from slime.distributed.order_proof import check_order, read_sequences

    reference = _single_process(moe_hf_dir, moe_rollout, 0.0)
    layout = dict(MOE_LAYOUTS[name], calculate_per_token_loss=True)
    results = run_ranks(_recorded_layout_child, 8, args=(str(tmp_path), layout, moe_hf_dir, moe_rollout, MODES),
                        timeout_s=500)
    assert_matches_reference(results, reference, moe_rollout)
    sequences = read_sequences(str(tmp_path))
    report = check_order(sequences)
    assert report.ok, report.format()
    unnamed = {(op.op, op.phase) for sequence in sequences.values() for op in sequence.ops if op.group == "unnamed"}
    assert not unnamed, f"ops on groups without a name: {sorted(unnamed)}"
    a2a = [op for op in sequences[0].ops if op.op == "all_to_all_single"]
    assert a2a and all(op.group == "ep" and op.peer[0] == "splits" for op in a2a)
    assert any(len(set(op.peer[1])) > 1 for op in a2a), "the token counts should differ per peer"


@pytest.mark.timeout(600)
def test_ep1_and_ep4_agree_with_the_aux_loss(moe_hf_dir, moe_rollout):
    """Same DP, same plan: EP only moves experts, so loss and grad norm (aux-loss gradients included) agree."""
    runs, modes = {}, ("per_token",)
    for ep in (1, 4):
        layout = dict(expert_model_parallel_size=ep, calculate_per_token_loss=True, moe_aux_loss_coeff=0.01)
        runs[ep] = run_ranks(layout_child, 4, args=(layout, moe_hf_dir, moe_rollout, modes), timeout_s=280)
    without_aux = _single_process(moe_hf_dir, moe_rollout, 0.0)
    for mode in modes:
        ep1, ep4 = runs[1][0]["steps"][mode], runs[4][0]["steps"][mode]
        assert ep4["loss"] == pytest.approx(ep1["loss"], abs=TOL)
        assert ep4["grad_norm"] == pytest.approx(ep1["grad_norm"], rel=TOL, abs=TOL)
        # the aux loss reaches the gradients (and only them: the reported loss is the policy's)
        assert ep1["grad_norm"] != pytest.approx(without_aux["steps"][mode]["grad_norm"], rel=1e-4)


# ------------------------------------------------------------------ bad input


def _moe_args(**overrides):
    fields = dict(num_experts=None, moe_router_topk=None, moe_ffn_hidden_size=None, moe_layer_freq=None,
                  expert_model_parallel_size=1, pipeline_model_parallel_size=1)
    return defaults_namespace(**{**fields, **overrides})


def test_flags_that_contradict_the_checkpoint_are_refused(moe_hf_dir):
    from transformers import AutoConfig

    from slime.backends.megatron_utils.moe import MoEConfigError, moe_config_fields

    config = AutoConfig.from_pretrained(moe_hf_dir)
    assert moe_config_fields(config, _moe_args())["num_moe_experts"] == 8
    cases = [
        (dict(num_experts=16), "--num-experts 16 does not match the HF checkpoint's config (num_experts=8)"),
        (dict(expert_model_parallel_size=3), "--expert-model-parallel-size 3 does not divide the checkpoint's 8"),
        (dict(moe_router_topk=4), "--moe-router-topk 4 does not match"),
        (dict(moe_token_dispatcher_type="allgather", expert_model_parallel_size=2),
         "use --moe-token-dispatcher-type alltoall"),
    ]
    for overrides, message in cases:
        with pytest.raises(MoEConfigError) as info:
            moe_config_fields(config, _moe_args(**overrides))
        assert message in str(info.value)
    config.num_experts_per_tok = 9
    with pytest.raises(MoEConfigError, match="top-k 9 is above the expert count 8"):
        moe_config_fields(config, _moe_args())


def test_num_experts_on_a_dense_checkpoint_is_refused(tmp_path):
    from tiny_models import tiny_qwen3_config

    from slime.backends.megatron_utils.moe import MoEConfigError, moe_config_fields

    with pytest.raises(MoEConfigError, match="the HF checkpoint is dense"):
        moe_config_fields(tiny_qwen3_config(), _moe_args(num_experts=8))


def _load_child(rank, world, hf_dir):
    from train_step_harness import build_loaded_model, layout_args

    build_loaded_model(layout_args({}), hf_dir)


def test_checkpoint_with_other_expert_count_is_refused_at_load(moe_hf_dir, tmp_path):
    """config.json says 4 experts, the safetensors hold 8: the load names both counts and the fix."""
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(moe_hf_dir, bad)
    config = json.loads((bad / "config.json").read_text())
    config.pop("num_local_experts", None)  # transformers' alias; hub configs spell it num_experts
    config["num_experts"] = 4
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(RuntimeError, match="holds 8 experts per MoE layer, its config.json .and --num-experts. says 4"):
        run_ranks(_load_child, 1, args=(str(bad),), timeout_s=120)


# ------------------------------------------------------------------ the engine's side


def test_engine_takes_checkpoint_named_experts(tmp_path):
    """A push speaks checkpoint names (model.layers.L.mlp.experts.E.gate_proj.weight); transformers keeps the
    experts fused: every expert's rows land where the model reads them."""
    from safetensors.torch import load_file

    from slime.backends.embedded_engine.engine import EmbeddedEngine
    from slime.tools.tiny_checkpoint import TinyQwen3Spec, write_tiny_checkpoint

    path = write_tiny_checkpoint(tmp_path / "m", TinyQwen3Spec(num_experts=4, moe_topk=2, alphabet="0123456789"))
    engine = EmbeddedEngine(str(path))
    tensors = load_file(os.path.join(path, "model.safetensors"))
    changed = [(n, t + 1.0) for n, t in tensors.items() if ".mlp.experts." in n]
    assert len(changed) == 2 * 4 * 3
    assert engine.update_weights(changed, "v2") == len(changed)
    for name, tensor in changed:
        assert torch.equal(engine.get_weight(name), tensor)
    with pytest.raises(ValueError, match="unknown parameter"):
        engine.update_weights([("model.layers.0.mlp.experts.9.up_proj.weight", changed[0][1])], "v3")


# ------------------------------------------------------------------ the fence's view of the all-to-alls


def _a2a(rank: int, sent: tuple, received: tuple, seq: int = 1):
    from slime.distributed.order_proof import SequenceOp

    return SequenceOp(seq=seq, position=seq, phase="actor_train/forward_backward", op="all_to_all_single",
                      group="ep", ranks=(0, 1), shape=(-1, 64), dtype="float32",
                      peer=("splits", sent, received))


def test_order_proof_pairs_all_to_all_token_counts():
    """Uneven per-rank counts are the norm (same row shape on both ranks); counts that do not pair are named."""
    from slime.distributed.order_proof import RankSequence, check_order

    good = {0: RankSequence(0, (_a2a(0, (3, 5), (3, 2)),), ()), 1: RankSequence(1, (_a2a(1, (2, 7), (5, 7)),), ())}
    assert check_order(good).ok
    bad = {0: good[0], 1: RankSequence(1, (_a2a(1, (2, 7), (4, 7)),), ())}
    report = check_order(bad)
    assert not report.ok and "rank 0 sends 5 rows to rank 1, which expects 4" in report.format()


def test_engine_returns_the_experts_each_token_went_to(tmp_path):
    """meta_info.routed_experts (SGLang's field): every token the model was fed, per MoE layer, the top-k ids
    transformers' router chose; left padding of a batch does not shift them."""
    from transformers import AutoModelForCausalLM

    from slime.backends.embedded_engine.engine import EmbeddedEngine, GenerationRequest
    from slime.backends.embedded_engine.sampling import SamplingParams
    from slime.tools.tiny_checkpoint import TinyQwen3Spec, write_tiny_checkpoint
    from slime_plugins.models.qwen3_moe import decode_routes, router_modules

    path = write_tiny_checkpoint(tmp_path / "m", TinyQwen3Spec(num_experts=8, moe_topk=2, alphabet="0123456789"))
    engine = EmbeddedEngine(str(path), seed=1)
    params = SamplingParams.from_request({"max_new_tokens": 4, "temperature": 1.0})
    requests = [GenerationRequest(rid=str(i), input_ids=prompt, params=params, return_routed_experts=True)
                for i, prompt in enumerate([(3, 4, 5), (6, 7, 8, 9, 10, 11)])]
    results = engine.generate_batch(requests)
    hf = AutoModelForCausalLM.from_pretrained(str(path)).float().eval()
    seen = []
    hooks = [m.register_forward_hook(lambda mod, i, out: seen.append(out[2])) for m in router_modules(hf)]
    for request, result in zip(requests, results):
        fed = list(request.input_ids) + result.output_ids[:-1]
        routes = decode_routes(result.to_sglang()["meta_info"]["routed_experts"], num_layers=2, topk=2)
        seen.clear()
        with torch.no_grad():
            hf(torch.tensor([fed]))
        want = torch.stack(seen, dim=1).numpy()  # [tokens, layers, k]
        assert routes.shape == (len(fed), 2, 2)
        assert (routes == want).all()
    for hook in hooks:
        hook.remove()


def _hf_routes(hf_dir: str, data: dict) -> list[str]:
    """What an engine would return for each sample: base64 int32 [total - 1, layers, k] from transformers."""
    import base64

    from transformers import AutoModelForCausalLM

    from slime_plugins.models.qwen3_moe import router_modules

    hf = AutoModelForCausalLM.from_pretrained(hf_dir).float().eval()
    seen = []
    hooks = [m.register_forward_hook(lambda mod, i, out: seen.append(out[2])) for m in router_modules(hf)]
    encoded = []
    with torch.no_grad():
        for tokens in data["tokens"]:
            seen.clear()
            hf(torch.tensor([tokens[:-1]]))
            routes = torch.stack(seen, dim=1).to(torch.int32).contiguous()
            encoded.append(base64.b64encode(routes.numpy().tobytes()).decode())
    for hook in hooks:
        hook.remove()
    return encoded


def _replay_child(rank, world, hf_dir, data, layout):
    import base64

    import numpy as np

    from train_step_harness import plans_for_this_rank
    from slime.backends.megatron_utils.train_step import compute_log_probs
    from train_step_harness import build_loaded_model, layout_args

    args = layout_args(layout, use_rollout_routing_replay=True)
    model, _, _ = build_loaded_model(args, hf_dir)
    (plan,) = plans_for_this_rank(data, args)
    same = compute_log_probs(model, data, plan, args)
    shifted = dict(data)  # every token sent to the next expert ids: a different expert path
    shifted["rollout_routed_experts"] = [
        base64.b64encode(((np.frombuffer(base64.b64decode(r), dtype=np.int32) + 3) % 8).astype(np.int32).tobytes())
        .decode() for r in data["rollout_routed_experts"]]
    return same, compute_log_probs(model, shifted, plan, args)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world, layout", [(1, {}), (4, dict(tensor_model_parallel_size=2, sequence_parallel=True,
                                                             context_parallel_size=2))], ids=["single", "tp2_sp_cp2"])
def test_rollout_routes_are_replayed_in_the_log_prob_forward(moe_hf_dir, moe_rollout, world, layout):
    """The engine's own routes give the engine's log-probs (CP zig-zag and SP chunks line up); other routes
    change them, so the replay is really used."""
    data = dict(moe_rollout, rollout_routed_experts=_hf_routes(moe_hf_dir, moe_rollout))
    results = run_ranks(_replay_child, world, args=(moe_hf_dir, data, layout), timeout_s=260)
    same, shifted = results[0]
    want = _hf_log_probs(moe_hf_dir, moe_rollout)
    for got, ref in zip(same, want):
        assert got == pytest.approx(ref, abs=1e-5)
    assert max(abs(a - b) for x, y in zip(shifted, want) for a, b in zip(x, y)) > 1e-2

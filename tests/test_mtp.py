"""Multi-token prediction: checkpoints that carry MTP layers (MiMo's and DeepSeek-V3's spellings) load and save
bit-exactly with them, the main model's log-probs equal transformers' (which drops the MTP layers) and are unchanged
by them, the weight push leaves them out, --mtp-num-layers alone carries them untrained, and --enable-mtp-training
trains them beside the main loss with the same step at TP2 x SP, CP2, TP2 x SP x CP2, PP2 and PP2 x CP2 as on one
rank (the MTP layers' shifted tokens come with each CP rank's slice: no point-to-point message; under PP the last
stage's copy of the embedding stays the first stage's).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from mp_utils import run_ranks
from tiny_models import save_tiny_after_decoder_mtp, save_tiny_mimo, save_tiny_qwen3_next_mtp
from train_step_harness import layout_args, make_rollout, recorded_phase

MTP_FLAGS = {"plain": {}, "carried": dict(mtp_num_layers=1),
             "trained": dict(mtp_num_layers=1, enable_mtp_training=True, mtp_loss_scaling_factor=0.3)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    return {"mimo": save_tiny_mimo(str(root / "mimo")), "deepseek_v3": save_tiny_after_decoder_mtp(str(root / "dsv3"), "deepseek_v3"),
            "glm4_moe_lite": save_tiny_after_decoder_mtp(str(root / "glm47"), "glm4_moe_lite"),
            "qwen3_next": save_tiny_qwen3_next_mtp(str(root / "qwen3_next"))}


def _hf_config(hf_dir: str):
    import transformers

    with open(os.path.join(hf_dir, "config.json")) as f:
        if json.load(f)["model_type"] == "mimo":  # no MiMo class in transformers: its config is Qwen2's
            return transformers.Qwen2Config.from_pretrained(hf_dir)
    return transformers.AutoConfig.from_pretrained(hf_dir)


def _reference_log_probs(hf_dir: str, data: dict) -> list[list[float]]:
    """transformers' log-probs of the response tokens (MiMo's main model is Qwen2's; both drop the MTP layers)."""
    import transformers

    config = _hf_config(hf_dir)
    cls = transformers.Qwen2ForCausalLM if config.model_type == "mimo" else transformers.AutoModelForCausalLM
    model = cls.from_pretrained(hf_dir, config=config, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for tokens, response in zip(data["tokens"], data["response_lengths"]):
            logits = model(torch.tensor([tokens])).logits[0].float().log_softmax(-1)
            first = len(tokens) - response
            out.append([logits[j - 1, tokens[j]].item() for j in range(first, len(tokens))])
    return out


def _mimo_mtp_reference(hf_dir: str, data: dict, scale: float) -> float:
    """The MTP loss of one step from transformers' own Qwen2 parts, wired as MiMo's modeling_mimo.py wires its MTP
    layer: input_proj([hidden_layernorm(h_t); token_layernorm(embed(x_t+1))]), a Qwen2 decoder layer, final_layernorm,
    the shared lm_head; its cross-entropy on token t+2 weighted as the main loss weighs that token (per sample)."""
    from safetensors.torch import load_file
    from transformers.models.qwen2 import modeling_qwen2 as qwen2

    config = _hf_config(hf_dir)
    config._attn_implementation = "eager"
    main = qwen2.Qwen2ForCausalLM.from_pretrained(hf_dir, config=config, dtype=torch.float32).eval()
    weights = {k.removeprefix("model.mtp_layers.0."): v for k, v in
               load_file(os.path.join(hf_dir, "model.safetensors")).items() if k.startswith("model.mtp_layers.0.")}
    layer = qwen2.Qwen2DecoderLayer(config, layer_idx=0).float().eval()
    layer.load_state_dict({k: v for k, v in weights.items() if k.startswith(("self_attn.", "mlp.", "input_layernorm", "post_"))})
    norms = {}
    for name in ("token_layernorm", "hidden_layernorm", "final_layernorm"):
        norms[name] = qwen2.Qwen2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        norms[name].weight.data.copy_(weights[name + ".weight"])
    total = 0.0
    with torch.no_grad():
        for tokens, response, mask in zip(data["tokens"], data["response_lengths"], data["loss_masks"]):
            ids = torch.tensor([tokens])
            hidden = main.model(ids).last_hidden_state[:, :-1]  # h_t for t < T-1, after the final norm
            merged = torch.cat([norms["hidden_layernorm"](hidden), norms["token_layernorm"](main.model.embed_tokens(ids[:, 1:]))], -1)
            x = merged @ weights["input_proj.weight"].T
            positions = torch.arange(x.size(1)).unsqueeze(0)
            causal = torch.full((x.size(1), x.size(1)), float("-inf")).triu(1)[None, None]
            x = layer(x, attention_mask=causal, position_ids=positions,
                      position_embeddings=main.model.rotary_emb(x, positions))
            log_probs = main.lm_head(norms["final_layernorm"](x)).log_softmax(-1)[0]
            first = len(tokens) - response
            for j in range(max(first, 2), len(tokens)):  # x_j predicted at t = j - 2
                total -= log_probs[j - 2, tokens[j]].item() * mask[j - first] / sum(mask)
    return scale * total / len(data["tokens"])


def _build(args, hf_dir):
    from slime.backends.megatron_utils.model import build_model_and_optimizer
    from slime.models.hf_weights import load_hf_weights

    hf_config = _hf_config(hf_dir)
    model, optimizer, scheduler = build_model_and_optimizer(args, hf_config)
    load_hf_weights(model, hf_dir, hf_config)
    return model, optimizer, scheduler, hf_config


def _mtp_params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model[0].module.named_parameters() if n.startswith("mtp.")}


def _child(rank, world, hf_dir, data, layout, steps, ledger_dir=None):
    """Per MTP mode: log-probs after the load, the exports (with and without MTP), `steps` training steps (the
    trained mode's first one with its collectives in a ledger under `ledger_dir`, if given)."""
    import copy

    from slime.backends.megatron_utils.parallel import init_model_parallel
    from slime.backends.megatron_utils.train_step import compute_log_probs, train_one_step
    from slime.models.hf_weights import export_hf_weights
    from train_step_harness import plans_for_this_rank

    init_model_parallel(layout_args(layout))
    out = {}
    for mode, flags in MTP_FLAGS.items():
        args = layout_args(layout, lr=1e-2, **flags)
        model, optimizer, scheduler, hf_config = _build(args, hf_dir)
        (plan,) = plans_for_this_rank(data, args)
        run = copy.deepcopy(data)
        before = compute_log_probs(model, run, plan, args)
        run.update(log_probs=before, ref_log_probs=before, rollout_log_probs=before)
        result = dict(log_probs=before, pushed=[n for n, _ in export_hf_weights(model, hf_config, mtp=False)])
        if mode == "trained":
            result["saved"] = {n: t.clone() for n, t in export_hf_weights(model, hf_config)}
        mtp_before = _mtp_params(model)
        step = lambda: train_one_step(model, optimizer, scheduler, run, plan, args)  # noqa: E731
        first = _in_ledger(step, rank, world, ledger_dir) if mode == "trained" and ledger_dir else step()
        result["steps"] = [first] + [step() for _ in range(steps - 1)]
        result["mtp_changed"] = sorted(n for n, p in _mtp_params(model).items() if not torch.equal(p, mtp_before[n]))
        result["mtp_count"] = len(mtp_before)
        out[mode] = result
    return out


def _in_ledger(step, rank, world, ledger_dir):
    """`step()` with every collective recorded in a ledger that keeps the whole sequence (the order proof's input)."""
    with recorded_phase(rank, world, ledger_dir):
        return step()


# where each family's checkpoint keeps its MTP layer
MTP_PREFIXES = {"deepseek_v3": "model.layers.3.", "glm4_moe_lite": "model.layers.3.", "mimo": "model.mtp_layers.", "qwen3_next": "mtp."}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family, layout", [
    ("deepseek_v3", dict(tensor_model_parallel_size=2, sequence_parallel=True, expert_model_parallel_size=2,
                         expert_tensor_parallel_size=1)),
    ("glm4_moe_lite", dict(context_parallel_size=2)), ("mimo", {}), ("qwen3_next", {})])
def test_mtp_checkpoint_round_trips_and_main_model_matches_transformers(checkpoints, family, layout, tmp_path):
    """Every rank exports every tensor (the MTP layer's experts too, all-gathered over EP), bit-exactly; the step's
    collectives, MTP loss included, pass the fence's order proof, with no point-to-point op (GLM-4.7-Flash at CP2)."""
    from safetensors.torch import load_file

    from slime.distributed.order_proof import check_order, read_sequences

    hf_dir = checkpoints[family]
    data = make_rollout(num_samples=3, seed=4, vocab=512, max_len=16)
    world = layout.get("tensor_model_parallel_size", 1) * layout.get("context_parallel_size", 1)
    out, *_ = run_ranks(_child, world, args=(hf_dir, data, layout, 1, str(tmp_path)), timeout_s=240)
    report = check_order(read_sequences(str(tmp_path)))
    assert report.ok and report.ranks == world and report.ops > 0, report.format()
    assert not _p2p_ops(str(tmp_path))
    original = load_file(os.path.join(hf_dir, "model.safetensors"))
    saved = out["trained"]["saved"]
    is_mtp = lambda name: name.startswith(MTP_PREFIXES[family])  # noqa: E731
    assert sorted(saved) == sorted(original) and any(is_mtp(n) for n in original)
    for name, tensor in original.items():
        assert torch.equal(saved[name], tensor), name
    assert sorted(out["trained"]["pushed"]) == sorted(n for n in original if not is_mtp(n))
    reference = _reference_log_probs(hf_dir, data)
    for mode in MTP_FLAGS:  # the MTP layers change nothing the engines or the old-policy pass see
        got = out[mode]["log_probs"]
        assert max(abs(a - b) for r, g in zip(reference, got) for a, b in zip(r, g)) < 1e-5, mode
    step = out["trained"]["steps"][0]
    assert step.metrics["mtp_loss"] > 0 and not step.skipped
    assert out["trained"]["mtp_changed"]
    if family == "mimo":  # the MTP loss itself, against transformers' parts wired as MiMo wires them
        reference = _mimo_mtp_reference(hf_dir, data, MTP_FLAGS["trained"]["mtp_loss_scaling_factor"])
        assert _close(step.metrics["mtp_loss"], reference), (step.metrics["mtp_loss"], reference)


def _p2p_ops(ledger_dir: str) -> set[str]:
    """The point-to-point ops in a ledger (megatron's own MTP sends tokens between CP ranks with some)."""
    from slime.distributed.order_proof import read_sequences

    return {op.op for seq in read_sequences(ledger_dir).values() for op in seq.ops
            if op.op in ("isend", "irecv", "send", "recv", "batch_isend_irecv")}


def _close(a: float, b: float, tol: float = 1e-5) -> bool:
    return abs(a - b) <= tol * max(1.0, abs(a), abs(b))


@pytest.mark.timeout(300)
def test_mtp_trains_beside_the_main_loss_alike_at_tp2_sp_and_one_rank(checkpoints):
    hf_dir = checkpoints["mimo"]
    data = make_rollout(num_samples=4, seed=5, vocab=512, max_len=20)
    (single,) = run_ranks(_child, 1, args=(hf_dir, data, {}, 3), timeout_s=240)
    tp = run_ranks(_child, 2, args=(hf_dir, data, dict(tensor_model_parallel_size=2, sequence_parallel=True), 3),
                   timeout_s=240)
    for out in (single, *tp):
        plain, carried, trained = (out[m]["steps"] for m in MTP_FLAGS)
        # --mtp-num-layers alone: the layers are loaded and saved, not run nor trained: the same step as without
        assert [(s.loss, s.grad_norm) for s in carried] == [(s.loss, s.grad_norm) for s in plain]
        assert out["carried"]["mtp_changed"] == [] and out["carried"]["mtp_count"] > 0
        # trained: the MTP loss adds to the main one, and falls as its layers learn
        assert "mtp_loss" not in plain[0].metrics
        assert _close(trained[0].metrics["pg_loss"], plain[0].metrics["pg_loss"])
        assert _close(trained[0].loss - trained[0].metrics["mtp_loss"], plain[0].loss)
        losses = [s.metrics["mtp_loss"] for s in trained]
        assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses
        assert len(out["trained"]["mtp_changed"]) == out["trained"]["mtp_count"]
    for mode in MTP_FLAGS:
        for a, b in zip(single[mode]["steps"], tp[0][mode]["steps"]):
            assert _close(a.loss, b.loss) and _close(a.grad_norm, b.grad_norm, 1e-4), (mode, a, b)
            assert all(_close(a.metrics[k], b.metrics[k]) for k in a.metrics if k != "train_rollout_logprob_abs_diff")


@pytest.mark.parametrize("cp, tp, sp", [(1, 1, False), (2, 1, False), (4, 2, True)])
def test_mtp_shifted_tokens_are_the_whole_sequence_shift_sliced_for_each_cp_rank(cp, tp, sp):
    """Each CP rank's rows, put back in sequence order, are the tokens and masks 1..D+1 places later in the same
    sequence: across a zig-zag chunk's end (the next chunk, often another rank's) and never into the next sequence."""
    from slime.backends.megatron_utils.data import pack_micro_batch, zigzag_gather

    data = make_rollout(num_samples=3, seed=2, vocab=512, max_len=19)
    depths = 2
    parts = [pack_micro_batch(data, [0, 1, 2], cp_size=cp, cp_rank=r, tp_size=tp, sequence_parallel=sp,
                              mtp_depths=depths) for r in range(cp)]
    offset = 0
    for i, local in enumerate(parts[0].local_lengths):
        span = slice(offset, offset + local)
        offset += local
        shifted_tokens = zigzag_gather([p.mtp_tokens[:, span] for p in parts], dim=-1)
        shifted_masks = zigzag_gather([p.mtp_loss_mask[:, span] for p in parts], dim=-1)
        labels = zigzag_gather([p.labels[span] for p in parts])
        mask = zigzag_gather([p.loss_mask[span] for p in parts])
        tokens, padded = data["tokens"][i], labels.numel()
        for j in range(depths + 1):  # token t + j + 1 of the sample, 0 past its end
            expected = [tokens[t + j + 1] if t + j + 1 < len(tokens) else 0 for t in range(padded)]
            assert shifted_tokens[j].tolist() == expected
        for k in range(1, depths + 1):
            assert torch.equal(shifted_masks[k - 1], torch.cat([mask[k:], mask.new_zeros(k)]))
        assert torch.equal(shifted_tokens[0], labels) and mask.sum() > 0


def _trained_child(rank, world, hf_dir, data, layout, steps, ledger_dir=None):
    """`steps` MTP-training steps (the first one in a ledger under `ledger_dir`, if given)."""
    from slime.backends.megatron_utils.parallel import init_model_parallel
    from slime.backends.megatron_utils.train_step import compute_log_probs, train_one_step
    from train_step_harness import plans_for_this_rank

    args = layout_args(layout, lr=1e-2, **MTP_FLAGS["trained"])
    init_model_parallel(args)
    model, optimizer, scheduler, _ = _build(args, hf_dir)
    (plan,) = plans_for_this_rank(data, args)
    run = dict(data)
    before = compute_log_probs(model, run, plan, args)
    run.update(log_probs=before, ref_log_probs=before, rollout_log_probs=before)
    step = lambda: train_one_step(model, optimizer, scheduler, run, plan, args)  # noqa: E731
    first = _in_ledger(step, rank, world, ledger_dir) if ledger_dir else step()
    return [first] + [step() for _ in range(steps - 1)]


@pytest.mark.timeout(300)
def test_mtp_trains_alike_under_context_parallelism(checkpoints, tmp_path):
    """MTP at CP2 and TP2 x SP x CP2: the loss, the MTP loss and the grad norm of two steps are the single rank's;
    the step's collectives pass the order proof and hold no point-to-point message (megatron's CP roll sends some)."""
    from slime.distributed.order_proof import check_order, read_sequences

    hf_dir = checkpoints["mimo"]
    data = make_rollout(num_samples=4, seed=6, vocab=512, max_len=21)
    (single,) = run_ranks(_trained_child, 1, args=(hf_dir, data, {}, 2), timeout_s=240)
    for name, layout in (("cp2", dict(context_parallel_size=2)),
                         ("tp2_sp_cp2", dict(tensor_model_parallel_size=2, sequence_parallel=True,
                                             context_parallel_size=2))):
        ledger = tmp_path / name
        world = layout.get("tensor_model_parallel_size", 1) * layout["context_parallel_size"]
        ranks = run_ranks(_trained_child, world, args=(hf_dir, data, layout, 2, str(ledger)), timeout_s=240)
        report = check_order(read_sequences(str(ledger)))
        assert report.ok and report.ranks == world and report.ops > 0, report.format()
        assert not _p2p_ops(str(ledger)), name
        for steps in ranks:
            for a, b in zip(single, steps):
                assert not b.skipped and b.metrics["mtp_loss"] > 0, (name, b)
                assert _close(a.loss, b.loss) and _close(a.metrics["mtp_loss"], b.metrics["mtp_loss"]), (name, a, b)
                assert _close(a.grad_norm, b.grad_norm, 1e-4), (name, a, b)
        assert ranks[0][1].metrics["mtp_loss"] != ranks[0][0].metrics["mtp_loss"]  # the second step saw the update


def _pipeline_child(rank, world, hf_dir, data, layout, steps, ledger_dir, save_dir):
    """--save-hf right after the load and the weight push's names (exported and planned), then `steps` MTP-training
    steps (the first in a ledger); this rank's embedding before and after them, and whether it is the MTP stage's
    copy."""
    from megatron.core import parallel_state

    from slime.backends.megatron_utils.checkpoint import save_hf_checkpoint
    from slime.backends.megatron_utils.parallel import init_model_parallel
    from slime.backends.megatron_utils.train_step import compute_log_probs, train_one_step
    from slime.backends.weight_sync.plan import hf_tensor_sizes
    from slime.models.hf_weights import export_hf_weights
    from train_step_harness import plans_for_this_rank

    args = layout_args(layout, lr=1e-2, **MTP_FLAGS["trained"])
    init_model_parallel(args)
    model, optimizer, scheduler, hf_config = _build(args, hf_dir)
    save_hf_checkpoint(save_dir, model, hf_config, hf_dir)
    pushed = [n for n, _ in export_hf_weights(model, hf_config, mtp=False)]
    planned = [n for n, _ in hf_tensor_sizes(model, hf_config, tp_size=1)]
    module = model[0].module
    embedding = module.embedding.word_embeddings.weight
    before = embedding.detach().clone()
    (plan,) = plans_for_this_rank(data, args)
    run = dict(data)
    log_probs = compute_log_probs(model, run, plan, args)
    run.update(log_probs=log_probs, ref_log_probs=log_probs, rollout_log_probs=log_probs)
    step = lambda: train_one_step(model, optimizer, scheduler, run, plan, args)  # noqa: E731
    results = [_in_ledger(step, rank, world, ledger_dir)] + [step() for _ in range(steps - 1)]
    return dict(steps=results, log_probs=log_probs, pushed=pushed, planned=planned, before=before, after=embedding.detach().clone(),
                stage=parallel_state.get_pipeline_model_parallel_rank(), has_mtp=module.mtp_process,
                copy=bool(getattr(embedding, "shared", False)))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family, layout", [
    ("mimo", dict(pipeline_model_parallel_size=2, context_parallel_size=2)),
    ("glm4_moe_lite", dict(pipeline_model_parallel_size=2, decoder_first_pipeline_num_layers=1))])
def test_mtp_trains_alike_under_pipeline_parallelism(checkpoints, family, layout, tmp_path):
    """MTP at PP2 x CP2 (MiMo) and PP2 (GLM-4.7-Flash, whose MTP layer keeps its own embed_tokens): the MTP layers
    on the last stage, beside a copy of the embedding. The same loss, MTP loss and grad norm over two steps as one
    rank, transformers' log-probs; the two stages' embeddings equal after the steps (their grads all-reduced over the
    embedding group, in the ledger, the order proof holding); --save-hf writes the checkpoint back bit-exactly,
    embed_tokens once (the MTP layer's own copy from the last stage)."""
    from safetensors.torch import load_file

    from slime.distributed.order_proof import check_order, read_sequences

    hf_dir = checkpoints[family]
    data = make_rollout(num_samples=4, seed=7, vocab=512, max_len=21)
    (single,) = run_ranks(_trained_child, 1, args=(hf_dir, data, {}, 2), timeout_s=240)
    world = 2 * layout.get("context_parallel_size", 1)
    ledger, saved = tmp_path / "ledger", tmp_path / "saved"
    ranks = run_ranks(_pipeline_child, world, args=(hf_dir, data, layout, 2, str(ledger), str(saved)),
                      timeout_s=240)
    sequences = read_sequences(str(ledger))
    report = check_order(sequences)
    assert report.ok and report.ranks == world and report.ops > 0, report.format()
    embd = [op for seq in sequences.values() for op in seq.ops if op.group.startswith("embd")]
    assert {op.op for op in embd} == {"all_reduce"} and len(embd) == world, embd  # once per rank, in grad_reduce
    reference = _reference_log_probs(hf_dir, data)
    for out in ranks:
        got = out["log_probs"]
        assert max(abs(a - b) for r, g in zip(reference, got) for a, b in zip(r, g)) < 1e-5
        assert torch.equal(out["before"], ranks[0]["before"]) and torch.equal(out["after"], ranks[0]["after"])
        assert not torch.equal(out["after"], out["before"])  # the embedding trained, on both stages alike
        for a, b in zip(single, out["steps"]):
            assert not b.skipped and b.metrics["mtp_loss"] > 0, b
            assert _close(a.loss, b.loss) and _close(a.metrics["mtp_loss"], b.metrics["mtp_loss"]), (a, b)
            assert _close(a.grad_norm, b.grad_norm, 1e-4), (a, b)
    original = load_file(os.path.join(hf_dir, "model.safetensors"))
    shards = [load_file(str(f)) for f in sorted(saved.glob("model-*.safetensors"))]
    assert len(shards) == 2 and sum(len(s) for s in shards) == len(original)
    written = {k: v for shard in shards for k, v in shard.items()}
    assert sorted(written) == sorted(original) and "model.embed_tokens.weight" in shards[0]
    for name, tensor in original.items():
        assert torch.equal(written[name], tensor), name
    # the push sends each main-model tensor once (embed_tokens from the first stage), as its plan says
    pushed = [n for out in {out["stage"]: out for out in ranks}.values() for n in out["pushed"]]  # one rank a stage
    assert sorted(pushed) == sorted(n for n in original if not n.startswith(MTP_PREFIXES[family]))
    assert all(out["pushed"] == out["planned"] for out in ranks)
    # the MTP stage holds the copy, marked so that the grad norm counts the embedding once
    half = world // 2
    assert sorted((r["stage"], r["has_mtp"], r["copy"]) for r in ranks) == \
        [(0, False, False)] * half + [(1, True, True)] * half


BASE = ["--rollout-batch-size", "2", "--num-rollout", "1", "--actor-num-gpus-per-node", "2",
        "--train-backend-device", "cpu"]
TINY = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)


@pytest.mark.parametrize("config, flags, says", [
    (dict(model_type="deepseek_v3"), ["--enable-mtp-training"], "pass --mtp-num-layers N"),
    (dict(model_type="deepseek_v3", num_nextn_predict_layers=1, tie_word_embeddings=True),
     ["--mtp-num-layers", "1", "--pipeline-model-parallel-size", "2"],
     "ties lm_head to embed_tokens (tie_word_embeddings=True) is not supported here"),
    (dict(model_type="deepseek_v3", num_nextn_predict_layers=1), ["--mtp-num-layers", "1",
                                                                  "--use-rollout-routing-replay"],
     "--mtp-num-layers 1 with --use-rollout-routing-replay is not supported here"),
    (dict(model_type="qwen3"), ["--mtp-num-layers", "1"], "Qwen3 checkpoints carry no multi-token-prediction"),
    (dict(model_type="deepseek_v3", num_nextn_predict_layers=0), ["--mtp-num-layers", "1"],
     "config.json has no MTP layers"),
    (dict(model_type="mimo", num_nextn_predict_layers=1), ["--mtp-num-layers", "2"],
     "--mtp-num-layers 2 contradicts the checkpoint, which carries 1 MTP layer(s); pass --mtp-num-layers 1"),
])
def test_mtp_flags_are_checked_against_the_checkpoint_before_ray_starts(config, flags, says, tmp_path, capsys):
    from arg_testing import parse_error

    path = tmp_path / "ckpt"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({**TINY, **config}))
    (path / "tokenizer.json").write_text("{}")
    assert says in parse_error([*BASE, "--hf-checkpoint", str(path), *flags], capsys)


def test_a_checkpoint_without_the_mtp_tensors_names_them(checkpoints, tmp_path):
    """A config that claims an MTP layer over weights that lack it (transformers' own classes save none)."""
    from safetensors.torch import load_file, save_file

    from slime.models.hf_weights import HFCheckpointError

    hf_dir = tmp_path / "mimo"
    hf_dir.mkdir()
    for name in ("config.json",):
        (hf_dir / name).write_text((open(os.path.join(checkpoints["mimo"], name))).read())
    tensors = load_file(os.path.join(checkpoints["mimo"], "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if ".mtp_layers." not in k}, str(hf_dir / "model.safetensors"))
    (single,) = run_ranks(_load_only, 1, args=(str(hf_dir),), timeout_s=120)
    assert single.startswith(HFCheckpointError.__name__) and "model.mtp_layers.0." in single
    assert "holds no weights for its multi-token-prediction layers" in single and "drop --mtp-num-layers" in single


def _load_only(rank, world, hf_dir):
    from slime.backends.megatron_utils.parallel import init_model_parallel

    args = layout_args({}, **MTP_FLAGS["carried"])
    init_model_parallel(args)
    try:
        _build(args, hf_dir)
    except Exception as exc:  # noqa: BLE001 (the message is what is checked)
        return f"{type(exc).__name__}: {exc}"
    return "loaded"

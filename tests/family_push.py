"""What the model families' tests share: a family's training steps on forked ranks, each followed by the fenced weight
push to a running embedded engine (the project's WeightSync: its plan, buckets, sessions and fences, over HTTP), the
engine's log-probs read after every push, and every collective of the steps and the pushes recorded for the order
proof; one rank's logits and export against transformers'.

`serve(checkpoint)` the embedded engine's HTTP server (its real routes, over loopback) on a thread of the test
process, which has torch and transformers imported already (a server process would import them again);
`serve_tiny(root, save)` a tiny checkpoint with the project's tiny tokenizer, a rollout and that server;
`train_and_push(rank, world, ledger_dir, hf_dir, data, layout, url, steps)` is one rank's run (`url` None: the
single process's reference, no engine); `engine_log_probs(url, data)` what the engine gives each response;
`check_run` what every family's run must show, `check_layout_run` the run at a layout against the single process's;
`forward_and_export` and `check_logits_and_export` one rank's logits and HF export against transformers';
`check_lora_run` the LoRA steps, merge and push plan.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

FENCE_S = 60.0
BUCKET_BYTES = 256 * 1024  # several buckets per push, even for the tiny models


@contextlib.contextmanager
def serve(checkpoint: str, seed: int = 7):
    """The embedded engine serving `checkpoint`; yields its URL."""
    from rollout_testing import AppThread
    from slime.backends.embedded_engine.engine import EmbeddedEngine
    from slime.backends.embedded_engine.server import build_app
    from slime.utils.security import current_key

    server = AppThread(build_app(EmbeddedEngine(checkpoint, seed=seed), api_key=current_key())).start()
    try:
        yield f"http://127.0.0.1:{server.port}"
    finally:
        server.stop()


@contextlib.contextmanager
def serve_tiny(root, save: Callable[..., str]) -> Iterator[tuple[str, dict, str]]:
    """The tiny checkpoint `save` writes, with the project's tiny tokenizer (digits), a rollout of it, and the
    embedded engine serving it: yields (checkpoint dir, rollout, URL)."""
    import json

    from slime.tools.tiny_checkpoint import TinyQwen3Spec, write_tiny_checkpoint
    from tiny_models import replace_model
    from train_step_harness import make_rollout

    checkpoint = write_tiny_checkpoint(root / "m", TinyQwen3Spec(alphabet="0123456789"))
    replace_model(checkpoint, save)
    vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    with serve(str(checkpoint)) as url:
        yield str(checkpoint), make_rollout(num_samples=4, seed=2, vocab=vocab, max_len=20), url


def engine_log_probs(url: str, data: dict) -> list[list[float]]:
    """SGLang's input_token_logprobs of each sample's response, as the engine computes them."""
    from slime.backends.sglang_utils.http_client import SGLangHTTPClient

    client = SGLangHTTPClient(url)
    try:
        rows = []
        for tokens, response in zip(data["tokens"], data["response_lengths"]):
            reply = client.generate(input_ids=list(tokens), sampling_params={"max_new_tokens": 0, "temperature": 1.0},
                                    return_logprob=True, logprob_start_len=0)
            rows.append([entry[0] for entry in reply["meta_info"]["input_token_logprobs"][-response:]])
        return rows
    finally:
        client.close()


def _fence(rank: int, world: int, ledger):
    import datetime

    import torch.distributed as dist

    from slime.distributed import Fence

    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=FENCE_S))
    return Fence(group, rank=rank, world_size=world, timeout_s=FENCE_S, ledger=ledger)


def train_and_push(rank, world, ledger_dir, hf_dir, data, layout, url, steps: int) -> dict:
    """`steps` training steps on the same rollout; after each, with `url`, the push and the engine's log-probs."""
    from transformers import AutoConfig

    from slime.backends.megatron_utils.train_step import compute_log_probs, train_one_step
    from slime.backends.weight_sync.sync import WeightSync
    from slime.distributed.instrument import instrument_collectives, uninstrument_collectives
    from slime.distributed.ledger import Ledger
    from slime_plugins.models.hf_weights import export_hf_weights
    from train_step_harness import build_loaded_model, layout_args, plans_for_this_rank

    args = layout_args(layout, fence_timeout=FENCE_S, colocate=True, rollout_num_gpus_per_engine=1,
                       update_weight_buffer_size=BUCKET_BYTES)
    hf_config = AutoConfig.from_pretrained(hf_dir)
    model, optimizer, scheduler = build_loaded_model(args, hf_dir)
    (plan,) = plans_for_this_rank(data, args)
    before = compute_log_probs(model, data, plan, args)
    loaded = {name: tensor.clone() for name, tensor in export_hf_weights(model, hf_config)}  # HF -> megatron -> HF
    data = dict(data, log_probs=before, ref_log_probs=before, rollout_log_probs=before)
    ledger = Ledger(rank, world, ledger_dir, record_sequence=True)
    fence = _fence(rank, world, ledger)
    sync = WeightSync(args, hf_config, [url], engine_kind="embedded") if url else None
    results = []
    instrument_collectives(ledger)
    try:
        for step in range(steps):
            with ledger.phase("actor_train"):
                outcome = train_one_step(model, optimizer, scheduler, data, plan, args)
            if sync is not None:
                with ledger.phase("weight_sync"):
                    sync.sync(model, step, fence=fence)
            trainer = compute_log_probs(model, data, plan, args)
            engine = engine_log_probs(url, data) if sync is not None and rank == 0 else None
            results.append(dict(loss=outcome.loss, grad_norm=outcome.grad_norm, skipped=outcome.skipped,
                                trainer=trainer, engine=engine))
    finally:
        uninstrument_collectives()
        ledger.close()
        if sync is not None:
            sync.close()
    return dict(before=before, loaded=loaded, steps=results)


def check_run(results: list[dict], single: dict, engine_before: list[list[float]], tolerance: float) -> None:
    """The layout's steps are the single process's (loss, grad norm: Adam's first steps turn rounding-level gradient
    differences into lr-sized ones, so the log-probs after a step are compared with the engine's, not the single
    process's), each moved the model, and the engine served the trainer's log-probs before the first push and after
    every push."""
    import pytest

    first = results[0]
    assert len(first["steps"]) == len(single["steps"])
    for got, want in zip(first["before"], engine_before):
        assert got == pytest.approx(want, abs=tolerance)
    previous = first["before"]
    for step, (mine, ref) in enumerate(zip(first["steps"], single["steps"])):
        assert not mine["skipped"], step
        assert mine["loss"] == pytest.approx(ref["loss"], abs=1e-5), step
        assert mine["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4), step
        assert max(abs(a - b) for x, y in zip(mine["trainer"], previous) for a, b in zip(x, y)) > 1e-4, step
        for got, want in zip(mine["trainer"], mine["engine"]):
            assert got == pytest.approx(want, abs=tolerance), step
        previous = mine["trainer"]


TP2_SP_CP2_EP2 = dict(tensor_model_parallel_size=2, sequence_parallel=True, context_parallel_size=2,
                      expert_model_parallel_size=2)


def check_layout_run(tmp_path, served: tuple[str, dict, str], single_layout: dict, layout: dict, exported: dict,
                     world: int = 4, steps: int = 2, tolerance: float = 1e-5) -> list[dict]:
    """`steps` steps at `layout` on `world` ranks, each pushed to the engine of `served`, against the single
    process's at `single_layout`: the recorded collectives pass the order proof, `check_run` holds, and every
    rank's HF -> megatron -> HF export is `exported` bit for bit. Returns the ranks' results."""
    from mp_utils import run_ranks
    from slime.distributed.order_proof import check_order, read_sequences

    hf_dir, data, url = served
    engine_before = engine_log_probs(url, data)
    (single,) = run_ranks(train_and_push, 1, args=(str(tmp_path / "single"), hf_dir, data, single_layout, None,
                                                   steps), timeout_s=150)
    results = run_ranks(train_and_push, world, args=(str(tmp_path / "ranks"), hf_dir, data, layout, url, steps),
                        timeout_s=300)
    report = check_order(read_sequences(str(tmp_path / "ranks")))
    assert report.ok, report.format()
    check_run(results, single, engine_before, tolerance)
    for result in results:
        assert_same_tensors(result["loaded"], exported)
    return results


def assert_same_tensors(got: dict, want: dict) -> None:
    """The same names, and every tensor equal bit for bit."""
    import torch

    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[name], want[name]) for name in want)


SEQ = 16


def forward_and_export(rank, world, hf_dir, tp: int, cp: int, flags: dict | None = None) -> dict:
    """This rank's logits of SEQ seeded tokens (its zig-zag CP positions, its TP vocabulary shard) and its HF
    export, the model loaded from `hf_dir` at TP `tp` x CP `cp` (`flags` on top)."""
    import torch
    import transformers
    from megatron.core import parallel_state

    from slime.backends.megatron_utils.model import build_gpt_model
    from slime.backends.megatron_utils.parallel import init_model_parallel
    from slime.config import defaults_namespace
    from slime_plugins.models.cp_attention import zigzag_positions
    from slime_plugins.models.hf_weights import export_hf_weights, load_hf_weights

    args = defaults_namespace(**{**dict(tensor_model_parallel_size=tp, context_parallel_size=cp,
                                        pipeline_model_parallel_size=1, seed=5, attention_dropout=0.0,
                                        hidden_dropout=0.0), **(flags or {})})
    init_model_parallel(args)
    hf_config = transformers.AutoConfig.from_pretrained(hf_dir)
    model = build_gpt_model(args, hf_config).eval()
    load_hf_weights([model], hf_dir, hf_config)
    tokens = torch.randint(0, hf_config.vocab_size, (1, SEQ), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(SEQ)
    if cp > 1:
        positions = zigzag_positions(SEQ, cp, parallel_state.get_context_parallel_rank())
    with torch.no_grad():
        logits = model(tokens[:, positions], positions.unsqueeze(0), None)[0]
    return dict(logits=logits, positions=positions, tp_rank=parallel_state.get_tensor_model_parallel_rank(),
                exported=dict(export_hf_weights([model], hf_config)))


def check_logits_and_export(result: dict, reference, original: dict, tolerance: float = 1e-5) -> None:
    """One rank's logits are transformers' `reference` logits [SEQ, vocab] at its positions and of its vocabulary
    shard; its export is `original` bit for bit."""
    width = result["logits"].shape[-1]
    want = reference[result["positions"]][:, result["tp_rank"] * width:(result["tp_rank"] + 1) * width]
    assert (result["logits"] - want).abs().max().item() < tolerance
    assert_same_tensors(result["exported"], original)


LORA = dict(enable_lora=True, lora_rank=4, lora_alpha=8.0, lora_dropout=0.0, lr=0.05, calculate_per_token_loss=True,
            expert_tensor_parallel_size=1)


def lora_steps(rank, world, hf_dir, data, targets: list[str]) -> dict:
    """Two LoRA steps (the second is where both factors learn) on one process: the log-probs after them, the merged
    export, the base parameters that moved (none may), and what a push after the first plans and sends."""
    import torch
    from transformers import AutoConfig

    from slime.backends.megatron_utils.train_step import compute_log_probs, train_one_step
    from slime.backends.weight_sync.plan import build_weight_sync_plan
    from slime.models.lora import adapted_weight_names
    from slime_plugins.models.hf_weights import export_hf_weights
    from train_step_harness import build_loaded_model, layout_args, with_policy_log_probs

    args = layout_args(dict(LORA, lora_target_modules=list(targets)))
    hf_config = AutoConfig.from_pretrained(hf_dir)
    model, optimizer, scheduler = build_loaded_model(args, hf_dir)
    data, plan, _ = with_policy_log_probs(model, data, args)
    base = {n: p.detach().clone() for n, p in model[0].module.named_parameters() if not p.requires_grad}
    for _ in range(2):
        step = train_one_step(model, optimizer, scheduler, data, plan, args)
        assert not step.skipped
    select = adapted_weight_names(model)
    return dict(after=compute_log_probs(model, data, plan, args),
                merged={n: t.clone() for n, t in export_hf_weights(model, hf_config)},
                base_moved=[n for n, p in model[0].module.named_parameters()
                            if not p.requires_grad and not torch.equal(p.detach(), base[n])],
                adapters=[n for n, p in model[0].module.named_parameters() if p.requires_grad],
                planned=list(build_weight_sync_plan(model, hf_config, tp_size=1, bucket_bytes=1 << 16,
                                                    select=select).names()),
                sent=[n for n, _ in export_hf_weights(model, hf_config, select=select)])


def check_lora(result: dict, hf_dir: str, data: dict, tolerance: float) -> None:
    """Only adapters trained, the base unmoved; the embedded engine (transformers' class) given the merged export
    gives the trainer's log-probs; the push after the first plans and sends the adapted layers only."""
    import pytest
    import torch

    from slime.backends.embedded_engine.engine import EmbeddedEngine

    assert result["adapters"] and all(".lora.lora_" in n for n in result["adapters"])
    assert result["base_moved"] == []
    engine = EmbeddedEngine(hf_dir)
    before = {name: engine.get_weight(name) for name in result["merged"]}
    assert engine.update_weights(list(result["merged"].items()), "merged") == len(result["merged"])
    assert any(not torch.equal(before[n], t) for n, t in result["merged"].items())
    model = engine.model
    with torch.no_grad():
        for tokens, response, got in zip(data["tokens"], data["response_lengths"], result["after"]):
            logits = model(torch.tensor([tokens])).logits[0].log_softmax(-1)
            want = logits[:-1].gather(-1, torch.tensor(tokens[1:]).unsqueeze(-1)).squeeze(-1)[-response:]
            assert got == pytest.approx(want.tolist(), abs=tolerance)
    assert result["planned"] == result["sent"] and 0 < len(result["sent"]) < len(result["merged"])


def check_lora_run(served: tuple[str, dict, str], targets: list[str], tolerance: float = 1e-5) -> dict:
    """`lora_steps` on one forked process with LoRA on `targets`, and `check_lora` of it; returns its result."""
    from mp_utils import run_ranks

    hf_dir, data, _ = served
    (result,) = run_ranks(lora_steps, 1, args=(hf_dir, data, list(targets)), timeout_s=180)
    check_lora(result, hf_dir, data, tolerance)
    return result

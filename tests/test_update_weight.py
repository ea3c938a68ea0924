"""Fenced weight sync: the pure bucket plan, its check against the export, and a real push of a
megatron model (TP2 and DP2 on gloo) into a running embedded engine."""

from __future__ import annotations

import types

import pytest
import torch

from mp_utils import run_ranks
from slime.backends.weight_sync.factory import choose_transport
from slime.backends.weight_sync.plan import WeightSyncPlan, WeightSyncPlanError, iter_planned_buckets, pack_buckets
from slime.backends.weight_sync.transport import encode_safetensors_payload
from slime.backends.sglang_utils.named_tensors import deserialize_named_tensors
from slime.backends.sglang_utils.shared_payload import read_shared_bucket, write_shared_bucket

pytestmark = pytest.mark.ranks

MiB = 1024**2


# ----------------------------------------------------------------------------- pure plan
def test_pack_buckets_keeps_order_and_budget():
    sizes = [("a", 3), ("b", 4), ("c", 2), ("huge", 50), ("d", 5), ("e", 5), ("f", 1)]
    buckets = pack_buckets(sizes, bucket_bytes=10)
    assert [b.hf_names for b in buckets] == [("a", "b", "c"), ("huge",), ("d", "e"), ("f",)]
    assert [b.index for b in buckets] == [0, 1, 2, 3]
    assert [b.nbytes for b in buckets] == [9, 50, 10, 1]
    assert all(b.nbytes <= 10 or len(b.hf_names) == 1 for b in buckets)  # only a lone oversized tensor exceeds
    assert all(sum(b.tensor_nbytes) == b.nbytes for b in buckets)
    assert pack_buckets(sizes, bucket_bytes=10) == buckets  # deterministic
    with pytest.raises(ValueError):
        pack_buckets(sizes, bucket_bytes=0)


def _plan(sizes, bucket_bytes=10) -> WeightSyncPlan:
    buckets = pack_buckets(sizes, bucket_bytes)
    return WeightSyncPlan(buckets, sum(b.nbytes for b in buckets), pp_rank=0)


def _float_tensors(sizes):
    return [(name, torch.zeros(nbytes // 4)) for name, nbytes in sizes]


def test_planned_buckets_follow_the_export():
    sizes = [("a", 8), ("b", 4), ("c", 12)]
    grouped = list(iter_planned_buckets(_plan(sizes), _float_tensors(sizes)))
    assert [[n for n, _ in tensors] for _, tensors in grouped] == [["a"], ["b"], ["c"]]


@pytest.mark.parametrize("exported, message", [
    ([("a", 8), ("c", 12), ("b", 4)], "bucket 1 position 0: plan expects 'b' (4 bytes), export gave 'c'"),
    ([("a", 8), ("b", 8), ("c", 12)], "plan expects 'b' (4 bytes), export gave 'b' (8 bytes)"),
    ([("a", 8), ("b", 4)], "plan expects 'c', the export ended"),
    ([("a", 8), ("b", 4), ("c", 12), ("d", 4)], "export gave 'd' after the plan's last tensor"),
])
def test_plan_mismatch_names_the_first_difference(exported, message):
    plan = _plan([("a", 8), ("b", 4), ("c", 12)])
    with pytest.raises(WeightSyncPlanError, match=message.replace("(", r"\(").replace(")", r"\)")):
        list(iter_planned_buckets(plan, _float_tensors(exported)))


NAMED = [("z.weight", torch.randn(3, 2)), ("a.bias", torch.arange(4.0)), ("h", torch.randn(5, dtype=torch.bfloat16)),
         ("ids", torch.arange(3, dtype=torch.int64))]


def test_embedded_payloads_round_trip_in_order_and_dtype(tmp_path):
    payload = encode_safetensors_payload(NAMED)
    assert payload.load_format == "slime_safetensors" and len(payload.serialized_per_tp_rank) == 1
    shared = write_shared_bucket(NAMED, tmp_path, "bucket0")
    decodings = (deserialize_named_tensors(payload.serialized_per_tp_rank[0]), read_shared_bucket(shared.descriptor, tmp_path))
    for decoded in decodings:
        assert [n for n, _ in decoded] == [n for n, _ in NAMED]
        assert all(a.dtype == b.dtype and torch.equal(a, b) for (_, a), (_, b) in zip(decoded, NAMED))
    shared.remove()
    assert not shared.path.exists()


def test_transport_follows_upstream_choice():
    assert choose_transport(types.SimpleNamespace(colocate=True, update_weight_transport="nccl")) == "tensor"
    assert choose_transport(types.SimpleNamespace(colocate=False, update_weight_transport="nccl")) == "distributed"
    with pytest.raises(ValueError, match="disk"):
        choose_transport(types.SimpleNamespace(colocate=False, update_weight_transport="disk"))


# ----------------------------------------------------------------------------- real sync
BUCKET_BYTES = 16 * MiB  # the tiny model's 151936 x 64 embedding (37 MiB) gets a bucket of its own


def _sync_on_ranks(rank, world, layout, hf_dir, engine_url, ledger_dir, rollout_ids, colocate):
    import datetime

    import torch.distributed as dist
    import transformers

    from slime.backends.weight_sync import sync as weight_sync
    from slime.backends.megatron_utils.model import build_gpt_model
    from slime.backends.weight_sync.proof import WeightProofError
    from slime.backends.megatron_utils.parallel import init_model_parallel
    from slime.backends.sglang_utils.http_client import SGLangHTTPClient
    from slime.config import defaults_namespace
    from slime.distributed import CollectiveDivergenceError, Fence, Ledger, Watchdog
    from slime_plugins.models.hf_weights import export_hf_weights, load_hf_weights

    tp = world if layout == "tp2" else 1
    args = defaults_namespace(tensor_model_parallel_size=tp, seed=5, fence_timeout=60.0, colocate=colocate,
                              update_weight_buffer_size=BUCKET_BYTES, rollout_num_gpus_per_engine=1)
    init_model_parallel(args)
    hf_config = transformers.AutoConfig.from_pretrained(hf_dir)
    model = build_gpt_model(args, hf_config)
    load_hf_weights([model], hf_dir, hf_config)
    with torch.no_grad():  # the trainer moved away from the engine's checkpoint
        generator = torch.Generator().manual_seed(100 + rank)
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))

    plan = weight_sync.build_weight_sync_plan([model], hf_config, tp_size=tp, bucket_bytes=BUCKET_BYTES)
    exported = list(export_hf_weights([model], hf_config))  # every rank: TP collectives / none at DP2
    assert plan == weight_sync.build_weight_sync_plan([model], hf_config, tp_size=tp, bucket_bytes=BUCKET_BYTES)
    assert [(n, t.numel() * t.element_size()) for n, t in exported] == [
        (n, s) for b in plan.buckets for n, s in zip(b.hf_names, b.tensor_nbytes)]
    probe = {name: tensor.flatten()[:512].float().clone() for name, tensor in exported}  # some are live views

    ledger = Ledger(rank, world, ledger_dir)
    fence = Fence(dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=60)),
                  rank=rank, world_size=world, timeout_s=60.0, ledger=ledger)
    watchdog = Watchdog(60.0, ledger_dir, rank, world, ledger=ledger)
    sync = weight_sync.WeightSync(args, hf_config, [engine_url], engine_kind="embedded")
    metrics = [sync.sync([model], rollout_id, fence=fence, watchdog=watchdog) for rollout_id in rollout_ids]
    sent_buckets = sorted({e.op for e in ledger.entries() if e.op.startswith("weight_sync/send_bucket")})

    # A plan that disagrees with the export: every rank fails at the same fence, the exporters name it.
    swapped = list(plan.buckets)
    target = max(b.index for b in plan.buckets if len(b.hf_names) > 1)
    bucket = swapped[target]
    swapped[target] = weight_sync.WeightBucket(target, bucket.hf_names[::-1], bucket.nbytes,
                                                 bucket.tensor_nbytes[::-1])
    planner = weight_sync.build_weight_sync_plan
    weight_sync.build_weight_sync_plan = lambda *a, **k: WeightSyncPlan(tuple(swapped), plan.total_bytes, 0)
    sync._plans.clear()  # the sync keeps the plan it built for the model: this push builds the swapped one
    try:
        sync.sync([model], rollout_ids[-1] + 1, fence=fence, watchdog=watchdog)
        mismatch = "none"
    except WeightSyncPlanError as exc:
        mismatch = f"plan: {exc}"
    except CollectiveDivergenceError as exc:
        mismatch = f"divergence at {exc.phase} in {list(exc.fields)}"
    weight_sync.build_weight_sync_plan = planner
    sync._plans.clear()

    # The final norm moves on the trainer and the sender's push leaves it out: the version still moves, the
    # weight-sync proof names the engine, the tensor and the version (the engine keeps the probed weights).
    with torch.no_grad():
        model.decoder.final_layernorm.weight.add_(0.01)
    dropped = "model.norm.weight"
    weight_sync.apply_weight_push_fault = lambda tensors, *_: [(n, t) for n, t in tensors if n != dropped]
    try:
        sync.sync([model], rollout_ids[-1] + 2, fence=fence, watchdog=watchdog)
        proof = "none"
    except WeightProofError as exc:
        proof = f"proof: {exc}"
    except CollectiveDivergenceError as exc:
        proof = f"divergence at {exc.phase} in {list(exc.fields)}"
    if rank == 0:  # the failed syncs left the engine paused on purpose; resume it for what follows
        SGLangHTTPClient(engine_url).continue_generation()
    watchdog.close()
    ledger.close()
    sync.close()
    if rank != 0:
        return {"metrics": metrics, "mismatch": mismatch, "sent_buckets": sent_buckets, "proof": proof}
    assert sync.transport_kind == ("tensor" if colocate else "distributed")
    return {"metrics": metrics, "mismatch": mismatch, "sent_buckets": sent_buckets, "plan": plan, "probe": probe,
            "proof": proof, "dropped": dropped}


@pytest.fixture(scope="module")
def checkpoint(small_run_inputs):
    return str(small_run_inputs["checkpoint"])


@pytest.fixture(scope="module")
def engine(checkpoint, tmp_path_factory):
    from slime.backends.sglang_utils.launcher import launch_engine
    from slime.config import defaults_namespace

    handle = launch_engine("embedded", defaults_namespace(seed=7), 0, 0, checkpoint,
                           startup_timeout_s=120, log_dir=str(tmp_path_factory.mktemp("engine-logs")))
    yield handle
    handle.stop()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout, rollout_ids, colocate", [("tp2", (0, 1), True), ("dp2", (10, 11), False)],
                         ids=["tp2-tensor", "dp2-distributed"])
def test_sync_makes_engine_weights_equal_trainer_weights(layout, rollout_ids, colocate, checkpoint, engine, tmp_path):
    from slime.backends.sglang_utils.http_client import SGLangHTTPClient

    client = SGLangHTTPClient(engine.url)
    before = torch.tensor(client.get_weights_by_name("model.layers.0.mlp.down_proj.weight", 512))
    results = run_ranks(_sync_on_ranks, 2, args=(layout, checkpoint, engine.url, str(tmp_path), rollout_ids, colocate),
                        timeout_s=280)
    rank0 = results[0]
    plan = rank0["plan"]
    assert any(len(b.hf_names) == 1 and b.nbytes > BUCKET_BYTES for b in plan.buckets)
    assert all(b.nbytes <= BUCKET_BYTES for b in plan.buckets if len(b.hf_names) > 1)

    # The engine now holds the trainer's (perturbed) weights, tensor by tensor.
    assert not torch.equal(before, rank0["probe"]["model.layers.0.mlp.down_proj.weight"])
    for name, expected in rank0["probe"].items():
        served = torch.tensor(client.get_weights_by_name(name, 512), dtype=torch.float32)
        assert torch.equal(served, expected), name

    version = str(rollout_ids[-1] + 3)  # the last sync's: the one that left the final norm out (below)
    assert client.weight_version() == version
    reply = client.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2, "temperature": 0.0})
    assert reply["meta_info"]["weight_version"] == version  # resumed, serving the new weights

    for rollout_id, metrics in zip(rollout_ids, rank0["metrics"]):
        assert metrics["weight_sync/version"] == rollout_id + 1
        assert metrics["weight_sync/bytes"] == plan.total_bytes
        assert metrics["weight_sync/buckets"] == len(plan.buckets)
        assert metrics["weight_sync/gbps"] > 0
        # the proof compared every tensor the engine serves with the trainer's push
        assert metrics["weight_sync/proof_tensors"] == len(plan.names()) and metrics["weight_sync/proof_seconds"] > 0
    assert rank0["sent_buckets"] == sorted(f"weight_sync/send_bucket{b.index}" for b in plan.buckets)
    # Rank 1 never talks to the engines: a TP peer (tp2) or a DP replica that skips the export (dp2).
    assert all(m["weight_sync/bytes"] == 0 and m["weight_sync/proof_tensors"] == 0 for m in results[1]["metrics"])
    assert results[1]["sent_buckets"] == []

    target = max(b.index for b in plan.buckets if len(b.hf_names) > 1)
    assert rank0["mismatch"].startswith(f"plan: bucket {target} position 0: plan expects")
    if layout == "tp2":  # both TP ranks meet the mismatch in the export they iterate together
        assert results[1]["mismatch"] == rank0["mismatch"]
    else:  # the replica that skipped the export learns of it at the fence
        assert results[1]["mismatch"] == "divergence at weight_sync/pushed in ['error']"
    # the push that left one tensor out: named on the coordinator, every other rank stops at the same fence
    version = str(rollout_ids[-1] + 3)
    assert rank0["proof"].startswith(f"proof: weight-sync proof after the push of version {version}: 1 tensor(s)")
    assert f"engine {engine.url}, tensor {rank0['dropped']!r}, version {version}: the engine serves" in rank0["proof"]
    assert results[1]["proof"] == "divergence at weight_sync/proved in ['error']"
    client.close()

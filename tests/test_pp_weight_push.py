"""Pipeline parallelism with the weight push, on two embedded engines.

Colocated on one node (`--colocate`, the tensor transport): 2 forked ranks as PP2 push their stages to both
engines at once. An engine holds one weight-update session at a time (SGLang refuses a second begin), so the
sync's coordinator opens one on every engine for the whole push and closes it after the push's fence: both
stages land inside it, sync after sync, and the engines serve both stages' weights.

Separate engines: 4 forked ranks as PP2 x TP2 (gloo) push to two embedded engines of 2 GPUs each
(`--rollout-num-gpus-per-engine 2`: one process, one rank of each group) over the distributed transport.

Each stage has its own weight-update group (every engine joins both). An engine joins one group and receives
one broadcast at a time, so the stages go one after another in one global order, stage 0 first: the groups'
creations and the pushes are in every rank's ledger, in the same order, and the order proof holds. Then
engine 1 stops (SIGSTOP) just as stage 1 forms its group again: that stage's sender ends with a named error
(the stage, the engine that stopped answering) within half the fence window, and every other rank learns of
it at the stage's fence instead of waiting on.
"""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from mp_utils import run_ranks

pytestmark = pytest.mark.ranks

FENCE_S = 16.0  # the group deadline is half of it
PROBE = ("model.embed_tokens.weight", "model.layers.0.mlp.down_proj.weight", "model.layers.1.mlp.down_proj.weight",
         "lm_head.weight")


def _stage_model(args, hf_dir, rollout_id=0):
    """This rank's PP stage of the checkpoint, moved away from what the engines hold (by stage and rollout)."""
    import transformers
    from megatron.core import parallel_state as mpu

    from slime.backends.megatron_utils.model import build_gpt_model
    from slime.backends.megatron_utils.parallel import init_model_parallel
    from slime_plugins.models.hf_weights import load_hf_weights

    init_model_parallel(args)
    hf_config = transformers.AutoConfig.from_pretrained(hf_dir)
    model = build_gpt_model(args, hf_config, pre_process=mpu.is_pipeline_first_stage(),
                            post_process=mpu.is_pipeline_last_stage())
    load_hf_weights([model], hf_dir, hf_config)
    _perturb(model, 100 + mpu.get_pipeline_model_parallel_rank())
    return model, hf_config


def _perturb(model, seed):
    with torch.no_grad():  # the trainer moved away from the engines' weights
        generator = torch.Generator().manual_seed(seed)
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))


def _fenced(rank, world, ledger_dir):
    import datetime

    import torch.distributed as dist

    from slime.distributed import Fence, Ledger, Watchdog

    ledger = Ledger(rank, world, ledger_dir, record_sequence=True)
    fence = Fence(dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=60)),
                  rank=rank, world_size=world, timeout_s=FENCE_S, ledger=ledger)
    return ledger, fence, Watchdog(FENCE_S, ledger_dir, rank, world, ledger=ledger)


def _probe(model, hf_config):
    from slime_plugins.models.hf_weights import export_hf_weights

    return {name: t.flatten()[:256].clone() for name, t in export_hf_weights([model], hf_config) if name in PROBE}


def _colocated_pp_push(rank, world, hf_dir, urls, ledger_dir):
    from megatron.core import parallel_state as mpu

    from slime.backends.weight_sync import sync as weight_sync
    from slime.config import defaults_namespace

    args = defaults_namespace(pipeline_model_parallel_size=2, seed=5, fence_timeout=FENCE_S, colocate=True,
                              rollout_num_gpus_per_engine=1, update_weight_buffer_size=64 * 1024)
    model, hf_config = _stage_model(args, hf_dir)
    ledger, fence, watchdog = _fenced(rank, world, ledger_dir)
    sync = weight_sync.WeightSync(args, hf_config, urls, engine_kind="embedded")
    assert sync.transport_kind == "tensor" and not sync.stages_in_order(weight_sync.SyncRole.current())
    served = []
    for rollout_id in (0, 1):  # the second sync opens the sessions the first one closed
        _perturb(model, 200 + 10 * rollout_id + mpu.get_pipeline_model_parallel_rank())
        sync.sync([model], rollout_id, fence=fence, watchdog=watchdog)
        served.append(_served(urls) if rank == 0 else {})
    ledger.flush()
    ops = [e.op for e in ledger.entries() if "weight_sync/" in e.op]
    watchdog.close()
    sync.close()
    return {"stage": mpu.get_pipeline_model_parallel_rank(), "probe": _probe(model, hf_config), "ops": ops,
            "served": served}


def _pp_push(rank, world, hf_dir, urls, stopped_pid, ledger_dir):
    from megatron.core import parallel_state as mpu

    from slime.backends.weight_sync import sync as weight_sync
    from slime.config import defaults_namespace

    args = defaults_namespace(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, seed=5,
                              fence_timeout=FENCE_S, colocate=False, rollout_num_gpus_per_engine=2,
                              update_weight_buffer_size=64 * 1024)
    model, hf_config = _stage_model(args, hf_dir)
    ledger, fence, watchdog = _fenced(rank, world, ledger_dir)
    sync = weight_sync.WeightSync(args, hf_config, urls, engine_kind="embedded")
    sync.sync([model], 0, fence=fence, watchdog=watchdog)
    probe = _probe(model, hf_config)
    served = _served(urls) if rank == 0 else {}  # before the stall, which leaves the engines inside a join
    ledger.flush()
    healthy_ops = [e.op for e in ledger.entries() if "weight_sync/" in e.op]

    # The stall: the groups are formed anew (retarget), and engine 1 stops as stage 1's sender forms its group.
    sync.retarget(urls)
    stage, tp_rank = mpu.get_pipeline_model_parallel_rank(), mpu.get_tensor_model_parallel_rank()
    if stage == 1 and tp_rank == 0:
        connect = sync._connect

        def stop_engine_then_connect(*a, **k):
            os.kill(stopped_pid, signal.SIGSTOP)
            return connect(*a, **k)

        sync._connect = stop_engine_then_connect
    start = time.monotonic()
    try:
        sync.sync([model], 1, fence=fence, watchdog=watchdog)
        outcome = "none"
    except Exception as exc:  # noqa: BLE001 - the test reads which error each rank ended with
        outcome = f"{type(exc).__name__}: {exc}"
    seconds = time.monotonic() - start
    ledger.flush()
    watchdog.close()
    # no sync.close(): it would ask the stopped engine to leave its groups
    return {"stage": stage, "tp_rank": tp_rank, "probe": probe if tp_rank == 0 else {}, "healthy_ops": healthy_ops,
            "outcome": outcome, "seconds": seconds, "served": served}


def _served(urls):
    from slime.backends.sglang_utils.http_client import SGLangHTTPClient

    served = {}
    for url in urls:
        client = SGLangHTTPClient(url)
        served[url] = {name: torch.tensor(client.get_weights_by_name(name, 256)) for name in PROBE}
        client.close()
    return served


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from slime.tools.tiny_checkpoint import TinyQwen3Spec, write_tiny_checkpoint

    spec = TinyQwen3Spec(layers=2, alphabet="0123456789")
    return str(write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-pp"), spec))


@pytest.fixture(scope="module")
def engines(checkpoint, tmp_path_factory):
    from slime.backends.sglang_utils.launcher import launch_engine
    from slime.config import defaults_namespace

    logs = str(tmp_path_factory.mktemp("engine-logs"))
    handles = [launch_engine("embedded", defaults_namespace(seed=7), i, 0, checkpoint, startup_timeout_s=120,
                             log_dir=logs) for i in range(2)]
    yield handles
    for handle in handles:
        os.kill(handle.server.process.pid, signal.SIGCONT)
        handle.stop(grace_s=2.0)  # engine 0 may still wait inside the abandoned join


@pytest.mark.timeout(120)
def test_colocated_pp_stages_push_together_inside_one_session_per_sync(checkpoint, engines, tmp_path):
    urls = [handle.url for handle in engines]
    results = run_ranks(_colocated_pp_push, 2, args=(checkpoint, urls, str(tmp_path)), timeout_s=100)
    by_stage = {r["stage"]: r for r in results}
    coordinator, stage1 = by_stage[0]["ops"], by_stage[1]["ops"]
    # One session per sync, opened after the pause fence and closed after the push fence (and the weight-sync
    # proof over both stages' tensors), by the coordinator.
    for sync in range(2):
        window = coordinator[_nth(coordinator, "fence:weight_sync/paused", sync):
                             _nth(coordinator, "fence:weight_sync/done", sync)]
        assert [op for op in window if "_session" in op or op.startswith("fence:")] == [
            "fence:weight_sync/paused", "fence:weight_sync/pushed", "fence:weight_sync/proved",
            "weight_sync/end_session"], window
        before = coordinator[:_nth(coordinator, "fence:weight_sync/paused", sync)]
        assert before[-1] == "weight_sync/begin_session", before
    assert not any("_session" in op for op in stage1) and "weight_sync/send_bucket0" in stage1
    # Both syncs reached both engines: each serves both stages' weights of that sync.
    assert set(by_stage[0]["probe"]) | set(by_stage[1]["probe"]) == set(PROBE)
    expected = {**by_stage[0]["probe"], **by_stage[1]["probe"]}
    for url in urls:
        for name, values in expected.items():
            assert torch.equal(results[0]["served"][-1][url][name].float(), values.float()), (url, name)
            assert not torch.equal(results[0]["served"][0][url][name].float(), values.float()), (url, name)


def _nth(ops, op, n):
    return [i for i, o in enumerate(ops) if o == op][n]


@pytest.mark.timeout(120)
def test_pp_stages_push_in_one_order_and_a_stalled_stage_is_named(checkpoint, engines, tmp_path):
    from slime.distributed.order_proof import check_order, read_sequences

    urls = [handle.url for handle in engines]
    results = run_ranks(_pp_push, 4, args=(checkpoint, urls, engines[1].server.process.pid, str(tmp_path)),
                        timeout_s=100)
    os.kill(engines[1].server.process.pid, signal.SIGCONT)

    # The healthy sync: each stage's group formed, then pushed, stage 0 before stage 1, fenced between.
    senders = {r["stage"]: r for r in results if r["tp_rank"] == 0}
    for stage, sender in senders.items():
        ops = sender["healthy_ops"]
        assert ops.index(f"weight_sync/connect_pp{stage}") < ops.index("weight_sync/send_bucket0")
    fences = [op for op in results[0]["healthy_ops"] if op.startswith("fence:weight_sync/")]
    stage_fences = [op for op in fences if "pushed_pp" in op]
    assert stage_fences == ["fence:weight_sync/pushed_pp0", "fence:weight_sync/pushed_pp1"]
    assert all([op for op in r["healthy_ops"] if op.startswith("fence:")] == fences for r in results)
    for stage, sender in senders.items():  # a stage's group and buckets lie between the fences of its turn
        ops = sender["healthy_ops"]
        before = ops.index(f"fence:weight_sync/pushed_pp{stage - 1}") if stage else -1
        assert before < ops.index(f"weight_sync/connect_pp{stage}") < ops.index(f"fence:weight_sync/pushed_pp{stage}")
    report = check_order(read_sequences(str(tmp_path)), complete=False)
    assert report.ok, report.format()

    # Both engines hold both stages' weights (the first sync's).
    expected = {**senders[0]["probe"], **senders[1]["probe"]}
    assert set(expected) == set(PROBE)
    for url in urls:
        for name, values in expected.items():
            assert torch.equal(results[0]["served"][url][name].float(), values.float()), (url, name)

    # The stall: stage 1's sender names the stage and the stopped engine, within the group deadline.
    stalled = senders[1]["outcome"]
    assert stalled.startswith("WeightGroupStallError: PP stage 1: the creation"), stalled
    assert f"engine(s) not answering: ['{urls[1]}']" in stalled
    assert senders[1]["seconds"] < FENCE_S  # half a window, not a full one
    for result in results:  # every other rank ends at stage 1's fence, naming the failing rank's error
        if result is not senders[1]:
            assert "weight_sync/pushed_pp1" in result["outcome"], result["outcome"]

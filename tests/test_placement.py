"""Placement: which bundle, node and GPU every trainer rank and engine gets.

Pure tests of the layout arithmetic, the cluster address and the device ids, then one Ray cluster of
two nodes with four fake GPUs each: the trainer ranks and the engines' actors are created on it as
train.py creates them, and each reports what Ray gave it, colocated and not; on the same cluster, the
critic's values reach the ranks by reference without passing through the driver.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types

import pytest

from arg_testing import driver_args
from slime.backends.sglang_utils.launcher import gpu_id_layout, sglang_server_args_for_engine
from slime.config import defaults_namespace
from slime.ray.common.node import PlacementError, visible_device_index
from slime.ray.driver.cluster import cluster_address, worker_env
from slime.ray.driver.placement import (
    BundleInfo,
    check_colocated_nodes,
    check_engine_bind_host,
    order_bundles,
    plan_layout,
)
from slime.utils.security import ApiKey

pytestmark = pytest.mark.e2e


def _bundles(spec: list[tuple[str, str, str | None]]) -> list[BundleInfo]:
    return [BundleInfo(index=i, node_id=node, node_ip=ip, gpu_id=gpu) for i, (node, ip, gpu) in enumerate(spec)]


# ----------------------------------------------------------------------------- the layout
def test_bundles_are_ordered_by_node_address_then_gpu():
    # Ray hands bundles back in any order; 10.0.0.10 sorts after 10.0.0.9 (numerically, not as text).
    infos = _bundles([("b", "10.0.0.10", "1"), ("a", "10.0.0.9", "1"), ("b", "10.0.0.10", "0"),
                      ("a", "10.0.0.9", "0")])
    ordered = order_bundles(infos)
    assert [(b.node_ip, b.gpu_id) for b in ordered] == [("10.0.0.9", "0"), ("10.0.0.9", "1"),
                                                      ("10.0.0.10", "0"), ("10.0.0.10", "1")]
    assert [b.index for b in ordered] == [3, 1, 2, 0]


def test_nodes_sharing_an_address_stay_apart():
    infos = _bundles([("n2", "10.0.0.1", "0"), ("n1", "10.0.0.1", "0"), ("n2", "10.0.0.1", "1"),
                      ("n1", "10.0.0.1", "1")])
    assert [(b.node_id, b.gpu_id) for b in order_bundles(infos)] == [("n1", "0"), ("n1", "1"), ("n2", "0"), ("n2", "1")]


def test_colocated_engines_take_the_trainer_ranks_gpus():
    infos = _bundles([(n, ip, g) for n, ip in (("b", "10.0.0.2"), ("a", "10.0.0.1")) for g in "3210"])
    layout = plan_layout(infos, trainer_ranks=8, num_engines=4, gpus_per_engine=2, colocate=True)
    ranks = [(b.node_id, b.gpu_id) for b in layout.actor_bundles]
    assert ranks == [("a", "0"), ("a", "1"), ("a", "2"), ("a", "3"), ("b", "0"), ("b", "1"), ("b", "2"), ("b", "3")]
    assert [(e.node_id, e.gpu_ids) for e in layout.engines] == [
        ("a", ("0", "1")), ("a", ("2", "3")), ("b", ("0", "1")), ("b", ("2", "3"))]
    by_bundle = {b.index: (b.node_id, b.gpu_id) for b in infos}
    for engine in layout.engines:  # the actor runs on the engine's first GPU's bundle
        assert by_bundle[engine.bundles[0]] == (engine.node_id, engine.gpu_ids[0])


def test_colocated_across_nodes_needs_a_node_per_block_of_ranks_at_its_own_address():
    def layout(spec):
        return plan_layout(_bundles(spec), trainer_ranks=len(spec), num_engines=2, gpus_per_engine=len(spec) // 2,
                           colocate=True)

    even = [(n, ip, None) for n, ip in (("a", "10.0.0.1"), ("b", "10.0.0.2")) for _ in range(4)]
    assert check_colocated_nodes(layout(even), gpus_per_node=4) == ("10.0.0.1", "10.0.0.2")  # by node index
    # Ray packed 5 ranks on one node: node b's engine would be fed by a rank of node a
    uneven = [("a", "10.0.0.1", None)] * 5 + [("b", "10.0.0.2", None)] * 3
    with pytest.raises(PlacementError, match="needs 4 trainer ranks on each node"):
        check_colocated_nodes(plan_layout(_bundles(uneven), trainer_ranks=8, num_engines=8, gpus_per_engine=1,
                                          colocate=True), gpus_per_node=4)
    shared = [(n, "10.0.0.1", None) for n in "ab" for _ in range(4)]
    with pytest.raises(PlacementError, match="SLIME_HOST_IP"):
        check_colocated_nodes(layout(shared), gpus_per_node=4)


def test_separate_engines_come_after_the_trainer_ranks():
    infos = _bundles([(n, ip, g) for n, ip in (("a", "10.0.0.1"), ("b", "10.0.0.2")) for g in "0123"])
    layout = plan_layout(infos, trainer_ranks=4, num_engines=2, gpus_per_engine=2, colocate=False)
    assert {b.node_id for b in layout.actor_bundles} == {"a"}
    assert [(e.node_id, e.gpu_ids) for e in layout.engines] == [("b", ("0", "1")), ("b", ("2", "3"))]


def test_an_engine_larger_than_a_node_gets_a_part_on_each_of_its_nodes():
    # 3 nodes x 4 GPUs: 4 trainer ranks fill node a, one engine of 8 takes nodes b and c
    infos = _bundles([(n, ip, g) for n, ip in (("c", "10.0.0.3"), ("a", "10.0.0.1"), ("b", "10.0.0.2")) for g in "3210"])
    layout = plan_layout(infos, trainer_ranks=4, num_engines=1, gpus_per_engine=8, colocate=False)
    (engine,) = layout.engines
    assert engine.nnodes == 2 and [p.node_rank for p in engine.parts] == [0, 1]
    assert [(p.node_id, p.node_ip, p.gpu_ids) for p in engine.parts] == [
        ("b", "10.0.0.2", ("0", "1", "2", "3")), ("c", "10.0.0.3", ("0", "1", "2", "3"))]
    by_bundle = {b.index: (b.node_id, b.gpu_id) for b in infos}
    assert all(by_bundle[p.bundles[0]] == (p.node_id, p.gpu_ids[0]) for p in engine.parts)  # each part's actor
    assert {i for p in engine.parts for i in p.bundles}.isdisjoint(b.index for b in layout.actor_bundles)
    # node rank 0 (the engine's URL, what the router and the weight push address) is the first node's part
    assert (engine.node_id, engine.rank, engine.followers[0].rank) == ("b", 0, 0)


def test_an_engine_with_unequal_parts_on_its_nodes_is_refused():
    # 6 trainer ranks leave 2 GPUs of node b: an engine of 4 would hold 2 there and 2 on node c
    infos = _bundles([(n, ip, g) for n, ip in (("a", "10.0.0.1"), ("b", "10.0.0.2"), ("c", "10.0.0.3")) for g in "0123"])
    layout = plan_layout(infos, trainer_ranks=6, num_engines=1, gpus_per_engine=4, colocate=False)
    assert [len(p.gpu_ids) for p in layout.engines[0].parts] == [2, 2]  # even: allowed
    with pytest.raises(PlacementError, match="engine 0 would hold 3 on 10.0.0.1 .* 1 on 10.0.0.2 .* splits an engine"):
        plan_layout(infos[:8], trainer_ranks=1, num_engines=1, gpus_per_engine=4, colocate=False)


def test_too_few_bundles_is_refused():
    with pytest.raises(PlacementError, match="need 6"):
        plan_layout(_bundles([("a", "10.0.0.1", None)] * 4), trainer_ranks=4, num_engines=2, gpus_per_engine=1,
                    colocate=False)


def test_cpu_bundles_give_engines_no_gpus():
    layout = plan_layout(_bundles([("a", "10.0.0.1", None)] * 2), trainer_ranks=2, num_engines=2, gpus_per_engine=1,
                         colocate=True)
    assert [e.gpu_ids for e in layout.engines] == [(), ()]


def test_a_critic_with_counts_of_its_own_gets_bundles_after_the_others():
    infos = _bundles([(n, ip, g) for n, ip in (("a", "10.0.0.1"), ("b", "10.0.0.2")) for g in "0123"])
    colocated = plan_layout(infos, trainer_ranks=4, num_engines=2, gpus_per_engine=2, colocate=True, critic_ranks=2)
    assert [(b.node_id, b.gpu_id) for b in colocated.role_bundles("actor")] == [("a", g) for g in "0123"]
    assert [e.gpu_ids for e in colocated.engines] == [("0", "1"), ("2", "3")] and colocated.engines[0].node_id == "a"
    assert [(b.node_id, b.gpu_id) for b in colocated.role_bundles("critic")] == [("b", "0"), ("b", "1")]
    apart = plan_layout(infos, trainer_ranks=2, num_engines=2, gpus_per_engine=2, colocate=False, critic_ranks=2)
    taken = [b.index for b in (*apart.actor_bundles, *apart.critic_bundles)] + [
        i for e in apart.engines for i in e.bundles]
    assert sorted(taken) == sorted(b.index for b in infos)  # trainer, engines, critic: each bundle once
    assert [(b.node_id, b.gpu_id) for b in apart.critic_bundles] == [("b", "2"), ("b", "3")]
    shared = plan_layout(infos, trainer_ranks=4, num_engines=2, gpus_per_engine=2, colocate=True)
    assert shared.role_bundles("critic") == shared.actor_bundles and shared.critic_bundles == ()
    with pytest.raises(PlacementError, match="for 4 trainer ranks, 6 critic ranks .* need 10"):
        plan_layout(infos, trainer_ranks=4, num_engines=2, gpus_per_engine=2, colocate=True, critic_ranks=6)


def test_bundle_count_per_mode():
    from slime.ray.driver.placement import total_bundles

    def count(**kw):
        base = dict(actor_num_nodes=2, actor_num_gpus_per_node=4, rollout_num_gpus=4, rollout_num_gpus_per_engine=2,
                    colocate=False, debug_train_only=False, debug_rollout_only=False, use_critic=False)
        return total_bundles(defaults_namespace(**{**base, **kw}))

    assert count() == 12  # trainer's 8 + the engines' 4
    assert count(colocate=True) == 8 and count(colocate=True, rollout_num_gpus=16) == 16  # shared: the larger
    assert count(debug_train_only=True) == 8 and count(debug_rollout_only=True) == 4
    ppo = dict(advantage_estimator="ppo", use_critic=True, critic_num_nodes=None, colocate=True)
    assert count(**ppo, critic_num_gpus_per_node=None) == 8  # the critic on the actor's bundles
    assert count(**ppo, critic_num_gpus_per_node=4) == 8  # the actor's counts: the same
    assert count(**ppo, critic_num_gpus_per_node=2) == 12 and count(**{**ppo, "critic_num_nodes": 1},
                                                                     critic_num_gpus_per_node=4) == 12
    assert count(**ppo, critic_num_gpus_per_node=2, debug_rollout_only=True) == 4
    with pytest.raises(PlacementError, match="set --rollout-num-gpus"):
        count(rollout_num_gpus=None)


# ----------------------------------------------------------------------------- devices, addresses
def test_gpu_ids_become_device_indices_through_the_inherited_visible_list():
    assert visible_device_index("5", visible="") == 5
    assert visible_device_index("6", visible="4,5,6,7") == 2
    with pytest.raises(PlacementError, match="not in CUDA_VISIBLE_DEVICES"):
        visible_device_index("1", visible="4,5")


def test_sglang_gets_its_bundles_gpus_not_rank_arithmetic():
    args = defaults_namespace(rollout_num_gpus_per_engine=2, num_gpus_per_node=8, seed=1, sglang_server_args={})
    assert sglang_server_args_for_engine(args, 0, gpu_ids=[4, 5])["base_gpu_id"] == 4
    spaced = sglang_server_args_for_engine(args, 0, gpu_ids=[1, 3])
    assert (spaced["base_gpu_id"], spaced["gpu_id_step"]) == (1, 2)
    assert gpu_id_layout([6]) == (6, 1)
    with pytest.raises(ValueError, match="not evenly spaced"):
        gpu_id_layout([0, 1, 3])


def test_cluster_address_follows_ray_address_then_ray_start(tmp_path):
    assert cluster_address({"RAY_ADDRESS": "10.1.2.3:6379"}) == "10.1.2.3:6379"
    assert cluster_address({"RAY_ADDRESS": "local", "RAY_TMPDIR": str(tmp_path)}) is None
    assert cluster_address({"RAY_TMPDIR": str(tmp_path)}) is None  # nothing started: a private cluster
    with pytest.raises(PlacementError, match="no cluster was started"):
        cluster_address({"RAY_ADDRESS": "auto", "RAY_TMPDIR": str(tmp_path)})
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text("10.9.9.9:6379\n")  # what `ray start --head` leaves
    assert cluster_address({"RAY_TMPDIR": str(tmp_path)}) == "10.9.9.9:6379"
    assert cluster_address({"RAY_ADDRESS": "auto", "RAY_TMPDIR": str(tmp_path)}) == "10.9.9.9:6379"


def test_a_recorded_address_nobody_answers_at_fails_at_once(monkeypatch, tmp_path):
    import socket

    import ray

    from slime.ray.driver.placement import init_ray

    with socket.socket() as sock:  # a port that was free a moment ago: nothing listens there
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text(f"127.0.0.1:{port}")  # a dead `ray start` cluster
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(PlacementError, match=f"no Ray cluster answers at 127.0.0.1:{port}"):
        init_ray(types.SimpleNamespace())


def test_worker_env_forwards_the_job_env_but_not_node_addresses(monkeypatch):
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth1")
    monkeypatch.setenv("SLIME_FAULT_INJECT", "diverge_plan@1")
    monkeypatch.setenv("SLIME_HOST_IP", "10.0.0.5")  # the driver node's own address
    monkeypatch.setenv("UNRELATED_VAR", "x")
    env = worker_env(use_gpu=True)
    assert env["NCCL_SOCKET_IFNAME"] == "eth1" and env["SLIME_FAULT_INJECT"] == "diverge_plan@1"
    assert "SLIME_HOST_IP" not in env and "UNRELATED_VAR" not in env
    assert env["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] == "1"
    assert "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES" not in worker_env(use_gpu=False)


def test_a_concrete_engine_bind_host_is_refused_across_nodes():
    two_nodes = plan_layout(_bundles([("a", "10.0.0.1", None), ("b", "10.0.0.2", None)]), trainer_ranks=2,
                            num_engines=2, gpus_per_engine=1, colocate=True)
    with pytest.raises(PlacementError, match="runs on 2 nodes"):
        check_engine_bind_host("127.0.0.1", two_nodes, driver_node_id="a")
    check_engine_bind_host("0.0.0.0", two_nodes, driver_node_id="a")
    one_node = plan_layout(_bundles([("a", "10.0.0.1", None)] * 2), trainer_ranks=2, num_engines=2,
                           gpus_per_engine=1, colocate=True)
    check_engine_bind_host("127.0.0.1", one_node, driver_node_id="a")


# ----------------------------------------------------------------------------- on a Ray cluster
FAKE_GPUS_PER_NODE = 4


@pytest.fixture(scope="module")
def fake_gpu_cluster():
    """Two Ray nodes of 4 fake GPUs (GPU resources on a CPU machine), the second on its own address."""
    import ray
    from ray_cluster import RayTestCluster, second_loopback_address

    second = {"node_ip_address": ip} if (ip := second_loopback_address()) else {}
    node = {"num_cpus": FAKE_GPUS_PER_NODE, "num_gpus": FAKE_GPUS_PER_NODE}
    if ray.is_initialized():  # this process must talk to the test cluster, not to one joined earlier
        ray.shutdown()
    with RayTestCluster([node, {**node, **second}]) as cluster:
        ray.init(address=cluster.address, log_to_driver=False)
        try:
            yield cluster
        finally:
            ray.shutdown()


def _layout_args(tmp_path, **overrides):
    args = dict(actor_num_nodes=2, actor_num_gpus_per_node=4, rollout_num_gpus=8, rollout_num_gpus_per_engine=2,
                num_gpus_per_node=FAKE_GPUS_PER_NODE, colocate=True, debug_train_only=False, debug_rollout_only=False,
                engine_bind_host=None, ledger_dir=str(tmp_path), fence_timeout=60.0, seed=1,
                api_key=ApiKey.generate(),  # as parse_args makes it: every actor takes the run's key
                use_critic=False, sglang_server_args={})  # derived by parse_args
    return driver_args(**{**args, **overrides})


def _assignments(args):
    """Place the job as train.py does; every trainer rank and engine actor reports what Ray gave it."""
    import ray

    from slime.backends.sglang_utils.launcher import sglang_server_args_for_engine
    from slime.ray.driver.trainer_group import RayTrainGroup
    from slime.ray.engines.actor import EngineRayActor
    from slime.config.run_state import actor_args, run_state_of
    from slime.ray.driver.placement import create_placement

    placement = create_placement(args, use_gpu=True, timeout_s=120)
    trainers = RayTrainGroup(args, placement) if not args.debug_rollout_only else None
    parts = [part for slot in placement.layout.engines for part in slot.parts]  # an actor on each engine's node
    engines = []
    try:  # the placement is given back whatever fails, so that the next test finds the cluster free
        engines += [ray.remote(EngineRayActor).options(**placement.engine_options(part.rank, part.node_rank)).remote(
            actor_args(args), run_state_of(args), part, "sglang", str(args.ledger_dir)) for part in parts]
        ranks = trainers.where() if trainers is not None else []
        actors = ray.get([e.where.remote() for e in engines], timeout=120)
    finally:
        if trainers is not None:
            trainers.shutdown()
        for engine in engines:
            ray.kill(engine)
        placement.remove()
    # what SGLang is launched with (rendered against SGLang's parser in tests/test_sglang_contract.py)
    server_args = [sglang_server_args_for_engine(args, a["rank"], a["device_indices"]) for a in actors]
    return placement.layout, ranks, actors, server_args


def _check_engines_on_their_bundles(layout, actors, server_args):
    parts = [part for slot in layout.engines for part in slot.parts]
    for part, actor, fields in zip(parts, actors, server_args, strict=True):
        assert actor["node_id"] == part.node_id  # the engine's actor runs on its own bundle's node ...
        assert actor["ray_gpu_ids"] == [part.gpu_ids[0]]  # ... holding a share of its first bundle's GPU
        assert actor["device_indices"] == [int(g) for g in part.gpu_ids]  # NOSET: physical ids are indices
        assert fields["base_gpu_id"] == int(part.gpu_ids[0])
        assert fields["tp_size"] == args_gpus_per_engine(layout, part)


def args_gpus_per_engine(layout, part) -> int:
    """The engine's whole GPU count (its tensor-parallel size, on one node or over several)."""
    return sum(len(p.gpu_ids) for p in layout.engines[part.rank].parts)


@pytest.mark.timeout(300)
def test_an_engine_over_both_nodes_gets_an_actor_on_each_with_its_gpus(fake_gpu_cluster, tmp_path):
    args = _layout_args(tmp_path, colocate=False, debug_rollout_only=True, rollout_num_gpus=8,
                        rollout_num_gpus_per_engine=8)
    layout, _, actors, server_args = _assignments(args)
    (engine,) = layout.engines
    assert engine.nnodes == 2 and len({a["node_id"] for a in actors}) == 2
    assert [a["device_indices"] for a in actors] == [[0, 1, 2, 3]] * 2
    _check_engines_on_their_bundles(layout, actors, server_args)


@pytest.mark.timeout(300)
def test_colocated_trainer_ranks_and_engines_share_each_bundle_gpu(fake_gpu_cluster, tmp_path):
    layout, ranks, actors, server_args = _assignments(_layout_args(tmp_path, colocate=True))
    # 8 ranks over 2 nodes x 4 GPUs: every (node, GPU) once, consecutive ranks on one node.
    held = [(r["node_id"], r["gpu_ids"][0]) for r in ranks]
    assert len(set(held)) == 8 and len({node for node, _ in held}) == 2
    assert len({node for node, _ in held[:4]}) == 1 and [g for _, g in held] == ["0", "1", "2", "3"] * 2
    assert [r["device"] for r in ranks] == [int(g) for _, g in held]
    for rank, bundle in zip(ranks, layout.actor_bundles, strict=True):
        assert (rank["node_id"], rank["gpu_ids"]) == (bundle.node_id, [bundle.gpu_id])
    _check_engines_on_their_bundles(layout, actors, server_args)
    # colocated: engine e runs on the GPUs of trainer ranks 2e and 2e+1
    for engine, slot in enumerate(layout.engines):
        assert {(slot.node_id, g) for g in slot.gpu_ids} == set(held[2 * engine: 2 * engine + 2])


@pytest.mark.timeout(300)
def test_separate_engines_get_gpus_of_their_own(fake_gpu_cluster, tmp_path):
    # 6 ranks fill node A and half of node B; the two engines get node B's last GPUs (2 and 3), where
    # rank arithmetic (engine_rank * gpus_per_engine % gpus_per_node) would say 0 and 1.
    args = _layout_args(tmp_path, colocate=False, actor_num_nodes=1, actor_num_gpus_per_node=6,
                        rollout_num_gpus=2, rollout_num_gpus_per_engine=1)
    layout, ranks, actors, server_args = _assignments(args)
    trainer_gpus = {(r["node_id"], r["gpu_ids"][0]) for r in ranks}
    engine_gpus = [(slot.node_id, g) for slot in layout.engines for g in slot.gpu_ids]
    assert len(trainer_gpus) == 6 and not trainer_gpus & set(engine_gpus)
    node_b = ranks[-1]["node_id"]
    assert engine_gpus == [(node_b, "2"), (node_b, "3")]
    _check_engines_on_their_bundles(layout, actors, server_args)


def test_a_private_cluster_and_its_servers_stay_on_loopback():
    """Without the patch Ray turns 127.0.0.1 into the machine's network address (slime/patches/ray.py)."""
    script = textwrap.dedent("""
        import os, types, ray
        os.environ.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)  # as train.py runs outside the tests
        from slime.ray.driver.placement import init_ray
        from slime.ray.common.node import serving_host
        init_ray(types.SimpleNamespace(actor_num_nodes=1, actor_num_gpus_per_node=1, debug_rollout_only=False,
                                       debug_train_only=True, rollout_num_gpus=0, rollout_num_gpus_per_engine=1,
                                       colocate=True, use_critic=False))
        where = ray.remote(lambda: ray.util.get_node_ip_address())
        print("NODES", sorted({n["NodeManagerAddress"] for n in ray.nodes()}), ray.get(where.remote(), timeout=60),
              serving_host(False))
        ray.shutdown()
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}
    out = subprocess.run([sys.executable, "-c", script], env={**env, "RAY_ADDRESS": "local"}, capture_output=True,
                         text=True, timeout=180)
    line = next((l for l in out.stdout.splitlines() if l.startswith("NODES")), None)
    assert line == "NODES ['127.0.0.1'] 127.0.0.1 127.0.0.1", out.stdout + out.stderr[-3000:]


@pytest.mark.parametrize("error, starts", [("The current node timed out during startup. This could happen", 2),
                                            ("some other failure", 1)])
def test_a_private_cluster_start_that_timed_out_is_tried_once_more(monkeypatch, error, starts):
    from slime.ray.driver import placement

    calls = []

    def failing_init(**kwargs):
        calls.append(kwargs)
        raise Exception(error)

    monkeypatch.setattr(placement.ray, "init", failing_init)
    monkeypatch.setattr(placement.ray, "shutdown", lambda: calls.append("shutdown"))
    with pytest.raises(Exception, match=error):
        placement.start_private_cluster(num_cpus=4)
    assert [c for c in calls if c != "shutdown"] == [calls[0]] * starts and calls.count("shutdown") == starts - 1


@pytest.mark.timeout(120)
def test_ranks_that_fail_after_the_reported_one_print_no_unhandled_error(fake_gpu_cluster, monkeypatch):
    """After `training stopped:` nothing but the run's summary: the calls the driver stops watching when one rank's
    failure is reported (peers that fail a few seconds later, at their own fence deadlines) are settled, so Ray's
    driver does not print each as an "Unhandled error" once their refs are dropped."""
    import gc
    import time

    import ray
    import ray._private.worker as ray_worker

    from slime.ray.driver.rank_wait import RankFailedError, wait_ranks

    printed = []
    monkeypatch.setattr(ray_worker, "_unhandled_error_handler", printed.append)

    @ray.remote(num_cpus=0)
    class Rank:
        def step(self, rank: int) -> None:
            time.sleep(0.2 if rank == 0 else 3.0)  # the peers fail after the driver's 2 s look at them
            raise RuntimeError(f"rank {rank} failed")

    ranks = [Rank.remote() for _ in range(3)]
    with pytest.raises(RankFailedError, match="failed on rank 0"):
        wait_ranks([r.step.remote(i) for i, r in enumerate(ranks)], phase="actor_train", window_s=60.0)
    time.sleep(4.0)  # the peers' errors have arrived
    for rank in ranks:
        ray.kill(rank)
    gc.collect()  # the refs held by the raised error's frames go
    time.sleep(1.0)
    assert printed == []


@pytest.mark.timeout(300)
def test_the_critics_values_reach_every_rank_by_reference_and_the_driver_never_fetches_them(
        fake_gpu_cluster, tmp_path, monkeypatch):
    """ppo: every critic rank computes the values, rank 0 alone puts them in Ray's object store and the group
    returns that reference; each rank then fetches them beside the rollout. The driver's waits never see them."""
    import ray

    from slime.ray.driver import trainer_group
    from slime.ray.driver.placement import create_placement
    from slime.ray.trainer.rank_actor import TrainRayActor

    values = [[0.25, -1.5], [3.75]]

    class FencedCritic:  # the megatron critic's two calls, as the rank's Ray actor sees them
        def values(self, rollout_id, data):
            return values  # every critic rank holds all of them (shared over DP)

        def train(self, rollout_id, data):
            if data["values"] != values or data["prompt"] != "p":
                raise AssertionError(f"this rank fetched {data}")
            return {"critic/loss": 0.0}

    class CriticRank(TrainRayActor):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.actor = FencedCritic()

    fetched = []  # every result the driver takes from Ray
    real_get = ray.get
    monkeypatch.setattr(ray, "get", lambda *a, **kw: fetched.append(real_get(*a, **kw)) or fetched[-1])
    monkeypatch.setattr(trainer_group, "TrainRayActor", CriticRank)
    args = _layout_args(tmp_path, actor_num_nodes=1, actor_num_gpus_per_node=2, rollout_num_gpus=0,
                        debug_train_only=True)
    placement = create_placement(args, use_gpu=True, timeout_s=120)
    group = trainer_group.RayTrainGroup(args, placement)
    try:
        data_ref = ray.put({"prompt": "p"})
        values_ref = group.values(0, data_ref)
        assert isinstance(values_ref, ray.ObjectRef)
        assert group.train(0, data_ref, extra_refs=(values_ref,)) == {"critic/loss": 0.0}  # raised on any rank else
    finally:
        group.shutdown()
        placement.remove()
    assert fetched and "3.75" not in repr(fetched)

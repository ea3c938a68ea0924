"""Set before any test imports Ray or starts a server:
- every test's processes keep Ray on loopback (slime/patches/ray.py says why);
- every test process holds a run key, as each process of a run does: the clients here send it and the
  servers started here require it (slime/utils/security.py)."""
import os
from pathlib import Path

from slime.patches.ray import ENV_SWITCH
from slime.utils.security import ApiKey, use_key

os.environ.setdefault(ENV_SWITCH, "0")
use_key(ApiKey.generate())  # at import: module-scoped fixtures start servers before any test runs


import pytest  # noqa: E402 (after the environment above is set)

ISSUE_RECORDING_TIMEOUT_S = 480

# `make test` runs on two pytest-xdist workers. A file's tests stay on one worker, so a run its module fixture
# shares happens once. Files named in SHARED_GROUPS share a worker instead: the #1487 recording is a session
# fixture of two files, and the runs of eight ranks (which alone fill two cores) go one after another.
# Groups start longest first (as measured), then any other group with an end-to-end test, then the slowest other
# files, then the rest in file order: the suite ends on short files, which the two workers share out evenly, never on
# a run one worker starts last.
SHARED_GROUPS = {
    "test_end_to_end.py": "eight_ranks", "test_order_proof.py": "eight_ranks", "test_learning_demo.py": "eight_ranks",
    "test_learning_demo_moe.py": "eight_ranks",
}
LONGEST_FIRST = ("eight_ranks", "test_exact_resume.py", "test_engine_faults_e2e.py", "test_learning_demo_ppo.py",
                 "test_multinode_end_to_end.py", "test_train_async_e2e.py", "test_dropin_e2e.py",
                 "test_rollout_stack_e2e.py", "test_learning_demo_qwen3_5.py", "test_logprob_agreement.py",
                 "test_bench_step_gpu.py", "test_model_families_e2e.py", "test_opd.py", "test_gpu_driver_cpu.py",
                 "test_sft.py")
# The slowest files without a train.py run (as measured), after the end-to-end groups and before the rest: the suite's
# last minutes are then short files both workers share, not one worker finishing a long file alone.
SLOW_UNIT_FIRST = ("test_qwen3_5.py", "test_model_families.py", "test_step_faults.py", "test_vlm_model.py",
                   "test_deadlines.py", "test_mtp.py", "test_pp_weight_push.py", "test_sglang_contract.py",
                   "test_engine_progress.py", "test_progress_hub.py", "test_moe.py", "test_embedded_engine.py",
                   "test_distributed_lifecycle.py", "test_delta_weight_sync.py", "test_import_structure_cache.py",
                   "test_fused_kernels.py", "test_rollout_deadline.py", "test_deepseek_v4.py")


def worker_group(nodeid: str) -> str:
    file = nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
    return SHARED_GROUPS.get(file, file)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: a plain `pytest` run without it is fine too
def pytest_xdist_make_scheduler(config, log):
    """Whole groups to a worker (pytest-xdist's file scheduling, with the shared groups above)."""
    from xdist.scheduler import LoadFileScheduling

    class GroupScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return worker_group(nodeid)

    return GroupScheduling(config, log)


def pytest_collection_modifyitems(items) -> None:
    """Longest groups first, then end-to-end ones; every test is `unit` unless its file is marked `ranks` or `e2e`."""
    for item in items:
        if not (item.get_closest_marker("ranks") or item.get_closest_marker("e2e")):
            item.add_marker(pytest.mark.unit)
    order = {group: i for i, group in enumerate(LONGEST_FIRST)}
    slow = {group: i for i, group in enumerate(SLOW_UNIT_FIRST)}
    end_to_end = {worker_group(item.nodeid) for item in items if item.get_closest_marker("e2e")}

    def rank(item) -> tuple[int, int]:
        group = worker_group(item.nodeid)
        if group in order:
            return 0, order[group]
        if group in end_to_end:
            return 1, 0
        return (2, slow[group]) if group in slow else (3, 0)

    items.sort(key=rank)  # stable: within a rank, files keep their collection order


@pytest.fixture(scope="session")
def small_run_inputs(tmp_path_factory) -> dict[str, Path]:
    """A one-layer tiny Qwen3 with the Qwen tokenizer and 8 arithmetic prompts, written once per test process for
    the engines and short runs whose assertions do not depend on the model's shape; nothing writes into them."""
    from slime.tools.tiny_checkpoint import TinyQwen3Spec
    from train_runs import write_run_assets

    return write_run_assets(tmp_path_factory.mktemp("small_run_inputs"), TinyQwen3Spec(layers=1), prompts=8)


@pytest.fixture(scope="session")
def issue_recording(tmp_path_factory) -> dict:
    """Upstream #1487's configuration through `python train.py`, every rank's collective sequence recorded
    (slime.tools.record_step_sequence: 8 ranks TP2 x SP x CP4, --colocate, dynamic batches, per-token
    loss, engines, 2 rollouts of 2 steps). One run per session: the end-to-end tests check what it
    trained and replay its rollouts, the order proof checks its sequences."""
    from slime.tools.record_step_sequence import record
    from train_runs import train_env

    out = tmp_path_factory.mktemp("issue_recording")
    proc = record(out, [], timeout_s=ISSUE_RECORDING_TIMEOUT_S, env=train_env())
    return {"proc": proc, "out": out, "metrics": out / "metrics.jsonl", "replay": out / "rollout_{rollout_id}.pt"}

"""`python train.py` with engines that fail (SLIME_FAULT_INJECT kill_engine / stall_engine), end to end.

One rank, two embedded engines behind the router, a one-layer tiny Qwen3:
- with --use-fault-tolerance, once behind the project's router and once behind the real sglang-router
  (each restarted engine is registered at its new URL, the dead one removed): rollout 0 loses engine 1
  (killed mid-generation; the survivor takes its requests), rollout 1 loses both (engine 0 stalls,
  engine 1 is killed: every request waits for the restarted engines, which first get the trainer's
  weights); every rollout trains on all its samples and the run goes on to its last rollout.
- without it: a killed engine ends the run at once with an error naming the engine; a stalled one ends
  it at --rollout-no-progress-timeout (long before --rollout-timeout) with the engines and the requests
  outstanding.
The tolerant runs also watch the engines' progress with a 10 s window: no healthy engine is taken for a stalled
one (every failure counted is an injected one).
"""
from __future__ import annotations

import re

import pytest

from train_runs import read_events, run_train

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

FLAGS = [
    "--input-key", "prompt", "--label-key", "label", "--apply-chat-template", "--rm-type", "math",
    "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "2",
    "--rollout-num-gpus-per-engine", "1",
    "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--num-steps-per-rollout", "1",
    "--rollout-max-response-len", "24", "--advantage-estimator", "grpo", "--lr", "1e-4", "--seed", "1234",
    "--fence-timeout", "120", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "512",
]
ROUTERS = {"slime_router": ["--use-slime-router"], "sglang_router": []}
# A probe's /health_generate runs a generation: on a loaded 2-core machine a healthy engine once took over 2 s
# (an extra failure and restart in rollout 2); 5 s still finds the stalled engine within its rollout.
FAULT_TOLERANCE = ["--use-fault-tolerance", "--rollout-health-check-interval", "1",
                   "--rollout-health-check-timeout", "5", "--rollout-health-check-first-wait", "0",
                   "--rollout-no-progress-timeout", "10"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory, small_run_inputs) -> dict:
    flags = ["--hf-checkpoint", str(small_run_inputs["checkpoint"]), "--prompt-data", str(small_run_inputs["prompts"])]
    return {"root": tmp_path_factory.mktemp("faults"), "flags": [*flags, *FLAGS]}


def _run(assets, name: str, extra: list[str], faults: str, timeout_s: float = 540):
    out = assets["root"] / name
    out.mkdir()
    flags = [*assets["flags"], *extra, "--metrics-jsonl", str(out / "metrics.jsonl"), "--ledger-dir", str(out)]
    proc, seconds = run_train(flags, timeout_s=timeout_s, env_extra={"SLIME_FAULT_INJECT": faults})
    return {"proc": proc, "out": out, "output": proc.stdout + proc.stderr, "seconds": seconds}


@pytest.fixture(scope="module", params=sorted(ROUTERS))
def tolerant_run(request, assets) -> dict:
    return _run(assets, f"tolerant-{request.param}", [*ROUTERS[request.param], *FAULT_TOLERANCE, "--num-rollout", "3"],
                "kill_engine@1#0,stall_engine@0#1,kill_engine@1#1")


def test_failed_engines_are_restarted_and_every_rollout_trains(tolerant_run):
    proc, output = tolerant_run["proc"], tolerant_run["output"]
    assert proc.returncode == 0, output[-4000:]
    events = read_events(tolerant_run["out"] / "metrics.jsonl")
    rollouts = {e["rollout_id"]: e for e in events["rollout"]}
    assert sorted(rollouts) == [0, 1, 2]
    assert [rollouts[r]["rollout/engine_failures"] for r in (0, 1, 2)] == [1, 2, 0]
    assert [rollouts[r]["rollout/engine_restarts"] for r in (0, 1, 2)] == [1, 2, 0]
    for event in rollouts.values():  # the samples of failed engines were generated again, none lost
        assert event["rollout/num_samples"] == 8 and event["rollout/aborted_ratio"] == 0
        assert event["rollout/response_len/min"] > 0
    assert [e["rollout_id"] for e in events["train"]] == [0, 1, 2]
    # the engines' log-probs match the trainer's: restarted engines generated with the trainer's weights
    assert all(e["train/train_rollout_logprob_abs_diff"] <= 1e-4 for e in events["train"]), events["train"]
    assert [(e["rollout_id"], e["weight_sync/version"]) for e in events["weight_sync"]] == [
        (-1, 0), (0, 1), (1, 2), (2, 3)]
    for kind, engine in (("kill_engine", 1), ("stall_engine", 0)):
        assert re.search(rf"fault injection: {kind} on engine {engine} .* during rollout", output), kind


def test_engines_lost_together_get_the_current_weights_before_serving(tolerant_run):
    """Rollout 1 had no engine left: its requests waited until the restarted ones held version 1."""
    events = read_events(tolerant_run["out"] / "metrics.jsonl")
    catch_ups = events.get("engine_catch_up", [])
    assert catch_ups and all(e["weight_sync/version"] == 1 for e in catch_ups), catch_ups
    served_again = re.findall(r"engine (\d) serves again at \S+ \(weights (\S+)\)", tolerant_run["output"])
    assert {engine for engine, _ in served_again} == {"0", "1"}
    assert all(version != "of" for _, version in served_again)  # always after a push, never the checkpoint's
    # an engine back during rollout 1 got version 1 (the catch-up push); one back only after it, version 2
    # (the rollout's own sync): which engine makes it in time depends on the machine's speed
    assert ("0", "1") in served_again or ("1", "1") in served_again, served_again
    assert {version for _, version in served_again} <= {"1", "2"}, served_again


def test_killed_engine_without_fault_tolerance_ends_the_run_naming_it(assets):
    run = _run(assets, "kill", ["--use-slime-router", "--debug-rollout-only", "--num-rollout", "2"], "kill_engine@1#0",
               timeout_s=300)
    output = run["output"]
    assert run["proc"].returncode != 0, output[-3000:]
    summary = [line for line in output.splitlines() if "training stopped:" in line]
    assert summary, output[-3000:]
    assert re.search(r"engine 1 at http://\S+: process exited with code -9", summary[0]), summary[0]
    assert "--use-fault-tolerance" in summary[0]
    assert "rollout 1: generating" not in output  # the run ended in rollout 0


def test_stalled_engine_without_fault_tolerance_ends_at_the_no_progress_window(assets):
    window, timeout = 6, 240
    run = _run(assets, "stall", ["--use-slime-router", "--debug-rollout-only", "--num-rollout", "2",
                                 "--rollout-timeout", str(timeout), "--rollout-no-progress-timeout", str(window)],
               "stall_engine@1#0", timeout_s=300)
    output = run["output"]
    assert run["proc"].returncode != 0, output[-3000:]
    summary = [line for line in output.splitlines() if "training stopped:" in line]
    assert summary, output[-3000:]
    # SIGSTOP: the engine answers nothing, its progress read included
    match = re.search(rf"rollout 0: generate: engine 1 at http://\S+ did not answer GET /v1/loads for (\d+)s \(.*\) "
                      rf"\(--rollout-no-progress-timeout {window}s\); pass --use-fault-tolerance", summary[0])
    assert match and int(match.group(1)) >= window, summary[0]
    table = output.split("training stopped:")[0]
    assert re.search(r"\n1\s+http://\S+\s+serving\s+stopped \(SIGSTOP\)", table), table[-3000:]
    assert re.search(r"requests outstanding \(client side, oldest first\): [1-9]", table), table[-3000:]
    assert re.search(r"rid=sample\d+-\w+", table)
    # from the stall to the manager's error: the window and one look, not --rollout-timeout (a bound far from both,
    # so that a loaded machine's slower looks cannot fail it; the manager logs whole seconds)
    elapsed = (_manager_time(output, "ERROR slime.ray.rollout_manager.guard")
               - _manager_time(output, "fault injection: stall_engine on engine 1")) % 86400
    assert window - 1 <= elapsed < timeout / 4, f"took {elapsed:.0f}s"


def _manager_time(output: str, marker: str) -> int:
    """Seconds of the day of the rollout manager's first log line holding `marker` ([HH:MM:SS rollout manager])."""
    line = next(line for line in output.splitlines() if marker in line)
    hours, minutes, seconds = map(int, re.search(r"\[(\d\d):(\d\d):(\d\d) rollout manager\]", line).groups())
    return 3600 * hours + 60 * minutes + seconds

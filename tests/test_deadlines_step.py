"""The progress rule on a real megatron step (one gloo rank, the tiny Qwen3): a forward/backward phase
several times longer than the watchdog window passes while micro-batches complete, the same phase
without the micro-batch progress ticks trips (so the window really is shorter than the phase), and a
micro-batch that stalls ends in HangError about one window later.

Each micro-batch is slowed by a forward pre-hook (a stand-in for a long sequence): the step, its
phases, the ledger and the watchdog are the real ones.
"""
from __future__ import annotations

import math

import pytest

from mp_utils import run_ranks
from tiny_models import save_tiny_qwen3

pytestmark = pytest.mark.ranks

WINDOW_S = 1.0
MICRO_BATCH_S = 0.25


def _child(rank, world, hf_dir, ledger_dir):
    import copy
    import time

    from slime.backends.megatron_utils.train_step import compute_log_probs, train_one_step
    from slime.distributed import HangError, Ledger, Watchdog
    from train_step_harness import build_loaded_model, layout_args, make_rollout, plans_for_this_rank

    args = layout_args({}, max_tokens_per_gpu=24, fence_timeout=WINDOW_S)
    model, optimizer, scheduler = build_loaded_model(args, hf_dir)
    data = make_rollout(num_samples=16, seed=3)
    (plan,) = plans_for_this_rank(data, args)
    log_probs = compute_log_probs(model, data, plan, args)
    for key in ("log_probs", "ref_log_probs", "rollout_log_probs"):
        data[key] = copy.deepcopy(log_probs)
    ledger = Ledger(0, 1, ledger_dir)
    watchdog = Watchdog(WINDOW_S, ledger_dir, 0, 1, ledger=ledger, grace_s=5.0)
    slow = {"stall_at": None, "calls": 0, "stalled_at": None}

    def slow_micro_batch(module, inputs):
        slow["calls"] += 1
        if slow["stall_at"] is not None and slow["calls"] >= slow["stall_at"]:
            slow["stalled_at"] = time.monotonic()
            while True:  # a stalled micro-batch, in short sleeps so the HangError can land
                time.sleep(0.02)
        time.sleep(MICRO_BATCH_S)

    model[0].register_forward_pre_hook(slow_micro_batch)

    def step(progress):
        start = time.monotonic()
        try:
            result = train_one_step(model, optimizer, scheduler, data, plan, args, collective_hook=watchdog.phase,
                                    progress=progress)
            return {"seconds": time.monotonic() - start, "loss": result.loss, "error": None}
        except HangError as exc:
            return {"seconds": time.monotonic() - start, "error": str(exc)}

    out = {"micro_batches": plan.num_micro_batches, "healthy": step(ledger.note_progress),
           "without_ticks": step(None)}
    slow["stall_at"] = slow["calls"] + 3
    out["stalled"] = step(ledger.note_progress)
    out["stall_to_error_s"] = time.monotonic() - slow["stalled_at"]
    watchdog.close()
    ledger.close()
    return out


@pytest.fixture(scope="module")
def outcome(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("deadline_step")
    hf_dir = save_tiny_qwen3(str(root / "hf"))
    (result,) = run_ranks(_child, 1, args=(hf_dir, str(root / "ledger")), timeout_s=240)
    return result


@pytest.mark.timeout(300)
def test_a_step_several_windows_long_passes_while_micro_batches_complete(outcome):
    healthy = outcome["healthy"]
    assert outcome["micro_batches"] >= 12
    assert healthy["error"] is None and math.isfinite(healthy["loss"]), healthy
    assert healthy["seconds"] > 3 * WINDOW_S, healthy  # the phase outlasts the window several times


@pytest.mark.timeout(300)
def test_the_same_step_without_progress_ticks_trips(outcome):
    control = outcome["without_ticks"]
    assert control["error"] and "phase=actor_train/forward_backward" in control["error"], control
    assert control["seconds"] < outcome["healthy"]["seconds"], control


@pytest.mark.timeout(300)
def test_a_stalled_micro_batch_fails_about_one_window_later(outcome):
    stalled = outcome["stalled"]
    assert stalled["error"] and "phase=actor_train/forward_backward" in stalled["error"], stalled
    assert "no progress for 1s" in stalled["error"]
    assert outcome["stall_to_error_s"] < WINDOW_S + MICRO_BATCH_S + 2.0, outcome

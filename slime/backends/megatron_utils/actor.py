"""One trainer rank: the fenced actor_train of docs/fenced-step.md, phase by phase.

Every phase runs on every rank, in this order, under a watchdog no-progress window
(`--fence-timeout`: slime/utils/deadlines.py) and recorded in this rank's ledger:

  wake          re-create groups if they were destroyed, warm every communicator, fenced
  plan          build the micro-batch plans from data every rank shares; fence their fingerprint
  log_probs     forward-only old-policy (and reference) log-probs
  step k        loss-token total (one DP x CP reduce) -> forward/backward -> grad reduce
                -> metrics (one reduce over sorted keys) -> optimizer (decisions on reduced values)
  exit          fence the metric key set, then log off the critical path with a deadline

Inside the step, plans, skips and metric keys are derived from data every rank holds or from reduced
values. Two branches follow what each rank sees and are fenced first: at start-up, whether --load holds a
checkpoint and what it holds (each rank reads the directory), and after a --rollout-data-postprocess-path
or --custom-advantage-function-path hook, what the hook changed (hook_fence.py).
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import threading
import time
from typing import Any

import torch

from megatron.core import parallel_state
from megatron.core.utils import get_model_config

from slime.algorithms import estimator
from slime.algorithms.advantages import compute_advantages_and_returns
from slime.backends.megatron_utils.data import plans_from_rollout
from slime.backends.megatron_utils.hook_fence import PerDpKeys, run_fenced_hook
from slime.backends.megatron_utils.loss import metric_keys, trainer_computes_old_log_probs
from slime.backends.megatron_utils.opd import megatron_teacher
from slime.backends.megatron_utils.moe import moe_plan_collectives
from slime.backends.megatron_utils.train_step import StepResult, compute_log_probs, train_one_step
from slime.distributed import (
    Ledger,
    ProcessGroupLifecycle,
    Watchdog,
    instrument_collectives,
    stable_hash,
)
from slime.config.run_config import run_groups, run_loss
from slime.config.run_state import RunState
from slime.distributed.errors import DistributedStepError
from slime.distributed.progress_hub import HubClient, RayHub
from slime.distributed.progress_relay import RELAY_MIN_WORLD, node_relay
from slime.distributed.fault_inject import (
    RANK_FAULT_KINDS,
    apply_metric_key_fault,
    apply_plan_fault,
    fault_active,
    maybe_fail_rank,
    maybe_kill_run,
    skipping_one_collective,
    stall_forever,
)
from slime.utils.deadlines import run_deadlines
from slime.utils.rollout_batch import PER_DP_RANK_KEYS
from slime.models import fused_kernels
from slime.models.lora import adapted_weight_names
from slime.models.registry import language_model_config

logger = logging.getLogger(__name__)


class LoggingStallError(DistributedStepError):
    """A rank's logging did not finish within the deadline."""


class MegatronTrainActor:
    def __init__(self, args, rank: int, world_size: int, ledger_dir: str, hub: tuple | None = None,
                 run_state: RunState | None = None):
        """`run_state`: what the run knows of this rank's node and the others' (its Ray actor's; None: a rank
        started without Ray, on one node)."""
        self.args = args
        self.run_state = run_state
        self.rank = rank
        self.world_size = world_size
        self.deadlines = run_deadlines(args)
        self.timeout_s = self.deadlines.no_progress_s
        self.loss = run_loss(args)
        self.ledger_dir = ledger_dir
        self.ledger = Ledger(rank, world_size, ledger_dir, record_sequence=bool(args.ledger_record_sequence))
        if hub is not None:  # peers' progress from the driver's hub, on every node (no shared filesystem)
            if world_size >= RELAY_MIN_WORLD:  # the hub hears one caller per node, not per rank
                hub = node_relay(hub)
            self.ledger.hub = HubClient(RayHub(*hub), self.ledger)
        self.watchdog = Watchdog(self.timeout_s, ledger_dir, rank, world_size, ledger=self.ledger)
        self.asleep = False

    # ------------------------------------------------------------------ set-up
    def init(self, master_addr: str, master_port: int, engine_urls: list[str], store=None) -> int:
        from transformers import AutoConfig

        from slime import patches
        from slime.backends.megatron_utils.parallel import init_distributed, seed_model_parallel
        from slime.backends.weight_sync.sync import WeightSync

        patches.apply_all()
        init_distributed(self.args, self.rank, self.world_size, master_addr, master_port, store=store)
        instrument_collectives(self.ledger)
        self.groups = ProcessGroupLifecycle(run_groups(self.args, self.world_size), ledger=self.ledger)
        # the first set-up of every communicator is slower than a re-warm-up (on 4 H200s a rank was
        # seen 15 s behind its CP peer): it gets a longer window
        with self.watchdog.phase("init/create_groups", deadline_s=self.deadlines.first_setup_s):
            self.groups.create(timeout_s=self.deadlines.first_setup_op_s)
        seed_model_parallel(self.args)
        call_hook(self.args.custom_megatron_init_path, self.args)  # after megatron's groups and RNG exist
        # a composite (vision + text) checkpoint trains its text model, and its vision tower when the run trains on
        # images (--multimodal-keys)
        self.hf_config = language_model_config(AutoConfig.from_pretrained(self.args.hf_checkpoint,
                                                                          trust_remote_code=True),
                                               vision=self.args.multimodal_keys is not None)
        # model build and loads make no ledger progress: the longest rank window (slime/utils/deadlines.py)
        with self.watchdog.phase("init/load", deadline_s=self.deadlines.first_setup_s):
            self._fence_load_views()
            start = self._build_model()
        hosts = {} if self.run_state is None else {"node_host": self.run_state.node_host,
                                                   "node_hosts": self.run_state.colocated_node_hosts}
        self.weight_sync = WeightSync(self.args, self.hf_config, engine_urls,
                                      select=adapted_weight_names(self.model) if self.args.enable_lora else None,
                                      **hosts)
        return start

    def _weight_sources(self) -> dict[str, tuple[str, int | None]]:
        """Every (path, iteration) _build_model may read, by role."""
        sources = {"hf_checkpoint": (self.args.hf_checkpoint, self.args.ref_ckpt_step)}
        if self.args.use_kl_loss or self.args.kl_coef:
            sources["reference"] = (self.args.ref_load or self.args.hf_checkpoint, self.args.ref_ckpt_step)
        teacher = megatron_teacher(self.args)
        if teacher is not None:
            sources["teacher"] = teacher
        if self.args.load:
            sources["load"] = (self.args.load, None)
        return sources

    def _fence_load_views(self) -> None:
        """Before any collective load, every rank shows what it sees of each weights source (which iteration
        the tracker names, what it holds): a rank with another view (a node's stale or missing copy) is named
        by a CollectiveDivergenceError instead of entering other collectives than its peers."""
        from slime.checkpoint.contents import load_view

        views = {role: load_view(path, iteration) for role, (path, iteration) in self._weight_sources().items()}
        self.groups.fence("init/load_view", views, timeout_s=self.deadlines.first_setup_s)

    def _build_model(self) -> int:
        from slime.backends.megatron_utils.checkpoint import latest_iteration
        from slime.backends.megatron_utils.model import build_model_and_optimizer

        from slime.backends.megatron_utils.offload import TrainerMemory

        self.model, self.optimizer, self.lr_scheduler = build_model_and_optimizer(self.args, self.hf_config)
        self.memory = TrainerMemory(self.model, self.optimizer)  # colocate: what sleep frees and wake restores
        self.snapshots = WeightSnapshots(self.model)
        self.served_version: int | None = None  # the version of the "served" snapshot (train_async.py)
        # forward-only copies first (the model holds each in turn), then the actor's own weights
        loaded = None
        reference = self.args.ref_load or self.args.hf_checkpoint  # --ref-load defaults to the HF weights
        if self.args.use_kl_loss or self.args.kl_coef:
            loaded = self._load_weights(reference, self.args.ref_ckpt_step)
            self.snapshots.take("ref")
        teacher = megatron_teacher(self.args)  # --use-opd --opd-type megatron
        if teacher is not None:
            loaded = self._load_weights(*teacher)
            self.snapshots.take("teacher")
        if self.args.load and latest_iteration(self.args.load) is not None:
            return self._resume(self.args.load)
        if loaded != self.args.hf_checkpoint:
            self._load_weights(self.args.hf_checkpoint, self.args.ref_ckpt_step)
        return 0

    def _resume(self, path: str, iteration: int | None = None) -> int:
        """--load: weights, optimizer (unless --no-load-optim), schedule, this rank's RNG (unless --no-load-rng)
        and a refreshed reference model; --finetune: weights only, rollout 0. `iteration`: which one (default:
        the tracker's). At another layout than the saved one, what can be restored is, what cannot is refused first
        (slime/checkpoint/layout.py)."""
        from slime.backends.megatron_utils.checkpoint import latest_iteration, load_checkpoint, plan_resume
        from slime.checkpoint.layout import training_draws

        iteration = latest_iteration(path) if iteration is None else iteration
        fresh_optimizer = self.args.no_load_optim or self.args.finetune
        plan = None if self.args.finetune else plan_resume(
            path, iteration, self.optimizer, load_optimizer=not fresh_optimizer,
            load_rng=not self.args.no_load_rng, random_draws=training_draws(self.args))
        if plan is not None and self.rank == 0:
            for note in plan.notes:
                logger.warning("%s", note)
        iteration = load_checkpoint(path, self.model, None if fresh_optimizer else self.optimizer,
                                    None if self.args.finetune else self.lr_scheduler, iteration=iteration)
        if fresh_optimizer:
            self.optimizer.reload_model_params()  # bf16 main params follow the loaded weights (load_model_weights)
        if self.args.finetune:
            return 0
        self._resume_reference(path, iteration)
        self._resume_served(path, iteration)
        if plan.restore_rng:
            self._resume_rng(path, iteration)
        return iteration + 1

    def _resume_reference(self, path: str, iteration: int) -> None:
        """--ref-update-interval: the reference as the saved run had refreshed it, not --ref-load's."""
        from slime.backends.megatron_utils.checkpoint import holds, load_reference

        if not self._reference_moves():
            return
        if "reference" not in holds(path, iteration):
            logger.warning("%s (iteration %d) holds no reference model (saved before references were saved): "
                           "the reference restarts from --ref-load, so the KL term differs from the saved run's",
                           path, iteration)
            return
        self.snapshots.capture("ref", lambda: load_reference(path, iteration, self.model))

    def _resume_served(self, path: str, iteration: int) -> None:
        """The weights the engines held when the checkpoint was saved (train_async.py), for the push at start."""
        from slime.backends.megatron_utils.checkpoint import holds, load_served

        if "served" in holds(path, iteration):
            self.snapshots.capture("served", lambda: setattr(self, "served_version",
                                                              load_served(path, iteration, self.model)))

    def _resume_rng(self, path: str, iteration: int) -> None:
        from slime.backends.megatron_utils.checkpoint import restore_rng

        if not restore_rng(path, iteration, self.rank):
            logger.warning("%s (iteration %d) holds no RNG state for rank %d (saved before RNG was saved, or by "
                           "another world size): this rank keeps the --seed state", path, iteration, self.rank)

    def _reference_moves(self) -> bool:
        """The reference is refreshed from the actor, so only a checkpoint holds its current weights."""
        return bool(self.args.ref_update_interval) and "ref" in self.snapshots

    def _load_weights(self, path: str, iteration: int | None) -> str:
        """Model weights from an HF directory or a megatron checkpoint (--ref-load and --opd-teacher-load accept
        both; --ref-ckpt-step / --opd-teacher-ckpt-step pick the checkpoint's iteration); the optimizer's main
        params follow them. Returns `path`."""
        from slime.backends.megatron_utils.checkpoint import load_model_weights

        load_model_weights(path, self.model, self.optimizer, self.hf_config, iteration=iteration)
        return path

    # ------------------------------------------------------------- actor_train
    def train(self, rollout_id: int, data: dict[str, Any]) -> dict[str, Any]:
        """One rollout's training on this rank; `data` is the rollout batch every rank shares."""
        start = time.perf_counter()
        with self.watchdog.phase("actor_train/wake"):
            wake = self.wake(rollout_id)
        with self.watchdog.phase("actor_train/plan"):
            plans = self._fenced_plans(rollout_id, data)
        maybe_kill_run("kill_during_train", self.rank, rollout_id)
        with self.watchdog.phase("actor_train/log_probs"):
            for kind in RANK_FAULT_KINDS:
                maybe_fail_rank(kind, self.rank, rollout_id, self.ledger_dir)
            self._fill_log_probs(data, self.log_prob_plans)
            self._advantages(rollout_id, data)
        with self.watchdog.phase("actor_train/postprocess"):
            plans = self._postprocess(rollout_id, data, plans)
            self._save_train_data(rollout_id, data)
        results = [self._train_step(rollout_id, data, plan) for plan in plans]
        metrics = self._exit_fence(rollout_id, results)
        self._refresh_reference(rollout_id)
        metrics.update(wake)
        metrics["perf/actor_train_s"] = time.perf_counter() - start
        self._log_locally(rollout_id, metrics)
        self.ledger.flush()  # on file before the driver may kill this process
        return metrics

    def _advantages(self, rollout_id: int, data: dict) -> None:
        if not self.args.compute_advantages_and_returns:  # --disable-compute-advantages-and-returns
            return
        path = self.args.custom_advantage_function_path  # fn(args, rollout_data) fills advantages, returns
        if path:
            run_fenced_hook(self.groups.fence, "actor_train/custom_advantages", rollout_id, data,
                            lambda: call_hook(path, self.args, data), per_dp=self._per_dp_keys())
        else:
            compute_advantages_and_returns(self.args, data)

    def _per_dp_keys(self) -> PerDpKeys | None:
        """Batch keys whose values differ between DP replicas by design (each computed its own samples'), fenced
        among this DP rank's model-parallel group; None where every rank holds every value."""
        shared = (parallel_state.get_data_parallel_world_size() == 1
                  or estimator(self.args.advantage_estimator).whole_rollout)
        return None if shared else PerDpKeys(PER_DP_RANK_KEYS, parallel_state.get_data_parallel_rank())

    def _save_train_data(self, rollout_id: int, data: dict) -> None:
        """--save-debug-train-data: the whole train batch (every rank holds it), written by rank 0."""
        path = self.args.save_debug_train_data
        if path and self.rank == 0:
            path = path.format(rollout_id=rollout_id, rank=self.rank)
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            torch.save({"rollout_id": rollout_id, "data": data}, path)

    def _refresh_reference(self, rollout_id: int) -> None:
        """--ref-update-interval N: the reference model becomes the actor after every N rollouts."""
        if self._reference_moves() and (rollout_id + 1) % self.args.ref_update_interval == 0:
            self.snapshots.take("ref")

    def _postprocess(self, rollout_id: int, data: dict, plans):
        """--rollout-data-postprocess-path `fn(args, rollout_id, rollout_data)` on every rank, then one fence on
        what it changed (slime/backends/megatron_utils/hook_fence.py), so every rank takes the next branch
        together. Changed loss masks change the loss-token totals: the plans are rebuilt and fenced again."""
        path = self.args.rollout_data_postprocess_path
        if not path:
            return plans
        changed = run_fenced_hook(self.groups.fence, "actor_train/postprocess", rollout_id, data,
                                  lambda: call_hook(path, self.args, rollout_id, data),
                                  per_dp=self._per_dp_keys())
        if "loss_masks" not in changed:
            return plans
        return self._fenced_plans(rollout_id, data, fence_name="actor_train/plan_postprocess")

    def _fenced_plans(self, rollout_id: int, data: dict, fence_name: str = "actor_train/plan"):
        """This DP rank's plans, after every rank showed it derived the same plans for ALL DP ranks.

        Plans are a pure function of the rollout every rank holds, so each rank can build every
        DP rank's plans and fingerprint the whole table: one global fence then catches any
        divergence, also between DP replicas (different micro-batch counts, token totals...).
        """
        dp_size = parallel_state.get_data_parallel_world_size()
        every_dp = [plans_from_rollout(data, self.args, dp_size=dp_size, dp_rank=r) for r in range(dp_size)]
        log_prob_args = log_prob_plan_args(self.args)
        log_prob_plans = every_dp if log_prob_args is self.args else [
            plans_from_rollout(data, log_prob_args, dp_size=dp_size, dp_rank=r) for r in range(dp_size)]
        fields = {
            "rollout_id": rollout_id,
            "num_steps": len(every_dp[0]),
            "plan_hash": stable_hash([[{**p.fingerprint_fields(), **p.rank_fields()} for p in plans]
                                      for plans in every_dp]),
            "num_micro_batches": sum(p.num_micro_batches for plans in every_dp for p in plans),
            "micro_batches_per_step": [[p.num_micro_batches for p in plans] for plans in every_dp],
            "micro_batch_tokens": [[list(p.token_counts) for p in plans] for plans in every_dp],
            "loss_token_totals": [p.step_loss_token_total for p in every_dp[0]],
            "log_prob_plan_digests": [[p.global_digest for p in plans] for plans in log_prob_plans],
            "metric_keys": sorted(metric_keys(self.loss)),
            "optional_collectives": sorted(name for name, on in (
                ("kl_loss", self.loss.use_kl_loss), ("ref_log_probs", "ref" in self.snapshots),
                ("teacher_log_probs", "teacher" in self.snapshots),
                ("old_log_probs", trainer_computes_old_log_probs(self.loss)),
                # the fused log-prob head all-reduces over TP per chunk, unlike the unfused one: every rank the same
                ("fused_logprob_head", fused_kernels.active() == "compile"),
                *moe_plan_collectives(get_model_config(self.model[0]))) if on),
        }
        self.groups.fence(fence_name, apply_plan_fault(fields, self.rank, rollout_id))
        self.log_prob_plans = log_prob_plans[parallel_state.get_data_parallel_rank()]
        return every_dp[parallel_state.get_data_parallel_rank()]

    def _fill_log_probs(self, data: dict, plans) -> None:
        hooks = dict(collective_hook=self.watchdog.phase, progress=self.ledger.note_progress)
        if self.loss.use_rollout_logprobs and data.get("rollout_log_probs") is None:
            raise ValueError("--use-rollout-logprobs: the rollout carries no engine log-probs (every sample needs "
                             "rollout_log_probs)")
        before = self.args.custom_megatron_before_log_prob_hook_path  # fn(args, model, store_prefix)
        with torch.no_grad():
            if trainer_computes_old_log_probs(self.loss):  # else the engines' log-probs are the old policy
                call_hook(before, self.args, self.model, "")
                data["log_probs"] = compute_log_probs(self.model, data, plans, self.args, **hooks)
            for tag in FORWARD_ONLY_COPIES:
                if tag in self.snapshots:
                    with self.snapshots.swapped(tag):
                        call_hook(before, self.args, self.model, f"{tag}_")
                        data[f"{tag}_log_probs"] = compute_log_probs(self.model, data, plans, self.args, **hooks)
        if estimator(self.args.advantage_estimator).whole_rollout:  # its advantages read every sample's
            with self.watchdog.phase("actor_train/log_probs_share"):
                share_across_dp(data, ("log_probs", *(f"{tag}_log_probs" for tag in FORWARD_ONLY_COPIES)))

    def _train_step(self, rollout_id: int, data: dict, plan) -> StepResult:
        call_hook(self.args.custom_megatron_before_train_step_hook_path, self.args, rollout_id, plan.step_index,
                  self.model, self.optimizer, self.lr_scheduler)
        return train_one_step(self.model, self.optimizer, self.lr_scheduler, data, plan, self.args,
                              collective_hook=lambda phase: self._step_phase(phase, rollout_id),
                              progress=self.ledger.note_progress)

    @contextlib.contextmanager
    def _step_phase(self, phase: str, rollout_id: int):
        with self.watchdog.phase(phase):
            if phase.endswith("forward_backward") and fault_active("skip_collective", self.rank, rollout_id):
                with skipping_one_collective():
                    yield
            else:
                yield

    def _exit_fence(self, rollout_id: int, results: list[StepResult]) -> dict[str, Any]:
        last = results[-1]
        metrics = {f"train/{k}": v for k, v in last.metrics.items()}
        metrics.update({
            "train/loss": last.loss,
            "train/grad_norm": last.grad_norm,
            "train/skipped_steps": sum(r.skipped for r in results),
            "train/num_steps": len(results),
            "train/num_micro_batches": sum(r.num_micro_batches for r in results),
            "train/loss_tokens": sum(r.loss_token_total for r in results),
            "train/lr": self.optimizer.param_groups[0]["lr"],
        })
        keys = apply_metric_key_fault(metrics, self.rank, rollout_id)
        with self.watchdog.phase("actor_train/exit"):
            self.groups.fence("actor_train/exit", {"rollout_id": rollout_id, "metric_keys": list(keys)})
        return metrics

    def _log_locally(self, rollout_id: int, metrics: dict[str, Any]) -> None:
        """Per-rank log line after the exit fence, in a thread with a deadline: a stuck sink is named."""
        def write() -> None:
            if fault_active("stall_logging", self.rank, rollout_id):
                stall_forever()
            if (rollout_id + 1) % self.args.log_interval == 0:  # --log-interval
                logger.info("rank %d rollout %d: loss=%.6g grad_norm=%.6g", self.rank, rollout_id,
                            metrics["train/loss"], metrics["train/grad_norm"])

        writer = threading.Thread(target=write, name="rank-logging", daemon=True)
        writer.start()
        writer.join(self.timeout_s)
        if writer.is_alive():
            raise LoggingStallError(
                f"phase=actor_train/logging rank={self.rank}: logging did not finish within {self.timeout_s:g}s")

    # ------------------------------------------------------- colocate lifecycle
    def wake(self, rollout_id: int) -> dict[str, float]:
        """Memory back first (rank-local), then the fenced group wake-up and warm-up."""
        memory_s = self.memory.wake() if self.memory.asleep else 0.0
        metrics = self._wake_groups(rollout_id)
        self.asleep = False
        return {**metrics, "perf/wake_memory_s": memory_s}

    def _wake_groups(self, rollout_id: int) -> dict[str, float]:
        report = self.groups.wake(rollout_id)
        if report.regrouped:
            repoint_process_groups([self.model, self.optimizer], report.regrouped)
        return {"perf/wake_create_groups_s": report.create_seconds,
                "perf/wake_warmup_s": report.warmup.seconds if report.warmup else 0.0}

    def sleep(self) -> dict[str, float]:
        """Fence (every rank is done with the step), then free this rank's model and optimizer memory."""
        with self.watchdog.phase("sleep"):
            self.groups.sleep()
            report = self.memory.sleep()
        self.asleep = True
        return report.metrics()

    def close(self) -> None:
        """The run is over: the watchdog stops and the ledger writes what it has not yet written (its flusher
        runs every 0.1-0.5 s, and the process is killed right after this)."""
        self.watchdog.close()
        self.ledger.close()

    # ------------------------------------------------------------ weight sync
    def update_weights(self, rollout_id: int, engine_urls: list[str] | None = None, *, served: bool = False,
                       keep_served: bool | None = None) -> dict[str, Any]:
        """Push the weights to the engines as version rollout_id + 1. A sleeping trainer stays asleep: only its
        communicators wake, and the weights are read from the host copy (nothing is resident twice on a shared
        GPU). `engine_urls`: aim this and later pushes at these engines (engines were restarted).
        train_async.py's copy of what the engines hold (saved with a checkpoint): `keep_served` True keeps a host
        copy of what is pushed, False forgets the copy (the engines hold other weights now), None leaves it (a
        catch-up of restarted engines); `served` pushes the copy a checkpoint brought back, not the weights."""
        maybe_kill_run("kill_during_weight_sync", self.rank, rollout_id)
        if engine_urls is not None:
            self.weight_sync.retarget(engine_urls)
        asleep = self.asleep
        with self.watchdog.phase("weight_sync/wake"):
            wake = self._wake_groups(rollout_id) if asleep else {}
        with self.snapshots.swapped("served") if served else contextlib.nullcontext():
            metrics = self.weight_sync.sync(self.model, rollout_id, fence=self.groups.fence, watchdog=self.watchdog,
                                            read_param=self.memory.read_param)
        if keep_served:
            self.snapshots.take("served")
            self.served_version = rollout_id + 1
        elif keep_served is not None:
            self.snapshots.drop("served")
            self.served_version = None
        if asleep:  # groups go back down only after the sync's closing fence
            with self.watchdog.phase("weight_sync/sleep"):
                self.groups.sleep()
                self.memory.release_cached()
        self.ledger.flush()  # on file before the driver may kill this process
        return {**metrics, **{f"weight_sync/{k.split('/')[-1]}": v for k, v in wake.items()}}

    def publish(self, rollout_id: int) -> None:
        """The tracker names the iteration `save(rollout_id, publish=False)` wrote (rank 0 writes it)."""
        from slime.backends.megatron_utils.checkpoint import publish_checkpoint

        with self.watchdog.phase("publish"):
            publish_checkpoint(self.args.save, rollout_id)

    def _lora_config(self):
        from slime.backends.megatron_utils.model import lora_config

        return lora_config(self.args) if self.args.enable_lora else None

    def save(self, rollout_id: int, publish: bool = True) -> None:
        """--save (without the optimizer state under --no-save-optim), --save-hf as HF safetensors, then
        --keep-checkpoint-num: rank 0 deletes the older checkpoints (slime/checkpoint/retention.py).
        publish=False: the tracker stays until `publish` (the critic's, once the actor's save is the run's)."""
        from slime.backends.megatron_utils.checkpoint import save_checkpoint, save_hf_checkpoint

        with self.watchdog.phase("save"):  # progress: collectives and checkpoint bytes written
            optimizer = None if self.args.no_save_optim else self.optimizer
            reference = (lambda: self.snapshots.swapped("ref")) if self._reference_moves() else None
            served = (self.served_version, lambda: self.snapshots.swapped("served")) if "served" in self.snapshots \
                else None
            barrier = lambda name: self.groups.fence(f"save/{name}", {"iteration": rollout_id})  # noqa: E731
            save_checkpoint(self.args.save, rollout_id, self.model, optimizer, self.lr_scheduler,
                            progress=self.ledger.note_progress, reference=reference, served=served, barrier=barrier,
                            run_id=self.args.run_id, publish=publish)
            if self.args.save_hf:
                save_hf_checkpoint(self.args.save_hf.format(rollout_id=rollout_id), self.model, self.hf_config,
                                   self.args.hf_checkpoint, barrier=barrier, lora_config=self._lora_config())
            if self.args.keep_checkpoint_num and self.rank == 0:  # every role's tracker protects what a restart needs
                from slime.checkpoint.retention import prune

                prune(self.args.save, self.args.keep_checkpoint_num, self.args.checkpoint_roots,
                      progress=self.ledger.note_progress)


def log_prob_plan_args(args):
    """args whose token budget is --log-probs-max-tokens-per-gpu (args itself when that is the training budget)."""
    budget = args.log_probs_max_tokens_per_gpu
    if not args.use_dynamic_batch_size or budget in (None, args.max_tokens_per_gpu):
        return args
    return argparse.Namespace(**{**vars(args), "max_tokens_per_gpu": budget})


def call_hook(path: str | None, *args):
    """Call the user function at `path` (a --custom-* flag) when it is set."""
    if path:
        from slime.utils.misc import load_function

        load_function(path)(*args)


# Weight copies scored in the log-prob phase, in this order: the reference policy (KL loss / shaping) and
# the distillation teacher (--opd-type megatron); their log-probs go to data["<tag>_log_probs"].
FORWARD_ONLY_COPIES = ("ref", "teacher")


def share_across_dp(data: dict, keys: tuple[str, ...]) -> None:
    """Fill in the other DP ranks' per-sample values (one all_gather_object over the DP group).

    compute_log_probs leaves [] for samples outside this DP rank; every response has at least one
    token, so a non-empty entry marks the rank that computed it.
    """
    import torch.distributed as dist

    group = parallel_state.get_data_parallel_group()
    if dist.get_world_size(group) == 1:
        return
    present = [k for k in keys if data.get(k) is not None]
    mine = {k: {i: v for i, v in enumerate(data[k]) if v} for k in present}
    gathered: list[dict | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    for key in present:
        for part in gathered:
            for index, values in part[key].items():
                data[key][index] = values


class WeightSnapshots:
    """Named CPU copies of the model's parameters, swapped in for forward-only passes (reference policy)."""

    def __init__(self, model_chunks):
        self._params = [(f"{i}.{n}", p) for i, c in enumerate(model_chunks) for n, p in c.named_parameters()]
        self._saved: dict[str, dict[str, torch.Tensor]] = {}

    def __contains__(self, tag: str) -> bool:
        return tag in self._saved

    @torch.no_grad()
    def take(self, tag: str) -> None:
        self._saved[tag] = {n: p.detach().to("cpu", copy=True) for n, p in self._params}

    def drop(self, tag: str) -> None:
        self._saved.pop(tag, None)

    @torch.no_grad()
    def _load(self, values: dict[str, torch.Tensor]) -> None:
        for name, param in self._params:
            param.copy_(values[name].to(param.device))

    def capture(self, tag: str, fill) -> None:
        """Snapshot `tag` of the weights fill() loads into the model; the live weights come back after."""
        self.take("_live")
        try:
            fill()
            self.take(tag)
        finally:
            self._load(self._saved.pop("_live"))

    def swapped(self, tag: str):
        snapshots = self

        class _Swap:
            def __enter__(self):
                snapshots.take("_live")
                snapshots._load(snapshots._saved[tag])

            def __exit__(self, *exc):
                snapshots._load(snapshots._saved.pop("_live"))

        return _Swap()


def repoint_process_groups(roots: list[Any], regrouped) -> int:
    """Replace destroyed process groups by their re-created twins inside DDP/optimizer objects.

    Objects built before a colocate sleep (megatron layers, DDP bucket groups, the optimizer) keep
    references to the groups they were built with; after re-creation those references must follow.
    The object graph is walked iteratively (attributes, lists, tuples, dict values), each object once.
    """
    mapping = {id(old): new for _, old, new in regrouped}
    seen: set[int] = set()
    stack = list(roots)
    replaced = 0
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (torch.Tensor, str, bytes, int, float, type)):
            continue
        seen.add(id(obj))
        if isinstance(obj, (tuple, set, frozenset)):
            stack.extend(obj)
            continue
        attributes = vars(obj) if hasattr(obj, "__dict__") else {}
        items = dict(enumerate(obj)) if isinstance(obj, list) else obj if isinstance(obj, dict) else {}
        for container, setter in ((attributes, lambda k, v: setattr(obj, k, v)),
                                  (items, obj.__setitem__ if items else None)):
            for key, value in list(container.items()):
                if id(value) in mapping:
                    setter(key, mapping[id(value)])
                    replaced += 1
                else:
                    stack.append(value)
    return replaced

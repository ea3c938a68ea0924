"""The critic's trainer rank (--advantage-estimator ppo): the actor's fenced rank with a value model.

It reuses MegatronTrainActor's set-up, wake/sleep, fences and checkpointing; what differs is the role:

  model     value_head.value_model_provider (the actor's architecture, a scalar head); weights from
            --critic-load (an HF directory: backbone, plus `score.weight` when it has one) or, on a resume,
            the critic's megatron checkpoint (--critic-load holding one, else <--load>/critic), at the iteration
            the actor resumes at (the run's tracker is the actor's: config/critic_role.py)
  values    critic_values/{wake,plan,forward}: the values of every response token of the rollout (shared
            over DP), which rank 0 puts in Ray's object store for the actor (GAE) and the critic's step to fetch
  train     critic_train/{wake,plan,returns,step...,exit}: returns by GAE over those values, then the
            clipped value loss (value_loss.py) on train_one_step
  save      --critic-save, else <--save>/critic, before the actor's; its tracker moves after the actor's
            (`publish`); never pushes weights to the engines

Its ranks have their own ledger directory (<ledger dir>/critic), progress hub and deadlines, so its
collectives are proven and reported apart from the actor's.
"""
from __future__ import annotations

import time
from typing import Any

import torch

from slime.algorithms.ppo import get_ppo_advantages_and_returns
from slime.backends.megatron_utils.actor import MegatronTrainActor, share_across_dp
from slime.backends.megatron_utils.train_step import train_one_step
from slime.backends.megatron_utils.value_loss import compute_values, value_objective


def critic_returns(args, data: dict[str, Any]) -> None:
    """GAE's returns over the critic's values (the same as the actor's: ppo runs without a KL reward term)."""
    kl = [torch.zeros(len(v)) for v in data["values"]]
    _, returns = get_ppo_advantages_and_returns(data["rewards"], kl, data["values"], 0.0, args.gamma, args.lambd)
    data["returns"] = [r.tolist() for r in returns]


class CriticTrainActor(MegatronTrainActor):
    def _weight_sources(self) -> dict[str, tuple[str, int | None]]:
        sources = {"critic_load": (self.args.critic_load, None)}
        if self.args.load:
            sources["load"] = (self.args.load, self.args.resume_iteration)
        return sources

    def _build_model(self) -> int:
        from slime.backends.megatron_utils.model import build_model_and_optimizer
        from slime.backends.megatron_utils.offload import TrainerMemory
        from slime.backends.megatron_utils.actor import WeightSnapshots
        from slime.backends.megatron_utils.value_head import load_value_model

        self.model, self.optimizer, self.lr_scheduler = build_model_and_optimizer(self.args, self.hf_config)
        self.memory = TrainerMemory(self.model, self.optimizer)
        self.snapshots = WeightSnapshots(self.model)  # stays empty: the critic has no forward-only copies
        if self.args.load:  # critic_resume_dir found a checkpoint: resumed at the actor's iteration
            return self._resume(self.args.load, self.args.resume_iteration)
        load_value_model(self.model, self.args.critic_load, self.hf_config)
        self.optimizer.reload_model_params()  # bf16 main params follow the loaded weights
        return 0

    def values(self, rollout_id: int, data: dict[str, Any]) -> list[list[float]]:
        """The critic's value of every response token of the rollout (every rank returns all of them)."""
        with self.watchdog.phase("critic_values/wake"):
            self.wake(rollout_id)
        with self.watchdog.phase("critic_values/plan"):
            self._fenced_plans(rollout_id, data, fence_name="critic_values/plan")
        with self.watchdog.phase("critic_values/forward"), torch.no_grad():
            data["values"] = compute_values(self.model, data, self.log_prob_plans, self.args,
                                            collective_hook=self._critic_phase, progress=self.ledger.note_progress)
            share_across_dp(data, ("values",))
        self.ledger.flush()
        return data["values"]

    def train(self, rollout_id: int, data: dict[str, Any]) -> dict[str, Any]:
        """One rollout's critic step(s) on `data`, which carries the values `values` gave."""
        start = time.perf_counter()
        with self.watchdog.phase("critic_train/wake"):
            wake = self.wake(rollout_id)
        with self.watchdog.phase("critic_train/plan"):
            plans = self._fenced_plans(rollout_id, data, fence_name="critic_train/plan")
        with self.watchdog.phase("critic_train/returns"):
            critic_returns(self.args, data)
        objective = value_objective(self.args)
        results = [train_one_step(self.model, self.optimizer, self.lr_scheduler, data, plan, self.args,
                                  collective_hook=self._critic_phase, progress=self.ledger.note_progress,
                                  objective=objective) for plan in plans]
        last = results[-1]
        metrics = {f"critic/{k}": v for k, v in last.metrics.items()}
        metrics.update({"critic/grad_norm": last.grad_norm, "critic/num_steps": len(results),
                        "critic/lr": self.optimizer.param_groups[0]["lr"]})
        with self.watchdog.phase("critic_train/exit"):
            self.groups.fence("critic_train/exit", {"rollout_id": rollout_id, "metric_keys": sorted(metrics)})
        metrics.update({f"critic/{k.split('/')[-1]}": v for k, v in wake.items()})
        metrics["perf/critic_train_s"] = time.perf_counter() - start
        self.ledger.flush()
        return metrics

    def _critic_phase(self, phase: str):
        # train_step names its phases after the actor's step
        return self.watchdog.phase(phase.replace("actor_train/", "critic_train/", 1))

    def update_weights(self, rollout_id: int, engine_urls: list[str] | None = None) -> dict[str, Any]:
        raise RuntimeError("the critic's weights are not served by the engines")

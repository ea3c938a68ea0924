"""The parallel layout a checkpoint was saved at, and what a resume at another layout restores.

Rank 0 writes `iter_N/slime_layout.json` with every save. A resume compares it with the layout it runs at:

  item                      same layout        another layout (TP, PP, CP, EP, ETP, DP or the world changed)
  model, reference, served  exact              exact: megatron's dist_checkpointing reshards every tensor
  scheduler                 exact              exact (one state for every rank)
  optimizer, per parameter  exact              exact: saved per parameter, resharded with the model. Refused when
  (the default)                                expert parallelism is switched on or off (EP 1 <-> EP > 1): megatron
                                               then splits the state into two optimizers, saved under other names
  optimizer, distributed    exact              exact when TP, PP, EP, ETP and the virtual stages are the saved
  (--use-distributed-                          ones (megatron's dp_reshardable format reshards DP x CP only);
  optimizer)                                   anything else is refused before loading
  RNG, per rank             exact              not restored: each rank's streams were a rank of the other layout's,
                                               advanced by its data. The continuation is still exact when training
                                               draws nothing (every dropout 0); with dropout it is refused unless
                                               --no-load-rng asks for the --seed streams of the new layout
  data position, rollout    exact              exact (the rollout manager's, the same at any layout)
  side RNG

A refusal names the difference and the way out (the saved layout, or --no-load-optim / --no-load-rng). A
checkpoint saved before layouts were recorded is resumed as before: every item as saved, rank by rank.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields

from slime.checkpoint.durable import write_text_atomic
from slime.config.errors import ArgumentValidationError

LAYOUT_FILE = "slime_layout.json"
DISTRIBUTED, PER_PARAMETER = "distributed", "per_parameter"


class LayoutResumeError(ArgumentValidationError):
    """A checkpoint item cannot be restored at this layout; the message says what to do instead."""


@dataclass(frozen=True, kw_only=True)
class SavedLayout:
    """The training ranks' layout and how the optimizer state is partitioned, as a save records it."""

    tp: int
    pp: int
    cp: int
    ep: int
    etp: int
    dp: int
    world_size: int
    vpp: int | None
    optimizer: str | None
    """DISTRIBUTED (megatron's dp_reshardable format), PER_PARAMETER, or None (no optimizer state saved)."""
    optimizer_parts: int
    """Optimizers megatron chains (2 with expert parallelism: one for the experts' parameters)."""

    def describe(self) -> str:
        sizes = (("TP", self.tp), ("PP", self.pp), ("CP", self.cp), ("EP", self.ep),
                 ("ETP", self.etp if self.etp != self.tp else 1), ("DP", self.dp))
        text = " x ".join(f"{name}{size}" for name, size in sizes if size > 1 or name == "TP")
        return f"{text}{f' (VPP{self.vpp})' if self.vpp else ''}, {self.world_size} ranks"

    def ranks(self) -> tuple:
        """What decides which rank holds what: equal -> every rank's saved state is its own."""
        return (self.tp, self.pp, self.cp, self.ep, self.etp, self.dp, self.world_size, self.vpp)


def write_layout(iteration_path: str, layout: SavedLayout) -> None:
    write_text_atomic(os.path.join(iteration_path, LAYOUT_FILE), json.dumps(asdict(layout)))


def read_layout(iteration_path: str) -> SavedLayout | None:
    """The layout an iteration was saved at (None: saved before layouts were recorded)."""
    path = os.path.join(iteration_path, LAYOUT_FILE)
    if not os.path.exists(path):
        return None
    with open(path) as handle:
        data = json.load(handle)
    return SavedLayout(**{f.name: data[f.name] for f in fields(SavedLayout)})


@dataclass(frozen=True)
class LayoutResume:
    """What a resume restores at the layout it runs at."""

    changed: bool
    """The checkpoint was saved at another layout."""
    restore_rng: bool
    """Every rank restores its own saved RNG state."""
    notes: tuple[str, ...] = ()
    """What the resume says in its log (what is restored, what is not and why)."""


def plan_layout_resume(saved: SavedLayout | None, current: SavedLayout, *, load_optimizer: bool, load_rng: bool,
                       random_draws: tuple[str, ...]) -> LayoutResume:
    """What to restore; LayoutResumeError for what cannot be. `random_draws`: the flags that make training draw
    random numbers (a dropout above 0), for the RNG's verdict."""
    if saved is None or saved.ranks() == current.ranks():
        if load_optimizer and saved is not None:
            _check_optimizer(saved, current)  # the same layout, another optimizer kind
        return LayoutResume(changed=False, restore_rng=load_rng)
    where = f"saved at {saved.describe()}, resumed at {current.describe()}"
    if load_optimizer:
        _check_optimizer(saved, current, where)
    notes = [f"checkpoint {where}: model, reference model, scheduler"
             + (", optimizer state" if load_optimizer and saved.optimizer else "")
             + " and the data position are restored (resharded); each rank's RNG state is not"]
    if load_rng and random_draws:
        raise LayoutResumeError(
            f"checkpoint {where}: its per-rank RNG states belong to the ranks of the saved layout, so the dropout "
            f"draws ({', '.join(random_draws)}) cannot continue as saved. Resume at the saved layout, or pass "
            "--no-load-rng to go on with the --seed streams of the new layout")
    if load_rng:
        notes.append("no flag makes training draw random numbers (every dropout is 0): not restoring the "
                     "per-rank RNG changes nothing")
    return LayoutResume(changed=True, restore_rng=False, notes=tuple(notes))


def _check_optimizer(saved: SavedLayout, current: SavedLayout, where: str = "") -> None:
    where = where or f"saved at {saved.describe()}"
    way_out = "pass --no-load-optim to start a fresh optimizer (the weights, schedule and data position still load)"
    if saved.optimizer is None:
        return  # --no-save-optim: the load starts a fresh optimizer and says so
    if saved.optimizer != current.optimizer:
        flag = "with" if saved.optimizer == DISTRIBUTED else "without"
        raise LayoutResumeError(f"checkpoint {where}: its optimizer state was saved {flag} "
                                f"--use-distributed-optimizer, in another format than this run's; run {flag} it, or "
                                f"{way_out}")
    if saved.optimizer_parts != current.optimizer_parts:
        raise LayoutResumeError(
            f"checkpoint {where}: its optimizer state is in {saved.optimizer_parts} part(s) and this layout makes "
            f"{current.optimizer_parts} (megatron keeps the experts' parameters in an optimizer of their own when "
            f"expert parallelism is on); resume with expert parallelism {'on' if saved.optimizer_parts > 1 else 'off'}"
            f", or {way_out}")
    fixed = [("TP", "tp"), ("PP", "pp"), ("EP", "ep"), ("virtual pipeline stages", "vpp")]
    if saved.ep > 1 or current.ep > 1:  # experts split over ranks: their own TP too (a dense model has no experts)
        fixed.insert(3, ("ETP", "etp"))
    differ = [(name, getattr(saved, attr), getattr(current, attr)) for name, attr in fixed
              if getattr(saved, attr) != getattr(current, attr)]
    if saved.optimizer == DISTRIBUTED and differ:
        raise LayoutResumeError(
            f"checkpoint {where}: the distributed optimizer's state (megatron's dp_reshardable format) reshards "
            f"over DP and CP only, and {', '.join(f'{name} {was} -> {now}' for name, was, now in differ)}; resume "
            f"at the saved {', '.join(name for name, _, _ in differ)}, or {way_out}")


def training_draws(args) -> tuple[str, ...]:
    """The flags that make a training step draw random numbers (what a per-rank RNG state is for)."""
    draws = [f"--{flag} {value:g}" for flag, value in (("hidden-dropout", args.hidden_dropout),
                                                       ("attention-dropout", args.attention_dropout)) if value]
    if args.enable_lora and args.lora_dropout:
        draws.append(f"--lora-dropout {args.lora_dropout:g}")
    return tuple(draws)


def check_resume_layout(args) -> None:
    """Before Ray starts: what the ranks would refuse when they resume from --load at this run's layout (they
    check again, on what they see)."""
    from slime.checkpoint.contents import iteration_dir, latest_iteration

    iteration = latest_iteration(args.load) if args.load and not args.finetune else None
    if iteration is None:
        return
    layout = args.run_config.layout
    current = SavedLayout(tp=layout.tp, pp=layout.pp, cp=layout.cp, ep=layout.ep, etp=layout.etp, dp=layout.dp,
                          world_size=layout.world_size, vpp=layout.vpp,
                          optimizer=DISTRIBUTED if args.use_distributed_optimizer else PER_PARAMETER,
                          optimizer_parts=2 if layout.ep > 1 else 1)  # megatron: experts apart when EP > 1
    plan_layout_resume(read_layout(iteration_dir(args.load, iteration)), current,
                       load_optimizer=not args.no_load_optim, load_rng=not args.no_load_rng,
                       random_draws=training_draws(args))

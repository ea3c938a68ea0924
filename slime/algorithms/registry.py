"""The estimator registry: `--advantage-estimator NAME` -> the one `Estimator` record that says how the run's
rewards, advantages and losses are computed. The rollout side (reward normalisation), the pre-Ray checks, the
actor (log-prob sharing, advantages) and the losses ask `estimator(name)`; none of them names an estimator.

An estimator module describes its estimator with one frozen `Estimator` and calls `register` at import; the
built-in modules are listed in `_BUILTIN_MODULES` by estimator name and imported on the first look-up of that
name. This module imports neither torch nor an estimator module, so the flags read `estimator_names()` cheaply
(an engine's process parses no estimator).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Literal, Sequence

if TYPE_CHECKING:
    import torch

# One module per estimator (a family of variants may share one); adding an estimator is its module plus its
# line here. The order is the one --help shows.
_BUILTIN_MODULES: dict[str, str] = {
    "grpo": "slime.algorithms.grpo",
    "gspo": "slime.algorithms.grpo",
    "cispo": "slime.algorithms.cispo",
    "reinforce_plus_plus": "slime.algorithms.reinforce_plus_plus",
    "reinforce_plus_plus_baseline": "slime.algorithms.reinforce_plus_plus",
    "ppo": "slime.algorithms.ppo",
}

RatioMode = Literal["token", "sequence"]
RATIO_MODES: tuple[str, ...] = ("token", "sequence")


@dataclass(frozen=True, kw_only=True)
class AdvantageInputs:
    """What an estimator's advantages are computed from, per sample of the rollout (1-D per-token tensors)."""

    rewards: Sequence[float]
    """The post-processed rewards (group-normalised where the record says so)."""
    kl: list[torch.Tensor]
    """Per-token KL of the old policy to the reference (zeros without reference log-probs): the reward shaping."""
    loss_masks: list[torch.Tensor]
    values: Sequence[Sequence[float]] | None
    """The critic's value of every response token (None without a critic)."""
    kl_coef: float
    """--kl-coef: the weight of the KL reward term."""
    args: Any
    """The parsed flags (--gamma, --lambd, ...)."""


@dataclass(frozen=True, kw_only=True)
class PolicyLossInputs:
    """What a policy-loss term is computed from, per local token of a packed micro-batch."""

    log_ratio: torch.Tensor
    """old - new log-prob (0 on masked positions); with ratio_mode "sequence" each token holds its sample's mean."""
    log_probs: torch.Tensor
    """The new policy's log-probs (with gradient)."""
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    eps_clip: float
    eps_clip_high: float
    eps_clip_c: float | None
    """Dual-clip bound for negative advantages (None: off)."""


AdvantageTerm = Callable[[AdvantageInputs], "tuple[list[torch.Tensor], list[torch.Tensor]]"]
PolicyLossTerm = Callable[[PolicyLossInputs], "tuple[torch.Tensor, torch.Tensor]"]
ValueLossTerm = Callable[..., "tuple[torch.Tensor, torch.Tensor]"]


@dataclass(frozen=True, kw_only=True)
class Estimator:
    """One advantage estimator: how rewards become advantages and which loss terms train on them. The steps
    every estimator shares (the KL shaping, the distillation penalty, whitening) are in advantages.py."""

    name: str
    """The --advantage-estimator value."""
    advantages: AdvantageTerm
    """AdvantageInputs -> (advantages, returns) per sample, before the distillation penalty and whitening."""
    policy_loss: PolicyLossTerm
    """PolicyLossInputs -> (loss per token, clipfrac per token): the policy-gradient term of the actor's loss."""
    ratio_mode: RatioMode = "token"
    """How the importance ratio pi / pi_old is formed: one per token, or one per sample (GSPO: the mean token
    log-ratio over the sample's loss tokens, on each of its tokens)."""
    group_normalised: bool = False
    """The rollout side centres each reward within its prompt's group (--rewards-normalization, on by default)."""
    std_normalised: bool = False
    """Of a group-normalised estimator: also divides by the group's std (unless --disable-grpo-std-normalization)."""
    always_whitened: bool = False
    """The advantages are whitened over the rollout's loss tokens whatever --normalize-advantages says (the flag is
    then required, as upstream); otherwise only with --normalize-advantages."""
    whole_rollout: bool = False
    """The advantages of a sample use the log-probs of every sample of the rollout (KL-shaped returns, whitened
    together): with DP > 1 the ranks share their log-probs before computing them, and the per-DP batch keys hold
    the same values on every rank."""
    value_loss: ValueLossTerm | None = None
    """(values, old_values, returns, value_clip) -> (loss per token, clipfrac per token): the critic's loss term;
    None: the estimator trains no critic."""
    check_flags: Callable[[Any], None] | None = None
    """args -> None, or ValueError naming the fix: flags this estimator refuses, checked before Ray starts."""

    def __post_init__(self) -> None:
        if self.ratio_mode not in RATIO_MODES:
            raise ValueError(f"estimator {self.name}: ratio_mode {self.ratio_mode!r} is not one of {RATIO_MODES}")
        if self.std_normalised and not self.group_normalised:
            raise ValueError(f"estimator {self.name}: std_normalised needs group_normalised")

    @property
    def needs_critic(self) -> bool:
        """A run of this estimator trains a critic next to the actor (its value loss)."""
        return self.value_loss is not None


_ESTIMATORS: dict[str, Estimator] = {}


def register(record: Estimator) -> Estimator:
    """Make `record` the estimator of its name (called by the estimator's module at import)."""
    taken = _ESTIMATORS.get(record.name)
    if taken is not None and taken is not record:
        raise ValueError(f"advantage estimator {record.name!r} is registered twice")
    _ESTIMATORS[record.name] = record
    return record


def estimator_names() -> tuple[str, ...]:
    """Every built-in estimator name, in --help's order (imports no estimator module)."""
    return tuple(_BUILTIN_MODULES)


def estimator(name: str) -> Estimator:
    """The estimator registered as `name` (ValueError naming the known ones when there is none)."""
    if name not in _ESTIMATORS and name in _BUILTIN_MODULES:
        importlib.import_module(_BUILTIN_MODULES[name])
    if name not in _ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; known: {', '.join(estimator_names())}")
    return _ESTIMATORS[name]


@dataclass(frozen=True)
class DeferredTerm:
    """A loss term named by its module and qualified name, imported at its first call. The run config travels to
    every Ray actor, and a function pickles as a reference its receiver imports at once: an engine actor, which never
    computes a loss, would import the term's module and torch with it (~1.6 CPU-s a process)."""

    module: str
    qualname: str

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.resolve()(*args, **kwargs)

    def resolve(self) -> Callable[..., Any]:
        target: Any = importlib.import_module(self.module)
        for part in self.qualname.split("."):
            target = getattr(target, part)
        return target


def deferred(term: Callable[..., Any]) -> Callable[..., Any]:
    """`term` as a DeferredTerm where its module and name find it again (a lambda, a local function or None stays as
    is)."""
    module, qualname = getattr(term, "__module__", None), getattr(term, "__qualname__", "")
    if not module or "<" in qualname:
        return term
    return DeferredTerm(module, qualname)

"""The RL algorithm's room (slime/algorithms, docs/architecture.md): every estimator decision reads the estimator's
record, so no code outside the room (and the flag that names the choices) compares `--advantage-estimator` with a
name; a new estimator is its module and its registry line; the rollout batch's keys are declared once."""
from __future__ import annotations

import ast
import contextlib
from pathlib import Path

import pytest
import torch

from slime.algorithms import AdvantageInputs, Estimator, estimator, estimator_names, register, registry
from slime.algorithms.advantages import OPD_KL_KEY, compute_advantages_and_returns
from slime.algorithms.policy_loss import ppo_clip_loss
from slime.config import defaults_namespace
from slime.utils.rollout_batch import ACTOR, BATCH_KEYS, MANAGER, PER_DP_RANK_KEYS, REQUIRED_KEYS
from slime.utils.types import Sample

REPO = Path(__file__).resolve().parents[1]
# Where a comparison with an estimator name may stand: the room itself and the flag's definition.
ALLOWED = ("slime/algorithms/", "slime/config/flags/")


def _python_files(root: Path):
    for top in ("slime", "slime_plugins"):
        yield from sorted((root / top).rglob("*.py"))
    yield from sorted(root.glob("train*.py"))


def _names_an_estimator(node: ast.AST) -> bool:
    if isinstance(node, ast.Attribute) and node.attr == "advantage_estimator":
        return True
    if isinstance(node, ast.Name) and node.id == "advantage_estimator":
        return True
    if isinstance(node, ast.Constant) and node.value in estimator_names():
        return True
    return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(_names_an_estimator(e) for e in node.elts)


def estimator_conditionals(source: str, where: str) -> list[str]:
    """`<x>.advantage_estimator == ...`, `... in ("grpo", ...)`, `x == "ppo"`: a comparison or match on a name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        operands = ([node.left, *node.comparators] if isinstance(node, ast.Compare)
                    else [node.subject] if isinstance(node, ast.Match) else [])
        if any(_names_an_estimator(operand) for operand in operands):
            found.append(f"{where}:{node.lineno}")
    return found


def _conditionals_under(root: Path) -> list[str]:
    found = []
    for path in _python_files(root):
        where = str(path.relative_to(root))
        if not where.startswith(ALLOWED):
            found += estimator_conditionals(path.read_text(), where)
    return found


def test_no_estimator_conditionals_outside_the_algorithms_room():
    assert _conditionals_under(REPO) == []


def test_the_guard_sees_a_comparison_an_alias_and_a_tuple():
    probe = ('if args.advantage_estimator == "ppo": pass\n'
             'name = args.advantage_estimator\n'
             'if name in ("reinforce_plus_plus", "reinforce_plus_plus_baseline"): pass\n'
             'critic = args.advantage_estimator != other\n'
             'if args.loss_type == "policy_loss": pass\n')
    assert estimator_conditionals(probe, "probe.py") == ["probe.py:1", "probe.py:3", "probe.py:4"]


# ----------------------------------------------------------------------------------------------- the registry


def test_every_flag_choice_is_a_registered_record_of_its_module():
    from slime.config.parser import build_parser

    choices = next(a.choices for a in build_parser()._actions if a.dest == "advantage_estimator")
    assert tuple(choices) == estimator_names()
    for name, module in registry._BUILTIN_MODULES.items():
        record = estimator(name)
        assert record.name == name
        assert record.advantages.__module__.startswith("slime.algorithms.")
    with pytest.raises(ValueError, match="unknown advantage estimator 'a2c'; known: grpo, gspo"):
        estimator("a2c")


def test_the_records_say_what_upstream_does_for_each_estimator():
    facts = {name: (r.group_normalised, r.std_normalised, r.always_whitened, r.whole_rollout, r.needs_critic,
                    r.ratio_mode, r.policy_loss.__name__)
             for name, r in ((n, estimator(n)) for n in estimator_names())}
    assert facts == {
        "grpo": (True, True, False, False, False, "token", "ppo_clip_loss"),
        "gspo": (True, True, False, False, False, "sequence", "ppo_clip_loss"),
        "cispo": (True, True, False, False, False, "token", "cispo_loss"),
        "reinforce_plus_plus": (False, False, True, True, False, "token", "ppo_clip_loss"),
        "reinforce_plus_plus_baseline": (True, False, True, True, False, "token", "ppo_clip_loss"),
        "ppo": (False, False, False, False, True, "token", "ppo_clip_loss"),
    }


def test_a_record_with_an_unknown_ratio_mode_or_std_without_groups_is_refused():
    with pytest.raises(ValueError, match="ratio_mode 'chunk'"):
        Estimator(name="x", advantages=lambda i: ([], []), policy_loss=ppo_clip_loss, ratio_mode="chunk")
    with pytest.raises(ValueError, match="std_normalised needs group_normalised"):
        Estimator(name="x", advantages=lambda i: ([], []), policy_loss=ppo_clip_loss, std_normalised=True)


@contextlib.contextmanager
def _registered(record: Estimator):
    register(record)
    try:
        yield record
    finally:
        registry._ESTIMATORS.pop(record.name)


def _halved_clip(inputs):
    losses, clipfrac = ppo_clip_loss(inputs)
    return losses / 2, clipfrac


def test_a_new_estimator_is_its_record_alone():
    """Nothing outside the record names an estimator: one registered here drives the rewards, the advantages, the
    whitening, the loss term and the critic decision without another line changing."""
    from slime.config.loss import build_loss_config
    from slime.rollout.train_data import samples_to_train_data

    def doubled(inputs: AdvantageInputs):
        returns = [torch.full_like(m, 2.0 * float(r)) for r, m in zip(inputs.rewards, inputs.loss_masks)]
        return returns, returns

    record = Estimator(name="doubled_test", advantages=doubled, policy_loss=_halved_clip, ratio_mode="sequence",
                       group_normalised=True, always_whitened=True)
    with _registered(record):
        args = defaults_namespace(advantage_estimator="doubled_test", n_samples_per_prompt=2, reward_key=None,
                                  normalize_advantages=False)
        samples = [Sample(index=i, group_index=i // 2, tokens=[1, 2, 3], response_length=2, reward=float(i))
                   for i in range(4)]
        data = samples_to_train_data(args, samples)
        assert data["rewards"] == [-0.5, 0.5, -0.5, 0.5]  # centred in each group, not divided by its std
        compute_advantages_and_returns(args, data)
        assert data["returns"][1] == pytest.approx([2 * data["rewards"][1]] * 2)
        flat = torch.tensor(data["advantages"]).flatten()  # whitened although --normalize-advantages is off
        assert flat.mean().item() == pytest.approx(0.0, abs=1e-6)
        assert flat.std(unbiased=False).item() == pytest.approx(1.0, rel=1e-4)
        cfg = build_loss_config(args)
        assert cfg.ratio_mode == "sequence" and cfg.policy_loss.resolve() is _halved_clip
        assert not estimator("doubled_test").needs_critic
    assert "doubled_test" not in registry._ESTIMATORS


# ------------------------------------------------------------------------------------------ the rollout batch


def test_the_conversion_returns_the_required_keys_and_only_manager_keys():
    from slime.rollout.train_data import samples_to_train_data

    args = defaults_namespace(advantage_estimator="grpo", n_samples_per_prompt=1, reward_key=None)
    plain = samples_to_train_data(args, [Sample(index=0, tokens=[1, 2], response_length=1, reward=1.0)])
    assert set(plain) == set(REQUIRED_KEYS)
    full = samples_to_train_data(args, [Sample(index=0, tokens=[1, 2], response_length=1, reward=1.0,
                                               rollout_log_probs=[-0.5], teacher_log_probs=[-0.7],
                                               rollout_routed_experts="AAAA")])
    assert all(MANAGER in BATCH_KEYS[key].added_by for key in full)


def test_every_key_the_trainer_reads_or_writes_is_declared():
    from slime.backends.megatron_utils.actor import FORWARD_ONLY_COPIES
    from slime.backends.megatron_utils.data import PER_TOKEN_KEYS

    assert set(PER_TOKEN_KEYS) <= set(BATCH_KEYS)
    written = {"log_probs", *(f"{tag}_log_probs" for tag in FORWARD_ONLY_COPIES), "advantages", "returns", OPD_KL_KEY}
    assert all(ACTOR in BATCH_KEYS[key].added_by for key in written)
    # what a DP rank fills for its own samples only: fenced among its peers after a hook, shared by whole-rollout
    # estimators
    assert written <= set(PER_DP_RANK_KEYS)
    assert not set(PER_DP_RANK_KEYS) & set(REQUIRED_KEYS)

"""On-policy distillation (--use-opd): upstream's flag rules, the teacher-engine plug-ins of
slime.rollout.on_policy_distillation, the reverse-KL penalty on the advantages, the trainer's metric, the
embedded engine scoring a prompt at the rollout temperature, and (end to end, CPU) the student's KL to a tiny
teacher falling."""
from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from arg_testing import no_real_sglang, parse_error, parse_quiet  # noqa: F401 (fixture)
from slime.backends.megatron_utils.opd import megatron_teacher
from slime.config import defaults_namespace
from slime.utils.ppo_utils import OPD_KL_KEY, opd_penalised
from slime.rollout import on_policy_distillation as opd_rollout
from slime.utils.ppo_utils import compute_advantages_and_returns
from slime.utils.types import Sample

pytestmark = pytest.mark.e2e

MINIMAL = ["--rollout-batch-size", "2", "--num-rollout", "1", "--actor-num-gpus-per-node", "1",
           "--train-backend-device", "cpu"]


# ------------------------------------------------------------------ flags

@pytest.mark.parametrize("flags, message", [
    (["--use-opd"], "--use-opd needs --opd-type"),
    (["--use-opd", "--opd-type", "megatron"], "--opd-type megatron needs --opd-teacher-load"),
    (["--use-opd", "--opd-type", "megatron", "--opd-teacher-load", "/no/such/teacher"], "does not exist"),
    (["--use-opd", "--opd-type", "sglang", "--opd-teacher-load", "."], "--opd-teacher-load is for --opd-type megatron"),
    (["--opd-teacher-load", "."], "--opd-teacher-load is set but --use-opd is not"),
    (["--opd-type", "sglang"], "no effect without --use-opd"),
    (["--use-opd", "--opd-type", "sglang", "--opd-teacher-ckpt-step", "3"], "--opd-teacher-ckpt-step"),
    (["--use-opd", "--opd-type", "sglang", "--loss-type", "sft_loss"], "--loss-type sft_loss"),
    (["--use-opd", "--opd-type", "sglang", "--disable-compute-advantages-and-returns"],
     "remove --disable-compute-advantages-and-returns"),
    (["--use-opd", "--opd-type", "sglang", "--custom-advantage-function-path", "os.path.join"],
     "--custom-advantage-function-path replaces"),
])
def test_opd_flag_rules(flags, message, capsys):
    assert message in parse_error(MINIMAL + flags, capsys)


def test_opd_flags_accepted_in_both_modes(tmp_path):
    args = parse_quiet(MINIMAL + ["--use-opd", "--opd-type", "megatron", "--opd-teacher-load", str(tmp_path),
                                  "--opd-teacher-ckpt-step", "7", "--opd-kl-coef", "0.5"])
    assert megatron_teacher(args) == (str(tmp_path), 7) and args.opd_kl_coef == 0.5
    args = parse_quiet(MINIMAL + ["--use-opd", "--opd-type", "sglang"])
    assert megatron_teacher(args) is None  # the teacher engine scores the samples


# ------------------------------------------------------------------ the penalty

def _opd_args(**kw):
    base = dict(use_opd=True, opd_type="sglang", opd_kl_coef=0.5, use_rollout_logprobs=False,
                advantage_estimator="grpo", normalize_advantages=False, kl_coef=0.0, kl_loss_type="k1")
    return SimpleNamespace(**{**base, **kw})


def test_reverse_kl_is_subtracted_from_the_advantages_per_token():
    data = {"log_probs": [[-1.0, -2.0], []], "teacher_log_probs": [[-1.5, -1.0], [-0.3]]}
    out = opd_penalised(_opd_args(), data, [torch.tensor([1.0, 1.0]), torch.tensor([2.0])])
    assert out[0].tolist() == pytest.approx([1.0 - 0.5 * 0.5, 1.0 - 0.5 * -1.0])
    assert out[1].tolist() == [2.0]  # another DP rank's sample: untouched here
    assert data[OPD_KL_KEY] == [pytest.approx([0.5, -1.0]), []]
    # --use-rollout-logprobs: the engines' log-probs are the student's
    data = {"rollout_log_probs": [[-0.5]], "log_probs": [[-9.0]], "teacher_log_probs": [[-0.5]]}
    assert opd_penalised(_opd_args(use_rollout_logprobs=True), data, [torch.zeros(1)])[0].tolist() == [0.0]
    with pytest.raises(ValueError, match="no teacher_log_probs.*reward_func"):
        opd_penalised(_opd_args(), {"log_probs": [[-1.0]]}, [torch.zeros(1)])
    with pytest.raises(ValueError, match="2 teacher log-probs for 1 response tokens"):
        opd_penalised(_opd_args(), {"log_probs": [[-1.0]], "teacher_log_probs": [[-1.0, -2.0]]}, [torch.zeros(1)])


def test_opd_joins_the_estimators_advantages_before_whitening():
    data = {"rewards": [1.0, -1.0], "loss_masks": [[1, 1], [1]], "log_probs": [[-1.0, -1.0], [-2.0]],
            "teacher_log_probs": [[-1.0, -3.0], [-1.0]]}
    compute_advantages_and_returns(_opd_args(opd_kl_coef=1.0), data)
    assert data["advantages"] == [pytest.approx([1.0, -1.0]), pytest.approx([0.0])]
    assert data["returns"] == [pytest.approx([1.0, 1.0]), pytest.approx([-1.0])]  # returns stay the rewards'
    off = {k: v for k, v in data.items() if k in ("rewards", "loss_masks", "log_probs", "teacher_log_probs")}
    compute_advantages_and_returns(_opd_args(use_opd=False), off)
    assert off["advantages"] == [pytest.approx([1.0, 1.0]), pytest.approx([-1.0])] and OPD_KL_KEY not in off


def test_trainer_reports_the_reverse_kl_as_a_train_metric():
    from test_loss_hooks import _args, _data  # the loss tests' one packed micro-batch

    from slime.backends.megatron_utils.data import pack_micro_batch, plans_from_rollout
    from slime.backends.megatron_utils.loss import metric_keys, micro_batch_loss
    from slime.config.loss import build_loss_config

    args = _args(use_opd=True, calculate_per_token_loss=True)
    data = _data()
    data[OPD_KL_KEY] = [[0.5] * len(m) for m in data["loss_masks"]]
    plan = plans_from_rollout(data, args, dp_size=1, dp_rank=0)[0]
    packed = pack_micro_batch(data, plan.micro_batches[0], cp_size=1, cp_rank=0, tp_size=1, sequence_parallel=False)
    logits = torch.randn(packed.labels.numel(), 11)
    _, metrics = micro_batch_loss(logits, packed, plan, build_loss_config(args), None, plugin_args=args)
    assert OPD_KL_KEY in metric_keys(build_loss_config(args))
    covered = float(packed.loss_mask.sum()) / plan.step_loss_token_total
    assert metrics[OPD_KL_KEY].item() == pytest.approx(0.5 * covered)


# ------------------------------------------------------------------ the teacher-engine plug-ins

def _reply(logprobs: list[float | None], tokens: list[int]) -> dict:
    return {"meta_info": {"input_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, tokens)]}}


def test_teacher_request_scores_every_token_at_the_rollout_temperature(monkeypatch):
    sent = {}

    async def fake_post(url, payload, timeout_s):
        sent.update(url=url, payload=payload, timeout_s=timeout_s)
        return _reply([None, -0.1, -0.2, -0.3, -0.4], payload["input_ids"])

    monkeypatch.setattr(opd_rollout, "post", fake_post)
    args = SimpleNamespace(rm_url="http://127.0.0.1:1/generate", rollout_temperature=0.7)
    sample = Sample(index=0, tokens=[5, 6, 7, 8, 9], response_length=2)
    assert asyncio.run(opd_rollout.reward_func(args, sample)) == 0.0
    assert sample.teacher_log_probs == pytest.approx([-0.3, -0.4])  # the response's tokens only
    assert sent["payload"]["sampling_params"] == {"temperature": 0.7, "max_new_tokens": 0, "skip_special_tokens": False}
    assert sent["payload"]["logprob_start_len"] == 0 and sent["payload"]["return_logprob"] is True
    with pytest.raises(ValueError, match="--rm-url"):
        asyncio.run(opd_rollout.reward_func(SimpleNamespace(rm_url=None), sample))


def test_post_process_gives_zero_rewards_and_reads_upstreams_raw_reply_form():
    scored = Sample(index=0, response_length=1, teacher_log_probs=[-0.5], reward=0.0)
    raw = Sample(index=1, tokens=[1, 2, 3], response_length=2, reward=_reply([None, -0.7, -0.9], [1, 2, 3]))
    assert opd_rollout.post_process_rewards(None, [scored, raw]) == ([0.0, 0.0], [0.0, 0.0])
    assert raw.teacher_log_probs == pytest.approx([-0.7, -0.9]) and raw.reward == 0.0
    with pytest.raises(ValueError, match="no teacher log-probs"):
        opd_rollout.post_process_rewards(None, [Sample(index=2, response_length=1, reward=0.0)])
    with pytest.raises(ValueError, match="fewer than the 3 response tokens"):
        opd_rollout.teacher_response_log_probs(_reply([None, -0.1], [1, 2]), 3)


def test_train_data_carries_the_teacher_log_probs():
    from slime.rollout.train_data import samples_to_train_data

    args = SimpleNamespace(advantage_estimator="grpo", n_samples_per_prompt=1, reward_key=None,
                           custom_reward_post_process_path="slime.rollout.on_policy_distillation.post_process_rewards")
    samples = [Sample(index=i, group_index=i, tokens=[1, 2, 3], response_length=1, reward=0.0,
                      teacher_log_probs=[-0.25 * (i + 1)]) for i in range(2)]
    data = samples_to_train_data(args, samples)
    assert data["teacher_log_probs"] == [[-0.25], [-0.5]] and data["rewards"] == [0.0, 0.0]
    samples[0].teacher_log_probs = [-1.0, -2.0]
    with pytest.raises(ValueError, match="2 teacher_log_probs for 1 response tokens"):
        samples_to_train_data(args, samples)


def test_embedded_engine_scores_a_prompt_at_the_request_temperature(tmp_path):
    from transformers import AutoModelForCausalLM

    from slime.backends.embedded_engine.engine import EmbeddedEngine
    from slime.backends.embedded_engine.generate_request import build_requests
    from slime.tools.tiny_checkpoint import TinyQwen3Spec, write_tiny_checkpoint

    model_dir = write_tiny_checkpoint(tmp_path / "teacher", TinyQwen3Spec(layers=1, alphabet="0123456789"))
    engine = EmbeddedEngine(str(model_dir), seed=1)
    ids = [3, 4, 5, 6, 7, 8]
    body = {"input_ids": ids, "sampling_params": {"temperature": 0.5, "max_new_tokens": 0},
            "return_logprob": True, "logprob_start_len": 0}
    requests, _ = build_requests(body, engine.tokenize)
    (result,) = engine.generate_batch(requests)
    reply = result.to_sglang()
    assert reply["output_ids"] == [] and reply["meta_info"]["finish_reason"]["type"] == "length"
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(str(model_dir))(torch.tensor([ids])).logits.float()[0, :-1]
    expected = torch.log_softmax(logits / 0.5, -1).gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)
    assert opd_rollout.teacher_response_log_probs(reply, len(ids) - 1) == pytest.approx(expected.tolist(), abs=1e-5)


# ------------------------------------------------------------------ end to end (CPU): the KL to the teacher falls

OPD_ROLLOUTS = 10


@pytest.fixture(scope="module")
def opd_assets(tmp_path_factory) -> dict[str, Path]:
    from slime.tools.demo_prompts import write_prompts
    from slime.tools.tiny_checkpoint import TinyQwen3Spec, write_tiny_checkpoint

    root = tmp_path_factory.mktemp("opd")
    # a random-init tiny student over the demo's alphabet; its teacher is the same model made sharper (output
    # layer x SHARPEN): far from the near-uniform student at first, and reachable within a few steps
    student = write_tiny_checkpoint(root / "student", TinyQwen3Spec(alphabet="0123456789", seed=1))
    teacher = _sharpened_copy(Path(student), root / "teacher")
    prompts = write_prompts(root / "prompts.jsonl", n=32, seed=0, task="counting")
    zero = root / "zero_reward.py"
    zero.write_text("async def reward(args, sample, **kwargs):\n    return 0.0\n")  # pure distillation
    return {"root": root, "student": Path(student), "teacher": Path(teacher), "prompts": Path(prompts),
            "zero": zero}


SHARPEN = 4.0


def _sharpened_copy(model: Path, out: Path) -> Path:
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(model, out)
    weights = load_file(str(out / "model.safetensors"))
    weights["lm_head.weight"] = weights["lm_head.weight"] * SHARPEN
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def opd_flags(assets: dict[str, Path], metrics: Path) -> list[str]:
    return [
        "--hf-checkpoint", str(assets["student"]), "--prompt-data", str(assets["prompts"]),
        "--input-key", "prompt", "--label-key", "label", "--rollout-shuffle",
        "--use-opd", "--opd-kl-coef", "1.0",
        "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1",
        "--rollout-num-gpus-per-engine", "1", "--use-slime-router",
        "--num-rollout", str(OPD_ROLLOUTS), "--rollout-batch-size", "8",
        "--n-samples-per-prompt", "8", "--num-steps-per-rollout", "1", "--rollout-max-response-len", "6",
        "--rollout-temperature", "1.0", "--advantage-estimator", "grpo",
        "--use-dynamic-batch-size", "--max-tokens-per-gpu", "256", "--calculate-per-token-loss",
        "--optimizer", "adam", "--lr", "5e-3", "--lr-decay-style", "constant", "--weight-decay", "0.0",
        "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--seed", "1234", "--fence-timeout", "120",
        "--metrics-jsonl", str(metrics),
    ]


def _reverse_kls(metrics: Path) -> list[float]:
    from train_runs import read_events

    train = sorted(read_events(metrics)["train"], key=lambda e: e["rollout_id"])
    return [e[f"train/{OPD_KL_KEY}"] for e in train]


def exact_kl(student: Path, teacher: Path, prompts: Path) -> float:
    """Mean full-vocabulary KL(student || teacher) of the next-token distributions over every prompt followed by
    its label (the task's continuation): low-variance, unlike the sampled-token estimate the trainer logs."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(student))
    rows = [json.loads(line) for line in prompts.read_text().splitlines()]
    ids = torch.tensor([tokenizer(r["prompt"] + r["label"], add_special_tokens=False)["input_ids"] for r in rows])
    with torch.no_grad():
        s, t = (torch.log_softmax(AutoModelForCausalLM.from_pretrained(str(m))(ids).logits.float(), -1)
                for m in (student, teacher))
    return float((s.exp() * (s - t)).sum(-1).mean())


def _run_and_check(assets: dict[str, Path], tmp_path: Path, extra: list[str]) -> None:
    from train_runs import run_train

    metrics, saved = tmp_path / "metrics.jsonl", tmp_path / "hf_{rollout_id}"
    proc, _ = run_train([*opd_flags(assets, metrics), "--save", str(tmp_path / "ckpt"), "--save-interval",
                         str(OPD_ROLLOUTS), "--no-save-optim", "--save-hf", str(saved), *extra], timeout_s=640)
    assert proc.returncode == 0, proc.stderr[-4000:]
    kls = _reverse_kls(metrics)  # the trainer's per-rollout estimate: logged every rollout, and positive
    assert len(kls) == OPD_ROLLOUTS and all(math.isfinite(v) and v > 0 for v in kls), kls
    before = exact_kl(assets["student"], assets["teacher"], assets["prompts"])
    after = exact_kl(Path(str(saved).format(rollout_id=OPD_ROLLOUTS - 1)), assets["teacher"], assets["prompts"])
    assert before > 0.05 and after < 0.7 * before, f"KL(student || teacher) {before:.4f} -> {after:.4f}; per rollout {kls}"


@pytest.mark.timeout(700)
def test_student_moves_towards_a_megatron_teacher(opd_assets, tmp_path):
    _run_and_check(opd_assets, tmp_path, ["--opd-type", "megatron", "--opd-teacher-load", str(opd_assets["teacher"]),
                                          "--custom-rm-path", f"{opd_assets['zero']}:reward"])


@pytest.mark.timeout(700)
def test_student_moves_towards_a_teacher_engine(opd_assets, tmp_path):

    from slime.backends.sglang_utils.launcher import launch_engine
    from slime.utils.ports import find_free_port

    teacher = launch_engine("embedded", defaults_namespace(seed=7), 0, find_free_port(), str(opd_assets["teacher"]),
                            startup_timeout_s=120, log_dir=str(tmp_path / "teacher-logs"))
    try:
        _run_and_check(opd_assets, tmp_path, [
            "--opd-type", "sglang", "--custom-rm-path", "slime.rollout.on_policy_distillation.reward_func",
            "--custom-reward-post-process-path", "slime.rollout.on_policy_distillation.post_process_rewards",
            "--rm-url", f"{teacher.url}/generate"])
    finally:
        teacher.stop()

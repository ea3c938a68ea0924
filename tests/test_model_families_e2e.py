"""`python train.py` trains and generates a tiny DeepSeek-V3 (MLA, YaRN) and a tiny GLM-4 (--spec) end to end.

Embedded engines serve transformers' DeepseekV3ForCausalLM / Glm4ForCausalLM; after every weight push their
log-probs must match the trainer's (train/train_rollout_logprob_abs_diff <= 1e-4 in fp32), the same proof the
dense model gives in test_logprob_agreement.py. DeepSeek-V3 runs at CP2, GLM-4 at TP2 with SP.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_logprob_agreement import AGREEMENT, RUN_TIMEOUT_S, train_flags
from tiny_models import replace_model, save_tiny_deepseek_v3, save_tiny_glm4
from train_runs import run_train

pytestmark = pytest.mark.e2e

NUM_ROLLOUTS = 3
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32,
        "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, Path]:
    from slime.tools.demo_prompts import write_prompts
    from slime.tools.tiny_checkpoint import TinyQwen3Spec, write_tiny_checkpoint

    root = tmp_path_factory.mktemp("families_e2e")
    checkpoints = {}
    for name, save in (("deepseek_v3", lambda path, **ids: save_tiny_deepseek_v3(path, rope_scaling=YARN, **ids)),
                       ("glm4", save_tiny_glm4)):
        checkpoints[name] = write_tiny_checkpoint(root / name, TinyQwen3Spec(alphabet="0123456789"))
        replace_model(checkpoints[name], save)
    prompts = write_prompts(root / "counting.jsonl", n=32, seed=0, task="counting")
    return {"root": root, "checkpoints": checkpoints, "prompts": prompts}


def _with(flags: list[str], **values: str | None) -> list[str]:
    """flags with --name value replaced (or added); a None value drops the flag and its value."""
    out, skip = [], False
    for i, flag in enumerate(flags):
        if skip:
            skip = False
            continue
        key = flag[2:].replace("-", "_") if flag.startswith("--") else None
        if key in values:
            skip = i + 1 < len(flags) and not flags[i + 1].startswith("--")
            continue
        out.append(flag)
    for key, value in values.items():
        if value is not None:
            out += [f"--{key.replace('_', '-')}", *([] if value == "" else [value])]
    return out


def _run(assets, family: str, extra: tuple[str, ...] = (), **layout: str | None) -> dict[int, float]:
    base = train_flags({"root": assets["root"], "checkpoint": assets["checkpoints"][family],
                        "prompts": assets["prompts"]}, family)
    flags = [*_with(base, num_rollout=str(NUM_ROLLOUTS), save_debug_rollout_data=None, **layout), *extra]
    proc, _ = run_train(flags, timeout_s=RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    events = [json.loads(line) for line in (assets["root"] / family / "metrics.jsonl").read_text().splitlines()]
    return {e["rollout_id"]: e["train/train_rollout_logprob_abs_diff"] for e in events if e["event"] == "train"}


@pytest.mark.timeout(600)
def test_deepseek_v3_mla_trains_and_generates_under_cp2(assets):
    diffs = _run(assets, "deepseek_v3", tensor_model_parallel_size="1", sequence_parallel=None,
                 context_parallel_size="2", multi_latent_attention="")
    assert sorted(diffs) == list(range(NUM_ROLLOUTS))
    assert all(0.0 <= d <= AGREEMENT for d in diffs.values()), diffs


@pytest.mark.timeout(600)
def test_glm4_spec_trains_and_generates_under_tp2_sp(assets):
    diffs = _run(assets, "glm4", extra=("--spec", "slime_plugins.models.glm4", "get_glm_spec",
                                        "--post-self-attn-layernorm", "--post-mlp-layernorm", "--rotary-interleaved"))
    assert sorted(diffs) == list(range(NUM_ROLLOUTS))
    assert all(0.0 <= d <= AGREEMENT for d in diffs.values()), diffs

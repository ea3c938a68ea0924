"""The learnable demo's pieces without a training run: the character tokenizer and its tiny model, the counting
task and its reward plugin, the curves of plot_metrics, and the TensorBoard sink of the metrics logger."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from examples.counting_reward import counting_reward, digit_credit
from slime.tools.char_tokenizer import EOS_TOKEN, save_char_tokenizer
from slime.tools.demo_prompts import make_counting_prompts
from slime.tools.plot_metrics import PANELS, plot_metrics, read_series, reward_summary
from slime.tools.tiny_checkpoint import TinyQwen3Spec, write_tiny_checkpoint

pytestmark = pytest.mark.timeout(300)


def test_char_tokenizer_loads_with_auto_tokenizer_and_round_trips(tmp_path):
    from transformers import AutoTokenizer

    save_char_tokenizer(tmp_path, "0123456789")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tokenizer) == 13 and tokenizer.eos_token == EOS_TOKEN and tokenizer.pad_token_id == 0
    ids = tokenizer.encode("7890", add_special_tokens=False)
    assert ids == [10, 11, 12, 3] and tokenizer.decode(ids) == "7890"
    assert tokenizer.decode(ids + [tokenizer.eos_token_id], skip_special_tokens=True) == "7890"
    assert tokenizer.encode("7x", add_special_tokens=False) == [10, tokenizer.unk_token_id]


def test_tiny_checkpoint_over_a_character_vocabulary(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out = write_tiny_checkpoint(tmp_path / "model", TinyQwen3Spec(alphabet="0123456789", seed=5))
    config, tokenizer = AutoConfig.from_pretrained(out), AutoTokenizer.from_pretrained(out)
    assert config.vocab_size == len(tokenizer) == 13
    assert config.eos_token_id == tokenizer.eos_token_id and config.pad_token_id == tokenizer.pad_token_id
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    logits = model(torch.tensor([tokenizer.encode("345")])).logits
    assert logits.shape == (1, 3, 13) and torch.isfinite(logits).all()


def test_counting_prompts_continue_the_run_of_digits():
    rows = make_counting_prompts(50, seed=2)
    assert rows == make_counting_prompts(50, seed=2) and rows != make_counting_prompts(50, seed=3)
    for row in rows:
        digits = [int(c) for c in row["prompt"] + row["label"]]
        assert len(row["prompt"]) == len(row["label"]) == 3
        assert all((b - a) % 10 == 1 for a, b in zip(digits, digits[1:]))


def test_counting_reward_gives_graded_credit_per_position():
    assert counting_reward("012", "012") == 1.0
    assert counting_reward("9", "012") == pytest.approx((2 / 3) / 3)  # 9 is one step from 0 (cyclic)
    assert counting_reward("0<|im_end|>", "012") == pytest.approx(1 / 3)  # the special token earns nothing
    assert counting_reward("", "012") == 0.0 and counting_reward("555", "012") == 0.0
    assert [digit_credit(str(d), "0") for d in (0, 1, 2, 3, 8)] == pytest.approx([1, 2 / 3, 1 / 3, 0, 1 / 3])


def test_counting_reward_plugin_loads_as_custom_rm_path():
    import asyncio

    from slime.rollout.rm_hub import async_rm
    from slime.utils.types import Sample

    args = SimpleNamespace(custom_rm_path="examples.counting_reward.reward")
    sample = Sample(prompt="789", response="01", label="012")
    assert asyncio.run(async_rm(args, sample)) == pytest.approx(2 / 3)


def _write_metrics(path: Path) -> None:
    events = []
    for k in range(4):
        events += [{"event": "rollout", "rollout_id": k, "rollout/raw_reward": 0.2 + 0.1 * k},
                   {"event": "train", "rollout_id": k, "train/loss": 1.0 - k, "train/pg_loss": -k,
                    "train/grad_norm": 2.0, "train/train_rollout_logprob_abs_diff": 1e-7 * (k + 1),
                    "perf/actor_train_s": 1.5},
                   {"event": "weight_sync", "rollout_id": k, "weight_sync/seconds": 0.1}]
    events.append({"event": "rollout", "rollout_id": 3, "rollout/raw_reward": 0.9})  # resumed: the last one wins
    events.append({"event": "train", "rollout_id": 4, "train/train_rollout_logprob_abs_diff": "nan"})
    path.write_text("".join(json.dumps(e) + "\n" for e in events))


def test_plot_metrics_writes_every_panel_and_curves(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    _write_metrics(metrics)
    series = read_series(metrics)
    assert series[("rollout", "rollout/raw_reward")] == pytest.approx({0: 0.2, 1: 0.3, 2: 0.4, 3: 0.9})
    assert 4 not in series[("train", "train/train_rollout_logprob_abs_diff")]  # "nan" is not a point
    assert "rollout 0 0.200" in reward_summary(series) and "(+0.333)" in reward_summary(series)
    proc = subprocess.run([sys.executable, "-m", "slime.tools.plot_metrics", str(metrics), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, check=True)
    expected = [tmp_path / f"{panel.name}.png" for panel in PANELS] + [tmp_path / "curves.png"]
    for path in expected:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"wrote {path}" in proc.stdout
    assert plot_metrics(metrics, tmp_path / "again") == [tmp_path / "again" / p.name for p in expected]


@pytest.mark.parametrize("dtype, line", [("fp32", 1e-4), ("bf16", 2e-2)])
def test_the_log_prob_agreement_line_follows_the_runs_dtype(dtype, line, tmp_path, monkeypatch):
    """A bf16 run is drawn against bf16's line: its healthy diff (~4e-3 on one H200) sits above fp32's 1e-4."""
    import matplotlib.axes

    from slime.config import defaults_namespace
    from slime.utils.metrics_logger import MetricsLogger

    metrics = MetricsLogger(defaults_namespace(metrics_jsonl=str(tmp_path / "m.jsonl"), start_rollout_id=0,
                                               bf16=dtype == "bf16"))
    metrics.log("train", 0, {"train/train_rollout_logprob_abs_diff": 4e-3})
    metrics.close()
    import matplotlib.figure

    drawn = []
    monkeypatch.setattr(matplotlib.axes.Axes, "axhline", lambda ax, y, **kw: drawn.append((y, kw["label"])))
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda *a, **kw: None)  # the lines, not the PNGs
    plot_metrics(tmp_path / "m.jsonl", tmp_path / "plots")
    assert {y for y, _ in drawn} == {line} and dtype in drawn[0][1]
    if dtype == "bf16":
        drawn.clear()
        plot_metrics(tmp_path / "m.jsonl", tmp_path / "plots", dtype="fp32")  # --dtype overrides
        assert {y for y, _ in drawn} == {1e-4}


def test_tensorboard_logs_the_same_metrics_as_the_jsonl(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from slime.config import defaults_namespace
    from slime.utils.metrics_logger import MetricsLogger

    monkeypatch.delenv("TENSORBOARD_DIR", raising=False)
    args = defaults_namespace(metrics_jsonl=str(tmp_path / "m.jsonl"), use_tensorboard=True, start_rollout_id=0,
                              tensorboard_dir=str(tmp_path / "tb"), tb_experiment_name="run1")
    metrics = MetricsLogger(args)
    for k in range(3):
        metrics.log("train", k, {"train/loss": 0.5 * k, "train/train_rollout_logprob_abs_diff": 1e-6 * k})
    metrics.close()
    events = EventAccumulator(str(tmp_path / "tb" / "run1"))
    events.Reload()
    jsonl = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert jsonl[0] == {"event": "run", "rollout_id": 0, "run/dtype": "fp32"}  # first: what readers of the file need
    jsonl = jsonl[1:]
    for key in ("train/loss", "train/train_rollout_logprob_abs_diff"):
        scalars = [(s.step, s.value) for s in events.Scalars(key)]
        assert scalars == [(e["rollout_id"], pytest.approx(e[key], rel=1e-6)) for e in jsonl]
    assert math.isclose(events.Scalars("train/loss")[-1].value, 1.0)


def test_tensorboard_dir_follows_upstream_override_then_flags(monkeypatch):
    from slime.config import defaults_namespace
    from slime.utils.metrics_logger import tensorboard_log_dir

    args = SimpleNamespace(tensorboard_dir="tb", tb_experiment_name="exp")
    monkeypatch.delenv("TENSORBOARD_DIR", raising=False)
    assert tensorboard_log_dir(args) == "tb/exp"
    assert tensorboard_log_dir(defaults_namespace(use_tensorboard=True)) == "tensorboard_log"  # completed by the config
    assert tensorboard_log_dir(defaults_namespace(tb_project_name="proj")) == "proj"  # upstream's name
    monkeypatch.setenv("TENSORBOARD_DIR", "/elsewhere")
    assert tensorboard_log_dir(args) == "/elsewhere"

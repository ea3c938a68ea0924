"""`python train.py` on the embedded default (1 rank, 1 engine) with upstream users' plug-ins.

Three runs, each shared by many assertions:
- hooks: every function hook at once (tests/hook_plugins.py records each call), --custom-config-path,
  --start-rollout-id, --save with --no-save-optim and --save-hf;
- sampling: over-sampling + check_reward_nonzero_std, partial rollout with off-policy masking, a
  recording --buffer-filter-path and --data-source-path, --loss-type custom_loss;
- multi-turn: examples/multi_turn (tool replies masked out of the loss) trains.
A rollout log hook that never returns ends the rollout within its window, naming the hook
(tests/test_rollout_deadline.py, on the rollout manager itself: its window and the driver's wait).
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

import hook_plugins
from train_runs import read_events, run_script, run_train, write_run_assets

pytestmark = pytest.mark.e2e

PLUGINS = str(Path(hook_plugins.__file__).resolve())
ONE_RANK = ["--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1",
            "--use-slime-router", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "1024",
            "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--fence-timeout", "120", "--seed", "1234"]


def hook(records: list[dict], name: str) -> list[dict]:
    return [r for r in records if r["hook"] == name]


def saved_samples(pattern: str, rollout_id: int) -> list[dict]:
    return torch.load(pattern.format(rollout_id=rollout_id), weights_only=False)["samples"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, Path]:
    from slime.tools.demo_prompts import write_prompts

    assets = write_run_assets(tmp_path_factory.mktemp("dropin"), prompts=32)
    return {**assets, "eval": write_prompts(assets["root"] / "eval.jsonl", n=2, seed=1)}


def data_flags(assets) -> list[str]:
    return ["--hf-checkpoint", str(assets["checkpoint"]), "--prompt-data", str(assets["prompts"]),
            "--input-key", "prompt", "--label-key", "label", "--apply-chat-template"]


# ==================================================================================== run 1: every hook


@pytest.fixture(scope="module")
def hooks_run(assets) -> dict:
    root = assets["root"] / "hooks"
    root.mkdir()
    log, metrics = root / "hooks.jsonl", root / "metrics.jsonl"
    (root / "overrides.yaml").write_text(f"hook_log: {log}\nlr: 2e-4\n")
    p = lambda name: f"{PLUGINS}:{name}"  # noqa: E731
    flags = [
        *data_flags(assets), *ONE_RANK,
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--num-steps-per-rollout", "2",
        "--rollout-max-response-len", "8", "--lr", "1e-5", "--start-rollout-id", "3", "--num-rollout", "5",
        "--use-kl-loss", "--kl-loss-coef", "0.01", "--use-tis",
        "--custom-config-path", str(root / "overrides.yaml"),
        "--rollout-function-path", p("rollout"), "--custom-generate-function-path", p("generate"),
        "--rollout-sample-hook-path", p("sample_hook"), "--custom-rm-path", p("index_parity_rm"),
        "--rollout-sample-filter-path", p("sample_filter"),
        "--rollout-all-samples-process-path", p("all_samples_process"),
        "--custom-convert-samples-to-train-data-path", p("convert_samples"),
        "--custom-rollout-log-function-path", p("rollout_log"),
        "--eval-interval", "2", "--eval-prompt-data", "small", str(assets["eval"]), "--skip-eval-before-train",
        "--eval-max-response-len", "4", "--custom-eval-rollout-log-function-path", p("eval_log"),
        "--custom-megatron-init-path", p("megatron_init"), "--custom-model-provider-path", p("model_provider"),
        "--custom-megatron-before-log-prob-hook-path", p("before_log_prob"),
        "--custom-megatron-before-train-step-hook-path", p("before_train_step"),
        "--custom-advantage-function-path", p("advantages"), "--rollout-data-postprocess-path", p("data_postprocess"),
        "--custom-tis-function-path", p("tis"), "--custom-pg-loss-reducer-function-path", p("pg_reducer"),
        "--save", str(root / "ckpt"), "--save-interval", "2", "--no-save-optim",
        "--save-hf", str(root / "hf_{rollout_id}"),
        "--save-debug-rollout-data", str(root / "rollout_{rollout_id}.pt"),
        "--save-debug-train-data", str(root / "train_{rollout_id}.pt"), "--metrics-jsonl", str(metrics),
    ]
    proc, _ = run_train(flags, timeout_s=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return {"root": root, "records": hook_plugins.read_records(log), "events": read_events(metrics),
            "rollout": str(root / "rollout_{rollout_id}.pt"), "train": str(root / "train_{rollout_id}.pt")}


@pytest.mark.timeout(900)
def test_rollout_function_and_start_rollout_id(hooks_run):
    calls = [(r["rollout_id"], r["evaluation"]) for r in hook(hooks_run["records"], "rollout_function")]
    assert calls == [(3, False), (4, True), (4, False), (5, True)]  # eval after rollouts 3 (every 2) and 4 (last)
    assert [e["rollout_id"] for e in hooks_run["events"]["train"]] == [3, 4]


def test_generate_sample_hook_and_rm_hooks(hooks_run):
    generate = hook(hooks_run["records"], "generate")
    assert sum(not r["evaluation"] for r in generate) == 16 and sum(r["evaluation"] for r in generate) == 4
    assert {(r["rollout_id"], r["evaluation"]) for r in hook(hooks_run["records"], "sample_hook")} == \
        {(3, False), (4, False), (4, True), (5, True)}
    for rollout_id in (3, 4):
        for sample in saved_samples(hooks_run["rollout"], rollout_id):
            assert sample["metadata"]["generate_hook"] == "train"
            assert sample["metadata"]["sample_hook_rollout"] == rollout_id
            assert sample["reward"] == float(sample["index"] % 2)


def test_group_hooks_and_conversion(hooks_run):
    records = hooks_run["records"]
    assert [r["groups"] for r in hook(records, "sample_filter")] == [2, 2]
    assert [(r["groups"], r["has_data_source"]) for r in hook(records, "all_samples_process")] == [(2, True)] * 2
    assert [r["samples"] for r in hook(records, "convert_samples")] == [8, 8]
    for rollout_id in (3, 4):
        removed = [s["remove_sample"] for s in saved_samples(hooks_run["rollout"], rollout_id)]
        assert removed == [False, False, False, True] * 2
        masks = torch.load(hooks_run["train"].format(rollout_id=rollout_id), weights_only=False)["data"]["loss_masks"]
        assert all(sum(m) == 0 for m, gone in zip(masks, removed) if gone)  # removed samples carry no loss


def test_custom_log_functions_replace_the_default_logging(hooks_run):
    rollout_logs = hook(hooks_run["records"], "rollout_log")
    assert [r["rollout_id"] for r in rollout_logs] == [3, 4] and all(r["samples"] == 8 for r in rollout_logs)
    assert "rollout/hook_marker" in rollout_logs[0]["extra_keys"]
    # the plug-in took over rollout 3 (odd) and left rollout 4 to the default logging
    assert [e["rollout_id"] for e in hooks_run["events"]["rollout"]] == [4]
    assert hooks_run["events"]["rollout"][0]["rollout/hook_marker"] == 1.0
    evals = hook(hooks_run["records"], "eval_log")
    assert [(r["rollout_id"], r["datasets"]) for r in evals] == [(4, ["small"]), (5, ["small"])]
    assert "eval/small" in evals[0]["metric_keys"] and "eval" not in hooks_run["events"]


def test_megatron_hooks(hooks_run):
    records = hooks_run["records"]
    assert hook(records, "megatron_init")[0]["model_parallel"] is True
    assert [(r["pre_process"], r["post_process"]) for r in hook(records, "model_provider")] == [(True, True)]
    assert [r["store_prefix"] for r in hook(records, "before_log_prob")] == ["", "ref_", "", "ref_"]
    steps = hook(records, "before_train_step")
    assert [(r["rollout_id"], r["step_id"]) for r in steps] == [(3, 0), (3, 1), (4, 0), (4, 1)]
    assert all(r["lr"] == pytest.approx(2e-4) for r in steps)  # --custom-config-path overrode --lr 1e-5
    assert [e["train/lr"] for e in hooks_run["events"]["train"]] == [pytest.approx(2e-4)] * 2


def test_advantage_and_postprocess_hooks_change_what_is_trained(hooks_run):
    records = hooks_run["records"]
    assert [r["has_log_probs"] for r in hook(records, "advantages")] == [True, True]
    post = hook(records, "data_postprocess")
    assert [r["rollout_id"] for r in post] == [3, 4] and "advantages" in post[0]["keys"]
    for rollout_id, record, event in zip((3, 4), post, hooks_run["events"]["train"]):
        data = torch.load(hooks_run["train"].format(rollout_id=rollout_id), weights_only=False)["data"]
        assert all(mask[0] == 0 for mask in data["loss_masks"])  # the postprocess masked the first token
        assert event["train/loss_tokens"] == record["loss_tokens"] == sum(sum(m) for m in data["loss_masks"])
        for advantages, reward in zip(data["advantages"], data["rewards"]):
            assert advantages[0] == pytest.approx(2.0 * reward)  # doubled by the advantage plug-in


def test_tis_and_pg_reducer_plugins_shape_the_loss(hooks_run):
    records = hooks_run["records"]
    tis = hook(records, "tis")
    assert tis and all(r["sizes"] == r["response_lengths"] for r in tis)
    train = hooks_run["events"]["train"]
    assert all("train/plugin_tis_ratio" in e and "train/tis" not in e for e in train)
    assert all(math.isfinite(e["train/loss"]) and e["train/grad_norm"] > 0 for e in train)
    # train/pg_loss of the last step is the sum of the reducer's values on that step's micro-batches
    last_step = max(i for i, r in enumerate(records) if r["hook"] == "before_train_step")
    values = [r["value"] for r in records[last_step:] if r["hook"] == "pg_reducer"]
    assert values and train[-1]["train/pg_loss"] == pytest.approx(sum(values), rel=1e-6, abs=1e-9)


def test_checkpoint_without_optimizer_and_hf_export(hooks_run, assets):
    from transformers import AutoModelForCausalLM

    ckpt = hooks_run["root"] / "ckpt"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    contents = json.loads((ckpt / "iter_0000003" / "slime_contents.json").read_text())
    assert re.fullmatch(r"[0-9a-f]{16}", contents.pop("run_id"))  # the run this checkpoint belongs to
    assert contents == {"items": ["model", "scheduler", "rng"], "optimizer": False}
    exported = {r: AutoModelForCausalLM.from_pretrained(hooks_run["root"] / f"hf_{r}", torch_dtype=torch.float32)
                for r in (3, 4)}
    initial = AutoModelForCausalLM.from_pretrained(assets["checkpoint"], torch_dtype=torch.float32)
    assert (hooks_run["root"] / "hf_4" / "tokenizer_config.json").exists()
    name = "model.layers.0.self_attn.q_proj.weight"
    weights = {r: dict(m.named_parameters())[name] for r, m in exported.items()}
    start = dict(initial.named_parameters())[name]
    assert weights[3].shape == start.shape
    assert not torch.equal(weights[3], start) and not torch.equal(weights[4], weights[3])  # it trained


# ==================================================================================== run 2: dynamic sampling


@pytest.fixture(scope="module")
def sampling_run(assets) -> dict:
    root = assets["root"] / "sampling"
    root.mkdir()
    log, metrics = root / "hooks.jsonl", root / "metrics.jsonl"
    (root / "overrides.yaml").write_text(f"hook_log: {log}\n")
    p = lambda name: f"{PLUGINS}:{name}"  # noqa: E731
    flags = [
        *data_flags(assets), *ONE_RANK, "--custom-config-path", str(root / "overrides.yaml"),
        # one group of 4 in flight at a time; 4 prompts drawn per round for 2 kept groups
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--over-sampling-batch-size", "4",
        "--sglang-server-concurrency", "4", "--rollout-max-response-len", "64", "--num-rollout", "2",
        "--custom-rm-path", p("first_group_flat_rm"),
        "--dynamic-sampling-filter-path", "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std",
        "--partial-rollout", "--mask-offpolicy-in-partial-rollout", "--buffer-filter-path", p("buffer_filter"),
        "--data-source-path", p("RecordingDataSource"), "--rollout-sample-hook-path", p("slow_sample_hook"),
        "--loss-type", "custom_loss", "--custom-loss-function-path", p("custom_loss"), "--lr", "1e-4",
        "--save-debug-rollout-data", str(root / "rollout_{rollout_id}.pt"), "--metrics-jsonl", str(metrics),
    ]
    proc, _ = run_train(flags, timeout_s=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return {"records": hook_plugins.read_records(log), "events": read_events(metrics),
            "rollout": str(root / "rollout_{rollout_id}.pt")}


@pytest.mark.timeout(900)
def test_dynamic_sampling_drops_flat_groups_and_over_samples(sampling_run):
    first = saved_samples(sampling_run["rollout"], 0)
    assert sorted({s["group_index"] for s in first}) == [1, 2]  # group 0 (all rewards 0) was dropped
    rollout_0 = sampling_run["events"]["rollout"][0]
    assert rollout_0["rollout/dynamic_filter/drop_zero_std_0.0"] == 1.0
    assert rollout_0["rollout/sampling/drawn_groups"] == 4.0 and rollout_0["rollout/zero_std_group_ratio"] == 0.0
    draws = hook(sampling_run["records"], "data_source_get")
    assert [(d["rollout_id"], d["num"]) for d in draws] == [(0, 4), (1, 4)]


def test_partial_rollout_buffers_aborted_groups_and_resumes_them_masked(sampling_run):
    records = sampling_run["records"]
    assert sampling_run["events"]["rollout"][0]["rollout/partial/buffered_groups"] == 1.0
    assert [r["groups"] for r in hook(records, "data_source_add")][:1] == [1]
    buffered = hook(records, "buffer_filter")[0]
    assert buffered["rollout_id"] == 1 and buffered["num_samples"] == 4
    group = buffered["groups"][0]
    status = {s["index"]: s["status"] for s in group}
    generated_before = {s["index"]: s["response_length"] for s in group}
    # samples of the in-flight group that had started early may have finished before the abort
    assert "aborted" in status.values()
    assert any(generated_before[i] for i in status if status[i] == "aborted"), "no aborted sample had a token"
    resumed = [s for s in saved_samples(sampling_run["rollout"], 1) if s["index"] in generated_before]
    assert len(resumed) == 4 and draws_first(records, 1) == min(generated_before)  # the buffer is served first
    for sample in resumed:
        before = generated_before[sample["index"]]
        assert sample["loss_mask"][:before] == [0] * before  # an earlier policy's tokens: not trained on
        if status[sample["index"]] != "aborted":  # finished earlier: nothing new was generated
            assert sample["response_length"] == before
            continue
        assert sample["status"] in ("completed", "truncated") and sample["response_length"] > before
        assert sample["loss_mask"][before:] == [1] * (sample["response_length"] - before)
        if before:
            assert sample["metadata"]["start_rollout_id"] == 0
            assert len(set(sample["weight_versions"])) >= 2  # tokens from two weight versions


def draws_first(records, rollout_id: int) -> int:
    return next(d for d in hook(records, "data_source_get") if d["rollout_id"] == rollout_id)["first_indices"][0]


def test_custom_loss_trains(sampling_run):
    assert hook(sampling_run["records"], "custom_loss")
    train = sampling_run["events"]["train"]
    assert [e["rollout_id"] for e in train] == [0, 1]
    for event in train:
        assert event["train/loss"] == pytest.approx(event["train/plugin_nll"], rel=1e-6)
        assert event["train/loss"] > 0 and event["train/grad_norm"] > 0 and "train/pg_loss" not in event


# ==================================================================================== run 3: multi-turn example


@pytest.fixture(scope="module")
def multi_turn_run(assets) -> dict:
    out = assets["root"] / "multi_turn"
    pattern = str(out / "rollout_{rollout_id}.pt")
    run_script("multi_turn/run_multi_turn_cpu.sh", out, timeout_s=600, extra=["--save-debug-rollout-data", pattern])
    return {"out": out, "events": read_events(out / "metrics.jsonl"), "rollout": pattern}


@pytest.mark.timeout(900)
def test_multi_turn_tool_replies_are_masked_and_aligned(multi_turn_run):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(multi_turn_run["out"] / "tiny-qwen3")
    replies = 0
    for rollout_id in (0, 1):
        for sample in saved_samples(multi_turn_run["rollout"], rollout_id):
            n = sample["response_length"]
            response = sample["tokens"][len(sample["tokens"]) - n:]
            assert len(sample["loss_mask"]) == len(sample["rollout_log_probs"]) == n
            tool_positions = set()
            for reply in sample["metadata"]["tool_replies"]:
                span = range(reply["start"], reply["start"] + reply["length"])
                tool_positions |= set(span)
                text = tokenizer.decode([response[i] for i in span])
                assert f"<tool_response>\n{reply['result']}\n</tool_response>" in text
                assert all(sample["rollout_log_probs"][i] == 0.0 for i in span)
                replies += 1
            assert sample["loss_mask"] == [0 if i in tool_positions else 1 for i in range(n)]
    assert replies >= 8  # at least one tool reply per sample


def test_multi_turn_example_trains_on_model_tokens_only(multi_turn_run):
    train = multi_turn_run["events"]["train"]
    assert [e["rollout_id"] for e in train] == [0, 1]
    for event in train:
        samples = saved_samples(multi_turn_run["rollout"], event["rollout_id"])
        assert event["train/loss_tokens"] == sum(sum(s["loss_mask"]) for s in samples)
        assert math.isfinite(event["train/loss"]) and event["train/grad_norm"] > 0

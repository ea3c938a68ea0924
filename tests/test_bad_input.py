"""Bad input refused cleanly: each case ends in an error (or a counted warning) that says what to fix."""
from __future__ import annotations

import asyncio
import logging
import os
import shutil
from types import SimpleNamespace

import pytest

from rollout_testing import tokenizer_dir  # noqa: F401 (fixture)
from rollout_testing import write_jsonl
from slime.rollout import rm_hub
from slime.config import defaults_namespace
from slime.rollout.data_source import RolloutDataSource, load_tokenizer
from slime.utils.types import Sample


def _args(tokenizer_dir, prompt_path, **kw):
    base = dict(prompt_data=str(prompt_path), hf_checkpoint=tokenizer_dir, input_key="prompt", label_key="label",
                metadata_key="metadata", apply_chat_template=False, apply_chat_template_kwargs=None,
                rollout_shuffle=False, seed=1, rollout_seed=None, n_samples_per_prompt=1, rollout_max_prompt_len=None,
                rollout_max_context_len=None, save=None, load=None)
    base.update(kw)
    return defaults_namespace(**base)


def test_an_empty_prompt_file_says_what_a_line_should_hold(tokenizer_dir, tmp_path):
    for name, text in (("empty.jsonl", ""), ("blank.jsonl", "\n\n  \n")):
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=rf"--prompt-data: .*{name} is empty: expected one JSON object per "
                                             r"line with the prompt under 'prompt' \(--input-key\)"):
            RolloutDataSource(_args(tokenizer_dir, tmp_path / name))


def test_a_prompt_over_the_training_token_budget_is_skipped_with_the_flags_to_change(tokenizer_dir, tmp_path, caplog):
    rows = [{"prompt": "one two", "label": "1"}, {"prompt": " ".join(["one"] * 20), "label": "2"}]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    caplog.set_level(logging.WARNING)
    source = RolloutDataSource(_args(tokenizer_dir, path, use_dynamic_batch_size=True, max_tokens_per_gpu=4,
                                     context_parallel_size=2))
    assert len(source) == 1 and source.dataset.skipped_lines == [2]
    assert ("skipped 1 prompt(s) longer than 7 tokens, the training token budget (--max-tokens-per-gpu 4 x CP 2) "
            "less one response token (lines [2]); raise that limit") in caplog.text
    with pytest.raises(ValueError, match=r"all 1 prompts .* longer than 63 tokens, the model's context \(64\) less"):
        RolloutDataSource(_args(tokenizer_dir, write_jsonl(tmp_path / "q.jsonl", [{"prompt": " ".join(["one"] * 70),
                                                                                    "label": "1"}])))


def test_a_missing_tokenizer_file_is_named(tokenizer_dir, tmp_path):
    broken = tmp_path / "no_tokenizer"
    shutil.copytree(tokenizer_dir, broken)
    os.remove(broken / "tokenizer.json")
    with pytest.raises(FileNotFoundError, match=r"has no tokenizer: expected tokenizer.json, or tokenizer.model, "
                                                r"or vocab.json \+ merges.txt"):
        load_tokenizer(str(broken))
    (broken / "vocab.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"found \['vocab.json'\], but not the file it needs"):
        load_tokenizer(str(broken))


@pytest.mark.parametrize("rm_type, label, problem", [
    ("math", None, "no label; set --label-key"),
    ("math", {"answer": 3}, "a dict label"),
    ("deepscaler", "  ", "holds no answer"),
    ("f1", "...", "holds no words"),
    ("gpqa", "Z", "names none of the choices ABCD"),
])
def test_an_unreadable_label_earns_zero_and_a_counted_warning(rm_type, label, problem, caplog, monkeypatch):
    monkeypatch.setattr(rm_hub.UnreadableLabels, "count", 2)  # the first few are quoted in full
    sample = Sample(prompt="q", response="The answer is \\boxed{3}", label=label, index=7)
    caplog.set_level(logging.WARNING)
    reward = asyncio.run(rm_hub.async_rm(SimpleNamespace(rm_type=rm_type, custom_rm_path=None), sample))
    assert reward == 0 and rm_hub.UnreadableLabels.count == 3
    assert f"--rm-type {rm_type} cannot read the label of sample 7 (" in caplog.text and problem in caplog.text
    assert "reward 0 (3 such sample(s) so far)" in caplog.text and "--label-key" in caplog.text


def test_readable_labels_are_graded_as_before():
    args = SimpleNamespace(rm_type="math", custom_rm_path=None)
    before = rm_hub.UnreadableLabels.count
    assert asyncio.run(rm_hub.async_rm(args, Sample(response="\\boxed{3}", label="3"))) == 1
    assert asyncio.run(rm_hub.async_rm(args, Sample(response="\\boxed{3}", label=4))) == 0
    dapo = asyncio.run(rm_hub.async_rm(SimpleNamespace(rm_type="dapo", custom_rm_path=None),
                                       Sample(response="Answer: 3", label=None)))
    assert dapo["score"] == 0.0  # a dict reward keeps its keys for --reward-key
    assert rm_hub.UnreadableLabels.count == before + 1


# ---------------------------------------------------------------- the prompt file, before Ray starts

PARSE_BASE = ["--rollout-batch-size", "2", "--num-rollout", "1", "--actor-num-gpus-per-node", "1",
              "--train-backend-device", "cpu"]


@pytest.mark.parametrize("lines, flags, says", [
    (['{"input": "a"}', '{"input": "b"', '{"input": "c"}'], [], ":2: malformed JSON line"),
    (['{"input": "a"}', '["input"]'], [], ":2: expected a JSON object, got list"),
    (['{"input": "a"}', '', '{"prompt": "b"}'], [], ":3: input key 'input' missing (keys: ['prompt']); set --input-key"),
    (['{"prompt": "a", "label": 1}', '{"prompt": "b"}'], ["--input-key", "prompt", "--label-key", "label"],
     ":2: label key 'label' missing (keys: ['prompt']); set --label-key"),
])
def test_a_bad_prompt_line_is_named_by_file_and_line_at_parse_time(lines, flags, says, tmp_path, capsys):
    from arg_testing import parse_error

    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    err = parse_error([*PARSE_BASE, "--prompt-data", str(path), *flags], capsys)
    assert f"--prompt-data: {path}{says}" in err and "Traceback" not in err


def test_a_good_prompt_file_and_a_custom_data_source_pass_at_parse_time(tmp_path):
    from arg_testing import parse_quiet

    good = write_jsonl(tmp_path / "good.jsonl", [{"prompt": "a", "label": "1"}])
    parse_quiet([*PARSE_BASE, "--prompt-data", str(good), "--input-key", "prompt", "--label-key", "label"])
    odd = write_jsonl(tmp_path / "odd.jsonl", [{"question": "a"}])  # a custom data source reads its own keys
    parse_quiet([*PARSE_BASE, "--prompt-data", str(odd), "--data-source-path", "examples.counting_reward.reward"])


def test_a_bad_eval_prompt_line_is_named_with_its_dataset(tmp_path, capsys):
    from arg_testing import parse_error

    train = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "a", "label": "1"}])
    evals = write_jsonl(tmp_path / "aime.jsonl", [{"prompt": "a", "label": "1"}, {"question": "b", "label": "2"}])
    err = parse_error([*PARSE_BASE, "--prompt-data", str(train), "--input-key", "prompt", "--label-key", "label",
                       "--eval-prompt-data", "aime", str(evals)], capsys)
    assert f"--eval-prompt-data aime: {evals}:2: input key 'prompt' missing" in err

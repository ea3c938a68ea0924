"""Prompt loading, chat template, grouping, epochs, shuffling, state, and bad-input errors."""

import pytest

from rollout_testing import tokenizer_dir  # noqa: F401 (fixture)
from rollout_testing import rollout_args, write_jsonl
from slime.rollout.eval_config import EvalDatasetSpec
from slime.rollout.data_source import (
    RolloutDataSource,
    RolloutDataSourceWithBuffer,
    eval_prompt_specs,
)
from slime.utils.types import Sample

PROMPTS = [{"prompt": f"what is {i} + 1 ?", "label": str(i + 1), "metadata": {"id": i}} for i in range(1, 6)]


def make_args(tokenizer_dir, prompt_path, **kw):
    return rollout_args(tokenizer_dir, prompt_path, **{"seed": 1234, **kw})


def test_groups_have_copies_with_indices(tokenizer_dir, tmp_path):
    source = RolloutDataSource(make_args(tokenizer_dir, write_jsonl(tmp_path / "p.jsonl", PROMPTS)))
    groups = source.get_samples(2)
    assert len(groups) == 2 and all(len(g) == 2 for g in groups)
    assert [[s.group_index for s in g] for g in groups] == [[0, 0], [1, 1]]
    assert [s.index for g in groups for s in g] == [0, 1, 2, 3]
    first = groups[0][0]
    assert first.prompt == "what is 1 + 1 ?" and first.label == "2" and first.metadata == {"id": 1}
    assert first.tokens and first.status is Sample.Status.PENDING
    # copies are independent objects
    groups[0][0].tokens.append(-1)
    assert groups[0][1].tokens[-1] != -1


def test_chat_template_applied_with_generation_prompt(tokenizer_dir, tmp_path):
    rows = [{"prompt": "what is 2 + 2 ?", "label": "4"}, {"prompt": [{"role": "user", "content": "what is 1 ?"}], "label": "1"}]
    args = make_args(tokenizer_dir, write_jsonl(tmp_path / "p.jsonl", rows), apply_chat_template=True, n_samples_per_prompt=1)
    groups = RolloutDataSource(args).get_samples(2)
    assert groups[0][0].prompt == "<|im_start|> user what is 2 + 2 ? <|im_end|> <|im_start|> assistant "
    assert groups[1][0].prompt.startswith("<|im_start|> user what is 1 ?")


def test_row_tools_reach_the_chat_template(tokenizer_dir, tmp_path):
    rows = [{"prompt": "what is 1 ?", "label": "1", "tools": [{"name": "calc"}, {"name": "search"}]}]
    args = make_args(tokenizer_dir, write_jsonl(tmp_path / "p.jsonl", rows), apply_chat_template=True, tool_key="tools",
                     n_samples_per_prompt=1)
    assert RolloutDataSource(args).get_samples(1)[0][0].prompt.startswith("<tools> calc search <|im_start|> user")


def test_epochs_wrap_around_and_shuffle_is_seeded(tokenizer_dir, tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", PROMPTS)
    plain = RolloutDataSource(make_args(tokenizer_dir, path, n_samples_per_prompt=1))
    labels = [g[0].label for g in plain.get_samples(12)]
    assert labels == ["2", "3", "4", "5", "6"] * 2 + ["2", "3"]
    assert plain.epoch_id == 2

    def shuffled(seed):
        source = RolloutDataSource(make_args(tokenizer_dir, path, n_samples_per_prompt=1, rollout_shuffle=True, seed=seed))
        return [g[0].label for g in source.get_samples(10)]

    first = shuffled(7)
    assert first == shuffled(7)
    assert sorted(first[:5]) == sorted(first[5:]) == ["2", "3", "4", "5", "6"]  # each epoch is a permutation
    assert first[:5] != first[5:]  # a new order each epoch
    assert first != shuffled(8) and first[:5] != labels[:5]


def test_state_save_and_load_resumes_position(tokenizer_dir, tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", PROMPTS)
    ckpt = tmp_path / "ckpt"
    source = RolloutDataSource(make_args(tokenizer_dir, path, save=str(ckpt), rollout_shuffle=True))
    source.get_samples(4)
    source.save(rollout_id=3)
    expected = source.get_samples(3)
    resumed = RolloutDataSource(make_args(tokenizer_dir, path, load=str(ckpt), rollout_shuffle=True))
    resumed.load(rollout_id=3)
    got = resumed.get_samples(3)
    assert [(s.label, s.index, s.group_index) for g in got for s in g] == [
        (s.label, s.index, s.group_index) for g in expected for s in g
    ]


def test_a_resume_warns_only_of_what_the_saved_state_lacks(tokenizer_dir, tmp_path, caplog):
    from slime.checkpoint.contents import DATA_ITEMS

    source = RolloutDataSource(make_args(tokenizer_dir, write_jsonl(tmp_path / "p.jsonl", PROMPTS)))
    source.get_samples(2)
    state = source.state_dict()
    assert sorted(state) == sorted([*DATA_ITEMS, "metadata"])
    source.load_state_dict(state)
    assert "data-source state has no" not in caplog.text
    source.load_state_dict({k: v for k, v in state.items() if k not in ("outstanding", "rng")})
    assert "data-source state has no ['outstanding', 'rng']" in caplog.text


def test_missing_state_file_is_an_error_naming_the_file_and_the_flag(tokenizer_dir, tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", PROMPTS)
    source = RolloutDataSource(make_args(tokenizer_dir, path, load=str(tmp_path)))
    with pytest.raises(FileNotFoundError, match=r"global_dataset_state_dict_9\.pt.*--allow-fresh-data-position"):
        source.load(rollout_id=9)
    fresh = RolloutDataSource(make_args(tokenizer_dir, path, load=str(tmp_path), allow_fresh_data_position=True))
    fresh.load(rollout_id=9)
    assert fresh.sample_index == 0 and fresh.get_samples(1)[0][0].label == "2"


def test_state_holds_the_buffer_the_shuffle_order_and_the_rng(tokenizer_dir, tmp_path):
    """A resumed source serves the buffered groups, then the same prompts, and draws the same random numbers."""
    import random

    import numpy
    import torch

    path = write_jsonl(tmp_path / "p.jsonl", PROMPTS)
    ckpt = tmp_path / "ckpt"
    source = RolloutDataSourceWithBuffer(make_args(tokenizer_dir, path, save=str(ckpt), rollout_shuffle=True))
    aborted = source.get_samples(3)[1]
    aborted[0].tokens, aborted[0].status = aborted[0].tokens + [7, 8], Sample.Status.ABORTED
    source.add_samples([aborted])
    source.save(rollout_id=0)
    expected_rng = (random.random(), float(numpy.random.rand()), float(torch.rand(1)))
    expected = source.get_samples(4)
    random.seed(0), numpy.random.seed(0), torch.manual_seed(0)  # what a fresh process would hold

    resumed = RolloutDataSourceWithBuffer(make_args(tokenizer_dir, path, load=str(ckpt), rollout_shuffle=True))
    resumed.load(rollout_id=0)
    assert (random.random(), float(numpy.random.rand()), float(torch.rand(1))) == expected_rng
    got = resumed.get_samples(4)
    assert [s.to_dict() for g in got for s in g] == [s.to_dict() for g in expected for s in g]
    assert got[0][0].status is Sample.Status.ABORTED and got[0][0].tokens[-2:] == [7, 8]
    saved = torch.load(RolloutDataSource.state_path(str(ckpt), 0), weights_only=True)
    assert sorted(saved["epoch_order"]) == list(range(len(PROMPTS))) and len(saved["buffer"]) == 1


def test_state_for_another_prompt_file_is_refused(tokenizer_dir, tmp_path):
    ckpt = tmp_path / "ckpt"
    source = RolloutDataSource(make_args(tokenizer_dir, write_jsonl(tmp_path / "p.jsonl", PROMPTS), save=str(ckpt)))
    source.get_samples(1)
    source.save(rollout_id=2)
    shorter = RolloutDataSource(make_args(tokenizer_dir, write_jsonl(tmp_path / "q.jsonl", PROMPTS[:3]), load=str(ckpt)))
    with pytest.raises(ValueError, match="3 usable prompts.*saved data position is for 5"):
        shorter.load(rollout_id=2)


def test_buffer_groups_served_first(tokenizer_dir, tmp_path):
    source = RolloutDataSourceWithBuffer(make_args(tokenizer_dir, write_jsonl(tmp_path / "p.jsonl", PROMPTS)))
    returned = [Sample(label="buffered"), Sample(label="buffered")]
    source.add_samples([returned])
    groups = source.get_samples(2)
    assert groups[0] is returned and groups[1][0].label == "2"
    with pytest.raises(ValueError, match="n-samples-per-prompt"):
        source.add_samples([[Sample()]])


def test_missing_file_names_flag_and_path(tokenizer_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="--prompt-data.*nope.jsonl"):
        RolloutDataSource(make_args(tokenizer_dir, tmp_path / "nope.jsonl"))


def test_malformed_line_names_file_and_line(tokenizer_dir, tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [PROMPTS[0], "", '{"prompt": "x", '])
    with pytest.raises(ValueError, match=r"bad.jsonl:3: malformed JSON"):
        RolloutDataSource(make_args(tokenizer_dir, path))


def test_missing_input_key_names_key_and_line(tokenizer_dir, tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [PROMPTS[0], {"question": "q", "label": "1"}])
    with pytest.raises(ValueError, match=r"p.jsonl:2: input key 'prompt' missing.*--input-key"):
        RolloutDataSource(make_args(tokenizer_dir, path))


def test_missing_label_key_is_an_error(tokenizer_dir, tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "what"}])
    with pytest.raises(ValueError, match=r"p.jsonl:1: label key 'label' missing"):
        RolloutDataSource(make_args(tokenizer_dir, path))
    # without --label-key the label is simply None
    source = RolloutDataSource(make_args(tokenizer_dir, path, label_key=None, n_samples_per_prompt=1))
    assert source.get_samples(1)[0][0].label is None


def test_message_list_without_chat_template_stays_messages(tokenizer_dir, tmp_path):
    # upstream keeps the chat as the prompt (SFT renders it turn by turn; generation refuses it: test_sft.py)
    messages = [{"role": "user", "content": "hi"}]
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": messages, "label": "1", "tools": [{"name": "f"}]}])
    sample = RolloutDataSource(make_args(tokenizer_dir, path)).get_samples(1)[0][0]
    assert sample.prompt == messages and sample.tokens == [] and sample.metadata["tools"] == [{"name": "f"}]
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": 7, "label": "1"}])
    with pytest.raises(ValueError, match="expected text or chat messages"):
        RolloutDataSource(make_args(tokenizer_dir, bad))


def test_overlong_prompts_are_skipped_and_counted(tokenizer_dir, tmp_path, caplog):
    rows = PROMPTS[:2] + [{"prompt": " ".join(["one"] * 30), "label": "x"}]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    source = RolloutDataSource(make_args(tokenizer_dir, path, rollout_max_prompt_len=10, n_samples_per_prompt=1))
    assert len(source) == 2 and source.dataset.num_skipped == 1 and source.dataset.skipped_lines == [3]
    assert "skipped 1 prompt(s) longer than 10 tokens" in caplog.text
    # without --rollout-max-prompt-len the model context (64 here) minus one is the budget
    long_rows = PROMPTS[:1] + [{"prompt": " ".join(["one"] * 64), "label": "x"}]
    source = RolloutDataSource(make_args(tokenizer_dir, write_jsonl(tmp_path / "q.jsonl", long_rows)))
    assert len(source) == 1 and source.dataset.num_skipped == 1


def test_all_prompts_too_long_is_an_error(tokenizer_dir, tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", PROMPTS)
    with pytest.raises(ValueError, match=r"all 5 prompts .* longer than 2 tokens, --rollout-max-prompt-len; raise"):
        RolloutDataSource(make_args(tokenizer_dir, path, rollout_max_prompt_len=2))


def test_eval_prompt_specs_pairs(tokenizer_dir, tmp_path):
    datasets = (EvalDatasetSpec("aime", "/a.jsonl"), EvalDatasetSpec("gsm", "/g.jsonl"))  # as parse_args resolves
    args = make_args(tokenizer_dir, tmp_path / "p.jsonl", eval_datasets=datasets, eval_input_key=None,
                     eval_label_key="answer")
    specs = eval_prompt_specs(args)
    assert list(specs) == ["aime", "gsm"]
    assert specs["gsm"].path == "/g.jsonl" and specs["gsm"].label_key == "answer" and specs["gsm"].input_key == "prompt"

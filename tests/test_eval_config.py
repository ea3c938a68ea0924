"""--eval-config: upstream's multi-task eval YAML (per-dataset keys, sampling, rm_type), next to --eval-prompt-data."""
from __future__ import annotations

import asyncio
import json

import pytest

from arg_testing import no_real_sglang, parse_error, parse_quiet  # noqa: F401 (fixture)
from rollout_testing import write_jsonl, write_tokenizer
from slime.rollout.eval_config import EvalDatasetSpec, parse_eval_config

MINIMAL = ["--rollout-batch-size", "2", "--num-rollout", "1", "--actor-num-gpus-per-node", "1",
           "--train-backend-device", "cpu"]


def test_config_forms_defaults_and_upstream_field_names():
    both = parse_eval_config({"eval": {
        "defaults": {"n_samples_per_eval_prompt": 4, "temperature": 0.6},
        "datasets": [{"name": "aime", "path": "/a.jsonl", "rm_type": "deepscaler", "temperature": 1.0},
                     {"name": "gpqa", "path": "/g.jsonl", "prompt_key": "question", "stop": "END"}]}}, "cfg.yaml")
    assert both[0] == EvalDatasetSpec("aime", "/a.jsonl", rm_type="deepscaler", n_samples_per_eval_prompt=4,
                                      temperature=1.0)  # the entry wins over the defaults
    assert both[1].input_key == "question" and both[1].stop == ("END",) and both[1].temperature == 0.6
    # the root may be the eval mapping itself, and datasets a mapping name -> entry
    (only,) = parse_eval_config({"datasets": {"math": {"path": "/m.jsonl", "max_response_len": 64}}}, "cfg.yaml")
    assert only.name == "math" and only.sampling_overrides() == {"max_new_tokens": 64}
    assert only.sample_metadata({"k": 1}) == {"k": 1}
    assert both[0].sample_metadata({"rm_type": "math", "k": 1}) == {"rm_type": "deepscaler", "k": 1}


@pytest.mark.parametrize("config, message", [
    ([], "expected a mapping"),
    ({"eval": {"datasets": []}}, "no datasets"),
    ({"datasets": [{"path": "/x"}]}, "needs a `name`"),
    ({"datasets": {"x": {}}}, "has no `path`"),
    ({"datasets": {"x": {"path": "/x", "temprature": 1}}}, "unknown fields \\['temprature'\\]"),
    ({"datasets": [{"name": "x", "path": "/a"}, {"name": "x", "path": "/b"}]}, "names repeat"),
])
def test_bad_configs_are_refused_with_the_fix(config, message):
    with pytest.raises(ValueError, match=message):
        parse_eval_config(config, "cfg.yaml")


def test_eval_config_replaces_eval_prompt_data(tmp_path, capsys):
    data = write_jsonl(tmp_path / "a.jsonl", [{"input": "q", "label": "1"}])
    cfg = tmp_path / "eval.json"  # JSON is accepted as YAML
    cfg.write_text(json.dumps({"eval": {"datasets": [{"name": "a", "path": str(data), "rm_type": "math"}]}}))
    args = parse_quiet(MINIMAL + ["--eval-config", str(cfg), "--eval-interval", "1"])
    assert [d.name for d in args.eval_datasets] == ["a"] and args.eval_prompt_data == ["a", str(data)]
    assert args.eval_datasets[0].rm_type == "math"
    missing = tmp_path / "bad.yaml"
    missing.write_text("eval:\n  datasets:\n    - {name: a, path: /no/such.jsonl}\n")
    assert "--eval-config a: file '/no/such.jsonl' does not exist" in parse_error(
        MINIMAL + ["--eval-config", str(missing)], capsys)
    assert "does not exist" in parse_error(MINIMAL + ["--eval-config", str(tmp_path / "nope.yaml")], capsys)


def test_eval_rollout_uses_each_datasets_own_settings(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from slime.config import defaults_namespace
    from slime.rollout import sglang_rollout

    tok = str(write_tokenizer(tmp_path / "tok", max_position_embeddings=64))
    a = write_jsonl(tmp_path / "a.jsonl", [{"input": "what is 1", "label": "1"}, {"input": "what is 2", "label": "2"}])
    g = write_jsonl(tmp_path / "g.jsonl", [{"question": "pick", "answer": "B"}])
    datasets = (EvalDatasetSpec("a", str(a), rm_type="math", temperature=0.3),
                EvalDatasetSpec("g", str(g), rm_type="gpqa", input_key="question", label_key="answer",
                                n_samples_per_eval_prompt=3, max_response_len=7))
    # top_p/top_k None: the sampling params these args always gave (the parser's defaults would add them)
    args = defaults_namespace(hf_checkpoint=tok, eval_datasets=datasets, eval_config="cfg.yaml", input_key="input",
                              label_key="label", n_samples_per_eval_prompt=2, rollout_temperature=1.0,
                              rollout_max_response_len=16, eval_reward_key=None, reward_key=None,
                              metadata_key="metadata", tool_key="tools", apply_chat_template=False,
                              apply_chat_template_kwargs=None, rollout_max_context_len=None,
                              rollout_max_prompt_len=None, rollout_top_p=None, rollout_top_k=None)
    seen = {}

    async def fake_generate_groups(args, groups, params, desc, evaluation=False):
        name = desc.split()[1]
        seen[name] = (params, [[s.metadata.get("rm_type") for s in grp] for grp in groups],
                      [grp[0].label for grp in groups])
        for grp in groups:
            for s in grp:
                s.reward = 1.0
        return groups

    monkeypatch.setattr(sglang_rollout, "generate_groups", fake_generate_groups)
    monkeypatch.setattr(sglang_rollout, "GenerateState", lambda args: SimpleNamespace(reset=lambda rollout_id: None))
    output = asyncio.run(sglang_rollout.eval_rollout(args, 0))
    assert seen["a"][0]["temperature"] == 0.3 and seen["a"][0]["max_new_tokens"] == 16
    assert seen["a"][1] == [["math"] * 2] * 2  # the default 2 samples per prompt
    assert seen["g"][0]["temperature"] == 1.0 and seen["g"][0]["max_new_tokens"] == 7
    assert seen["g"][1] == [["gpqa"] * 3] and seen["g"][2] == ["B"]  # its own keys
    assert set(output.data) == {"a", "g"} and len(output.data["g"]["samples"]) == 3

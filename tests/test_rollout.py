"""generate / generate_rollout against a fake SGLang /generate server; rewards, metrics, train data."""
import sys
import textwrap
from types import SimpleNamespace

import pytest

from rollout_testing import engine, fresh_generate_state, tokenizer_dir  # noqa: F401 (fixtures)
from rollout_testing import FakeEngine, rollout_args, write_jsonl
from slime.config import defaults_namespace
from slime.algorithms.rewards import group_normalize
from slime.rollout.train_data import samples_to_train_data
from slime.rollout.base_types import RolloutFnEvalOutput, RolloutFnTrainOutput, call_rollout_fn
from slime.rollout.data_source import RolloutDataSource, load_tokenizer
from slime.rollout.eval_config import EvalDatasetSpec
from slime.rollout.metrics import compute_rollout_metrics, pass_at_k
from slime.rollout.sglang_rollout import GenerateState, generate, generate_rollout, run, sampling_params
from slime.utils.misc import SingletonMeta
from slime.utils.ports import find_free_port
from slime.utils.types import Sample

pytestmark = pytest.mark.timeout(120)

PROMPTS = [{"prompt": "what is 3 + 4 ?", "label": "7"}, {"prompt": "what is 1 + 1 ?", "label": "2"},
           {"prompt": "what is 2 + 5 ?", "label": "7"}]




def make_args(tokenizer_dir, prompt_path, port, **kw):
    return rollout_args(tokenizer_dir, prompt_path, port, **{"seed": 1, "rollout_batch_size": 3, "rm_type": "math", **kw})


def test_generate_fills_response_fields_and_sends_sglang_payload(tokenizer_dir, tmp_path, engine):
    args = make_args(tokenizer_dir, tmp_path / "unused", engine.port, rollout_stop=["</s>"])
    sample = Sample(prompt="what is 3 + 4 ?", index=0)
    sample = run(generate(args, sample, sampling_params(args)))
    prompt_ids = engine.requests[0]["input_ids"]
    assert len(prompt_ids) == 6  # six whitespace-separated words
    assert sample.tokens == prompt_ids + [5, 6, 7, 8]
    assert sample.response == "the answer is 7" and sample.response_length == 4
    assert sample.loss_mask == [1, 1, 1, 1]
    assert sample.rollout_log_probs == [-0.25, -0.5, -0.75, -1.0]
    assert sample.status is Sample.Status.COMPLETED and sample.weight_versions == ["3"]
    sent = engine.requests[0]
    assert sent["return_logprob"] is True
    assert sent["sampling_params"] == {
        "temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 16, "stop": ["</s>"],
        "skip_special_tokens": False, "no_stop_trim": True,
    }


def test_length_limit_marks_truncated(tokenizer_dir, tmp_path, engine):
    args = make_args(tokenizer_dir, tmp_path, engine.port, rollout_max_response_len=2)
    sample = run(generate(args, Sample(prompt="what is 1 ?"), sampling_params(args)))
    assert sample.status is Sample.Status.TRUNCATED and sample.response_length == 2 and len(sample.rollout_log_probs) == 2


def test_an_abort_after_the_last_allowed_token_leaves_a_truncated_sample(tokenizer_dir, tmp_path, engine):
    """--partial-rollout buffers aborted samples to resume them; one whose abort came with its whole budget
    generated has nothing left to resume, so it is truncated, as if the length had ended it."""
    import threading
    import time

    def abort_once_in_flight() -> None:  # as /abort_request would, once the request waits in the engine
        deadline = time.monotonic() + 30
        while engine._inflight == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        engine.abort_calls += 1

    args = make_args(tokenizer_dir, tmp_path, engine.port, rollout_max_response_len=2)
    engine.delay_s = 30.0
    for aborted_tokens, status in ((2, Sample.Status.TRUNCATED), (1, Sample.Status.ABORTED)):
        engine.aborted_tokens = aborted_tokens
        threading.Thread(target=abort_once_in_flight, daemon=True).start()
        sample = run(generate(args, Sample(prompt="what is 1 ?"), sampling_params(args)))
        assert sample.response_length == aborted_tokens and sample.status is status


def test_context_limit_clamps_or_skips_the_request(tokenizer_dir, tmp_path, engine):
    args = make_args(tokenizer_dir, tmp_path, engine.port, rollout_max_context_len=4)
    sample = run(generate(args, Sample(tokens=[1, 2, 3]), sampling_params(args)))
    assert engine.requests[-1]["sampling_params"]["max_new_tokens"] == 1
    assert sample.response_length == 1 and sample.status is Sample.Status.TRUNCATED
    full = Sample(tokens=[1, 2, 3, 4])
    count = len(engine.requests)
    assert run(generate(args, full, sampling_params(args))).status is Sample.Status.TRUNCATED
    assert len(engine.requests) == count and full.response_length == 0


def test_generate_rollout_rewards_groups_and_builds_train_data(tokenizer_dir, tmp_path, engine):
    args = make_args(tokenizer_dir, write_jsonl(tmp_path / "p.jsonl", PROMPTS), engine.port)
    output = call_rollout_fn(generate_rollout, args, 0, RolloutDataSource(args), evaluation=False)
    assert isinstance(output, RolloutFnTrainOutput) and len(output.samples) == 3
    assert [[s.reward for s in g] for g in output.samples] == [[1, 1], [0, 0], [1, 1]]
    assert len(engine.requests) == 6
    assert output.metrics["rollout/raw_reward"] == pytest.approx(2 / 3)
    assert output.metrics["rollout/pass@1"] == pytest.approx(2 / 3)
    assert output.metrics["rollout/response_len/mean"] == 4.0
    assert output.metrics["rollout/truncated_ratio"] == 0.0
    assert output.metrics["rollout/zero_std_group_ratio"] == 1.0

    data = samples_to_train_data(args, output.samples)
    assert sorted(data) == ["loss_masks", "raw_reward", "response_lengths", "rewards", "rollout_log_probs",
                            "sample_indices", "tokens", "truncated"]
    assert all(len(v) == 6 for v in data.values())
    assert data["sample_indices"] == [0, 1, 2, 3, 4, 5]
    assert data["raw_reward"] == [1.0, 1.0, 0.0, 0.0, 1.0, 1.0]
    assert data["rewards"] == [0.0] * 6  # identical rewards in each group -> no GRPO signal
    assert data["response_lengths"] == [4] * 6 and data["loss_masks"][0] == [1, 1, 1, 1]
    assert all(t[-4:] == [5, 6, 7, 8] for t in data["tokens"])


@pytest.fixture
def hooks_module(tmp_path, monkeypatch):
    (tmp_path / "my_hooks_f.py").write_text(textwrap.dedent("""
        from slime.rollout.sglang_rollout import GenerateState, generate

        async def generate_twice(args, sample, sampling_params):
            state = GenerateState(args)  # upstream plugins read the tokenizer from here
            sample = await generate(args, sample, sampling_params)
            sample.metadata["custom"] = state.tokenizer.decode(sample.tokens[:2])
            return sample

        async def rank_rm(args, samples):
            return [float(s.index % 2) for s in samples]
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_hooks_f"
    sys.modules.pop("my_hooks_f", None)
    SingletonMeta.reset(GenerateState)


def test_custom_generate_and_group_rm_hooks(tokenizer_dir, tmp_path, engine, hooks_module):
    args = make_args(tokenizer_dir, write_jsonl(tmp_path / "p.jsonl", PROMPTS), engine.port,
                     custom_generate_function_path=f"{hooks_module}.generate_twice",
                     custom_rm_path=f"{hooks_module}.rank_rm", group_rm=True, rollout_batch_size=2)
    output = generate_rollout(args, 0, RolloutDataSource(args))
    samples = [s for g in output.samples for s in g]
    assert all(s.metadata["custom"] == "what is" for s in samples)
    assert [s.reward for s in samples] == [0.0, 1.0, 0.0, 1.0]
    data = samples_to_train_data(args, output.samples)
    assert data["rewards"] == pytest.approx([-0.70710, 0.70710] * 2, abs=1e-4)


def test_concurrency_is_bounded(tokenizer_dir, tmp_path):
    fake = FakeEngine(delay_s=0.2).start()
    try:
        args = make_args(tokenizer_dir, write_jsonl(tmp_path / "p.jsonl", PROMPTS), fake.port,
                         sglang_server_concurrency=2, n_samples_per_prompt=3)
        generate_rollout(args, 0, RolloutDataSource(args))
        assert len(fake.requests) == 9 and fake.max_inflight == 2
    finally:
        fake.stop()


def test_request_timeout_and_dead_engine_fail_with_the_url(tokenizer_dir, tmp_path):
    fake = FakeEngine(delay_s=1.0).start()
    try:
        args = make_args(tokenizer_dir, tmp_path, fake.port, sglang_router_request_timeout_secs=0.2)
        with pytest.raises(TimeoutError, match=f"127.0.0.1:{fake.port}/generate: no reply within"):
            run(generate(args, Sample(prompt="what"), sampling_params(args)))
    finally:
        fake.stop()
    dead = make_args(tokenizer_dir, tmp_path, find_free_port())
    with pytest.raises(ConnectionError, match="cannot connect"):
        run(generate(dead, Sample(prompt="what"), sampling_params(dead)))


def test_eval_rollout_per_dataset(tokenizer_dir, tmp_path, engine):
    easy = write_jsonl(tmp_path / "easy.jsonl", [{"prompt": "what is 3 + 4 ?", "label": "7"}])
    hard = write_jsonl(tmp_path / "hard.jsonl", PROMPTS[1:])
    datasets = (EvalDatasetSpec("easy", str(easy)), EvalDatasetSpec("hard", str(hard)))  # as parse_args resolves
    args = make_args(tokenizer_dir, easy, engine.port, eval_datasets=datasets, n_samples_per_eval_prompt=2,
                     eval_max_response_len=None, eval_top_p=0.5, eval_temperature=None, eval_top_k=None,
                     eval_input_key=None, eval_label_key=None, eval_reward_key=None)
    output = call_rollout_fn(generate_rollout, args, 5, None, evaluation=True)
    assert isinstance(output, RolloutFnEvalOutput)
    assert output.data["easy"]["rewards"] == [1.0, 1.0] and output.data["hard"]["rewards"] == [0.0, 0.0, 1.0, 1.0]
    assert output.metrics["eval/easy"] == 1.0 and output.metrics["eval/hard"] == 0.5
    assert output.metrics["eval/hard/pass@2"] == 0.5
    assert {r["sampling_params"]["top_p"] for r in engine.requests} == {0.5}
    args.eval_max_response_len = 1
    truncated = generate_rollout(args, 6, None, evaluation=True)
    assert all(truncated.data["hard"]["truncated"]) and truncated.metrics["eval/hard/truncated_ratio"] == 1.0


def test_group_normalize_hand_values():
    rewards = group_normalize([1, 0, 0, 1, 3, 3], [0, 0, 0, 0, 1, 1], divide_by_std=True)
    scaled = 0.5 / ((4 * 0.25 / 3) ** 0.5 + 1e-6)  # unbiased std of [1, 0, 0, 1]
    assert rewards[:4] == pytest.approx([scaled, -scaled, -scaled, scaled])
    assert rewards[4:] == [0.0, 0.0]
    assert group_normalize([1, 0, 4, 2], [0, 0, 1, 1], divide_by_std=False) == [0.5, -0.5, 1.0, -1.0]


def _rewarded(rewards, n):
    return [Sample(index=i, group_index=i // n, tokens=[1, 2, 3], response_length=2, reward=r,
                   status=Sample.Status.TRUNCATED if i == 0 else Sample.Status.COMPLETED) for i, r in enumerate(rewards)]


def test_train_data_estimators_and_masks():
    samples = _rewarded([1.0, 0.0, 0.0, 0.0], 2)
    samples[1].remove_sample = True
    samples[2].loss_mask = [0, 1]
    args = defaults_namespace(reward_key=None, advantage_estimator="reinforce_plus_plus_baseline",
                              n_samples_per_prompt=2, rewards_normalization=True, grpo_std_normalization=True)
    data = samples_to_train_data(args, samples)
    assert data["rewards"] == [0.5, -0.5, 0.0, 0.0]  # mean-centred only
    assert data["loss_masks"] == [[1, 1], [0, 0], [0, 1], [1, 1]]
    assert data["truncated"] == [1, 0, 0, 0] and "rollout_log_probs" not in data
    args.advantage_estimator = "ppo"
    assert samples_to_train_data(args, samples)["rewards"] == [1.0, 0.0, 0.0, 0.0]
    samples[3].loss_mask = [1]
    with pytest.raises(ValueError, match="sample 3: loss_mask has 1 entries"):
        samples_to_train_data(args, samples)


def test_pass_at_k_values():
    assert pass_at_k(4, 1, 1) == 0.25
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 3, 2) == 1.0
    metrics = compute_rollout_metrics(SimpleNamespace(reward_key=None), _rewarded([1, 0, 0, 0], 2))
    assert metrics["rollout/pass@1"] == 0.25 and metrics["rollout/pass@2"] == 0.5
    assert metrics["rollout/truncated_ratio"] == 0.25 and metrics["rollout/zero_std_group_ratio"] == 0.5


@pytest.fixture(scope="module")
def embedded_engine(tmp_path_factory):
    """The embedded engine (tiny Qwen3 + real Qwen tokenizer) served in-process."""
    from rollout_testing import AppThread
    from slime.backends.embedded_engine.engine import EmbeddedEngine
    from slime.backends.embedded_engine.server import build_app
    from slime.tools.tiny_checkpoint import write_tiny_checkpoint
    from slime.utils.security import current_key

    model_dir = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))
    server = AppThread(build_app(EmbeddedEngine(str(model_dir), dtype="float32", seed=0), api_key=current_key())).start()
    yield str(model_dir), server.port
    server.stop()


@pytest.mark.timeout(300)
def test_rollout_against_embedded_engine(embedded_engine, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from slime.tools.demo_prompts import write_prompts

    model_dir, port = embedded_engine
    prompts = write_prompts(tmp_path / "demo.jsonl", n=4)
    args = make_args(model_dir, prompts, port, apply_chat_template=True, rollout_batch_size=2, n_samples_per_prompt=2,
                     rollout_max_response_len=6)
    output = generate_rollout(args, 0, RolloutDataSource(args))
    samples = [s for g in output.samples for s in g]
    assert len(samples) == 4 and all(s.reward in (0, 1) for s in samples)
    for sample in samples:
        assert 1 <= sample.response_length <= 6 and sample.weight_versions
        assert sample.status in (Sample.Status.COMPLETED, Sample.Status.TRUNCATED)
        prompt_ids = load_tokenizer(model_dir)(sample.prompt, add_special_tokens=False)["input_ids"]
        assert sample.tokens == prompt_ids + sample.tokens[len(prompt_ids):]
        assert len(sample.tokens) == len(prompt_ids) + sample.response_length
        assert sample.prompt.endswith("<|im_start|>assistant\n")
    data = samples_to_train_data(args, output.samples)
    assert [len(m) for m in data["loss_masks"]] == data["response_lengths"]
    # the engine's log-probs are those of the sampled tokens under the served weights (temperature 1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    for tokens, n, logps in zip(data["tokens"], data["response_lengths"], data["rollout_log_probs"]):
        with torch.no_grad():
            logits = model(torch.tensor([tokens])).logits[0].log_softmax(-1)
        expected = [logits[pos - 1, tokens[pos]].item() for pos in range(len(tokens) - n, len(tokens))]
        assert logps == pytest.approx(expected, abs=1e-3)


def test_failed_request_cancels_the_rest_of_the_rollout(tokenizer_dir, tmp_path):
    fake = FakeEngine(delay_s=0.5).start()
    try:
        args = make_args(tokenizer_dir, write_jsonl(tmp_path / "p.jsonl", PROMPTS), fake.port, rm_type="nope",
                         sglang_server_concurrency=1, n_samples_per_prompt=2)
        with pytest.raises(NotImplementedError, match="'nope'"):
            generate_rollout(args, 0, RolloutDataSource(args))
        import time

        time.sleep(1.0)
        # 6 samples, one at a time: the failure on the first cancels the queued ones (one may be in flight)
        assert 1 <= len(fake.requests) <= 2
    finally:
        fake.stop()

"""SFT as upstream runs it: conversations -> tokens + loss masks from the tokenizer's chat template
(slime.utils.mask_utils), the rollout function slime.rollout.sft_rollout.generate_rollout, and
`python train.py ... --loss-type sft_loss` driving the loss down on the demo's tiny model (CPU)."""
from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from slime.config import defaults_namespace
from slime.rollout.data_source import RolloutDataSource
from slime.rollout.sft_rollout import generate_rollout
from slime.utils.mask_utils import MultiTurnLossMaskGenerator

pytestmark = pytest.mark.e2e

CONVERSATION = [
    {"role": "system", "content": "count on"},
    {"role": "user", "content": "345"},
    {"role": "assistant", "content": "678"},
    {"role": "user", "content": "12"},
    {"role": "assistant", "content": "345"},
]
# a character-level chat template over the demo alphabet: U/A/S mark the roles, '|' ends a turn
CHAR_CHAT_TEMPLATE = (
    "{%- for m in messages -%}{{- {'user': 'U', 'assistant': 'A', 'system': 'S'}[m['role']] + m['content'] + '|' -}}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{- 'A' -}}{%- endif -%}"
)
ALPHABET = "0123456789UAS|"


@pytest.fixture(scope="module")
def qwen_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from slime.tools.qwen_tokenizer_files import save_hf_tokenizer

    out = tmp_path_factory.mktemp("qwen-tok")
    save_hf_tokenizer(out, model_max_length=4096)
    return AutoTokenizer.from_pretrained(str(out))


def test_qwen_template_masks_only_the_assistant_turns(qwen_tokenizer):
    generator = MultiTurnLossMaskGenerator(qwen_tokenizer)
    tokens, mask = generator.get_loss_mask(CONVERSATION)
    assert len(tokens) == len(mask)
    # the tokens are exactly the template's rendering of the whole conversation
    full = qwen_tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert qwen_tokenizer.decode(tokens) == full
    trained = qwen_tokenizer.decode([t for t, m in zip(tokens, mask) if m])
    assert trained == "678<|im_end|>\n345<|im_end|>\n"  # each answer with its end of turn; no header, no user text
    (response_length,) = generator.get_response_lengths([mask])
    assert mask[-response_length] == 1 and 1 not in mask[:-response_length]


def test_char_template_masks_and_bad_conversations_are_refused(tmp_path):
    tokenizer = _char_tokenizer(tmp_path)
    generator = MultiTurnLossMaskGenerator(tokenizer)
    tokens, mask = generator.get_loss_mask(CONVERSATION[1:3])
    assert tokenizer.decode(tokens) == "U345|A678|"
    assert mask == [0] * 6 + [1] * 4
    with pytest.raises(ValueError, match="no assistant message"):
        generator.get_response_lengths([generator.get_loss_mask(CONVERSATION[:2])[1]])
    with pytest.raises(ValueError, match="do not pass\n?.*--apply-chat-template|--apply-chat-template"):
        generator.get_loss_mask("U345|A")
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="chat template"):
        MultiTurnLossMaskGenerator(tokenizer)


def test_template_that_rewrites_earlier_turns_is_refused(tmp_path):
    tokenizer = _char_tokenizer(tmp_path)
    # drops every assistant turn but the last: the rendering of a prefix is not the start of the whole
    tokenizer.chat_template = ("{%- for m in messages -%}{%- if m['role'] != 'assistant' or loop.last -%}"
                               "{{- m['content'] + '|' -}}{%- endif -%}{%- endfor -%}")
    with pytest.raises(ValueError, match="rewrites earlier turns"):
        MultiTurnLossMaskGenerator(tokenizer).get_loss_mask(CONVERSATION)


def test_sft_rollout_turns_the_data_sources_conversations_into_trainable_samples(tmp_path):
    model = _char_model(tmp_path)
    data = _write_conversations(tmp_path / "sft.jsonl", n=5)
    args = _args(model, data)
    output = generate_rollout(args, 0, RolloutDataSource(args))
    groups = output.samples
    assert len(groups) == 3 and all(len(g) == 1 for g in groups)
    sample = groups[0][0]
    assert sample.reward == 0.0 and sample.status.value == "completed"
    assert len(sample.loss_mask) == sample.response_length <= len(sample.tokens)
    assert sample.loss_mask[0] == 1 and sample.response == sample.prompt[1]["content"] + "|"
    from slime.rollout.train_data import samples_to_train_data

    train = samples_to_train_data(args, groups)
    assert train["loss_masks"][0] == sample.loss_mask and train["rewards"] == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="--n-samples-per-prompt 1"):
        generate_rollout(SimpleNamespace(**{**vars(args), "n_samples_per_prompt": 2}), 0, RolloutDataSource(args))
    with pytest.raises(ValueError, match="no eval mode"):
        generate_rollout(args, 0, RolloutDataSource(args), evaluation=True)


def test_chat_prompts_without_a_template_stay_messages_and_generation_refuses_them(tmp_path):
    import asyncio

    from slime.rollout.sglang_rollout import generate
    from slime.utils.types import Sample

    model = _char_model(tmp_path)
    args = _args(model, _write_conversations(tmp_path / "sft.jsonl", n=2))
    (sample,) = RolloutDataSource(args).get_samples(1)[0]
    assert sample.prompt == _conversation(0) and sample.tokens == []
    with pytest.raises(ValueError, match="pass --apply-chat-template"):
        asyncio.run(generate(args, Sample(index=0, prompt=sample.prompt), {}))


# ------------------------------------------------------------------ helpers (also the e2e test's)

def _char_tokenizer(tmp_path: Path):
    from transformers import AutoTokenizer

    from slime.tools.char_tokenizer import save_char_tokenizer

    out = tmp_path / "char-tok"
    save_char_tokenizer(out, ALPHABET)
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    tokenizer.chat_template = CHAR_CHAT_TEMPLATE
    return tokenizer


def _char_model(tmp_path: Path) -> Path:
    from slime.tools.tiny_checkpoint import TinyQwen3Spec, write_tiny_checkpoint

    out = write_tiny_checkpoint(tmp_path / "char-model", TinyQwen3Spec(alphabet=ALPHABET))
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["chat_template"] = CHAR_CHAT_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def _conversation(i: int) -> list[dict]:
    start = i % 7
    digits = "".join(str((start + k) % 10) for k in range(6))
    return [{"role": "user", "content": digits[:3]}, {"role": "assistant", "content": digits[3:]}]


def _write_conversations(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"messages": _conversation(i)}) + "\n" for i in range(n)))
    return path


def _args(model: Path, data: Path):
    return defaults_namespace(hf_checkpoint=str(model), prompt_data=str(data), input_key="messages",
                              rollout_batch_size=3, rollout_seed=1, start_rollout_id=0, loss_mask_type=None)


def sft_flags(model: Path, data: Path, metrics: Path, num_rollout: int) -> list[str]:
    return [
        "--hf-checkpoint", str(model), "--prompt-data", str(data), "--input-key", "messages",
        "--rollout-function-path", "slime.rollout.sft_rollout.generate_rollout",
        "--loss-type", "sft_loss", "--calculate-per-token-loss", "--disable-compute-advantages-and-returns",
        "--debug-train-only", "--rollout-shuffle", "--rollout-batch-size", "8", "--global-batch-size", "8",
        "--num-rollout", str(num_rollout),
        "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1", "--tensor-model-parallel-size", "1",
        "--use-dynamic-batch-size", "--max-tokens-per-gpu", "256",
        "--optimizer", "adam", "--lr", "1e-2", "--lr-decay-style", "constant", "--weight-decay", "0.0",
        "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--seed", "1234", "--fence-timeout", "120",
        "--metrics-jsonl", str(metrics),
    ]


def test_sft_flags_parse_as_upstreams_sft_job(tmp_path):
    from slime.utils.arguments import parse_args

    model = _char_model(tmp_path)
    args = parse_args(sft_flags(model, _write_conversations(tmp_path / "sft.jsonl", 4), tmp_path / "m.jsonl", 2))
    assert args.loss_type == "sft_loss" and not args.compute_advantages_and_returns and args.debug_train_only


@pytest.mark.timeout(600)
def test_sft_run_of_the_tiny_model_drives_the_loss_down(tmp_path):
    from train_runs import PRIVATE_CLUSTER, read_events, run_train

    model = _char_model(tmp_path)
    data = _write_conversations(tmp_path / "sft.jsonl", n=32)
    metrics = tmp_path / "metrics.jsonl"
    proc, _ = run_train(sft_flags(model, data, metrics, num_rollout=12), timeout_s=540, env_extra=PRIVATE_CLUSTER)
    assert proc.returncode == 0, proc.stderr[-4000:]
    losses = [e["train/loss"] for e in sorted(read_events(metrics)["train"], key=lambda e: e["rollout_id"])]
    assert len(losses) == 12 and all(math.isfinite(v) for v in losses)
    # a random-init model starts near log(vocabulary); the conversations follow a rule it can learn
    first, last = losses[0], sum(losses[-3:]) / 3
    assert last < 0.6 * first, f"losses {[round(v, 3) for v in losses]}"

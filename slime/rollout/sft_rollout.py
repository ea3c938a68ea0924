"""Supervised fine-tuning through the RL loop: `--rollout-function-path slime.rollout.sft_rollout.generate_rollout`.

With `--loss-type sft_loss` (negative log-likelihood of the loss tokens) this is upstream's SFT recipe:
each prompt row holds a conversation (`--input-key messages`, no `--apply-chat-template`); the rollout
renders it with the tokenizer's chat template and trains on the assistant turns only. No engine
generates: pair it with `--debug-train-only` (no engines start) and `--disable-compute-advantages-and-returns`.
The function is an ordinary rollout function, so `train.py` and `train_async.py` drive it alike.
"""
from __future__ import annotations

import logging

from slime.rollout.base_types import RolloutFnTrainOutput
from slime.rollout.data_source import load_tokenizer
from slime.utils.mask_utils import MultiTurnLossMaskGenerator
from slime.utils.types import Sample

__all__ = ["generate_rollout"]

logger = logging.getLogger(__name__)

_generators: dict[str, MultiTurnLossMaskGenerator] = {}  # one per tokenizer directory and process


def mask_generator(args) -> MultiTurnLossMaskGenerator:
    from slime.rollout.data_source import train_prompt_spec

    key = args.hf_checkpoint
    if key not in _generators:
        _generators[key] = MultiTurnLossMaskGenerator(
            load_tokenizer(args.hf_checkpoint), tokenizer_type=args.loss_mask_type,
            chat_template_kwargs=train_prompt_spec(args).chat_template_kwargs)
    return _generators[key]


def conversation_sample(generator: MultiTurnLossMaskGenerator, sample: Sample) -> Sample:
    """Fill a sample from its conversation: tokens, the response (first assistant token to the end) and its mask."""
    token_ids, loss_mask = generator.get_loss_mask(sample.prompt, tools=sample.metadata.get("tools"),
                                                   **sample.apply_chat_template_kwargs)
    (response_length,) = generator.get_response_lengths([loss_mask])
    sample.tokens = token_ids
    sample.response_length = response_length
    sample.loss_mask = loss_mask[-response_length:]
    sample.response = generator.tokenizer.decode(token_ids[-response_length:])
    sample.reward = 0.0
    sample.status = Sample.Status.COMPLETED
    return sample


def generate_rollout(args, rollout_id: int, data_source, evaluation: bool = False) -> RolloutFnTrainOutput:
    """`--rollout-batch-size` conversations from the data source, as one-sample groups ready to train on."""
    if evaluation:
        raise ValueError("slime.rollout.sft_rollout has no eval mode; set --eval-function-path to an eval rollout "
                         "(e.g. slime.rollout.sglang_rollout.generate_rollout) or drop --eval-interval")
    if not args.rollout_global_dataset:
        raise ValueError("sft_rollout reads the global dataset; remove --disable-rollout-global-dataset")
    if args.n_samples_per_prompt != 1:
        raise ValueError(f"SFT trains on each conversation once: set --n-samples-per-prompt 1 "
                         f"(got {args.n_samples_per_prompt})")
    generator = mask_generator(args)
    groups = data_source.get_samples(args.rollout_batch_size)
    for group in groups:
        for sample in group:
            conversation_sample(generator, sample)
    if rollout_id == args.start_rollout_id and groups:
        first = groups[0][0]
        logger.info("sft rollout %d: %d conversations; the first has %d tokens, %d trained of its %d response tokens",
                    rollout_id, len(groups), len(first.tokens), sum(first.loss_mask), first.response_length)
    return RolloutFnTrainOutput(samples=groups)

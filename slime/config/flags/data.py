"""Flags of prompt data, batch sizes and periodic evaluation."""

from __future__ import annotations

import argparse
import json

from slime.config.constants import DEFAULT_DATA_SOURCE_PATH


def add_data_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("data", "prompt data and batch sizes")
    g.add_argument("--num-rollout", type=int, default=None, help="rollout steps to run")
    g.add_argument("--num-epoch", type=int, default=None,
                   help="derive --num-rollout as epochs x prompts // --rollout-batch-size")
    g.add_argument("--data-source-path", type=str, default=DEFAULT_DATA_SOURCE_PATH,
                   help="class cls(args) handing out prompt groups (get_samples, add_samples, save, load)")
    g.add_argument("--prompt-data", type=str, default=None, help="JSONL (or parquet) file of prompts")
    g.add_argument("--input-key", type=str, default="input", help="record key holding the prompt")
    g.add_argument("--label-key", type=str, default=None, help="record key holding the label given to the reward")
    g.add_argument("--metadata-key", type=str, default="metadata", help="record key of per-sample metadata")
    g.add_argument("--tool-key", type=str, default="tools", help="record key of tool specs for the chat template")
    g.add_argument("--multimodal-keys", type=json.loads, default=None,
                   help="JSON mapping of media types to record keys, e.g. '{\"image\": \"images\"}': each row's images "
                        "(paths, base64, bytes) fill the prompt's <image> placeholders; video and audio are refused")
    g.add_argument("--apply-chat-template", action="store_true", default=False,
                   help="the prompt is a chat message list; render it with the tokenizer's chat template")
    g.add_argument("--apply-chat-template-kwargs", type=json.loads, default="{}",
                   help="JSON object of extra keyword arguments for the chat template")
    g.add_argument("--start-rollout-id", type=int, default=None,
                   help="first rollout id (default: the rollout after the last checkpoint under --load, else 0)")
    g.add_argument("--rollout-batch-size", type=int, required=True, help="prompts (groups) per rollout step")
    g.add_argument("--n-samples-per-prompt", type=int, default=1, help="responses generated per prompt (group size)")
    g.add_argument("--num-steps-per-rollout", type=int, default=None,
                   help="optimizer steps per rollout; sets --global-batch-size = rollout samples // this")
    g.add_argument("--balance-data", action="store_true", default=False,
                   help="balance tokens across data-parallel ranks when splitting a step")
    g.add_argument("--balance-by-flops", action="store_true", default=False,
                   help="balance micro-batches by estimated FLOPs instead of tokens")
    g.add_argument("--use-dynamic-batch-size", action="store_true", default=False,
                   help="pack micro-batches up to --max-tokens-per-gpu instead of --micro-batch-size samples")
    g.add_argument("--max-tokens-per-gpu", type=int, default=None, help="token budget of a micro-batch per rank")
    g.add_argument("--log-probs-max-tokens-per-gpu", type=int, default=None,
                   help="token budget per rank of the log-prob passes (default: --max-tokens-per-gpu)")


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("eval", "periodic evaluation")
    g.add_argument("--eval-function-path", type=str, default=None,
                   help="rollout function used for eval (default: --rollout-function-path)")
    g.add_argument("--eval-interval", type=int, default=None, help="evaluate every N rollouts")
    g.add_argument("--eval-prompt-data", type=str, nargs="+", default=None, metavar="NAME PATH",
                   help="pairs of dataset name and path, e.g. aime /data/aime.jsonl")
    g.add_argument("--eval-config", type=str, default=None, help="YAML description of the eval datasets")
    g.add_argument("--skip-eval-before-train", action="store_true", default=False, help="no eval at rollout 0")
    g.add_argument("--eval-input-key", type=str, default=None, help="record key of eval prompts (default: --input-key)")
    g.add_argument("--eval-label-key", type=str, default=None, help="record key of eval labels (default: --label-key)")
    g.add_argument("--eval-tool-key", type=str, default=None, help="record key of eval tool specs (default: --tool-key)")
    g.add_argument("--n-samples-per-eval-prompt", type=int, default=1, help="responses generated per eval prompt")
    g.add_argument("--eval-temperature", type=float, default=None, help="eval sampling temperature (default: rollout's)")
    g.add_argument("--eval-top-p", type=float, default=None, help="eval nucleus-sampling mass (default: rollout's)")
    g.add_argument("--eval-top-k", type=int, default=None, help="eval top-k sampling (default: rollout's)")
    g.add_argument("--eval-max-response-len", type=int, default=None,
                   help="most new tokens per eval response (default: --rollout-max-response-len)")
    g.add_argument("--eval-max-prompt-len", type=int, default=None,
                   help="eval prompts with more tokens are skipped (default: as for training prompts)")
    g.add_argument("--eval-min-new-tokens", type=int, default=None, help="fewest new tokens per eval response")
    g.add_argument("--eval-max-context-len", type=int, default=None, help="most prompt + response tokens in eval")

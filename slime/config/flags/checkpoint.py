"""Flags of Megatron and HF checkpoints: load, save, reference and resume."""

from __future__ import annotations

import argparse


def add_checkpoint_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("checkpoint", "Megatron and HF checkpoints")
    g.add_argument("--ref-load", type=str, default=None,
                   help="reference-model weights: HF directory or Megatron checkpoint (default: --hf-checkpoint)")
    g.add_argument("--ref-ckpt-step", type=int, default=None,
                   help="iteration of the --ref-load Megatron checkpoint to use (default: its latest)")
    g.add_argument("--load", type=str, default=None, help="resume from this Megatron checkpoint directory")
    g.add_argument("--save", type=str, default=None, help="save Megatron checkpoints under this directory")
    g.add_argument("--save-interval", type=int, default=None, help="save every N rollouts (needs --save)")
    g.add_argument("--keep-checkpoint-num", type=int, default=None,
                   help="keep the newest N complete checkpoints under --save (and the critic's), deleting older ones "
                        "after each save; never the one a tracker names nor anything newer (default: keep all)")
    g.add_argument("--async-save", action="store_true", default=False, help="save checkpoints in the background")
    g.add_argument("--no-save-optim", action="store_true", default=False,
                   help="save model weights without the optimizer state")
    g.add_argument("--no-load-optim", action="store_true", default=False,
                   help="resume model weights but start a fresh optimizer")
    g.add_argument("--no-load-rng", action="store_true", default=False,
                   help="do not restore the saved RNG states on --load (every rank starts from --seed)")
    g.add_argument("--allow-fresh-data-position", action="store_true", default=False,
                   help="--load without the saved data position (rollout/global_dataset_state_dict_N.pt): start "
                        "from the first prompt instead of failing")
    g.add_argument("--finetune", action="store_true", default=False,
                   help="load --load's weights only and start at rollout 0 with a fresh optimizer")
    g.add_argument("--ckpt-format", type=str, default="torch_dist", choices=["torch", "torch_dist"],
                   help="checkpoint format")
    g.add_argument("--save-hf", "--save-hf-path", dest="save_hf", type=str, default=None,
                   help="also save HF safetensors weights at every checkpoint to this path ('{rollout_id}' is filled in)")
    g.add_argument("--custom-model-provider-path", type=str, default=None,
                   help="fn(pre_process, post_process, vp_stage) -> GPTModel replacing the model builder")

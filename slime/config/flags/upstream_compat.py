"""Upstream slime's remaining non-model flags: two implemented, the rest declared with their upstream
keywords; the mark --help puts before each (help.registry_mark) says what its registry entry makes of it.
"""

from __future__ import annotations

import argparse
from typing import Any



# upstream flag -> its argparse keywords; what each does here is its registry entry (warned or refused)
UPSTREAM_COMPAT_FLAGS: dict[str, dict[str, Any]] = {
    "--keep-old-actor": dict(action="store_true"),
    "--profile-target": dict(type=str, default=None), "--use-pytorch-profiler": dict(action="store_true"),
    "--profile": dict(action="store_true"), "--profile-step-start": dict(type=int, default=None),
    "--profile-step-end": dict(type=int, default=None), "--profile-ranks": dict(type=int, nargs="+", default=None),
    "--train-memory-margin-bytes": dict(type=int, default=None), "--disable-weights-backuper": dict(action="store_true"),
    "--megatron-to-hf-mode": dict(type=str, default="raw", choices=["raw", "bridge"]),
    "--qkv-format": dict(type=str, default="thd", choices=["thd", "bshd"]),
    "--eval-num-gpus": dict(type=int, default=None), "--log-throughput": dict(action="store_true"),
    "--log-timers-to-tensorboard": dict(action="store_true"), "--tensorboard-log-interval": dict(type=int, default=None),
    "--log-params-norm": dict(action="store_true"), "--timing-log-level": dict(type=int, default=None),
    "--save-retain-interval": dict(type=int, default=None),
    "--sglang-config": dict(type=str, default=None), "--prefill-num-servers": dict(type=int, default=None),
    "--slime-router-middleware-paths": dict(type=str, nargs="+", default=None),
    "--custom-update-weight-post-write-path": dict(type=str, default=None),
    "--true-on-policy-mode": dict(action="store_true"), "--use-dynamic-global-batch-size": dict(action="store_true"),
    "--rollout-external": dict(action="store_true"), "--ckpt-step": dict(type=int, default=None),
    "--exit-interval": dict(type=int, default=None), "--no-save-rng": dict(action="store_true"),
    "--update-weight-disk-dir": dict(type=str, default=None),
    "--update-weight-disk-keep-files": dict(type=int, default=None),
    "--update-weight-local-checkpoint-dir": dict(type=str, default=None),
}


def add_upstream_compat_arguments(parser: argparse.ArgumentParser) -> None:
    """Upstream slime's remaining non-model flags: two implemented, the rest warned or refused with the reason."""
    g = parser.add_argument_group("upstream compatibility", "upstream slime flags, with what they do here")
    g.add_argument("--disable-rollout-global-dataset", action="store_false", dest="rollout_global_dataset",
                   help="do not load --prompt-data into the data source; a custom --rollout-function-path (or "
                        "--data-source-path) supplies the prompts")
    g.add_argument("--log-interval", type=int, default=1, help="write each rank's loss line every N rollouts")
    for flag, kwargs in UPSTREAM_COMPAT_FLAGS.items():
        g.add_argument(flag, help="upstream slime's flag", **kwargs)

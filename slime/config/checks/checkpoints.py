"""What the checkpoint flags point at, before Ray starts: --load (a run it resumes, or the first run of a job that
resumes itself) and --keep-checkpoint-num (which directories its pruning protects).

The --load rule (docs/exact-resume.md, "Where a run starts"):

  --load holds a checkpoint     the tracker names an iteration whose iter_* directory exists: the run resumes it
  --load is --save, no tracker  the first run of a job that saves where its later runs resume (upstream's
                                launchers pass one directory to both): it starts from --hf-checkpoint, and says so
  anything else                 refused: a directory without a checkpoint (missing, empty, an HF checkpoint,
                                iter_* directories without a tracker), an unreadable tracker or one naming a
                                missing iteration. A mistyped resume path would otherwise start from the HF
                                weights and then save over the wrong directory. To start fresh, drop --load.
"""

from __future__ import annotations

import argparse
import logging
import os

from slime.checkpoint.contents import TRACKER, iteration_dir, latest_iteration
from slime.config.critic_role import CRITIC_ROLE, critic_save_dir
from slime.config.errors import fail
from slime.config.launch import HF_CONFIG_FILE

logger = logging.getLogger(__name__)


def check_load(args: argparse.Namespace) -> None:
    if args.load is None:
        return
    path = args.load
    try:
        iteration = latest_iteration(path)
        entries = os.listdir(path) if os.path.isdir(path) else []
    except (OSError, ValueError) as exc:
        fail(f"--load {path}: {exc}")
    if iteration is not None:
        if not os.path.isdir(iteration_dir(path, iteration)):
            fail(f"--load {path}: {TRACKER} names iteration {iteration}, but "
                 f"{os.path.basename(iteration_dir(path, iteration))} is missing; write the number of a complete "
                 "iter_* directory into it")
        return
    if args.use_critic and latest_iteration(os.path.join(path, CRITIC_ROLE)) is not None:
        return  # the critic's checkpoint alone: it resumes, the actor starts from --hf-checkpoint
    saved = sorted(name for name in entries if name.startswith("iter_"))
    if saved:
        fail(f"--load {path} holds {', '.join(saved[-3:])} but no {TRACKER} (a save that never completed, or a copy "
             f"without its tracker): write the number of a complete iteration into {os.path.join(path, TRACKER)}, or "
             "drop --load to start fresh")
    if args.finetune:
        fail(f"--finetune loads the weights of --load {path}, which holds no checkpoint; drop --finetune to start "
             "from --hf-checkpoint")
    if starts_fresh_in_save_dir(args):
        logger.info("--load %s holds no checkpoint yet: this run starts from --hf-checkpoint and saves there "
                    "(--save is the same directory)", path)
        return
    if HF_CONFIG_FILE in entries:
        fail(f"--load {path} is a Hugging Face checkpoint, not a saved run: the trainer reads HF weights from "
             f"--hf-checkpoint only; pass --hf-checkpoint {path} and drop --load")
    what = "does not exist" if not os.path.exists(path) else "holds no checkpoint (no " + TRACKER + ")"
    fail(f"--load {path} {what}: a run resumes only from a checkpoint. To start fresh, drop --load (or pass the "
         "--save directory, as a first run of a job that resumes itself does); to resume, point --load at the "
         "directory a run saved into")


def starts_fresh_in_save_dir(args: argparse.Namespace) -> bool:
    """--load and --save name one directory (upstream's launchers' idiom) that holds no checkpoint yet."""
    return args.save is not None and os.path.realpath(args.load) == os.path.realpath(args.save)


def resolve_checkpoint_retention(args: argparse.Namespace) -> None:
    """--keep-checkpoint-num N >= 1 with --save; args.checkpoint_roots: every role's --save directory, whose trackers
    all protect what a restart goes back to (slime/checkpoint/retention.py)."""
    args.checkpoint_roots = tuple(root for root in (args.save, critic_save_dir(args) if args.use_critic else None)
                                  if root)
    if args.keep_checkpoint_num is None:
        return
    if args.keep_checkpoint_num < 1:
        fail(f"--keep-checkpoint-num {args.keep_checkpoint_num} would delete every checkpoint; pass N >= 1 (or drop "
             "it to keep all)")
    if not args.save:
        fail("--keep-checkpoint-num prunes the checkpoints under --save: add --save DIR --save-interval N")

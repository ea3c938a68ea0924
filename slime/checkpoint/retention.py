"""--keep-checkpoint-num N: after a save has published (its tracker moved), the older complete checkpoints beyond
the newest N are deleted by rank 0, so a long run does not fill its disk.

Never deleted: the iteration a tracker names, anything newer, and anything at or above the oldest iteration
any role's tracker names (a run with a critic saves both roles; a restart goes back to a checkpoint both
have). Only complete checkpoints (published `iter_N` directories) count and are deleted; a save in progress
(`iter_N.partial`) is not touched. A directory is renamed `iter_N.deleting` before it is removed, so a run killed
mid-deletion leaves nothing a load would take for a checkpoint; such leftovers are removed by the next prune.
"""
from __future__ import annotations

import logging
import os
import re
from typing import Callable, Iterable, Sequence

from slime.checkpoint.contents import iteration_dir, latest_iteration

logger = logging.getLogger(__name__)

_COMPLETE = re.compile(r"^iter_(\d{7})$")
DELETING = ".deleting"


def complete_iterations(root: str) -> list[int]:
    """The published iterations under root, oldest first."""
    if not os.path.isdir(root):
        return []
    return sorted(int(m.group(1)) for m in map(_COMPLETE.match, os.listdir(root)) if m)


def iterations_to_delete(present: Iterable[int], keep: int, protected_from: int | None) -> list[int]:
    """Which of the `present` complete iterations go: all but the newest `keep`, and never one at or above
    `protected_from` (None: nothing is published yet, so nothing is deleted)."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    if protected_from is None:
        return []
    older = [i for i in sorted(present) if i < protected_from]
    newest_kept = sorted(present)[-keep:]
    return [i for i in older if i not in newest_kept]


def protected_floor(roots: Sequence[str]) -> int | None:
    """The oldest iteration a tracker of `roots` names (None when none has a tracker)."""
    named = [it for it in (latest_iteration(root) for root in roots if root) if it is not None]
    return min(named) if named else None


def prune(root: str, keep: int, roots: Sequence[str], progress: Callable[[], None] | None = None) -> list[int]:
    """Delete root's complete iterations beyond the newest `keep` (iterations_to_delete, protected by every root's
    tracker); `progress()` after each file removed (a long delete is not a stall). Returns what was deleted."""
    doomed = iterations_to_delete(complete_iterations(root), keep, protected_floor([root, *roots]))
    for iteration in doomed:
        path = iteration_dir(root, iteration)
        os.replace(path, path + DELETING)
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        if name.endswith(DELETING):
            try:
                _remove_tree(os.path.join(root, name), progress)
            except OSError as exc:  # the run goes on; the next prune tries again
                logger.warning("--keep-checkpoint-num: could not remove %s (%s)", os.path.join(root, name), exc)
    return doomed


def _remove_tree(path: str, progress: Callable[[], None] | None) -> None:
    for base, dirs, files in os.walk(path, topdown=False):
        for name in files:
            os.remove(os.path.join(base, name))
            if progress is not None:
                progress()
        for name in dirs:
            full = os.path.join(base, name)
            if os.path.islink(full):
                os.remove(full)
            else:
                os.rmdir(full)
    os.rmdir(path)

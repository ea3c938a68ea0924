"""The trainer roles of a run's ledger directory: the actor's ranks write to the directory itself, the critic's
(--advantage-estimator ppo: their own process groups, fences and deadlines) to its `critic/` subdirectory. The
order proof and the hang report read every role's."""
from __future__ import annotations

import os

ROLE_SUBDIRS = ("critic",)


def role_dirs(ledger_dir: str) -> list[tuple[str, str]]:
    """[(role, directory)]: the actor's, then each role subdirectory that exists."""
    found = [("actor", ledger_dir)]
    for role in ROLE_SUBDIRS:
        path = os.path.join(ledger_dir, role)
        if os.path.isdir(path):
            found.append((role, path))
    return found

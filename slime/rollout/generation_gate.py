"""A process-wide gate in front of new /generate requests: held while the trainer pushes weights.

train_async.py pushes weights while a background generator (slime.rollout.fully_async_rollout) may still
be drawing prompts. Holding the gate stops new requests at the client (a sample that has not sent its
request comes back ABORTED with nothing generated), the rollout manager then aborts what the engines
still run and waits for those requests to come back, so the push finds idle engines (a flush refuses
to run while requests wait) and no request mixes two weight versions. Releasing it lets generation go on.
"""
from __future__ import annotations

import threading

_held = threading.Event()


def is_held() -> bool:
    return _held.is_set()


def hold() -> None:
    _held.set()


def release() -> None:
    _held.clear()

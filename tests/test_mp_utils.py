"""The multi-process runner the distributed tests stand on: failures and deaths are reported, not hung on."""
from __future__ import annotations

import os

import pytest

from mp_utils import run_ranks, run_ranks_outcomes

pytestmark = pytest.mark.ranks


def _fail_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("rank one refuses")
    return rank * 10


def _exit_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        os._exit(3)
    return rank * 10


def _probe_env(rank: int, world_size: int) -> str | None:
    return os.environ.get("SLIME_MP_UTILS_PROBE")


def test_each_rank_sees_the_callers_environment_as_of_the_call(monkeypatch):
    """Ranks fork from a server started at the first call; a variable set after that still reaches them."""
    monkeypatch.delenv("SLIME_MP_UTILS_PROBE", raising=False)
    assert run_ranks(_probe_env, 1, init_process_group=False, timeout_s=60) == [None]
    monkeypatch.setenv("SLIME_MP_UTILS_PROBE", "set after the server started")
    assert run_ranks(_probe_env, 2, init_process_group=False, timeout_s=60) == ["set after the server started"] * 2


def test_run_ranks_returns_values_in_rank_order():
    assert run_ranks(_fail_on_rank_1, 1, init_process_group=False, timeout_s=60) == [0]


def test_run_ranks_raises_with_the_failing_ranks_traceback():
    with pytest.raises(RuntimeError, match=r"(?s)rank 1 failed:.*ValueError: rank one refuses"):
        run_ranks(_fail_on_rank_1, 2, init_process_group=False, timeout_s=60)


def test_run_ranks_outcomes_keeps_every_rank_including_one_that_died():
    # no process group: what is tested is the collection of outcomes, not a rendezvous (whose port another
    # test's process may take on a busy machine)
    outcomes = run_ranks_outcomes(_exit_on_rank_1, 2, timeout_s=60, init_process_group=False)
    assert [(o.rank, o.status) for o in outcomes] == [(0, "ok"), (1, "exit")]
    assert outcomes[0].value == 0 and outcomes[1].exitcode == 3

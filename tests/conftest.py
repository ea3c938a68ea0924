"""Set before any test imports Ray or starts a server:
- every test's processes keep Ray on loopback (patches/ray.py says why);
- every test process holds a run key, as each process of a run does: the clients here send it and the
  servers started here require it (slime/utils/security.py)."""
import os

from patches.ray import ENV_SWITCH
from slime.utils.security import ApiKey, use_key

os.environ.setdefault(ENV_SWITCH, "0")
use_key(ApiKey.generate())  # at import: module-scoped fixtures start servers before any test runs


import pytest  # noqa: E402 (after the environment above is set)

SEED_RECORDING_TIMEOUT_S = 480


@pytest.fixture(scope="session")
def seed_recording(tmp_path_factory) -> dict:
    """The seed's configuration through `python train.py`, every rank's collective sequence recorded
    (slime.tools.record_step_sequence: 8 ranks TP2 x SP x CP4, --colocate, dynamic batches, per-token
    loss, engines, 2 rollouts of 2 steps). One run per session: the end-to-end tests check what it
    trained and replay its rollouts, the order proof checks its sequences."""
    from slime.tools.record_step_sequence import record

    out = tmp_path_factory.mktemp("seed_recording")
    proc = record(out, [], timeout_s=SEED_RECORDING_TIMEOUT_S)
    return {"proc": proc, "out": out, "metrics": out / "metrics.jsonl", "replay": out / "rollout_{rollout_id}.pt"}

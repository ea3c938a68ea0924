"""Set before any test imports Ray or starts a server:
- every test's processes keep Ray on loopback (patches/ray.py says why);
- every test process holds a run key, as each process of a run does: the clients here send it and the
  servers started here require it (slime/utils/security.py)."""
import os

from patches.ray import ENV_SWITCH
from slime.utils.security import ApiKey, use_key

os.environ.setdefault(ENV_SWITCH, "0")
use_key(ApiKey.generate())  # at import: module-scoped fixtures start servers before any test runs

"""Every test process holds a run key, as each process of a run does: the clients here send it and the
servers started here require it (slime/utils/security.py)."""
from slime.utils.security import ApiKey, use_key

use_key(ApiKey.generate())  # at import: module-scoped fixtures start servers before any test runs

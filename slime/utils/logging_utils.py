"""Process-wide logging setup: one format with time, process role and rank, configured once per process."""

from __future__ import annotations

import logging
import os
import sys

_FORMAT = "[%(asctime)s %(role)s] %(levelname)s %(name)s: %(message)s"
_configured = False


class _RoleFilter(logging.Filter):
    """Stamps every record with the process role (driver, rank N) so interleaved Ray logs stay readable."""

    def __init__(self, role: str) -> None:
        super().__init__()
        self.role = role

    def filter(self, record: logging.LogRecord) -> bool:
        record.role = self.role
        return True


def process_role() -> str:
    """'rank N' inside a torch.distributed worker (from RANK), else 'driver'."""
    rank = os.environ.get("RANK")
    return f"rank {rank}" if rank is not None else "driver"


def configure_logger(level: int | str = logging.INFO, role: str | None = None) -> None:
    """Configure the root logger once per process; later calls only change the level."""
    global _configured
    root = logging.getLogger()
    root.setLevel(level)
    if _configured:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
    handler.addFilter(_RoleFilter(role or process_role()))
    root.addHandler(handler)
    logging.captureWarnings(True)  # NotImplementedFlagWarning and friends reach the same stream
    _configured = True

"""Runtime patches of third-party libraries, one module per library.

`apply_all()` is the single entry point; it is a no-op where the library runs as designed
(CUDA present), so cluster runs execute unpatched upstream code.
"""

import torch


def apply_all() -> None:
    """Apply every patch this machine needs. Idempotent; call before building a model."""
    if torch.cuda.is_available():
        return
    from patches import megatron_core

    megatron_core.apply()

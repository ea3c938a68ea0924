"""What the engines are, decided from the flags and the environment before anything starts: the engine kind of
``--rollout-backend`` and SGLang's switch that makes engines report log-probs before the temperature.

The parse-time checks and the engines (SGLang servers, the embedded engine) read both from here."""

from __future__ import annotations

import importlib.util
import os
from typing import Any

ROLLOUT_BACKENDS = ("sglang", "embedded")

# SGLang's switch (sglang/srt/layers/sampler.py): report log-probs before temperature scaling.
RETURN_ORIGINAL_LOGPROB_ENV = "SGLANG_RETURN_ORIGINAL_LOGPROB"


def return_original_logprob() -> bool:
    """SGLang's reading of SGLANG_RETURN_ORIGINAL_LOGPROB ("1"/"true", any case)."""
    return os.environ.get(RETURN_ORIGINAL_LOGPROB_ENV, "false").lower() in ("true", "1")


def pick_rollout_backend(args: Any) -> str:
    """'sglang' or 'embedded' from args.rollout_backend (auto: sglang iff CUDA and sglang are present)."""
    choice = args.rollout_backend
    if choice in ROLLOUT_BACKENDS:
        return choice
    if choice != "auto":
        raise ValueError(f"--rollout-backend {choice!r}: expected auto, sglang or embedded")
    import torch  # deferred: --help and pure parsing should not pay for torch

    if not torch.cuda.is_available():
        return "embedded"
    if importlib.util.find_spec("sglang") is None:
        # A GPU cluster without SGLang would otherwise fall back to the transformers engine, which is
        # orders of magnitude slower, without anyone noticing: make the choice explicit.
        raise ValueError("--rollout-backend auto: CUDA is available but sglang is not installed. Install SGLang "
                         "(see README, 'Running on a cluster'), or pass --rollout-backend embedded to generate "
                         "with the embedded transformers engine on purpose")
    return "sglang"

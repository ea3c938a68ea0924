"""The random-number state of one process: torch (CPU and every CUDA device), Python's `random`,
numpy, and megatron's model-parallel RNG tracker when it exists. Captured as plain values that
torch.load(weights_only=True) reads back."""
from __future__ import annotations

import random
from typing import Any

import numpy
import torch


def capture(*, tracker: bool = True) -> dict[str, Any]:
    """tracker=False: leave megatron's tracker out (a process that trains nothing)."""
    kind, keys, pos, has_gauss, gauss = numpy.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "python": random.getstate(),
        "numpy": (kind, [int(k) for k in keys], int(pos), int(has_gauss), float(gauss)),
        "tracker": _tracker_states() if tracker else None,
    }


def restore(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    numpy.random.set_state((kind, numpy.asarray(keys, dtype=numpy.uint32), pos, has_gauss, cached))
    if state.get("tracker") is not None:
        from megatron.core import tensor_parallel

        tensor_parallel.get_cuda_rng_tracker().set_states(dict(state["tracker"]))


def _tracker_states() -> dict[str, torch.Tensor] | None:
    """megatron's tensor-parallel RNG streams (dropout inside TP regions), when megatron made them."""
    try:
        from megatron.core import tensor_parallel
    except ImportError:
        return None
    states = tensor_parallel.get_cuda_rng_tracker().get_states()
    return {name: state.clone() for name, state in states.items()} or None

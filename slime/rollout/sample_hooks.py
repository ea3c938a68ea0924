"""`--rollout-sample-hook-path`: functions applied to every finished sample before it is rewarded.

Each hook is `hook(args, sample, *, rollout_id, evaluation) -> Sample | None` (sync or async);
returning None keeps the (possibly edited) sample. The flag may be given several times; hooks
run in the order given. Aborted samples are not finished: they are hooked when they complete.
"""
from __future__ import annotations

import inspect

from slime.utils.misc import load_function
from slime.utils.types import Sample


async def apply_rollout_sample_hooks(args, result: Sample | list[Sample], *, rollout_id: int | None,
                                     evaluation: bool) -> Sample | list[Sample]:
    paths = args.rollout_sample_hook_path
    if not paths:
        return result
    hooks = [load_function(path) for path in paths]
    samples = result if isinstance(result, list) else [result]
    out = [await _apply(hooks, args, s, rollout_id, evaluation) for s in samples]
    return out if isinstance(result, list) else out[0]


async def _apply(hooks, args, sample: Sample, rollout_id: int | None, evaluation: bool) -> Sample:
    if sample.status == Sample.Status.ABORTED:
        return sample
    for hook in hooks:
        returned = hook(args, sample, rollout_id=rollout_id, evaluation=evaluation)
        if inspect.isawaitable(returned):
            returned = await returned
        sample = sample if returned is None else returned
    return sample

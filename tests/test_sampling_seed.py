"""Each sample's sampling seed: derived from --seed, the rollout id and the sample index, and sent with
every request the default rollout makes (custom generate functions receive it in sampling_params)."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

from rollout_testing import fresh_generate_state, tokenizer_dir  # noqa: F401 (fixtures)
from slime.config import defaults_namespace
from slime.rollout.sampling_seed import SEED_RANGE, sample_seed, seeded_params
from slime.utils.types import Sample

SEEN: list[dict] = []


async def recording_generate(args, sample, sampling_params):
    """A --custom-generate-function-path that records the params it gets."""
    SEEN.append(dict(sampling_params))
    sample.response, sample.reward, sample.status = "x", 1.0, Sample.Status.COMPLETED
    return sample


def test_seed_is_a_pure_function_of_seed_rollout_index_and_mode():
    seed = sample_seed(1234, 3, 17, False)
    assert seed == sample_seed(1234, 3, 17, False) and 0 <= seed < SEED_RANGE
    others = {sample_seed(1235, 3, 17, False), sample_seed(1234, 4, 17, False), sample_seed(1234, 3, 18, False),
              sample_seed(1234, 3, 17, True)}
    assert seed not in others and len(others) == 4


def test_params_keep_a_set_seed_and_samples_without_index_go_unseeded():
    args = SimpleNamespace(seed=1)
    assert seeded_params(args, {"sampling_seed": 5}, 0, 3, False) == {"sampling_seed": 5}
    assert seeded_params(args, {"temperature": 1.0}, 0, None, False) == {"temperature": 1.0}
    assert seeded_params(args, {}, 2, 3, False) == {"sampling_seed": sample_seed(1, 2, 3, False)}


def test_generate_and_rm_sends_each_sample_its_seed(tokenizer_dir):
    from slime.rollout.sglang_rollout import GenerateState, generate_and_rm

    args = defaults_namespace(seed=42, hf_checkpoint=tokenizer_dir,
                              custom_generate_function_path=f"{__name__}.recording_generate",
                              sglang_server_concurrency=4, rollout_num_gpus=1, rollout_num_gpus_per_engine=1,
                              partial_rollout=False, group_rm=False, rollout_temperature=1.0)
    GenerateState(args).reset(rollout_id=6)
    SEEN.clear()
    for index in (0, 1):
        asyncio.run(generate_and_rm(args, Sample(tokens=[1, 2], index=index), {"temperature": 1.0}))
    assert [p["sampling_seed"] for p in SEEN] == [sample_seed(42, 6, 0, False), sample_seed(42, 6, 1, False)]

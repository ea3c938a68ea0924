"""Which communicators get one NCCL channel: the group kinds of one rank, in the file megatron reads."""
from __future__ import annotations

import os

import yaml

from slime.distributed.communicator_config import ALL_GROUP_KINDS, megatron_config_file, single_rank_group_kinds


def test_a_world_of_one_caps_every_kind():
    assert single_rank_group_kinds(world_size=1, tensor=1, pipeline=1, context=1, expert=1) == ALL_GROUP_KINDS


def test_only_kinds_of_one_rank_are_capped_in_the_issue_layout():
    """8 ranks as TP2 x CP4: DP is 1, so DP, PP, EP and the embedding groups hold one rank; TP, CP and their
    products span ranks and keep NCCL's channels."""
    kinds = single_rank_group_kinds(world_size=8, tensor=2, pipeline=1, context=4, expert=1)
    assert set(kinds) == {"pp", "dp", "ep", "embd", "pos_embd"}
    assert not {"tp", "cp", "dp_cp", "tp_cp", "tp_dp_cp", "mp"} & set(kinds)


def test_data_parallel_groups_span_ranks_when_dp_is_above_one():
    kinds = single_rank_group_kinds(world_size=4, tensor=2, pipeline=1, context=1, expert=1)
    assert "dp" not in kinds and "cp" in kinds and "tp_cp" not in kinds


def test_the_config_file_lives_only_while_megatron_reads_it():
    with megatron_config_file(("tp", "dp"), 1) as path:
        assert yaml.safe_load(open(path)) == {"tp": {"max_ctas": 1, "min_ctas": 1}, "dp": {"max_ctas": 1, "min_ctas": 1}}
    assert not os.path.exists(path)
    with megatron_config_file(("tp",), 0) as path:  # 0: NCCL's default channels, no file
        assert path is None
    with megatron_config_file((), 1) as path:
        assert path is None

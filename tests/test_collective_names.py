"""Every collective lands in the ledger under a known group, and the CPU stand-ins record what they stand in for.

- broadcast_object_list (the PP broadcast of the log-probs) and the other object collectives call
  distributed_c10d's module-level functions, which the torch.distributed wrappers do not see: they are
  wrapped themselves.
- megatron's expert-TP gathers with per-rank row counts call the list forms of all_gather / reduce_scatter
  on GPUs; on gloo slime/patches/megatron_core.py replaces them by a padded all_gather_into_tensor and an
  all_reduce, recorded as the list-form op they replace, so the order proof reads the GPU's sequence.
The MoE groups (tp_ep, tp_ep_pp) are named: tests/test_moe.py checks that no op of a recorded MoE step is
'unnamed'.
"""
from __future__ import annotations

import pytest

from mp_utils import run_ranks

pytestmark = pytest.mark.ranks

SIZES = (3, 1)  # rows of rank 0 and rank 1


def _ops(ledger) -> list[tuple]:
    return [(e["op"], e["group"], tuple(e["shape"]), e["dtype"], e["peer"]) for e in ledger.snapshot()["recent"]]


def _child(rank: int, world: int, ledger_dir: str) -> dict:
    import torch
    import torch.distributed as dist
    from megatron.core.tensor_parallel import mappings

    from slime import patches
    from slime.distributed.group_names import register_group
    from slime.distributed.instrument import instrument_collectives, uninstrument_collectives
    from slime.distributed.ledger import Ledger

    patches.apply_all()
    group = dist.new_group([0, 1])
    register_group("etp", group)
    pp = dist.new_group([0, 1])
    register_group("pp", pp)
    rows = torch.full((SIZES[rank], 4), float(rank + 1))
    cpu = Ledger(rank, world, ledger_dir, record_sequence=True)
    instrument_collectives(cpu)
    try:
        holder = [{"log_probs": [1.0, 2.0]} if rank == 1 else None]
        dist.broadcast_object_list(holder, src=1, group=pp)
        gathered = mappings.gather_from_sequence_parallel_region(rows, group=group, output_split_sizes=list(SIZES))
        scattered = mappings.reduce_scatter_to_sequence_parallel_region(
            torch.ones(sum(SIZES), 4), group=group, input_split_sizes=list(SIZES))
        # megatron's GPU path: its list-form calls through the same wrappers (gloo refuses the uneven gather
        # after the ledger recorded it)
        gpu = Ledger(rank, world, None)
        instrument_collectives(gpu)
        with pytest.raises(RuntimeError, match="allgather"):
            dist.all_gather(list(torch.empty(sum(SIZES), 4).split(list(SIZES))), rows, group=group)
        dist.reduce_scatter(torch.empty(SIZES[rank], 4), list(torch.ones(sum(SIZES), 4).split(list(SIZES))),
                            group=group)
    finally:
        uninstrument_collectives()
    cpu.close()
    return {"holder": holder[0], "gathered": gathered.tolist(), "scattered": scattered.tolist(),
            "cpu": _ops(cpu), "gpu": _ops(gpu)}


@pytest.mark.timeout(120)
def test_object_broadcast_and_uneven_expert_gathers_are_recorded_as_on_gpu(tmp_path):
    from slime.distributed.order_proof import check_order, read_sequences

    results = run_ranks(_child, 2, args=(str(tmp_path),), timeout_s=100)
    expected_rows = [[1.0] * 4] * SIZES[0] + [[2.0] * 4] * SIZES[1]
    for rank, result in enumerate(results):
        assert result["holder"] == {"log_probs": [1.0, 2.0]}
        assert result["gathered"] == expected_rows  # the stand-in computes what megatron's gather does
        assert result["scattered"] == [[2.0] * 4] * SIZES[rank]
        broadcast, *expert = result["cpu"]
        assert broadcast[:4] == ("broadcast_object_list", "pp", (), "object")  # the same whichever rank holds it
        assert [op[0] for op in expert] == ["all_gather", "reduce_scatter"]
        assert expert == result["gpu"], "the CPU stand-ins must record the GPU path's ops"
        assert all(op[1] == "etp" and op[2] == (2, -1, 4) and op[4] == ("sizes", SIZES) for op in expert)
    report = check_order(read_sequences(str(tmp_path)))
    assert report.ok and report.groups == 2, report.format()

"""Human names for process groups, so ledgers and errors say "cp[1,3,5,7]" instead of an object id.

Names are registered by the lifecycle when it creates groups; an unregistered group is named by its ranks.
The name alone (without ranks) is identical on every rank, which makes ledger signatures comparable.
"""
from __future__ import annotations

import torch.distributed as dist

_names: dict[int, tuple[object, str]] = {}  # id(group) -> (group kept alive so the id stays unique, name)


def register_group(name: str, group: object) -> None:
    _names[id(group)] = (group, name)


def forget_group(group: object) -> None:
    _names.pop(id(group), None)


def group_name(group: object | None) -> str:
    if group is None or group is dist.GroupMember.WORLD:
        return "world"
    entry = _names.get(id(group))
    return entry[1] if entry else "unnamed"


def group_ranks(group: object | None) -> tuple[int, ...]:
    if not dist.is_initialized():
        return ()
    try:
        if group is None or group is dist.GroupMember.WORLD:
            return tuple(range(dist.get_world_size()))
        return tuple(dist.get_process_group_ranks(group))
    except (RuntimeError, ValueError):  # destroyed or foreign group: the name still identifies it
        return ()


def group_label(group: object | None) -> str:
    """Name plus global ranks, e.g. 'tp[0,1]'."""
    return f"{group_name(group)}[{','.join(map(str, group_ranks(group)))}]"

"""Human names for process groups, so ledgers and errors say "cp[1,3,5,7]" instead of an object id.

Names are registered by the lifecycle when it creates groups; an unregistered group is named by its ranks.
The name alone (without ranks) is identical on every rank, which makes ledger signatures comparable.
A registered group's (name, ranks, label) is computed once: the ledger asks for it on every collective.
"""
from __future__ import annotations

import torch.distributed as dist

GroupIdentity = tuple[str, tuple[int, ...], str]  # (name, global ranks, label "name[r0,r1]")

REGISTERED: dict[int, tuple[object, GroupIdentity]] = {}  # id(group) -> (group kept alive: unique id, identity)


def register_group(name: str, group: object) -> None:
    ranks = group_ranks(group)
    REGISTERED[id(group)] = (group, (name, ranks, format_label(name, ranks)))


def forget_group(group: object) -> None:
    REGISTERED.pop(id(group), None)


def format_label(name: str, ranks: tuple[int, ...]) -> str:
    return f"{name}[{','.join(map(str, ranks))}]"


def group_identity(group: object | None) -> GroupIdentity:
    entry = REGISTERED.get(id(group))
    if entry is not None:
        return entry[1]
    name, ranks = group_name(group), group_ranks(group)
    return name, ranks, format_label(name, ranks)


def group_name(group: object | None) -> str:
    if group is None or group is dist.GroupMember.WORLD:
        return "world"
    entry = REGISTERED.get(id(group))
    return entry[1][0] if entry else "unnamed"


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
    return group_identity(group)[2]

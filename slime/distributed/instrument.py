"""Record every torch.distributed collective in a Ledger by wrapping the module-level functions.

megatron-core calls collectives as `torch.distributed.X(...)` (or `dist.X` after
`import torch.distributed as dist`), resolved at call time, so replacing the attributes of
`torch.distributed` records megatron's own calls too. isend/irecv are also replaced in
distributed_c10d because P2POp and batch_isend_irecv compare ops by identity against that
module's globals. A few megatron modules bind `dist_all_gather_func` / `dist_reduce_scatter_func`
at import time; those aliases are re-pointed as well (MEGATRON_ALIAS_MODULES). Nested calls (send -> isend, batch_isend_irecv -> isend) record only the outer op.
Point-to-point ops also record their peer (global rank), so that a send can be paired with its receive.
An all-to-all records its per-rank token counts instead of its row count (which differs per rank by
design under expert parallelism): shape (-1, *row shape) and, in the peer slot,
("splits", rows sent to each member, rows received from each member); the order proof pairs them.
The list forms of all_gather / reduce_scatter with rows that differ per member (megatron's expert-TP
gathers) record (members, -1, *row shape) and ("sizes", rows per member): the same on every member.
A stand-in for a collective (slime/patches/megatron_core.py on gloo) records what it replaces with `recorded_as`,
so the CPU sequence is the one a GPU run records.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import threading
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from slime.distributed.ledger import Ledger, error_text

INSTRUMENTED_OPS = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "_reduce_scatter_base",
    "_all_gather_base",
    "broadcast",
    "barrier",
    "monitored_barrier",
    "isend",
    "irecv",
    "send",
    "recv",
    "batch_isend_irecv",
    "all_to_all_single",
    "all_gather_object",
    # module-level calls inside: distributed_c10d's own broadcast/gather/scatter, which the wrappers above miss
    "broadcast_object_list",
    "gather_object",
    "scatter_object_list",
    "reduce_scatter",
    "gather",
    "scatter",
    "reduce",
)
_SPLIT_LIST_ARG = {"all_gather": 0, "reduce_scatter": 1}  # the per-member tensor list of the list forms
# objects differ per member (the source's value, None elsewhere): recorded without a shape
_OBJECT_OPS = frozenset({"broadcast_object_list", "gather_object", "scatter_object_list"})
_ALSO_IN_C10D = ("isend", "irecv")  # identity-checked inside distributed_c10d
_PEER_PARAMS = {"isend": ("dst", "group_dst"), "send": ("dst", "group_dst"),
                "irecv": ("src", "group_src"), "recv": ("src", "group_src")}
_P2P_OPS = (*_PEER_PARAMS, "batch_isend_irecv")

# megatron modules holding import-time aliases of all_gather_into_tensor / reduce_scatter_tensor
MEGATRON_ALIAS_MODULES = (
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.utils",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.transformer.multi_token_prediction",
    "megatron.core.timers",
    "megatron.core.utils",
)
_ALIAS_NAMES = ("dist_all_gather_func", "dist_reduce_scatter_func")

_originals: dict[str, Callable] = {}
_alias_restore: list[tuple[object, str, Callable]] = []
_active: list[Ledger | None] = [None]


class _Depth(threading.local):
    value = 0  # >0 inside a recorded call: nested collectives are not recorded again


_depth = _Depth()


def _describe(args: tuple, kwargs: dict, group_index: int | None) -> tuple[object | None, tuple, str]:
    """(group, shape, dtype) of a call, from the first tensor-like argument."""
    group = kwargs.get("group")
    if group is None and group_index is not None and len(args) > group_index:
        group = args[group_index]
    first = args[0] if args else next(iter(kwargs.values()), None)
    if isinstance(first, torch.Tensor):
        return group, tuple(first.shape), str(first.dtype).removeprefix("torch.")
    if isinstance(first, (list, tuple)) and first and isinstance(first[0], dist.P2POp):
        shapes = tuple((type_name(p.op), tuple(p.tensor.shape)) for p in first)
        return first[0].group, shapes, str(first[0].tensor.dtype).removeprefix("torch.")
    if isinstance(first, (list, tuple)) and first and isinstance(first[0], torch.Tensor):
        return group, (len(first),) + tuple(first[0].shape), str(first[0].dtype).removeprefix("torch.")
    return group, (), ""


def split_record(sizes, row_shape: tuple) -> tuple[tuple, tuple | None]:
    """(shape, peer) recorded for a list-form collective with `sizes` rows per member."""
    sizes = tuple(int(n) for n in sizes)
    if len(set(sizes)) <= 1:
        return (len(sizes), *sizes[:1], *row_shape), None
    return (len(sizes), -1, *row_shape), ("sizes", sizes)


def _describe_split(name: str, args: tuple, kwargs: dict, group_index: int | None):
    """(group, shape, dtype, peer) of all_gather(list, t) / reduce_scatter(t, list)."""
    group = kwargs.get("group")
    if group is None and group_index is not None and len(args) > group_index:
        group = args[group_index]
    index = _SPLIT_LIST_ARG[name]
    tensors = args[index] if len(args) > index else kwargs.get(("tensor_list", "input_list")[index])
    if not tensors or not tensors[0].dim():
        return group, (len(tensors or ()),), str(tensors[0].dtype).removeprefix("torch.") if tensors else "", None
    shape, peer = split_record([t.shape[0] if t.dim() else 1 for t in tensors], tuple(tensors[0].shape[1:]))
    return group, shape, str(tensors[0].dtype).removeprefix("torch."), peer


@contextlib.contextmanager
def recorded_as(op: str, group: object | None, shape: tuple, dtype: object, peer: tuple | None = None):
    """Record the collectives inside as the one op they stand in for."""
    ledger = _active[0]
    if ledger is None or _depth.value:
        yield
        return
    entry = ledger.begin_p2p(op, group, shape, dtype, peer)
    _depth.value = 1
    try:
        yield
    except BaseException as exc:
        _depth.value = 0
        ledger.end(entry, error_text(exc))
        raise
    _depth.value = 0
    ledger.end(entry)


def type_name(op: Callable) -> str:
    return getattr(op, "__name__", str(op))


def _wrap(name: str, original: Callable) -> Callable:
    params = list(inspect.signature(original).parameters)
    group_index = params.index("group") if "group" in params else None
    objects = name in _OBJECT_OPS

    @functools.wraps(original)
    def recorded(*args, **kwargs):  # the hot path: no context manager, see ledger.py
        ledger = _active[0]
        if ledger is None or _depth.value:
            return original(*args, **kwargs)
        first = args[0] if args else None
        if objects:
            group = args[group_index] if group_index is not None and len(args) > group_index else kwargs.get("group")
            entry = ledger.begin(name, group, (), "object")
        elif isinstance(first, torch.Tensor):  # the common case inline; the ledger formats shape/dtype when read
            group = args[group_index] if group_index is not None and len(args) > group_index else kwargs.get("group")
            entry = ledger.begin(name, group, first.shape, first.dtype)
        else:
            entry = ledger.begin(name, *_describe(args, kwargs, group_index))
        return _run_recorded(ledger, entry, original, args, kwargs)

    recorded.__slime_original__ = original
    return recorded


def _wrap_split(name: str, original: Callable) -> Callable:
    """Like _wrap, for the list forms whose members' rows may differ (split_record)."""
    params = list(inspect.signature(original).parameters)
    group_index = params.index("group") if "group" in params else None

    @functools.wraps(original)
    def recorded(*args, **kwargs):
        ledger = _active[0]
        if ledger is None or _depth.value:
            return original(*args, **kwargs)
        entry = ledger.begin_p2p(name, *_describe_split(name, args, kwargs, group_index))
        return _run_recorded(ledger, entry, original, args, kwargs)

    recorded.__slime_original__ = original
    return recorded


def _peer_getter(name: str, params: list[str]) -> Callable:
    """(args, kwargs, group) -> the global peer rank of a send/recv, or the peers of a batch in order."""
    if name == "batch_isend_irecv":
        return lambda args, kwargs, group: tuple(p.peer for p in (args[0] if args else kwargs["p2p_op_list"]))
    peer_param, group_peer_param = _PEER_PARAMS[name]
    peer_index = params.index(peer_param)

    def peer_of(args: tuple, kwargs: dict, group: object | None) -> int | None:
        peer = args[peer_index] if len(args) > peer_index else kwargs.get(peer_param)
        group_peer = kwargs.get(group_peer_param)
        if peer is None and group_peer is not None:
            return dist.get_global_rank(group, group_peer)
        return peer

    return peer_of


def _wrap_p2p(name: str, original: Callable) -> Callable:
    """Like _wrap, for point-to-point ops: the ledger entry also names the peer(s)."""
    params = list(inspect.signature(original).parameters)
    group_index = params.index("group") if "group" in params else None
    peer_of = _peer_getter(name, params)

    @functools.wraps(original)
    def recorded(*args, **kwargs):
        ledger = _active[0]
        if ledger is None or _depth.value:
            return original(*args, **kwargs)
        group, shape, dtype = _describe(args, kwargs, group_index)
        entry = ledger.begin_p2p(name, group, shape, dtype, peer_of(args, kwargs, group))
        return _run_recorded(ledger, entry, original, args, kwargs)

    recorded.__slime_original__ = original
    return recorded


def _run_recorded(ledger: Ledger, entry: list, original: Callable, args: tuple, kwargs: dict):
    """Call the op with nested collectives unrecorded; its ledger entry ends with the op (or its error)."""
    _depth.value = 1
    try:
        result = original(*args, **kwargs)
    except BaseException as exc:
        ledger.end(entry, error_text(exc))
        raise
    finally:
        _depth.value = 0
    ledger.end(entry)
    return result


def _a2a_splits(output, input_, output_split_sizes, input_split_sizes, group) -> tuple:
    members = dist.get_world_size(group)
    even = lambda t: [t.shape[0] // members] * members
    sent = [int(n) for n in input_split_sizes] if input_split_sizes is not None else even(input_)
    received = [int(n) for n in output_split_sizes] if output_split_sizes is not None else even(output)
    return "splits", tuple(sent), tuple(received)


def _wrap_all_to_all(original: Callable) -> Callable:
    """all_to_all_single: the same row shape on every member, each member's token counts beside it."""

    @functools.wraps(original)
    def recorded(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        ledger = _active[0]
        if ledger is None or _depth.value:
            return original(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)
        splits = _a2a_splits(output, input, output_split_sizes, input_split_sizes, group)
        entry = ledger.begin_p2p("all_to_all_single", group, (-1, *input.shape[1:]), input.dtype, splits)
        return _run_recorded(ledger, entry, original, (output, input, output_split_sizes, input_split_sizes),
                             dict(group=group, async_op=async_op))

    recorded.__slime_original__ = original
    return recorded


def instrument_collectives(ledger: Ledger) -> None:
    """Route all collectives of this process into `ledger` (idempotent; re-targets if called again)."""
    _active[0] = ledger
    if _originals:
        return
    for name in INSTRUMENTED_OPS:
        original = getattr(dist, name)
        _originals[name] = original
        callee = _without_deprecation_warning(original)
        if name == "all_to_all_single":
            wrapped = _wrap_all_to_all(callee)
        elif name in _SPLIT_LIST_ARG:
            wrapped = _wrap_split(name, callee)
        else:
            wrapped = (_wrap_p2p if name in _P2P_OPS else _wrap)(name, callee)
        setattr(dist, name, wrapped)
        if name in _ALSO_IN_C10D:
            setattr(c10d, name, wrapped)
    _repoint_megatron_aliases()


def _without_deprecation_warning(op: Callable) -> Callable:
    """The function under a `@deprecated` op's wrappers (torch 2.13 deprecates all_gather_into_tensor and
    reduce_scatter_tensor, which megatron calls several times a layer): the same op without a FutureWarning per call,
    whose filter lookup cost the CPU step about 8 % of its Python time, nor c10d's error log around it (this module
    records errors)."""
    return inspect.unwrap(op) if getattr(op, "__deprecated__", None) is not None else op


def _repoint_megatron_aliases() -> None:
    wrapped_by_original = {id(orig): getattr(dist, name) for name, orig in _originals.items()}
    for module_name in MEGATRON_ALIAS_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # megatron absent (pure torch use): nothing to re-point
            continue
        for alias in _ALIAS_NAMES:
            current = getattr(module, alias, None)
            if current is not None and id(current) in wrapped_by_original:
                _alias_restore.append((module, alias, current))
                setattr(module, alias, wrapped_by_original[id(current)])


def uninstrument_collectives() -> None:
    """Restore the original functions (tests)."""
    for name, original in _originals.items():
        setattr(dist, name, original)
        if name in _ALSO_IN_C10D:
            setattr(c10d, name, original)
    for module, alias, original in _alias_restore:
        setattr(module, alias, original)
    _alias_restore.clear()
    _originals.clear()
    _active[0] = None

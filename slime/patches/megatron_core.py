"""Runtime patches of megatron-core (0.16.x, written defensively for 0.19).

`apply_thd_rope()` (every machine): the unfused THD RoPE without a host-device sync per layer.
megatron's `_apply_rotary_pos_emb_thd` (used whenever TransformerEngine's fused RoPE is not)
calls `.tolist()` on the GPU `cu_seqlens` for the query and the key of every layer of every
forward: the host waits for the GPU twice per layer (measured on one H200: 2.6 s of a 6.9 s
step; benchmarks/RESULTS.md). The replacement computes each token's position on cu_seqlens'
device instead (same positions, same rotation code, bit-identical results), so the host keeps
queueing kernels ahead of the GPU.

`apply_grad_norm_without_host_sync()` (every machine, where Apex is absent): grad clipping's norm
without a host-device sync per parameter, and its norms and scaling as multi-tensor kernels.

`apply_moe_identity_sort()` (every machine): the alltoall MoE dispatcher skips its re-sort of the
received tokens by local expert where that order is the identity (one rank in EP x expert-TP), instead
of copying every routed row into the same order.

`apply_permute_without_host_sync()` (every machine): the MoE dispatcher's token permutation in a dropless run
without its two host-device syncs per layer (megatron's `masked_select`), the same rows in the same order.

`apply_batched_optimizer_copies()` (every machine): the distributed optimizer's two per-parameter copy loops
(model grads -> fp32 main grads before the step, fp32 main params -> the model's param buffer after it) as
multi-tensor copies over views made once per optimizer, instead of a Python loop of range lookups, slices and
one kernel per parameter (about 2,100 of each in a Qwen3-30B-A3B-shaped step at EP1). The same values.

`apply_in_process_save_results()` (every machine): a checkpoint save hands its write results to itself through
an in-process queue; megatron's queue lives in a Manager process it spawns per rank at the first save (a fresh
interpreter, ~2 CPU-s), which only its background save (not used here: `--async-save` saves synchronously) needs.

`import_megatron()` (every machine, before anything imports megatron-core): its `jit_fuser` is torch.compile,
applied to a score of functions as they are defined, and wrapping a function pulls in inductor (~1.3 CPU-s in every
process, most of megatron's import beyond torch); imported through this, the functions are wrapped at their first
call instead, and compiled there only where `--fused-kernels` resolved to compile (slime/models/fused_kernels.py),
else they run as written, as the flag's eager (the unfused reference, and CPU's default under auto) promises. A GPU
run under auto compiles them at their first call. On CPU the gated attention's output gate is the one called;
compiled, its C++ kernel would cost each rank ~5 CPU-s of tracing, header preprocessing and vector-ISA probes.

`apply_router_padding_mask()` (every machine): the MoE router's padding mask, so padding tokens are
not counted by the expert-bias update or the aux losses (three spots of megatron's path, below).

`apply()` (machines without CUDA only) lets megatron-core train on CPU with gloo:

megatron-core assumes CUDA in a handful of places that have nothing to do with the maths:
`torch.cuda.current_device()` used as a tensor device, literal `device="cuda"`, the CUDA RNG
tracker, CUDA streams/events/synchronize, and `tensor.type() == 'torch.cuda.FloatTensor'`
checks. On a machine without CUDA every one of these can only raise, so mapping them to
their CPU equivalents changes no code path that could have worked. Nothing here is applied
when CUDA is available (`patches.apply_all()` checks).

Mechanism, chosen to stay local to megatron-core:
- Each loaded `megatron.core.*` module gets a `torch` proxy in its globals: identical to torch
  except that `torch.cuda` is a CPU stand-in and tensor factories map a CUDA device to CPU.
  Other libraries (transformers, ray, our own code) keep the real torch.
- A few functions are replaced outright where the proxy cannot reach (Tensor methods).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import queue
import sys
import types
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from slime.models import fused_kernels

_APPLIED = False

# Modules the training path imports; importing them before swapping `torch` makes sure they
# are patched. Missing ones (layout changes between releases) are skipped.
_MODULES_TO_LOAD = (
    "megatron.core.parallel_state",
    "megatron.core.utils",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.random",
    "megatron.core.tensor_parallel.utils",
    "megatron.core.tensor_parallel.data",
    "megatron.core.tensor_parallel.cross_entropy",
    "megatron.core.transformer.utils",
    "megatron.core.transformer.module",
    "megatron.core.transformer.attention",
    "megatron.core.transformer.multi_latent_attention",
    "megatron.core.transformer.dot_product_attention",
    "megatron.core.transformer.transformer_layer",
    "megatron.core.transformer.transformer_block",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding",
    "megatron.core.models.common.embeddings.rope_utils",
    "megatron.core.models.common.embeddings.language_model_embedding",
    "megatron.core.models.common.language_module.language_module",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.optimizer",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.optimizer_param_scheduler",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.dist_checkpointing",
    "megatron.core.dist_checkpointing.exchange_utils",
    "megatron.core.dist_checkpointing.tensor_aware_state_dict",
    "megatron.core.dist_checkpointing.strategies.torch",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.strategies.fully_parallel",
    "megatron.core.dist_checkpointing.strategies.async_utils",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.transformer.moe.experts",
    "megatron.core.transformer.moe.moe_layer",
    "megatron.core.transformer.moe.shared_experts",
)

_FACTORIES = (
    "tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn",
    "randint", "eye", "linspace", "zeros_like", "ones_like", "empty_like", "full_like",
)


def _cpu_device(device: Any) -> Any:
    """Map any CUDA device spelling (\"cuda\", \"cuda:0\", torch.device('cuda'), an int) to CPU."""
    if isinstance(device, int) and not isinstance(device, bool):
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


def _factory_on_cpu(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        kwargs.pop("pin_memory", None)  # pinning needs an accelerator; meaningless on CPU
        return fn(*args, **kwargs)

    return wrapper


class _NoOpStream:
    """Stands in for torch.cuda.Stream/Event: CPU ops are synchronous, so ordering is a no-op."""

    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return _NoOpStream()

    def record(self, *args, **kwargs):
        pass

    def wait(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, *args):
        return 0.0


class _CpuCuda(types.ModuleType):
    """`torch.cuda` as megatron-core sees it on a CPU-only machine."""

    def __init__(self):
        super().__init__("torch.cuda")
        self.current_device = lambda: torch.device("cpu")
        self.device_count = lambda: 0
        self.is_available = lambda: False
        self.synchronize = lambda *a, **k: None
        self.empty_cache = lambda: None
        self.Stream = _NoOpStream
        self.Event = _NoOpStream
        self.current_stream = lambda *a, **k: _NoOpStream()
        self.default_stream = lambda *a, **k: _NoOpStream()
        self.stream = lambda *a, **k: contextlib.nullcontext()
        self.device = lambda *a, **k: contextlib.nullcontext()
        self.set_device = lambda *a, **k: None
        self.memory_allocated = lambda *a, **k: 0
        self.max_memory_allocated = lambda *a, **k: 0
        self.memory_reserved = lambda *a, **k: 0
        self.max_memory_reserved = lambda *a, **k: 0
        # The "CUDA" RNG of a CPU run is the CPU generator: it is what dropout draws from.
        self.get_rng_state = lambda *a, **k: torch.get_rng_state()
        self.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
        self.manual_seed = lambda seed: torch.manual_seed(seed)
        self.manual_seed_all = lambda seed: torch.manual_seed(seed)
        self.FloatTensor = torch.FloatTensor
        self.HalfTensor = torch.HalfTensor
        self.BFloat16Tensor = torch.BFloat16Tensor
        self.random = types.SimpleNamespace(
            get_rng_state=self.get_rng_state, set_rng_state=self.set_rng_state
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


class _CpuTorch(types.ModuleType):
    """The `torch` module as megatron-core sees it on a CPU-only machine."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = _CpuCuda()
        for name in _FACTORIES:
            setattr(self, name, _factory_on_cpu(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


_CPU_TORCH = _CpuTorch()


def _swap_torch_in_megatron_modules() -> None:
    """Give every loaded megatron.core module the CPU torch proxy (fixes current_device()/"cuda")."""
    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.core") and getattr(module, "torch", None) is torch:
            module.torch = _CPU_TORCH


@contextlib.contextmanager
def _cpu_tensors_report_cuda_type():
    """Within a call, CPU float tensors answer `.type()` as their CUDA counterparts.

    megatron's optimizers and grad clipping assert `param.type() == 'torch.cuda.FloatTensor'`
    (a dtype check written as a device check). Scoped to those calls only.
    """
    original = torch.Tensor.type

    def cuda_named_type(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        if not args and not kwargs and isinstance(result, str) and result.startswith("torch.") \
                and not result.startswith("torch.cuda."):
            return "torch.cuda." + result[len("torch."):]
        return result

    torch.Tensor.type = cuda_named_type
    try:
        yield
    finally:
        torch.Tensor.type = original


@contextlib.contextmanager
def _tensor_cuda_is_identity():
    """Within a call, `tensor.cuda()` returns the tensor: megatron moves freshly built CPU
    tensors to the GPU before a collective; on a CPU-only machine they already are where
    gloo needs them."""
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.Tensor.cuda = original


def _wrap_scoped(owner: Any, attr: str, scope: Callable) -> None:
    """Run owner.attr inside `scope()`, keeping staticmethod/classmethod descriptors."""
    raw = vars(owner).get(attr) if isinstance(owner, type) else getattr(owner, attr, None)
    if raw is None:
        return
    kind = type(raw) if isinstance(raw, (staticmethod, classmethod)) else None
    fn = raw.__func__ if kind else raw
    if getattr(fn, "_slime_cpu_patched", False):
        return

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with scope():
            return fn(*args, **kwargs)

    wrapper._slime_cpu_patched = True
    setattr(owner, attr, kind(wrapper) if kind else wrapper)


def _wrap_with_cuda_type_names(owner: Any, attr: str) -> None:
    _wrap_scoped(owner, attr, _cpu_tensors_report_cuda_type)


def _patch_tied_embedding_sync() -> None:
    """PP>1 with tied embeddings: the first/last-stage weight sync calls `.cuda()`."""
    language_module = importlib.import_module(
        "megatron.core.models.common.language_module.language_module")
    cls = getattr(language_module, "LanguageModule", None)
    if cls is not None:
        _wrap_scoped(cls, "setup_embeddings_and_output_layer", _tensor_cuda_is_identity)


def _patch_type_checks() -> None:
    clip_grads = importlib.import_module("megatron.core.optimizer.clip_grads")
    _wrap_with_cuda_type_names(clip_grads, "clip_grad_by_total_norm_fp32")
    optimizer_mod = importlib.import_module("megatron.core.optimizer.optimizer")
    float16_cls = getattr(optimizer_mod, "Float16OptimizerWithFloat16Params", None)
    if float16_cls is not None:
        _wrap_with_cuda_type_names(float16_cls, "__init__")
    distrib = importlib.import_module("megatron.core.optimizer.distrib_optimizer")
    distrib_cls = getattr(distrib, "DistributedOptimizer", None)
    if distrib_cls is not None:
        _wrap_with_cuda_type_names(distrib_cls, "_build_model_and_main_param_groups")
    # Optimizer modules bind clip_grad_by_total_norm_fp32 by name at import.
    for module in (optimizer_mod, distrib):
        if hasattr(module, "clip_grad_by_total_norm_fp32"):
            module.clip_grad_by_total_norm_fp32 = clip_grads.clip_grad_by_total_norm_fp32


def _patch_moe_split_sizes() -> None:
    """The alltoall token dispatcher hands its split sizes to all_to_all_single after
    `maybe_move_tensor_to_cpu(..., as_numpy=True)`, which converts only CUDA tensors; CPU tensors
    stay tensors, which the binding refuses. Convert CPU ones too (same values)."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    original = moe_utils.maybe_move_tensor_to_cpu

    def move_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
        moved = original(tensor, as_numpy=as_numpy, record_stream=record_stream)
        return moved.numpy() if as_numpy and torch.is_tensor(moved) else moved

    for module in (moe_utils, token_dispatcher):
        if hasattr(module, "maybe_move_tensor_to_cpu"):
            module.maybe_move_tensor_to_cpu = move_to_cpu


def _hybrid_split_on_cpu(self, offload_fraction: float) -> tuple:
    """HybridDeviceOptimizer._get_sub_optimizer_param_groups where the training device is the CPU: megatron
    offloads CUDA parameters only and files every other one as already offloaded (without the host copy its step
    looks up). Here the parameters are the device's: the first `offload_fraction` of their elements, in group order,
    get a host copy that the host optimizers update and copy back after each step, as CUDA parameters do; fp32
    copies of 16-bit parameters where the update runs in fp32, as megatron makes them."""
    total = sum(p.numel() for g in self.param_groups for p in g["params"])
    threshold, offloaded = total * offload_fraction, 0
    host_groups, device_groups = [], []
    host_copy, device_param, fp32_copy = {}, {}, {}
    for group in self.param_groups:
        host, device = {**group, "params": []}, {**group, "params": []}
        for param in group["params"]:
            inner, to_host = param, offloaded < threshold
            if to_host:
                inner = param.detach().clone()
                offloaded += param.numel()
            if self.param_update_in_fp32 and inner.dtype != torch.float32:
                inner = inner.detach().clone().float()
                fp32_copy[param] = inner
            if to_host:
                host_copy[param], device_param[inner] = inner, param
            (host if to_host else device)["params"].append(inner)
        host_groups += [host] if host["params"] else []
        device_groups += [device] if device["params"] else []
    return host_groups, device_groups, host_copy, device_param, fp32_copy


def _patch_hybrid_optimizer_split() -> None:
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

    HybridDeviceOptimizer._get_sub_optimizer_param_groups = _hybrid_split_on_cpu


def _patch_uneven_sequence_collectives() -> None:
    """gloo has no all-gather / reduce-scatter with per-rank sizes (the expert-TP group of the alltoall
    dispatcher uses them when ETP > 1: each ETP rank routes its own token count). Same results:
    the gather pads every rank's rows to the largest count, gathers, and drops the padding; the
    reduce-scatter all-reduces the whole tensor and keeps this rank's rows. Each records, in the ledger,
    the list-form op it replaces (slime/distributed/instrument.py: recorded_as), so the order proof checks
    the sequence a GPU run records."""
    from megatron.core.tensor_parallel import mappings

    from slime.distributed.instrument import recorded_as, split_record

    gather, reduce_scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim

    def gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(n) for n in output_split_sizes]
        width = max(sizes)
        padded = input_.new_zeros((width, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        out = input_.new_empty((width * len(sizes), *input_.shape[1:]))
        with recorded_as("all_gather", group, *_split_record(sizes, input_)):
            dist.all_gather_into_tensor(out, padded.contiguous(), group=group)
        return torch.cat([out[r * width: r * width + n] for r, n in enumerate(sizes)])

    def reduce_scatter_along_first_dim(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return reduce_scatter(input_, group, input_split_sizes, use_global_buffer)
        total = input_.contiguous().clone()
        with recorded_as("reduce_scatter", group, *_split_record(input_split_sizes, input_)):
            dist.all_reduce(total, group=group)
        return list(torch.split(total, [int(n) for n in input_split_sizes], dim=0))[group.rank()].contiguous()

    def _split_record(sizes, input_: torch.Tensor) -> tuple:
        shape, peer = split_record(sizes, tuple(input_.shape[1:]))
        return shape, str(input_.dtype).removeprefix("torch."), peer

    mappings._gather_along_first_dim = gather_along_first_dim
    mappings._reduce_scatter_along_first_dim = reduce_scatter_along_first_dim


def _patch_rng() -> None:
    """The tensor-parallel RNG tracker keeps CPU generator states instead of CUDA ones."""
    random = importlib.import_module("megatron.core.tensor_parallel.random")
    # CUDA generator state accessors -> CPU generator (the one CPU dropout uses).
    random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    random._set_cuda_rng_state = lambda new_state, *args, **kwargs: torch.set_rng_state(new_state)
    tracker_cls = getattr(random, "CudaRNGStatesTracker", None)
    if tracker_cls is not None:
        tracker_cls.fork = _cpu_fork


@contextlib.contextmanager
def _cpu_fork(self, name: str = "model-parallel-rng"):  # megatron's _MODEL_PARALLEL_RNG_TRACKER_NAME
    """CudaRNGStatesTracker.fork on CPU: run the block under the tracked state of `name`.

    Upstream's fork warns whenever the CPU state changes inside the block; on CPU the tracked
    state *is* the CPU generator, so that warning would fire on every use.
    """
    if name not in self.states_:
        raise Exception(f"rng state {name} is not added")
    outer_state = torch.get_rng_state()
    outer_name = getattr(self, "_current_state_name", "default-rng")
    torch.set_rng_state(self.states_[name])
    self._current_state_name = name
    try:
        yield
    finally:
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(outer_state)
        self._current_state_name = outer_name


def _patch_rope_cp_slice() -> None:
    """get_pos_emb_on_this_cp_rank builds a pinned index and calls `.cuda()` on it."""
    rope_utils = importlib.import_module("megatron.core.models.common.embeddings.rope_utils")

    def pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group):
        cp_size, cp_rank = cp_group.size(), cp_group.rank()
        index = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=pos_emb.device)
        shape = pos_emb.shape
        pos_emb = pos_emb.view(*shape[:seq_dim], 2 * cp_size, -1, *shape[seq_dim + 1:])
        pos_emb = pos_emb.index_select(seq_dim, index)
        return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 2:])

    rope_utils.get_pos_emb_on_this_cp_rank = pos_emb_on_this_cp_rank
    for name in ("rotary_pos_embedding", "yarn_rotary_pos_embedding"):  # both import it by name
        module = importlib.import_module(f"megatron.core.models.common.embeddings.{name}")
        if hasattr(module, "get_pos_emb_on_this_cp_rank"):
            module.get_pos_emb_on_this_cp_rank = pos_emb_on_this_cp_rank


# ------------------------------------------------------------------ THD RoPE (every machine)
_UPSTREAM_THD_ROPE: dict[str, Callable] = {}
_ROPE_MODULES = ("megatron.core.models.common.embeddings.rope_utils",
                 "megatron.core.models.common.embeddings.rotary_pos_embedding")


def thd_rope_positions(cu_seqlens: torch.Tensor, num_local_tokens: int, cp_size: int, cp_rank: int,
                       *, batch_offsets: bool) -> torch.Tensor:
    """Row of the RoPE frequency table for every local token of a THD batch, on cu_seqlens' device.

    cu_seqlens: [b+1] cumulative FULL padded lengths. Sequence i contributes (cu[i+1]-cu[i])/cp
    local tokens: its zig-zag chunks cp_rank and 2*cp-1-cp_rank (megatron's CP layout). Positions
    count from each sequence's start; with batch_offsets (a frequency table as long as the whole
    batch) the sequence's start in the batch is added, as megatron does in that case.
    """
    cu = cu_seqlens.to(torch.int64)
    local_cu = cu // cp_size
    token = torch.arange(num_local_tokens, device=cu.device)
    seq = torch.searchsorted(local_cu[1:], token, right=True)
    offset = token - local_cu[seq]
    half = (local_cu[seq + 1] - local_cu[seq]) // 2
    first_chunk_pos = cp_rank * half + offset
    second_chunk_pos = (2 * cp_size - 1 - cp_rank) * half + offset - half
    positions = torch.where(offset < half, first_chunk_pos, second_chunk_pos) if cp_size > 1 else offset
    return positions + cu[seq] if batch_offsets else positions


def _thd_rope_without_host_sync(t, cu_seqlens, freqs, rotary_interleaved=False, multi_latent_attention=False,
                                mscale=1.0, cp_group=None):
    """Same contract as megatron's _apply_rotary_pos_emb_thd: t [t, h, d], freqs [max_s, 1, 1, d]."""
    if cp_group is None:
        raise ValueError("cp_group must be provided for THD format RoPE")
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    # megatron picks batch offsets when freqs.size(0) == cu_seqlens[-1]; the local tokens are
    # cu_seqlens[-1] / cp, so the same test needs no device read
    positions = thd_rope_positions(cu_seqlens, t.size(0), cp_size, cp_rank,
                                   batch_offsets=freqs.size(0) == t.size(0) * cp_size)
    # the rotation itself stays megatron's (rotate-half / interleaved / MLA variants, mscale), compiled
    # with the frequency gather under --fused-kernels compile
    return fused_kernels.rotary_bshd(t, freqs, positions, rotary_interleaved, multi_latent_attention, mscale)


def apply_thd_rope(enabled: bool = True) -> None:
    """Install the sync-free THD RoPE in megatron-core (idempotent); `enabled=False` puts
    megatron's own back (the "old" side of benchmarks/bench_step_gpu.py)."""
    for name in _ROPE_MODULES:
        module = importlib.import_module(name)
        _UPSTREAM_THD_ROPE.setdefault(name, module._apply_rotary_pos_emb_thd)
        module._apply_rotary_pos_emb_thd = _thd_rope_without_host_sync if enabled else _UPSTREAM_THD_ROPE[name]


def thd_rope_in_use() -> str:
    """"patched" or "megatron": which THD RoPE megatron-core's attention calls now."""
    rope_utils = importlib.import_module(_ROPE_MODULES[0])
    return "patched" if rope_utils._apply_rotary_pos_emb_thd is _thd_rope_without_host_sync else "megatron"


# ------------------------------------------------------------------ MLA without TransformerEngine (every machine)
def apply_mla_without_te() -> None:
    """multi_latent_attention.HAVE_TE is True even without TransformerEngine: megatron's TE extension
    stands MagicMocks in for the TE classes, so MLA's `isinstance(linear_proj, TELinear)` raises.
    Without TE those checks must be False; flipping the flag keeps megatron's own branches."""
    try:
        import transformer_engine  # noqa: F401
        return
    except ImportError:
        pass
    from megatron.core.transformer import multi_latent_attention

    multi_latent_attention.HAVE_TE = False


# ------------------------------------------------------------------ MoE without TransformerEngine (every machine)
def define_missing_te_gemm() -> None:
    """megatron-core 0.16's router GEMM tests `te_general_gemm is not None`, a name it binds only when
    TransformerEngine imports: without TE the router raises NameError. Binding it to None selects the
    torch.mm branch megatron already has (the result is the same GEMM)."""
    try:
        from megatron.core.transformer.moe import moe_utils
    except ImportError:
        return
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


# ------------------------------------------------------------------ TE version checks without TE (every machine)
def _te_at_least(original: Callable) -> Callable:
    @functools.wraps(original)
    def at_least(version, check_equality=True):
        from megatron.core.utils import get_te_version

        return get_te_version() is not None and original(version, check_equality=check_equality)

    return at_least


def apply_te_version_checks_without_te() -> None:
    """megatron-core 0.16's `is_te_min_version` compares None with a version where TransformerEngine is absent
    (TypeError); its optimizer config asks it for any precision-aware optimizer, the one in the hybrid CPU optimizer
    too, which needs no TE. Without TE no TE version is at least any version: False, megatron's own fallback."""
    from megatron.core import optimizer
    from megatron.core.optimizer import optimizer_config

    for module in (optimizer, optimizer_config):
        if not getattr(module.is_te_min_version, "_slime_without_te", False):
            module.is_te_min_version = _te_at_least(module.is_te_min_version)
            module.is_te_min_version._slime_without_te = True


# ------------------------------------------------------------------ the hybrid CPU optimizer (every machine)
def _state_to_its_parameters_device(self) -> None:
    """Each sub-optimizer's state tensors on the device of the parameter they belong to (host copies on the host,
    the device optimizer's parameters on the device). megatron tells the two apart by class, which fails where
    both are torch's AdamW (no TransformerEngine or Apex) and names "cuda" where the device is the CPU."""
    for optimizer in self.sub_optimizers:
        for param, state in optimizer.state.items():
            orig_param = self.inner_param_to_orig_param.get(param, param)
            for key, value in state.items():
                if torch.is_tensor(value):
                    self.state[orig_param][key] = state[key] = value.to(param.device)


def apply_hybrid_optimizer_state_devices() -> None:
    """HybridDeviceOptimizer moves a loaded state to its sub-optimizers' devices (`_move_new_state_to_right_device`)
    by the parameter each state belongs to, not by the sub-optimizer's class."""
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

    HybridDeviceOptimizer._move_new_state_to_right_device = _state_to_its_parameters_device


# ------------------------------------------------------------------ a fresh distributed optimizer's state dict (every machine)
def _state_dict_before_the_first_step(original: Callable) -> Callable:
    @functools.wraps(original)
    def state_dict(self):
        from megatron.core.optimizer import distrib_optimizer

        inner = self.optimizer
        if distrib_optimizer.HAVE_APEX_OR_TE or inner is None or len(inner.state) > 0:
            return original(self)
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "step": 0} for g in inner.state_dict()["param_groups"]]
        out = {"optimizer": {"param_groups": groups}}
        if self.grad_scaler:
            out["grad_scaler"] = self.grad_scaler.state_dict()
        return out

    state_dict._slime_fresh_step = True
    return state_dict


def _saved_step(state_dict: dict) -> float | None:
    steps = {g["step"] for g in state_dict.get("optimizer", {}).get("param_groups", ()) if "step" in g}
    return float(steps.pop()) if len(steps) == 1 else None


def _loaded_state_completed(original: Callable) -> Callable:
    @functools.wraps(original)
    def load_state_dict(self, state_dict):
        from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

        original(self, state_dict)
        hybrid = isinstance(self.optimizer, HybridDeviceOptimizer)
        if hybrid and state_dict.get("param_state_sharding_type") == "dp_reshardable":
            self.optimizer._sync_hdo_state_to_sub_optimizers()
        step = _saved_step(state_dict)
        for inner in (self.optimizer.sub_optimizers if hybrid else [self.optimizer] if self.optimizer else []):
            for state in inner.state.values():
                old = state.get("step")
                if step is not None and torch.is_tensor(old):
                    state["step"] = torch.tensor(step, dtype=old.dtype, device=old.device)

    load_state_dict._slime_completed = True
    return load_state_dict


def apply_fresh_optimizer_state_dict() -> None:
    """Two spots of megatron's DistributedOptimizer on the way of a resumed run where TransformerEngine and Apex are
    absent (torch's Adam):
    - `state_dict` reads the Adam step from torch's per-parameter states and asserts there is exactly one: before
      the first step there are none, and a checkpoint load into a fresh optimizer stops on that assert (the load asks
      for the state dict to lay out what it reads). A fresh optimizer's step is 0; the load replaces it.
    - `load_state_dict` from the `dp_reshardable` format (the one saved here) copies each parameter's `step` from the
      load request, i.e. from the optimizer being loaded into (0 when fresh), over the saved step it set from the
      saved param groups; and it gives every state one shared `step` tensor, which torch's Adam increments in place
      once per parameter. Each state gets its own tensor holding the saved step. The hybrid CPU optimizer's loaded
      master weights and moments reach its sub-optimizers as megatron's other two loaders hand them
      (`_sync_hdo_state_to_sub_optimizers`); this loader leaves them in the outer state only."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if not getattr(DistributedOptimizer.state_dict, "_slime_fresh_step", False):
        DistributedOptimizer.state_dict = _state_dict_before_the_first_step(DistributedOptimizer.state_dict)
    if not getattr(DistributedOptimizer.load_state_dict, "_slime_completed", False):
        DistributedOptimizer.load_state_dict = _loaded_state_completed(DistributedOptimizer.load_state_dict)


# ------------------------------------------------------------------ the MoE router's padding mask (every machine)
def _count_real_tokens(self, routing_map: torch.Tensor, padding_mask: torch.Tensor | None = None) -> None:
    """TopKRouter._apply_expert_bias with the [tokens] padding mask applied per token."""
    if self.enable_expert_bias and torch.is_grad_enabled():
        with torch.no_grad():
            if padding_mask is not None:
                routing_map = routing_map & ~padding_mask.reshape(-1, 1)
            self.local_tokens_per_expert += routing_map.sum(dim=0)


def _counts_with_nonzero_total(original: Callable) -> Callable:
    @functools.wraps(original)
    def counts(routing_map, reduce_group, topk=None, with_padding_mask=False):
        per_expert, local, total = original(routing_map, reduce_group, topk=topk, with_padding_mask=with_padding_mask)
        if with_padding_mask:  # a group holding padding only: its aux loss is 0 * 0 instead of 0 / 0
            total = torch.where(total > 0, total, torch.ones_like(total))
        return per_expert, local, total

    counts.slime_nonzero_total = True
    return counts


def _scatter_mask_on_later_stages(original: Callable) -> Callable:
    @functools.wraps(original)
    def preprocess(self, *args, **kwargs):
        out, input_ids = original(self, *args, **kwargs), kwargs.get("input_ids")
        if len(out) > 5 and out[5] is not None and input_ids is not None and self.config.sequence_parallel \
                and out[5].shape[-1] == input_ids.shape[-1]:
            from megatron.core.tensor_parallel import scatter_to_sequence_parallel_region

            mask = scatter_to_sequence_parallel_region(out[5].transpose(0, 1).contiguous()).transpose(0, 1)
            out = (*out[:5], mask.contiguous(), *out[6:])
        return out

    preprocess.slime_sp_mask = True
    return preprocess


def apply_router_padding_mask() -> None:
    """megatron-core 0.16 takes a padding mask (GPTModel.forward(padding_mask=...), True = padding) down to the MoE
    router, which leaves those tokens out of the aux losses and the expert-bias token counts. Three spots of that
    path need help (idempotent):
    - the expert-bias count ANDs the [tokens, experts] routing map with the [tokens] mask, which broadcasts it over
      the experts axis (an error, or the wrong tokens when both counts agree): masked per token instead;
    - a group whose tokens are all padding (a padding micro-batch) divides its aux loss by a zero token total
      (0 / 0: NaN gradients); its loss is zero (no routed token) with a total of one;
    - the mask is cut to this rank's sequence-parallel chunk on the first pipeline stage only; the later stages'
      routers see a chunk too, so it is cut there as well (the same split, no collective)."""
    try:
        from megatron.core.models.gpt import gpt_model
        from megatron.core.transformer.moe import moe_utils, router
    except ImportError:
        return
    router.TopKRouter._apply_expert_bias = _count_real_tokens
    if not getattr(router.get_tokens_per_expert_and_token_count, "slime_nonzero_total", False):
        router.get_tokens_per_expert_and_token_count = _counts_with_nonzero_total(
            moe_utils.get_tokens_per_expert_and_token_count)
    if not getattr(gpt_model.GPTModel._preprocess, "slime_sp_mask", False):
        gpt_model.GPTModel._preprocess = _scatter_mask_on_later_stages(gpt_model.GPTModel._preprocess)


# ------------------------------------------------------------------ MoE dispatch at EP1 (every machine)
_UPSTREAM_SORT_CHUNKS: dict[str, Callable] = {}


def _identity_order(sorted_idxs: torch.Tensor) -> bool:
    return (not sorted_idxs.is_cuda and sorted_idxs.dim() == 1
            and torch.equal(sorted_idxs, torch.arange(sorted_idxs.numel(), dtype=sorted_idxs.dtype)))


def _sort_chunks_unless_identity(input, split_sizes, sorted_idxs, probs=None, fused=False):
    """megatron's sort_chunks_by_idxs, except where the order is the identity.

    The alltoall dispatcher re-sorts the tokens it received from (rank, local expert) chunks into (local expert,
    rank) order, and back for the combine. With one rank in the expert-parallel x expert-TP group that order is
    the identity, yet megatron still splits and concatenates the tokens, their routing weights and the experts'
    output: a copy of every routed row in the forward and again in the backward (on one H200, half of the 384
    concatenation kernels of a Qwen3-30B-A3B-shaped step). The identity returns its inputs (the same values)."""
    if _identity_order(sorted_idxs):
        return input, probs
    return _UPSTREAM_SORT_CHUNKS["sort_chunks_by_idxs"](input, split_sizes, sorted_idxs, probs=probs, fused=fused)


def apply_moe_identity_sort(enabled: bool = True) -> None:
    """Skip the alltoall dispatcher's identity re-sort (idempotent); `enabled=False` puts megatron's own back
    (the "grouped-base" side of benchmarks/bench_step_gpu.py)."""
    try:
        from megatron.core.transformer.moe import token_dispatcher
    except ImportError:
        return
    _UPSTREAM_SORT_CHUNKS.setdefault("sort_chunks_by_idxs", token_dispatcher.sort_chunks_by_idxs)
    token_dispatcher.sort_chunks_by_idxs = (_sort_chunks_unless_identity if enabled
                                            else _UPSTREAM_SORT_CHUNKS["sort_chunks_by_idxs"])


def moe_identity_sort_in_use() -> bool:
    from megatron.core.transformer.moe import token_dispatcher

    return token_dispatcher.sort_chunks_by_idxs is _sort_chunks_unless_identity


def _permute_without_host_sync(tokens, routing_map, probs=None, num_out_tokens=None, fused=False,
                               drop_and_pad=False):
    """megatron's unfused `permute` without its two host-device syncs.

    It gathers the routed (expert, token) pairs with `masked_select`, whose output size only the GPU knows: the
    host waits for the GPU twice per MoE layer and micro-batch (128 waits in a Qwen3-30B-A3B-shaped step on one
    H200). In a dropless run the dispatcher knows that size (tokens x top-k, a Python int), as TransformerEngine's
    fused permute is told it too; `nonzero_static` of that size lists the same pairs in the same (expert-major)
    order on the device. Token dropping, padding to capacity and the fused path keep megatron's own."""
    if fused or drop_and_pad or not isinstance(num_out_tokens, int):
        from megatron.core.transformer.moe import moe_utils

        return moe_utils.permute(tokens, routing_map, probs=probs, num_out_tokens=num_out_tokens,
                                 fused=fused, drop_and_pad=drop_and_pad)
    num_tokens = tokens.shape[0]
    expert_major = routing_map.bool().T.contiguous()
    pairs = torch.nonzero_static(expert_major, size=num_out_tokens)  # [num_out, 2]: (expert, token)
    sorted_indices = pairs[:, 1]
    permuted_probs = None
    if probs is not None:
        permuted_probs = probs.T.contiguous().view(-1).index_select(0, pairs[:, 0] * num_tokens + sorted_indices)
    return tokens.index_select(0, sorted_indices), permuted_probs, sorted_indices


def apply_permute_without_host_sync(enabled: bool = True) -> None:
    """Point the MoE token dispatchers at the sync-free permute (idempotent); `enabled=False` puts megatron's own
    back (the benchmark's comparison)."""
    try:
        from megatron.core.transformer.moe import moe_utils, token_dispatcher
    except ImportError:
        return
    token_dispatcher.permute = _permute_without_host_sync if enabled else moe_utils.permute


def permute_without_host_sync_in_use() -> bool:
    from megatron.core.transformer.moe import token_dispatcher

    return token_dispatcher.permute is _permute_without_host_sync


# ------------------------------------------------------------------ grad norm and clipping (every machine)
def _by_device_and_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return list(groups.values())


def _l2_norm_per_tensor(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """The sync-free norm one kernel per tensor (the "grouped-base" side of benchmarks/bench_step_gpu.py)."""
    norms = [torch.linalg.vector_norm(t, dtype=torch.float32) for tensors in tensor_lists for t in tensors]
    if not norms:
        return torch.zeros(1, dtype=torch.float), None
    return torch.linalg.vector_norm(torch.stack(norms)).reshape(1), None


def _l2_norm_without_host_sync(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """megatron's local (no-Apex) multi_tensor_l2norm, kept on the device.

    megatron's `local_multi_tensor_l2_norm` turns every tensor's norm into a Python float
    (`torch.tensor(list of 0-d GPU tensors)`): one host-device sync per parameter at every grad clip
    (226 per 0.6B step on one H200). Here the tensors' norms come from torch's multi-tensor norm (a few
    kernels for thousands of expert weights; on CPU the same per-tensor norms) and stay on the device;
    the same fp32 reduction over them follows.
    """
    tensors = [t for group in tensor_lists for t in group]
    if not tensors:
        return torch.zeros(1, dtype=torch.float), None
    # fp32 norms of 16-bit tensors too (Apex's kernel's output): the precision-aware optimizer's grads are the
    # model's bf16 buffer, and a norm rounded to bf16 would move the clip coefficient by up to 0.4 %.
    norms = [n for group in _by_device_and_dtype(tensors) for n in torch._foreach_norm(group, 2, dtype=torch.float32)]
    return torch.linalg.vector_norm(torch.stack(norms)).reshape(1), None


def _scale_without_a_copy(chunk_size, noop_flag, tensor_lists, scale):
    """megatron's local multi_tensor_scale (`dst.copy_(src * scale)` per tensor: a temporary, a copy and two
    kernels per parameter) as torch's multi-tensor multiply: in place where source and destination are the same
    tensors, as for grad clipping (fp32 gradients). The same products (one fp32 multiply each)."""
    src, dst = tensor_lists
    if all(a is b for a, b in zip(src, dst)) and len(src) == len(dst):
        for group in _by_device_and_dtype(list(dst)):
            torch._foreach_mul_(group, scale)
        return
    for a, b in zip(src, dst):
        b.copy_(a * scale)


def apply_grad_norm_without_host_sync(multi_tensor: bool = True) -> None:
    """Point megatron's grad clipping at the sync-free norm and the multi-tensor scale where it fell back to its
    local ones (idempotent). `multi_tensor=False`: the per-tensor sync-free norm and megatron's local scale (the
    "grouped-base" side of benchmarks/bench_step_gpu.py)."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    norms = (utils.local_multi_tensor_l2_norm, _l2_norm_without_host_sync, _l2_norm_per_tensor)
    if clip_grads.l2_norm_impl in norms:
        clip_grads.l2_norm_impl = _l2_norm_without_host_sync if multi_tensor else _l2_norm_per_tensor
    if clip_grads.multi_tensor_scale_impl in (utils.local_multi_tensor_scale, _scale_without_a_copy):
        clip_grads.multi_tensor_scale_impl = _scale_without_a_copy if multi_tensor else utils.local_multi_tensor_scale


# ------------------------------------------------------------------ distributed optimizer copies (every machine)
_UPSTREAM_OPTIMIZER_COPIES: dict[str, Callable] = {}


@dataclass(frozen=True)
class _ShardViews:
    """One distributed optimizer's fixed pairs: each trained parameter's slice of its DDP grad buffer and of its
    param buffer, beside the fp32 main parameter that shard maps to. Views follow their storages, so they stay
    valid across the colocated sleep (storages freed and re-allocated in place); `buffers` names the DDP buffer
    tensors they were cut from, to notice buffers that were replaced."""

    buffers: tuple[int, ...]
    main_params: list[torch.Tensor]
    grad_shards: list[torch.Tensor]
    param_shards: list[torch.Tensor]


def _buffer_ids(opt) -> tuple[int, ...]:
    return tuple(id(t) for b in opt.buffers for t in (b.grad_data, b.param_data))


def _shard_views(opt) -> _ShardViews:
    views = getattr(opt, "_slime_shard_views", None)
    if views is not None and views.buffers == _buffer_ids(opt):
        return views
    main_params, grad_shards, param_shards = [], [], []
    pairs = ((opt.model_float16_groups, opt.shard_fp32_from_float16_groups), (opt.model_fp32_groups, opt.shard_fp32_groups))
    for model_groups, main_groups in pairs:
        for model_group, main_group in zip(model_groups, main_groups):
            for model_param, main_param in zip(model_group, main_group):
                ranges = opt._get_model_param_range_map(model_param)
                own, world = ranges["param"], ranges["gbuf_world_in_bucket"]
                gbuf_index, _, bucket_id = opt.model_param_gbuf_map[model_param]
                main_params.append(main_param)
                grad_shards.append(model_param.main_grad.view(-1)[own.start:own.end])
                param_shards.append(opt.buffers[gbuf_index].buckets[bucket_id].param_data.view(-1)[world.start:world.end])
    views = _ShardViews(_buffer_ids(opt), main_params, grad_shards, param_shards)
    opt._slime_shard_views = views
    return views


def _batched_copies_apply(opt) -> bool:
    """The batched copies serve the plain bf16/fp16 + fp32-main-params optimizer; FSDP, the precision-aware
    optimizer, FP8 parameters and the stub keep megatron's loops (the FP8 look, over every parameter, once per
    optimizer)."""
    config = opt.config
    if (opt.is_stub_optimizer or opt.ddp_config.use_megatron_fsdp
            or config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
            or getattr(config, "reuse_grad_buf_for_mxfp8_param_ag", False)):
        return False
    fp8 = getattr(opt, "_slime_has_fp8_params", None)
    if fp8 is None:
        from megatron.core.fp8_utils import is_float8tensor

        fp8 = opt._slime_has_fp8_params = any(is_float8tensor(p) for g in opt.model_float16_groups for p in g)
    return not fp8


def _copy_model_grads_to_main_grads(self) -> None:
    """Each main parameter's .grad = its shard of the DDP grad buffer in fp32 (megatron's `.float()`: the buffer's
    own view where it is fp32 already, else a cast), the casts as one multi-tensor copy into one fp32 block."""
    if not _batched_copies_apply(self):
        return _UPSTREAM_OPTIMIZER_COPIES["grads"](self)
    views = _shard_views(self)
    to_cast = [i for i, g in enumerate(views.grad_shards) if g.dtype != torch.float32]
    grads = list(views.grad_shards)
    if to_cast:
        sizes = [grads[i].numel() for i in to_cast]
        block = torch.empty(sum(sizes), dtype=torch.float32, device=grads[to_cast[0]].device)
        casts = list(torch.split(block, sizes))
        torch._foreach_copy_(casts, [grads[i] for i in to_cast])
        for i, cast in zip(to_cast, casts):
            grads[i] = cast
    for main_param, grad in zip(views.main_params, grads):
        main_param.grad = grad


def _copy_main_params_to_model_params(self) -> None:
    """The updated fp32 main parameters into their shards of the model's param buffer (cast to its dtype), as one
    multi-tensor copy."""
    if not _batched_copies_apply(self):
        return _UPSTREAM_OPTIMIZER_COPIES["params"](self)
    views = _shard_views(self)
    if views.param_shards:
        torch._foreach_copy_(views.param_shards, views.main_params)


def apply_batched_optimizer_copies(enabled: bool = True) -> None:
    """Megatron's DistributedOptimizer copies grads and params through `_copy_model_grads_to_main_grads` and
    `_copy_main_params_to_model_params`; point both at the batched versions (idempotent), or back (`enabled=False`,
    the benchmark's comparison)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    names = {"grads": "_copy_model_grads_to_main_grads", "params": "_copy_main_params_to_model_params"}
    ours = {"grads": _copy_model_grads_to_main_grads, "params": _copy_main_params_to_model_params}
    for key, attr in names.items():
        _UPSTREAM_OPTIMIZER_COPIES.setdefault(key, getattr(DistributedOptimizer, attr))
        setattr(DistributedOptimizer, attr, ours[key] if enabled else _UPSTREAM_OPTIMIZER_COPIES[key])


def batched_optimizer_copies_in_use() -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return DistributedOptimizer._copy_main_params_to_model_params is _copy_main_params_to_model_params


def import_megatron() -> None:
    """Import megatron-core with torch.compile deferred to each decorated function's first call (module doc)."""
    if "megatron.core" in sys.modules:
        return
    eager_wrap = torch.compile
    torch.compile = _compile_at_first_call(eager_wrap)
    try:
        import megatron.core  # noqa: F401 - megatron.core.jit keeps the deferring decorator for later imports
    finally:
        torch.compile = eager_wrap


def _compile_at_first_call(compile_now: Callable) -> Callable:
    def compile_later(model=None, **options):
        if not inspect.isfunction(model) or options:  # modules, or options for a decorator: as torch does
            return compile_now(**options) if model is None else compile_now(model, **options)
        compiled = None

        @functools.wraps(model)
        def call(*args, **kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = compile_now(model) if fused_kernels.active() == "compile" else model
            return compiled(*args, **kwargs)

        return call

    return compile_later


def apply_in_process_save_results() -> None:
    """The synchronous save (AsyncRequest.execute_sync) puts and takes its results in this process: a plain queue."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async._get_write_results_queue = queue.Queue


# ------------------------------------------------------------------ CPU-only patches
def apply() -> None:
    """Apply all CPU patches to megatron-core (idempotent).

    The torch swap runs on every call so megatron modules imported since the last call are
    covered too; the function replacements run once.
    """
    global _APPLIED
    for name in _MODULES_TO_LOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # module absent in this release; nothing to patch there
    _swap_torch_in_megatron_modules()
    if _APPLIED:
        return
    _patch_type_checks()
    _patch_tied_embedding_sync()
    _patch_rng()
    _patch_rope_cp_slice()
    _patch_moe_split_sizes()
    _patch_hybrid_optimizer_split()
    _patch_uneven_sequence_collectives()
    _APPLIED = True

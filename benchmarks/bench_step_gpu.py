"""The fenced training step on GPUs without TransformerEngine, old path vs new path in one run.

    python benchmarks/bench_step_gpu.py attention [--device cuda] [--tokens 16384 32768] [--shapes 16:8:128 32:8:128]
    torchrun --nproc-per-node N benchmarks/bench_step_gpu.py step --model qwen3-0.6b [--cycles 3] \\
        [--sync-audit] [--profile] [train.py flags: layout, --max-tokens-per-gpu, recompute, ...]

Paths, switched in place between cycles of one process (same model, data and allocator):
  fused  the new path with --fused-kernels compile: torch.compile'd RMSNorm, RoPE, SwiGLU (megatron's
       jit_fuser) and the fused log-prob/entropy head (slime/backends/megatron_utils/logprob_head.py)
  old  attention with an explicit [tq, tk] mask and GQA by repeat_interleave (kernel "masked"),
       megatron's own THD RoPE (`.tolist()` of cu_seqlens for q and k in every layer)
  new  (eager kernels) the mask-free kernels (kernel "causal": SDPA causal / lower-right per sequence or zig-zag
       chunk with native GQA, flash-attn varlen when importable) and the sync-free THD RoPE
  grouped / grouped-prev / grouped-base / sequential  (MoE) the new path with the experts as grouped GEMMs; the
       same with megatron's per-parameter optimizer copies and its syncing token permute (before the batched copies
       and the sync-free permute); the same as it was before
       torch's fused AdamW kernel, the skipped identity re-sort of the dispatched tokens at EP1, the experts'
       gradients added into DDP's buffer as one multi-tensor add, grad clipping's multi-tensor norm and scale, the
       batched optimizer copies and the sync-free permute; megatron's SequentialMLP (one expert after another)
(The old path reads the lengths from the host like the new one: the attention's own per-layer
`.tolist()` of the code before the sync-free RoPE, a third sync right after RoPE's two, is not replayed.)

`attention`: fwd+bwd of one sequence per shape and length, old vs new, at CP1 and as one CP2 rank
(its two zig-zag chunks against the gathered keys, without the all-gather); time, TFLOP/s (causal
fwd 2*s^2*d*hq, bwd 2.5 x fwd: the convention of the issue's figures; a CP2 rank does half),
peak memory, the new/old output and gradient difference, and whether the new path synchronises.

`step`: cycles of MegatronTrainActor.train (plan fence, log-probs, train step, exit fence; no
engines) alternating old and new after one warm-up cycle each. Per cycle: step seconds (train()
without its wake phase), tokens/s and model TFLOP/s per GPU, peak and static memory. Model FLOPs
(what the step must compute, recompute not counted; MFU convention):
  forward FLOPs of a sequence of L tokens = 2 * L * P_matmul + 2 * layers * hq * d * L^2
  P_matmul = layers * (h*(hq + 2*hkv)*d + hq*d*h + 3*h*f) + h*V      (projections, SwiGLU, LM head)
  step FLOPs = 4 x forward (log-prob forward + training forward and backward = 2 x forward)
Weights stay at megatron's random init (no HF weights are loaded: the step's speed does not
depend on their values, and a 4B checkpoint would cost minutes to write and read).
With --optimizer-cpu-offload --use-precision-aware-optimizer (train.py flags) the optimizer is megatron-core's hybrid
CPU optimizer: each cycle's `in_use` names it, and MEMORY adds the process's host peak (the state it holds there).
--sync-audit runs one extra cycle per path under torch.cuda.set_sync_debug_mode("warn") and
counts the host-device synchronisations by source line; --profile runs one extra new-path cycle
under torch.profiler (top kernels, GPU busy share of the step).

Rank 0 prints RATIO / MEMORY / FIT / SYNC lines and writes --results-json after every cycle (a
run cut short keeps what it measured). An out-of-memory cycle prints "OOM ..." and exits 3
(BENCH_STEP_INJECT_OOM_AT=N fakes one at the N-th cycle, for the CPU test of that report).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import functools
import gc
import json
import os
import resource
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH_DIR)
sys.path[:0] = [p for p in (ROOT, BENCH_DIR) if p not in sys.path]

warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*not installed")
warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor. is deprecated")

import torch  # noqa: E402

PATHS = ("fused", "new", "old", "grouped", "grouped-prev", "grouped-base", "sequential")
KERNEL_OF_PATH = {"fused": "causal", "new": "causal", "old": "masked", "grouped": "causal", "grouped-prev": "causal",
                  "grouped-base": "causal", "sequential": "causal"}
# MoE experts as grouped GEMMs; the same as before the launch savings around them (see the module doc);
# SequentialMLP's per-expert loop
EXPERT_PATHS = ("grouped", "grouped-prev", "grouped-base", "sequential")
# the attention phase compares the kernels ("new": the default, at CP>1 on Hopper both chunks' causal squares as one
# batched cuDNN call plus a call per chunk against the keys before it, merged by lse; "three-call": the later chunk
# alone split into two cuDNN calls, the default before the batched call; "lower-right": every chunk as one SDPA
# call with the lower-right mask, the default before the split; "split-flash": the split with torch's flash kernels)
ATTENTION_PATHS = ("new", "old", "three-call", "lower-right", "split-flash")
SPLIT_PATHS = ("three-call", "lower-right", "split-flash")  # compared with "old" like "new"
# A path may name the gated DeltaNet's kernel after an "@" (gated_delta_rule.KERNEL_CHOICES, e.g. "fused@compiled":
# the fused path with the DeltaNet forced to the compiled rule); without one the DeltaNet runs the auto choice.
GDN_SEPARATOR = "@"
OOM_EXIT_CODE = 3


@dataclass(frozen=True, kw_only=True)
class VisionShape:
    """A Qwen3.5-style vision tower (transformers' Qwen3_5VisionModel): a patch embedding of temporal x patch x patch
    pixels, `depth` blocks of full attention within each image and a GELU MLP, a merger of merge x merge patches into
    one image token of the text width. Defaults: transformers' Qwen3_5VisionConfig (the released 27-block tower)."""

    depth: int = 27
    hidden: int = 1152
    intermediate: int = 4304
    heads: int = 16
    patch: int = 16
    merge: int = 2
    temporal_patch: int = 2
    position_embeddings: int = 2304

    def patches(self, image_size: int) -> int:
        """Patches of one square image (its side a multiple of patch x merge)."""
        return (image_size // self.patch) ** 2

    def tokens(self, image_size: int) -> int:
        return self.patches(image_size) // self.merge ** 2

    def matmul_params(self, out_hidden: int) -> tuple[int, int]:
        """(weights each patch multiplies with: patch embedding, the blocks' projections and MLPs; weights each
        merged image token multiplies with: the merger's two projections)."""
        h, w = self.hidden, self.merge ** 2 * self.hidden
        per_patch = 3 * self.temporal_patch * self.patch ** 2 * h + self.depth * (4 * h * h + 2 * h * self.intermediate)
        return per_patch, w * w + w * out_hidden

    def forward_flops(self, image_sizes: list[int], out_hidden: int) -> float:
        """One forward over these images: 2 x weights per patch and per token, and full attention within each
        image (4 x patches^2 x width per block: scores and values)."""
        per_patch, per_token = self.matmul_params(out_hidden)
        patches = [self.patches(n) for n in image_sizes]
        attention = sum(4.0 * self.depth * self.hidden * n * n for n in patches)
        return 2.0 * (per_patch * sum(patches) + per_token * sum(self.tokens(n) for n in image_sizes)) + attention


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """A Qwen3-style decoder (SwiGLU MLP, GQA, RMSNorm), dense or MoE (every layer routed, top-k experts); or,
    with `kv_lora_rank`, a GLM-4.7-Flash-style one (multi-latent attention, the first `dense_layers` MLPs dense,
    the others routed plus `shared_experts`)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn_hidden: int
    vocab: int = 151936
    num_experts: int = 0
    topk: int = 0
    moe_ffn_hidden: int = 0
    tied: bool = True
    full_attention_every: int = 0
    """> 0: a Qwen3.5-style hybrid, every N-th layer gated full attention, the others gated DeltaNet."""
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_head_dim: int = 0
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    """> 0: multi-latent attention; head_dim is then the no-RoPE query/key width (qk_nope_head_dim)."""
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    shared_experts: int = 0
    dense_layers: int = 0
    shared_expert_gate: bool = False
    """A sigmoid gate (one output) on the shared expert, as Qwen3.5-MoE has."""
    hc_mult: int = 0
    """> 0: a DeepSeek-V4-style model (slime/models/deepseek_v4.py) with this many hyper-connection streams: one
    shared key/value head of head_dim, a q_lora_rank query latent, o_groups output groups of o_lora_rank, every
    MLP routed (the first `hash_layers` by token id) plus `shared_experts`; `attention_kinds` per layer."""
    attention_kinds: tuple[str, ...] = ()
    """"sliding", "csa" (compressed sparse: a key per compress_ratios[0] tokens, indexer top-index_topk) or "hca"
    (heavily compressed: a key per compress_ratios[1] tokens)."""
    sliding_window: int = 0
    compress_ratios: tuple[int, int] = (4, 128)
    o_groups: int = 0
    o_lora_rank: int = 0
    index_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    hash_layers: int = 0
    sliding_every_other: bool = False
    """A gpt-oss-style model (slime/models/gpt_oss.py): layers alternate sliding-window (`sliding_window`, the first)
    and full attention, with attention sinks, biased projections, experts and router (no matmul FLOPs)."""
    vision: VisionShape | None = None
    """A vision tower in front (a Qwen3.5 hybrid with images: transformers' composite checkpoint, the tower trained)."""

    @property
    def full_layers(self) -> int:
        return self.layers // self.full_attention_every if self.full_attention_every else self.layers

    def matmul_params(self) -> int:
        """Weights every token multiplies with (projections, MLP or its router and top-k experts: the ACTIVE
        parameters, LM head; no embedding lookup, norms). A hybrid's full-attention q_proj also gives the gate."""
        h, d = self.hidden, self.head_dim
        routed = 3 * h * self.moe_ffn_hidden * (self.topk + self.shared_experts) + h * self.num_experts \
            + h * self.shared_expert_gate
        dense = 3 * h * self.ffn_hidden
        mlp = (self.layers - self.dense_layers) * routed + self.dense_layers * dense if self.num_experts \
            else self.layers * dense
        if self.hc_mult:
            return mlp + self._compressed_layers() + h * self.vocab
        gate = 1 if self.full_attention_every else 0
        attention = self._latent_attention() if self.kv_lora_rank else \
            h * ((1 + gate) * self.heads + 2 * self.kv_heads) * d + self.heads * d * h
        hk, hv, dl = self.linear_key_heads, self.linear_value_heads, self.linear_head_dim
        delta_net = h * (2 * hk * dl + 2 * hv * dl + 2 * hv) + hv * dl * h
        linear_layers = self.layers - self.full_layers
        return mlp + self.full_layers * attention + linear_layers * delta_net + h * self.vocab

    def _latent_attention(self) -> int:
        """MLA's projections: q down/up, the joint kv down (latent + shared RoPE key), kv up, output."""
        h, n, rope = self.hidden, self.heads, self.qk_rope_head_dim
        q = h * self.q_lora_rank + self.q_lora_rank * n * (self.head_dim + rope)
        kv = h * (self.kv_lora_rank + rope) + self.kv_lora_rank * n * (self.head_dim + self.v_head_dim)
        return q + kv + n * self.v_head_dim * h

    def _compressed_layers(self) -> int:
        """DeepSeek-V4's attention projections (q down/up, the shared key, both output projections), each kind's
        compressor (kv and gate) and indexer (its compressor, queries, head weights), the two hyper-connection
        mixers of every layer and the final collapse of the streams."""
        h, n, d, heads = self.hidden, self.hc_mult, self.head_dim, self.heads
        attention = h * self.q_lora_rank + self.q_lora_rank * heads * d + h * d + heads * d * self.o_lora_rank \
            + self.o_groups * self.o_lora_rank * h
        di = self.index_head_dim
        indexer = 2 * h * 2 * di + self.q_lora_rank * self.index_heads * di + h * self.index_heads
        extra = {"sliding": 0, "hca": 2 * h * d, "csa": 2 * h * 2 * d + indexer}
        mixers = 2 * (2 + n) * n * n * h
        return sum(attention + extra[kind] + mixers for kind in self.attention_kinds) + n * n * h

    def _compressed_attention_flops(self, n: int) -> float:
        """DeepSeek-V4's attention over one sequence of n tokens: each query against its window and the compressed
        keys it uses (its top-k of the causal ones in a CSA layer, every causal one in an HCA layer; QK^T and PV:
        4 x heads x head_dim each), and the indexer's scores of every causal compressed key (2 x its heads x width)."""
        csa, hca = self.compress_ratios
        window = sum(min(self.sliding_window, t + 1) for t in range(n))
        flops = 0.0
        for kind in self.attention_kinds:
            used = window
            if kind == "csa":
                ready = [(t + 1) // csa for t in range(n)]
                used += sum(min(self.index_topk, r) for r in ready)
                flops += 2 * self.index_heads * self.index_head_dim * sum(ready)
            elif kind == "hca":
                used += sum((t + 1) // hca for t in range(n))
            flops += 4 * self.heads * self.head_dim * used
        return flops

    @property
    def attention_width(self) -> float:
        """Half of (query-key width + value width): 2 x this x heads x L^2 is causal attention's forward."""
        if not self.kv_lora_rank:
            return self.head_dim
        return (self.head_dim + self.qk_rope_head_dim + self.v_head_dim) / 2

    def forward_flops(self, seq_lens: list[int]) -> float:
        """Model FLOPs of one forward over sequences of these lengths: causal attention in the full-attention
        layers; in a DeltaNet layer, per token and value head, the chunked rule's intra-chunk products
        (2 x 64 x 2 x head dim) and the state's update and read (6 x head dim^2)."""
        if self.hc_mult:
            return 2.0 * self.matmul_params() * sum(seq_lens) + sum(map(self._compressed_attention_flops, seq_lens))
        attention = sum(2 * self.full_layers * self.heads * self.attention_width * n * n for n in seq_lens)
        if self.sliding_every_other:  # each query of a sliding layer sees its window: 4 x heads x head_dim per key
            sliding, full = self.layers - self.layers // 2, self.layers // 2
            attention = sum(2 * full * self.heads * self.head_dim * n * n
                            + 4 * sliding * self.heads * self.head_dim * sum(min(self.sliding_window, t + 1)
                                                                             for t in range(n)) for n in seq_lens)
        dl = self.linear_head_dim
        delta_rule = (self.layers - self.full_layers) * self.linear_value_heads * (4 * 64 * dl + 6 * dl * dl)
        return (2.0 * self.matmul_params() + delta_rule) * sum(seq_lens) + attention


MODELS = {
    "qwen3-0.6b": ModelShape(layers=28, hidden=1024, heads=16, kv_heads=8, head_dim=128, ffn_hidden=3072),
    "qwen3-4b": ModelShape(layers=36, hidden=2560, heads=32, kv_heads=8, head_dim=128, ffn_hidden=9728),
    "tiny": ModelShape(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn_hidden=128),
    # Qwen3-30B-A3B's layer (128 experts, top-8, expert width 768) with 8 of its 48 layers: fits one H200
    # with Adam state (about 5.6B parameters) at EP1
    "qwen3-30b-a3b-8l": ModelShape(layers=8, hidden=2048, heads=32, kv_heads=4, head_dim=128, ffn_hidden=6144,
                                   num_experts=128, topk=8, moe_ffn_hidden=768, tied=False),
    # a Qwen3.5-4B-sized hybrid (3 DeltaNet : 1 gated attention, the released 4B's widths) with 16 of 32 layers
    "qwen3.5-4b-16l": ModelShape(layers=16, hidden=2560, heads=16, kv_heads=4, head_dim=256, ffn_hidden=9216,
                                 vocab=248320, full_attention_every=4, linear_key_heads=16, linear_value_heads=32,
                                 linear_head_dim=128),
    # a Qwen3.5-35B-A3B-sized hybrid MoE (its widths: 256 experts of 512 top-8 plus a gated shared expert) with 4 of
    # its 40 layers (3 DeltaNet, 1 gated attention): with 8, weights, grads and Adam state leave 11 GiB of one H200
    "qwen3.5-35b-a3b-4l": ModelShape(layers=4, hidden=2048, heads=16, kv_heads=2, head_dim=256, ffn_hidden=512,
                                     vocab=248320, full_attention_every=4, linear_key_heads=16,
                                     linear_value_heads=32, linear_head_dim=128, num_experts=256, topk=8,
                                     moe_ffn_hidden=512, shared_experts=1, shared_expert_gate=True, tied=False),
    "tiny-hybrid-moe": ModelShape(layers=4, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn_hidden=32, vocab=1024,
                                  full_attention_every=4, linear_key_heads=2, linear_value_heads=4,
                                  linear_head_dim=16, num_experts=8, topk=2, moe_ffn_hidden=32, shared_experts=1,
                                  shared_expert_gate=True, tied=False),
    "tiny-hybrid": ModelShape(layers=4, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn_hidden=128, vocab=1024,
                              full_attention_every=4, linear_key_heads=2, linear_value_heads=4, linear_head_dim=16),
    # a Qwen3.5-VL-shaped step: the Qwen3.5-4B-sized hybrid with 8 of its 32 layers behind the whole 27-block vision
    # tower (transformers' Qwen3_5VisionConfig), images of --image-size pixels square
    "qwen3.5-vl-4b-8l": ModelShape(layers=8, hidden=2560, heads=16, kv_heads=4, head_dim=256, ffn_hidden=9216,
                                   vocab=248320, full_attention_every=4, linear_key_heads=16, linear_value_heads=32,
                                   linear_head_dim=128, vision=VisionShape()),
    "tiny-hybrid-vl": ModelShape(layers=4, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn_hidden=128, vocab=1024,
                                 full_attention_every=4, linear_key_heads=2, linear_value_heads=4, linear_head_dim=16,
                                 vision=VisionShape(depth=2, hidden=32, intermediate=64, heads=2, patch=4,
                                                    position_embeddings=64)),
    # GLM-4.7-Flash's layers (MLA, 64 experts top-4 behind the sigmoid router, one shared expert, the first MLP
    # dense) with 8 of its 47 layers: about the same parameters as the Qwen3-30B-A3B 8-layer shape
    "glm-4.7-flash-8l": ModelShape(layers=8, hidden=2048, heads=20, kv_heads=20, head_dim=192, ffn_hidden=10240,
                                   vocab=154880, num_experts=64, topk=4, moe_ffn_hidden=1536, tied=False,
                                   q_lora_rank=768, kv_lora_rank=512, qk_rope_head_dim=64, v_head_dim=256,
                                   shared_experts=1, dense_layers=1),
    "tiny-glm-moe-lite": ModelShape(layers=3, hidden=64, heads=4, kv_heads=4, head_dim=16, ffn_hidden=96, vocab=512,
                                    num_experts=8, topk=2, moe_ffn_hidden=32, tied=False, q_lora_rank=32,
                                    kv_lora_rank=24, qk_rope_head_dim=8, v_head_dim=12, shared_experts=1,
                                    dense_layers=1),
    "tiny-moe": ModelShape(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn_hidden=128,
                           num_experts=8, topk=2, moe_ffn_hidden=32, tied=False),
    # DeepSeek-V4-Flash's widths (64 heads of 512 over one shared key, query rank 1024, 8 output groups of 1024,
    # 4 streams, window 128, a compressed key per 4 / 128 tokens, the indexer's 64 heads of 128 keeping 512, experts
    # of 2048 top-6 plus a shared one, the first layer hash-routed) with 4 of its 43 layers and 32 of its 256 experts
    # (all 256 are 6.4B parameters a layer): about 4.8B parameters, weights, grads and Adam state near 90 GiB
    "deepseek-v4-flash-4l": ModelShape(layers=4, hidden=4096, heads=64, kv_heads=1, head_dim=512, ffn_hidden=2048,
                                       vocab=129280, num_experts=32, topk=6, moe_ffn_hidden=2048, shared_experts=1,
                                       tied=False, q_lora_rank=1024, hc_mult=4,
                                       attention_kinds=("hca", "csa", "hca", "csa"), sliding_window=128,
                                       compress_ratios=(4, 128), o_groups=8, o_lora_rank=1024, index_heads=64,
                                       index_head_dim=128, index_topk=512, hash_layers=1),
    # gpt-oss-20b's layers (64 heads of 64 over 8 kv heads, 32 experts of 2880 top-4, window 128 on every other layer)
    # with 4 of its 24: about 4.4B parameters (3.3B in experts, 1.2B in the untied embeddings), weights, grads and
    # Adam state near 80 GiB: an H200
    "gpt-oss-20b-4l": ModelShape(layers=4, hidden=2880, heads=64, kv_heads=8, head_dim=64, ffn_hidden=2880,
                                 vocab=201088, num_experts=32, topk=4, moe_ffn_hidden=2880, tied=False,
                                 sliding_window=128, sliding_every_other=True),
    "tiny-gpt-oss": ModelShape(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn_hidden=32, vocab=512,
                               num_experts=4, topk=2, moe_ffn_hidden=32, tied=False, sliding_window=4,
                               sliding_every_other=True),
    "tiny-deepseek-v4": ModelShape(layers=3, hidden=64, heads=4, kv_heads=1, head_dim=32, ffn_hidden=32, vocab=512,
                                   num_experts=8, topk=2, moe_ffn_hidden=32, shared_experts=1, tied=False,
                                   q_lora_rank=32, hc_mult=3, attention_kinds=("sliding", "csa", "hca"),
                                   sliding_window=6, compress_ratios=(2, 4), o_groups=2, o_lora_rank=16,
                                   index_heads=4, index_head_dim=16, index_topk=3, hash_layers=1),
}
# the Qwen3-30B-A3B layer with 4 of the 48: about 3.1B parameters, so the step fits one H100 with and without the
# optimizer's state on the host (a side by side of the offload's cost on an 80 GB card)
MODELS["qwen3-30b-a3b-4l"] = replace(MODELS["qwen3-30b-a3b-8l"], layers=4)
STEP_FORWARDS = 4  # log-prob forward + training forward/backward (backward = 2 forwards)


def attention_flops(seq_len: int, heads: int, head_dim: int, cp_size: int = 1) -> float:
    """fwd+bwd FLOPs of causal attention over one sequence (bwd 2.5 x fwd), one CP rank's share."""
    return 3.5 * 2 * seq_len * seq_len * head_dim * heads / cp_size


# ------------------------------------------------------------------------------ shared helpers
def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_gib(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0


def allocated_gib(device: torch.device) -> float:
    return torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0


def host_peak_gib() -> float:
    """This process's peak resident host memory (Linux reports kB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


def sync_sites(records: list[warnings.WarningMessage], top: int = 12) -> dict[str, int]:
    """Synchronising-operation warnings (set_sync_debug_mode("warn")) counted by source line."""
    sites = collections.Counter(
        f"{Path(r.filename).parent.name}/{Path(r.filename).name}:{r.lineno}"
        for r in records if "synchronizing" in str(r.message))
    return dict(sites.most_common(top))


@contextlib.contextmanager
def recording_syncs(device: torch.device):
    """Yield the list the block's host-device synchronisations are recorded into (CUDA only)."""
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        if device.type != "cuda":
            yield records
            return
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield records
        finally:
            torch.cuda.set_sync_debug_mode("default")


def write_json(path: str | None, payload: dict) -> None:
    if path:
        tmp = f"{path}.tmp"
        Path(tmp).write_text(json.dumps(payload, indent=2, default=str))
        os.replace(tmp, path)


# ------------------------------------------------------------------------------ attention
@dataclass(frozen=True, kw_only=True)
class AttentionOptions:
    device: str
    dtype: str
    tokens: tuple[int, ...]
    shapes: tuple[tuple[int, int, int], ...]
    """(query heads, kv heads, head dim)"""
    reps: int
    results_json: str | None
    profile: tuple[str, ...] = ()
    """paths whose CP2 call is also profiled: its top kernels (KERNELS lines)"""


def parse_attention(argv: list[str]) -> AttentionOptions:
    p = argparse.ArgumentParser(prog="bench_step_gpu.py attention")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--tokens", type=int, nargs="+", default=[16384, 32768])
    p.add_argument("--shapes", nargs="+", default=["16:8:128", "32:8:128"], help="heads:kv_heads:head_dim")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--results-json", default=None)
    p.add_argument("--profile", nargs="*", choices=ATTENTION_PATHS, default=[])
    ns = p.parse_args(argv)
    if ns.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda but torch sees no GPU")
    shapes = tuple(tuple(int(x) for x in s.split(":")) for s in ns.shapes)
    if any(len(s) != 3 or s[0] % s[1] for s in shapes):
        p.error("--shapes are heads:kv_heads:head_dim with heads divisible by kv_heads")
    if any(n % 4 for n in ns.tokens):
        p.error("--tokens must be divisible by 4 (a CP2 zig-zag split)")
    dtype = ns.dtype or ("bf16" if ns.device.startswith("cuda") else "fp32")
    return AttentionOptions(device=ns.device, dtype=dtype, tokens=tuple(ns.tokens), shapes=shapes,
                            reps=ns.reps, results_json=ns.results_json, profile=tuple(ns.profile))


def _timed(fn, device: torch.device, reps: int) -> float:
    for _ in range(2):
        fn()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    synchronize(device)
    return (time.perf_counter() - start) / reps


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30))


class AttentionCase:
    """One sequence of `seq_len` tokens on one CP rank: this rank's queries, the gathered K/V."""

    def __init__(self, seq_len: int, heads: int, kv_heads: int, head_dim: int, cp_size: int,
                 device: torch.device, dtype: torch.dtype):
        from slime_plugins.models import cp_attention

        gen = torch.Generator(device=device).manual_seed(seq_len + heads)
        make = lambda n, h: torch.randn(n, h, head_dim, device=device, dtype=dtype, generator=gen)  # noqa: E731
        self.q = make(seq_len // cp_size, heads).requires_grad_(True)
        self.k = make(seq_len, kv_heads).requires_grad_(True)
        self.v = make(seq_len, kv_heads).requires_grad_(True)
        self.grad = make(seq_len // cp_size, heads)
        self.plan = cp_attention.attention_plan((seq_len,), cp_size, 0, device)
        self.scale = head_dim ** -0.5
        from slime.models.prefix_attention import FLASH

        self.kernels = {"new": cp_attention.attend_causal, "old": cp_attention.attend_masked,
                        "three-call": functools.partial(cp_attention.attend_causal, split=True, batched=False),
                        "lower-right": functools.partial(cp_attention.attend_causal, split=False),
                        "split-flash": functools.partial(cp_attention.attend_causal, split=True, batched=False,
                                                         lse_kernel=FLASH)}

    def run(self, path: str) -> tuple[torch.Tensor, ...]:
        for x in (self.q, self.k, self.v):
            x.grad = None
        out = self.kernels[path](self.q, self.k, self.v, self.plan, scale=self.scale, dropout_p=0.0)
        out.backward(self.grad)
        return out.detach(), self.q.grad, self.k.grad, self.v.grad


def _measure_variant(case: AttentionCase, path: str, device: torch.device, reps: int, flops: float) -> dict:
    synchronize(device)
    base = allocated_gib(device)
    reset_peak(device)
    try:
        seconds = _timed(lambda: case.run(path), device, reps)
    except Exception as exc:  # noqa: BLE001 - an OOM or an unsupported kernel is a result here
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
    return {"ms": 1e3 * seconds, "tflops": flops / seconds / 1e12, "peak_gib": peak_gib(device) - base}


def _new_path_syncs(case: AttentionCase, device: torch.device) -> dict[str, int]:
    """Syncs of a new-path call that recur: a one-time sync of the first audited call (torch's own lazy set-up
    on first use, seen once per process) is not a per-call cost, so the audit counts the second call."""
    for _ in range(2):
        with recording_syncs(device) as records:
            case.run("new")
    return sync_sites(list(records))


def _profiled_kernels(case: AttentionCase, path: str) -> list:
    """The profiler's events of one fwd+bwd call of `path`: its CUDA kernels (on CPU, the ops instead)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if case.q.is_cuda else [])
    case.run(path)  # outside the trace: one-time set-up is not a kernel of the call
    with profile(activities=activities) as prof:
        case.run(path)
    events = prof.key_averages()
    return [e for e in events if e.device_type == DeviceType.CUDA] or list(events)


def _kernel_times(case: AttentionCase, path: str, top: int = 10) -> list[tuple[str, int, float]]:
    """(kernel, launches, ms) of one fwd+bwd call of `path`, the most time first."""
    events = sorted(_profiled_kernels(case, path), key=lambda e: e.self_device_time_total, reverse=True)
    return [(e.key[:70], e.count, e.self_device_time_total / 1e3) for e in events[:top]]


def _attention_kernels(case: AttentionCase) -> list[str]:
    """Names of the attention kernels the new path launches (which SDPA backend was taken)."""
    names = {e.key for e in _profiled_kernels(case, "new")}
    return sorted(n for n in names if any(w in n.lower() for w in ("flash", "fmha", "cudnn", "attention", "sdpa")))[:8]


def bench_attention_case(seq_len: int, shape: tuple[int, int, int], cp_size: int, opts: AttentionOptions,
                         device: torch.device, dtype: torch.dtype) -> dict:
    heads, kv_heads, head_dim = shape
    case = AttentionCase(seq_len, heads, kv_heads, head_dim, cp_size, device, dtype)
    flops = attention_flops(seq_len, heads, head_dim, cp_size)
    result = {"tokens": seq_len, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "cp": cp_size,
              "tflop_per_call": flops / 1e12}
    for path in ATTENTION_PATHS:
        result[path] = _measure_variant(case, path, device, opts.reps, flops)
    if "error" not in result["new"] and "error" not in result["old"]:
        new, old = case.run("new"), case.run("old")
        result["rel_error"] = {name: _relative_error(a, b) for name, a, b in zip(("out", "dq", "dk", "dv"), new, old)}
        result["speedup"] = result["new"]["tflops"] / result["old"]["tflops"]
        for path in SPLIT_PATHS:
            if "error" not in result[path]:
                got = case.run(path)
                result[f"{path}_rel_error"] = {name: _relative_error(a, b) for name, a, b in
                                               zip(("out", "dq", "dk", "dv"), got, old)}
    if cp_size > 1 and device.type == "cuda":
        result["kernel_ms"] = {path: _kernel_times(case, path) for path in opts.profile}
    result["new_path_syncs"] = _new_path_syncs(case, device)
    result["new_path_kernels"] = _attention_kernels(case)
    del case
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def attention_line(r: dict) -> str:
    name = f"cp{r['cp']} hq{r['heads']}/hkv{r['kv_heads']} d{r['head_dim']} {r['tokens']} tokens"
    parts = []
    for path in ATTENTION_PATHS:
        m = r[path]
        parts.append(f"{path} {m['error']}" if "error" in m else
                     f"{path} {m['tflops']:.0f} TFLOP/s {m['ms']:.2f} ms peak {m['peak_gib']:.2f} GiB")
    ratio = f"new/old = {r['speedup']:.2f}x; " if "speedup" in r else ""
    err = max(r["rel_error"].values()) if "rel_error" in r else float("nan")
    split_err = {p: max(r[f"{p}_rel_error"].values()) if f"{p}_rel_error" in r else float("nan")
                 for p in SPLIT_PATHS}
    split_note = ", ".join(f"{p} {e:.1e}" for p, e in split_err.items())
    return (f"RATIO attention {name}: {ratio}{'; '.join(parts)}; max rel diff {err:.1e} ({split_note}); "
            f"new-path syncs {sum(r['new_path_syncs'].values())}; kernels {r['new_path_kernels'][:3]}")


# bf16 new vs old (flash vs masked math); fp32 on CPU agrees to ~1e-6
ATTENTION_TOLERANCE = {"bf16": 3e-2, "fp32": 1e-4}


def run_attention(argv: list[str]) -> int:
    opts = parse_attention(argv)
    device = torch.device(opts.device)
    dtype = torch.bfloat16 if opts.dtype == "bf16" else torch.float32
    from slime import patches

    patches.apply_all()
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "dtype": opts.dtype}
    print("ENV " + json.dumps(env), flush=True)
    results, failures = [], []
    for shape in opts.shapes:
        for seq_len in opts.tokens:
            for cp_size in (1, 2):
                r = bench_attention_case(seq_len, shape, cp_size, opts, device, dtype)
                results.append(r)
                print(attention_line(r), flush=True)
                for path, kernels in r.get("kernel_ms", {}).items():
                    print(f"KERNELS attention cp{cp_size} hq{shape[0]} {seq_len} tokens {path}: "
                          + "; ".join(f"{name} x{n} {ms:.2f} ms" for name, n, ms in kernels), flush=True)
                errors = [*r.get("rel_error", {}).values(),
                          *(e for p in SPLIT_PATHS for e in r.get(f"{p}_rel_error", {}).values())]
                if "rel_error" not in r or max(errors) > ATTENTION_TOLERANCE[opts.dtype]:
                    failures.append(f"MISMATCH or failure: {attention_line(r)}")
                if r["new_path_syncs"]:
                    failures.append(f"SYNC in the new attention path: {r['new_path_syncs']}")
                write_json(opts.results_json, {"env": env, "options": asdict(opts), "results": results})
    for line in failures:
        print(line, flush=True)
    return 1 if failures else 0


# ------------------------------------------------------------------------------ step
@dataclass(frozen=True, kw_only=True)
class StepOptions:
    """Flags of `step`; every other flag goes to slime's parse_args unchanged."""

    model: str
    paths: tuple[str, ...]
    cycles: int
    """timed cycles per path, after one warm-up cycle each"""
    num_samples: int
    min_tokens: int
    max_tokens: int
    data_seed: int
    sync_audit: bool
    profile: bool
    host_profile: bool
    """one extra cycle of the first path under cProfile: where the host's time goes (HOST line)"""
    profile_warmup: bool = False
    """the first warm-up cycle under cProfile: where a fresh process's first step goes (WARMUP_PROFILE line)"""
    time_budget_s: float
    """start no cycle that would end past this many seconds after start-up (estimated from that
    path's last cycle), so the summary is written inside the caller's deadline"""
    results_json: str | None
    checkpoint_dir: str
    image_size: int = 1024
    """A model with a vision tower: each sample's prompt holds images of this many pixels square (random pixels)."""
    images_per_sample: int = 1


def path_label(label: str) -> str:
    """A --paths entry: PATH or PATH@KERNEL (the gated DeltaNet's kernel on that path)."""
    from slime.models.gated_delta_rule import KERNEL_CHOICES

    base, _, kernel = label.partition(GDN_SEPARATOR)
    if base not in PATHS or (GDN_SEPARATOR in label and kernel not in KERNEL_CHOICES):
        raise argparse.ArgumentTypeError(f"{label!r}: a path is one of {', '.join(PATHS)}, optionally followed by "
                                         f"@ and a gated DeltaNet kernel ({', '.join(KERNEL_CHOICES)})")
    return label


def parse_step(argv: list[str]) -> tuple[StepOptions, list[str]]:
    p = argparse.ArgumentParser(prog="bench_step_gpu.py step", add_help=False)
    p.add_argument("--model", choices=sorted(MODELS), default="tiny")
    p.add_argument("--paths", nargs="+", type=path_label, default=list(PATHS),
                   help=f"of {', '.join(PATHS)}, each optionally @KERNEL: the gated DeltaNet's kernel")
    p.add_argument("--cycles", type=int, default=3)
    p.add_argument("--num-samples", type=int, default=6)
    p.add_argument("--min-tokens", type=int, default=12288)
    p.add_argument("--max-tokens", type=int, default=16384)
    p.add_argument("--data-seed", type=int, default=0)
    p.add_argument("--sync-audit", action="store_true")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--host-profile", action="store_true")
    p.add_argument("--profile-warmup", action="store_true")
    p.add_argument("--time-budget-s", type=float, default=1e9)
    p.add_argument("--results-json", default=None)
    p.add_argument("--checkpoint-dir", default=None, help="where the config-only HF checkpoint is written")
    p.add_argument("--image-size", type=int, default=1024, help="vision models: each image's side in pixels")
    p.add_argument("--images-per-sample", type=int, default=1)
    ns, rest = p.parse_known_args(argv)
    if not 1 <= ns.min_tokens <= ns.max_tokens:
        p.error("need 1 <= --min-tokens <= --max-tokens")
    vision = MODELS[ns.model].vision
    if vision is not None and ns.image_size % (vision.patch * vision.merge):
        p.error(f"--image-size must be a multiple of patch x merge = {vision.patch * vision.merge}")
    ckpt = ns.checkpoint_dir or os.path.join(tempfile.gettempdir(), f"bench_step_gpu_{ns.model}")
    return StepOptions(model=ns.model, paths=tuple(dict.fromkeys(ns.paths)), cycles=ns.cycles,
                       num_samples=ns.num_samples, min_tokens=ns.min_tokens, max_tokens=ns.max_tokens,
                       data_seed=ns.data_seed, sync_audit=ns.sync_audit, profile=ns.profile,
                       host_profile=ns.host_profile, profile_warmup=ns.profile_warmup,
                       time_budget_s=ns.time_budget_s, results_json=ns.results_json, checkpoint_dir=ckpt,
                       image_size=ns.image_size, images_per_sample=ns.images_per_sample), rest


def hybrid_config(shape: ModelShape):
    """transformers' Qwen3.5 text config of a hybrid shape (Qwen3.5-MoE's where the shape has experts)."""
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig

    kinds = ["full_attention" if (i + 1) % shape.full_attention_every == 0 else "linear_attention"
             for i in range(shape.layers)]
    common = dict(
        vocab_size=shape.vocab, hidden_size=shape.hidden, num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
        layer_types=kinds, linear_num_key_heads=shape.linear_key_heads,
        linear_num_value_heads=shape.linear_value_heads, linear_key_head_dim=shape.linear_head_dim,
        linear_value_head_dim=shape.linear_head_dim, linear_conv_kernel_dim=4, max_position_embeddings=40960,
        tie_word_embeddings=shape.tied)
    if shape.num_experts:
        return Qwen3_5MoeTextConfig(
            **common, moe_intermediate_size=shape.moe_ffn_hidden, num_experts=shape.num_experts,
            num_experts_per_tok=shape.topk, shared_expert_intermediate_size=shape.moe_ffn_hidden * shape.shared_experts,
            architectures=["Qwen3_5MoeForCausalLM"])
    return Qwen3_5TextConfig(**common, intermediate_size=shape.ffn_hidden, architectures=["Qwen3_5ForCausalLM"])


def latent_moe_config(shape: ModelShape):
    """transformers' GLM-4.7-Flash config of a multi-latent-attention MoE shape (its other fields: the release's)."""
    from transformers import Glm4MoeLiteConfig

    kinds = ["dense" if i < shape.dense_layers else "sparse" for i in range(shape.layers)]
    return Glm4MoeLiteConfig(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.ffn_hidden,
        moe_intermediate_size=shape.moe_ffn_hidden, num_hidden_layers=shape.layers, mlp_layer_types=kinds,
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, n_routed_experts=shape.num_experts,
        num_experts_per_tok=shape.topk, n_shared_experts=shape.shared_experts, q_lora_rank=shape.q_lora_rank,
        kv_lora_rank=shape.kv_lora_rank, qk_nope_head_dim=shape.head_dim, qk_rope_head_dim=shape.qk_rope_head_dim,
        v_head_dim=shape.v_head_dim, max_position_embeddings=40960, tie_word_embeddings=shape.tied,
        pad_token_id=0, architectures=["Glm4MoeLiteForCausalLM"])


V4_KINDS = {"sliding": "sliding_attention", "csa": "compressed_sparse_attention",
            "hca": "heavily_compressed_attention"}


def compressed_config(shape: ModelShape):
    """transformers' DeepSeek-V4 config of a V4 shape (its other fields, YaRN on the compress RoPE included: the
    release's defaults)."""
    from transformers import DeepseekV4Config

    csa, hca = shape.compress_ratios
    return DeepseekV4Config(
        vocab_size=shape.vocab, hidden_size=shape.hidden, moe_intermediate_size=shape.moe_ffn_hidden,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=1,
        head_dim=shape.head_dim, q_lora_rank=shape.q_lora_rank, num_experts_per_tok=shape.topk,
        n_routed_experts=shape.num_experts, n_shared_experts=shape.shared_experts, hc_mult=shape.hc_mult,
        sliding_window=shape.sliding_window, o_groups=shape.o_groups, o_lora_rank=shape.o_lora_rank,
        index_n_heads=shape.index_heads, index_head_dim=shape.index_head_dim, index_topk=shape.index_topk,
        compress_rates={"compressed_sparse_attention": csa, "heavily_compressed_attention": hca},
        layer_types=[V4_KINDS[kind] for kind in shape.attention_kinds],
        mlp_layer_types=["hash_moe" if i < shape.hash_layers else "moe" for i in range(shape.layers)],
        rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1},
        max_position_embeddings=1048576, tie_word_embeddings=shape.tied, architectures=["DeepseekV4ForCausalLM"])


def sink_moe_config(shape: ModelShape):
    """transformers' gpt-oss config of a sliding/full alternating shape (its other fields, YaRN RoPE and the clamped
    SwiGLU's alpha and limit: the release's)."""
    from transformers import GptOssConfig

    kinds = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(shape.layers)]
    return GptOssConfig(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.moe_ffn_hidden,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim, num_local_experts=shape.num_experts, num_experts_per_tok=shape.topk,
        sliding_window=shape.sliding_window, layer_types=kinds, max_position_embeddings=131072,
        rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 4096, "rope_theta": 150000.0},
        tie_word_embeddings=shape.tied, pad_token_id=0, architectures=["GptOssForCausalLM"])


def vision_language_config(shape: ModelShape):
    """transformers' Qwen3.5 composite config (Qwen3_5ForConditionalGeneration): the hybrid text model behind the
    shape's vision tower; the vision token ids are the tiny character tokenizer's (slime/tools/tiny_vl_checkpoint.py)."""
    from transformers import Qwen3_5Config

    from slime.tools.tiny_vl_checkpoint import token_ids

    ids, v = token_ids(), shape.vision
    vision = dict(depth=v.depth, hidden_size=v.hidden, intermediate_size=v.intermediate, num_heads=v.heads,
                  patch_size=v.patch, spatial_merge_size=v.merge, temporal_patch_size=v.temporal_patch,
                  out_hidden_size=shape.hidden, num_position_embeddings=v.position_embeddings)
    text = hybrid_config(shape).to_dict()
    percent = 0.25 if shape.head_dim >= 64 else 0.5  # the release's quarter of each head (half for tiny heads)
    pairs = int(shape.head_dim * percent) // 2
    height, width = max(1, pairs * 11 // 32), max(1, pairs * 10 // 32)  # the release's [11, 11, 10] of 32 pairs
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": percent,
                               "mrope_section": [pairs - height - width, height, width], "mrope_interleaved": True}
    return Qwen3_5Config(text_config=text, vision_config=vision,
                         image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                         vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
                         tie_word_embeddings=shape.tied, architectures=["Qwen3_5ForConditionalGeneration"])


def _processing_files(shape: ModelShape):
    """A vision shape's tokenizer and image processor writer (what --multimodal-keys checks before the run)."""
    from slime.tools.tiny_vl_checkpoint import TinyVLSpec, write_processing_files

    v = shape.vision
    spec = TinyVLSpec(patch_size=v.patch, merge_size=v.merge, max_position_embeddings=40960)
    return lambda out: write_processing_files(Path(out), spec)


def write_config_checkpoint(out_dir: str, shape: ModelShape) -> str:
    """An HF directory holding only config.json (weights stay at megatron's init); a vision shape's also its
    tokenizer and image processor."""
    from slime.tools.tiny_checkpoint import TinyQwen3Spec, build_config

    if shape.hc_mult:
        return _publish_config(out_dir, compressed_config(shape))
    if shape.vision is not None:
        return _publish_config(out_dir, vision_language_config(shape), _processing_files(shape))
    if shape.sliding_every_other:
        return _publish_config(out_dir, sink_moe_config(shape))
    if shape.full_attention_every:
        return _publish_config(out_dir, hybrid_config(shape))
    if shape.kv_lora_rank:
        return _publish_config(out_dir, latent_moe_config(shape))
    spec = TinyQwen3Spec(layers=shape.layers, hidden=shape.hidden, heads=shape.heads, kv_heads=shape.kv_heads,
                         head_dim=shape.head_dim, ffn_hidden=shape.ffn_hidden, max_position_embeddings=40960,
                         tie_word_embeddings=shape.tied, num_experts=shape.num_experts, moe_topk=shape.topk or 2,
                         moe_ffn_hidden=shape.moe_ffn_hidden or 32)
    return _publish_config(out_dir, build_config(spec))


def _publish_config(out_dir: str, config, extra=None) -> str:
    tmp = tempfile.mkdtemp(dir=os.path.dirname(os.path.abspath(out_dir)), prefix=".cfg_")
    config.save_pretrained(tmp)
    if extra is not None:
        extra(tmp)
    if not os.path.exists(os.path.join(out_dir, "config.json")):
        os.replace(tmp, out_dir)  # atomic: another local rank may have written it first
    return out_dir


def step_argv(opts: StepOptions, world: int, rest: list[str], ckpt: str) -> list[str]:
    """Defaults a bare run needs, then the user's flags (they win), then what torchrun fixes. A vision model's run
    trains on images (--multimodal-keys: the trainer builds the tower)."""
    vision = ["--multimodal-keys", '{"image": "images"}', "--apply-chat-template"] if MODELS[opts.model].vision else []
    defaults = [*vision, "--num-rollout", "1000", "--rollout-batch-size", str(opts.num_samples),
                "--n-samples-per-prompt", "1", "--seed", "1234", "--lr", "1e-6",
                "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--use-dynamic-batch-size",
                "--calculate-per-token-loss", "--fence-timeout", "300",
                "--rollout-backend", "embedded"]  # no engines run here (auto refuses the embedded one on CUDA)
    if torch.cuda.is_available():
        defaults.append("--bf16")
    return defaults + rest + ["--hf-checkpoint", ckpt, "--actor-num-nodes", "1",
                              "--actor-num-gpus-per-node", str(world)]


def attention_modules(actor) -> list:
    from slime_plugins.models.cp_attention import ContextParallelAttention

    return [m for chunk in actor.model for m in chunk.modules() if isinstance(m, ContextParallelAttention)]


def use_path(actor, label: str) -> int:
    """Switch the model's attention kernel, megatron's THD RoPE, the fused kernels and the gated DeltaNet's kernel
    to the path `label` (PATH or PATH@KERNEL); the attention modules switched."""
    from megatron.core.transformer.mlp import MLP

    from slime.patches import megatron_core
    from slime.backends.megatron_utils.adam_kernel import fused_adam_chosen, use_fused_adam
    from slime.models import gated_delta_rule
    from slime.models.grouped_experts import GroupedExperts
    from slime_plugins.models import fused_kernels

    path, _, gdn_kernel = label.partition(GDN_SEPARATOR)
    gated_delta_rule.KERNEL_OVERRIDE = gdn_kernel or None

    experts = [m for chunk in actor.model for m in chunk.modules() if isinstance(m, GroupedExperts)]
    if path in EXPERT_PATHS and not experts:
        raise RuntimeError(f"--paths {path} compares MoE experts; the model has no GroupedExperts (dense model, "
                           "or --no-moe-grouped-gemm)")
    base = path == "grouped-base"  # before the fused AdamW, the skipped re-sort and the multi-tensor grad adds
    previous = base or path == "grouped-prev"  # before the batched optimizer copies and the sync-free permute
    for module in experts:
        module.grouped = path != "sequential"
        module.into_main_grad = not base
    megatron_core.apply_thd_rope(enabled=path != "old")
    megatron_core.apply_moe_identity_sort(enabled=not base)
    megatron_core.apply_grad_norm_without_host_sync(multi_tensor=not base)
    megatron_core.apply_batched_optimizer_copies(enabled=not previous)
    megatron_core.apply_permute_without_host_sync(enabled=not previous)
    use_fused_adam(actor.optimizer, fused_adam_chosen(next(actor.model[0].parameters()).device) and not base)
    fused_kernels.configure("compile" if path == "fused" else "eager")
    for module in (m for chunk in actor.model for m in chunk.modules() if isinstance(m, MLP)):
        # megatron's compiled SwiGLU, which has no clamp (DeepSeek-V4's swiglu_limit keeps the eager one)
        module.config.bias_activation_fusion = path == "fused" and module.config.activation_func_clamp_value is None
    modules = attention_modules(actor)
    for module in modules:
        module.kernel = KERNEL_OF_PATH[path]
    return len(modules)


def path_in_use(actor) -> dict:
    """What the model ran with: the THD RoPE (patched or megatron's), the attention and DeltaNet kernels, ..."""
    from slime.patches import megatron_core

    from slime.backends.megatron_utils.adam_kernel import adam_kernel_in_use
    from slime.backends.megatron_utils.offload import torch_optimizers
    from slime.models import gated_delta_rule
    from slime_plugins.models import fused_kernels

    return {"thd_rope": megatron_core.thd_rope_in_use(), "kernels": sorted({m.kernel for m in attention_modules(actor)}),
            "gated_deltanet_kernel": gated_delta_rule.KERNEL_OVERRIDE or "auto",
            "fused_kernels": fused_kernels.active(), "adam": adam_kernel_in_use(actor.optimizer),
            "optimizer": sorted({type(o).__name__ for o in torch_optimizers(actor.optimizer)}),
            "moe_identity_sort_skipped": megatron_core.moe_identity_sort_in_use(),
            "batched_optimizer_copies": megatron_core.batched_optimizer_copies_in_use(),
            "permute_without_host_sync": megatron_core.permute_without_host_sync_in_use()}


def cycle_schedule(paths: tuple[str, ...], cycles: int) -> list[tuple[str, str]]:
    """(kind, path): a warm-up per path, then `cycles` blocks holding each path once, the order
    rotated by one per block (new, old, old, new, new, old, ...)."""
    warmup = [("warmup", p) for p in paths]
    timed = [("timed", paths[(i + b) % len(paths)]) for b in range(cycles) for i in range(len(paths))]
    return warmup + timed


OWN_S, CUMULATIVE_S = 2, 3  # fields of a pstats entry: (calls, primitive calls, own s, cumulative s, callers)


def _profile_rows(profiler, field: int, top: int) -> list[tuple[str, int, float, float]]:
    """(dir/file:line function, calls, own s, cumulative s) of a cProfile run, the most `field` first."""
    import pstats

    stats = pstats.Stats(profiler).stats
    rows = sorted(stats.items(), key=lambda kv: kv[1][field], reverse=True)[:top]
    return [(f"{Path(f).parent.name}/{Path(f).name}:{line} {name}", v[0], v[2], v[3]) for (f, line, name), v in rows]


class StepBench:
    """One process of the step benchmark (every rank runs the same schedule)."""

    def __init__(self, opts: StepOptions, rest: list[str]):
        import gpu_fenced_step as fenced

        from slime.utils.arguments import parse_args

        self.opts = opts
        self.shape = MODELS[opts.model]
        self.env = fenced.TorchrunEnv.read()
        self.device = torch.device("cuda", self.env.local_rank) if torch.cuda.is_available() else torch.device("cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        ckpt = opts.checkpoint_dir
        if self.env.local_rank == 0 and not os.path.exists(os.path.join(ckpt, "config.json")):
            write_config_checkpoint(ckpt, self.shape)
        self._wait_for(os.path.join(ckpt, "config.json"))
        self.args = parse_args(step_argv(opts, self.env.world_size, rest, ckpt))
        self.start = time.perf_counter()
        self.actor = self._build_actor()
        self.clock = fenced.PhaseClock(self.actor.watchdog)
        self.data = fenced.synthetic_rollout(opts, self.actor.hf_config.vocab_size, self.args.n_samples_per_prompt)
        self.data["rewards"] = [(-1.0) ** i for i in range(opts.num_samples)]  # never all-zero advantages
        self.seq_lens = [len(t) for t in self.data["tokens"]]
        self.flops = STEP_FORWARDS * self.shape.forward_flops(self.seq_lens)
        if self.shape.vision is not None:
            vision = vision_arch_of(self.actor.model[0])
            with_images(self.data, self.shape.vision, vision.image_token_id, opts)
            sizes = [opts.image_size] * opts.images_per_sample * opts.num_samples
            self.flops += STEP_FORWARDS * self.shape.vision.forward_flops(sizes, self.shape.hidden)
        self.cycles: list[dict] = []
        self.extras: dict = {}
        self.rollout_id = -1
        self.current = "start-up"

    @staticmethod
    def _wait_for(path: str, deadline_s: float = 300.0) -> None:
        end = time.monotonic() + deadline_s
        while not os.path.exists(path):
            if time.monotonic() > end:
                raise TimeoutError(f"{path} not written within {deadline_s:g}s")
            time.sleep(0.2)

    def _build_actor(self):
        from slime.backends.megatron_utils.actor import MegatronTrainActor

        ledger_dir = self.args.ledger_dir or os.path.join(tempfile.gettempdir(), f"bench_step_ledger_{self.env.master_port}")
        actor = MegatronTrainActor(self.args, self.env.rank, self.env.world_size, ledger_dir)
        actor._load_weights = lambda *where: None  # weights stay at megatron's random init (see module doc)
        actor.init(self.env.master_addr, self.env.master_port, engine_urls=[])
        if not attention_modules(actor) and not self.shape.hc_mult:  # V4's attention is its own module
            raise RuntimeError("the model does not use ContextParallelAttention (TransformerEngine spec?): "
                               "this benchmark compares the local-spec paths; pass --transformer-impl local")
        return actor

    def measure_tower(self, reps: int = 3) -> dict:
        """The vision tower alone on the step's images, as the step runs it: a forward without gradients (the
        log-probs), then a forward and a backward (the training pass); median seconds of `reps`."""
        from slime.models.hf_weights import unwrap_model
        from slime.models.vision_arch import VISION_MODULE

        tower = getattr(unwrap_model(self.actor.model[0]), VISION_MODULE)
        inputs = [x for x in self.data["multimodal_train_inputs"] if x is not None]
        pixels = torch.cat([x["pixel_values"] for x in inputs]).to(self.device)
        grids = torch.cat([x["image_grid_thw"] for x in inputs]).to(self.device)

        def forward() -> torch.Tensor:
            return tower(pixels.to(tower.dtype), grid_thw=grids).pooler_output

        def timed(fn) -> float:
            times = []
            for _ in range(reps):
                synchronize(self.device)
                start = time.perf_counter()
                fn()
                synchronize(self.device)
                times.append(time.perf_counter() - start)
            return statistics.median(times)

        with torch.no_grad():
            no_grad_s = timed(forward)
        train_s = timed(lambda: forward().float().square().mean().backward())
        tower.zero_grad(set_to_none=True)
        step_s = statistics.median(c["step_s"] for c in self.cycles if c["path"] == self.opts.paths[0])
        return {"images": grids.shape[0], "patches": int(pixels.shape[0]), "image_tokens": int(grids.prod(-1).sum())
                // self.shape.vision.merge ** 2, "log_prob_forward_s": no_grad_s, "train_forward_backward_s": train_s,
                "tower_s": no_grad_s + train_s, "step_s": step_s, "share": (no_grad_s + train_s) / step_s,
                "tower_params": sum(p.numel() for p in tower.parameters())}

    # -- one cycle -------------------------------------------------------------------------
    def _train(self) -> dict:
        """actor.train on a fresh copy of the rollout, under the next rollout id (same on every rank)."""
        self.rollout_id += 1
        return self.actor.train(self.rollout_id, copy.deepcopy(self.data))

    def run_cycle(self, path: str) -> dict:
        use_path(self.actor, path)
        if len(self.cycles) == int(os.environ.get("BENCH_STEP_INJECT_OOM_AT", -1)):  # tests: the OOM report
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected by BENCH_STEP_INJECT_OOM_AT)")
        gc.collect()  # between cycles, never inside one
        gc.disable()
        synchronize(self.device)
        reset_peak(self.device)
        static = allocated_gib(self.device)
        start = time.perf_counter()
        try:
            metrics = self._train()
            synchronize(self.device)
        finally:
            gc.enable()
        wall = time.perf_counter() - start
        phases = self.clock.take()
        step_s = wall - phases.get("actor_train/wake", 0.0)
        world = self.env.world_size
        return {
            "rollout_id": self.rollout_id, "path": path, "in_use": path_in_use(self.actor),
            "step_s": step_s, "wall_s": wall,
            "tokens_per_s_per_gpu": sum(self.seq_lens) / step_s / world,
            "tflops_per_gpu": self.flops / step_s / world / 1e12,
            "peak_gib": peak_gib(self.device), "static_gib": static, "host_peak_gib": host_peak_gib(),
            "loss": metrics["train/loss"], "grad_norm": metrics["train/grad_norm"],
            "num_micro_batches": metrics["train/num_micro_batches"],
            "phase_s": {k: round(v, 4) for k, v in sorted(phases.items())},
        }

    def audit_syncs(self, path: str) -> dict:
        use_path(self.actor, path)
        with recording_syncs(self.device) as records:
            self._train()
        self.clock.take()
        return {"total": sum(1 for r in records if "synchronizing" in str(r.message)),
                "top_sites": sync_sites(list(records), top=15)}

    def profile_cycle(self, path: str) -> dict:
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        use_path(self.actor, path)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        start = time.perf_counter()
        with profile(activities=activities) as prof:
            self._train()
            synchronize(self.device)
        wall = time.perf_counter() - start
        self.clock.take()
        kernels = [e for e in prof.key_averages()
                   if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]
        kernels.sort(key=lambda e: e.self_device_time_total, reverse=True)
        busy_s = sum(e.self_device_time_total for e in kernels) / 1e6
        by_kind = collections.Counter()
        for e in kernels:
            by_kind[kernel_kind(e.key)] += e.self_device_time_total / 1e6
        return {"path": path, "wall_s": wall, "kernel_s": busy_s, "kernel_share": busy_s / wall,
                "kernel_s_by_kind": {k: round(v, 3) for k, v in by_kind.most_common()},
                "top_kernels": [{"name": e.key[:120], "gpu_s": e.self_device_time_total / 1e6, "calls": e.count}
                                for e in kernels[:20]]}

    def host_profile_cycle(self, path: str, top: int = 14) -> dict:
        """One cycle under cProfile (the host's Python time; the profiler's own cost inflates it): the functions
        with the most own time, and the phase clock's split of the same cycle."""
        import cProfile

        use_path(self.actor, path)
        profiler = cProfile.Profile()
        start = time.perf_counter()
        profiler.enable()
        try:
            self._train()
            synchronize(self.device)
        finally:
            profiler.disable()
        wall = time.perf_counter() - start
        return {"path": path, "wall_s": wall, "phase_s": {k: round(v, 3) for k, v in sorted(self.clock.take().items())},
                "top_own": [{"function": name, "calls": calls, "own_s": round(own, 4), "cumulative_s": round(cum, 4)}
                            for name, calls, own, cum in _profile_rows(profiler, OWN_S, top)]}

    def profiled_first_cycle(self, path: str, top: int = 25) -> dict:
        """run_cycle under cProfile, its functions with the most cumulative and own time in a WARMUP_PROFILE line:
        a fresh process's first step is mostly host work (tracing, cache lookups, kernel loading), not kernels."""
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
        try:
            result = self.run_cycle(path)
        finally:
            profiler.disable()
        cumulative = _profile_rows(profiler, CUMULATIVE_S, top)
        own = _profile_rows(profiler, OWN_S, top)
        self.report(f"WARMUP_PROFILE {path}: wall {result['wall_s']:.1f} s under cProfile; cumulative: "
                    + "; ".join(f"{name} x{calls} {cum_s:.1f}s" for name, calls, _, cum_s in cumulative)
                    + " || own: " + "; ".join(f"{name} x{calls} {own_s:.2f}s" for name, calls, own_s, _ in own))
        return result

    # -- the run -----------------------------------------------------------------------------
    def out_of_time(self, estimate_s: float) -> bool:
        """Every rank agrees: the decision is reduced (MAX) over the world."""
        import torch.distributed as dist

        late = time.perf_counter() - self.start + estimate_s > self.opts.time_budget_s
        flag = torch.tensor([1.0 if late else 0.0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def run(self) -> dict:
        """Warm-ups, timed cycles, then the audit and profile cycles, each only if time is left."""
        last: dict[str, float] = {}
        schedule = cycle_schedule(self.opts.paths, self.opts.cycles)
        for kind, path in schedule:
            if self.out_of_time(last.get(path, 0.0)):
                return self._stop(f"time budget: {len(self.cycles)} of {len(schedule)} cycles ran")
            self.current = f"{kind} cycle of the {path} path"
            if self.opts.profile_warmup and not self.cycles:
                result = {**self.profiled_first_cycle(path), "kind": kind}
            else:
                result = {**self.run_cycle(path), "kind": kind}
            last[path] = result["wall_s"]
            self.cycles.append(result)
            self.report("CYCLE " + json.dumps(result))
        if self.shape.vision is not None and self.opts.paths[0] in last:
            if self.out_of_time(4 * last[self.opts.paths[0]]):
                return self._stop("time budget: the vision tower was not timed alone")
            self.current = "the vision tower timed alone"
            v = self.extras["vision"] = self.measure_tower()
            self.report(f"VISION {self.opts.model}: the tower ({v['tower_params'] / 1e6:.0f} M parameters) on the step's "
                        f"{v['images']} images ({v['patches']} patches, {v['image_tokens']} image tokens): "
                        f"{v['tower_s']:.3f} s of a {v['step_s']:.3f} s step ({100 * v['share']:.1f} %): log-prob "
                        f"forward {v['log_prob_forward_s']:.3f} s, training forward + backward "
                        f"{v['train_forward_backward_s']:.3f} s")
        for path in self.opts.paths if self.opts.sync_audit else ():
            if self.out_of_time(last[path]):
                return self._stop(f"time budget: no sync audit of the {path} path")
            self.current = f"sync audit of the {path} path"
            audit = self.extras[f"syncs_{path}"] = self.audit_syncs(path)
            self.report(f"SYNC {self.opts.model} {path}: {audit['total']} host-device syncs per step; "
                        f"top sites {audit['top_sites']}")
        first = self.opts.paths[0]
        if self.opts.profile and first in last:
            if self.out_of_time(3 * last[first]):  # tracing and reading the trace back cost extra
                return self._stop("time budget: no profiled cycle")
            self.current = f"profiled cycle of the {first} path"
            p = self.extras[f"profile_{first}"] = self.profile_cycle(first)
            self.report(f"PROFILE {self.opts.model} {first}: kernels {p['kernel_s']:.2f} s of a {p['wall_s']:.2f} s step "
                        f"({100 * p['kernel_share']:.0f} %); by kind {p['kernel_s_by_kind']}; top: "
                        + "; ".join(f"{k['name'][:60]} {k['gpu_s']:.2f}s" for k in p["top_kernels"][:6]))
        if self.opts.host_profile and first in last:
            if self.out_of_time(3 * last[first]):
                return self._stop("time budget: no host-profiled cycle")
            self.current = f"host-profiled cycle of the {first} path"
            h = self.extras[f"host_profile_{first}"] = self.host_profile_cycle(first)
            self.report(f"HOST {self.opts.model} {first}: {h['wall_s']:.2f} s under cProfile, phases {h['phase_s']}; "
                        "own time: " + "; ".join(f"{r['function']} x{r['calls']} {r['own_s']:.3f}s"
                                                 for r in h["top_own"]))
        return self._finish()

    def _stop(self, why: str) -> dict:
        self.extras["stopped_early"] = why
        self.report("STOPPED " + why)
        return self._finish()

    def _finish(self) -> dict:
        """The summary, after the compile counters where the fused path ran (a run cut short reports them too:
        a warm start's first step is often all it measures)."""
        if any(p.partition(GDN_SEPARATOR)[0] == "fused" for p in self.opts.paths):
            c = self.extras["compile_counters"] = compile_counters()
            self.report(f"COMPILE_COUNTERS {self.opts.model}: {json.dumps(c)}")
        return self.summary()

    def layout(self) -> dict:
        a = self.args
        return {"model": self.opts.model, "shape": asdict(self.shape), "world": self.env.world_size,
                "tp": a.tensor_model_parallel_size, "cp": a.context_parallel_size, "sp": a.sequence_parallel,
                "max_tokens_per_gpu": a.max_tokens_per_gpu, "recompute": [a.recompute_granularity,
                a.recompute_method, a.recompute_num_layers], "bf16": a.bf16,
                "device": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu",
                "device_memory_gib": (torch.cuda.get_device_properties(self.device).total_memory / 2**30
                                      if self.device.type == "cuda" else 0.0),
                "torch": torch.__version__, "samples": len(self.seq_lens), "tokens": sum(self.seq_lens),
                "seq_lens": self.seq_lens, "step_model_flops": self.flops,
                "attention_modules": len(attention_modules(self.actor)),
                "matmul_params": self.shape.matmul_params(), **self.parameter_counts()}

    def parameter_counts(self) -> dict:
        """This rank's parameters and the share of them the optimizer trains (LoRA: the adapters alone)."""
        params = [p for chunk in self.actor.model for p in chunk.parameters()]
        return {"params": sum(p.numel() for p in params),
                "trained_params": sum(p.numel() for p in params if p.requires_grad)}

    def summary(self) -> dict:
        by_path: dict[str, dict] = {}
        for path in self.opts.paths:
            timed = [c for c in self.cycles if c["path"] == path and c["kind"] == "timed"] or \
                    [c for c in self.cycles if c["path"] == path]
            if not timed:
                continue
            med = lambda key: statistics.median(c[key] for c in timed)  # noqa: E731
            by_path[path] = {"cycles": len(timed), "step_s": med("step_s"), "tflops_per_gpu": med("tflops_per_gpu"),
                             "tokens_per_s_per_gpu": med("tokens_per_s_per_gpu"),
                             "peak_gib": max(c["peak_gib"] for c in timed), "static_gib": med("static_gib"),
                             "host_peak_gib": max(c.get("host_peak_gib", 0.0) for c in timed),
                             "loss": timed[0]["loss"], "grad_norm": timed[0]["grad_norm"],
                             "only_warmup": all(c["kind"] == "warmup" for c in timed)}
        return {**self.layout(), "paths": by_path, **self.extras}

    def report(self, line: str) -> None:
        if self.env.rank == 0:
            print(line, flush=True)
            write_json(self.opts.results_json, {"options": asdict(self.opts), "summary": self.summary(),
                                                "cycles": self.cycles})


def vision_arch_of(chunk):
    from slime.models.vision_arch import vision_arch_of as arch

    return arch(chunk)


def with_images(data: dict, vision: VisionShape, image_token_id: int, opts: StepOptions) -> None:
    """Each sample's prompt begins with its images' token runs (between vision start and end tokens), the rest of
    the sample kept at its length; random pixel values [patches, 3 x temporal x patch x patch] and the grids go to
    `multimodal_train_inputs`. The response shrinks where the prompt must hold the images."""
    from slime.tools.tiny_vl_checkpoint import token_ids

    ids = token_ids()
    side = opts.image_size // vision.patch
    run = [ids["<|vision_start|>"], *[image_token_id] * vision.tokens(opts.image_size), ids["<|vision_end|>"]]
    block = run * opts.images_per_sample
    generator = torch.Generator().manual_seed(opts.data_seed)
    data["multimodal_train_inputs"] = []
    for i, tokens in enumerate(data["tokens"]):
        if len(tokens) < len(block) + 2:
            raise ValueError(f"a sample of {len(tokens)} tokens cannot hold {len(block)} image tokens and a response: "
                             "raise --min-tokens or lower --image-size")
        rest = [t if t != image_token_id else t + 1 for t in tokens[len(block):]]  # no stray image token
        data["tokens"][i] = block + rest
        cap = len(data["tokens"][i]) - len(block) - 1
        if data["response_lengths"][i] > cap:
            data["response_lengths"][i] = cap
            data["loss_masks"][i] = data["loss_masks"][i][-cap:]
        patches = vision.patches(opts.image_size) * opts.images_per_sample
        data["multimodal_train_inputs"].append({
            "pixel_values": torch.randn(patches, 3 * vision.temporal_patch * vision.patch ** 2, generator=generator),
            "image_grid_thw": torch.tensor([[1, side, side]] * opts.images_per_sample)})


def compile_counters() -> dict:
    """What torch.compile did in this process: graphs compiled, cache hits and misses (FX graph, AOTAutograd),
    recompiles, and the seconds by compile stage (where a warm start's time goes)."""
    from torch._dynamo.utils import compile_times, counters

    kept = ("stats", "inductor", "aot_autograd", "recompiles", "frames")
    out = {group: {k: v for k, v in counters[group].items() if isinstance(v, int)} for group in kept if group in counters}
    names, totals = compile_times(repr="csv", aggregate=True)
    out["seconds_by_stage"] = {name: round(float(t), 2) for name, t in zip(names, totals) if float(t) >= 0.5}
    return out


def summary_lines(s: dict) -> list[str]:
    """RATIO / MEMORY / FIT lines of a step summary."""
    name = (f"{s['model']} world{s['world']} tp{s['tp']} cp{s['cp']} max-tokens-per-gpu {s['max_tokens_per_gpu']}"
            f" recompute {'/'.join(str(x) for x in s['recompute']) if s['recompute'][0] else 'off'}")
    paths = s["paths"]
    lines = []
    per_path = "; ".join(f"{p} {m['tflops_per_gpu']:.0f} TFLOP/s/GPU {m['tokens_per_s_per_gpu']:.0f} tok/s/GPU "
                         f"{m['step_s']:.2f} s (median of {m['cycles']}{' warm-up only' if m['only_warmup'] else ''})"
                         for p, m in paths.items())
    pairs = [(a, b) for a, b in zip(PATHS, PATHS[1:]) if a in paths and b in paths]
    pairs += [(p.partition(GDN_SEPARATOR)[0], p) for p in paths  # a path against itself with another DeltaNet kernel
              if GDN_SEPARATOR in p and p.partition(GDN_SEPARATOR)[0] in paths]
    ratio = "".join(f"{a}/{b} speed = {paths[b]['step_s'] / paths[a]['step_s']:.2f}x; " for a, b in pairs)
    lines.append(f"RATIO step {name}: {ratio}{per_path or 'no cycle finished'}; {s['tokens']} tokens in "
                 f"{s['samples']} samples")
    per_32k = 32768 / s["max_tokens_per_gpu"] if s["max_tokens_per_gpu"] else float("nan")
    lines.append("MEMORY step " + name + ": " + ("; ".join(
        f"{p} peak {m['peak_gib']:.1f} GiB (static {m['static_gib']:.1f}, above static {m['peak_gib'] - m['static_gib']:.1f}"
        f" = {(m['peak_gib'] - m['static_gib']) * per_32k:.1f} per 32k tokens), host peak {m.get('host_peak_gib', 0):.1f} GiB"
        for p, m in paths.items())
        or "no cycle finished") + (f"; parameters {s['params'] / 1e9:.3f} B, trained {s['trained_params'] / 1e6:.1f} M"
                                   if "params" in s else ""))  # summaries written before the counts were kept
    verdict = "; ".join(f"{p} fits" for p in paths) or "no cycle finished"
    if s.get("failure"):
        verdict += f"; then {s['failure']}"
    if len(paths) > 1:  # with --lr 0 every cycle trains the same weights: the paths differ by their numerics only
        ref = next(iter(paths.values()))
        lines.append(f"PARITY step {name}: " + "; ".join(
            f"{p} loss {m['loss']:.6g} grad norm {m['grad_norm']:.6g} (rel diff to the first "
            f"{abs(m['loss'] - ref['loss']) / max(abs(ref['loss']), 1e-30):.1e} / "
            f"{abs(m['grad_norm'] - ref['grad_norm']) / max(abs(ref['grad_norm']), 1e-30):.1e})"
            for p, m in paths.items()))
    lines.append(f"FIT step {name}: {verdict}; peak {max((m['peak_gib'] for m in paths.values()), default=0):.1f}"
                 f" GiB of {s['device_memory_gib']:.1f} GiB")
    return lines


KERNEL_KINDS = (  # (kind, lower-case name fragments), first match wins
    ("attention", ("fmha", "flash", "sdpa", "attention")),
    ("expert grouped GEMM", ("grouped", "group_gemm", "groupproblem", "ptr_array", "ptrarray")),
    ("router top-k / sort", ("topk", "sort", "radix")),
    ("index / gather / scatter (MoE permute)", ("index", "scatter", "gather", "masked_select", "nonzero")),
    ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "matmul")),
    ("compiled (triton)", ("triton",)),
    ("nccl", ("nccl",)),
    ("copy / cast", ("copy", "cast", "convert")),
    ("reduction", ("reduce", "norm", "softmax", "sum", "max")),
)


def kernel_kind(name: str) -> str:
    """A CUDA kernel's kind for the profile's time breakdown (the rest: elementwise and other)."""
    lower = name.lower()
    return next((kind for kind, parts in KERNEL_KINDS if any(p in lower for p in parts)), "elementwise / other")


def failure_site(exc: BaseException) -> str:
    """The innermost frame of this project or megatron in the exception's traceback (where an OOM hit)."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if any(p in f.filename for p in ("/slime/", "/slime_plugins/", "/megatron/"))]
    if not frames:
        return "?"
    f = (ours or frames)[-1]
    return f"{Path(f.filename).parent.name}/{Path(f.filename).name}:{f.lineno} {f.name}"


def show_deltanet_kernel_lines() -> None:
    """The gated DeltaNet's kernel choice and fla-dqkwg's first-use check (INFO lines) on stdout: the step's log."""
    import logging

    from slime.models import gated_delta_rule

    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("LOG %(name)s: %(message)s"))
    log = logging.getLogger(gated_delta_rule.__name__)
    log.setLevel(logging.INFO)
    log.addHandler(handler)
    log.propagate = False


def run_step(argv: list[str]) -> int:
    opts, rest = parse_step(argv)
    show_deltanet_kernel_lines()
    start = time.perf_counter()
    rank = os.environ.get("RANK", "?")
    bench = None
    try:
        bench = StepBench(opts, rest)
        summary = bench.run()
    except BaseException as exc:  # noqa: BLE001 - report any ending, then leave without a teardown that could hang
        sys.stderr.write(traceback.format_exc())
        first = (str(exc).strip().splitlines() or [""])[0][:400]
        kind = "OOM" if is_oom(exc) else "FAILED"
        where = failure_site(exc)
        print(f"{kind} rank={rank} after={time.perf_counter() - start:.1f}s at {where}: {type(exc).__name__}: {first}",
              flush=True)
        if bench is not None and rank == "0":
            summary = bench.summary()
            summary["failure"] = f"{kind} in the {bench.current} at {where}: {type(exc).__name__}: {first}"
            write_json(opts.results_json, {"options": asdict(opts), "summary": summary, "cycles": bench.cycles})
            for line in summary_lines(summary):
                print(line, flush=True)
        sys.stdout.flush()
        os._exit(OOM_EXIT_CODE if kind == "OOM" else 1)
    if rank == "0":
        for line in summary_lines(summary):
            print(line, flush=True)
        write_json(opts.results_json, {"options": asdict(opts), "summary": summary, "cycles": bench.cycles})
    sys.stdout.flush()
    os._exit(0)  # skip process-group teardown: every rank passed the last exit fence


def main(argv: list[str]) -> int:
    commands = {"attention": run_attention, "step": run_step}
    if not argv or argv[0] not in commands:
        print(__doc__)
        print(f"usage: bench_step_gpu.py {{{','.join(commands)}}} ...", file=sys.stderr)
        return 2
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

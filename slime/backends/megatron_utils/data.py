"""Micro-batch plans, packing and zig-zag context-parallel slicing.

Everything here is pure (no collectives): every rank computes the same plans from the
rollout data all ranks share, so the plans can be fingerprinted and compared across
ranks instead of being trusted. The distributed step (train_step.py) only executes them.

Conventions shared with slime/models/cp_attention.py:
- each sequence is padded to a multiple of ``pad_multiple_for(cp, tp, sp)``;
- zig-zag: a padded sequence is cut into 2*cp equal chunks, CP rank r holds chunks r
  and 2*cp-1-r (concatenated in that order), which balances causal-attention work;
- cu_seqlens describe the FULL padded sequences; position ids are global positions
  within each sequence.
Per-token tensors are aligned with the *target*: position t carries the mask, old
log-prob, advantage, ... of token t+1 (logits at t predict token t+1).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import warnings
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from slime.models.mrope import image_token_counts, position_rows
from slime.models.vision_arch import VisionArch, VisionBatch

# Keys of per-response-token float lists in the rollout data, and the PackedMicroBatch
# field each one is aligned into.
PER_TOKEN_KEYS: dict[str, str] = {
    "log_probs": "old_log_probs",
    "ref_log_probs": "ref_log_probs",
    "advantages": "advantages",
    "rollout_log_probs": "rollout_log_probs",
    "opd_reverse_kl": "opd_reverse_kl",
    "values": "old_values",
    "returns": "returns",
}

PAD_TOKEN_ID = 0
PADDING_SAMPLE_ID = -1  # marks the dummy sequence of a padding micro-batch


# ----------------------------------------------------------------------------- plans


@dataclass(frozen=True)
class MicroBatchPlan:
    """One training step's micro-batches for one DP rank (identical within its DP group)."""

    step_index: int
    """Step within the rollout (0 .. num_steps-1)."""
    dp_rank: int
    dp_size: int
    micro_batches: tuple[tuple[int, ...], ...]
    """Sample positions (indices into the rollout lists) per micro-batch; () = padding."""
    token_counts: tuple[int, ...]
    """Unpadded tokens per micro-batch (0 for a padding micro-batch)."""
    padded_lengths: tuple[int, ...]
    """Sum of the full padded sequence lengths per micro-batch (before CP slicing)."""
    loss_token_counts: tuple[int, ...]
    """Loss-mask tokens per micro-batch on this DP rank."""
    step_loss_token_total: int
    """Loss tokens of the whole step over ALL DP ranks (the per-token denominator)."""
    step_sample_count: int
    """Samples of the whole step over ALL DP ranks (the per-sample-mean denominator)."""
    num_padding_micro_batches: int
    """Trailing micro-batches that run forward with zero loss weight to equalise counts."""
    cp_size: int
    pad_multiple: int
    global_digest: str
    """Hash of every DP rank's micro-batches of this step: equal on all ranks iff they
    all derived the same global plan."""

    @property
    def num_micro_batches(self) -> int:
        return len(self.micro_batches)

    def is_padding(self, index: int) -> bool:
        return len(self.micro_batches[index]) == 0

    def fingerprint_fields(self) -> dict[str, Any]:
        """Plain JSON-able fields that must be EQUAL ON ALL RANKS (all-rank fence)."""
        return {
            "step_index": self.step_index,
            "dp_size": self.dp_size,
            "cp_size": self.cp_size,
            "pad_multiple": self.pad_multiple,
            "num_micro_batches": self.num_micro_batches,
            "step_loss_token_total": self.step_loss_token_total,
            "step_sample_count": self.step_sample_count,
            "global_digest": self.global_digest,
        }

    def rank_fields(self) -> dict[str, Any]:
        """This DP rank's own content: equal within its DP group (TP/CP/PP peers) only."""
        return {
            "dp_rank": self.dp_rank,
            "micro_batches": [list(mb) for mb in self.micro_batches],
            "token_counts": list(self.token_counts),
            "loss_token_counts": list(self.loss_token_counts),
            "local_padded_lengths": [n // self.cp_size for n in self.padded_lengths],
            "num_padding_micro_batches": self.num_padding_micro_batches,
        }


def pad_multiple_for(cp_size: int, tp_size: int, sequence_parallel: bool) -> int:
    """Per-sequence padding unit: 2*cp for zig-zag, times tp so SP can split the sequence."""
    return 2 * cp_size * (tp_size if sequence_parallel else 1)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def build_rollout_plans(
    sample_lengths: Sequence[int],
    loss_token_counts: Sequence[int],
    *,
    num_steps: int,
    dp_size: int,
    dp_rank: int,
    use_dynamic_batch_size: bool,
    max_tokens_per_gpu: int | None,
    cp_size: int,
    micro_batch_size: int,
    global_batch_size: int | None,
    balance_data: bool,
    pad_multiple: int,
) -> list[MicroBatchPlan]:
    """Plans of every step of one rollout for ``dp_rank``; deterministic in its inputs."""
    if len(sample_lengths) != len(loss_token_counts):
        raise ValueError("sample_lengths and loss_token_counts differ in length")
    if use_dynamic_batch_size and not max_tokens_per_gpu:
        raise ValueError("--use-dynamic-batch-size needs --max-tokens-per-gpu")
    padded = [round_up(n, pad_multiple) for n in sample_lengths]
    budget = max_tokens_per_gpu * cp_size if use_dynamic_batch_size else None
    plans = []
    for step_index, step_ids in enumerate(_split_steps(len(sample_lengths), num_steps, global_batch_size)):
        per_rank = _partition_dp(step_ids, padded, dp_size, balance_data)
        batches = [
            _dynamic_micro_batches(ids, padded, budget) if budget else _fixed_micro_batches(ids, micro_batch_size)
            for ids in per_rank
        ]
        target = max(1, max(len(b) for b in batches))
        every_rank = [_equalise_count(b, padded, target) for b in batches]
        digest = hashlib.sha256(json.dumps([step_ids, every_rank, padded]).encode()).hexdigest()[:16]
        plans.append(_make_plan(step_index, dp_rank, dp_size, every_rank[dp_rank], step_ids, sample_lengths,
                                padded, loss_token_counts, cp_size, pad_multiple, digest))
    return plans


def _split_steps(num_samples: int, num_steps: int, global_batch_size: int | None) -> list[list[int]]:
    """Contiguous steps of global_batch_size samples; a rollout of another size (a generate function that
    returned several samples per prompt) is cut into num_steps steps whose sizes differ by at most one."""
    step_size = global_batch_size or num_samples // num_steps
    if step_size * num_steps == num_samples:
        return [list(range(s * step_size, (s + 1) * step_size)) for s in range(num_steps)]
    if global_batch_size is None or num_samples < num_steps:
        raise ValueError(f"rollout has {num_samples} samples but num_steps={num_steps} x global_batch_size={step_size}")
    bounds = [round(s * num_samples / num_steps) for s in range(num_steps + 1)]
    return [list(range(bounds[s], bounds[s + 1])) for s in range(num_steps)]


def _partition_dp(ids: list[int], padded: Sequence[int], dp_size: int, balance: bool) -> list[list[int]]:
    """Split a step's samples over DP ranks with counts differing by at most one.

    balance: longest-first greedy onto the rank with fewest tokens (ties: lowest rank),
    so ranks see similar token loads; otherwise contiguous slices.
    """
    base, extra = divmod(len(ids), dp_size)
    capacity = [base + (1 if r < extra else 0) for r in range(dp_size)]
    if not balance:
        starts = [sum(capacity[:r]) for r in range(dp_size)]
        return [ids[starts[r]: starts[r] + capacity[r]] for r in range(dp_size)]
    parts: list[list[int]] = [[] for _ in range(dp_size)]
    loads = [0] * dp_size
    for i in sorted(ids, key=lambda i: (-padded[i], i)):
        rank = min((r for r in range(dp_size) if len(parts[r]) < capacity[r]), key=lambda r: (loads[r], r))
        parts[rank].append(i)
        loads[rank] += padded[i]
    return [sorted(p) for p in parts]


def _fixed_micro_batches(ids: list[int], micro_batch_size: int) -> list[tuple[int, ...]]:
    return [tuple(ids[i: i + micro_batch_size]) for i in range(0, len(ids), micro_batch_size)]


def _dynamic_micro_batches(ids: list[int], padded: Sequence[int], budget: int) -> list[tuple[int, ...]]:
    """Fewest micro-batches (first-fit decreasing) with at most ``budget`` padded tokens.

    A sample longer than the budget cannot be split across micro-batches, so it gets a
    micro-batch of its own and a warning (it may need more memory than planned).
    """
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(ids, key=lambda i: (-padded[i], i)):
        if padded[i] > budget:
            warnings.warn(
                f"sample {i} has {padded[i]} padded tokens > max_tokens_per_gpu*cp={budget}; "
                "it gets a micro-batch of its own",
                stacklevel=3,
            )
            bins.append([i])
            loads.append(padded[i])
            continue
        slot = next((b for b, load in enumerate(loads) if load + padded[i] <= budget), None)
        if slot is None:
            bins.append([i])
            loads.append(padded[i])
        else:
            bins[slot].append(i)
            loads[slot] += padded[i]
    return [tuple(sorted(b)) for b in bins]


def _equalise_count(batches: list[tuple[int, ...]], padded: Sequence[int], target: int) -> list[tuple[int, ...]]:
    """Reach ``target`` micro-batches by splitting multi-sample ones, then by padding.

    Splitting keeps every micro-batch within budget; padding micro-batches (empty
    tuples) run a dummy forward with zero loss weight so every rank runs the same
    number of forward/backward passes (and collectives).
    """
    batches = list(batches)
    while len(batches) < target:
        splittable = [b for b in range(len(batches)) if len(batches[b]) > 1]
        if not splittable:
            return batches + [()] * (target - len(batches))
        b = max(splittable, key=lambda b: (len(batches[b]), sum(padded[i] for i in batches[b]), -b))
        left, right = _halve(batches[b], padded)
        batches[b: b + 1] = [left, right]
    return batches


def _halve(mb: tuple[int, ...], padded: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Split a micro-batch in two non-empty halves of similar token load."""
    total, acc = sum(padded[i] for i in mb), 0
    for cut in range(1, len(mb)):
        acc += padded[mb[cut - 1]]
        if acc * 2 >= total:
            break
    return mb[:cut], mb[cut:]


def _make_plan(step_index, dp_rank, dp_size, batches, step_ids, lengths, padded, loss_counts,
               cp_size, pad_multiple, digest) -> MicroBatchPlan:
    return MicroBatchPlan(
        step_index=step_index,
        dp_rank=dp_rank,
        dp_size=dp_size,
        micro_batches=tuple(batches),
        token_counts=tuple(sum(lengths[i] for i in mb) for mb in batches),
        padded_lengths=tuple(sum(padded[i] for i in mb) if mb else pad_multiple for mb in batches),
        loss_token_counts=tuple(sum(loss_counts[i] for i in mb) for mb in batches),
        step_loss_token_total=sum(loss_counts[i] for i in step_ids),
        step_sample_count=len(step_ids),
        num_padding_micro_batches=sum(1 for mb in batches if not mb),
        cp_size=cp_size,
        pad_multiple=pad_multiple,
        global_digest=digest,
    )


def plans_from_rollout(data: Mapping[str, Any], args: Any, *, dp_size: int, dp_rank: int) -> list[MicroBatchPlan]:
    """build_rollout_plans with the sizes read from the rollout data and ``args``."""
    cp = args.context_parallel_size
    return build_rollout_plans(
        [len(t) for t in data["tokens"]],
        [int(sum(m)) for m in data["loss_masks"]],
        num_steps=args.num_steps_per_rollout,
        dp_size=dp_size,
        dp_rank=dp_rank,
        use_dynamic_batch_size=args.use_dynamic_batch_size,
        max_tokens_per_gpu=args.max_tokens_per_gpu,
        cp_size=cp,
        micro_batch_size=args.micro_batch_size,
        global_batch_size=args.global_batch_size,
        balance_data=args.balance_data,
        pad_multiple=pad_multiple_for(cp, args.tensor_model_parallel_size, args.sequence_parallel),
    )


# ------------------------------------------------------------------------ zig-zag CP


def zigzag_slice(t: torch.Tensor, cp_size: int, cp_rank: int, dim: int = 0) -> torch.Tensor:
    """CP rank's part of one padded sequence: chunks r and 2*cp-1-r of 2*cp chunks."""
    if cp_size == 1:
        return t
    chunks = t.chunk(2 * cp_size, dim=dim)
    if t.size(dim) % (2 * cp_size):
        raise ValueError(f"length {t.size(dim)} is not a multiple of 2*cp={2 * cp_size}")
    return torch.cat([chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]], dim=dim)


def zigzag_index(lengths: Sequence[int], cp_size: int, cp_rank: int) -> torch.Tensor:
    """Positions, in sequences of ``lengths`` laid end to end, of CP rank's parts: zigzag_slice of each sequence's
    positions, concatenated (one gather then takes every field's part)."""
    starts = itertools.accumulate(lengths, initial=0)
    return torch.cat([start + zigzag_slice(torch.arange(length), cp_size, cp_rank)
                      for start, length in zip(starts, lengths)])


def zigzag_gather(slices: Sequence[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """Inverse of zigzag_slice: ``slices[r]`` is CP rank r's part; returns the sequence."""
    cp_size = len(slices)
    if cp_size == 1:
        return slices[0]
    ordered: list[torch.Tensor | None] = [None] * (2 * cp_size)
    for rank, part in enumerate(slices):
        first, second = part.chunk(2, dim=dim)
        ordered[rank], ordered[2 * cp_size - 1 - rank] = first, second
    return torch.cat(ordered, dim=dim)


# ------------------------------------------------------------------------- packing


@dataclass(frozen=True)
class PackedMicroBatch:
    """One micro-batch packed as a THD batch, sliced for one CP rank.

    Per-token tensors are [T_local] (input_ids/position_ids are [1, T_local]) and aligned
    with target positions; optional ones are None when the rollout data lacks the key.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    padding_mask: torch.Tensor
    """bool [1, T_local], True where the input is padding (megatron's MoE routing mask): the router leaves these
    tokens out of the expert-bias token counts and the aux losses."""
    labels: torch.Tensor
    """Target token per position (token t+1), 0 where there is none."""
    cu_seqlens: torch.Tensor
    """int32 [num_seqs+1], cumulative FULL padded lengths (what CP attention expects)."""
    max_seqlen: int
    loss_mask: torch.Tensor
    sample_weight: torch.Tensor
    """1 / max(1, loss tokens of the token's whole sample): per-sample-mean weighting."""
    old_log_probs: torch.Tensor | None
    ref_log_probs: torch.Tensor | None
    advantages: torch.Tensor | None
    rollout_log_probs: torch.Tensor | None
    opd_reverse_kl: torch.Tensor | None
    """--use-opd: student - teacher log-prob per token (a metric; the penalty is in the advantages)."""
    old_values: torch.Tensor | None
    """The critic's values of the rollout (ppo): the centre of the value clip."""
    returns: torch.Tensor | None
    """The critic's targets (ppo: GAE advantages + values)."""
    sample_ids: tuple[int, ...]
    """Sample position per packed sequence (PADDING_SAMPLE_ID for the dummy sequence)."""
    total_lengths: tuple[int, ...]
    response_lengths: tuple[int, ...]
    padded_lengths: tuple[int, ...]
    cp_size: int
    is_padding: bool
    mtp_tokens: torch.Tensor | None = None
    """--enable-mtp-training with D layers: [D + 1, T_local], row j the token j + 1 places after the position's own
    (row 0 is `labels`), 0 past its padded sequence: MTP depth k embeds row k - 1 and predicts row k."""
    mtp_loss_mask: torch.Tensor | None = None
    """[D, T_local]: row k - 1 the loss mask of the position k places later in the sequence (0 past its end)."""
    position_rows: torch.Tensor | None = None
    """A model with a vision tower: [3, sum(padded_lengths)] multimodal RoPE positions of the WHOLE micro-batch (every
    CP rank's tokens: the rotary table the THD RoPE takes each local token's row from; slime/models/mrope.py)."""
    image_feature_index: torch.Tensor | None = None
    """A model with a vision tower: [T_local] the image-feature row each local image token takes, -1 elsewhere."""
    pixel_values: torch.Tensor | None = None
    """The micro-batch's images in packed order (the processor's pixel values), None without images."""
    image_grid_thw: torch.Tensor | None = None
    """[images, 3] their grids, None without images."""

    @property
    def local_lengths(self) -> tuple[int, ...]:
        return tuple(n // self.cp_size for n in self.padded_lengths)

    def vision(self) -> VisionBatch | None:
        """What the vision side of the model takes (None for a text model's batch)."""
        if self.position_rows is None:
            return None
        return VisionBatch(position_rows=self.position_rows, feature_index=self.image_feature_index,
                           pixel_values=self.pixel_values, image_grid_thw=self.image_grid_thw)


def pack_micro_batch(
    data: Mapping[str, Any],
    sample_ids: Sequence[int],
    *,
    cp_size: int,
    cp_rank: int,
    tp_size: int,
    sequence_parallel: bool,
    mtp_depths: int = 0,
    vision: VisionArch | None = None,
) -> PackedMicroBatch:
    """Pack ``sample_ids`` (empty: a padding micro-batch) and take CP rank's zig-zag slice.

    ``mtp_depths``: also the MTP layers' shifted tokens and loss masks, shifted on the whole sequence before the
    slice, so a CP rank has the tokens of positions another rank holds without exchanging them.
    ``vision`` (a model with a vision tower): also the multimodal RoPE positions of the whole micro-batch, each local
    image token's feature row, and the samples' pixel values and grids (a sample's images travel with it whole).
    """
    multiple = pad_multiple_for(cp_size, tp_size, sequence_parallel)
    seqs = [_aligned_sequence(data, i, multiple) for i in sample_ids] or [_dummy_sequence(data, multiple)]
    seqs = [s | _mtp_shifts(s, mtp_depths) for s in seqs] if mtp_depths else seqs
    images = _vision_fields(data, seqs, vision) if vision is not None else {}
    padded = tuple(s["padded_length"] for s in seqs)
    fields = {k: torch.cat([s[k] for s in seqs], dim=-1) for k in seqs[0] if isinstance(seqs[0][k], torch.Tensor)}
    if cp_size > 1:  # one gather per field, not a slice per sequence and field
        local = zigzag_index(padded, cp_size, cp_rank)
        fields = {k: v.index_select(-1, local) for k, v in fields.items()}
    cu = torch.tensor([0, *torch.tensor(padded).cumsum(0).tolist()], dtype=torch.int32)
    return PackedMicroBatch(
        input_ids=fields["input_ids"].unsqueeze(0),
        position_ids=fields["position_ids"].unsqueeze(0),
        padding_mask=fields["padding_mask"].unsqueeze(0),
        labels=fields["labels"],
        cu_seqlens=cu,
        max_seqlen=max(padded),
        loss_mask=fields["loss_mask"],
        sample_weight=fields["sample_weight"],
        **{name: fields.get(name) for name in PER_TOKEN_KEYS.values()},
        sample_ids=tuple(s["sample_id"] for s in seqs),
        total_lengths=tuple(s["total_length"] for s in seqs),
        response_lengths=tuple(s["response_length"] for s in seqs),
        padded_lengths=padded,
        cp_size=cp_size,
        is_padding=not sample_ids,
        mtp_tokens=fields.get("mtp_tokens"),
        mtp_loss_mask=fields.get("mtp_loss_mask"),
        image_feature_index=fields.get("image_feature_index"),
        **images,
    )


def _vision_fields(data: Mapping[str, Any], seqs: list[dict[str, Any]], vision: VisionArch) -> dict[str, Any]:
    """The micro-batch's position rows (whole, unsliced), pixel values and grids in packed order; each sequence gets
    its "image_feature_index" (sliced with the other per-token fields). Only prompt tokens are image tokens (a
    generated image token is text, as the engines fed it). ValueError naming a sample whose prompt's image tokens
    are not its images'."""
    inputs = data.get("multimodal_train_inputs") or [None] * len(data["tokens"])
    rows, pixels, grids, offset = [], [], [], 0
    for seq in seqs:
        sample = seq["sample_id"]
        item = inputs[sample] if sample != PADDING_SAMPLE_ID else None
        grid = torch.as_tensor(item["image_grid_thw"]).long() if item is not None else None
        prompt = seq["total_length"] - seq["response_length"]
        tokens = seq["input_ids"][:prompt]
        is_image = tokens == vision.image_token_id
        want = sum(image_token_counts(grid, vision.merge_size)) if grid is not None else 0
        if int(is_image.sum()) != want:
            raise ValueError(f"sample {sample}: its prompt holds {int(is_image.sum())} image tokens (id "
                             f"{vision.image_token_id}), its images {want}; the prompt and multimodal_train_inputs "
                             "must come from the same processing")
        try:
            rows.append(position_rows(tokens.tolist(), grid, vision.image_token_id, vision.merge_size,
                                      seq["padded_length"]))
        except ValueError as exc:
            raise ValueError(f"sample {sample}: {exc}") from None
        index = torch.full((seq["padded_length"],), -1, dtype=torch.long)
        index[:prompt][is_image] = torch.arange(offset, offset + want)
        seq["image_feature_index"] = index
        offset += want
        if want:
            pixels.append(torch.as_tensor(item["pixel_values"]))
            grids.append(grid)
    return dict(position_rows=torch.cat(rows, dim=1), pixel_values=torch.cat(pixels) if pixels else None,
                image_grid_thw=torch.cat(grids) if grids else None)


def _shifted(values: torch.Tensor, k: int) -> torch.Tensor:
    """values[t + k] of one padded sequence, 0 past its end."""
    return torch.cat([values[k:], values.new_zeros(min(k, values.numel()))])


def _mtp_shifts(seq: Mapping[str, Any], depths: int) -> dict[str, torch.Tensor]:
    """The MTP layers' inputs and targets of one whole padded sequence (pack_micro_batch slices them)."""
    return {"mtp_tokens": torch.stack([_shifted(seq["labels"], k) for k in range(depths + 1)]),
            "mtp_loss_mask": torch.stack([_shifted(seq["loss_mask"], k) for k in range(1, depths + 1)])}


def _aligned_sequence(data: Mapping[str, Any], i: int, multiple: int) -> dict[str, Any]:
    tokens = list(data["tokens"][i])
    total, response = len(tokens), int(data["response_lengths"][i])
    prompt = total - response
    if prompt < 1 or response < 0:
        raise ValueError(f"sample {i}: response_length {response} needs a prompt of >= 1 token (total {total})")
    padded = round_up(total, multiple)
    # target position t predicts token t+1; response token j sits at prompt+j, so its
    # values go to position prompt+j-1.
    first = prompt - 1

    def aligned(values: Sequence[float], dtype: torch.dtype) -> torch.Tensor:
        out = torch.zeros(padded, dtype=dtype)
        out[first: first + response] = torch.as_tensor(list(values), dtype=dtype)
        return out

    mask = aligned(data["loss_masks"][i], torch.float32)
    seq = {
        "input_ids": torch.tensor(tokens + [PAD_TOKEN_ID] * (padded - total), dtype=torch.long),
        "position_ids": torch.arange(padded, dtype=torch.long),
        "padding_mask": torch.arange(padded) >= total,
        "labels": torch.tensor(tokens[1:] + [PAD_TOKEN_ID] * (padded - total + 1), dtype=torch.long),
        "loss_mask": mask,
        "sample_weight": torch.full((padded,), 1.0 / max(1.0, float(mask.sum()))),
        "sample_id": i,
        "total_length": total,
        "response_length": response,
        "padded_length": padded,
    }
    for key, name in PER_TOKEN_KEYS.items():
        if data.get(key) is not None:
            seq[name] = aligned(data[key][i], torch.float32)
    return seq


def _dummy_sequence(data: Mapping[str, Any], multiple: int) -> dict[str, Any]:
    """A padding micro-batch's one sequence: pad tokens, zero loss weight everywhere."""
    zeros = torch.zeros(multiple)
    per_token = {name: zeros for key, name in PER_TOKEN_KEYS.items() if data.get(key) is not None}
    return per_token | {
        "input_ids": torch.full((multiple,), PAD_TOKEN_ID, dtype=torch.long),
        "position_ids": torch.arange(multiple, dtype=torch.long),
        "padding_mask": torch.ones(multiple, dtype=torch.bool),
        "labels": torch.full((multiple,), PAD_TOKEN_ID, dtype=torch.long),
        "loss_mask": zeros,
        "sample_weight": zeros,
        "sample_id": PADDING_SAMPLE_ID,
        "total_length": 0,
        "response_length": 0,
        "padded_length": multiple,
    }


def unpack_response_values(gathered: torch.Tensor, packed: PackedMicroBatch) -> dict[int, list[float]]:
    """Per-sample response values from per-position values of all CP ranks.

    ``gathered`` is [cp, T_local] (row r = CP rank r's aligned values, e.g. log-probs of
    the target tokens); returns {sample position: values of its response tokens}.
    """
    out: dict[int, list[float]] = {}
    offset = 0
    for sid, local, total, response in zip(packed.sample_ids, packed.local_lengths,
                                           packed.total_lengths, packed.response_lengths):
        full = zigzag_gather([gathered[r, offset: offset + local] for r in range(packed.cp_size)])
        offset += local
        if sid != PADDING_SAMPLE_ID:
            first = total - response - 1
            out[sid] = full[first: first + response].tolist()
    return out

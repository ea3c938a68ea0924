"""Bad checkpoints end in errors that say what to fix; a failed save leaves nothing --load would read.

One rank builds the tiny Qwen3 on megatron (gloo) once and meets every case: an HF checkpoint with a
tensor missing, one with a mis-shaped tensor, a save that fails half-way (a new iteration and a
re-save of an existing one), and a tracker file that holds garbage.
"""
from __future__ import annotations

import os
import shutil

import pytest

from mp_utils import run_ranks
from tiny_models import save_tiny_qwen3
from slime.config import defaults_namespace

pytestmark = pytest.mark.ranks

DROPPED = "model.layers.1.mlp.down_proj.weight"
RESHAPED = "model.layers.0.self_attn.k_proj.weight"


def _rewrite(src: str, dst: str, edit) -> str:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    edit(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def outcome(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("bad_checkpoints")
    good = save_tiny_qwen3(str(root / "good"))
    missing = _rewrite(good, str(root / "missing"), lambda t: t.pop(DROPPED))
    misshaped = _rewrite(good, str(root / "misshaped"), lambda t: t.update({RESHAPED: t[RESHAPED][:-4]}))
    (result,) = run_ranks(_child, 1, args=(good, missing, misshaped, str(root / "ckpt")), timeout_s=200)
    return result


def _child(rank, world, good, missing, misshaped, ckpt):
    import torch
    import transformers
    from megatron.core import dist_checkpointing

    from slime.backends.megatron_utils import checkpoint
    from slime.backends.megatron_utils.model import build_model_and_optimizer
    from slime.backends.megatron_utils.parallel import init_model_parallel
    from slime_plugins.models.hf_weights import HFCheckpointError, load_hf_weights

    args = defaults_namespace(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, context_parallel_size=1,
                              sequence_parallel=False, seed=1234, lr=1e-3, clip_grad=1.0, weight_decay=0.0,
                              fence_timeout=120)
    init_model_parallel(args)
    hf_config = transformers.AutoConfig.from_pretrained(good)
    model, _, _ = build_model_and_optimizer(args, hf_config)
    out = {}
    for key, path in (("missing", missing), ("misshaped", misshaped)):
        try:
            load_hf_weights(model, path, hf_config)
            out[key] = None
        except HFCheckpointError as exc:
            out[key] = str(exc)
    load_hf_weights(model, good, hf_config)
    saved = {n: p.detach().clone() for n, p in model[0].named_parameters()}
    checkpoint.save_checkpoint(ckpt, 0, model)  # the model only: no optimizer step has made state yet

    def fails_half_way(state, path, *rest, **kwargs):
        with open(os.path.join(path, "__0_0.distcp"), "wb") as f:
            f.write(b"half a shard")
        raise OSError(28, "No space left on device")

    real_save, dist_checkpointing.save = dist_checkpointing.save, fails_half_way
    out["save_errors"] = []
    for iteration in (1, 0):  # a new iteration, then over the one the tracker names
        try:
            checkpoint.save_checkpoint(ckpt, iteration, model)
        except OSError as exc:
            out["save_errors"].append(str(exc))
    dist_checkpointing.save = real_save
    out["entries"] = sorted(os.listdir(ckpt))
    out["latest"] = checkpoint.latest_iteration(ckpt)
    with torch.no_grad():
        for p in model[0].parameters():
            p.add_(1.0)
    out["loaded"] = checkpoint.load_checkpoint(ckpt, model)
    out["restored"] = all(torch.equal(saved[n], p) for n, p in model[0].named_parameters())
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("")  # what a crash while writing the tracker used to leave
    try:
        checkpoint.latest_iteration(ckpt)
    except ValueError as exc:
        out["tracker"] = str(exc)
    return out


@pytest.mark.timeout(240)
def test_missing_tensor_is_named_with_what_to_fix(outcome):
    message = outcome["missing"]
    assert message is not None and "1 missing" in message and DROPPED in message, message
    assert "does not match its config.json" in message and "point --hf-checkpoint at" in message


@pytest.mark.timeout(240)
def test_misshaped_tensor_is_named_with_both_shapes(outcome):
    message = outcome["misshaped"]
    assert message is not None and f"{RESHAPED}: file (28, 64), config expects (32, 64)" in message, message


@pytest.mark.timeout(240)
def test_a_failed_save_leaves_the_previous_checkpoint_for_load(outcome):
    assert len(outcome["save_errors"]) == 2 and "No space left" in outcome["save_errors"][0]
    assert "iter_0000001" not in outcome["entries"], outcome["entries"]  # only its .partial, never read
    assert outcome["latest"] == 0 and outcome["loaded"] == 0 and outcome["restored"]


@pytest.mark.timeout(240)
def test_an_unreadable_tracker_says_which_file(outcome):
    assert "latest_checkpointed_iteration.txt holds ''" in outcome["tracker"], outcome["tracker"]

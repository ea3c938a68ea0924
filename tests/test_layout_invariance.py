"""8-rank layouts give the single process's log-probs, loss and grad norm (fp32, 1e-5).

Each layout runs the real megatron step (dynamic batches, zig-zag CP, SP) on the tiny
Qwen3 with the same HF weights; both loss normalisations are checked, and the two layouts
build megatron in its two gradient-averaging modes (config.calculate_per_token_loss).
"""

import pytest

from mp_utils import run_ranks
from test_train_step import assert_matches_reference, reference_run, rollout, tiny_hf_dir  # noqa: F401 (fixtures)
from train_step_harness import layout_child

pytestmark = pytest.mark.ranks

LAYOUTS = {
    "tp2_sp_cp4": dict(tensor_model_parallel_size=2, sequence_parallel=True, context_parallel_size=4,
                       calculate_per_token_loss=True),
    "tp2_dp2_cp2": dict(tensor_model_parallel_size=2, sequence_parallel=True, context_parallel_size=2,
                        calculate_per_token_loss=False),
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_layout_matches_single_process(name, tiny_hf_dir, rollout):
    layout = LAYOUTS[name]
    reference = reference_run(tiny_hf_dir, rollout, layout["calculate_per_token_loss"])
    results = run_ranks(layout_child, 8, args=(layout, tiny_hf_dir, rollout, ("per_token", "per_sample")),
                        timeout_s=200)
    assert_matches_reference(results, reference, rollout)


@pytest.mark.timeout(240)
def test_pipeline_parallel_pp2_tp2_matches_single_process(tiny_hf_dir, rollout):
    """PP=2 smoke: megatron's 1F1B schedule over the same planned micro-batches, PP broadcast of log-probs."""
    layout = dict(pipeline_model_parallel_size=2, tensor_model_parallel_size=2, calculate_per_token_loss=True)
    reference = reference_run(tiny_hf_dir, rollout, True)
    results = run_ranks(layout_child, 4, args=(layout, tiny_hf_dir, rollout, ("per_token", "per_sample")),
                        timeout_s=200)
    assert_matches_reference(results, reference, rollout)

"""Names the flags and the checks share: default hook paths, the choices of enumerated flags, what the model
builder always builds, the required flags and the hook-path flags. (The model families are slime/models' registry.)
"""

from __future__ import annotations

from slime.algorithms import estimator_names

DEFAULT_ROLLOUT_FUNCTION_PATH = "slime.rollout.sglang_rollout.generate_rollout"
DEFAULT_DATA_SOURCE_PATH = "slime.rollout.data_source.RolloutDataSourceWithBuffer"
ADVANTAGE_ESTIMATORS = estimator_names()  # the estimator registry's names (slime/algorithms/registry.py)
KL_LOSS_TYPES = ("k1", "k2", "k3", "low_var_kl")
ATTENTION_BACKENDS = ("auto", "local", "flash", "fused", "unfused")
LOSS_TYPES = ("policy_loss", "sft_loss", "custom_loss")


# Flags a run cannot do without, marked [required] in --help: --rollout-batch-size is checked by parse_args,
# --hf-checkpoint by check_launch_inputs before Ray starts (so that the parser's own tests work without it); a
# missing one is named together with every other missing flag.
REQUIRED_FLAGS: tuple[str, ...] = ("--hf-checkpoint", "--rollout-batch-size")


# Hook-path flags checked for an importable module when the user sets them.
FUNCTION_PATH_FLAGS: tuple[str, ...] = (
    "--rollout-function-path",
    "--custom-generate-function-path",
    "--eval-function-path",
    "--dynamic-sampling-filter-path",
    "--buffer-filter-path",
    "--data-source-path",
    "--rollout-sample-filter-path",
    "--rollout-all-samples-process-path",
    "--custom-rollout-log-function-path",
    "--custom-eval-rollout-log-function-path",
    "--rollout-data-postprocess-path",
    "--custom-rm-path",
    "--custom-reward-post-process-path",
    "--custom-convert-samples-to-train-data-path",
    "--custom-loss-function-path",
    "--custom-advantage-function-path",
    "--custom-tis-function-path",
    "--custom-pg-loss-reducer-function-path",
    "--custom-model-provider-path",
    "--custom-megatron-init-path",
    "--custom-megatron-before-log-prob-hook-path",
    "--custom-megatron-before-train-step-hook-path",
)


# What the model builder always builds (model.py: every supported family's HF config has RMSNorm and RoPE).
BUILT_NORMALIZATION, BUILT_POSITION_EMBEDDING = "RMSNorm", "rope"

# --update-weight-delta-encoding (upstream's names): how a changed position travels (sglang_utils/weight_delta.py).
DELTA_ENCODINGS = ("xor", "overwrite")
DELTA_LOAD_FORMAT = "slime_delta"  # the load_format of a delta push (the HTTP client sends it without torch)

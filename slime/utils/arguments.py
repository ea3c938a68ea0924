"""The flags of ``train.py``, as upstream slime and its plug-ins import them: ``from slime.utils.arguments
import parse_args`` and the other names below keep working. The parser, its registries, checks and help live in
``slime.config`` (one module per concern); this module only re-exports them.

``python -m slime.utils.arguments --help`` shows the flags without train.py.
"""

from __future__ import annotations

from slime.config.checks.paths import UNSUPPORTED_SPEC_MODULES, import_failure
from slime.config.constants import (
    ADVANTAGE_ESTIMATORS,
    ATTENTION_BACKENDS,
    BUILT_NORMALIZATION,
    BUILT_POSITION_EMBEDDING,
    DEFAULT_DATA_SOURCE_PATH,
    DEFAULT_ROLLOUT_FUNCTION_PATH,
    FUNCTION_PATH_FLAGS,
    KL_LOSS_TYPES,
    LOSS_TYPES,
    REQUIRED_FLAGS,
)
from slime.config.custom_config import apply_custom_config
from slime.config.errors import ArgumentValidationError, MissingPathError, NotImplementedFlagWarning
from slime.config.flags import ARGUMENT_GROUPS
from slime.config.flags.upstream_compat import UPSTREAM_COMPAT_FLAGS as _UPSTREAM_COMPAT_FLAGS
from slime.config.help import (
    DefaultsHelpFormatter,
    HELP_EPILOG,
    closest_flags,
    registry_mark,
    unknown_flags_message,
    unknown_flags_report,
)
from slime.config.launch import (
    HF_CONFIG_FILE,
    HF_TOKENIZER_FILES,
    SUPPORTED_MODEL_TYPES,
    check_launch_inputs,
    launch_missing_flags,
)
from slime.config.parse import parse_args
from slime.config.parser import SlimeArgumentParser, build_parser
from slime.config.registries import (
    ALWAYS_HONOURED_FLAGS,
    NOT_IMPLEMENTED_FLAGS,
    NotImplementedFlag,
    REFUSED_FLAGS,
    active_not_implemented_flags,
    refusal_messages,
    refuse_unsupported,
    resolve_train_device,
    warn_not_implemented,
)
from slime.config.validate import validate_args
from slime.rollout.eval_config import EvalDatasetSpec

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "ALWAYS_HONOURED_FLAGS",
    "ARGUMENT_GROUPS",
    "ATTENTION_BACKENDS",
    "ArgumentValidationError",
    "BUILT_NORMALIZATION",
    "BUILT_POSITION_EMBEDDING",
    "DEFAULT_DATA_SOURCE_PATH",
    "DEFAULT_ROLLOUT_FUNCTION_PATH",
    "DefaultsHelpFormatter",
    "EvalDatasetSpec",
    "FUNCTION_PATH_FLAGS",
    "HELP_EPILOG",
    "HF_CONFIG_FILE",
    "HF_TOKENIZER_FILES",
    "KL_LOSS_TYPES",
    "LOSS_TYPES",
    "MissingPathError",
    "NOT_IMPLEMENTED_FLAGS",
    "NotImplementedFlag",
    "NotImplementedFlagWarning",
    "REFUSED_FLAGS",
    "REQUIRED_FLAGS",
    "SUPPORTED_MODEL_TYPES",
    "SlimeArgumentParser",
    "UNSUPPORTED_SPEC_MODULES",
    "_UPSTREAM_COMPAT_FLAGS",
    "active_not_implemented_flags",
    "apply_custom_config",
    "build_parser",
    "check_launch_inputs",
    "closest_flags",
    "import_failure",
    "launch_missing_flags",
    "parse_args",
    "refusal_messages",
    "refuse_unsupported",
    "registry_mark",
    "resolve_train_device",
    "unknown_flags_message",
    "unknown_flags_report",
    "validate_args",
    "warn_not_implemented",
]

if __name__ == "__main__":  # `python -m slime.utils.arguments --help` shows the flags without train.py
    print(parse_args())

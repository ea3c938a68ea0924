"""Upstream's import path of slime.models.qwen3_5 (`--spec slime_plugins.models.qwen3_5 get_qwen3_5_spec` names it):
this name is that module itself, so attributes set here are set there."""

import sys

from slime.models import qwen3_5

sys.modules[__name__] = qwen3_5

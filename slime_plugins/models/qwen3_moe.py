"""Upstream's import path of slime.models.qwen3_moe (plug-ins and `--spec slime_plugins.models.qwen3_moe ...` name it):
this name is that module itself, so attributes set here are set there."""

import sys

from slime.models import qwen3_moe

sys.modules[__name__] = qwen3_moe

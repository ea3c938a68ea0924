"""Upstream's import path of slime.models.deepseek_v3 (plug-ins and `--spec slime_plugins.models.deepseek_v3 ...` name it):
this name is that module itself, so attributes set here are set there."""

import sys

from slime.models import deepseek_v3

sys.modules[__name__] = deepseek_v3

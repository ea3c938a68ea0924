"""Upstream's import path of slime.models.cp_attention (plug-ins and `--spec slime_plugins.models.cp_attention ...` name it):
this name is that module itself, so attributes set here are set there."""

import sys

from slime.models import cp_attention

sys.modules[__name__] = cp_attention

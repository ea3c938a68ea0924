"""Upstream's import path of slime.models.fused_kernels (plug-ins and `--spec slime_plugins.models.fused_kernels ...` name it):
this name is that module itself, so attributes set here are set there."""

import sys

from slime.models import fused_kernels

sys.modules[__name__] = fused_kernels

"""Upstream's import path of slime.models.moe_arch (plug-ins and `--spec slime_plugins.models.moe_arch ...` name it):
this name is that module itself, so attributes set here are set there."""

import sys

from slime.models import moe_arch

sys.modules[__name__] = moe_arch

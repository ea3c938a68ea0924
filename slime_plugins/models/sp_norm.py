"""Upstream's import path of slime.models.sp_norm (plug-ins and `--spec slime_plugins.models.sp_norm ...` name it):
this name is that module itself, so attributes set here are set there."""

import sys

from slime.models import sp_norm

sys.modules[__name__] = sp_norm

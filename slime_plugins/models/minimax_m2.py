"""Upstream's import path of slime.models.minimax_m2 (`--spec slime_plugins.models.minimax_m2 get_minimax_m2_spec`
names it): this name is that module itself, so attributes set here are set there."""

import sys

from slime.models import minimax_m2

sys.modules[__name__] = minimax_m2

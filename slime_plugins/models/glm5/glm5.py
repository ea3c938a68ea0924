"""Upstream's import path of slime.models.glm_moe_dsa (`--spec slime_plugins.models.glm5.glm5 get_glm5_spec`
names it): this name is that module itself, so attributes set here are set there."""

import sys

from slime.models import glm_moe_dsa

sys.modules[__name__] = glm_moe_dsa

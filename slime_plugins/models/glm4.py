"""Upstream's import path of slime.models.glm4 (plug-ins and `--spec slime_plugins.models.glm4 ...` name it):
this name is that module itself, so attributes set here are set there."""

import sys

from slime.models import glm4

sys.modules[__name__] = glm4

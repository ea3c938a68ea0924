"""Upstream's import path of slime.models.hf_weights (plug-ins and `--spec slime_plugins.models.hf_weights ...` name it):
this name is that module itself, so attributes set here are set there."""

import sys

from slime.models import hf_weights

sys.modules[__name__] = hf_weights

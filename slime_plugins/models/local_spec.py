"""Upstream's import path of slime.models.local_spec (plug-ins and `--spec slime_plugins.models.local_spec ...` name it):
this name is that module itself, so attributes set here are set there."""

import sys

from slime.models import local_spec

sys.modules[__name__] = local_spec

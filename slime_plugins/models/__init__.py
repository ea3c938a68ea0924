"""Upstream's plug-in path for model code. The code lives in slime.models; each module here is an alias of
the slime.models module of the same name, kept so `--spec slime_plugins.models.MODULE FUNCTION` and existing
imports resolve."""

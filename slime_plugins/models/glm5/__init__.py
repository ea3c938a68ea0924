"""Upstream's package of GLM-5's plug-in (`--spec slime_plugins.models.glm5.glm5 get_glm5_spec`); the code is
slime.models.glm_moe_dsa, aliased by the `glm5` module here."""

"""The models room: one module per HF model family, found through one registry keyed by config.json's
`model_type`, and the pieces the families share (CP attention, SP norm, fused kernels, the local layer spec,
the HF <-> megatron weight mapping). The megatron backend asks this package; slime_plugins/models keeps
upstream's import paths as aliases of these modules."""

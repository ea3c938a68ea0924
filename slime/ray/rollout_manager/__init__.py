"""The rollout manager's process: one Ray actor that owns the engines, the router, the data source and
the rollout function, and runs every rollout and eval under its deadline."""

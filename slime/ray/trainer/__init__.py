"""The trainer ranks' process: one Ray actor per rank, in front of the fenced megatron actor."""

"""The rollout engines: each engine's Ray actor (its own process), and the fleet the rollout manager
keeps of them (health, recovery, test-only faults)."""

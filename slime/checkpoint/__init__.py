"""What a checkpoint holds (contents.py), how it reaches the disk durably (durable.py), and the
random-number state of a process (rng.py). The megatron save and load (slime/backends/megatron_utils/
checkpoint.py) and the data source (slime/rollout/data_source.py) both read the same list."""

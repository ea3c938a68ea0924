"""What every process of the Ray side shares: the node a process runs on (its address, where its servers listen,
its GPUs as CUDA devices) and the slot an engine runs in. The trainer ranks, the engines and the rollout manager
import this room, never the driver's."""

"""The weight sync, trainer -> rollout engines (phase 6 of docs/fenced-step.md), one module per part:

  sync.py         the fenced sync every rank runs: who exports and sends, pause, push, proof, resume
  plan.py         the bucket plan of a PP stage (pure, fingerprinted) and the default weight source
  transport.py    how buckets travel: by tensor to colocated engines, over a weight-update group to separate
                  ones, and per node when colocated engines span nodes
  delta.py        `--update-weight-mode delta`: only what changed, over the distributed transport
  factory.py      which transport a run uses, built once (the only module that knows every kind)
  node_routes.py  colocated across nodes: which rank feeds which engines, per PP stage
  proof.py        after every push, every engine serves exactly the trainer's weights

The trainer's actor (backends/megatron_utils) builds a WeightSync; nothing here imports the trainer.
"""

"""Flags of Ray placement: training nodes and GPUs, engine GPUs, colocation and offload."""

from __future__ import annotations

import argparse
import json


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("cluster", "Ray placement of the training actors and rollout engines")
    g.add_argument("--actor-num-nodes", type=int, default=1, help="nodes that run training ranks")
    g.add_argument("--actor-num-gpus-per-node", type=int, default=8,
                   help="training ranks per node (one GPU each; CPU processes on the embedded default)")
    g.add_argument("--rollout-num-gpus", type=int, default=None,
                   help="GPUs for the rollout engines (with --colocate: the training ranks' GPUs)")
    g.add_argument("--rollout-num-gpus-per-engine", type=int, default=1,
                   help="GPUs per rollout engine (the engine's SGLang tensor-parallel size)")
    g.add_argument("--num-gpus-per-node", type=int, default=8, help="GPUs per node that rollout engines may use")
    g.add_argument("--engine-bind-host", type=str, default=None,
                   help="address engines listen on (this project; default: their node's address, as upstream; "
                        "0.0.0.0 listens on every interface, URLs keep the node's address)")
    g.add_argument("--colocate", action="store_true", default=False,
                   help="train and generate on the same GPUs, handing memory over between the two")
    g.add_argument("--offload", action="store_true", default=False, help="shorthand for --offload-train --offload-rollout")
    g.add_argument("--offload-train", action=argparse.BooleanOptionalAction, default=None,
                   help="release training memory while generating (on by default with --colocate)")
    g.add_argument("--offload-rollout", action=argparse.BooleanOptionalAction, default=None,
                   help="release engine memory while training (on by default with --colocate)")
    g.add_argument("--distributed-backend", type=str, default="nccl", choices=["nccl", "gloo"],
                   help="torch.distributed backend of the trainer on GPUs (CPU ranks always use gloo)")
    g.add_argument("--distributed-timeout-minutes", type=int, default=None,
                   help="timeout of process-group collectives (default: just above the watchdog's longest window, "
                        "2 x --fence-timeout + 40 s rounded up to a minute, 7 with --fence-timeout 180, so that the watchdog names "
                        "the phase and the ranks before NCCL or gloo aborts; a smaller value is refused)")
    g.add_argument("--train-env-vars", type=json.loads, default="{}",
                   help='JSON object of environment variables set in every training rank, e.g. \'{"NCCL_DEBUG": "WARN"}\'')

"""This project's own flags: the hang-proof step (fences, ledgers, devices) and the run's API key."""

from __future__ import annotations

import argparse

from slime.utils.deadlines import DEFAULT_NO_PROGRESS_S


def add_fencing_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("fencing (this project)", "hang-proof training step")
    g.add_argument("--fence-timeout", type=float, default=DEFAULT_NO_PROGRESS_S,
                   help="seconds a rank may go without progress (no collective, micro-batch, weight bucket or "
                        "checkpoint bytes completing, on it or on any peer) before the step fails naming the phase "
                        "and the ranks; phases may run longer while they progress. Default 180: the longest healthy "
                        "gap measured is the first step's kernel compile (25-69 s on one H200), so a stalled step "
                        "ends within 3 minutes on the ranks and 5 at the driver (1.5 windows + 30 s); start-up "
                        "(first communicator set-up, model build, weight loading) gets 2 windows + 10 s, 370 s, enough "
                        "to load a node's share of a resumed Qwen3-30B-A3B (~430 GB) at 2 GB/s. Raise it for slower "
                        "storage or longer compiles")
    g.add_argument("--max-restarts", type=int, default=0,
                   help="restarts of the trainer ranks and engines from the last complete checkpoint after a named "
                        "failure (a hang, a rank or engine lost, a stalled weight sync); the engines keep serving "
                        "when the trainer alone failed; needs --save and --save-interval. 0: a named failure ends "
                        "the run")
    g.add_argument("--restart-window-rollouts", type=int, default=None,
                   help="a restart may lose at most this many rollouts of work (the failed rollout excluded); a "
                        "failure with no complete checkpoint that recent ends the run (default: any checkpoint)")
    g.add_argument("--restart-engines-on-heal", action="store_true", default=False,
                   help="a restart after a failure of the trainer ranks alone restarts the engines too (default: "
                        "they keep serving and get the checkpoint's weights from the restarted trainer)")
    g.add_argument("--recreate-process-groups-on-wake", action="store_true", default=False,
                   help="destroy and re-create communicators across colocate sleep (default: keep them alive)")
    g.add_argument("--single-rank-group-max-ctas", type=int, default=1,
                   help="NCCL channels of a communicator whose group holds one rank (it moves no bytes; NCCL's "
                        "usual channels cost ~0.4 GiB each outside the allocator, kept while asleep); 0: as many as "
                        "NCCL picks")
    g.add_argument("--train-backend-device", type=str, default="auto", choices=["auto", "cpu", "cuda"],
                   help="device of the training ranks (auto: cuda when available)")
    g.add_argument("--metrics-jsonl", type=str, default=None, help="append one JSON line of metrics per event here")
    g.add_argument("--verbose", action="store_true", default=False,
                   help="print every metrics event on stdout as `[kind k] key=value ...`, the placement of every "
                        "bundle and every rank's Python warnings (default: one line per rollout; every event "
                        "still goes to --metrics-jsonl, wandb and TensorBoard)")
    g.add_argument("--ledger-dir", type=str, default=None,
                   help="directory for per-rank collective ledgers and stall reports (default: a temp dir, removed "
                        "after a run that ends cleanly and kept, with its path printed, after a failure)")
    g.add_argument("--custom-config-path", type=str, default=None,
                   help="YAML mapping of flag overrides (flag or attribute names; unknown keys become attributes "
                        "for plug-ins); applied over the command line")
    g.add_argument("--no-weight-sync-proof", action="store_false", dest="weight_sync_proof",
                   help="skip the weight-sync proof (after every push every engine digests every tensor it serves "
                        "and the trainer compares them with its own: a digest pass over the weights on each side "
                        "per push, and on a LoRA push over the tensors it leaves out; docs/fenced-step.md); the "
                        "push still goes out in the engines' dtypes")
    g.add_argument("--ledger-record-sequence", action="store_true", default=False,
                   help="also write every rank's whole sequence of fences and collectives to "
                        "<ledger-dir>/sequence_rank<N>.jsonl (check: python -m slime.distributed.order_proof DIR)")


def add_security_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("security", "who may call the run's engines and router (slime/utils/security.py)")
    g.add_argument("--api-key", type=str, default=None,
                   help="the run's API key, required as 'Authorization: Bearer <key>' on every route of every engine "
                        "and router the run starts (SGLang's --api-key is set to it); default: $SLIME_API_KEY, else "
                        "a random key made at start. Never logged")

"""One trainer rank as a Ray actor: rendezvous, then delegate to the fenced megatron actor."""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
import traceback
import warnings

import ray

from slime.ray.common.node import node_address, serving_host, visible_device_index
from slime.config.run_state import RunState
from slime.utils.deadlines import run_deadlines
from slime.utils.security import use_key

# megatron-core announces at import that TE/Apex are absent (expected on the embedded path),
# once per module per rank; the choice of leaves is logged once by the model provider instead.
warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*not installed")
warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor. is deprecated")


def quiet_library_warnings() -> None:
    """Ranks other than 0 drop the libraries' Python warnings and log records below ERROR, which Ray would
    otherwise echo to the driver once per rank (rank 0 still shows each one; --verbose: every rank does).
    Errors are untouched: a failing rank's traceback travels with its RankError, its logged errors as before."""
    warnings.filterwarnings("ignore", module=r"(megatron|torch|transformers|transformer_engine)(\.|$)")
    for name in ("megatron", "torch", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)


class RankError(RuntimeError):
    """A rank's failure as plain values, so that Ray can always carry it to the driver (exceptions
    with keyword-only fields, or raised by the watchdog into a thread, do not survive Ray's
    deserialisation): "Type: message", the rank's whole traceback, whether it is a stall (the
    driver then shows where every rank is), and the peers a fence timeout found lagging (the ranks to blame)."""

    def __init__(self, message: str, traceback_text: str = "", stalled: bool = False, lagging: tuple = ()):
        super().__init__(message, traceback_text, stalled, lagging)
        self.message = message
        self.traceback_text = traceback_text
        self.stalled = stalled
        self.lagging = tuple(lagging)

    def __str__(self) -> str:
        return self.message


def _is_stall(exc: BaseException) -> bool:
    """A liveness failure (deadline, hang), as opposed to ranks that agree they differ or bad input."""
    from slime.distributed.errors import CollectiveDivergenceError, DistributedStepError

    return isinstance(exc, TimeoutError) or (isinstance(exc, DistributedStepError)
                                             and not isinstance(exc, CollectiveDivergenceError))


def _portable_errors(method):
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except Exception as exc:
            raise RankError(f"{type(exc).__name__}: {exc}", traceback.format_exc(), _is_stall(exc),
                            tuple(getattr(exc, "lagging_ranks", ()) or ())) from None

    return call


def remove_stale_buckets() -> None:
    """Shared-memory buckets of the run's senders that died mid-push (a restart's ranks start when none pushes)."""
    from slime.backends.sglang_utils.shared_payload import remove_buckets
    from slime.utils.security import current_key

    key = current_key()
    if key is not None and (removed := remove_buckets(key)):
        logging.getLogger(__name__).info("removed %d shared-memory bucket(s) a failed attempt left", removed)


class TrainRayActor:
    def __init__(self, args, run_state: RunState, rank: int, world_size: int, ledger_dir: str,
                 hub: tuple | None = None, role: str = "actor"):
        """`run_state`: the driver's when it started this rank (this rank adds its node's address)."""
        self.args = args
        self.role = role  # "actor", or "critic" (--advantage-estimator ppo: slime/backends/megatron_utils/critic.py)
        self.rank = rank
        self.world_size = world_size
        self.ledger_dir = ledger_dir
        self.hub = hub  # (actor handle, name) of the driver's progress hub
        self.actor = None
        self._store = None  # rank 0: the rendezvous store it hosts
        use_key(args.api_key)  # weight pushes reach the engines with the run's key
        # colocated across nodes, the push feeds the engines at this address
        self.run_state = dataclasses.replace(run_state, node_host=node_address())
        if rank != 0 and not args.verbose:
            quiet_library_warnings()
        # On GPU bundles the rank sees the whole node (placement.py says why) and trains on its
        # bundle's GPU; init_distributed makes LOCAL_RANK the current device.
        self.gpu_ids = [str(g) for g in ray.get_gpu_ids()]
        if self.gpu_ids:
            os.environ["LOCAL_RANK"] = str(visible_device_index(self.gpu_ids[0]))

    def where(self) -> dict:
        """Where this rank landed: node, Ray's GPU ids, the CUDA device it trains on."""
        return {"rank": self.rank, "node_id": ray.get_runtime_context().get_node_id(), "node_ip": node_address(),
                "gpu_ids": self.gpu_ids, "device": int(os.environ["LOCAL_RANK"]) if self.gpu_ids else None}

    def rendezvous_address(self) -> tuple[str, int]:
        """Rank 0 hosts torch.distributed's store (on loopback when the run is on one node) on a port the
        kernel picks as it binds, so no other process can take it first, and offers that address and port."""
        from slime.backends.megatron_utils.parallel import host_rendezvous

        host = serving_host(self.run_state.spans_nodes)
        self._store = host_rendezvous(self.args, self.world_size, host)
        return host, self._store.port

    @_portable_errors
    def init(self, master_addr: str, master_port: int, engine_urls: list[str]) -> int:
        if self.gpu_ids:  # before any import touches CUDA: a context on device 0 of every rank is lost memory
            import torch

            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        from slime.patches.megatron_core import import_megatron

        import_megatron()  # before any module of ours imports it: the lighter import (slime/patches/megatron_core.py)
        from slime.backends.megatron_utils.actor import MegatronTrainActor
        from slime.backends.megatron_utils.critic import CriticTrainActor

        os.environ.setdefault("OMP_NUM_THREADS", "1")
        os.environ.update({k: str(v) for k, v in self.args.train_env_vars.items()})  # --train-env-vars
        from slime.backends.megatron_utils.parallel import join_rendezvous

        # before any push of this attempt on this host
        if self.role == "actor" and self.run_state.restart_count:
            remove_stale_buckets()
        store = self._store if self.rank == 0 else join_rendezvous(self.args, master_addr, master_port, self.world_size)
        trainer = CriticTrainActor if self.role == "critic" else MegatronTrainActor
        self.actor = trainer(self.args, self.rank, self.world_size, self.ledger_dir, hub=self.hub,
                             run_state=self.run_state)
        return self.actor.init(master_addr, master_port, engine_urls, store=store)

    @_portable_errors
    def train(self, rollout_id: int, data_ref: list) -> dict:
        return self.actor.train(rollout_id, self._fetch(data_ref))

    @_portable_errors
    def values(self, rollout_id: int, data_ref: list) -> ray.ObjectRef | None:
        """The critic's values of the rollout's response tokens, which every critic rank holds: rank 0 puts them in
        Ray's object store and returns the reference alone (the others None), so the driver hands the reference on
        and each rank of both roles fetches the values itself (`_fetch`), as it fetches the rollout."""
        values = self.actor.values(rollout_id, self._fetch(data_ref))
        return ray.put({"values": values}) if self.rank == 0 else None

    def _fetch(self, data_refs: list) -> dict:
        """The rollout (the first ref), with the fields the later refs add (the critic's values)."""
        window_s = run_deadlines(self.args).no_progress_s
        data = ray.get(data_refs[0], timeout=window_s)
        for ref in data_refs[1:]:
            data.update(ray.get(ref, timeout=window_s))
        return data

    @_portable_errors
    def update_weights(self, rollout_id: int, engine_urls: list[str] | None = None, *, served: bool = False,
                       keep_served: bool | None = None) -> dict:
        return self.actor.update_weights(rollout_id, engine_urls, served=served, keep_served=keep_served)

    @_portable_errors
    def sleep(self) -> dict:
        return self.actor.sleep()

    @_portable_errors
    def save(self, rollout_id: int, publish: bool = True) -> None:
        self.actor.save(rollout_id, publish)

    @_portable_errors
    def publish(self, rollout_id: int) -> None:
        self.actor.publish(rollout_id)

    def close(self) -> None:
        if self.actor is not None:
            self.actor.close()

"""Launch one rollout engine: a real SGLang server (cluster) or the embedded CPU engine.

Both answer the same HTTP API, so everything after `launch_engine` is backend-agnostic.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from slime.backends.sglang_utils.http_client import SGLangHTTPClient
from slime.utils.server_process import (
    ServerHandle,
    python_module_command,
    start_bound_server,
    start_server_process,
)
from slime.backends.sglang_utils.server_args import has_option, render_server_flags
from slime.config.engine import ROLLOUT_BACKENDS, pick_rollout_backend  # noqa: F401 (pick_rollout_backend: re-exported)
from slime.utils.deadlines import ENGINE_STARTUP_S, run_deadlines
from slime.utils.ports import find_free_port, retry_port_clash
from slime.utils.security import current_key, request_limit
from slime.utils.sglang_passthrough import server_args_parser

logger = logging.getLogger(__name__)

BACKENDS = ROLLOUT_BACKENDS

# SGLang's environment for RL engines, as upstream slime sets it (a value the user exported wins):
# /health answers without generating (a paused or released engine stays "alive" for routers), the
# memory saver covers CUDA graphs, and idle/TP-imbalance memory checks do not trip over colocation.
SGLANG_ENV_DEFAULTS: dict[str, str] = {
    "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "false",
    "SGLANG_MEMORY_SAVER_CUDA_GRAPH": "true",
    "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "false",
    "SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK": "false",
    "SGLANG_JIT_DEEPGEMM_PRECOMPILE": "false",
    "SGLANG_JIT_DEEPGEMM_FAST_WARMUP": "true",
    "SGLANG_BATCH_INVARIANT_OPS_ENABLE_MM_FALLBACK_VARIANT": "true",
    "RAY_USE_UVLOOP": "0",
}
# The trainer's allocator settings must not leak into the engine (SGLang manages its own pools).
SGLANG_ENV_REMOVED = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def sglang_engine_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment an SGLang engine process starts with."""
    env = dict(os.environ if environ is None else environ)
    for name in SGLANG_ENV_REMOVED:
        env.pop(name, None)
    for name, value in SGLANG_ENV_DEFAULTS.items():
        env.setdefault(name, value)
    return env


@dataclass(frozen=True, kw_only=True)
class EngineNodes:
    """Where one process of an engine over several nodes stands (SGLang's multi-node launch)."""

    nnodes: int
    """Nodes the engine spans (--nnodes)."""
    node_rank: int
    """This process's node (--node-rank); node rank 0 serves the engine's HTTP API, the others /health only."""
    dist_init_addr: str
    """host:port on node rank 0 where the engine's processes meet (--dist-init-addr)."""


@dataclass
class EngineHandle(ServerHandle):
    engine_rank: int = 0

    def client(self) -> SGLangHTTPClient:
        return SGLangHTTPClient(self.url)


def gpu_id_layout(gpu_ids: Sequence[int]) -> tuple[int, int]:
    """(base_gpu_id, gpu_id_step) that make SGLang's TP ranks use exactly these device indices."""
    step = gpu_ids[1] - gpu_ids[0] if len(gpu_ids) > 1 else 1
    if step < 1 or list(gpu_ids) != [gpu_ids[0] + i * step for i in range(len(gpu_ids))]:
        raise ValueError(f"engine GPUs {list(gpu_ids)} are not evenly spaced: SGLang takes a base GPU id and a step")
    return gpu_ids[0], step


def sglang_server_args_for_engine(args: Any, engine_rank: int, gpu_ids: Sequence[int] | None = None, *,
                                  parser: argparse.ArgumentParser | None = None,
                                  nodes: EngineNodes | None = None) -> dict[str, Any]:
    """ServerArgs fields for one engine: slime-derived ones, then the user's --sglang-* passthrough.

    gpu_ids: the CUDA device indices of the engine's Ray bundles (see slime/ray/driver/placement.py);
    without them, engines are assumed to fill each node's GPUs in rank order. `parser` (SGLang's
    launch parser) lets fields that only some SGLang versions have be set where they exist. `nodes`: this
    process's place in an engine over several nodes (gpu_ids are then its node's GPUs; the engine's
    tensor-parallel size stays its whole GPU count, split evenly over the nodes by SGLang).
    """
    gpus_per_engine = int(args.rollout_num_gpus_per_engine)
    gpus_per_node = int(args.num_gpus_per_node)
    base, step = gpu_id_layout(gpu_ids) if gpu_ids else ((engine_rank * gpus_per_engine) % gpus_per_node, 1)
    derived: dict[str, Any] = {
        "tp_size": gpus_per_engine,
        "base_gpu_id": base,
        "trust_remote_code": True,
        "random_seed": int(args.seed) + engine_rank,
        "skip_server_warmup": True,
    }
    if step != 1:
        derived["gpu_id_step"] = step
    if nodes is not None and nodes.nnodes > 1:
        derived.update(nnodes=nodes.nnodes, node_rank=nodes.node_rank, dist_init_addr=nodes.dist_init_addr)
    memory_saver = bool(args.offload_rollout)
    if memory_saver:
        derived["enable_memory_saver"] = True
        if parser is not None and has_option(parser, "--cuda-graph-backend-prefill"):
            derived["cuda_graph_backend_prefill"] = "disabled"  # prefill graphs are not memory-saver aware
    if args.sglang_mem_fraction_static is not None:
        derived["mem_fraction_static"] = args.sglang_mem_fraction_static
    return {**derived, **args.sglang_server_args}  # the --sglang-* passthrough, resolved by parse_args


def build_sglang_command(args: Any, engine_rank: int, host: str, port: int, model_path: str,
                         gpu_ids: Sequence[int] | None = None, *,
                         parser: argparse.ArgumentParser | None = None, nodes: EngineNodes | None = None,
                         key_file: str | None = None) -> list[str]:
    """`python -m sglang.launch_server ...`, rendered against SGLang's own parser (the installed one by default).

    The run's key reaches SGLang in `key_file` (`--config`: a private YAML file of SGLang's own config format,
    see `private_key_config`), never in argv, where every local user reads it. Only where that cannot be (a
    SGLang without --config, or a --sglang-config of the user's) does it go in argv, with a warning."""
    parser = parser or server_args_parser()
    if parser is None:
        raise RuntimeError("sglang is not importable here, so its launch flags cannot be rendered; "
                           "install the [gpu] extra or use --rollout-backend embedded")
    server_args = sglang_server_args_for_engine(args, engine_rank, gpu_ids, parser=parser, nodes=nodes)
    key = current_key()
    config: list[str] = []
    if key is not None:
        if key_file is not None and has_option(parser, "--config") and "config" not in server_args:
            config = ["--config", key_file]
        else:
            logger.warning("SGLang engine %d gets the run's key on its command line (visible to local users): %s",
                           engine_rank, "--sglang-config is the user's" if "config" in server_args
                           else "this SGLang has no --config" if key_file is not None else "no key file was made")
            server_args["api_key"] = key.reveal()
    flags = ["--model-path", model_path, "--host", host, "--port", str(port), *config,
             *render_server_flags(server_args, parser)]
    return python_module_command("sglang.launch_server", flags)


@contextlib.contextmanager
def private_key_config() -> Iterator[str | None]:
    """A YAML file in SGLang's --config format holding only the `api-key` option, in a folder of its own
    (folder 0700, file 0600), both removed on exit (SGLang reads it as it starts). None without a key."""
    key = current_key()
    if key is None:
        yield None
        return
    folder = tempfile.mkdtemp(prefix="slime-sglang-key-")  # 0700
    path = os.path.join(folder, "key.yaml")
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "w") as handle:
            # the option as spelled on the command line: SGLang turns a key into "--<key>" as written
            handle.write(f"api-key: {json.dumps(key.reveal())}\n")  # a JSON string is a YAML string
        yield path
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def build_embedded_command(args: Any, engine_rank: int, host: str, port: int, model_path: str,
                           gpu_ids: Sequence[int] | None = None, *, listen_fd: int | None = None,
                           num_threads: int | None = None) -> list[str]:
    """The embedded engine's command; `listen_fd`: a listening socket it inherits (then `port` is that
    socket's); `num_threads`: its torch threads (default: torch's). Its key comes from the environment
    ($SLIME_API_KEY), never from argv."""
    flags = ["--model-path", model_path, "--host", host, "--port", str(port)]
    flags += ["--listen-fd", str(listen_fd)] if listen_fd is not None else []
    flags += ["--max-request-bytes", str(request_limit(args.update_weight_buffer_size))]
    flags += ["--seed", str(int(args.seed) + engine_rank)]
    flags += ["--dtype", "bfloat16" if args.bf16 else "float32"]  # the trainer's precision
    on_gpus = bool(gpu_ids) if gpu_ids is not None else _on_gpus(args)
    if on_gpus:  # the embedded engine on CUDA: its GPU
        gpu = sglang_server_args_for_engine(args, engine_rank, gpu_ids)["base_gpu_id"]
        flags += ["--device", f"cuda:{gpu}"]
    if num_threads:
        flags += ["--num-threads", str(num_threads)]
    flags += ["--weight-update-timeout", str(run_deadlines(args).no_progress_s)]  # the trainer's rank window
    return python_module_command("slime.backends.embedded_engine.server", flags)


def _on_gpus(args: Any) -> bool:
    import torch

    return args.train_backend_device != "cpu" and torch.cuda.is_available()


def launch_engine(
    kind: str,
    args: Any,
    engine_rank: int,
    port: int,
    model_path: str,
    *,
    host: str = "127.0.0.1",
    gpu_ids: Sequence[int] | None = None,
    startup_timeout_s: float | None = None,
    log_dir: str | None = None,
    num_threads: int | None = None,
    nodes: EngineNodes | None = None,
) -> EngineHandle:
    """Start an engine process and return once its /health answers (or raise with its log tail).

    Callable from any process: host and port come from the caller (port 0: a free one, which no other
    process can take first); gpu_ids are the CUDA device indices (in this process's view, which the engine
    inherits) it must run on: SGLang's --base-gpu-id/--gpu-id-step, the embedded engine's --device (empty: the
    caller's bundles have no GPU, the engine runs on CPU; None: on CUDA when torch sees a GPU);
    num_threads: the embedded engine's torch threads (a benchmark's knob; default: torch's);
    nodes: this process's node of an SGLang engine over several nodes (its node rank 0 answers the whole API, the
    others /health once their schedulers joined; the embedded engine is one process and cannot span nodes).
    """
    if kind not in BACKENDS:
        raise ValueError(f"unknown engine kind {kind!r}; expected one of {BACKENDS}")
    if kind == "embedded" and nodes is not None and nodes.nnodes > 1:
        raise ValueError(f"engine {engine_rank}: the embedded engine is one process and cannot span "
                         f"{nodes.nnodes} nodes")
    deadline = startup_timeout_s or ENGINE_STARTUP_S
    name = f"{kind}-engine-{engine_rank}" + (f"-node-{nodes.node_rank}" if nodes is not None and nodes.nnodes > 1 else "")
    if kind == "embedded":  # bound here, served there: the port cannot be lost in between
        def command(p: int, fd: int) -> list[str]:
            return build_embedded_command(args, engine_rank, host, p, model_path, gpu_ids, listen_fd=fd,
                                          num_threads=num_threads)

        server, bound = start_bound_server(name, command, host=host, port=port, log_dir=log_dir,
                                           env={**os.environ, "HF_HUB_OFFLINE": "1"})
        server.wait_healthy(deadline)
        return EngineHandle(kind=kind, engine_rank=engine_rank, host=host, port=bound, server=server)

    def start_sglang() -> EngineHandle:
        chosen = port or find_free_port(host)
        with private_key_config() as key_file:  # removed once the engine serves: it read it as it started
            command = build_sglang_command(args, engine_rank, host, chosen, model_path, gpu_ids, nodes=nodes,
                                           key_file=key_file)
            server = start_server_process(name, command, f"http://{host}:{chosen}", log_dir=log_dir,
                                          env=sglang_engine_env())
            server.wait_healthy(deadline)
        return EngineHandle(kind=kind, engine_rank=engine_rank, host=host, port=chosen, server=server)

    return retry_port_clash(start_sglang, attempts=1 if port else 3, what=name)

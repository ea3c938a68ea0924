"""HTTP server exposing the embedded engine with SGLang's endpoints and payloads.

    SLIME_API_KEY=KEY python -m slime.backends.embedded_engine.server --model-path DIR --host 127.0.0.1 \
        --port P [--listen-fd FD] [--dtype float32] [--seed S] [--max-batch-size 64]

Rollout code talks to this exactly as to `sglang.launch_server` started with `--api-key KEY`: every
route but /health and /health_generate wants the key; state-changing routes take POST only.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from aiohttp import web

from slime.backends.embedded_engine.client_watch import ClientGoneError, made_progress, submit_while_connected
from slime.backends.embedded_engine.engine import EmbeddedEngine, EngineReleasedError, GenerationRequest
from slime.backends.embedded_engine.generate_request import build_requests
from slime.backends.embedded_engine.sampling import SamplingParams
from slime.backends.embedded_engine.scheduler import BatchScheduler
from slime.backends.sglang_utils.flattened_bucket import LOAD_FORMAT as BUCKET_FORMAT
from slime.backends.sglang_utils.flattened_bucket import decode_payload as decode_bucket
from slime.backends.sglang_utils.flattened_bucket import visible_device_uuids
from slime.backends.sglang_utils.named_tensors import deserialize_named_tensors
from slime.backends.sglang_utils.weight_delta import LOAD_FORMAT as DELTA_FORMAT
from slime.backends.sglang_utils.weight_delta import MISMATCH as DELTA_MISMATCH
from slime.utils.server_process import serve_on
from slime.backends.sglang_utils.shared_payload import LOAD_FORMAT as SHM_FORMAT
from slime.backends.sglang_utils.shared_payload import read_shared_bucket, run_directory
from slime.backends.sglang_utils import weight_checker
from slime.utils.deadlines import EMBEDDED_WEIGHT_GROUP_S, SERVER_SHUTDOWN_S
from slime.utils.security import LIVENESS_PATHS, ApiKey, request_limit, require_api_key, server_key

logger = logging.getLogger(__name__)

# load_format values of /update_weights_from_tensor this engine reads. SGLang's colocated
# "flattened_bucket" (CUDA-IPC handles in a ForkingPickler pickle) goes through the restricted unpickler
# (slime/utils/tensor_unpickler.py): tensor-rebuild functions only, any other global refused. SGLang's
# default format (None: a pickled list of LocalSerializedTensor) is refused.
SAFETENSORS_FORMAT = "slime_safetensors"
TENSOR_LOAD_FORMATS = (SAFETENSORS_FORMAT, SHM_FORMAT, BUCKET_FORMAT)
# UpdateWeightsFromTensorReqInput's fields (SGLang); anything else is a caller's mistake.
TENSOR_UPDATE_FIELDS = frozenset({"serialized_named_tensors", "load_format", "flush_cache", "abort_all_requests",
                                  "weight_version", "selector", "torch_empty_cache"})

SCHEDULER_KEY = web.AppKey("scheduler", BatchScheduler)


def error_response(message: str, status: int = 400) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


@web.middleware
async def errors_as_json(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except EngineReleasedError as exc:
        return error_response(str(exc), status=503)
    except ClientGoneError as exc:  # nobody reads this answer
        return error_response(str(exc), status=499)
    except (ValueError, KeyError, TypeError) as exc:
        return error_response(f"{type(exc).__name__}: {exc}", status=400)


async def _json_body(request: web.Request) -> dict[str, Any]:
    if not request.can_read_body:
        return {}
    body = await request.json()
    if not isinstance(body, dict):
        raise ValueError("request body must be a JSON object")
    return body


# ----- /generate ---------------------------------------------------------------------------
async def generate(request: web.Request) -> web.Response:
    scheduler = request.app[SCHEDULER_KEY]
    body = await _json_body(request)
    requests, as_list = build_requests(body, scheduler.engine.tokenize, scheduler.engine.vision)
    results = await submit_while_connected(request, scheduler, requests)
    outputs = [r.to_sglang() for r in results]
    if body.get("return_text_in_logprobs"):
        for out in outputs:
            for key in ("input_token_logprobs", "output_token_logprobs"):
                for entry in out["meta_info"].get(key, []):
                    entry[2] = scheduler.engine.tokenizer.decode([entry[1]])
    return web.json_response(outputs if as_list else outputs[0])


# ----- health, info --------------------------------------------------------------------------
async def health(request: web.Request) -> web.Response:
    # SGLang launched for RL (SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false): alive is enough, at once,
    # also while paused or released, so a router never marks an engine dead during a weight sync.
    return web.Response(status=200)


async def health_generate(request: web.Request) -> web.Response:
    scheduler = request.app[SCHEDULER_KEY]
    if scheduler.paused:  # paused on purpose (weight sync): alive, and a probe would wait for continue
        return web.Response(status=200)
    if made_progress(scheduler):  # busy and moving: a probe would only wait behind the batch
        return web.Response(status=200)
    probe = GenerationRequest(
        rid=f"health-{uuid.uuid4().hex}", input_ids=(0,), params=SamplingParams(max_new_tokens=1, temperature=0.0)
    )
    await scheduler.submit([probe])
    return web.Response(status=200)


async def model_info(request: web.Request) -> web.Response:
    return web.json_response(request.app[SCHEDULER_KEY].engine.model_info())


async def weight_version(request: web.Request) -> web.Response:
    return web.json_response({"weight_version": request.app[SCHEDULER_KEY].engine.weight_version})


async def server_info(request: web.Request) -> web.Response:
    scheduler = request.app[SCHEDULER_KEY]
    info = scheduler.engine.model_info()
    running, queued = scheduler.request_ids()
    info.update(paused=scheduler.paused, queued_requests=len(queued), running_requests=len(running),
                request_ids=running + queued, max_batch_size=scheduler.max_batch_size, memory=scheduler.engine.memory(),
                cuda_device_uuids=request.app[DEVICE_UUIDS_KEY])  # which CUDA-IPC senders can reach it
    return web.json_response(info)


async def loads(request: web.Request) -> web.Response:
    """SGLang's /v1/loads (JSON, core fields): what the rollout manager's progress watch reads."""
    return web.json_response({"timestamp": datetime.now(timezone.utc).isoformat(), "version": "embedded",
                              "loads": [request.app[SCHEDULER_KEY].load()]})


# ----- control ---------------------------------------------------------------------------------
async def flush_cache(request: web.Request) -> web.Response:
    """SGLang's semantics: flush only when no request runs or waits, waiting up to ?timeout= seconds.

    Nothing the engine keeps outlives a batch (no prefix cache), so an idle engine has nothing stale left."""
    scheduler = request.app[SCHEDULER_KEY]
    timeout_s = float(request.query.get("timeout", 0.0))
    if timeout_s < 0:
        raise ValueError("timeout must be >= 0")
    if not await scheduler.wait_idle(timeout_s):
        return web.Response(text="Cache not flushed: requests are running or waiting.\n", status=400)
    return web.Response(text="Cache flushed.\n", status=200)


async def pause_generation(request: web.Request) -> web.Response:
    body = await _json_body(request)
    await request.app[SCHEDULER_KEY].pause(body.get("mode", "abort"))
    return web.json_response({"message": "Generation paused successfully.", "status": "ok"})


async def continue_generation(request: web.Request) -> web.Response:
    request.app[SCHEDULER_KEY].resume_generation()
    return web.json_response({"message": "Generation continued successfully.", "status": "ok"})


async def abort_request(request: web.Request) -> web.Response:
    body = await _json_body(request)
    aborted = request.app[SCHEDULER_KEY].abort(rid=body.get("rid"), abort_all=bool(body.get("abort_all", False)))
    logger.info("abort_request (%s): %d request(s) aborted", "all" if body.get("abort_all") else body.get("rid"), aborted)
    return web.Response(status=200)


# ----- weight updates ----------------------------------------------------------------------------
SESSION_KEY = web.AppKey("weight_update_session", dict)


def _weight_result(success: bool, message: str) -> web.Response:
    return web.json_response({"success": success, "message": message}, status=200 if success else 400)


def _require_session(request: web.Request) -> None:
    if not request.app[SESSION_KEY]["open"]:
        raise ValueError("no weight-update session: POST /begin_weight_update first (as SGLang >= 0.5.21 requires)")


async def begin_weight_update(request: web.Request) -> web.Response:
    """One session at a time, as SGLang: a second begin is refused until the open session ends."""
    await _json_body(request)
    if request.app[SESSION_KEY]["open"]:
        return _weight_result(False, "A weight-update session is already open; call end_weight_update() first.")
    request.app[SESSION_KEY]["open"] = True
    return _weight_result(True, "Weight update session began.")


async def end_weight_update(request: web.Request) -> web.Response:
    await _json_body(request)
    if not request.app[SESSION_KEY]["open"]:
        return _weight_result(False, "No weight update session is open.")
    request.app[SESSION_KEY]["open"] = False
    return _weight_result(True, "Weight update session ended.")


def _decode_tensors(load_format: str, blob: str, shared_dir):
    if load_format == SHM_FORMAT:
        return read_shared_bucket(blob, shared_dir)  # only files of the run's own directory
    if load_format == BUCKET_FORMAT:
        return decode_bucket(blob)  # views of the sender's memory (CUDA IPC): copied, never kept
    return deserialize_named_tensors(blob)


def _check_tensor_update(body: dict[str, Any]) -> None:
    unknown = sorted(set(body) - TENSOR_UPDATE_FIELDS)
    if unknown:
        raise ValueError(f"unknown /update_weights_from_tensor fields {unknown}; SGLang's are "
                         f"{sorted(TENSOR_UPDATE_FIELDS)}")
    if body.get("load_format") not in TENSOR_LOAD_FORMATS:
        raise ValueError(f"load_format {body.get('load_format')!r}: the embedded engine reads {TENSOR_LOAD_FORMATS} "
                         "(SGLang's default pickled format, a list of LocalSerializedTensor, is refused)")
    if body.get("selector", "all") not in ("all", "target"):
        raise ValueError(f"selector {body['selector']!r}: the embedded engine has no draft model ('all' or 'target')")
    blobs = body.get("serialized_named_tensors")
    if not isinstance(blobs, list) or len(blobs) != 1 or not isinstance(blobs[0], str):
        raise ValueError("serialized_named_tensors must be a list with one string (the engine has TP=1)")


async def update_weights_from_tensor(request: web.Request) -> web.Response:
    scheduler = request.app[SCHEDULER_KEY]
    body = await _json_body(request)
    _check_tensor_update(body)
    load_format = body["load_format"]
    _require_session(request)
    if body.get("abort_all_requests"):
        scheduler.abort(abort_all=True)
    named = await asyncio.get_running_loop().run_in_executor(None, _decode_tensors, load_format,
                                                             body["serialized_named_tensors"][0],
                                                             request.app[SHARED_DIR_KEY])
    # Shared-memory views stay valid after the sender unlinks the file: the engine adopts them as storage.
    # CUDA-IPC views belong to the sender, which reuses them once answered: copied (and synchronized).
    update = functools.partial(scheduler.engine.update_weights, adopt=load_format == SHM_FORMAT,
                               empty_cache=bool(body.get("torch_empty_cache", False)))
    count = await scheduler.run_exclusive(update, named, body.get("weight_version"))
    del named  # the last reference to the sender's memory: torch's IPC refcount drops here
    logger.info("updated %d tensors, weight_version=%s", count, scheduler.engine.weight_version)
    return _weight_result(True, f"Updated {count} tensors.")


GROUPS_KEY = web.AppKey("weight_update_groups", dict)


async def init_weights_update_group(request: web.Request) -> web.Response:
    """Join the sender's group as rank `rank_offset` (TP=1), over gloo: the engine runs on CPU."""
    from slime.distributed.external_group import ExternalGroupSpec

    body = await _json_body(request)
    engine = request.app[SCHEDULER_KEY].engine
    backend = body.get("backend", "nccl")
    usable = ("gloo", "nccl") if engine.device.type == "cuda" else ("gloo",)
    if backend not in usable:
        raise ValueError(f"backend {backend!r}: the embedded engine on {engine.device} joins weight-update groups "
                         f"over {' or '.join(usable)}")
    spec = ExternalGroupSpec(
        master_address=str(body["master_address"]), master_port=int(body["master_port"]),
        world_size=int(body["world_size"]), group_name=str(body.get("group_name", "weight_update_group")),
        backend=backend, timeout_s=request.app[GROUP_TIMEOUT_KEY],
    )
    groups = request.app[GROUPS_KEY]
    if spec.group_name in groups:  # a new sender (a restarted trainer) replaces the old one's group, as SGLang does
        groups.pop(spec.group_name).close()
        logger.info("weight-update group %s replaced by a new sender's", spec.group_name)
    group = await _join_on_engine_thread(request, spec, int(body["rank_offset"]))
    groups[spec.group_name] = group
    logger.info("joined weight-update group %s as rank %d of %d", spec.group_name, group.rank, spec.world_size)
    return _weight_result(True, "Succeeded to initialize custom process group.")


async def _join_on_engine_thread(request: web.Request, spec, rank: int):
    """Join on the engine's own thread (NCCL binds the communicator to that thread's current device)."""
    from slime.distributed.external_group import open_external_group

    engine = request.app[SCHEDULER_KEY].engine

    def join():
        if spec.backend == "nccl":
            import torch

            torch.cuda.set_device(engine.device)
        return open_external_group(spec, rank)

    return await request.app[SCHEDULER_KEY].run_exclusive(join)


async def update_weights_from_distributed(request: web.Request) -> web.Response:
    scheduler = request.app[SCHEDULER_KEY]
    body = await _json_body(request)
    if body.get("load_format") not in (None, DELTA_FORMAT):
        raise ValueError(f"load_format {body['load_format']!r} is not supported for distributed updates here")
    _require_session(request)
    group_name = body.get("group_name", "weight_update_group")
    group = request.app[GROUPS_KEY].get(group_name)
    if group is None:
        raise ValueError(f"no weight-update group {group_name!r}: POST /init_weights_update_group first")
    if body.get("abort_all_requests"):
        scheduler.abort(abort_all=True)
    if body.get("load_format") == DELTA_FORMAT:
        return await _apply_delta(scheduler, group, group_name, body)
    count = await scheduler.run_exclusive(scheduler.engine.receive_broadcast_weights, group, body["names"],
                                          body["dtypes"], body["shapes"], body.get("weight_version"))
    logger.info("updated %d tensors from group %s, weight_version=%s", count, group_name,
                scheduler.engine.weight_version)
    return _weight_result(True, f"Updated {count} tensors.")


async def _apply_delta(scheduler, group, group_name: str, body: dict) -> web.Response:
    """A delta push: loaded only when every tensor's digest matches, else refused (the sender pushes in full)."""
    delta = body["delta"]
    count, mismatched = await scheduler.run_exclusive(
        scheduler.engine.receive_broadcast_delta, group, delta["tensors"], delta["encoding"], delta["checksum"],
        body.get("weight_version"))
    if mismatched:
        logger.warning("delta from group %s refused: %d tensors differ from the sender's baseline (%s)",
                       group_name, len(mismatched), ", ".join(mismatched[:3]))
        return _weight_result(False, f"{DELTA_MISMATCH}: {len(mismatched)} tensors, e.g. {mismatched[:3]}")
    logger.info("applied a delta to %d tensors from group %s, weight_version=%s", count, group_name,
                scheduler.engine.weight_version)
    return _weight_result(True, f"Updated {count} tensors.")


async def destroy_weights_update_group(request: web.Request) -> web.Response:
    body = await _json_body(request)
    group = request.app[GROUPS_KEY].pop(body.get("group_name", "weight_update_group"), None)
    if group is None:
        return _weight_result(False, "no such weight-update group")
    group.close()
    return _weight_result(True, "Succeeded to destroy custom process group.")


async def update_weights_from_disk(request: web.Request) -> web.Response:
    scheduler = request.app[SCHEDULER_KEY]
    body = await _json_body(request)
    count = await scheduler.run_exclusive(
        scheduler.engine.update_weights_from_disk, body["model_path"], body.get("weight_version")
    )
    return web.json_response({"success": True, "message": f"Loaded {count} tensors.", "num_paused_requests": 0})


async def update_weight_version(request: web.Request) -> web.Response:
    scheduler = request.app[SCHEDULER_KEY]
    body = await _json_body(request)
    if body.get("abort_all_requests"):
        scheduler.abort(abort_all=True)
    scheduler.engine.weight_version = str(body["new_version"])
    return web.json_response({"success": True, "new_version": scheduler.engine.weight_version})


async def get_weights_by_name(request: web.Request) -> web.Response:
    scheduler = request.app[SCHEDULER_KEY]
    body = await _json_body(request) if request.method == "POST" else dict(request.query)
    tensor = await scheduler.run_exclusive(scheduler.engine.get_weight, body["name"])
    truncate = int(body.get("truncate_size", 100))
    return web.json_response(tensor.flatten()[:truncate].tolist())


async def weights_checker(request: web.Request) -> web.Response:
    """SGLang's checksum action: a digest of every tensor the engine serves (sglang_utils/weight_checker.py).
    SGLang's other actions (snapshot, reset_tensors, compare) are not served here."""
    body = await _json_body(request)
    unknown = sorted(set(body) - weight_checker.REQUEST_FIELDS)
    if unknown:
        raise ValueError(f"unknown /weights_checker fields {unknown}; SGLang's are "
                         f"{sorted(weight_checker.REQUEST_FIELDS)}")
    action = body.get("action", weight_checker.CHECKSUM_ACTION)
    if action != weight_checker.CHECKSUM_ACTION:
        return web.json_response({"success": False, "message": f"action {action!r}: the embedded engine serves "
                                  f"{weight_checker.CHECKSUM_ACTION!r} only"}, status=400)
    if body.get("skip_tensor_list"):
        raise ValueError("skip_tensor_list: the embedded engine digests every tensor it serves")
    scheduler = request.app[SCHEDULER_KEY]
    checksums = await scheduler.run_exclusive(scheduler.engine.weight_checksums)
    return web.json_response(weight_checker.checksum_response(checksums))


async def release_memory_occupation(request: web.Request) -> web.Response:
    scheduler = request.app[SCHEDULER_KEY]
    body = await _json_body(request)
    await scheduler.run_exclusive(scheduler.engine.release, body.get("tags"))
    logger.info("memory released: %s", scheduler.engine.released_tags)
    return web.json_response({"success": True, "released_tags": list(scheduler.engine.released_tags)})


async def resume_memory_occupation(request: web.Request) -> web.Response:
    scheduler = request.app[SCHEDULER_KEY]
    body = await _json_body(request)
    await scheduler.run_exclusive(scheduler.engine.resume, body.get("tags"))
    logger.info("memory resumed; still released: %s", scheduler.engine.released_tags)
    return web.json_response({"success": True, "released_tags": list(scheduler.engine.released_tags)})


GROUP_TIMEOUT_KEY = web.AppKey("weight_update_group_timeout_s", float)
SHARED_DIR_KEY = web.AppKey("shared_bucket_directory", Path)
DEVICE_UUIDS_KEY = web.AppKey("cuda_device_uuids", list)


DEFAULT_MAX_REQUEST_BYTES = request_limit()  # one default weight bucket in base64, plus a margin


def build_app(engine: EmbeddedEngine, max_batch_size: int = 64,
              group_timeout_s: float = EMBEDDED_WEIGHT_GROUP_S, *, api_key: ApiKey,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> web.Application:
    auth = require_api_key(api_key, public=LIVENESS_PATHS)  # as SGLang: sglang-router probes /health keyless
    app = web.Application(middlewares=[auth, errors_as_json], client_max_size=max_request_bytes)
    scheduler = BatchScheduler(engine, max_batch_size)
    app[SCHEDULER_KEY] = scheduler
    app[SESSION_KEY] = {"open": False}
    app[GROUPS_KEY] = {}
    app[GROUP_TIMEOUT_KEY] = float(group_timeout_s)
    app[SHARED_DIR_KEY] = run_directory(api_key)
    app[DEVICE_UUIDS_KEY] = visible_device_uuids()

    async def lifecycle(app: web.Application):
        scheduler.start()
        yield
        await scheduler.close()

    app.cleanup_ctx.append(lifecycle)
    app.router.add_get("/get_weights_by_name", get_weights_by_name)  # reads only: GET as well
    app.router.add_post("/get_weights_by_name", get_weights_by_name)
    # State-changing routes take POST only (SGLang answers GET on some: a link or a prefetch must not act).
    app.router.add_post("/flush_cache", flush_cache)
    app.router.add_post("/release_memory_occupation", release_memory_occupation)
    app.router.add_post("/resume_memory_occupation", resume_memory_occupation)
    app.router.add_post("/generate", generate)
    app.router.add_get("/health", health)
    app.router.add_get("/health_generate", health_generate)
    app.router.add_get("/get_model_info", model_info)
    app.router.add_get("/model_info", model_info)
    app.router.add_get("/get_weight_version", weight_version)
    app.router.add_get("/get_server_info", server_info)
    app.router.add_get("/server_info", server_info)
    app.router.add_get("/v1/loads", loads)
    app.router.add_post("/pause_generation", pause_generation)
    app.router.add_post("/continue_generation", continue_generation)
    app.router.add_post("/abort_request", abort_request)
    app.router.add_post("/begin_weight_update", begin_weight_update)
    app.router.add_post("/end_weight_update", end_weight_update)
    app.router.add_post("/update_weights_from_tensor", update_weights_from_tensor)
    app.router.add_post("/init_weights_update_group", init_weights_update_group)
    app.router.add_post("/update_weights_from_distributed", update_weights_from_distributed)
    app.router.add_post("/destroy_weights_update_group", destroy_weights_update_group)
    app.router.add_post("/update_weights_from_disk", update_weights_from_disk)
    app.router.add_post("/update_weight_version", update_weight_version)
    app.router.add_post(weight_checker.ROUTE, weights_checker)  # reads only, but POST as the trainer sends it
    return app


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Embedded CPU rollout engine with SGLang's HTTP API")
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True, help="the port (with --listen-fd: the socket's)")
    parser.add_argument("--listen-fd", type=int, default=None,
                        help="serve on this inherited listening socket (bound by the launcher: no port race)")
    parser.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                        help="largest request body accepted (one weight bucket in base64, 4/3 of its bytes, plus a margin)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu", help="torch device of the model (cpu, cuda, cuda:N)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--num-threads", type=int, default=0, help="torch intra-op threads (0: torch default)")
    parser.add_argument("--weight-update-timeout", type=float, default=EMBEDDED_WEIGHT_GROUP_S,
                        help="seconds allowed to join a weight-update group and for each broadcast on it")
    parser.add_argument("--log-level", default="info")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="[embedded-engine %(asctime)s] %(message)s")
    if args.num_threads > 0:
        import torch

        torch.set_num_threads(args.num_threads)
    key = server_key()
    engine = EmbeddedEngine(args.model_path, dtype=args.dtype, seed=args.seed, device=args.device)
    logger.info("serving %s on http://%s:%d", args.model_path, args.host, args.port)
    access_log = logging.getLogger("aiohttp.access") if args.log_level.lower() == "debug" else None
    app = build_app(engine, args.max_batch_size, args.weight_update_timeout, api_key=key,
                    max_request_bytes=args.max_request_bytes)
    web.run_app(app, print=None, access_log=access_log, shutdown_timeout=SERVER_SHUTDOWN_S,
                **serve_on(args.listen_fd, args.host, args.port))


if __name__ == "__main__":
    main()

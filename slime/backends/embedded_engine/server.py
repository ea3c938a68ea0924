"""HTTP server exposing the embedded engine with SGLang's endpoints and payloads.

    python -m slime.backends.embedded_engine.server --model-path DIR --host 127.0.0.1 --port P \
        [--dtype float32] [--seed S] [--max-batch-size 64]

Rollout code talks to this exactly as to `sglang.launch_server`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import uuid
from typing import Any

from aiohttp import web

from slime.backends.embedded_engine.client_watch import ClientGoneError, made_progress, submit_while_connected
from slime.backends.embedded_engine.engine import EmbeddedEngine, EngineReleasedError, GenerationRequest
from slime.backends.embedded_engine.sampling import SamplingParams
from slime.backends.embedded_engine.scheduler import BatchScheduler
from slime.backends.sglang_utils.named_tensors import deserialize_named_tensors

logger = logging.getLogger(__name__)

# Top-level /generate keys this engine honours; any other key is rejected rather than ignored.
_GENERATE_KEYS = {
    "text",
    "input_ids",
    "sampling_params",
    "return_logprob",
    "rid",
    "stream",
    "logprob_start_len",
    "top_logprobs_num",
    "return_text_in_logprobs",
    "log_metrics",
}
PROJECT_LOAD_FORMATS = (None, "slime_safetensors")

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
def _prompts(body: dict[str, Any], engine: EmbeddedEngine) -> tuple[list[list[int]], bool]:
    """Token-id prompts and whether the request was a batch (SGLang then answers with a list)."""
    if (body.get("text") is None) == (body.get("input_ids") is None):
        raise ValueError("exactly one of text or input_ids is required")
    if body.get("input_ids") is not None:
        ids = body["input_ids"]
        is_batch = bool(ids) and isinstance(ids[0], list)
        return ([list(map(int, x)) for x in ids] if is_batch else [list(map(int, ids))]), is_batch
    text = body["text"]
    is_batch = isinstance(text, list)
    return [engine.tokenize(t) for t in (text if is_batch else [text])], is_batch


def _build_requests(body: dict[str, Any], engine: EmbeddedEngine) -> tuple[list[GenerationRequest], bool]:
    unknown = sorted(set(body) - _GENERATE_KEYS)
    if unknown:
        raise ValueError(f"unsupported /generate fields: {unknown}")
    if body.get("stream"):
        raise ValueError("streaming is not supported by the embedded engine")
    if body.get("top_logprobs_num"):
        raise ValueError("top_logprobs_num is not supported by the embedded engine")
    prompts, is_batch = _prompts(body, engine)
    params = SamplingParams.from_request(body.get("sampling_params"))
    rids = body.get("rid")
    rid_list = rids if isinstance(rids, list) else [rids] * len(prompts)
    requests = []
    for prompt, rid in zip(prompts, rid_list):
        base = rid or uuid.uuid4().hex
        for k in range(params.n):
            requests.append(
                GenerationRequest(
                    rid=base if params.n == 1 else f"{base}-{k}",
                    input_ids=tuple(prompt),
                    params=params,
                    return_logprob=bool(body.get("return_logprob", False)),
                )
            )
    return requests, is_batch or params.n > 1


async def generate(request: web.Request) -> web.Response:
    scheduler = request.app[SCHEDULER_KEY]
    body = await _json_body(request)
    requests, as_list = _build_requests(body, scheduler.engine)
    results = await submit_while_connected(request, scheduler, requests)
    outputs = [r.to_sglang() for r in results]
    if body.get("return_text_in_logprobs"):
        for out in outputs:
            for entry in out["meta_info"].get("output_token_logprobs", []):
                entry[2] = scheduler.engine.tokenizer.decode([entry[1]])
    return web.json_response(outputs if as_list else outputs[0])


# ----- health, info --------------------------------------------------------------------------
async def health(request: web.Request) -> web.Response:
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
                request_ids=running + queued, max_batch_size=scheduler.max_batch_size, memory=scheduler.engine.memory())
    return web.json_response(info)


# ----- control ---------------------------------------------------------------------------------
async def flush_cache(request: web.Request) -> web.Response:
    # No KV/prefix state outlives a batch here, so there is nothing stale to drop.
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
    request.app[SCHEDULER_KEY].abort(rid=body.get("rid"), abort_all=bool(body.get("abort_all", False)))
    return web.Response(status=200)


async def update_weights_from_tensor(request: web.Request) -> web.Response:
    scheduler = request.app[SCHEDULER_KEY]
    body = await _json_body(request)
    if body.get("load_format") not in PROJECT_LOAD_FORMATS:
        raise ValueError(f"load_format {body.get('load_format')!r} unsupported; expected one of {PROJECT_LOAD_FORMATS}")
    blobs = body.get("serialized_named_tensors")
    if not isinstance(blobs, list) or len(blobs) != 1:
        raise ValueError("serialized_named_tensors must be a list with one entry (the engine has TP=1)")
    if body.get("abort_all_requests"):
        scheduler.abort(abort_all=True)
    named = await asyncio.get_running_loop().run_in_executor(None, deserialize_named_tensors, blobs[0])
    count = await scheduler.run_exclusive(scheduler.engine.update_weights, named, body.get("weight_version"))
    logger.info("updated %d tensors, weight_version=%s", count, scheduler.engine.weight_version)
    return web.json_response({"success": True, "message": f"Updated {count} tensors."})


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


def build_app(engine: EmbeddedEngine, max_batch_size: int = 64) -> web.Application:
    app = web.Application(middlewares=[errors_as_json], client_max_size=2**31)
    scheduler = BatchScheduler(engine, max_batch_size)
    app[SCHEDULER_KEY] = scheduler

    async def lifecycle(app: web.Application):
        scheduler.start()
        yield
        await scheduler.close()

    app.cleanup_ctx.append(lifecycle)
    get_and_post = [
        ("/flush_cache", flush_cache),
        ("/get_weights_by_name", get_weights_by_name),
        ("/release_memory_occupation", release_memory_occupation),
        ("/resume_memory_occupation", resume_memory_occupation),
    ]
    for path, handler in get_and_post:
        app.router.add_get(path, handler)
        app.router.add_post(path, handler)
    app.router.add_post("/generate", generate)
    app.router.add_get("/health", health)
    app.router.add_get("/health_generate", health_generate)
    app.router.add_get("/get_model_info", model_info)
    app.router.add_get("/model_info", model_info)
    app.router.add_get("/get_weight_version", weight_version)
    app.router.add_get("/get_server_info", server_info)
    app.router.add_get("/server_info", server_info)
    app.router.add_post("/pause_generation", pause_generation)
    app.router.add_post("/continue_generation", continue_generation)
    app.router.add_post("/abort_request", abort_request)
    app.router.add_post("/update_weights_from_tensor", update_weights_from_tensor)
    app.router.add_post("/update_weights_from_disk", update_weights_from_disk)
    app.router.add_post("/update_weight_version", update_weight_version)
    return app


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Embedded CPU rollout engine with SGLang's HTTP API")
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu", help="torch device of the model (cpu, cuda, cuda:N)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--num-threads", type=int, default=0, help="torch intra-op threads (0: torch default)")
    parser.add_argument("--log-level", default="info")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="[embedded-engine %(asctime)s] %(message)s")
    if args.num_threads > 0:
        import torch

        torch.set_num_threads(args.num_threads)
    engine = EmbeddedEngine(args.model_path, dtype=args.dtype, seed=args.seed, device=args.device)
    logger.info("serving %s on http://%s:%d", args.model_path, args.host, args.port)
    access_log = logging.getLogger("aiohttp.access") if args.log_level.lower() == "debug" else None
    web.run_app(
        build_app(engine, args.max_batch_size), host=args.host, port=args.port, print=None, access_log=access_log,
        shutdown_timeout=2.0,
    )


if __name__ == "__main__":
    main()

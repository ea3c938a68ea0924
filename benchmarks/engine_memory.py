"""The embedded engine's colocate memory hand-off on one device, measured through its HTTP surface.

    python benchmarks/engine_memory.py --model-path DIR [--device cuda] [--dtype bfloat16] [--results-json F]

Starts the engine server, generates a greedy batch, releases every memory tag (what the rollout
manager does before actor_train), reads the engine's device memory before and after, resumes, and
generates the same batch again: the outputs must be identical (the weights came back exactly).
Prints one "ENGINE_MEMORY {...}" JSON line; exit status 1 when the outputs differ or the release
kept more than 10 % of the awake footprint.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from slime.backends.sglang_utils.http_client import ClientTimeouts, SGLangHTTPClient  # noqa: E402
from slime.utils.server_process import python_module_command, start_server_process  # noqa: E402
from slime.utils.ports import find_free_port  # noqa: E402
from slime.utils.security import ApiKey, use_key  # noqa: E402

TARGET_RATIO = 0.10  # asleep / awake, the colocate memory target


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--model-path", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--results-json", default=None)
    return p.parse_args()


def greedy_batch(client: SGLangHTTPClient, prompts: int, new_tokens: int) -> list[list[int]]:
    ids = [[(7 * i + j) % 1000 + 10 for j in range(8 + i % 5)] for i in range(prompts)]
    replies = [client.generate(input_ids=p, sampling_params={"temperature": 0.0, "max_new_tokens": new_tokens})
               for p in ids]
    return [r["output_ids"] for r in replies]


def main() -> int:
    opts = parse()
    use_key(ApiKey.generate())  # the engine requires it; the client sends it
    port = find_free_port()
    command = python_module_command("slime.backends.embedded_engine.server", [
        "--model-path", opts.model_path, "--port", str(port), "--device", opts.device, "--dtype", opts.dtype])
    server = start_server_process("engine-memory", command, f"http://127.0.0.1:{port}")
    try:
        server.wait_healthy(600)
        client = SGLangHTTPClient(server.url, ClientTimeouts(control=60, generate=600, weight_update=600, memory=600))
        first = greedy_batch(client, opts.prompts, opts.new_tokens)
        awake = client.server_info()["memory"]
        start = time.perf_counter()
        client.release_memory_occupation(None)
        release_s = time.perf_counter() - start
        released = client.server_info()["memory"]
        start = time.perf_counter()
        client.resume_memory_occupation(None)
        resume_s = time.perf_counter() - start
        second = greedy_batch(client, opts.prompts, opts.new_tokens)
    finally:
        server.stop()
    ratio = released["reserved_gb"] / max(awake["peak_reserved_gb"], 1e-12)
    report = {"awake": awake, "released": released, "released_over_awake_peak": ratio,
              "release_s": release_s, "resume_s": resume_s, "same_outputs_after_resume": first == second,
              "device": opts.device, "dtype": opts.dtype}
    print("ENGINE_MEMORY " + json.dumps(report), flush=True)
    if opts.results_json:
        Path(opts.results_json).write_text(json.dumps(report, indent=2))
    return 0 if first == second and (opts.device == "cpu" or ratio < TARGET_RATIO) else 1


if __name__ == "__main__":
    sys.exit(main())

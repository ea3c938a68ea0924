"""SGLang's own files as the contract, for the oldest and the newest release setup.py supports.

Every request body the project sends (recorded from the real client and rollout code), every launch
argv it renders (through the real passthrough and launcher, parsed back by SGLang's ServerArgs parser)
and its CUDA-IPC tensor payload (decoded by SGLang's own flattened-bucket code on CPU) are checked in a
subprocess that loads SGLang's files (tests/sglang_probe.py). A renamed field, a missing route or a
flag SGLang lacks fails here.
"""
from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
import types
from typing import Any

import pytest

from sglang_files import ROOT, sglang_root, supported_versions
from slime.backends.embedded_engine import generate_request
from slime.backends.embedded_engine.sampling import SamplingParams
from slime.backends.sglang_utils.http_client import SGLangHTTPClient
from slime.backends.sglang_utils.launcher import SGLANG_ENV_DEFAULTS

pytestmark = pytest.mark.timeout(300)
VERSIONS = supported_versions()
ENGINE_TP = 2

# route -> SGLang's request struct for it (None: no body struct)
ROUTE_STRUCTS = {
    "/generate": "GenerateReqInput",
    "/abort_request": "AbortReq",
    "/pause_generation": "PauseGenerationReqInput",
    "/continue_generation": "ContinueGenerationReqInput",
    "/release_memory_occupation": "ReleaseMemoryOccupationReqInput",
    "/resume_memory_occupation": "ResumeMemoryOccupationReqInput",
    "/begin_weight_update": "BeginWeightUpdateReqInput",
    "/end_weight_update": "EndWeightUpdateReqInput",
    "/update_weights_from_tensor": "UpdateWeightsFromTensorReqInput",
    "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
    "/get_weights_by_name": "GetWeightsByNameReqInput",
    "/weights_checker": "CheckWeightsReqInput",
    "/flush_cache": None,  # query parameter only
    "/health": None,
    "/model_info": None,
    "/server_info": None,
}
SESSION_ROUTES = ("/begin_weight_update", "/end_weight_update")  # SGLang >= 0.5.21; 404 before (fallback)


class _Recorder:
    """Stands in for requests.Session: records what the real client sends, answers 200 {}."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def request(self, method, url, json=None, timeout=None):
        path, _, query = url.split("//", 1)[1].partition("/")[2].partition("?")
        self.calls.append({"method": method, "route": "/" + path, "query": query, "body": json})
        return types.SimpleNamespace(status_code=200, json=lambda: {"weight_version": "1"}, text="")

    def close(self) -> None:
        pass


def record_client_calls() -> list[dict[str, Any]]:
    client = SGLangHTTPClient("http://engine:1")
    recorder = client._session = _Recorder()
    client.health()
    client.model_info()
    client.server_info()
    client.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 4, "temperature": 1.0, "top_k": 5},
                    return_logprob=True, logprob_start_len=0)
    client.abort_all()
    client.pause_generation()
    client.flush_cache(timeout_s=30)
    client.continue_generation()
    client.release_memory_occupation()
    client.resume_memory_occupation(["weights"])
    client.begin_weight_update()
    client.update_weights_from_serialized(["AAAA", "AAAA"], weight_version="3", flush_cache=False,
                                          load_format="flattened_bucket")
    client.end_weight_update()
    client.update_weights_from_disk("/ckpt", weight_version="4")
    client.init_weights_update_group(master_address="10.0.0.1", master_port=29500, rank_offset=1, world_size=3,
                                     group_name="slime_weight_update_pp0", backend="nccl")
    client.update_weights_from_distributed(names=["a"], dtypes=["bfloat16"], shapes=[[2, 3]],
                                           group_name="slime_weight_update_pp0", weight_version="5")
    client.destroy_weights_update_group("slime_weight_update_pp0")
    client.get_weights_by_name("lm_head.weight", 10)
    client.check_weights()
    return recorder.calls


def record_rollout_generate(monkeypatch) -> list[dict[str, Any]]:
    """The bodies slime.rollout.sglang_rollout.generate sends for the default sampling flags: a fresh sample,
    and one aborted earlier (--partial-rollout) that resumes within --rollout-max-context-len."""
    from slime.rollout import sglang_rollout
    from slime.utils.arguments import build_parser
    from slime.utils.types import Sample

    sent = []

    async def capture(url, payload, timeout_s=None):
        sent.append(payload)
        return {"text": "", "output_ids": [],
                "meta_info": {"finish_reason": {"type": "length"}, "output_token_logprobs": []}}

    monkeypatch.setattr(sglang_rollout, "post", capture)
    args = build_parser().parse_known_args(["--rollout-batch-size", "1"])[0]
    args.sglang_router_ip, args.sglang_router_port = "127.0.0.1", 1
    args.rollout_max_response_len, args.rollout_stop, args.rollout_stop_token_ids = 12, ["</s>"], [2]
    args.rollout_top_k, args.rollout_max_context_len = 20, 64
    resumed = Sample(tokens=[1, 2, 3, 7, 8], response_length=2, status=Sample.Status.ABORTED)
    for sample in (Sample(tokens=[1, 2, 3]), resumed, _sample_with_an_image(args, monkeypatch)):
        asyncio.run(sglang_rollout.generate(args, sample, sglang_rollout.sampling_params(args)))
    return [{"method": "POST", "route": "/generate", "query": "", "body": body} for body in sent]


def _sample_with_an_image(args, monkeypatch):
    """A sample of a tiny vision + text checkpoint with one picture (its body carries image_data)."""
    import tempfile

    from PIL import Image

    from slime.rollout import sglang_rollout
    from slime.tools.tiny_vl_checkpoint import write_tiny_vl_checkpoint
    from slime.utils.images import canonical_image
    from slime.utils.types import Sample
    from slime.utils.vision_processor import load_vision_processor

    path = write_tiny_vl_checkpoint(tempfile.mkdtemp())
    processor = load_vision_processor(str(path))
    monkeypatch.setattr(sglang_rollout, "GenerateState", lambda args: types.SimpleNamespace(processor=processor))
    args.debug_rollout_only = True  # images reach the engines; the trainer does not take them yet
    buffer = io.BytesIO()
    Image.new("RGB", (16, 16), (200, 10, 10)).save(buffer, format="PNG")
    image = canonical_image(buffer.getvalue())
    text = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>how many?<|im_end|>\n<|im_start|>assistant\n"
    return Sample(index=5, tokens=processor.prompt_ids(text, [image]), multimodal_inputs={"images": [image]})


# SGLang's /generate schema gate must refuse these (proof that the gate runs, not a formality)
GATE_CHECKS = {
    "float max_new_tokens": {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 10.0}},
    "unknown sampling param": {"input_ids": [1, 2], "sampling_params": {"max_new_token": 10}},
}
# Engine environment names that are not SGLang's, and the installed package that reads each
FOREIGN_ENV_READERS = {"RAY_": "ray"}


LAUNCH_CASES = [
    {"name": "colocated", "engine_rank": 1, "gpu_ids": [3, 4],
     "args": {"rollout_num_gpus_per_engine": ENGINE_TP, "seed": 7, "offload_rollout": True,
              "sglang_mem_fraction_static": 0.7, "sglang_cuda_graph_bs": [1, 2, 4]},
     "argv": [], "expect": {"tp_size": ENGINE_TP, "base_gpu_id": 3, "random_seed": 8, "enable_memory_saver": True,
                            "mem_fraction_static": 0.7, "skip_server_warmup": True, "trust_remote_code": True},
     "cuda_graph_bs": [1, 2, 4],
     "env": ["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK"]},
    # an engine of 8 GPUs over two nodes of 4: each node's process gets its node's GPUs, the whole TP size, its
    # node rank and node rank 0's address (upstream's deepseek-r1 / kimi-k2 / glm5 engines, at a smaller size)
    *({"name": f"node rank {rank} of 2", "engine_rank": 3, "gpu_ids": [0, 1, 2, 3],
       "nodes": {"nnodes": 2, "node_rank": rank, "dist_init_addr": "10.0.0.2:29555"},
       "args": {"rollout_num_gpus_per_engine": 8, "num_gpus_per_node": 4, "seed": 7, "offload_rollout": False},
       "argv": ["--sglang-ep-size", "8", "--sglang-enable-dp-attention", "--sglang-dp-size", "8"],
       "expect": {"tp_size": 8, "base_gpu_id": 0, "nnodes": 2, "node_rank": rank, "dist_init_addr": "10.0.0.2:29555",
                  "random_seed": 10, "ep_size": 8, "enable_dp_attention": True, "dp_size": 8}} for rank in (0, 1)),
    {"name": "passthrough", "args": {"rollout_num_gpus_per_engine": 1, "seed": 1, "offload_rollout": False},
     "argv": ["--sglang-preferred-sampling-params", '{"temperature": 0.5, "top_p": 0.9}',
              "--sglang-json-model-override-args", '{"rope_scaling": {"factor": 2.0}}',
              "--sglang-no-lora-strict-loading", "--sglang-disable-radix-cache", "--sglang-max-running-requests", "64"],
     "expect": {"preferred_sampling_params": {"temperature": 0.5, "top_p": 0.9},
                "json_model_override_args": '{"rope_scaling": {"factor": 2.0}}', "lora_strict_loading": False,
                "disable_radix_cache": True, "max_running_requests": 64, "enable_memory_saver": False}},
]


@pytest.fixture(scope="module", params=VERSIONS)
def report(request, tmp_path_factory) -> dict[str, Any]:
    version = request.param
    root = sglang_root(version)
    monkeypatch = pytest.MonkeyPatch()
    try:
        bodies = [*record_client_calls(), *record_rollout_generate(monkeypatch)]
    finally:
        monkeypatch.undo()
    for body in bodies:
        body["cls"] = ROUTE_STRUCTS[body["route"]]
    cases = [{k: v for k, v in case.items() if k != "cuda_graph_bs"} for case in LAUNCH_CASES]
    for case, source in zip(cases, LAUNCH_CASES):
        if "cuda_graph_bs" in source:
            case["expect"] = {**case["expect"], "cuda_graph_bs": None, "cuda_graph_bs_decode": None}
    env_names = sorted(n for n in SGLANG_ENV_DEFAULTS if n.startswith(("SGLANG_", "SGL_")))
    probe_request = {"bodies": bodies, "launch": cases, "env_names": env_names, "tp_size": ENGINE_TP,
                     "gate_checks": GATE_CHECKS, "checksum_answer": _embedded_checksum_answer()["ranks"][0]}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(ROOT)]), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "sglang_probe.py")], input=json.dumps(probe_request),
                          capture_output=True, text=True, env=env, timeout=240, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)
    assert result["version"] == version
    return result


def _embedded_checksum_answer() -> dict[str, Any]:
    from slime.backends.sglang_utils.weight_checker import checksum_response

    return checksum_response({"model.norm.weight": "float32:" + "0" * 32})


def test_the_embedded_engines_checksum_answer_is_sglangs(report):
    """/weights_checker: the embedded engine answers in SGLang's shape (one GPU's ChecksumInfo as SGLang types it)."""
    if _newer_than(report["version"], "0.5.23"):
        assert report["checksum_answer"] == [], report["checksum_answer"]
    else:  # 0.5.15 passes a free dict (one parallelism_info dict per GPU): the client reads either shape
        assert report["checksum_answer"] is None
    assert set(_embedded_checksum_answer()) == {"success", "message", "ranks", "per_engine_checksum"}


def _newer_than(version: str, other: str) -> bool:
    def key(v: str) -> tuple:
        return tuple(int(p) if p.isdigit() else 0 for p in v.replace(".post", ".").split("."))

    return key(version) >= key(other)


def test_every_request_body_fits_sglangs_request_types(report):
    for entry in report["bodies"]:
        where = f"{entry['method']} {entry['route']} (SGLang {report['version']})"
        if entry["route"] in SESSION_ROUTES and not _newer_than(report["version"], "0.5.21"):
            assert not entry["route_exists"], f"{where}: expected absent before 0.5.21 (the client falls back)"
            continue
        assert entry["route_exists"], f"{where}: SGLang has no such route"
        assert entry["cls_exists"], f"{where}: SGLang has no {entry['cls']}"
        assert entry["problems"] == [], f"{where}: {entry['problems']}"


def test_the_committed_server_option_list_is_sglangs(report):
    """slime/utils/sglang_server_options.py (what --sglang-* names are checked against without sglang) holds
    exactly this release's launch-parser options. Regenerate: python tests/sglang_files.py --write-server-options"""
    from slime.utils.sglang_server_options import SERVER_OPTIONS

    committed = sorted(o for o, versions in SERVER_OPTIONS.items() if report["version"] in versions)
    assert committed == report["server_options"], "run: python tests/sglang_files.py --write-server-options"


def test_flush_cache_takes_a_timeout(report):
    assert "timeout" in report["flush_cache_params"]
    flush = [b for b in report["bodies"] if b["route"] == "/flush_cache"]
    assert flush and all(b["query"].startswith("timeout=") for b in flush)


def test_launch_argv_parses_back_to_what_slime_meant(report):
    for case, source in zip(report["launch"], LAUNCH_CASES):
        assert "error" not in case, f"{case['name']} (SGLang {report['version']}): {case.get('error')}"
        expected = dict(source["expect"])
        parsed = dict(case["parsed"])
        if "cuda_graph_bs" in source:  # renamed in 0.5.20: whichever the installed SGLang has carries the sizes
            graph_sizes = parsed.pop("cuda_graph_bs") or parsed.pop("cuda_graph_bs_decode")
            parsed.pop("cuda_graph_bs_decode", None)
            assert graph_sizes == source["cuda_graph_bs"], case["tokens"]
        assert parsed == expected, f"{case['name']}: {case['tokens']}"
        # the run's key reaches SGLang through its --config file, never through the command line
        assert case["key_read"] and not case["key_in_argv"], case["tokens"]
        for name in source.get("env", []):
            assert case["env"][name] == "false", name


def test_every_engine_env_name_is_read_by_sglang(report):
    """A name SGLang does not read is a setting that silently does nothing (a renamed switch)."""
    readers = report["env_readers"]
    unread = [name for name, files in readers.items() if not files]
    assert not unread, f"SGLang {report['version']} reads none of {unread} (declared in environ.py at most)"
    assert "SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK" in readers, readers


def test_engine_env_names_of_other_libraries_are_read_by_them():
    import importlib.util
    import re
    from pathlib import Path

    for name in SGLANG_ENV_DEFAULTS:
        if name.startswith(("SGLANG_", "SGL_")):
            continue
        package = next((pkg for prefix, pkg in FOREIGN_ENV_READERS.items() if name.startswith(prefix)), None)
        assert package, f"{name}: no known reader; add its library to FOREIGN_ENV_READERS"
        root = Path(importlib.util.find_spec(package).origin).parent
        pattern = re.compile(rf"(?<![A-Z0-9_]){name}(?![A-Z0-9_])")
        assert any(pattern.search(p.read_text(errors="replace")) for p in root.rglob("*.py")), f"{package} never reads {name}"


def test_generate_bodies_pass_sglangs_own_schema_gate(report):
    """The newest release ships its /generate JSON gate; it must run and refuse what SGLang refuses."""
    if _newer_than(report["version"], "0.5.23"):
        assert report["schema_gate"], f"SGLang {report['version']}: sglang/api/v1/api_types.py not found"
    if not report["schema_gate"]:
        return  # older releases: the struct checks of test_every_request_body_fits_sglangs_request_types only
    assert all(report["gate_rejects"][name] for name in GATE_CHECKS), report["gate_rejects"]
    generate = [b for b in report["bodies"] if b["route"] == "/generate"]
    assert len(generate) == 4  # the client's, a fresh, a resumed rollout sample and one with an image
    assert generate[-1]["body"]["image_data"][0].startswith("data:image/png;base64,")
    for entry in generate:
        assert entry["problems"] == [], entry["problems"]


def test_tensor_payload_round_trips_through_sglangs_decoder(report):
    payload = report["payload"]
    assert payload["load_format"] == "flattened_bucket"
    assert payload["entries"] == 2 * ENGINE_TP
    assert payload["serialize_calls"] == payload["entries"], "one serialization per engine and TP rank"
    assert payload["decoded_equal"] and payload["base64_strings"]
    assert payload["embedded_reads_sglangs"], "the embedded engine's restricted decoder reads SGLang's own bucket"


def test_embedded_engine_knows_every_sglang_generate_field(report):
    """Each GenerateReqInput field is honoured, without effect here, or refused unless neutral: none slips by."""
    unclassified = set(report["generate_fields"]) - generate_request.KNOWN_KEYS
    assert not unclassified, f"SGLang {report['version']} /generate fields the embedded engine does not classify"
    assert generate_request.HONOURED_KEYS <= set(report["generate_fields"])


def test_embedded_sampling_params_are_sglangs(report):
    honoured = set(SamplingParams.__dataclass_fields__)
    assert honoured <= set(report["sampling_fields"]), honoured - set(report["sampling_fields"])


def test_progress_watch_reads_sglangs_loads(report):
    """GET /v1/loads as SGLang's own snapshot class writes it: the requests a DP rank holds, and every work counter
    the release sets is one the watch compares (a change in it alone is progress)."""
    from slime.ray.engines.progress import WORK_FIELDS, parse_loads

    loads = report["loads"]
    assert loads["mounted"], f"SGLang {report['version']} serves no GET /v1/loads"
    assert "num_used_tokens" in loads["set"]
    if _newer_than(report["version"], "0.5.23"):
        assert {"decode_moments", "total_prefill_uncached_tokens"} <= set(loads["set"])
    entry = loads["entry"]
    (dp_rank, load), = parse_loads({"loads": [entry]}).items()
    assert (dp_rank, load.held) == (1, 5)
    counters = set(loads["set"]) & set(WORK_FIELDS)
    for name in counters:
        value = entry[name]
        moved = {**entry, name: [*value[:-1], value[-1] + 1] if isinstance(value, list) else value + 1}
        assert parse_loads({"loads": [moved]})[1].work != load.work, name


def test_embedded_engine_serves_sglangs_loads_fields(report):
    """The embedded engine's /v1/loads entry holds SGLang's fields only (the newest release's), with the ones the
    progress watch needs."""
    import types as _types

    from slime.backends.embedded_engine.scheduler import BatchScheduler

    scheduler = BatchScheduler(_types.SimpleNamespace(), max_batch_size=4)
    served = set(scheduler.load())
    assert {"dp_rank", "num_running_reqs", "num_waiting_reqs", "num_used_tokens"} <= served
    if _newer_than(report["version"], "0.5.23"):
        assert served <= set(report["loads"]["entry"]), served - set(report["loads"]["entry"])

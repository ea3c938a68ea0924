"""The embedded engine behind SGLang's HTTP API, started as a real server process."""

from __future__ import annotations

import math
import threading
import time
import types

import pytest
import requests
import torch

from slime.backends.embedded_engine.sampling import SamplingParams, sample_next_tokens
from slime.backends.sglang_utils.http_client import EngineHTTPError, SGLangHTTPClient
from slime.backends.sglang_utils.launcher import (
    build_sglang_command,
    launch_engine,
    pick_rollout_backend,
)
from slime.backends.weight_sync.transport import encode_safetensors_payload
from slime.backends.sglang_utils.named_tensors import deserialize_named_tensors, serialize_named_tensors
from slime.backends.sglang_utils.server_args import render_server_flags
from slime.backends.sglang_utils.shared_payload import LOAD_FORMAT as SHM_FORMAT
from slime.backends.sglang_utils.shared_payload import make_run_directory, write_shared_bucket
from slime.config import defaults_namespace
from slime.utils.security import auth_headers, current_key

pytestmark = pytest.mark.timeout(300)

PROMPT = "What is 3 + 4?"


@pytest.fixture(scope="module")
def checkpoint(small_run_inputs):
    return str(small_run_inputs["checkpoint"])


@pytest.fixture(scope="module")
def engine(checkpoint, tmp_path_factory):
    args = defaults_namespace(seed=7)
    handle = launch_engine(
        "embedded", args, 0, 0, checkpoint, startup_timeout_s=120,
        log_dir=str(tmp_path_factory.mktemp("logs")),
    )
    yield handle
    handle.stop()
    assert not handle.alive()


@pytest.fixture
def client(engine):
    client = SGLangHTTPClient(engine.url)
    yield client
    client.close()


@pytest.fixture(scope="module")
def reference_model(checkpoint):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


def greedy(client, n=8, prompt=PROMPT, **extra):
    params = {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True, **extra}
    return client.generate(text=prompt, sampling_params=params, return_logprob=True)


def reference_logprobs(model, prompt_ids, output_ids):
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + output_ids])).logits.float()
    logprobs = torch.log_softmax(logits, dim=-1)[0]
    return [logprobs[len(prompt_ids) - 1 + j, tok].item() for j, tok in enumerate(output_ids)]


# ----- /generate ------------------------------------------------------------------------------
def test_generate_shapes_and_logprobs(client, engine, reference_model):
    prompt_ids = [3838, 374, 220, 18, 488, 220, 19, 30]  # "What is 3 + 4?" in Qwen's tokenizer
    out = client.generate(input_ids=prompt_ids, sampling_params={"max_new_tokens": 6}, return_logprob=True)
    meta = out["meta_info"]
    assert meta["finish_reason"]["type"] in ("length", "stop")
    assert meta["prompt_tokens"] == len(prompt_ids)
    assert meta["completion_tokens"] == len(out["output_ids"]) == len(meta["output_token_logprobs"])
    assert meta["weight_version"] == "default"
    assert [entry[1] for entry in meta["output_token_logprobs"]] == out["output_ids"]
    logprobs = [entry[0] for entry in meta["output_token_logprobs"]]
    assert all(math.isfinite(lp) and lp <= 0 for lp in logprobs)
    expected = reference_logprobs(reference_model, prompt_ids, out["output_ids"])
    assert logprobs == pytest.approx(expected, abs=1e-4)


def test_text_batch_and_n_return_lists(client):
    out = client.generate(text=["a", "b c"], sampling_params={"max_new_tokens": 3, "n": 2, "ignore_eos": True})
    assert isinstance(out, list) and len(out) == 4
    assert all(len(o["output_ids"]) == 3 and o["meta_info"]["finish_reason"]["type"] == "length" for o in out)


def test_concurrent_requests_are_batched_correctly(client, engine, reference_model):
    prompts = [[3838, 374], [9707, 1879, 0], [220]]
    results: list = [None] * len(prompts)

    def run(i):
        c = SGLangHTTPClient(engine.url)
        results[i] = c.generate(input_ids=prompts[i], sampling_params={"max_new_tokens": 5, "ignore_eos": True},
                                return_logprob=True)
        c.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for ids, out in zip(prompts, results):
        logprobs = [e[0] for e in out["meta_info"]["output_token_logprobs"]]
        assert logprobs == pytest.approx(reference_logprobs(reference_model, ids, out["output_ids"]), abs=1e-4)


def test_stop_token_ids(client):
    base = greedy(client)
    stop_token = base["output_ids"][3]
    first = base["output_ids"].index(stop_token)
    out = greedy(client, stop_token_ids=[stop_token])
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_token}
    assert out["output_ids"] == base["output_ids"][: first + 1]


def test_stop_string_trims_text(client):
    base = greedy(client, n=12)
    text = base["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    out = greedy(client, n=12, stop=[stop])
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stop not in out["text"] and text.startswith(out["text"])
    kept = greedy(client, n=12, stop=[stop], no_stop_trim=True)
    assert stop in kept["text"]


def test_bad_requests_are_clear_errors(client):
    with pytest.raises(EngineHTTPError, match="unknown sampling params"):
        client.generate(text="x", sampling_params={"max_new_tokenz": 3})
    with pytest.raises(EngineHTTPError, match="repetition_penalty"):
        client.generate(text="x", sampling_params={"repetition_penalty": 1.3})
    for key, value in (("max_new_tokens", 3.0), ("top_k", "5"), ("max_new_tokens", True)):
        with pytest.raises(EngineHTTPError, match=f"{key} must be an integer"):
            client.generate(text="x", sampling_params={key: value})


def _post_generate(engine, body: dict) -> requests.Response:
    return requests.post(engine.url + "/generate", json=body, headers=auth_headers(), timeout=60)


def test_generate_body_keys_follow_sglang(engine):
    """What the real sglang-router adds is accepted as SGLang accepts it; an SGLang feature the engine lacks
    is refused unless neutral; a key SGLang does not know is ignored."""
    base = {"input_ids": [3838, 374], "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}}
    router_keys = {"model": "tiny", "background": False, "no_logs": False, "return_bytes": False,
                   "return_entropy": False, "return_hidden_states": False}
    plain = _post_generate(engine, base)
    routed = _post_generate(engine, {**base, **router_keys, "not_an_sglang_field": 1})
    assert plain.status_code == routed.status_code == 200, routed.text
    assert routed.json()["output_ids"] == plain.json()["output_ids"]
    for key, value in (("return_hidden_states", True), ("stream", True), ("top_logprobs_num", 3),
                       ("lora_path", "adapter")):
        refused = _post_generate(engine, {**base, key: value})
        assert refused.status_code == 400 and key in refused.text, (key, refused.text)


def test_input_token_logprobs_when_asked(client, reference_model):
    prompt_ids = [3838, 374, 220, 18, 488]
    out = client.generate(input_ids=prompt_ids, sampling_params={"max_new_tokens": 2, "temperature": 0.0},
                          return_logprob=True, logprob_start_len=1)
    entries = out["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in entries] == prompt_ids[1:]
    with torch.no_grad():
        logits = reference_model(torch.tensor([prompt_ids])).logits.float()
    expected = torch.log_softmax(logits, -1)[0, :-1].gather(1, torch.tensor(prompt_ids[1:]).unsqueeze(1)).squeeze(1)
    assert [e[0] for e in entries] == pytest.approx(expected.tolist(), abs=1e-4)
    whole = client.generate(input_ids=prompt_ids, sampling_params={"max_new_tokens": 1}, return_logprob=True,
                            logprob_start_len=0)["meta_info"]["input_token_logprobs"]
    assert whole[0] == [None, prompt_ids[0], None] and len(whole) == len(prompt_ids)
    default = client.generate(input_ids=prompt_ids, sampling_params={"max_new_tokens": 1}, return_logprob=True)
    assert default["meta_info"]["input_token_logprobs"] == []  # SGLang's default (-1): output tokens only
    with pytest.raises(EngineHTTPError, match="logprob_start_len"):
        client.generate(input_ids=prompt_ids, sampling_params={"max_new_tokens": 1}, return_logprob=True,
                        logprob_start_len=len(prompt_ids))


# ----- control endpoints ----------------------------------------------------------------------
def test_health_info_flush(client, engine):
    assert client.health()
    client.health_generate()
    client.flush_cache()
    assert requests.post(engine.url + "/flush_cache", headers=auth_headers(), timeout=10).status_code == 200
    # SGLang: no flush while a request runs, unless ?timeout= lets it wait for the scheduler to go idle.
    running = threading.Thread(target=lambda: greedy(SGLangHTTPClient(engine.url), n=3000))
    running.start()
    time.sleep(0.5)
    busy = requests.post(engine.url + "/flush_cache", headers=auth_headers(), timeout=10)
    assert busy.status_code == 400, busy.text
    waiting = requests.post(engine.url + "/flush_cache?timeout=0.5", headers=auth_headers(), timeout=10)
    assert waiting.status_code == 400, waiting.text  # still running after waiting 0.5 s
    client.abort_all()
    assert requests.post(engine.url + "/flush_cache?timeout=60", headers=auth_headers(), timeout=70).status_code == 200
    running.join(timeout=30)
    assert not running.is_alive()
    info = client.model_info()
    assert info["is_generation"] and info["model_type"] == "qwen3"
    assert requests.get(engine.url + "/get_weight_version", headers=auth_headers(), timeout=10).json()["weight_version"] == info["weight_version"]


def test_pause_holds_requests_until_continue(client, engine):
    client.pause_generation(mode="in_place")
    start = time.monotonic()
    assert client.health() and time.monotonic() - start < 1.0  # alive at once while paused (routers probe it)
    result = {}
    worker = threading.Thread(target=lambda: result.update(out=greedy(SGLangHTTPClient(engine.url), n=2)))
    worker.start()
    worker.join(timeout=1.5)
    assert worker.is_alive(), "a request completed while generation was paused"
    client.continue_generation()
    worker.join(timeout=60)
    assert not worker.is_alive() and len(result["out"]["output_ids"]) == 2


def test_pause_abort_mode_aborts_running_request(client, engine):
    result = {}
    long_request = threading.Thread(target=lambda: result.update(out=greedy(SGLangHTTPClient(engine.url), n=3000)))
    long_request.start()
    time.sleep(1.0)
    client.pause_generation(mode="abort")
    long_request.join(timeout=60)
    client.continue_generation()
    out = result["out"]
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(out["output_ids"]) < 3000
    assert len(greedy(client, n=2)["output_ids"]) == 2  # serving again after continue


def test_release_and_resume_memory(client):
    before = greedy(client)
    client.release_memory_occupation()  # no tags: every tag, as SGLang
    assert client.model_info()["released_tags"] == ["cuda_graph", "kv_cache", "weights"]
    with pytest.raises(EngineHTTPError, match="resume_memory_occupation") as err:
        greedy(client)
    assert err.value.status == 503
    assert client.health()  # alive while released
    client.resume_memory_occupation(["weights"])
    client.resume_memory_occupation(["kv_cache"])
    with pytest.raises(EngineHTTPError, match="cuda_graph"):  # a tag left released is a clear error
        greedy(client)
    client.resume_memory_occupation(["cuda_graph"])
    assert greedy(client)["output_ids"] == before["output_ids"]
    client.release_memory_occupation()
    client.resume_memory_occupation(["weights"])
    client.resume_memory_occupation(None)  # the loop's second step: every tag still released
    assert client.model_info()["released_tags"] == []


def push(client, named, version, load_format=SHM_FORMAT):
    """One session-wrapped push, as the weight sync does it (shared buckets in the run's own directory)."""
    assert client.begin_weight_update()
    try:
        if load_format == SHM_FORMAT:
            shared = write_shared_bucket(named, make_run_directory(current_key()), f"test-push-{time.time_ns()}")
            try:
                return client.update_weights_from_serialized([shared.descriptor], weight_version=version,
                                                             load_format=SHM_FORMAT)
            finally:
                shared.remove()
        payload = encode_safetensors_payload(named)
        return client.update_weights_from_serialized(list(payload.serialized_per_tp_rank), weight_version=version,
                                                     load_format=payload.load_format)
    finally:
        client.end_weight_update()


def test_weight_update_needs_a_session_and_a_known_format(client, reference_model):
    named = [("lm_head.weight", reference_model.state_dict()["lm_head.weight"].clone())]
    payload = encode_safetensors_payload(named)
    with pytest.raises(EngineHTTPError, match="begin_weight_update") as err:
        client.update_weights_from_serialized(list(payload.serialized_per_tp_rank), load_format=payload.load_format)
    assert err.value.status == 400
    assert client.begin_weight_update()
    try:
        with pytest.raises(EngineHTTPError, match="default pickled format"):
            client.update_weights_from_serialized(list(payload.serialized_per_tp_rank), load_format=None)
        with pytest.raises(EngineHTTPError, match="flattened-bucket payload") as err:
            client.update_weights_from_serialized(list(payload.serialized_per_tp_rank), load_format="flattened_bucket")
        assert err.value.status == 400
    finally:
        client.end_weight_update()
    with pytest.raises(EngineHTTPError, match="No weight update session"):
        client.end_weight_update()


class _RunsCommand:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


def test_flattened_bucket_is_read_through_the_restricted_unpickler(client, reference_model, tmp_path):
    """SGLang's colocated format: a pickle naming os.system is refused unrun; a bucket of tensors is loaded."""
    import base64
    import pickle

    import torch.multiprocessing as mp

    from slime.backends.sglang_utils.flattened_bucket import encode_ipc_payload

    marker = tmp_path / "ran"
    evil = base64.b64encode(pickle.dumps({"flattened_tensor": _RunsCommand(str(marker)), "metadata": []})).decode()
    assert client.begin_weight_update()
    try:
        with pytest.raises(EngineHTTPError, match=r"refused global (posix|os)\.system") as err:
            client.update_weights_from_serialized([evil], load_format="flattened_bucket")
        assert err.value.status == 400 and not marker.exists()
    finally:
        client.end_weight_update()
    name = "model.layers.0.mlp.down_proj.weight"
    pushed = [(name, torch.randn_like(reference_model.state_dict()[name]))]
    before = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")  # CPU storages by file name (CUDA ones travel as IPC handles)
    try:
        flat, blobs = encode_ipc_payload(pushed)
    finally:
        mp.set_sharing_strategy(before)
    assert client.begin_weight_update()
    try:
        client.update_weights_from_serialized(list(blobs), weight_version="ipc-1", load_format="flattened_bucket")
    finally:
        client.end_weight_update()
    served = torch.tensor(client.get_weights_by_name(name, truncate_size=50))
    assert torch.allclose(served, pushed[0][1].flatten()[:50], atol=1e-6)
    assert client.weight_version() == "ipc-1"
    restore = [(name, reference_model.state_dict()[name].clone())]
    push(client, restore, "restored")


def test_weight_update_changes_outputs_and_equals_pushed(client, reference_model):
    before = greedy(client)
    torch.manual_seed(0)
    pushed = [
        (name, torch.randn_like(param) * 0.5)
        for name, param in reference_model.state_dict().items()
        if name in ("lm_head.weight", "model.layers.0.mlp.down_proj.weight")
    ]
    reply = push(client, pushed, "v1")
    assert reply["success"]
    assert client.weight_version() == "v1"
    for name, tensor in pushed:
        served = client.get_weights_by_name(name, truncate_size=50)
        assert served == pytest.approx(tensor.flatten()[:50].tolist(), abs=0)
    after = greedy(client)
    assert after["meta_info"]["weight_version"] == "v1"
    assert after["output_ids"] != before["output_ids"]
    # Log-probs are those of the new weights.
    updated = type(reference_model)(reference_model.config)
    updated.load_state_dict({**reference_model.state_dict(), **dict(pushed)})
    prompt_ids = [3838, 374, 220, 18, 488, 220, 19, 30]
    expected = reference_logprobs(updated.eval(), prompt_ids, after["output_ids"])
    assert [e[0] for e in after["meta_info"]["output_token_logprobs"]] == pytest.approx(expected, abs=1e-4)


def test_bad_weight_update_is_rejected_whole(client):
    version = client.weight_version()
    bad = [("lm_head.weight", torch.zeros(2, 2)), ("no.such.param", torch.zeros(1))]
    for load_format in (SHM_FORMAT, "slime_safetensors"):
        with pytest.raises(EngineHTTPError, match="no.such.param"):
            push(client, bad, "broken", load_format=load_format)
    assert client.weight_version() == version


# ----- pure helpers --------------------------------------------------------------------------------
def test_named_tensor_round_trip_keeps_order_and_dtype():
    named = [("z.weight", torch.arange(6.0).view(2, 3)), ("a.bias", torch.tensor([1, 2], dtype=torch.int64)),
             ("m", torch.ones(3, dtype=torch.bfloat16))]
    back = deserialize_named_tensors(serialize_named_tensors(named))
    assert [n for n, _ in back] == ["z.weight", "a.bias", "m"]
    for (_, expect), (_, got) in zip(named, back):
        assert got.dtype == expect.dtype and torch.equal(got, expect)


def test_sampler_top_k_1_and_tiny_top_p_are_greedy():
    logits = torch.randn(3, 50)
    gen = torch.Generator().manual_seed(0)
    for params in (SamplingParams(top_k=1), SamplingParams(top_p=1e-6), SamplingParams(temperature=0.0)):
        tokens, logprobs = sample_next_tokens(logits, [params] * 3, gen)
        assert torch.equal(tokens, logits.argmax(-1))
        assert torch.allclose(logprobs, torch.log_softmax(logits, -1).max(-1).values)


# ----- launcher / passthrough ----------------------------------------------------------------------
def _tiny_launch_parser():
    """A stand-in with each kind of action SGLang's parser has (the real one: tests/test_sglang_contract.py)."""
    import argparse
    import json

    parser = argparse.ArgumentParser()
    parser.add_argument("--tp-size", type=int)
    parser.add_argument("--enable-memory-saver", action="store_true")
    parser.add_argument("--enable-tf32-matmul", action=argparse.BooleanOptionalAction)
    parser.add_argument("--preferred-sampling-params", type=json.loads)
    parser.add_argument("--cuda-graph-bs-decode", type=int, nargs="+")
    return parser


def test_render_server_flags_reads_back_the_same_values():
    parser = _tiny_launch_parser()
    server_args = {"tp_size": 2, "enable_memory_saver": True, "enable_tf32_matmul": False,
                   "preferred_sampling_params": {"temperature": 0.5}, "cuda_graph_bs": [1, 2, 4]}
    tokens = render_server_flags(server_args, parser)
    assert "--no-enable-tf32-matmul" in tokens and '{"temperature": 0.5}' in tokens
    parsed = vars(parser.parse_args(tokens))
    assert parsed == {"tp_size": 2, "enable_memory_saver": True, "enable_tf32_matmul": False,
                      "preferred_sampling_params": {"temperature": 0.5}, "cuda_graph_bs_decode": [1, 2, 4]}
    with pytest.raises(ValueError, match="no field 'not_a_field'"):
        render_server_flags({"not_a_field": 1}, parser)


def test_sglang_command_needs_sglangs_parser_and_keeps_the_key_out_of_argv(caplog):
    args = defaults_namespace(rollout_num_gpus_per_engine=2, num_gpus_per_node=8, seed=1, offload_rollout=True,
                              sglang_server_args={})
    cmd = build_sglang_command(args, 3, "127.0.0.1", 30001, "/m", gpu_ids=[5, 6], parser=_tiny_launch_parser_full(),
                               key_file="/private/key.yaml")
    joined = " ".join(cmd)
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    for part in ("--model-path /m", "--port 30001", "--tp-size 2", "--base-gpu-id 5", "--enable-memory-saver",
                 "--config /private/key.yaml"):  # the key travels in SGLang's config file
        assert part in joined
    assert current_key().reveal() not in joined and "--api-key" not in cmd and not caplog.records
    # a SGLang without --config: argv is all there is, and the log says so
    cmd = build_sglang_command(args, 3, "127.0.0.1", 30001, "/m", gpu_ids=[5, 6],
                               parser=_tiny_launch_parser_full(config=False), key_file="/private/key.yaml")
    assert f"--api-key {current_key().reveal()}" in " ".join(cmd)
    assert "command line (visible to local users): this SGLang has no --config" in caplog.text


def _tiny_launch_parser_full(config: bool = True):
    parser = _tiny_launch_parser()
    for flag in ("--base-gpu-id", "--random-seed"):
        parser.add_argument(flag, type=int)
    parser.add_argument("--api-key", type=str)
    if config:
        parser.add_argument("--config", type=str)
    for flag in ("--trust-remote-code", "--skip-server-warmup"):
        parser.add_argument(flag, action="store_true")
    return parser


def test_pick_rollout_backend():
    assert pick_rollout_backend(types.SimpleNamespace(rollout_backend="sglang")) == "sglang"
    expected = "sglang" if torch.cuda.is_available() else "embedded"
    if expected == "sglang":
        import importlib.util

        expected = "sglang" if importlib.util.find_spec("sglang") else "embedded"
    assert pick_rollout_backend(types.SimpleNamespace(rollout_backend="auto")) == expected
    with pytest.raises(ValueError):
        pick_rollout_backend(types.SimpleNamespace(rollout_backend="vllm"))


def test_a_seeded_request_generates_the_same_alone_batched_or_on_another_engine(checkpoint):
    """sampling_seed fixes every draw: what a request generates does not depend on its batch or engine."""
    from slime.backends.embedded_engine.engine import EmbeddedEngine, GenerationRequest

    def request(rid, ids, seed):
        params = SamplingParams.from_request({"max_new_tokens": 10, "temperature": 1.0, "sampling_seed": seed})
        return GenerationRequest(rid=rid, input_ids=tuple(ids), params=params, return_logprob=True)

    one, other = EmbeddedEngine(checkpoint, seed=1), EmbeddedEngine(checkpoint, seed=2)
    alone = one.generate_batch([request("a", [5, 6, 7], 11)])[0]
    batched = other.generate_batch([request("b", [9, 3, 4, 2, 8], 12), request("a", [5, 6, 7], 11)])[1]
    assert batched.output_ids == alone.output_ids
    assert batched.output_logprobs == pytest.approx(alone.output_logprobs, abs=1e-5)
    reseeded = one.generate_batch([request("a", [5, 6, 7], 13)])[0]
    assert reseeded.output_ids != alone.output_ids  # the seed, not the prompt, fixes the draws
    with pytest.raises(ValueError, match="sampling_seed must be an integer"):
        SamplingParams.from_request({"sampling_seed": 1.5})

"""The weight-sync proof (slime/backends/weight_sync/proof.py): the digest on every path equals its
definition; the embedded engine's /weights_checker serves a digest of every parameter and buffer in its own dtype,
in SGLang's answer shape; the proof names a tensor no push wrote, a tensor changed on the engine after its push
and engines that disagree (SGLang); pushes go out in the engine's dtype, so a delta against MiniMax-M2's bf16
routing bias is taken; LoRA on a sigmoid-router MoE pushes the bias megatron moves, and the proof holds after
every push (on the old subset it names the bias). The proof on the real push (a skipped tensor named):
tests/test_update_weight.py."""
from __future__ import annotations

import json
import struct

import pytest
import torch

from slime.backends.sglang_utils import tensor_digest
from slime.backends.sglang_utils.weight_checker import EngineChecksums, parse_checksum_response

MiB = 1024**2


def _reference(tensor: torch.Tensor) -> str:
    """The digest as tensor_digest.py defines it, word by word in Python integers."""
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    nbytes = len(data)
    data += b"\0" * (-nbytes % 4)
    words = struct.unpack(f"<{len(data) // 4}I", data)
    lanes = []
    for position_factor, offset, first, second in tensor_digest._LANES:
        total = 0
        for j, w in enumerate(words):
            x = w ^ ((j * position_factor + offset) % 2**32)
            x = x * first % 2**32
            x ^= x >> 15
            x = x * second % 2**32
            total += x ^ (x >> 13)
        lanes.append((total + nbytes * tensor_digest._LENGTH_FACTOR) % 2**64)
    return f"{str(tensor.dtype).removeprefix('torch.')}:" + "".join(f"{v:016x}" for v in lanes)


def test_the_digest_is_its_definition_on_every_path(monkeypatch):
    generator = torch.Generator().manual_seed(0)
    tensors = [torch.randn(3, 5, generator=generator), torch.randn(7, generator=generator).bfloat16(),
               torch.zeros(0), torch.arange(5, dtype=torch.int64), torch.randn(3000, generator=generator),
               torch.tensor(1.5), torch.randn(10, 10, generator=generator).t(),
               torch.randn(6, generator=generator).half()[1:]]  # odd bytes, unaligned view
    digests = tensor_digest.tensor_digests(tensors)
    assert digests == [_reference(t) for t in tensors]
    assert digests == [tensor_digest.tensor_digest(t) for t in tensors]  # whatever it is digested with
    # the device path (grouped rows: compiled on CUDA, eager elsewhere) gives the host path's sums
    flats = [(i, tensor_digest._bytes_of(t)) for i, t in enumerate(tensors)]
    assert [tensor_digest._device_lanes(flats)[i] for i in range(len(tensors))] == [
        tensor_digest._host_lanes(f) for _, f in flats]
    monkeypatch.setattr(tensor_digest, "HOST_CHUNK_WORDS", 64)  # the host path a chunk at a time
    assert tensor_digest.tensor_digests(tensors) == digests
    monkeypatch.setattr(tensor_digest, "GROUP_BYTES", 20_000)  # a tensor over it: head in place, tail padded
    big = torch.randn(7000, generator=generator)
    assert tensor_digest._device_lanes([(0, tensor_digest._bytes_of(big))])[0] == tensor_digest._host_lanes(
        tensor_digest._bytes_of(big))
    # many tensors over several groups, a large one between them (its head alone, its tail with those after it)
    mixed = [(i, tensor_digest._bytes_of(t)) for i, t in enumerate([*tensors, big, *tensors, big[1:]])]
    lanes = tensor_digest._device_lanes(mixed)
    assert [lanes[i] for i, _ in mixed] == [tensor_digest._host_lanes(f) for _, f in mixed]
    # one bit anywhere, or the same bytes as another dtype, is another digest
    flipped = big.clone()
    flipped.view(torch.int32)[4321] ^= 1 << 7
    assert tensor_digest.tensor_digest(flipped) != tensor_digest.tensor_digest(big)
    assert tensor_digest.tensor_digest(big.view(torch.int32)) != tensor_digest.tensor_digest(big)


def test_sglang_engines_are_checked_against_each_other():
    """SGLang's names and hash are its own: engines must agree with the first, GPU by GPU."""
    from slime.backends.weight_sync.proof import _against_first_engine

    def answer(checksums_by_tp, legacy=False):
        ranks = [{"checksums": c, "per_gpu_checksum": "x",
                  "parallelism_info": (lambda info: info if legacy else [info])(
                      {"role": "target", "tp_rank": tp, "tp_size": 2, "dp_rank": 0, "dp_size": 1, "pp_rank": 0,
                       "pp_size": 1, "rank": tp, "size": 2})} for tp, c in enumerate(checksums_by_tp)]
        return parse_checksum_response({"success": True, "message": "Success.", "ranks": ranks})

    same = [{"qkv_proj.weight": "a", "norm.weight": "b"}, {"qkv_proj.weight": "c", "norm.weight": "b"}]
    urls = ["http://e0", "http://e1", "http://e2"]
    assert _against_first_engine(urls, [answer(same), answer(same, legacy=True), answer(same)], "3") == []
    drifted = [same[0], {"qkv_proj.weight": "stale", "norm.weight": "b"}]
    (finding,) = _against_first_engine(urls, [answer(same), answer(same), answer(drifted)], "3")
    assert (finding.engine, finding.version) == ("http://e2", "3")
    assert finding.tensor == "qkv_proj.weight (tp, dp, pp ranks (1, 0, 0))" and "stale" in finding.problem


# ----------------------------------------------------------------------------- the embedded engine
@pytest.fixture(scope="module")
def moe_engine(tmp_path_factory):
    """A tiny DeepSeek-V3 MoE (sigmoid router: e_score_correction_bias buffers) in the embedded engine, served
    from a thread; (engine, url, checkpoint)."""
    from rollout_testing import AppThread
    from slime.backends.embedded_engine.engine import EmbeddedEngine
    from slime.backends.embedded_engine.server import build_app
    from slime.tools.tiny_checkpoint import TinyQwen3Spec, write_tiny_checkpoint
    from slime.utils.security import current_key
    from tiny_models import replace_model, save_tiny_deepseek_v3_moe

    checkpoint = write_tiny_checkpoint(tmp_path_factory.mktemp("moe") / "m", TinyQwen3Spec(alphabet="0123456789"))
    replace_model(checkpoint, save_tiny_deepseek_v3_moe)
    engine = EmbeddedEngine(str(checkpoint), dtype="bfloat16")
    server = AppThread(build_app(engine, api_key=current_key())).start()
    yield engine, f"http://127.0.0.1:{server.port}", checkpoint
    server.stop()


def _checkpoint_tensors(checkpoint) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file

    return sorted(load_file(f"{checkpoint}/model.safetensors").items())


def test_the_engine_digests_every_parameter_and_buffer_in_its_own_dtype(moe_engine):
    import requests

    from slime.backends.sglang_utils.http_client import SGLangHTTPClient
    from slime.utils.security import current_key

    engine, url, checkpoint = moe_engine
    reply = SGLangHTTPClient(url).check_weights()
    assert set(reply) == {"success", "message", "ranks", "per_engine_checksum"}  # SGLang 0.5.23's answer
    (gpu,) = reply["ranks"]
    assert gpu["parallelism_info"][0]["tp_size"] == 1 and len(gpu["per_gpu_checksum"]) == 64
    served = parse_checksum_response(reply).single
    held = _checkpoint_tensors(checkpoint)
    assert sorted(served) == [name for name, _ in held]  # every parameter and buffer, under the checkpoint's names
    biases = [name for name in served if name.endswith("e_score_correction_bias")]
    assert biases and all(served[n].startswith("float32:") for n in biases)  # kept in fp32 by transformers
    assert served["model.embed_tokens.weight"].startswith("bfloat16:")
    expected = {name: tensor_digest.tensor_digest(engine.get_weight(name)) for name, _ in held}
    assert served == expected
    headers = current_key().headers()
    refused = requests.post(url + "/weights_checker", json={"action": "snapshot"}, headers=headers, timeout=30)
    assert refused.status_code == 400 and "checksum" in refused.json()["message"]
    assert requests.post(url + "/weights_checker", json={"actoin": "checksum"}, headers=headers,
                         timeout=30).status_code == 400


def _pusher(url):
    from slime.backends.weight_sync.transport import EngineSet, TensorTransport
    from slime.backends.sglang_utils.http_client import ClientTimeouts

    engines = EngineSet((url,), ClientTimeouts(control=30, weight_update=60))
    return engines, TensorTransport(engines, "embedded", 1)


def _push(proof, engines, transport, tensors, version, on_the_way=lambda tensors: tensors):
    """One bucket as the sync sends it: digested while it goes out; `on_the_way` stands for a faulty transport."""
    engines.begin_session()
    try:
        with proof.sending(engines, tensors) as cast:
            transport.send(0, on_the_way(cast), version=version, flush_cache=True)
    finally:
        engines.end_session()


def _prove(proof, engines, version):
    return proof.run(model_chunks=[], full_push=True, exporter=False, coordinator=True, read_param=None,
                     engines=engines, group=None, version=version)


def test_the_proof_names_unwritten_and_changed_tensors(moe_engine):
    from slime.backends.weight_sync.proof import WeightProof, WeightProofError

    engine, url, checkpoint = moe_engine
    engines, transport = _pusher(url)
    proof = WeightProof("embedded", enabled=True)
    weights = [(name, tensor.float() + 0.01) for name, tensor in _checkpoint_tensors(checkpoint)]  # fp32 trainer
    try:
        # a push that leaves the routing biases (buffers) out: the engine still serves them, never written
        proof.start_sync()
        _push(proof, engines, transport, [(n, t) for n, t in weights if "correction_bias" not in n], "1")
        error = _prove(proof, engines, "1")
        assert isinstance(error, WeightProofError)
        assert f"engine {url}, tensor 'model.layers.1.mlp.gate.e_score_correction_bias', version 1: served by the " \
               "engine, but no push ever wrote it" in str(error)
        # everything, cast to what the engine holds (bf16, the biases fp32): proved
        proof.start_sync()
        _push(proof, engines, transport, weights, "2")
        assert _prove(proof, engines, "2") is None
        assert proof.take_metrics()["weight_sync/proof_tensors"] == len(weights)
        assert engine.get_weight("model.norm.weight").dtype == torch.bfloat16
        assert torch.equal(engine.get_weight("model.norm.weight"), dict(weights)["model.norm.weight"].bfloat16())
        # a tensor changed on the engine after its push is named, with the version that pushed it
        name = "model.layers.1.mlp.experts.3.up_proj.weight"
        engine.update_weights([(name, engine.get_weight(name) * 2)], None)
        proof.start_sync()
        error = _prove(proof, engines, "3")
        assert f"engine {url}, tensor {name!r}, version 2: the engine serves bfloat16:" in str(error)
        assert "1 tensor(s) differ" in str(error)
        # a push corrupted on its way (after the trainer handed it over, as corrupt_weight_push does): named
        corrupted = "model.layers.0.self_attn.o_proj.weight"
        proof.start_sync()
        _push(proof, engines, transport, weights, "4",
              on_the_way=lambda cast: [(n, t + 0.5 if n == corrupted else t) for n, t in cast])
        error = str(_prove(proof, engines, "4"))
        assert f"engine {url}, tensor {corrupted!r}, version 4: the engine serves bfloat16:" in error
        assert "1 tensor(s) differ" in error
    finally:
        engines.close()
        transport.close()


@pytest.mark.timeout(240)
def test_a_bf16_routing_bias_is_pushed_as_bf16_so_its_delta_is_taken(tmp_path):
    """MiniMax-M2's engine holds e_score_correction_bias in bf16 (transformers keeps no fp32 copy of it) while
    megatron's expert bias is fp32: pushed in the engine's dtype, a delta against it matches; pushed as fp32 (the
    old push), the engine applies the delta to its bf16-rounded copy, refuses it, and the bucket goes in full."""
    from rollout_testing import AppThread
    from slime.backends.embedded_engine.engine import EmbeddedEngine
    from slime.backends.embedded_engine.server import build_app
    from slime.backends.weight_sync.proof import WeightProof
    from slime.backends.weight_sync.factory import build_transport
    from slime.config.weight_sync import DeltaOptions
    from slime.backends.weight_sync.transport import EngineSet
    from slime.backends.sglang_utils.http_client import ClientTimeouts
    from slime.tools.tiny_checkpoint import TinyQwen3Spec, write_tiny_checkpoint
    from slime.utils.security import current_key
    from tiny_models import replace_model, save_tiny_minimax_m2

    checkpoint = write_tiny_checkpoint(tmp_path / "m", TinyQwen3Spec(alphabet="0123456789"))
    replace_model(checkpoint, save_tiny_minimax_m2)
    engine = EmbeddedEngine(str(checkpoint), dtype="bfloat16")
    server = AppThread(build_app(engine, api_key=current_key())).start()
    engines = EngineSet((f"http://127.0.0.1:{server.port}",), ClientTimeouts(control=30, weight_update=60))
    bias = "model.layers.0.block_sparse_moe.e_score_correction_bias"
    assert engine.get_weight(bias).dtype == torch.bfloat16
    # a bf16 trainer's export: bf16 weights, the expert bias in fp32
    base = [(n, t.float() if n.endswith("correction_bias") else t.bfloat16()) for n, t in _checkpoint_tensors(checkpoint)]

    def trained(step):
        generator = torch.Generator().manual_seed(step)
        return [(n, t + 1e-2 * torch.randn(t.shape, generator=generator).to(t.dtype)
                 if n.endswith("correction_bias") or n.endswith("down_proj.weight") else t) for n, t in base]

    def pushes(cast: bool) -> tuple[int, WeightProof]:
        proof = WeightProof("embedded", enabled=True)
        transport = build_transport("distributed", engines, engine_kind="embedded", engine_tp_size=1, timeout_s=60,
                                    delta=DeltaOptions("xor", "adler32"))
        try:
            for step in range(3):
                proof.start_sync()
                engines.begin_session()
                try:
                    tensors = trained(step)
                    transport.send(0, proof.prepare(engines, tensors) if cast else tensors, version=str(step),
                                   flush_cache=True)
                finally:
                    engines.end_session()
                if cast:
                    assert _prove(proof, engines, str(step)) is None
            return transport.fallbacks, proof
        finally:
            transport.close()

    try:
        assert pushes(cast=False)[0] == 2  # both deltas refused: the engine's bias is not the sender's baseline
        fallbacks, proof = pushes(cast=True)
        assert fallbacks == 0
        assert proof.take_metrics()["weight_sync/proof_tensors"] == len(base)
        assert torch.equal(engine.get_weight(bias), dict(trained(2))[bias].bfloat16())
    finally:
        engines.close()
        server.stop()


# ----------------------------------------------------------------------------- LoRA on a sigmoid-router MoE
LORA_MOE = dict(expert_tensor_parallel_size=1, calculate_per_token_loss=True, moe_router_bias_update_rate=0.05,
                enable_lora=True, lora_target_modules=["linear_proj"], lora_rank=4, lora_alpha=8.0,
                lora_dropout=0.0, lr=0.05, colocate=True, rollout_num_gpus_per_engine=1)
LORA_ROLLOUTS = 3


def _lora_moe_child(rank, world, hf_dir, data, engine_url, ledger_dir):
    """The first push full, then LoRA's subset after each of LORA_ROLLOUTS steps: every sync's metrics (or the
    error that stopped it), and after each, on rank 0, the engine's routing biases against the trainer's."""
    import datetime

    import torch.distributed as dist
    from transformers import AutoConfig

    from slime.backends.megatron_utils.train_step import train_one_step
    from slime.backends.weight_sync.sync import WeightSync
    from slime.backends.weight_sync.proof import WeightProofError
    from slime.backends.sglang_utils.http_client import SGLangHTTPClient
    from slime.distributed import CollectiveDivergenceError, Fence, Ledger, Watchdog
    from slime.models.hf_weights import export_hf_weights
    from slime.models.lora import adapted_weight_names
    from train_step_harness import build_loaded_model, layout_args, with_policy_log_probs

    args = layout_args(LORA_MOE)
    hf_config = AutoConfig.from_pretrained(hf_dir)
    model, optimizer, scheduler = build_loaded_model(args, hf_dir)
    ledger = Ledger(rank, world, ledger_dir)
    fence = Fence(dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=120)), rank=rank,
                  world_size=world, timeout_s=120.0, ledger=ledger)
    watchdog = Watchdog(120.0, ledger_dir, rank, world, ledger=ledger)
    sync = WeightSync(args, hf_config, [engine_url], engine_kind="embedded", select=adapted_weight_names(model))
    client = SGLangHTTPClient(engine_url)
    syncs, biases = [], []
    try:
        for rollout_id in range(-1, LORA_ROLLOUTS):
            if rollout_id >= 0:
                step_data, plan, _ = with_policy_log_probs(model, data, args)
                train_one_step(model, optimizer, scheduler, step_data, plan, args)
            try:
                syncs.append(sync.sync(model, rollout_id, fence=fence, watchdog=watchdog))
            except (WeightProofError, CollectiveDivergenceError) as exc:
                syncs.append(f"{type(exc).__name__}: {exc}")
                break
            trainer = {n: t.clone() for n, t in export_hf_weights(model, hf_config, mtp=False,
                                                                   select=lambda n: n.endswith("expert_bias"))}
            if rank == 0:
                biases.append({n: (t, torch.tensor(client.get_weights_by_name(n, t.numel()))) for n, t in trainer.items()})
    finally:
        watchdog.close()
        ledger.close()
        sync.close()
        client.close()
    return dict(syncs=syncs, biases=biases)


@pytest.mark.ranks
@pytest.mark.timeout(240)
def test_lora_on_a_sigmoid_router_moe_keeps_the_engines_routing_bias_the_trainers(moe_engine, tmp_path):
    """A forked trainer rank (the weight sync's fences and proof as in a run) pushes to the bf16 engine, which
    keeps DeepSeek-V3's routing bias in fp32: the engine's bias equals the trainer's bit for bit."""
    from mp_utils import run_ranks
    from train_step_harness import make_rollout

    _, url, checkpoint = moe_engine
    vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    data = make_rollout(num_samples=4, seed=2, vocab=vocab, max_len=20)
    (rank0,) = run_ranks(_lora_moe_child, 1, args=(str(checkpoint), data, url, str(tmp_path)), timeout_s=220)
    syncs = rank0["syncs"]
    assert all(isinstance(m, dict) for m in syncs), syncs[-1]  # the old subset: the proof names
    assert len(syncs) == LORA_ROLLOUTS + 1  # the bias it left out (changed on the trainer, not pushed)
    first, later = syncs[0], syncs[1:]
    assert all(m["weight_sync/bytes"] < first["weight_sync/bytes"] for m in later)  # LoRA's subset after the first
    # every sync the proof compared every tensor the engine serves, expert biases included
    assert {m["weight_sync/proof_tensors"] for m in syncs} == {first["weight_sync/proof_tensors"]}
    assert first["weight_sync/proof_tensors"] > 0
    for after in rank0["biases"]:  # the engine's routing bias is the trainer's after every push, bit for bit
        assert after and all(torch.equal(trainer, engine) for trainer, engine in after.values())
    name = sorted(rank0["biases"][0])[0]
    moved = [after[name][0] for after in rank0["biases"]]
    assert all(not torch.equal(a, b) for a, b in zip(moved, moved[1:]))  # and megatron moved it every step


def test_upstreams_weight_equality_flag_asks_for_the_proof_and_contradicts_turning_it_off(capsys):
    from slime.config.parse import parse_args

    base = ["--rollout-batch-size", "2", "--num-rollout", "1", "--actor-num-gpus-per-node", "1",
            "--train-backend-device", "cpu", "--check-weight-update-equal"]
    assert parse_args(base).weight_sync_proof
    with pytest.raises(SystemExit) as exit_info:
        parse_args([*base, "--no-weight-sync-proof"])
    assert exit_info.value.code == 2 and "--no-weight-sync-proof turns off" in capsys.readouterr().err


@pytest.mark.timeout(240)
def test_a_text_only_run_of_a_vision_checkpoint_proves_the_tower_against_the_checkpoint(tmp_path):
    """A vision + text checkpoint trained on text: the engine serves the composite class, tower included, and the
    trainer never builds nor pushes the tower. The proof compares the engine's tower with --hf-checkpoint's (in
    the engine's dtype) and names a tower tensor that differs, saying why the trainer does not own it; told
    nothing (the old proof), it stops every such run at the first push."""
    from types import SimpleNamespace

    import transformers

    from rollout_testing import AppThread
    from slime.backends.embedded_engine.engine import EmbeddedEngine
    from slime.backends.embedded_engine.server import build_app
    from slime.backends.weight_sync.proof import WeightProof
    from slime.backends.weight_sync.sync import carried_by_engines
    from slime.models.hf_weights import untrained_tensor_names
    from slime.models.registry import language_model_config
    from slime.utils.security import current_key
    from tiny_models import save_tiny_qwen3_5_vl

    checkpoint = save_tiny_qwen3_5_vl(str(tmp_path / "vl"))
    text_only = language_model_config(transformers.AutoConfig.from_pretrained(checkpoint))
    held = _checkpoint_tensors(checkpoint)
    tower = set(untrained_tensor_names([n for n, _ in held], text_only))
    assert tower and all(name.startswith("model.visual.") for name in tower)
    weights = [(name, tensor.float() + 0.01) for name, tensor in held if name not in tower]  # the trained text model
    engine = EmbeddedEngine(checkpoint, dtype="bfloat16")
    assert engine.vision is not None  # the composite class, tower served
    server = AppThread(build_app(engine, api_key=current_key())).start()
    engines, transport = _pusher(f"http://127.0.0.1:{server.port}")
    try:
        told_nothing = WeightProof("embedded", enabled=True)
        told_nothing.start_sync()
        _push(told_nothing, engines, transport, weights, "1")
        assert "served by the engine, but no push ever wrote it" in str(_prove(told_nothing, engines, "1"))
        carried = carried_by_engines(SimpleNamespace(hf_checkpoint=checkpoint), text_only)
        proof = WeightProof("embedded", enabled=True, carried=carried)
        proof.start_sync()
        _push(proof, engines, transport, weights, "2")
        assert _prove(proof, engines, "2") is None
        assert proof.take_metrics()["weight_sync/proof_tensors"] == len(held)  # the tower's compared too
        name = sorted(tower)[0]
        engine.update_weights([(name, engine.get_weight(name) + 1)], None)
        proof.start_sync()
        error = str(_prove(proof, engines, "3"))
        assert f"tensor {name!r}, version loaded: the engine serves bfloat16:" in error and "1 tensor(s)" in error
        assert "the trainer does not build it" in error
    finally:
        engines.close()
        transport.close()
        server.stop()


# ----------------------------------------------------------------------------- the proof's concurrency
class _StandInEngines:
    """EngineSet's surface the proof reads, over stand-in clients (each: base_url, timeouts, check_weights)."""

    def __init__(self, clients):
        from concurrent.futures import ThreadPoolExecutor

        self.clients = clients
        self.urls = tuple(c.base_url for c in clients)
        self._pool = ThreadPoolExecutor(max_workers=len(clients))

    def submit_each(self, call, clients=None):
        return [self._pool.submit(call, c) for c in (self.clients if clients is None else clients)]

    def each(self, call, clients=None):
        return [f.result() for f in self.submit_each(call, clients)]

    def close(self):
        self._pool.shutdown(wait=False)


class _StandInClient:
    """An engine serving `served`; `answer`, if given, replaces its answers after the first (the sender's question
    for its dtypes)."""

    def __init__(self, url, served, *, deadline_s=10.0, answer=None):
        from slime.backends.sglang_utils.http_client import ClientTimeouts

        self.base_url, self.served, self.answer = url, served, answer
        self.timeouts = ClientTimeouts(weight_update=deadline_s)
        self.asked = 0

    def check_weights(self):
        from slime.backends.sglang_utils.weight_checker import checksum_response

        self.asked += 1
        if self.answer is not None and self.asked > 1:
            return self.answer()
        return checksum_response({n: tensor_digest.tensor_digest(t) for n, t in self.served.items()})


def test_a_bucket_is_digested_while_it_is_sent_and_let_go_only_once_digested(monkeypatch):
    """The sender's digests run while the bucket goes out (the digest waits for the send to have begun: inline, it
    would never start) and the block ends only once they are taken, so the next export may reuse the bucket's
    memory: a tensor changed after the block does not change what the proof compares. A digest that fails ends
    the block with its error (the push fails at its fence); the send's own error comes first."""
    import threading
    import time

    from slime.backends.weight_sync import proof as proof_module

    tensors = [("a", torch.arange(6, dtype=torch.float32)), ("b", torch.ones(3, dtype=torch.float32))]
    engines = _StandInEngines([_StandInClient("http://e0", dict(tensors))])
    sending_began = threading.Event()
    real = proof_module.tensor_digests

    def digests_once_sending(batch):
        if not sending_began.wait(10):
            raise AssertionError("the digests ran before the bucket was sent, not while")
        time.sleep(0.2)  # a slow digest: the block must wait for it
        return real(batch)

    monkeypatch.setattr(proof_module, "tensor_digests", digests_once_sending)
    proof = proof_module.WeightProof("embedded", enabled=True)
    try:
        proof.start_sync()
        expected = {n: tensor_digest.tensor_digest(t) for n, t in tensors}
        with proof.sending(engines, tensors) as cast:
            assert [n for n, _ in cast] == ["a", "b"]
            sending_began.set()
        tensors[0][1].add_(1)  # the next export reuses the memory
        assert {n: next(iter(d.values())) for n, d in proof._pushed.digests.items()} == expected
        assert _prove(proof, engines, "1") is not None  # the engine now serves what was not pushed

        def broken(batch):
            raise RuntimeError("digest kernel failed")

        monkeypatch.setattr(proof_module, "tensor_digests", broken)
        with pytest.raises(RuntimeError, match="digest kernel failed"):
            with proof.sending(engines, tensors):
                pass
        with pytest.raises(ConnectionError, match="send failed"):  # the send's error, not the digest's
            with proof.sending(engines, tensors):
                raise ConnectionError("send failed")
    finally:
        proof.close()
        engines.close()


def test_every_engine_is_asked_at_once_and_each_late_or_failing_one_is_named():
    """The coordinator asks every engine as the proof begins, before its own checks and the gather, and awaits
    them against one deadline: an engine that does not answer in time and one that fails are both named (not
    only the first), with the version; an engine that answers is not."""
    import threading

    from slime.backends.weight_sync.proof import WeightProof, WeightProofError

    tensors = {"w": torch.arange(4, dtype=torch.float32)}
    release, late_asked = threading.Event(), threading.Event()

    def late():
        late_asked.set()
        release.wait(30)
        raise RuntimeError("answered after the proof gave up")

    def failing():
        raise ConnectionError("connection refused")

    clients = [_StandInClient("http://ok", tensors, deadline_s=0.5),
               _StandInClient("http://late", tensors, deadline_s=0.5, answer=late),
               _StandInClient("http://failing", tensors, deadline_s=0.5, answer=failing)]
    engines = _StandInEngines(clients)
    proof = WeightProof("embedded", enabled=True, subset=lambda name: True)
    asked_before_own_checks = []  # the rank's own checks find the engines already asked
    proof._check_left_out = lambda *a: asked_before_own_checks.append(late_asked.wait(10))
    try:
        proof.start_sync()
        proof.prepare(engines, list(tensors.items()))
        error = proof.run(model_chunks=[], full_push=True, exporter=True, coordinator=True, read_param=None,
                          engines=engines, group=None, version="7")
        assert isinstance(error, WeightProofError)
        message = str(error)
        assert "after the push of version 7: 2 engine(s) did not report what they serve" in message
        assert "engine http://late: no answer within 0.5s" in message
        assert "engine http://failing: ConnectionError: connection refused" in message
        assert "http://ok" not in message
    finally:
        release.set()
        proof.close()
        engines.close()
    assert asked_before_own_checks == [True]

"""Delta weight pushes (--update-weight-mode delta): the encoding, its check, and pushes into a running
embedded engine over the broadcast group (gloo), compared with full pushes of the same weights."""

from __future__ import annotations

import logging

import pytest
import torch

from slime.backends.sglang_utils import weight_delta
from slime.utils import checksums

MiB = 1024**2


# ----------------------------------------------------------------------------- pure encoding
@pytest.mark.parametrize("encoding", weight_delta.ENCODINGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_delta_reproduces_the_new_tensor_bit_for_bit(encoding, dtype):
    generator = torch.Generator().manual_seed(3)
    base = torch.randn(64, 33, generator=generator).to(dtype)
    new = base.clone()
    rows = torch.randint(0, 64, (40,), generator=generator)
    new[rows, 5] += 1e-3 * torch.randn(40, generator=generator).to(dtype)
    new[0, 0] = -0.0 if base[0, 0] == 0 else float("nan")  # bit patterns, not values, are compared
    delta = weight_delta.encode(new, base, encoding, "adler32")
    changed = int((new.view(-1).view(weight_delta.value_dtype(dtype)) != base.view(-1).view(
        weight_delta.value_dtype(dtype))).sum())
    assert delta.positions.numel() == changed < new.numel()
    assert delta.nbytes == changed * (4 + new.element_size())
    applied = weight_delta.apply(base, delta.positions, delta.values, encoding)
    assert torch.equal(applied.view(weight_delta.value_dtype(dtype)), new.view(weight_delta.value_dtype(dtype)))
    assert weight_delta.digest(applied, "adler32") == delta.digest
    assert weight_delta.digest(base, "adler32") != delta.digest


def test_applying_to_other_weights_gives_another_digest():
    base = torch.arange(100, dtype=torch.float32)
    new = base.clone()
    new[7] = 0.5
    drifted = base.clone()
    drifted[50] = -1.0  # the engine's weights are not the sender's baseline
    for encoding in weight_delta.ENCODINGS:
        delta = weight_delta.encode(new, base, encoding, "adler32")
        result = weight_delta.apply(drifted, delta.positions, delta.values, encoding)
        assert weight_delta.digest(result, "adler32") != delta.digest
    twice = weight_delta.encode(new, base, "xor", "adler32")  # xor applied twice undoes itself
    once = weight_delta.apply(base, twice.positions, twice.values, "xor")
    assert torch.equal(weight_delta.apply(once, twice.positions, twice.values, "xor"), base)


def test_checksums_need_their_packages(monkeypatch):
    assert checksums.missing_package("adler32") is None
    monkeypatch.setattr(checksums.importlib.util, "find_spec", lambda name: None)
    assert checksums.missing_package("xxh3-128") == "xxhash"
    assert checksums.missing_package("blake3") == "blake3"
    with pytest.raises(ValueError, match="expected one of"):
        checksums.missing_package("md5")


# ----------------------------------------------------------------------------- flags
def _argv(tmp_path, *extra):
    (tmp_path / "hf").mkdir(exist_ok=True)
    (tmp_path / "data.jsonl").write_text("")
    return ["--hf-checkpoint", str(tmp_path / "hf"), "--prompt-data", str(tmp_path / "data.jsonl"),
            "--train-backend-device", "cpu", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1",
            "--rollout-backend", "embedded", "--rollout-batch-size", "2", "--num-rollout", "1",
            "--update-weight-mode", "delta", *extra]


def test_delta_flags_parse_and_refuse_with_the_fix(tmp_path, capsys, monkeypatch):
    from arg_testing import parse_error, parse_quiet

    args = parse_quiet(_argv(tmp_path, "--update-weight-delta-encoding", "overwrite",
                             "--update-weight-delta-checksum", "adler32"))
    assert (args.update_weight_mode, args.update_weight_delta_encoding, args.update_weight_delta_checksum) == (
        "delta", "overwrite", "adler32")
    err = parse_error(_argv(tmp_path, "--update-weight-delta-checksum", "adler32", "--colocate"), capsys)
    assert "--update-weight-mode delta is for separate engines" in err
    monkeypatch.setattr(checksums.importlib.util, "find_spec", lambda name: None)
    err = parse_error(_argv(tmp_path, "--update-weight-delta-checksum", "xxh3-128"), capsys)
    assert "needs" not in err and "without the xxhash package: pip install xxhash" in err
    err = parse_error(_argv(tmp_path, "--update-weight-delta-checksum", "crc32"), capsys)
    assert "invalid choice: 'crc32'" in err


def test_a_delta_transport_connects_its_group_in_its_stage_s_turn(monkeypatch):
    """PP stages form their weight-update groups one after another (sync.py asks the transport whether
    it is connected, connects it, and counts the engines joining): a delta push goes over the same group."""
    from slime.backends.weight_sync.delta import DeltaTransport
    from slime.backends.weight_sync.transport import DistributedTransport, EngineSet
    from slime.backends.sglang_utils.http_client import ClientTimeouts

    urls = ("http://127.0.0.1:1", "http://127.0.0.1:2")
    inner = DistributedTransport(EngineSet(urls, ClientTimeouts()), 1, backend="gloo", timeout_s=5.0, stage=1)
    delta = DeltaTransport(inner, encoding="xor", checksum="adler32")
    assert not delta.connected and delta.group_engines == urls
    monkeypatch.setattr(inner, "connect", lambda: setattr(inner, "_group", object()))
    delta.connect()
    assert delta.connected


# ----------------------------------------------------------------------------- into a running engine
from test_update_weight import checkpoint, engine  # noqa: E402, F401 (fixtures: a one-layer Qwen3 and its engine)


def _weights(checkpoint: str) -> list[tuple[str, torch.Tensor]]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    return [(name, tensor.detach().clone()) for name, tensor in model.state_dict().items()
            if name != "lm_head.weight" or not model.config.tie_word_embeddings]


def _step(weights, seed: int, fraction: float = 0.01):
    """An optimizer step's worth of change: a few positions of every tensor move."""
    generator = torch.Generator().manual_seed(seed)
    moved = []
    for name, tensor in weights:
        mask = torch.rand(tensor.shape, generator=generator) < fraction
        moved.append((name, tensor + mask * 1e-2 * torch.randn(tensor.shape, generator=generator)))
    return moved


def _push(transport, weights, version: str, bucket_bytes: int = 8 * MiB) -> int:
    buckets, size = [[]], 0
    for name, tensor in weights:
        if buckets[-1] and size + tensor.numel() * tensor.element_size() > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append((name, tensor))
        size += tensor.numel() * tensor.element_size()
    transport.engines.begin_session()
    sent = 0
    try:
        for index, bucket in enumerate(buckets):
            last = index == len(buckets) - 1
            result = transport.send(index, bucket, version=version if last else None, flush_cache=last)
            sent += result if isinstance(result, int) else sum(t.numel() * t.element_size() for _, t in bucket)
    finally:
        transport.engines.end_session()
    return sent


def _served(client, weights, probe: int = 4096) -> dict[str, torch.Tensor]:
    return {name: torch.tensor(client.get_weights_by_name(name, probe), dtype=torch.float32) for name, _ in weights}


def _logprobs(client) -> list[float]:
    reply = client.generate(input_ids=[1, 2, 3, 4, 5], sampling_params={"max_new_tokens": 4, "temperature": 0.0},
                            return_logprob=True, logprob_start_len=0)
    return [entry[0] for entry in reply["meta_info"]["input_token_logprobs"][1:]] + [
        entry[0] for entry in reply["meta_info"]["output_token_logprobs"]]


@pytest.mark.timeout(240)
def test_delta_pushes_leave_the_engine_where_full_pushes_do(checkpoint, engine, caplog):
    from slime.backends.weight_sync.factory import build_transport
    from slime.config.weight_sync import DeltaOptions
    from slime.backends.weight_sync.transport import EngineSet
    from slime.backends.sglang_utils.http_client import ClientTimeouts, SGLangHTTPClient

    client = SGLangHTTPClient(engine.url)
    engines = EngineSet((engine.url,), ClientTimeouts(control=30, weight_update=60))
    base = _weights(checkpoint)
    steps = [_step(base, seed) for seed in (1, 2)]
    full = build_transport("distributed", engines, engine_kind="embedded", engine_tp_size=1, timeout_s=60)
    delta = build_transport("distributed", engines, engine_kind="embedded", engine_tp_size=1, timeout_s=60,
                            delta=DeltaOptions("xor", "adler32"))
    try:
        full_bytes = [_push(full, weights, f"{i + 1}") for i, weights in enumerate(steps)]
        expected = (_served(client, base), _logprobs(client))
        full.close()  # one weight-update group at a time on the engine
        delta_bytes = [_push(delta, base, "10")] + [_push(delta, weights, f"{11 + i}") for i, weights in
                                                    enumerate(steps)]
        assert client.weight_version() == "12"
        got = (_served(client, base), _logprobs(client))
        assert got[1] == expected[1]  # the same weights, the same log-probs, bit for bit
        assert all(torch.equal(got[0][name], expected[0][name]) for name in expected[0])
        total = sum(t.numel() * t.element_size() for _, t in base)
        assert full_bytes == [total, total] and delta_bytes[0] == total  # the first push seeds the baseline
        assert all(b < 0.1 * total for b in delta_bytes[1:]), delta_bytes  # ~1% of positions moved
        assert delta.fallbacks == 0

        # The engine's weights drift from the sender's baseline (another writer): the delta is refused by
        # its digest, nothing of it is loaded, and the bucket goes in full.
        name, tensor = base[-1]
        delta.baseline[name].view(-1)[0] += 1.0
        final = _step(steps[-1], 3)
        with caplog.at_level(logging.WARNING):
            _push(delta, final, "13")
        assert delta.fallbacks == 1 and "refused it" in caplog.text and "pushing the bucket in full" in caplog.text
        served = _served(client, final)
        assert all(torch.equal(served[n], t.reshape(-1)[:4096]) for n, t in final)
        assert client.weight_version() == "13"
    finally:
        delta.close()
        full.close()
        engines.close()
        client.close()


def test_the_weight_sync_pushes_deltas_only_to_separate_embedded_engines():
    from slime.backends.weight_sync.delta import DeltaTransport
    from slime.backends.weight_sync.factory import build_transport
    from slime.config.weight_sync import DeltaOptions
    from slime.backends.weight_sync.sync import WeightSync
    from slime.backends.weight_sync.transport import EngineSet
    from slime.config import defaults_namespace

    args = defaults_namespace(colocate=False, update_weight_mode="delta", update_weight_delta_checksum="adler32",
                              rollout_num_gpus_per_engine=1)
    sync = WeightSync(args, None, ["http://127.0.0.1:1"], engine_kind="embedded")
    transport = sync.transport(torch.device("cpu"), 0)
    assert isinstance(transport, DeltaTransport) and (transport.encoding, transport.checksum) == ("xor", "adler32")
    sync.close()
    engines = EngineSet(("http://127.0.0.1:1",), None)
    with pytest.raises(ValueError, match="for separate engines"):
        build_transport("tensor", engines, engine_kind="embedded", engine_tp_size=1, timeout_s=1,
                        delta=DeltaOptions("xor", "adler32"))
    with pytest.raises(ValueError, match="SGLang engines take full pushes"):
        build_transport("distributed", engines, engine_kind="sglang", engine_tp_size=1, timeout_s=1,
                        delta=DeltaOptions("xor", "adler32"))
    engines.close()

"""The restricted unpickler of tensor payloads and SGLang's flattened bucket read through it (CPU).

CUDA-IPC decoding itself needs a GPU (benchmarks/bench_weight_sync.py --device cuda checks it there);
here CPU tensors shared by file name take the same path through the same allowlist.
"""
from __future__ import annotations

import base64
import io
import os
import pickle
import sys
import types
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
import torch.multiprocessing as mp

from slime.backends.sglang_utils import flattened_bucket
from slime.backends.sglang_utils.flattened_bucket import BucketPayloadError, decode_payload, encode_ipc_payload
from slime.utils.tensor_unpickler import RefusedGlobalError, restricted_loads

pytestmark = pytest.mark.timeout(120)

NAMED = [("model.embed_tokens.weight", torch.randn(6, 4)), ("model.norm.weight", torch.rand(4).to(torch.bfloat16)),
         ("steps", torch.arange(3, dtype=torch.int64)), ("flag", torch.tensor(True))]


@pytest.fixture
def shared_by_file_name():
    """CPU storages shared by file name (CUDA tensors need no such setting: they travel as IPC handles)."""
    before = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")
    yield
    mp.set_sharing_strategy(before)


class _RunsCommand:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _blob(obj) -> str:
    return base64.b64encode(pickle.dumps(obj)).decode()


def test_a_pickle_naming_os_system_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    data = pickle.dumps({"flattened_tensor": _RunsCommand(str(marker)), "metadata": []})
    with pytest.raises(RefusedGlobalError, match=r"refused global (posix|os)\.system"):
        restricted_loads(data)
    with pytest.raises(RefusedGlobalError):  # through the payload reader, as the engine calls it
        decode_payload(base64.b64encode(data).decode())
    assert not marker.exists()


@pytest.mark.parametrize("obj", [eval, getattr, __import__, io.FileIO, types.SimpleNamespace])
def test_builtins_and_other_classes_are_refused(obj):
    with pytest.raises(RefusedGlobalError, match="refused global"):
        restricted_loads(pickle.dumps(obj))


def test_a_plain_tensor_pickle_is_refused_it_would_nest_a_torch_load():
    with pytest.raises(RefusedGlobalError, match="_rebuild_tensor_v2.*ForkingPickler"):
        restricted_loads(pickle.dumps(torch.zeros(2)))


def test_storages_shared_by_file_descriptor_are_refused_with_the_fix():
    assert mp.get_sharing_strategy() == "file_descriptor"  # torch's Linux default
    _, blobs = encode_ipc_payload(NAMED)
    with pytest.raises(RefusedGlobalError, match="file_system"):
        decode_payload(blobs[0])


def test_the_trainers_payload_of_cpu_tensors_is_admitted(shared_by_file_name):
    flat, blobs = encode_ipc_payload(NAMED, consumers=2)
    assert len(blobs) == 2, "one serialization per consumer"
    for blob in blobs:
        decoded = decode_payload(blob)
        assert [n for n, _ in decoded] == [n for n, _ in NAMED]
        for (_, got), (_, sent) in zip(decoded, NAMED):
            assert got.dtype == sent.dtype and got.shape == sent.shape and torch.equal(got, sent)
    flat.zero_()  # views of the shared flat bucket, not copies
    assert not decoded[0][1].any()


def test_sglangs_own_metadata_class_is_read_as_a_bucket_entry(shared_by_file_name, monkeypatch):
    """A payload pickled with SGLang's FlattenedTensorMetadata (stood in here by a class of its module path)."""
    module = types.ModuleType("sglang.srt.weight_sync.tensor_bucket")

    @dataclass
    class FlattenedTensorMetadata:
        name: str
        shape: torch.Size
        dtype: torch.dtype
        start_idx: int
        end_idx: int
        numel: int

    FlattenedTensorMetadata.__module__ = module.__name__
    FlattenedTensorMetadata.__qualname__ = "FlattenedTensorMetadata"
    module.FlattenedTensorMetadata = FlattenedTensorMetadata
    for name in ("sglang", "sglang.srt", "sglang.srt.weight_sync"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, module.__name__, module)
    flat, entries = flattened_bucket.flatten(NAMED)
    theirs = [FlattenedTensorMetadata(**vars(e)) for e in entries]
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump({"flattened_tensor": flat, "metadata": theirs})
    assert b"sglang.srt.weight_sync.tensor_bucket" in buffer.getvalue()
    monkeypatch.delitem(sys.modules, module.__name__)  # the engine has no SGLang
    decoded = decode_payload(base64.b64encode(buffer.getvalue()).decode())
    assert all(torch.equal(got, sent) for (_, got), (_, sent) in zip(decoded, NAMED))


def test_entries_are_checked_against_the_bucket(shared_by_file_name):
    flat, entries = flattened_bucket.flatten(NAMED)
    entries[0].end_idx += 4  # claims bytes past its tensor
    with pytest.raises(BucketPayloadError, match="do not hold"):
        decode_payload(flattened_bucket.serialize(flat, entries))
    bad = flattened_bucket.BucketEntry.__new__(flattened_bucket.BucketEntry)
    with pytest.raises(BucketPayloadError, match="exactly the fields"):
        bad.__setstate__({"name": "x", "shape": (1,), "dtype": torch.float32, "start_idx": 0, "end_idx": 4,
                          "numel": 4, "extra": 1})
    with pytest.raises(BucketPayloadError, match="wrong type"):
        bad.__setstate__({"name": "x", "shape": ("1",), "dtype": torch.float32, "start_idx": 0, "end_idx": 4,
                          "numel": 4})
    with pytest.raises(BucketPayloadError, match="dict of"):
        decode_payload(_blob([1, 2]))
    with pytest.raises(BucketPayloadError, match="base64"):
        decode_payload("not base64!")

"""Checks the project against SGLang's own files; run as a subprocess (tests/test_sglang_contract.py).

    PYTHONPATH=<unpacked sglang>:<repo> python tests/sglang_probe.py < request.json > report.json

SGLang does not import on this CPU machine as a whole (CUDA kernels, ~16 missing packages), so a
meta-path hook hands modules imported *from SGLang's files* that are missing here a permissive stub,
and an SGLang module that fails to execute becomes a stub past the point where it failed. What the
checks use is SGLang's real code: its request structs (io_struct.py), its SamplingParams, its
ServerArgs launch parser, its route table (http_server.py, read as text), its tensor serializer and
its flattened-bucket decoder. Stubs stay inside this process.

The request holds the bodies the project sends (recorded by the test from the real client code);
the launch argv and the tensor payload are produced here, by the project's code, against SGLang's.
"""
from __future__ import annotations

import argparse
import ast
import base64
import dataclasses
import importlib
import importlib.abc
import importlib.machinery
import json
import re
import sys
import types
from pathlib import Path
from typing import Any


# ----------------------------------------------------------------------------- import stubs
class _StubMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _StubMeta(name, (_Stub,), {})

    def __or__(cls, other):
        return cls

    def __ror__(cls, other):
        return cls

    def __getitem__(cls, item):
        return cls


class _Stub(metaclass=_StubMeta):
    """Anything: callable, subclassable, every attribute another stub."""

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return _Stub()

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Stub()


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _StubMeta(name, (_Stub,), {})


STUBBED: list[str] = []
FAILED: list[str] = []


def _imported_from_sglang() -> bool:
    frame = sys._getframe(2)
    while frame and ("importlib" in frame.f_code.co_filename or frame.f_code.co_filename.startswith("<")):
        frame = frame.f_back
    return bool(frame) and "/sglang/" in frame.f_code.co_filename


class _TolerantLoader(importlib.abc.Loader):
    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        try:
            self.inner.exec_module(module)
        except Exception as exc:  # noqa: BLE001 - e.g. a CUDA-only module: keep what it defined, stub the rest
            FAILED.append(f"{module.__name__}: {type(exc).__name__}")
            module.__class__ = _StubModule


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = finder.find_spec(name, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None:
                if name.split(".")[0] == "sglang" and spec.loader is not None:
                    spec.loader = _TolerantLoader(spec.loader)
                return spec
        if name.split(".")[0] == "sglang" or not _imported_from_sglang():
            return None
        STUBBED.append(name)
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())
sys.modules.setdefault("pybase64", base64)  # pybase64 is a faster drop-in of the stdlib module; SGLang encodes with it


# ----------------------------------------------------------------------------- SGLang's surface
def sglang_dir() -> Path:
    import sglang

    return Path(sglang.__file__).parent


def routes() -> dict[str, list[str]]:
    """Every HTTP route of SGLang's server and its methods, read from http_server.py's decorators."""
    tree = ast.parse((sglang_dir() / "srt/entrypoints/http_server.py").read_text())
    found: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.AsyncFunctionDef | ast.FunctionDef):
            continue
        for deco in node.decorator_list:
            if not (isinstance(deco, ast.Call) and isinstance(deco.func, ast.Attribute) and deco.args):
                continue
            if not isinstance(deco.args[0], ast.Constant) or not str(deco.args[0].value).startswith("/"):
                continue
            method = deco.func.attr
            if method == "api_route":
                methods = next((ast.literal_eval(k.value) for k in deco.keywords if k.arg == "methods"), ["GET"])
            elif method in ("get", "post", "put", "delete"):
                methods = [method.upper()]
            else:
                continue
            found.setdefault(deco.args[0].value, set()).update(methods)
    return {path: sorted(m) for path, m in found.items()}


def route_params(function: str) -> list[str]:
    tree = ast.parse((sglang_dir() / "srt/entrypoints/http_server.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.AsyncFunctionDef | ast.FunctionDef) and node.name == function:
            return [a.arg for a in node.args.args]
    return []


def struct_problems(cls, body: dict[str, Any]) -> list[str]:
    """What SGLang's struct would refuse or drop in `body`: unknown keys, missing required fields, bad types."""
    import msgspec

    fields = {f.name: f for f in msgspec.structs.fields(cls)}
    problems = [f"unknown field {k!r}" for k in body if k not in fields]
    problems += [f"missing required field {n!r}" for n, f in fields.items() if f.required and n not in body]
    for key, value in body.items():
        if key in fields:
            try:
                msgspec.convert(value, fields[key].type)
            except Exception as exc:  # noqa: BLE001 - msgspec.ValidationError or a type it cannot build
                problems.append(f"{key}={value!r:.80}: {exc}")
    return problems


def schema_gate():
    """SGLang's own /generate JSON gate (`sglang/api/v1/api_types.py`, generated from its API schema; newer
    releases only): stricter than msgspec.convert, e.g. a float in an integer field is refused."""
    path = sglang_dir() / "api/v1/api_types.py"
    if not path.is_file():
        return None
    from sglang.api.v1 import api_types

    return api_types


def gate_problems(body: dict[str, Any], gate) -> list[str]:
    try:
        gate.GenerateRequest.from_json_value(json.loads(json.dumps(body)))  # as the server sees the JSON
    except gate.JsonContractError as exc:
        return [f"SGLang's /generate schema gate: {exc}"]
    return []


def generate_problems(body: dict[str, Any], io) -> list[str]:
    import msgspec

    from sglang.srt.sampling.sampling_params import SamplingParams

    names = {f.name for f in dataclasses.fields(io.GenerateReqInput)}
    problems = [f"unknown /generate field {k!r}" for k in body if k not in names]
    params = body.get("sampling_params") or {}
    sampling = {f.name: f for f in msgspec.structs.fields(SamplingParams)}
    problems += [f"unknown sampling param {k!r}" for k in params if k not in sampling]
    for key, value in params.items():
        if key in sampling:
            try:
                msgspec.convert(value, sampling[key].type, strict=True)
            except Exception as exc:  # noqa: BLE001
                problems.append(f"sampling param {key}={value!r}: {exc}")
    gate = schema_gate()
    return problems + (gate_problems(body, gate) if gate else [])


# ----------------------------------------------------------------------------- checks
def check_bodies(bodies: list[dict[str, Any]], io) -> list[dict[str, Any]]:
    table = routes()
    report = []
    for entry in bodies:
        cls = getattr(io, entry["cls"], None) if entry["cls"] else None
        result = {**entry, "route_exists": entry["method"] in table.get(entry["route"], []),
                  "cls_exists": cls is not None or entry["cls"] is None}
        if entry["route"] == "/generate":
            result["problems"] = generate_problems(entry["body"] or {}, io)
        elif cls is not None:
            result["problems"] = struct_problems(cls, entry["body"] or {})
        else:
            result["problems"] = []
        report.append(result)
    return report


def launch_parser() -> argparse.ArgumentParser:
    from slime.utils.sglang_passthrough import server_args_parser

    parser = server_args_parser()
    if parser is None:
        raise RuntimeError(f"SGLang's ServerArgs did not load; stubbed {STUBBED[:10]}, failed {FAILED[:10]}")
    return parser


def merge_config_file(parser: argparse.ArgumentParser, tokens: list[str]) -> list[str]:
    """What SGLang's prepare_server_args makes of `--config FILE`: its own ConfigArgumentMerger's argv."""
    if "--config" not in tokens:
        return tokens
    import sglang

    package = Path(sglang.__file__).parent
    for module in ("sglang.srt.utils.server_args_config_parser", "sglang.srt.server_args_config_parser"):
        if (package.parent / (module.replace(".", "/") + ".py")).is_file():
            merger = importlib.import_module(module).ConfigArgumentMerger(parser)
            return merger.merge_config_with_args(tokens)
    raise RuntimeError("SGLang's ConfigArgumentMerger was not found")


def check_launch(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each case: slime args + --sglang-* argv -> the project's passthrough and launcher -> SGLang's parser."""
    from slime.backends.sglang_utils import launcher
    from slime.config import defaults_namespace
    from slime.config.parse import apply_sglang_server_args
    from slime.utils import sglang_passthrough
    from slime.utils.security import current_key

    parser = launch_parser()
    strict = argparse.ArgumentParser(parents=[parser], add_help=False, allow_abbrev=False, exit_on_error=False)
    report = []
    for case in cases:
        args = defaults_namespace(**case["args"])
        result: dict[str, Any] = {"name": case["name"]}
        try:
            _, passthrough = sglang_passthrough.split_passthrough(case["argv"], frozenset(case.get("declared", [])))
            apply_sglang_server_args(args, passthrough)
            nodes = launcher.EngineNodes(**case["nodes"]) if case.get("nodes") else None
            with launcher.private_key_config() as key_file:  # as launch_engine starts SGLang
                command = launcher.build_sglang_command(args, case.get("engine_rank", 0), "127.0.0.1", 30000,
                                                        "/model", case.get("gpu_ids"), nodes=nodes, key_file=key_file)
                tokens = command[3:]  # after python -m sglang.launch_server
                parsed = vars(strict.parse_args(merge_config_file(parser, tokens)))
            key = current_key().reveal()
            result.update(tokens=tokens, parsed={k: parsed.get(k) for k in case["expect"]},
                          env={k: launcher.sglang_engine_env({}).get(k) for k in case.get("env", [])},
                          key_in_argv=any(key in token for token in command), key_read=parsed.get("api_key") == key)
        except Exception as exc:  # noqa: BLE001 - reported, the test asserts on it
            result["error"] = f"{type(exc).__name__}: {exc}"
        report.append(result)
    return report


def env_readers(names: list[str]) -> dict[str, list[str]]:
    """For each name, SGLang's files that read it. environ.py only declares names (or converts deprecated
    ones), so a name found there alone is read by nobody."""
    srt = sglang_dir() / "srt"
    texts = {str(p.relative_to(srt)): p.read_text(errors="replace") for p in srt.rglob("*.py")
             if p.name != "environ.py"}
    return {name: sorted(path for path, text in texts.items() if re.search(rf"(?<![A-Z0-9_]){name}(?![A-Z0-9_])", text))
            for name in names}


def check_payload(tp_size: int) -> dict[str, Any]:
    """The project's SGLang tensor payload, decoded by SGLang's own code on CPU."""
    import msgspec
    import torch

    import sglang.srt.utils.patch_torch as patch_torch
    from sglang.srt.managers import io_struct
    from sglang.srt.utils import MultiprocessingSerializer

    patch_torch.monkey_patch_torch_reductions = lambda: None  # CUDA-only (device-uuid IPC); CPU tensors need none
    serialized_calls = []
    real_serialize = MultiprocessingSerializer.serialize

    def counting(obj, output_str=False):
        serialized_calls.append(id(obj))
        return real_serialize(obj, output_str=output_str)

    MultiprocessingSerializer.serialize = staticmethod(counting)
    from slime.backends.weight_sync.transport import encode_sglang_payload

    named = [("model.embed_tokens.weight", torch.randn(6, 4)), ("model.norm.weight", torch.rand(4).to(torch.bfloat16)),
             ("lm_head.weight", torch.randn(6, 4))]
    engines = [encode_sglang_payload(named, tp_size) for _ in range(2)]
    blobs = [blob for payload in engines for blob in payload.serialized_per_tp_rank]
    field = {f.name: f for f in msgspec.structs.fields(io_struct.UpdateWeightsFromTensorReqInput)}
    raw = msgspec.convert(blobs, field["serialized_named_tensors"].type)  # as SGLang's HTTP layer decodes JSON
    decoded = [_decode_flattened(MultiprocessingSerializer.deserialize(b)) for b in raw]
    same = all(
        [n for n, _ in d] == [n for n, _ in named]
        and all(t.dtype == e.dtype and torch.equal(t, e) for (_, t), (_, e) in zip(d, named))
        for d in decoded
    )
    return {"load_format": engines[0].load_format, "entries": len(blobs), "serialize_calls": len(serialized_calls),
            "decoded_equal": same, "base64_strings": all(isinstance(b, str) and base64.b64decode(b) for b in blobs),
            "embedded_reads_sglangs": _embedded_reads_sglang_payload(named)}


def _embedded_reads_sglang_payload(named) -> bool:
    """SGLang's own flattened bucket (its classes, its serializer) read by the embedded engine's restricted decoder.
    CPU storages by file name: SGLang sends CUDA tensors as IPC handles, which need no such setting."""
    import torch
    import torch.multiprocessing as mp

    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket
    from slime.backends.sglang_utils.flattened_bucket import decode_payload

    mp.set_sharing_strategy("file_system")
    bucket = FlattenedTensorBucket(named_tensors=named)
    blob = MultiprocessingSerializer.serialize({"flattened_tensor": bucket.get_flattened_tensor(),
                                                "metadata": bucket.get_metadata()}, output_str=True)
    decoded = decode_payload(blob)
    return [n for n, _ in decoded] == [n for n, _ in named] and all(
        t.dtype == e.dtype and torch.equal(t, e) for (_, t), (_, e) in zip(decoded, named))


def _decode_flattened(data: dict[str, Any]):
    """SGLang's own flattened-bucket handler, with the model's load_weights recording what it gets."""
    captured = []
    model = types.SimpleNamespace(load_weights=lambda weights: captured.extend(weights))
    fake = types.SimpleNamespace(model=model, get_model=lambda: model)
    handler = _flattened_bucket_handler()
    handler(fake, data)
    return [(n, t) for n, t in captured]


def _flattened_bucket_handler():
    try:
        from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

        return WeightUpdater._update_weights_from_flattened_bucket
    except (ImportError, AttributeError):
        from sglang.srt.model_executor.model_runner import ModelRunner

        return ModelRunner._update_weights_from_flattened_bucket


# What the rollout manager's progress watch reads (slime/ray/engines/progress.py): a snapshot as a scheduler
# holding 3 running and 2 waiting requests publishes it, with every work counter this release has set
LOADS_SNAPSHOT = {"dp_rank": 1, "num_running_reqs": 3, "num_waiting_reqs": 2, "num_used_tokens": 120,
                  "total_prefill_uncached_tokens": 40, "decode_moments": [5.0, 15.0, 1e5, 45.0, 3e5, 15.0]}


def check_loads() -> dict[str, Any]:
    """GET /v1/loads: whether the server mounts the route, and one entry of its JSON as SGLang's own snapshot
    class writes it (`to_dict` of the core section, as ?include=core asks)."""
    from sglang.srt.managers.load_snapshot import LoadSnapshot

    entrypoints = sglang_dir() / "srt" / "entrypoints"
    route = (entrypoints / "v1_loads.py").read_text()
    fields = set(LoadSnapshot.__struct_fields__)
    snapshot = LoadSnapshot(**{k: v for k, v in LOADS_SNAPSHOT.items() if k in fields})
    return {"mounted": '@router.get("/v1/loads")' in route and '"loads": loads' in route
            and "app.include_router(v1_loads_router)" in (entrypoints / "http_server.py").read_text(),
            "entry": snapshot.to_dict({"core"}), "set": sorted(k for k in LOADS_SNAPSHOT if k in fields)}


def _version() -> str:
    from sglang._version import __version__

    return __version__


def server_options() -> list[str]:
    """Every option string of SGLang's launch parser (what `--sglang-<name>` may name)."""
    return sorted(o for o in launch_parser()._option_string_actions if o.startswith("--"))


def main() -> None:
    if sys.argv[1:] == ["--server-options"]:  # tests/sglang_files.py --write-server-options
        json.dump({"version": _version(), "server_options": server_options()}, sys.stdout)
        return
    request = json.load(sys.stdin)
    import sglang.srt.managers.io_struct as io
    from sglang.srt.sampling.sampling_params import SamplingParams
    import msgspec

    report = {
        "version": _version(),
        "routes": routes(),
        "flush_cache_params": route_params("flush_cache"),
        "generate_fields": sorted(f.name for f in dataclasses.fields(io.GenerateReqInput)),
        "sampling_fields": sorted(f.name for f in msgspec.structs.fields(SamplingParams)),
        "bodies": check_bodies(request["bodies"], io),
        "launch": check_launch(request["launch"]),
        "env_readers": env_readers(request["env_names"]),
        "schema_gate": schema_gate() is not None,
        "gate_rejects": {name: gate_problems(body, schema_gate()) if schema_gate() else None
                         for name, body in request.get("gate_checks", {}).items()},
        "payload": check_payload(request["tp_size"]),
        "loads": check_loads(),
        # one GPU's entry of a /weights_checker answer (typed in 0.5.23; 0.5.15 passes a free dict)
        "checksum_answer": struct_problems(io.ChecksumInfo, request["checksum_answer"])
        if hasattr(io, "ChecksumInfo") else None,
        "server_options": server_options(),
        "stubbed": sorted({name.split(".")[0] for name in STUBBED}),
    }
    json.dump(report, sys.stdout, default=str)


if __name__ == "__main__":
    main()

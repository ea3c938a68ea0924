"""The control plane: the run's key on every route, POST for what changes state, bounded bodies, shared
buckets only from the run's own directory, no secret in logs or the wandb config, no port races."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import sys
import time
import types

import pytest
import requests
import torch

from arg_testing import no_real_sglang, parse_quiet  # noqa: F401 (fixture)
from rollout_testing import AppThread
from slime.backends.embedded_engine.engine import EmbeddedEngine
from slime.backends.embedded_engine.server import build_app
from slime.config import defaults_namespace
from slime.backends.sglang_utils.shared_payload import (
    LOAD_FORMAT as SHM_FORMAT,
)
from slime.backends.sglang_utils.shared_payload import (
    SharedPayloadError,
    make_run_directory,
    read_shared_bucket,
    run_directory,
    write_shared_bucket,
)
from slime.router.router import SlimeRouter, build_router_app
from slime.utils.security import (
    API_KEY_ENV,
    LIVENESS_PATHS,
    ApiKey,
    auth_headers,
    current_key,
    public_config,
    resolve_api_key,
)

pytestmark = pytest.mark.timeout(300)

# GET routes that only read; every other route changes state and takes POST only.
READ_ONLY = {"/health", "/health_generate", "/get_model_info", "/model_info", "/get_weight_version",
             "/get_server_info", "/server_info", "/get_weights_by_name", "/list_workers", "/v1/loads"}
NAMED = [("model.norm.weight", torch.arange(64, dtype=torch.float32))]  # the tiny model's hidden size
MINIMAL = ["--rollout-batch-size", "2", "--num-rollout", "1", "--actor-num-gpus-per-node", "1",
           "--train-backend-device", "cpu"]


# ----- the key ---------------------------------------------------------------------------------------------
def test_key_comes_from_the_flag_then_the_environment_then_chance():
    assert resolve_api_key("flag-key", {API_KEY_ENV: "env-key"}).reveal() == "flag-key"
    assert resolve_api_key(None, {API_KEY_ENV: "env-key"}).reveal() == "env-key"
    made = resolve_api_key(None, {})
    assert len(made.reveal()) >= 40 and made != resolve_api_key(None, {})
    assert made.reveal() not in repr(made) + str(made) + f"{made}"


def test_key_check_wants_the_bearer_header_and_the_exact_key():
    key = ApiKey("s3cret")
    assert key.accepts("Bearer s3cret") and key.accepts("bearer s3cret")
    for header in (None, "", "s3cret", "Bearer", "Bearer s3cre", "Bearer s3cretX", "Basic s3cret"):
        assert not key.accepts(header), header
    with pytest.raises(ValueError):
        ApiKey("two words")


def test_the_key_is_never_logged_nor_uploaded(tmp_path, caplog, monkeypatch):
    from slime.utils import metrics_logger

    config = tmp_path / "overrides.yaml"
    config.write_text("api-key: yaml-api-key-123\nwandb_key: yaml-wandb-key-456\n")
    with caplog.at_level(logging.DEBUG):
        args = parse_quiet(MINIMAL + ["--custom-config-path", str(config)])
    assert args.api_key.reveal() == "yaml-api-key-123"
    assert "yaml-api-key-123" not in caplog.text and "yaml-wandb-key-456" not in caplog.text
    assert "yaml-api-key-123" not in repr(vars(args))  # an args dump keeps the run's key hidden

    uploaded = {}
    fake_wandb = types.SimpleNamespace(login=lambda key: None, init=lambda **kw: uploaded.update(kw),
                                       log=lambda *a, **k: None)
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb)
    args.wandb_project = "p"
    metrics_logger._wandb_sink(args)
    text = json.dumps(uploaded["config"], default=str)
    assert "yaml-api-key-123" not in text and "yaml-wandb-key-456" not in text
    assert "api_key" not in public_config(args) and "wandb_key" not in public_config(args)
    json.dumps(uploaded["config"])  # plain data: the derived run config goes up as nested dicts
    assert uploaded["config"]["run_config"]["layout"] == dataclasses.asdict(args.run_config.layout)


def test_sglang_api_key_passthrough_is_refused(capsys):
    with pytest.raises(SystemExit):
        parse_quiet(MINIMAL + ["--sglang-api-key", "k"])
    assert "--api-key" in capsys.readouterr().err


def test_the_key_reaches_child_servers_by_private_file_or_environment_never_argv(monkeypatch, tmp_path):
    """SGLang gets the key in a 0600 --config file that is gone once it started; sglang-router (argv only) through a
    launcher that hands the environment's key to sglang-router's own parser inside its process."""
    from slime.backends.sglang_utils.launcher import private_key_config
    from slime.router import sglang_router_launch
    from slime.router.router import router_command

    key = current_key().reveal()
    with private_key_config() as path:
        folder = os.path.dirname(path)
        assert oct(os.stat(folder).st_mode & 0o777) == "0o700" and oct(os.stat(path).st_mode & 0o777) == "0o600"
        assert open(path).read() == f"api-key: {json.dumps(key)}\n"
    assert not os.path.exists(folder)

    args = defaults_namespace(use_slime_router=False)
    kind, command = router_command(args, "127.0.0.1", 30000, ["http://127.0.0.1:1"])
    assert kind == "sglang-router" and command[1:3] == ["-m", "slime.router.sglang_router_launch"]
    assert not any(key in token for token in command) and "--api-key" not in command
    seen = []
    monkeypatch.setattr("sglang_router.launch_router.launch_router", seen.append)
    sglang_router_launch.main(command[3:])  # what the launched process runs, with the run's key in its environment
    (router_args,) = seen
    assert router_args.api_key == key and router_args.worker_urls == ["http://127.0.0.1:1"]
    # its metrics listener on the run's host and a port of its own, not every interface's 29000 (one per node)
    assert router_args.prometheus_host == "127.0.0.1" and router_args.prometheus_port not in (29000, 30000)
    with pytest.raises(SystemExit, match="export SLIME_API_KEY"):
        sglang_router_launch.main([*command[3:], "--api-key", "typed"])


# ----- shared-memory buckets ---------------------------------------------------------------------------------
@pytest.fixture
def run_dir():
    key = ApiKey.generate()
    path = make_run_directory(key)
    yield path
    for child in path.iterdir():
        child.unlink()
    path.rmdir()


def test_run_directory_is_private_and_its_buckets_read_back(run_dir):
    assert oct(os.lstat(run_dir).st_mode & 0o777) == oct(0o700)
    shared = write_shared_bucket(NAMED, run_dir, "b0")
    assert oct(os.lstat(shared.path).st_mode & 0o777) == oct(0o600)
    (name, tensor), = read_shared_bucket(shared.descriptor, run_dir)
    assert name == NAMED[0][0] and torch.equal(tensor, NAMED[0][1])


def _descriptor_for(path, nbytes=256):
    return json.dumps({"path": str(path), "tensors": [["model.norm.weight", "float32", [64], 0, nbytes]]})


def test_a_path_outside_the_run_directory_is_refused(run_dir, tmp_path):
    outside = tmp_path / "secret.bin"
    outside.write_bytes(b"x" * 256)
    outside.chmod(0o600)
    for path in (outside, run_dir / ".." / "secret.bin", run_dir.parent / "secret.bin", "/etc/hostname"):
        with pytest.raises(SharedPayloadError, match="not a file of this run's directory"):
            read_shared_bucket(_descriptor_for(path), run_dir)


def test_a_symlink_inside_the_run_directory_is_refused(run_dir, tmp_path):
    outside = tmp_path / "secret.bin"
    outside.write_bytes(b"x" * 256)
    outside.chmod(0o600)
    (run_dir / "link.bin").symlink_to(outside)
    with pytest.raises(SharedPayloadError, match="plain file"):
        read_shared_bucket(_descriptor_for(run_dir / "link.bin"), run_dir)


def test_a_shared_file_not_private_to_the_run_is_refused(run_dir):
    loose = run_dir / "loose.bin"
    loose.write_bytes(b"x" * 256)
    loose.chmod(0o644)
    with pytest.raises(SharedPayloadError, match="private"):
        read_shared_bucket(_descriptor_for(loose), run_dir)
    run_dir.chmod(0o755)
    try:
        with pytest.raises(SharedPayloadError, match="mode 0700"):
            write_shared_bucket(NAMED, run_dir, "b1")
    finally:
        run_dir.chmod(0o700)


def test_a_restarted_trainer_removes_the_buckets_a_killed_sender_left(monkeypatch):
    """A sender killed mid-push never removes its bucket, and a restart reuses the run's directory (same key):
    the restarted actor ranks remove what is left before their first push."""
    from slime.ray.trainer.rank_actor import remove_stale_buckets

    key = ApiKey.generate()
    left = write_shared_bucket(NAMED, make_run_directory(key), "weights-dead-sender-bucket0")
    monkeypatch.setenv(API_KEY_ENV, key.reveal())  # the rank's key (use_key)
    try:
        remove_stale_buckets()
        assert not left.path.exists()
    finally:
        left.remove()
        run_directory(key).rmdir()


# ----- debug rollout data ----------------------------------------------------------------------------------
class _Opaque:
    pass


def test_debug_rollout_data_loads_without_unpickling_code(tmp_path):
    from slime.ray.rollout_manager.manager import load_debug_rollout

    plain = tmp_path / "plain.pt"
    torch.save({"rollout_id": 0, "samples": [{"tokens": [1, 2], "reward": 1.0, "status": "completed"}]}, plain)
    assert load_debug_rollout(str(plain))["samples"][0]["tokens"] == [1, 2]
    opaque = tmp_path / "opaque.pt"
    torch.save({"rollout_id": 0, "samples": [{"metadata": _Opaque()}]}, opaque)
    with pytest.raises(ValueError, match="plain data"):
        load_debug_rollout(str(opaque))


# ----- every route of the engine and the router ---------------------------------------------------------------
@pytest.fixture(scope="module")
def engine_server(small_run_inputs):
    app = build_app(EmbeddedEngine(str(small_run_inputs["checkpoint"]), seed=3), api_key=current_key(), max_request_bytes=64 * 1024)
    server = AppThread(app).start()
    yield app, f"http://127.0.0.1:{server.port}"
    server.stop()


@pytest.fixture(scope="module")
def router_server():
    app = build_router_app(SlimeRouter(api_key=current_key()))
    server = AppThread(app).start()
    yield app, f"http://127.0.0.1:{server.port}"
    server.stop()


def _routes(app) -> list[tuple[str, str]]:
    """(method, path) of every route the app serves (HEAD mirrors GET)."""
    return sorted({(r.method, r.resource.canonical) for r in app.router.routes() if r.method != "HEAD"})


@pytest.mark.parametrize("which, public", [("engine_server", LIVENESS_PATHS), ("router_server", ())])
def test_every_route_wants_the_key(which, public, request):
    """The route table is read from the app, so a route added later is covered without listing it here.
    The engine leaves open only what SGLang does (sglang-router probes /health without a key)."""
    app, url = request.getfixturevalue(which)
    routes = _routes(app)
    assert len(routes) >= 5
    for method, path in routes + [("GET", "/no_such_route"), ("POST", "/health")]:
        if path in public:
            continue
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": current_key().reveal()}):
            reply = requests.request(method, url + path, json={}, headers=headers, timeout=10)
            assert reply.status_code == 401, (method, path, headers, reply.status_code)
    for path in public:
        assert requests.get(url + path, timeout=60).status_code == 200
    assert requests.get(url + "/health", headers=auth_headers(), timeout=10).status_code == 200


@pytest.mark.parametrize("which", ["engine_server", "router_server"])
def test_state_changing_routes_take_post_only(which, request):
    app, url = request.getfixturevalue(which)
    routes = _routes(app)
    assert {path for method, path in routes if method == "GET"} <= READ_ONLY
    changing = {path for method, path in routes if method == "POST"} - READ_ONLY
    assert changing
    for path in changing:
        reply = requests.get(url + path, headers=auth_headers(), timeout=10)
        assert reply.status_code == 405, (path, reply.status_code)


def test_a_body_over_the_limit_is_refused(engine_server):
    _, url = engine_server
    body = {"input_ids": [1] * 40_000, "sampling_params": {"max_new_tokens": 1}}  # > 64 KiB of JSON
    assert requests.post(url + "/generate", json=body, headers=auth_headers(), timeout=30).status_code == 413


def test_engine_reads_no_file_outside_the_run_directory(engine_server, tmp_path):
    _, url = engine_server
    outside = tmp_path / "secret.bin"
    outside.write_bytes(b"\x01" * 256)
    outside.chmod(0o600)
    run_dir = make_run_directory(current_key())
    link = run_dir / f"link-{os.getpid()}.bin"
    link.symlink_to(outside)
    try:
        assert requests.post(url + "/begin_weight_update", json={}, headers=auth_headers(), timeout=10).ok
        for path in (outside, link):
            body = {"serialized_named_tensors": [_descriptor_for(path)], "load_format": SHM_FORMAT}
            reply = requests.post(url + "/update_weights_from_tensor", json=body, headers=auth_headers(), timeout=30)
            assert reply.status_code == 400 and "SharedPayloadError" in reply.text, reply.text
        shared = write_shared_bucket(NAMED, run_dir, f"ok-{os.getpid()}")
        body = {"serialized_named_tensors": [shared.descriptor], "load_format": SHM_FORMAT}
        assert requests.post(url + "/update_weights_from_tensor", json=body, headers=auth_headers(), timeout=30).ok
        shared.remove()
        values = requests.post(url + "/get_weights_by_name", json={"name": "model.norm.weight"},
                               headers=auth_headers(), timeout=10).json()
        assert values == NAMED[0][1].tolist()
    finally:
        link.unlink()
        requests.post(url + "/end_weight_update", json={}, headers=auth_headers(), timeout=10)
    assert run_directory(current_key()) == run_dir


# ----- ports -------------------------------------------------------------------------------------------------
@pytest.fixture
def busy_port():
    """A port another process holds: what a server would lose if it chose a port and bound it later."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        yield sock.getsockname()[1]


@pytest.fixture(scope="module")
def launched_engine(tmp_path_factory, small_run_inputs):
    """An embedded engine process started as a run starts it (port 0: the launcher binds the socket)."""
    from slime.backends.sglang_utils.launcher import launch_engine

    handle = launch_engine("embedded", defaults_namespace(seed=1), 0, 0, str(small_run_inputs["checkpoint"]),
                           startup_timeout_s=120, log_dir=str(tmp_path_factory.mktemp("launched")))
    yield handle
    handle.stop()


def test_launched_engine_serves_on_its_socket_and_wants_the_key(launched_engine):
    assert launched_engine.port != 0
    generate = {"text": "hi", "sampling_params": {"max_new_tokens": 1}}
    assert requests.post(launched_engine.url + "/generate", json=generate, timeout=30).status_code == 401
    assert requests.post(launched_engine.url + "/generate", json=generate, headers=auth_headers(), timeout=60).ok


@pytest.mark.parametrize("use_slime_router", [True, False], ids=["slime-router", "sglang-router"])
def test_routers_start_although_their_first_ports_are_taken(use_slime_router, launched_engine, busy_port,
                                                            monkeypatch, tmp_path):
    """Both routers in front of a real engine: they start though the ports picked first are taken, want the
    run's key from their callers and send it to the engine (sglang-router through its --api-key)."""
    from slime.router import router

    ports = iter([busy_port, busy_port])  # sglang-router: its first two picks are taken, the third is free
    free = router.find_free_port
    monkeypatch.setattr(router, "find_free_port", lambda host="127.0.0.1": next(ports, None) or free(host))
    args = defaults_namespace(use_slime_router=use_slime_router)
    handle = router.launch_router(args, [launched_engine.url], host="127.0.0.1", port=None, startup_timeout_s=60,
                                  log_dir=str(tmp_path))
    generate = {"text": "hi", "sampling_params": {"max_new_tokens": 1}}
    try:
        assert handle.port != busy_port
        assert requests.post(handle.url + "/generate", json=generate, timeout=30).status_code == 401
        deadline = time.monotonic() + 60  # sglang-router registers its workers in the background
        while (reply := requests.post(handle.url + "/generate", json=generate, headers=auth_headers(),
                                      timeout=60)).status_code == 503 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert reply.status_code == 200, reply.text
        with open(f"/proc/{handle.server.process.pid}/cmdline", "rb") as cmdline:  # what every local user can read
            assert current_key().reveal().encode() not in cmdline.read()
    finally:
        handle.stop()


def test_port_clash_retries_are_bounded_and_only_for_a_lost_port():
    from slime.utils.ports import PORT_ATTEMPTS, retry_port_clash

    calls = []

    def lost_port():
        calls.append(1)
        raise RuntimeError("server exited: OSError: [Errno 98] Address already in use")

    with pytest.raises(RuntimeError, match="Address already in use"):
        retry_port_clash(lost_port)
    assert len(calls) == PORT_ATTEMPTS
    calls.clear()

    def other_failure():
        calls.append(1)
        raise RuntimeError("model not found")

    with pytest.raises(RuntimeError, match="model not found"):
        retry_port_clash(other_failure)
    assert len(calls) == 1


def test_rendezvous_port_is_held_from_the_moment_it_is_offered(monkeypatch):
    from slime.backends.megatron_utils.parallel import join_rendezvous
    from slime.config.run_state import initial_run_state
    from slime.ray.trainer.rank_actor import TrainRayActor

    monkeypatch.setenv("SLIME_HOST_IP", "127.0.0.1")
    args = parse_quiet(MINIMAL)
    # the run state a rank receives for a run over several nodes (create_placement's): the node's address
    state = dataclasses.replace(initial_run_state(args), spans_nodes=True)
    rank0 = types.SimpleNamespace(args=args, run_state=state, world_size=2, _store=None)
    address, port = TrainRayActor.rendezvous_address(rank0)
    with socket.socket() as thief, pytest.raises(OSError):
        thief.bind(("127.0.0.1", port))  # no other process can take it before the ranks meet
    other = join_rendezvous(rank0.args, address, port, 2)
    other.set("rank1", "here")
    assert rank0._store.get("rank1") == b"here"

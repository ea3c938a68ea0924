"""Blocking HTTP client for an SGLang server (or the embedded engine, same API).

Every call has a timeout; a non-2xx answer raises EngineHTTPError carrying the server's
message, so a stuck or failing engine never blocks the caller silently. Every call carries the
run's key (slime/utils/security.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import requests

from slime.backends.sglang_utils import weight_checker
from slime.config.constants import DELTA_LOAD_FORMAT as DELTA_FORMAT
from slime.utils.deadlines import ENGINE_CALL_S, ENGINE_HTTP_CONTROL_S, ENGINE_MEMORY_CALL_S
from slime.utils.security import ApiKey, current_key


class EngineHTTPError(RuntimeError):
    def __init__(self, url: str, status: int | None, message: str) -> None:
        super().__init__(f"{url}: HTTP {status}: {message}")
        self.url = url
        self.status = status


@dataclass(frozen=True, kw_only=True)
class ClientTimeouts:
    """Seconds allowed per kind of call."""

    control: float = ENGINE_HTTP_CONTROL_S  # health, pause/continue, flush, info
    generate: float = ENGINE_CALL_S
    weight_update: float = ENGINE_CALL_S
    memory: float = ENGINE_MEMORY_CALL_S  # release/resume memory occupation


class SGLangHTTPClient:
    def __init__(self, base_url: str, timeouts: ClientTimeouts = ClientTimeouts(),
                 api_key: ApiKey | None = None) -> None:
        """api_key: default, this process's key (security.use_key)."""
        self.base_url = base_url.rstrip("/")
        self.timeouts = timeouts
        self._session = requests.Session()
        key = api_key or current_key()
        if key is not None:
            self._session.headers.update(key.headers())

    def close(self) -> None:
        self._session.close()

    # ----- plumbing ------------------------------------------------------------------------
    def _call(self, method: str, path: str, timeout: float, payload: dict[str, Any] | None = None) -> requests.Response:
        url = self.base_url + path
        try:
            response = self._session.request(method, url, json=payload, timeout=timeout)
        except requests.RequestException as exc:
            raise EngineHTTPError(url, None, f"{type(exc).__name__}: {exc}") from exc
        if response.status_code >= 300:
            raise EngineHTTPError(url, response.status_code, _error_message(response))
        return response

    def _json(self, method: str, path: str, timeout: float, payload: dict[str, Any] | None = None) -> Any:
        return self._call(method, path, timeout, payload).json()

    # ----- health and info ----------------------------------------------------------------------
    def health(self) -> bool:
        try:
            self._call("GET", "/health", self.timeouts.control)
        except EngineHTTPError:
            return False
        return True

    def wait_healthy(self, deadline_s: float, poll_s: float = 0.5) -> None:
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            if self.health():
                return
            time.sleep(poll_s)
        raise TimeoutError(f"{self.base_url} not healthy within {deadline_s:.0f}s")

    def health_generate(self) -> None:
        self._call("GET", "/health_generate", self.timeouts.generate)

    def model_info(self) -> dict[str, Any]:
        return self._json("GET", "/model_info", self.timeouts.control)

    def server_info(self) -> dict[str, Any]:
        return self._json("GET", "/server_info", self.timeouts.control)

    def weight_version(self) -> str:
        return self.model_info()["weight_version"]

    # ----- generation -----------------------------------------------------------------------------
    def generate(
        self,
        *,
        input_ids: list[int] | None = None,
        text: str | None = None,
        sampling_params: dict[str, Any] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int | None = None,
    ) -> Any:
        payload: dict[str, Any] = {"sampling_params": sampling_params or {}, "return_logprob": return_logprob}
        payload.update({"input_ids": input_ids} if input_ids is not None else {"text": text})
        if logprob_start_len is not None:
            payload["logprob_start_len"] = logprob_start_len
        return self._json("POST", "/generate", self.timeouts.generate, payload)

    def abort_all(self) -> None:
        self._call("POST", "/abort_request", self.timeouts.control, {"abort_all": True})

    # ----- control -----------------------------------------------------------------------------------
    def flush_cache(self, timeout_s: float | None = None) -> None:
        """Drop the engine's caches. SGLang refuses at once while requests run unless given `timeout`
        seconds to wait for the scheduler to go idle (defaults to this client's control timeout)."""
        wait_s = self.timeouts.control if timeout_s is None else timeout_s
        self._call("POST", f"/flush_cache?timeout={wait_s:g}", wait_s + self.timeouts.control)

    def pause_generation(self, mode: str = "abort") -> None:
        self._call("POST", "/pause_generation", self.timeouts.generate, {"mode": mode})

    def continue_generation(self) -> None:
        self._call("POST", "/continue_generation", self.timeouts.control, {})

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """tags None: every tag the engine has (SGLang: weights, kv_cache, cuda_graph)."""
        self._call("POST", "/release_memory_occupation", self.timeouts.memory, {"tags": tags})

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        self._call("POST", "/resume_memory_occupation", self.timeouts.memory, {"tags": tags})

    # ----- weight updates ------------------------------------------------------------------------
    def begin_weight_update(self) -> bool:
        """Open a weight-update session (SGLang >= 0.5.21 refuses tensor pushes without one).
        False when the engine has no such route (older SGLang: 404), which then needs none."""
        try:
            self._call("POST", "/begin_weight_update", self.timeouts.control, {})
        except EngineHTTPError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    def end_weight_update(self) -> None:
        self._call("POST", "/end_weight_update", self.timeouts.control, {})

    def update_weights_from_serialized(
        self,
        serialized_per_tp_rank: list[str],
        *,
        weight_version: str | None = None,
        flush_cache: bool = True,
        load_format: str | None = None,
    ) -> dict[str, Any]:
        """`/update_weights_from_tensor`: one serialized entry per engine TP rank."""
        payload = {
            "serialized_named_tensors": serialized_per_tp_rank,
            "load_format": load_format,
            "flush_cache": flush_cache,
            "weight_version": weight_version,
        }
        return self._json("POST", "/update_weights_from_tensor", self.timeouts.weight_update, payload)

    def update_weights_from_disk(self, model_path: str, weight_version: str | None = None) -> dict[str, Any]:
        payload = {"model_path": model_path, "weight_version": weight_version}
        return self._json("POST", "/update_weights_from_disk", self.timeouts.weight_update, payload)

    def init_weights_update_group(
        self, *, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str,
        backend: str,
    ) -> dict[str, Any]:
        """Join the trainer's weight-update group; returns once every member arrived."""
        payload = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        return self._json("POST", "/init_weights_update_group", self.timeouts.weight_update, payload)

    def update_weights_from_distributed(
        self, *, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str,
        weight_version: str | None = None, flush_cache: bool = True, delta: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Receive these tensors, in this order, from broadcasts on the group; returns once loaded.

        `delta` (the embedded engine): the broadcasts carry a delta (sglang_utils/weight_delta.py)."""
        payload = {
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "group_name": group_name,
            "flush_cache": flush_cache,
            "weight_version": weight_version,
        }
        if delta is not None:
            payload.update(load_format=DELTA_FORMAT, delta=delta)
        return self._json("POST", "/update_weights_from_distributed", self.timeouts.weight_update, payload)

    def destroy_weights_update_group(self, group_name: str) -> None:
        self._call("POST", "/destroy_weights_update_group", self.timeouts.control, {"group_name": group_name})

    def check_weights(self) -> dict[str, Any]:
        """`/weights_checker` checksum action: the answer as sent (sglang_utils/weight_checker.py reads it).
        The engine digests every tensor it holds: bounded like a weight update."""
        return self._json("POST", weight_checker.ROUTE, self.timeouts.weight_update, weight_checker.checksum_request())

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[Any]:
        payload = {"name": name, "truncate_size": truncate_size}
        return self._json("POST", "/get_weights_by_name", self.timeouts.control, payload)


def _error_message(response: requests.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text.strip()[:500]
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message"))
    return str(body)[:500]

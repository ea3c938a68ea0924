"""Blocking HTTP client for an SGLang server (or the embedded engine, same API).

Every call has a timeout; a non-2xx answer raises EngineHTTPError carrying the server's
message, so a stuck or failing engine never blocks the caller silently.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import requests
import torch

from slime.backends.sglang_utils.named_tensors import serialize_named_tensors


class EngineHTTPError(RuntimeError):
    def __init__(self, url: str, status: int | None, message: str) -> None:
        super().__init__(f"{url}: HTTP {status}: {message}")
        self.url = url
        self.status = status


@dataclass(frozen=True, kw_only=True)
class ClientTimeouts:
    """Seconds allowed per kind of call."""

    control: float = 30.0  # health, pause/continue, flush, info
    generate: float = 600.0
    weight_update: float = 600.0
    memory: float = 120.0  # release/resume memory occupation


class SGLangHTTPClient:
    def __init__(self, base_url: str, timeouts: ClientTimeouts = ClientTimeouts()) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeouts = timeouts
        self._session = requests.Session()

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
        return self._json("GET", "/get_model_info", self.timeouts.control)

    def server_info(self) -> dict[str, Any]:
        return self._json("GET", "/get_server_info", self.timeouts.control)

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
    ) -> Any:
        payload: dict[str, Any] = {"sampling_params": sampling_params or {}, "return_logprob": return_logprob}
        payload.update({"input_ids": input_ids} if input_ids is not None else {"text": text})
        return self._json("POST", "/generate", self.timeouts.generate, payload)

    def abort_all(self) -> None:
        self._call("POST", "/abort_request", self.timeouts.control, {"abort_all": True})

    # ----- control -----------------------------------------------------------------------------------
    def flush_cache(self) -> None:
        self._call("POST", "/flush_cache", self.timeouts.control)

    def pause_generation(self, mode: str = "abort") -> None:
        self._call("POST", "/pause_generation", self.timeouts.generate, {"mode": mode})

    def continue_generation(self) -> None:
        self._call("POST", "/continue_generation", self.timeouts.control, {})

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        self._call("POST", "/release_memory_occupation", self.timeouts.memory, {"tags": tags})

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        self._call("POST", "/resume_memory_occupation", self.timeouts.memory, {"tags": tags})

    def update_weights_from_tensor(
        self,
        named_tensors: list[tuple[str, torch.Tensor]],
        *,
        weight_version: str | None = None,
        flush_cache: bool = True,
    ) -> dict[str, Any]:
        """Push HF-named tensors in the project's format (embedded engine)."""
        return self.update_weights_from_serialized(
            [serialize_named_tensors(named_tensors)], weight_version=weight_version, flush_cache=flush_cache
        )

    def update_weights_from_serialized(
        self,
        serialized_per_tp_rank: list[str],
        *,
        weight_version: str | None = None,
        flush_cache: bool = True,
        load_format: str | None = None,
    ) -> dict[str, Any]:
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

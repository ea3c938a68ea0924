"""The run's API key: who may talk to the servers a run starts.

One key per run: `--api-key`, else $SLIME_API_KEY, else a random one the driver makes
(`secrets.token_urlsafe`). Every server the run starts requires it, as `Authorization: Bearer <key>`
(SGLang's header): the project's router on every route, the embedded engines on every route but the
liveness probes SGLang leaves open too (`LIVENESS_PATHS`), both through `require_api_key`; SGLang
engines and sglang-router through their own `--api-key`.
Every client of the project sends it (`auth_headers`). The key never reaches a log line, an argv
of the project's own servers (they read $SLIME_API_KEY) or the wandb config (`public_config`).

A process that talks to the run's servers adopts the key once (`use_key`): its HTTP clients then
send it, and the servers it starts inherit it through the environment.
"""
from __future__ import annotations

import dataclasses
import hmac
import os
import secrets
from typing import Any, Mapping

API_KEY_ENV = "SLIME_API_KEY"
"""Neither SGLang nor sglang-router reads the key from the environment (both take `--api-key` only);
this project's servers and driver do, so it stays off their command lines."""
SECRET_DESTS = ("api_key", "wandb_key")
"""Argument dests that hold secrets: never logged, never uploaded."""
_HIDDEN = "<hidden>"


class ApiKey:
    """A secret whose repr and str never show it (an args dump or a traceback stays clean)."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        if not isinstance(value, str) or not value.strip() or any(c.isspace() for c in value):
            raise ValueError("an API key must be a non-empty string without whitespace")
        self._value = value

    @classmethod
    def generate(cls) -> "ApiKey":
        return cls(secrets.token_urlsafe(32))

    def reveal(self) -> str:
        """The key itself: only for a header, a child's environment or an SGLang `--api-key`."""
        return self._value

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self._value}"}

    def accepts(self, authorization: str | None) -> bool:
        """Constant-time check of an `Authorization` header."""
        scheme, _, token = (authorization or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self._value.encode())

    def __repr__(self) -> str:
        return f"ApiKey({_HIDDEN})"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ApiKey) and hmac.compare_digest(self._value.encode(), other._value.encode())

    def __hash__(self) -> int:
        return hash(ApiKey)

    def __reduce__(self):  # Ray ships args to the actors: the key travels with them
        return (ApiKey, (self._value,))


def resolve_api_key(given: str | ApiKey | None, environ: Mapping[str, str] | None = None) -> ApiKey:
    """`--api-key`, else $SLIME_API_KEY, else a fresh random key (the driver calls this once)."""
    if isinstance(given, ApiKey):
        return given
    environ = os.environ if environ is None else environ
    value = given or environ.get(API_KEY_ENV)
    return ApiKey(value) if value else ApiKey.generate()


def use_key(key: ApiKey | str | None) -> None:
    """This process talks to the run's servers with `key` (the driver's `args.api_key`); servers it starts
    inherit it."""
    if key is None:
        raise ValueError("no API key: build the arguments with slime.utils.arguments.parse_args, which makes the "
                         "run's key, or pass --api-key")
    os.environ[API_KEY_ENV] = (key if isinstance(key, ApiKey) else ApiKey(key)).reveal()


def current_key() -> ApiKey | None:
    value = os.environ.get(API_KEY_ENV)
    return ApiKey(value) if value else None


def server_key() -> ApiKey:
    """The key a server started by the run must require (from $SLIME_API_KEY)."""
    key = current_key()
    if key is None:
        raise SystemExit(f"${API_KEY_ENV} is not set: this server answers only callers holding the run's key "
                         "(train.py sets it; to start a server by hand, export a key and send it as "
                         "'Authorization: Bearer <key>')")
    return key


def auth_headers() -> dict[str, str]:
    """The header every client of the run's servers sends ({} when this process has no key)."""
    key = current_key()
    return key.headers() if key is not None else {}


LIVENESS_PATHS = ("/health", "/health_generate")
"""What SGLang answers without its key (its auth exempts /health*): sglang-router probes workers there
without sending one, so an engine behind it must too. They say only "alive"."""


def require_api_key(key: ApiKey, public: tuple[str, ...] = ()):
    """aiohttp middleware: every route, unknown ones included, answers 401 without the key, except the
    exact paths in `public`."""
    from aiohttp import web  # here: most processes that hold the key serve nothing (~0.2 CPU-s to import)

    @web.middleware
    async def check_api_key(request: web.Request, handler) -> web.StreamResponse:
        if request.path not in public and not key.accepts(request.headers.get("Authorization")):
            return web.json_response({"error": {"message": "missing or wrong API key (send 'Authorization: "
                                                           "Bearer <the run's key>')"}}, status=401,
                                     headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)

    return check_api_key


DEFAULT_BUCKET_BYTES = 512 * 1024**2  # --update-weight-buffer-size's default
REQUEST_MARGIN_BYTES = 64 * 1024**2  # a /generate batch of long prompts, JSON overhead


def request_limit(bucket_bytes: int | None = None) -> int:
    """The largest request body an engine takes: one weight bucket in the portable in-body format (base64:
    4/3 of its bytes) plus a margin. A larger tensor travels as shared memory or a broadcast."""
    return -(-int(bucket_bytes or DEFAULT_BUCKET_BYTES) * 4 // 3) + REQUEST_MARGIN_BYTES


def public_config(args: Any) -> dict[str, Any]:
    """The run's arguments without their secrets (what wandb may upload); the derived run config as plain data (a
    function it holds, such as the estimator's loss term, by its qualified name)."""
    return {k: dataclasses.asdict(v, dict_factory=_plain_fields) if dataclasses.is_dataclass(v)
            and not isinstance(v, type) else v for k, v in vars(args).items() if k not in SECRET_DESTS}


def _plain_fields(items: list[tuple[str, Any]]) -> dict[str, Any]:
    return {k: f"{v.__module__}.{v.__qualname__}" if callable(v) else v for k, v in items}


def shown(dest: str, value: Any) -> Any:
    """`value` as a log line may show it."""
    return _HIDDEN if dest in SECRET_DESTS and value is not None else value
